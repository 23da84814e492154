"""Benchmarks run end to end on tiny sizes and write well-formed output
(timings are not asserted: they belong to the scripts, not the tests)."""

import importlib.util
import json
import os
import sys

import pytest


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod            # dataclasses look their module up
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture(scope="module")
def workdir(markov_workdir):
  return markov_workdir


def test_bench_decode_quick(workdir, data_dir, tmp_path):
  out = str(tmp_path / "bd")
  _script("bench_decode").main(["--workdir", workdir, "--quick", "--data_dir", data_dir,
                                "--draft_workdir", workdir, "--out", out])
  report = json.load(open(out + ".json"))
  assert {"commit", "jax_version", "device_kind", "cpu_count", "date", "config"} <= set(report["meta"])
  names = {(r["method"], r["form"], r["temperature"]) for r in report["results"]}
  assert ("ar", "while", 0.0) in names and ("mtp", "stream", 1.0) in names and ("draft", "while", 1.0) in names
  for r in report["results"]:
    assert r["tokens_per_s"] > 0 and r["tau"] >= 1
    if r["method"] != "ar":
      assert r["ideal_speedup"] > 0 and r["efficiency"] > 0
      assert 0 < r["draft_cost_ratio_c_flops"] < 5
  md = open(out + ".md").read().splitlines()
  main_table = md[md.index(next(l for l in md if l.startswith("| T | B |"))) + 2:]
  rows = [l for l in main_table if l.startswith("| ")]
  assert len(rows) == len(report["results"])
  bare = report["meta"]["bare_forward_in_loop_s_by_batch"]["1"]
  assert set(bare) == {"1", "2"} and all(v > 0 for v in bare.values())
  assert any(l.startswith("| 1 | ") for l in md[:md.index(next(l for l in md if l.startswith("| T | B |")))])


def test_bench_train_quick(tmp_path):
  out = str(tmp_path / "bt")
  _script("bench_train").main(["--config", os.path.join(REPO, "configs/tiny.py"), "--quick",
                               "--depths", "0,1", "--out", out])
  rows = json.load(open(out + ".json"))["results"]
  assert [r["depth"] for r in rows] == [0, 1]
  assert rows[0]["time_ratio"] == 1.0 and rows[1]["flop_ratio"] > 1.0


def test_bench_draft_cost_quick(tmp_path):
  out = str(tmp_path / "dc")
  _script("bench_draft_cost").main(["--config", os.path.join(REPO, "configs/tiny.py"), "--quick",
                                    "--layers", "1,4", "--out", out])
  rows = json.load(open(out + ".json"))["results"]
  assert [r["layers"] for r in rows] == [1, 4]
  # one module next to 1 layer costs more of a target step than next to 4 layers
  assert rows[0]["c_flops"] > rows[1]["c_flops"] > 0
  assert all(r["c"] > 0 for r in rows) and os.path.getsize(out + ".png") < 150_000
