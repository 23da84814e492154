"""experiments/sweep_decode.py: sweep plan, end-to-end --quick run on the Markov
model, flag errors (timings are not asserted)."""

import json
import os

import pytest

from tests.conftest import md_command
from tests.test_scripts import _experiment


@pytest.fixture(scope="module")
def sweep():
  return _experiment("sweep_decode")


def test_sweep_points_move_one_axis_around_the_base(sweep):
  base = {"domain": "code", "temperature": 1.0, "top_p": 1.0, "batch_size": 1}
  plan = sweep.sweep_points(base, [0.0, 0.7, 1.0], [1.0, 0.9], [1, 4], [0.0, 1.0], ["code", "prose"])
  assert set(plan) == set(sweep.SWEEPS)
  assert len(plan["temperature"]) == 6 and len(plan["batch"]) == 4 and len(plan["top_p"]) == 2
  axes = {"temperature": {"temperature", "domain"}, "top_p": {"top_p"},
          "batch": {"batch_size", "temperature"}, "domain": {"domain", "temperature"}}
  for name, pts in plan.items():
    for p in pts:
      assert {k for k in base if p[k] != base[k]} <= axes[name], (name, p)
  unique = {sweep.point_key(p) for pts in plan.values() for p in pts}
  # shared settings are measured once: 6 (T x domain) + top_p 0.9 + B=4 at T=0,1
  assert len(unique) == 6 + 1 + 2


@pytest.mark.slow
def test_sweep_decode_quick(sweep, markov_workdir, data_dir, tmp_path):
  out = str(tmp_path / "sd")
  sweep.main(["--workdir", markov_workdir, "--data_dir", data_dir, "--quick", "--out", out])
  report = json.load(open(out + ".json"))
  meta, sweeps = report["meta"], report["results"]
  assert {"commit", "jax_version", "device_kind", "cpu_count", "date", "config", "command"} <= set(meta)
  assert meta["num_draft_tokens"] == [2] and meta["base"]["temperature"] == 1.0
  assert set(sweeps) == set(sweep.SWEEPS)
  domains = ["python_stdlib", "python_docs"]
  expected = {
      "temperature": {(d, t, 1.0, 1) for d in domains for t in (0.0, 1.0)},
      "top_p": {("python_stdlib", 1.0, p, 1) for p in (1.0, 0.9)},
      "batch": {("python_stdlib", t, 1.0, b) for t in (0.0, 1.0) for b in (1, 2)},
      "domain": {(d, t, 1.0, 1) for d in domains for t in (0.0, 1.0)},
  }
  for name, rows in sweeps.items():
    for method in ("ar", "mtp"):
      got = {(r["domain"], r["temperature"], r["top_p"], r["batch_size"]) for r in rows
             if r["method"] == method}
      assert got == expected[name], (name, method)
    for r in rows:
      assert r["speedup"] > 0 and r["tokens_per_s"] > 0
      if r["method"] == "ar":
        assert r["tau"] == 1.0 and r["speedup"] == 1.0 and r["acceptance_rate_per_position"] == []
      else:
        g = r["num_draft_tokens"]
        assert 1.0 <= r["tau"] <= g + 1
        assert len(r["acceptance_rate_per_position"]) == g
        assert all(a is None or 0 <= a <= 1 for a in r["acceptance_rate_per_position"])
        assert r["draft_cost_ratio_c"] > 0 and r["ideal_speedup"] > 0 and r["draft_cost_ratio_c_flops"] > 0
        assert sum(r["accepted_length_histogram"]) >= r["batch_size"] * meta["repeats"]
  # the same setting is measured once and reported identically in every sweep that has it
  key = lambda r: (r["domain"], r["temperature"], r["top_p"], r["batch_size"], r["method"])
  t_rows = {key(r): r for r in sweeps["temperature"]}
  for r in sweeps["domain"]:
    assert r["wall_s_median"] == t_rows[key(r)]["wall_s_median"]
  md = open(out + ".md").read()
  assert all(f"## {name}" in md for name in sweep.SWEEPS)
  assert md_command(out + ".md") == meta["command"] == " ".join([
      "python -m experiments.sweep_decode --workdir", markov_workdir, "--data_dir", data_dir,
      "--quick --out", out])
  table_rows = [l for l in md.splitlines() if l.startswith("| ") and not l.startswith("| domain")]
  assert len(table_rows) == sum(len(rows) for rows in sweeps.values())
  for what in ("temperature", "batch"):
    size = os.path.getsize(f"{out}_{what}.png")
    assert 5_000 < size < 150_000


@pytest.mark.parametrize("flag,value", [("--temperatures", "0,-1"), ("--top_ps", "1.5"),
                                        ("--batch_sizes", "0"), ("--repeats", "0"),
                                        ("--forms", "loop")])
def test_sweep_decode_bad_flags_name_the_flag(sweep, flag, value, capsys, tmp_path):
  with pytest.raises(SystemExit):
    sweep.main(["--workdir", str(tmp_path), flag, value, "--out", str(tmp_path / "x")])
  assert flag in capsys.readouterr().err
