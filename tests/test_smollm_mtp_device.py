"""scripts/smollm_mtp_device.py (``make smollm-mtp-device``): the pure
planning helpers, and the command itself at tiny scale on the CPU, run in a
subprocess as a user would, on a tiny random target imported from a GGUF
file with a chat template (``tests.tiny_bpe``): the report's fields, the
modules file, a re-run that resumes (no answers generated again, training
from its checkpoint), a finished run that only re-reports, and a bad flag
(one line, exit status 2)."""

import json
import os
import subprocess
import sys

import jax
import pytest

from scripts import smollm_mtp_device as smd
from tests import tiny_bpe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, env_extra=None, timeout=300):
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  env.update(**(env_extra or {}))      # the backend the suite runs on (make test-gpu: cuda)
  return subprocess.run([sys.executable, "-m", "scripts.smollm_mtp_device", *args], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=timeout)


def test_planning_helpers():
  assert smd.part_sizes(20, 8) == [8, 8, 4] and smd.part_sizes(8, 8) == [8]
  assert smd.part_fits(10.0, 20.0, None) and smd.part_fits(10.0, 20.0, 10.0)
  assert not smd.part_fits(10.0, 20.0, 10.5)
  assert smd.steps_for_budget(100, 0.1, 10) == 810
  assert smd.steps_for_budget(5, 0.1, 10) == 1                # at least one step
  with pytest.raises(ValueError, match="step_s"):
    smd.steps_for_budget(100, 0.0, 10)
  assert smd.self_prompt_slice(list("abcde"), 1, 2) == ["c", "d"]
  assert smd.self_prompt_slice(list("abcde"), 2, 2) == ["e", "a"]   # cycles past the end
  assert smd.self_prompt_slice([], 0, 3) == []
  rows = [{"step": 2, "split": "train", "loss": 3.0},
          {"step": 4, "split": "train", "loss": 9.0},
          {"step": 4, "split": "train", "loss": 2.0},                # logged twice: later wins
          {"step": 4, "split": "eval", "mtp_1/teacher_agreement": 0.5,
           "mtp_2/teacher_agreement": 0.25, "mtp_1/accuracy": 0.4, "mtp_2/accuracy": 0.2}]
  c = smd.curve(rows, {"4": [1, 12.5]}, 2)
  assert c == [{"step": 2, "run": None, "wall_s": None, "train_loss": 3.0, "agreement": None,
                "accuracy": None},
               {"step": 4, "run": 1, "wall_s": 12.5, "train_loss": 2.0, "agreement": [0.5, 0.25],
                "accuracy": [0.4, 0.2]}]
  assert smd.STEP_LINE.match("step 15/100: loss 1.0") and smd.STEP_LINE.match("step 7: eval loss")


@pytest.mark.parametrize("flags, needle", [
    (["--budget_s", "5"], "--budget_s=5"),
    (["--gen_share", "0.95"], "--gen_share"),
    (["--batch_size", "0"], "--batch_size='0': must be auto or an integer in [1, 4096]"),
    (["--steps", "many"], "--steps"),
    (["--temperatures", "0,-1"], "--temperatures"),
    (["--eval_s", "300", "--budget_s", "300"], "--eval_s=300"),
])
def test_bad_flags_one_line_exit_2(flags, needle, tmp_path):
  r = _run(flags + ["--out", str(tmp_path / "x")], timeout=120)
  assert r.returncode == 2, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
  assert not os.path.exists(tmp_path / "x.json")


@pytest.mark.slow
def test_quick_run_reports_exports_and_resumes(tmp_path, data_dir):
  (tmp_path / "target").mkdir()
  base = tiny_bpe.import_tiny_workdir(str(tmp_path / "target"))
  out = str(tmp_path / "report")
  stage = str(tmp_path / "stage")
  parts = str(tmp_path / "data")
  # a budget far above the run: under load the deadline must not cut the 12 steps
  args = ["--quick", "--budget_s", "3600", "--base_workdir", base,
          "--init_workdir", str(tmp_path / "init"), "--workdir", stage, "--data_dir", parts,
          "--out", out, "--modules_out", str(tmp_path / "modules.safetensors")]
  env = {"MTP_DATA_DIR": data_dir}
  # 1: cut after step 5 (as an interruption would): a partial report
  r = _run(args + ["--stop_after_step", "5"], env)
  assert r.returncode == 0, r.stderr[-3000:]
  first = json.load(open(out + ".json"))
  meta, res = first["meta"], first["results"]
  assert {"commit", "jax_version", "backend", "device_kind", "date", "command"} <= set(meta)
  assert meta["backend"] == jax.default_backend() and res["status"] == "partial"
  assert res["train"]["step"] == 5 and res["train"]["num_steps"] == 12 and not res["train"]["done"]
  assert res["train"]["config"]["hidden_cache"] is False
  assert set(res["budget"]) >= {"budget_s", "gen_share", "generation_s", "train_s", "eval_s"}
  assert [p["name"] for p in res["generation"]["parts"]] == ["smollm_dev_p0"]
  assert res["generation"]["answer_tokens"] > 0
  part = os.path.join(parts, "smollm_dev_p0")
  part_mtime = os.path.getmtime(part)
  # 2: the same arguments resume: no answers generated, training from step 5 to 12
  r = _run(args, env)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "answered" not in r.stderr and "[generate] done in an earlier run" in r.stderr
  assert "resumed from" in r.stderr and "checkpoints/5" in r.stderr, r.stderr[-3000:]
  assert os.path.getmtime(part) == part_mtime
  res = json.load(open(out + ".json"))["results"]
  assert res["status"] == "complete" and res["train"]["step"] == 12 and res["train"]["done"]
  curve = res["curve"]
  steps = [c["step"] for c in curve]
  assert {5, 12} <= set(steps) and steps[-1] == 12      # the cut's step and the last
  assert {c["run"] for c in curve if c["step"] > 5} == {1}
  assert all(c["train_loss"] is not None and c["wall_s"] > 0 for c in curve)
  evals = [c for c in curve if c["agreement"] is not None]
  assert evals and all(len(c["agreement"]) == 3 for c in evals)      # D = 1, two recursive steps
  assert evals[-1]["step"] == 12
  held = res["heldout"]
  assert held["step"] == 12 and held["num_draft_tokens"] == 3
  for t in ("T0", "T1"):
    cats = held[t]["categories"]
    assert set(cats) == {"code", "math", "question_answering", "summarisation", "translation",
                         "writing"}
    assert all(len(v["alpha"]) == 3 and v["tau"] >= 1 for v in cats.values())
  m = res["modules"]
  assert m["under_16mb"] and m["step"] == 12 and 0 < os.path.getsize(m["path"]) == m["bytes"]
  assert len(res["runs"]) == 2
  # 3: finished: only re-reports
  r = _run(args, env)
  assert r.returncode == 0 and "re-reporting" in r.stderr, r.stderr[-3000:]
  again = json.load(open(out + ".json"))["results"]
  assert again["curve"] == curve and again["heldout"] == held and len(again["runs"]) == 3
