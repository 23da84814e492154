"""experiments/bench_cache_length.py runs end to end in --quick mode and writes
well-formed output (timings are not asserted)."""

import importlib
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import md_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.cpu_only
def test_bench_cache_length_quick(tmp_path):
  """Runs the script as a user does, in a process of its own: in the
  suite's long-lived xdist worker, compiling its fori_loop of backbone steps
  segfaulted inside jaxlib three times (full runs of 2026-12-03 here, the
  CI run before 2026-12-04 and .ci/run here that day), never in 8 runs of
  this test alone (tests/crash_rerun.py reran it)."""
  out, png = str(tmp_path / "bcl"), str(tmp_path / "bcl.png")
  argv = ["--quick", "--out", out, "--plot", png]
  r = subprocess.run([sys.executable, "-m", "experiments.bench_cache_length", *argv], cwd=REPO,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert md_command(out + ".md") == "python -m experiments.bench_cache_length " + " ".join(argv)
  report = json.load(open(out + ".json"))
  assert {"commit", "jax_version", "device_kind", "cpu_count", "date", "machine_note"} <= set(report["meta"])
  res = report["results"]
  cells = {(r["impl"], r["cache_slots"], r["T"]) for r in res["steps"]}
  assert cells == {(i, s, t) for i in ("dense", "blockwise") for s in (64, 256) for t in (1, 4)}
  assert all(r["step_s"]["min"] > 0 for r in res["steps"])
  assert {r["kind"] for r in res["step_ratios"]} == {"vs_smallest_cache", "speedup_vs_dense"}
  gen = res["generation"]
  assert {(r["method"], r["impl"]) for r in gen} == {(m, i) for m in ("ar", "mtp")
                                                     for i in ("dense", "blockwise/128")}
  for r in gen:    # EOS never wins greedily, both implementations emit the same tokens
    assert r["emitted"] == r["new_tokens"] and r["tokens_equal"] and r["tokens_per_s"] > 0
  assert len(res["generation_speedups"]) == len(gen) // 2
  md = open(out + ".md").read()
  assert "## (a) Step cost" in md and "## (b) End-to-end tokens/s" in md and "## Targets" in md
  assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  # --render rewrites the report (with the targets table) from the JSON alone
  out2 = str(tmp_path / "bcl2")
  importlib.import_module("experiments.bench_cache_length").main(
      ["--render", out + ".json", "--out", out2, "--plot", str(tmp_path / "bcl2.png")])
  md2 = open(out2 + ".md").read()
  assert md_command(out2 + ".md") == md_command(out + ".md")
  assert "## Targets (issue 24)" in md2 and "speedup vs dense" in md2
  targets = json.load(open(out2 + ".json"))["results"]["targets"]
  assert {(t["case"], t["goal"]) for t in targets} == {("T=1", "<= 1.15"), ("T=4", "<= 1.15")}


def test_generation_on_a_bpe_workdir_runs_to_the_budget_with_the_same_tokens(tmp_path):
  """Part (b) on a trained/imported BPE workdir (``--workdir``): every variant
  holds the workdir's parameters, the stop ids are never emitted (so each
  generation is exactly its budget), prompts are real text of the asked
  length, and dense and blockwise emit the same tokens."""
  import numpy as np
  import pytest
  from experiments import bench_cache_length as bc
  from tests import tiny_bpe
  wd = tiny_bpe.import_tiny_workdir(str(tmp_path), mtp_depth=1)
  models, tk = bc.workdir_models(wd, bc.impl_variants(["dense", "blockwise"], [16]), 128)
  assert set(models) == {"dense", "blockwise/16"}
  a, b = (np.asarray(m.embed.embedding[...]) for m in models.values())
  np.testing.assert_array_equal(a, b)
  p = bc.text_prompt(tk, 40, seed=3)
  assert p.shape == (40,) and p.dtype == np.int32 and tk.stop_ids[0] not in p.tolist()
  rows = bc.generation_speed(models, ["mtp"], [(40, 24)], 1, log=None,
                             prompt_fn=lambda n, seed: bc.text_prompt(tk, n, seed), tokenizer=tk)
  assert len(rows) == 2
  for r in rows:
    assert r["emitted"] == 24 and r["tokens_equal"], r
  with pytest.raises(ValueError, match="max_seq_len"):
    bc.workdir_models(wd, [("dense", None)], 10 ** 6)
