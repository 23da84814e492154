"""scripts/device_check.py: its pure parts (device-kind slug, peak FLOP/s
and MFU arithmetic, the time budget, pytest's output, the test subset) and
its ``--quick`` dry run end to end, which CI runs in place of a machine
with an accelerator (the full check needs one: docs/testing.md)."""

import json
import os
import re
import subprocess
import sys

import pytest

from scripts import device_check as dc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "device_check.py")


def _run(args, tmp_path, timeout=240):
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=timeout)


def test_kind_slug_and_platform_value():
  assert dc.kind_slug("NVIDIA H200") == "nvidia_h200"
  assert dc.kind_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
  assert dc.kind_slug("TPU v5 lite") == "tpu_v5_lite"
  assert dc.kind_slug("cpu") == "cpu" and dc.kind_slug("") == "unknown"
  assert dc.jax_platforms_value("gpu", "cuda 13000") == "cuda"
  assert dc.jax_platforms_value("gpu", "rocm 6.2") == "rocm"
  assert dc.jax_platforms_value("tpu") == "tpu" and dc.jax_platforms_value("cpu") == "cpu"


def test_peak_flops_per_kind_and_dtype():
  assert dc.peak_flops("NVIDIA H200", "bfloat16") == pytest.approx(989.5e12)
  assert dc.peak_flops("NVIDIA H200", "float32") == pytest.approx(67e12)
  assert dc.peak_flops("NVIDIA H200 NVL", "bfloat16") == pytest.approx(835.5e12)
  assert dc.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == pytest.approx(989.5e12)
  assert dc.peak_flops("NVIDIA H100 PCIe", "float32") == pytest.approx(51e12)
  assert dc.peak_flops("TPU v5 lite", "bfloat16") == pytest.approx(197e12)
  assert dc.peak_flops("TPU v5 lite", "float32") is None
  assert dc.peak_flops("cpu", "bfloat16") is None
  assert dc.peak_flops("NVIDIA GeForce GTX 1080", "float32") is None


def test_train_flops_and_utilisation_by_hand():
  # d 4, V 10, 2 layers, 2 heads of 2, T 8, one MTP module, 100 parameters, tied:
  # N = 100 + 1 * 4 * 10 = 140 -> 6 N = 840; 12 * (2 + 1) * 2 * 2 * 8 = 1152
  model = dict(d_model=4, vocab_size=10, num_layers=2, num_heads=2, head_dim=2,
               tie_embeddings=True)
  assert dc.train_flops_per_token(model, 1, 8, 100) == 840 + 1152
  # untied: the input table (40) is a lookup, not a matmul
  assert dc.train_flops_per_token(dict(model, tie_embeddings=False), 1, 8, 140) == 840 + 1152
  assert dc.train_flops_per_token(model, 0, 8, 100) == 600 + 12 * 2 * 2 * 2 * 8
  assert dc.utilisation(1e12, 0.5, 4e12) == pytest.approx(0.5)
  assert dc.utilisation(1e12, 0.5, None) is None and dc.utilisation(None, 0.5, 1.0) is None
  assert dc.utilisation(1e12, 0.0, 1e12) is None
  # SmolLM2-135M's size at T 512: 6 N dominates; ~0.9 GFLOP per token
  cfg = dc.train_config(False, 16, 512, "bfloat16")
  from scripts.draft_models import param_count
  params = param_count(cfg)["total"]
  assert 130e6 < params < 160e6
  per_token = dc.train_flops_per_token(dc.SMOLLM2_135M, 1, 512, params)
  assert 0.8e9 < per_token < 1.3e9


def test_budget_skips_what_no_longer_fits():
  now = [100.0]
  b = dc.Budget(60, start=100.0, clock=lambda: now[0])
  assert b.left() == 60 and b.skip_reason("tests", 30, reserve_s=20) is None
  now[0] = 115.0
  reason = b.skip_reason("tests", 30, reserve_s=20)
  assert reason.startswith("time budget: 25 s of --budget_s=60 left after 20 s kept")
  assert "tests needs about 30 s" in reason
  assert b.skip_reason("hf", 20) is None
  now[0] = 200.0
  assert "0 s of --budget_s=60 left" in b.skip_reason("hf", 20)


XDIST_LOG = """\
4 workers [6 items]
[gw0] [ 16%] PASSED tests/test_sampling.py::test_single_round_laws[G1_hand]
[gw1] [ 33%] FAILED tests/test_decode.py::test_mtp_greedy_equals_ar[2]
[gw0] [ 50%] SKIPPED tests/test_precision.py::test_x
[gw2] [ 66%] PASSED tests/test_stops.py::test_y
[gw2] [ 66%] ERROR tests/test_stops.py::test_y
=========================== short test summary info ============================
FAILED tests/test_decode.py::test_mtp_greedy_equals_ar[2] - AssertionError: differ at 7
ERROR tests/test_stops.py::test_y - RuntimeError: teardown
"""


