"""Training loop: it learns, exact resume, SIGTERM, workdir safety, checkpoints."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mtp import checkpoint as ckpt_lib
from mtp.config import ConfigError
from mtp.data import DataError
from tests.conftest import tiny_config
from train.loop import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(data_dir, **sections):
  return tiny_config(data=dict(data_dir=data_dir), **sections)


def _train_losses(workdir):
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  out = {}
  for r in rows:                     # later lines win (re-run steps after a resume)
    if r["split"] == "train":
      out[r["step"]] = r["loss"]
  return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_dir):
  workdir = str(tmp_path_factory.mktemp("run_full"))
  result = train(_cfg(data_dir), workdir)
  return workdir, result


def test_learns_and_writes_workdir(uninterrupted):
  workdir, result = uninterrupted
  losses = _train_losses(workdir)
  assert result["step"] == 6 and sorted(losses) == [2, 4, 6]
  assert losses[6] < losses[2]
  assert {"main/loss", "main/bits_per_byte", "mtp_1/accuracy", "mtp_2/loss"} <= set(result["eval"])
  for name in ("config.json", "metrics.jsonl", "final_metrics.json", "tensorboard"):
    assert os.path.exists(os.path.join(workdir, name)), name
  assert ckpt_lib.Checkpointer(workdir, read_only=True).all_steps() == [3, 6]


def test_killed_and_resumed_run_reproduces_losses(uninterrupted, tmp_path, data_dir):
  workdir, _ = uninterrupted
  resumed = str(tmp_path / "resumed")
  first = train(_cfg(data_dir), resumed, stop_after=3)       # "killed" after step 3
  assert first["step"] == 3 and not os.path.exists(os.path.join(resumed, "final_metrics.json"))
  with open(os.path.join(resumed, "metrics.jsonl"), "a") as f:   # rows a killed run left behind
    f.write(json.dumps({"step": 5, "split": "train", "loss": -1.0}) + "\n")
  second = train(_cfg(data_dir), resumed)                    # same command again
  assert second["step"] == 6
  steps = [json.loads(l)["step"] for l in open(os.path.join(resumed, "metrics.jsonl"))]
  assert steps == sorted(steps) and len([s for s in steps if s == 4]) == 2   # train + eval, once
  want, got = _train_losses(workdir), _train_losses(resumed)
  assert set(want) <= set(got)       # the stopped run also logged its last step
  np.testing.assert_allclose([got[s] for s in sorted(want)], [want[s] for s in sorted(want)],
                             rtol=1e-6)
  np.testing.assert_allclose(second["eval"]["main/loss"], _eval(workdir), rtol=1e-6)


def _eval(workdir):
  return json.load(open(os.path.join(workdir, "final_metrics.json")))["eval"]["main/loss"]


def test_rerunning_a_finished_run_changes_nothing(uninterrupted, data_dir):
  workdir, result = uninterrupted
  names = ("config.json", "metrics.jsonl", "final_metrics.json")
  before = {n: open(os.path.join(workdir, n), "rb").read() for n in names}
  again = train(_cfg(data_dir), workdir)
  assert again["step"] == result["step"] and again["eval"] == json.loads(before["final_metrics.json"])["eval"]
  assert before == {n: open(os.path.join(workdir, n), "rb").read() for n in names}


def test_divergence_stops_with_a_clear_error(tmp_path, data_dir):
  from train.loop import DivergedError
  with pytest.raises(DivergedError, match="loss is nan"):
    train(_cfg(data_dir, train=dict(learning_rate=1e30, grad_clip_norm=1e30, warmup_steps=0)),
          str(tmp_path / "nan"))


def test_incompatible_config_refused_and_nothing_overwritten(uninterrupted, data_dir):
  workdir, _ = uninterrupted
  before = {n: open(os.path.join(workdir, n), "rb").read() for n in ("config.json", "metrics.jsonl")}
  with pytest.raises(ConfigError, match=r"mtp\.depth: 2 != 1"):
    train(_cfg(data_dir, mtp=dict(depth=1)), workdir)
  with pytest.raises(ConfigError, match=r"model\.d_model"):
    train(_cfg(data_dir, model=dict(d_model=48)), workdir)
  after = {n: open(os.path.join(workdir, n), "rb").read() for n in before}
  assert before == after


def test_unknown_dataset_fails_before_writing(tmp_path, data_dir):
  workdir = tmp_path / "never"
  with pytest.raises(DataError, match="no_such_dataset"):
    train(_cfg(data_dir) .replace(data=dict(name="no_such_dataset")), str(workdir))
  assert not workdir.exists()


def test_missing_and_corrupt_checkpoints(uninterrupted, tmp_path, data_dir):
  with pytest.raises(ckpt_lib.CheckpointError, match="no checkpoint"):
    ckpt_lib.load_model(str(tmp_path))
  workdir, _ = uninterrupted
  corrupt = str(tmp_path / "corrupt")
  import shutil
  shutil.copytree(workdir, corrupt)
  state_dir = os.path.join(corrupt, "checkpoints", "6", "state")
  for root, _, files in os.walk(state_dir):
    for f in files:
      with open(os.path.join(root, f), "wb") as fh:
        fh.write(b"garbage")
  with pytest.raises(ckpt_lib.CheckpointError, match="checkpoints/6"):
    ckpt_lib.load_model(corrupt)
  with pytest.raises(ckpt_lib.CheckpointError, match="unreadable"):
    train(_cfg(data_dir, train=dict(num_steps=9)), corrupt)


def test_non_finite_parameters_are_refused_at_load(uninterrupted, tmp_path):
  """A checkpoint with one NaN entry (a diverged run saved by another tool, a
  bad conversion) is an error naming the parameter, for decoding and resume."""
  from flax import nnx
  cfg, model, _ = ckpt_lib.load_model(uninterrupted[0])
  params = nnx.state(model, nnx.Param)
  kernel = params["mtp"][1]["block"]["mlp"]["up"]["kernel"]
  bad = np.array(kernel.get_value())
  bad[3, 5] = np.nan
  kernel.set_value(bad)
  ckpt = ckpt_lib.Checkpointer(str(tmp_path))
  ckpt.save(7, params, {}, None, cfg)
  ckpt.close()
  with pytest.raises(ckpt_lib.CheckpointError, match=r"mtp\.1\.block\.mlp\.up\.kernel .*1 non-finite"):
    ckpt_lib.load_model(str(tmp_path))


def test_load_model_for_inference(uninterrupted):
  workdir, _ = uninterrupted
  cfg, model, step = ckpt_lib.load_model(workdir)
  assert step == 6 and cfg.mtp.depth == model.mtp_depth == 2


def _run_cli(args, **kw):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "train", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, **kw)


def test_cli_rejects_bad_override_naming_the_field(tmp_path):
  r = _run_cli(["--config", "configs/tiny.py", "--workdir", str(tmp_path / "w"),
                "--config.mtp.depth=-1"], timeout=120)
  assert r.returncode == 2 and "mtp.depth" in r.stderr
  r = _run_cli(["--config", "configs/tiny.py", "--workdir", str(tmp_path / "w"),
                "--config.train.lr=3"], timeout=120)
  assert r.returncode == 2 and "unknown config key 'train.lr'" in r.stderr, r.stderr[-500:]
  assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_then_resume_finishes(tmp_path, data_dir):
  workdir = tmp_path / "sig"
  args = ["--config", "configs/tiny.py", "--workdir", str(workdir),
          f"--config.data.data_dir={data_dir}", "--config.model.d_model=32",
          "--config.model.num_layers=1", "--config.model.mlp_dim=64", "--config.model.head_dim=8",
          "--config.train.batch_size=2", "--config.train.seq_len=16",
          "--config.train.num_steps=100000", "--config.checkpoint.every_steps=100000",
          "--config.train.eval_every=100000", "--config.train.log_every=1"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
      time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 143, err[-2000:]
  steps = ckpt_lib.Checkpointer(str(workdir), read_only=True).all_steps()
  assert len(steps) == 1 and steps[0] >= 3
  r = _run_cli([*args[:-4], f"--config.train.num_steps={steps[0] + 2}",
                "--config.checkpoint.every_steps=100000", "--config.train.eval_every=100000",
                "--config.train.log_every=1"], timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  assert ckpt_lib.Checkpointer(str(workdir), read_only=True).latest_step() == steps[0] + 2
