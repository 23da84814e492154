"""scripts/bench_cache_length.py runs end to end in --quick mode and writes
well-formed output (timings are not asserted)."""

import importlib
import json

from tests.conftest import md_command


def test_bench_cache_length_quick(tmp_path):
  out, png = str(tmp_path / "bcl"), str(tmp_path / "bcl.png")
  argv = ["--quick", "--out", out, "--plot", png]
  importlib.import_module("scripts.bench_cache_length").main(argv)
  assert md_command(out + ".md") == "python scripts/bench_cache_length.py " + " ".join(argv)
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
  importlib.import_module("scripts.bench_cache_length").main(
      ["--render", out + ".json", "--out", out2, "--plot", str(tmp_path / "bcl2.png")])
  md2 = open(out2 + ".md").read()
  assert md_command(out2 + ".md") == md_command(out + ".md")
  assert "## Targets (issue 24)" in md2 and "speedup vs dense" in md2
  targets = json.load(open(out2 + ".json"))["results"]["targets"]
  assert {(t["case"], t["goal"]) for t in targets} == {("T=1", "<= 1.15"), ("T=4", "<= 1.15")}