def test_parse_pytest_output_with_and_without_xdist():
  r = dc.parse_pytest_output(XDIST_LOG)
  assert (r["selected"], r["passed"], r["failed"], r["errors"], r["skipped"]) == (6, 1, 1, 1, 1)
  assert r["finished"] == 4 and r["not_run"] == 2
  assert r["failing"] == [{"node": "tests/test_decode.py::test_mtp_greedy_equals_ar[2]",
                           "message": "AssertionError: differ at 7"},
                          {"node": "tests/test_stops.py::test_y",
                           "message": "RuntimeError: teardown"}]
  cut = ("collected 9 items / 5 deselected / 4 selected\n"
         "tests/test_sampling.py::test_a PASSED                [ 25%]\n"
         "tests/test_sampling.py::test_b[x] PASSED             [ 50%]\n")
  r = dc.parse_pytest_output(cut)
  assert (r["selected"], r["passed"], r["not_run"], r["failing"]) == (4, 2, 2, [])
  assert dc.parse_pytest_output("")["selected"] is None


def test_the_chosen_tests_exist():
  """Every name in DEVICE_TESTS / QUICK_TESTS is a test in its file (a
  renamed test would silently leave the device check's subset)."""
  for tests in (dc.DEVICE_TESTS, dc.QUICK_TESTS):
    for path, names in tests.items():
      text = open(os.path.join(REPO, path)).read()
      for name in names:
        assert re.search(rf"^def {re.escape(name)}\w*\(", text, re.M), (path, name)
  expr = dc.keyword_expression(dc.QUICK_TESTS)
  assert expr.split(" or ")[0] == "test_single_round_laws" and expr.count(" or ") == 2


def test_agreement_with_ar_and_the_near_tie_verdict():
  from types import SimpleNamespace as NS

  import numpy as np
  _, model = dc.tiny_target()
  gens = lambda *rows: [NS(tokens=[np.array(r, np.int32) for r in rows])]
  prompt = np.array([1, 100, 101, 102], np.int32)
  rows_of = lambda r: [prompt] * 6
  ar = NS(gens=gens(*[[5, 6, 7]] * 6))
  same = dc.agreement(ar, NS(gens=gens(*[[5, 6, 7]] * 6)), rows_of, model)
  assert same == {"identical_to_ar": True, "rows_differing": 0, "first_divergence": None,
                  "near_tie_checks": [], "bug": False}
  other = NS(gens=gens([5, 6, 7], [5, 9, 7], [5, 6], *[[8, 6, 7]] * 3))
  got = dc.agreement(ar, other, rows_of, model, checks=3)
  assert got["rows_differing"] == 5 and got["first_divergence"] == 0
  checks = got["near_tie_checks"]
  assert [(c["row"], c["index"]) for c in checks] == [(1, 1), (2, 2), (3, 0)]
  for c in checks:
    assert c["gap"] >= 0 and c["bound"] > 0 and c["near_tie"] == (c["gap"] < c["bound"])
  assert got["bug"] == any(not c["near_tie"] for c in checks)


def test_finite_and_bad_flags(tmp_path):
  assert dc.finite({"a": float("nan"), "b": [1.0, float("inf")], "c": 2}) == \
      {"a": None, "b": [1.0, None], "c": 2}
  for args, flag in ((["--budget_s", "5"], "--budget_s"), (["--parts", "tests,gpu"], "--parts"),
                     (["--num_draft_tokens", "1,17"], "--num_draft_tokens"),
                     (["--dtypes", "float16"], "--dtypes")):
    r = _run(args, tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("device_check.py: error: " + flag) or flag in last, last


@pytest.mark.cpu_only
def test_a_cpu_only_machine_is_refused_in_one_line(tmp_path):
  r = _run(["--out", str(tmp_path / "x")], tmp_path, timeout=120)
  assert r.returncode == 2
  err = r.stderr.strip().splitlines()
  assert len(err) == 1 and "only JAX backend here is the CPU" in err[0] and "--quick" in err[0]
  assert not os.path.exists(tmp_path / "x.json")


def test_run_part_skips_what_the_budget_cannot_fit_and_records_errors(tmp_path):
  import argparse
  now = [0.0]
  args = argparse.Namespace(parts=list(dc.PARTS), quick=False)
  ctx = dc.Context(args=args, budget=dc.Budget(200, start=0.0, clock=lambda: now[0]),
                   out=str(tmp_path / "device"), meta={"command": "python scripts/device_check.py"},
                   results={"device": {"kind": "cpu"}, "parts": {}})
  ran = []

  def ok(ctx, rec, deadline):
    ran.append(deadline)
    rec["rows"] = [1]

  def boom(ctx, rec, deadline):
    raise RuntimeError("no device\nsecond line")

  def missing(ctx, rec, deadline):
    raise dc.PartSkipped("torch not installed")
  now[0] = 10.0     # 190 s left: tests need 30 and keep 45 + 25 + 20 for decode, train, hf
  dc.run_part(ctx, "tests", ok)
  assert ran == [200 - 90] and ctx.results["parts"]["tests"]["status"] == "ok"
  now[0] = 150.0    # 50 s left: decode needs 45 and keeps 45 for train and hf
  dc.run_part(ctx, "decode", ok)
  p = ctx.results["parts"]["decode"]
  assert p["status"] == "skipped" and p["reason"].startswith("time budget: 5 s of --budget_s=200")
  dc.run_part(ctx, "train", boom)
  p = ctx.results["parts"]["train"]
  assert p["status"] == "error" and p["error"] == "RuntimeError: no device" and p["traceback_tail"]
  dc.run_part(ctx, "hf", missing)
  assert ctx.results["parts"]["hf"]["status"] == "skipped"
  assert ctx.results["parts"]["hf"]["reason"] == "torch not installed"
  args.parts = ["tests"]
  dc.run_part(ctx, "hf", ok)
  assert ctx.results["parts"]["hf"] == {"status": "skipped", "reason": "not in --parts=tests"}
  assert len(ran) == 1
  doc = json.load(open(tmp_path / "device.json"))
  assert doc["results"]["parts"]["decode"]["status"] == "skipped"
  assert "| decode | skipped |" in open(tmp_path / "device.md").read()


def test_the_watchdog_writes_the_report_then_ends_the_process(tmp_path, monkeypatch):
  import argparse
  exits = []
  monkeypatch.setattr(dc.os, "_exit", exits.append)
  ctx = dc.Context(args=argparse.Namespace(parts=list(dc.PARTS), quick=True),
                   budget=dc.Budget(10, start=0.0, clock=lambda: 10 + dc.HARD_GRACE_S + 1),
                   out=str(tmp_path / "device"), meta={"command": "python scripts/device_check.py"},
                   results={"device": {"kind": "cpu"}, "parts": {"tests": {"status": "ok"}}})
  ctx.current = "decode"
  dc.start_watchdog(ctx).join(timeout=30)
  assert exits == [124]
  res = json.load(open(tmp_path / "device.json"))["results"]
  assert res["parts"]["decode"]["status"] == "cut_off" and res["watchdog"].startswith("ended at")
  assert res["parts"]["tests"] == {"status": "ok"}


def test_quick_dry_run(tmp_path):
  """--quick end to end: every part ran (hf skips without torch), the JSON
  and markdown hold the device, provenance and each part's rows; greedy
  MTP equals AR in float32."""
  out = str(tmp_path / "device")
  r = _run(["--quick", "--out", out], tmp_path)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert r.stdout.startswith("device: ")
  doc = json.load(open(out + ".json"))
  meta, res = doc["meta"], doc["results"]
  assert {"commit", "dirty", "datetime_utc", "host", "jax_version", "jaxlib_version",
          "flax_version", "command", "budget_s"} <= set(meta)
  assert meta["command"].startswith("python scripts/device_check.py --quick")
  assert res["device"]["slug"] == dc.kind_slug(res["device"]["kind"])
  assert res["verdict"] == "ok" and res["elapsed_s"] < meta["budget_s"]
  parts = res["parts"]
  for name in ("tests", "decode", "train"):
    assert parts[name]["status"] == "ok" and parts[name]["wall_s"] > 0, (name, parts[name])
  t = parts["tests"]
  assert t["passed"] == t["selected"] >= 3 and t["failed"] == 0 and t["not_run"] == 0
  assert os.path.isfile(out + ".pytest.log")
  rows = parts["decode"]["rows"]
  assert {(r["label"], r["dtype"]) for r in rows} >= {("ar", "float32"), ("mtp_G1", "float32")}
  for r in rows:
    assert r["tokens_per_s"] > 0 and r["tau"] >= 1
  assert all(r["identical_to_ar"] for r in rows if r["dtype"] == "float32" and r["label"] != "ar")
  large = [r for r in rows if r.get("large_batch")]      # the generator's shape, AR at T = 1
  assert {(r["label"], r["batch_size"], r["temperature"]) for r in large} == {("ar", 4, 1.0)}
  train = parts["train"]["rows"]
  assert {r["dtype"] for r in train} == {"bfloat16", "float32"}
  assert all(r["tokens_per_s"] > 0 and r["model_flops_per_step"] > 0 for r in train)
  if parts["hf"]["status"] == "skipped":
    assert "not installed" in parts["hf"]["reason"]
  md = open(out + ".md").read()
  assert md.startswith("Command: `python scripts/device_check.py --quick")
  for heading in ("| part | status | wall s | note |", "## Correctness tests", "## Decoding",
                  "## Train step"):
    assert heading in md
