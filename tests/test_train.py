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
from mtp import loading
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
  assert result.step == 6 and sorted(losses) == [2, 4, 6]
  assert losses[6] < losses[2]
  assert {"main/loss", "main/bits_per_byte", "mtp_1/accuracy", "mtp_2/loss"} <= set(result.eval)
  for name in ("config.json", "metrics.jsonl", "final_metrics.json", "tensorboard"):
    assert os.path.exists(os.path.join(workdir, name)), name
  assert ckpt_lib.Checkpointer(workdir, read_only=True).all_steps() == [3, 6]


def test_killed_and_resumed_run_reproduces_losses(uninterrupted, tmp_path, data_dir):
  workdir, _ = uninterrupted
  resumed = str(tmp_path / "resumed")
  first = train(_cfg(data_dir), resumed, stop_after=3)       # "killed" after step 3
  assert first.step == 3 and not os.path.exists(os.path.join(resumed, "final_metrics.json"))
  with open(os.path.join(resumed, "metrics.jsonl"), "a") as f:   # rows a killed run left behind
    f.write(json.dumps({"step": 5, "split": "train", "loss": -1.0}) + "\n")
  second = train(_cfg(data_dir), resumed)                    # same command again
  assert second.step == 6
  steps = [json.loads(l)["step"] for l in open(os.path.join(resumed, "metrics.jsonl"))]
  assert steps == sorted(steps) and len([s for s in steps if s == 4]) == 2   # train + eval, once
  want, got = _train_losses(workdir), _train_losses(resumed)
  assert set(want) <= set(got)       # the stopped run also logged its last step
  np.testing.assert_allclose([got[s] for s in sorted(want)], [want[s] for s in sorted(want)],
                             rtol=1e-6)
  np.testing.assert_allclose(second.eval["main/loss"], _eval(workdir), rtol=1e-6)


def test_deadline_stops_at_a_log_step_with_a_checkpoint_and_resumes(uninterrupted, tmp_path,
                                                                     data_dir):
  workdir, _ = uninterrupted
  run = str(tmp_path / "budget")
  lines = []
  first = train(_cfg(data_dir), run, deadline=0.0, log=lines.append)   # already past: first log step
  assert (first.step, first.interrupted, first.signal, first.deadline_reached) == \
      (2, True, None, True)
  assert ckpt_lib.Checkpointer(run, read_only=True).all_steps() == [2]
  assert not os.path.exists(os.path.join(run, "final_metrics.json"))
  assert any(l.startswith("deadline reached: checkpoint saved at step 2") for l in lines)
  second = train(_cfg(data_dir), run, deadline=time.monotonic() + 3600)
  assert (second.step, second.interrupted, second.deadline_reached) == (6, False, False)
  want, got = _train_losses(workdir), _train_losses(run)
  np.testing.assert_allclose([got[s] for s in sorted(want)], [want[s] for s in sorted(want)],
                             rtol=1e-6)


def _eval(workdir):
  return json.load(open(os.path.join(workdir, "final_metrics.json")))["eval"]["main/loss"]


def test_rerunning_a_finished_run_changes_nothing(uninterrupted, data_dir):
  workdir, result = uninterrupted
  names = ("config.json", "metrics.jsonl", "final_metrics.json")
  before = {n: open(os.path.join(workdir, n), "rb").read() for n in names}
  again = train(_cfg(data_dir), workdir)
  assert again.step == result.step and again.eval == json.loads(before["final_metrics.json"])["eval"]
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
    loading.load_model(str(tmp_path))
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
    loading.load_model(corrupt)
  with pytest.raises(ckpt_lib.CheckpointError, match="unreadable"):
    train(_cfg(data_dir, train=dict(num_steps=9)), corrupt)


def test_non_finite_parameters_are_refused_at_load(uninterrupted, tmp_path):
  """A checkpoint with one NaN entry (a diverged run saved by another tool, a
  bad conversion) is an error naming the parameter, for decoding and resume."""
  from flax import nnx
  cfg, model, _ = loading.load_model(uninterrupted[0])
  params = nnx.state(model, nnx.Param)
  kernel = params["mtp"][1]["block"]["mlp"]["up"]["kernel"]
  bad = np.array(kernel.get_value())
  bad[3, 5] = np.nan
  kernel.set_value(bad)
  ckpt = ckpt_lib.Checkpointer(str(tmp_path))
  ckpt.save(7, params, {}, None, cfg)
  ckpt.close()
  with pytest.raises(ckpt_lib.CheckpointError, match=r"mtp\.1\.block\.mlp\.up\.kernel .*1 non-finite"):
    loading.load_model(str(tmp_path))


def test_load_model_for_inference(uninterrupted):
  workdir, _ = uninterrupted
  cfg, model, step = loading.load_model(workdir)
  assert step == 6 and cfg.mtp.depth == model.mtp_depth == 2


def _run_cli(args, **kw):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "train", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, **kw)


@pytest.mark.cpu_only
def test_cli_rejects_bad_override_naming_the_field(tmp_path):
  r = _run_cli(["--config", "configs/tiny.py", "--workdir", str(tmp_path / "w"),
                "--config.mtp.depth=-1"], timeout=120)
  assert r.returncode == 2 and "mtp.depth" in r.stderr
  r = _run_cli(["--config", "configs/tiny.py", "--workdir", str(tmp_path / "w"),
                "--config.train.lr=3"], timeout=120)
  assert r.returncode == 2 and "unknown config key 'train.lr'" in r.stderr, r.stderr[-500:]
  assert not (tmp_path / "w").exists()
  (tmp_path / "f.txt").write_text("keep me")
  r = _run_cli(["--config", "configs/tiny.py", "--workdir", str(tmp_path / "f.txt"),
                "--config.train.num_steps=2", "stray"], timeout=120)
  assert r.returncode == 2 and "unexpected arguments 'stray'" in r.stderr, r.stderr[-500:]
  r = _run_cli(["--config", "configs/tiny.py", "--workdir", str(tmp_path / "f.txt"),
                "--config.train.num_steps=2"], timeout=120)
  assert r.returncode == 2 and "is not a directory" in r.stderr, r.stderr[-500:]
  assert "Traceback" not in r.stderr and (tmp_path / "f.txt").read_text() == "keep me"
  # a batch whose logits alone exceed the machine: one line naming the field, nothing written
  r = _run_cli(["--config", "configs/tiny.py", "--workdir", str(tmp_path / "w"),
                "--config.train.batch_size=100000000"], timeout=120)
  assert r.returncode == 2 and "train.batch_size=100000000 cannot fit" in r.stderr, r.stderr[-500:]
  assert "Traceback" not in r.stderr and not (tmp_path / "w").exists()
  r = _run_cli(["--config", "configs/tiny.py", "--workdir", str(tmp_path / "w"),
                "--config.model.mlp_dim=1000000000"], timeout=120)
  assert r.returncode == 2 and "the model cannot fit" in r.stderr, r.stderr[-500:]
  assert "Traceback" not in r.stderr and not (tmp_path / "w").exists()


def test_memory_floor_names_the_largest_batch_that_fits():
  from flax import nnx
  from mtp.model import Transformer, count_params
  from train import workdir as workdir_lib
  for cfg in (tiny_config(), tiny_config(model=dict(tie_embeddings=False), mtp=dict(depth=3))):
    model = Transformer(cfg.model, cfg.mtp.depth, rngs=nnx.Rngs(0))   # the formula is exact
    assert workdir_lib.param_count(cfg) == count_params(model)["total"]
  cfg = tiny_config(train=dict(batch_size=100, seq_len=32))   # V = 264
  floor = workdir_lib.memory_floor_bytes(cfg)
  assert floor["logits"] == 100 * 32 * 264 * 4 and floor["params"] == 4 * workdir_lib.param_count(cfg)
  need = floor["params"] + floor["logits"]
  workdir_lib.check_memory_floor(cfg, (need, "test"))    # exactly fits
  with pytest.raises(ConfigError, match=r"train\.batch_size=100 cannot fit.*"
                     r"allowed: train\.batch_size <= 99 here"):
    workdir_lib.check_memory_floor(cfg, (need - 32 * 264 * 4 + 5, "test"))
  with pytest.raises(ConfigError, match=r"the model cannot fit: its .* parameters \(model\.d_model"):
    workdir_lib.check_memory_floor(cfg, (floor["params"] - 1, "test"))
  have, where = workdir_lib.device_memory_bytes()
  assert have > 2 ** 28 and where
  # across 2 hosts of 4 devices: the batch (and vocabulary) split over all 8
  # devices, the parameters over mesh.fsdp x mesh.tensor only
  fsdp = tiny_config(train=dict(batch_size=100, seq_len=32), mesh=dict(data=1, fsdp=8))
  assert workdir_lib.process_share(cfg, 4, 8) == (1.0, 0.5)
  assert workdir_lib.process_share(fsdp, 4, 8) == (0.5, 0.5)
  workdir_lib.check_memory_floor(fsdp, (need // 2 + 8, "test"), devices=(4, 8))
  with pytest.raises(ConfigError, match="train.batch_size=100 cannot fit"):
    workdir_lib.check_memory_floor(cfg, (need // 2 + 8, "test"), devices=(4, 8))


@pytest.mark.cpu_only
def test_cli_missing_or_unloadable_config_file_is_one_line(tmp_path):
  (tmp_path / "syntax.py").write_text("def get_config(:\n")
  (tmp_path / "noget.py").write_text("x = 1\n")
  for path, want in ((str(tmp_path / "nope.py"), "does not exist"),
                     (str(tmp_path / "syntax.py"), "SyntaxError (line 1)"),
                     (str(tmp_path / "noget.py"), "no get_config() function")):
    r = _run_cli([f"--config={path}", "--workdir", str(tmp_path / "w")], timeout=120)
    assert r.returncode == 2, r.stderr[-1000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: config file {path!r}"), r.stderr
    assert want in lines[0]
  assert not (tmp_path / "w").exists()


@pytest.mark.cpu_only
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


# -- a signal anywhere: re-running the same call finishes exactly what is left --------------

class _SignalAt:
  """Sends this process SIGTERM from inside train(): before the checkpoint save
  of step ``save``, at the start of the next evaluation (``eval=True``), or
  during the train step that produces step ``step``. One shot per arm()."""

  def __init__(self, monkeypatch):
    from train.loop import Trainer
    self.armed = {}
    orig_save, orig_eval, orig_step = ckpt_lib.Checkpointer.save, Trainer.eval_sums, Trainer.train_step

    def save(ckpt, step, *a, **kw):
      self._fire("save", step)
      return orig_save(ckpt, step, *a, **kw)

    def eval_sums(trainer, params, batches):
      self._fire("eval", True)
      return orig_eval(trainer, params, batches)

    def train_step(trainer, state, batch):
      self._fire("step", state.step + 1)
      return orig_step(trainer, state, batch)

    monkeypatch.setattr(ckpt_lib.Checkpointer, "save", save)
    monkeypatch.setattr(Trainer, "eval_sums", eval_sums)
    monkeypatch.setattr(Trainer, "train_step", train_step)

  def arm(self, **event):
    self.armed = dict(event)

  def _fire(self, kind, value):
    if self.armed.get(kind) == value:
      self.armed = {}
      # train() must have installed its handler: the default one would end pytest
      assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
      os.kill(os.getpid(), signal.SIGTERM)


def test_signal_anywhere_then_rerun_ends_as_an_uninterrupted_run(uninterrupted, tmp_path, data_dir,
                                                                  monkeypatch):
  """Steps 1..6, eval at 4 and 6 (final), checkpoints every 3 steps. The same
  command is re-run after each signal: during the save of step 3, during the
  evaluation at step 4, during the last step (its final evaluation is then
  abandoned), during the final evaluation of a resumed run; the fifth run
  finishes and everything matches the uninterrupted run."""
  import io
  monkeypatch.setattr(sys, "stderr", io.StringIO())   # not a terminal: no progress bar
  full_dir, full = uninterrupted
  wd = str(tmp_path / "sig")
  final = os.path.join(wd, "final_metrics.json")
  hooks = _SignalAt(monkeypatch)

  def run(cfg=None, **event):
    hooks.arm(**event)
    lines = []
    res = train(cfg or _cfg(data_dir), wd, log=lines.append)
    assert hooks.armed == {}, f"signal {event} never sent"
    return res, lines

  res, _ = run(save=3)                                  # 1: the save completes, then it stops
  assert (res.step, res.interrupted, res.signal) == (3, True, signal.SIGTERM)
  assert ckpt_lib.Checkpointer(wd, read_only=True).all_steps() == [3] and not os.path.exists(final)
  # 2: resumed with a changed (non-architecture) field, stopped inside the evaluation at step 4
  res, lines = run(_cfg(data_dir, checkpoint=dict(keep=6)), eval=True)
  assert (res.step, res.interrupted, res.eval) == (4, True, {})
  assert any("checkpoint.keep: 5 -> 6" in l and "config.until_step3.json" in l for l in lines), lines
  assert os.path.exists(os.path.join(wd, "config.until_step3.json"))
  assert ckpt_lib.Checkpointer(wd, read_only=True).all_steps() == [3, 4]
  # 3: runs the abandoned evaluation at 4 first; stopped during the last step
  res, lines = run(_cfg(data_dir, checkpoint=dict(keep=6)), step=6)
  assert (res.step, res.interrupted, res.eval) == (6, True, {}) and not os.path.exists(final)
  assert not any("config changed" in l for l in lines)
  progress = [l for l in lines if l.startswith("step 6/6: loss ")]
  assert len(progress) == 1 and "tokens/s" in progress[0] and ", elapsed " in progress[0]
  assert progress[0].endswith(", remaining ~0s")
  assert ckpt_lib.Checkpointer(wd, read_only=True).latest_step() == 6
  res, _ = run(_cfg(data_dir, checkpoint=dict(keep=6)), eval=True)   # 4: final evaluation stopped
  assert (res.step, res.interrupted, res.signal) == (6, True, signal.SIGTERM)
  assert not os.path.exists(final)
  res, _ = run(_cfg(data_dir, checkpoint=dict(keep=6)))             # 5: finishes
  assert (res.step, res.interrupted, res.signal) == (6, False, None)
  got, want = json.load(open(final)), json.load(open(os.path.join(full_dir, "final_metrics.json")))
  assert got == res.as_dict() and got["step"] == want["step"] == 6
  assert set(got["eval"]) == set(want["eval"])
  np.testing.assert_allclose([got["eval"][k] for k in sorted(want["eval"])],
                             [want["eval"][k] for k in sorted(want["eval"])], rtol=1e-6)
  np.testing.assert_allclose(got["train"]["loss"], want["train"]["loss"], rtol=1e-6)
  rows = [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl"))]
  assert [r["step"] for r in rows if r["split"] == "eval"] == [4, 6]    # each once, in order
  assert [r["step"] for r in rows if r["split"] == "train"] == [2, 4, 6]
  full_losses = _train_losses(full_dir)
  np.testing.assert_allclose([_train_losses(wd)[s] for s in (2, 4, 6)],
                             [full_losses[s] for s in (2, 4, 6)], rtol=1e-6)
  _, model_a, _ = loading.load_model(wd)
  _, model_b, _ = loading.load_model(full_dir)
  from flax import nnx
  import jax
  for a, b in zip(jax.tree.leaves(nnx.state(model_a, nnx.Param)),
                  jax.tree.leaves(nnx.state(model_b, nnx.Param))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  again, lines = run(_cfg(data_dir, checkpoint=dict(keep=6)))       # 6: nothing left to do
  assert again.as_dict() == got and any("already finished" in l for l in lines)


def test_only_a_complete_final_result_counts_as_finished(tmp_path):
  from train.workdir import finished_result
  path = str(tmp_path / "final_metrics.json")
  assert finished_result(str(tmp_path), 6) is None                       # missing
  good = {"step": 6, "eval": {"main/loss": 1.0}, "interrupted": False, "signal": None}
  for bad in ({**good, "interrupted": True, "signal": 15},       # left by an interrupted run
              {**good, "step": 4}, {**good, "eval": {}}):
    json.dump(bad, open(path, "w"))
    assert finished_result(str(tmp_path), 6) is None, bad
  open(path, "w").write('{"step": 6, "ev')                        # torn write
  assert finished_result(str(tmp_path), 6) is None
  json.dump(good, open(path, "w"))
  assert finished_result(str(tmp_path), 6) == good


# -- one writer per workdir (issue 23, part 3) ------------------------------------------------

def _snapshot(workdir):
  """{relative path: (size, mtime_ns, bytes)} of every file under ``workdir``."""
  out = {}
  for root, _, files in os.walk(workdir):
    for f in files:
      p = os.path.join(root, f)
      st = os.stat(p)
      out[os.path.relpath(p, workdir)] = (st.st_size, st.st_mtime_ns, open(p, "rb").read())
  return out


@pytest.fixture
def lock_holder():
  """Starts a process that holds the lock of a workdir (as a running
  ``python -m train`` does); yields a function workdir -> Popen."""
  procs = []

  def hold(workdir):
    code = ("import sys, time\n"
            "from train.workdir import WorkdirLock\n"
            "lock = WorkdirLock(sys.argv[1])\n"
            "lock.acquire()\n"
            "print('held', flush=True)\n"
            "time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code, workdir], cwd=REPO, stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO})
    procs.append(p)
    assert p.stdout.readline() == "held\n"
    return p

  yield hold
  for p in procs:
    p.kill()
    p.wait()


@pytest.mark.cpu_only
def test_second_run_on_a_workdir_stops_at_once_naming_the_holder(uninterrupted, tmp_path,
                                                                  data_dir, lock_holder):
  from train.workdir import WorkdirBusyError
  import shutil
  busy = str(tmp_path / "busy")
  shutil.copytree(uninterrupted[0], busy)
  holder = lock_holder(busy)
  before = _snapshot(busy)
  lock = json.load(open(os.path.join(busy, "train.lock")))
  assert lock["pid"] == holder.pid and {"host", "started"} <= set(lock)
  want = rf"in use by another training run \(host {lock['host']}, process id {holder.pid}, started "
  with pytest.raises(WorkdirBusyError, match=want):
    train(_cfg(data_dir, train=dict(num_steps=9, seed=1)), busy)
  assert _snapshot(busy) == before                                    # nothing touched
  # the same through the CLI: exit status 2, one line, no traceback
  r = _run_cli(["--config", "configs/tiny.py", "--workdir", busy,
                f"--config.data.data_dir={data_dir}"], timeout=300)
  assert r.returncode == 2, r.stderr[-2000:]
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: workdir") and f"process id {holder.pid}" \
      in lines[0] and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert _snapshot(busy) == before
  # reading needs no lock: decoding (and so export) loads the checkpoint
  assert loading.load_model(busy)[2] == 6
  # a new workdir being created by a first run: the second stops too, writes nothing
  fresh = str(tmp_path / "fresh")
  os.makedirs(fresh)
  lock_holder(fresh)
  with pytest.raises(WorkdirBusyError):
    train(_cfg(data_dir), fresh)
  assert os.listdir(fresh) == ["train.lock"]


def test_stale_lock_of_a_killed_run_is_taken_over_with_a_notice(tmp_path, data_dir):
  import socket
  gone = subprocess.Popen([sys.executable, "-c", "pass"])
  gone.wait()
  workdir = tmp_path / "w"
  workdir.mkdir()
  (workdir / "train.lock").write_text(json.dumps(
      {"host": socket.gethostname(), "pid": gone.pid, "started": "2026-01-01T00:00:00+00:00"}))
  lines = []
  result = train(_cfg(data_dir, train=dict(num_steps=2, eval_every=2)), str(workdir),
                 log=lines.append)
  assert result.step == 2
  notes = [l for l in lines if l.startswith("note: taking over the lock")]
  assert len(notes) == 1 and f"process id {gone.pid}" in notes[0], lines
  assert (workdir / "train.lock").read_text() == ""                  # released at the end


# -- optimizer state precision (issue 23, part 6b) ----------------------------------------------

def test_bfloat16_parameters_keep_float32_adam_moments():
  """model.param_dtype=bfloat16: parameters stay bf16 through a step while
  Adam's mu and nu are float32 (init, after a step, and as checkpointed)."""
  import jax
  import optax
  from tests.conftest import markov_batch, markov_transition
  from train.loop import Trainer
  cfg = tiny_config(model=dict(param_dtype="bfloat16", dtype="bfloat16"))
  trainer = Trainer(cfg)
  state = trainer.init_state()

  def moments(opt_state):
    adam = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
        x, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
    assert len(adam) == 1
    return jax.tree.leaves(adam[0].mu) + jax.tree.leaves(adam[0].nu)

  assert {x.dtype.name for x in jax.tree.leaves(state.params)} == {"bfloat16"}
  assert {x.dtype.name for x in moments(state.opt_state)} == {"float32"}
  assert {x.dtype for x in jax.tree.leaves(trainer.abstract_opt_state)
          if x.ndim >= 1} == {np.dtype("float32")}
  batch = markov_batch(np.random.default_rng(0), 4, 32, markov_transition())
  state, metrics = trainer.train_step(state, batch)
  assert np.isfinite(float(metrics["loss"]))
  assert {x.dtype.name for x in jax.tree.leaves(state.params)} == {"bfloat16"}
  assert {x.dtype.name for x in moments(state.opt_state)} == {"float32"}
  assert any(float(np.abs(np.asarray(x)).max()) > 0 for x in moments(state.opt_state))


def test_float32_state_is_the_identity_for_float32_parameters():
  import jax
  import jax.numpy as jnp
  import optax
  from train.loop import float32_state
  inner = optax.adamw(1e-2, weight_decay=0.1)
  params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
  grads = jax.tree.map(lambda x: 0.1 * x + 0.01, params)
  a_state, b_state = inner.init(params), float32_state(inner).init(params)
  for _ in range(3):
    ua, a_state = inner.update(grads, a_state, params)
    ub, b_state = float32_state(inner).update(grads, b_state, params)
    for x, y in zip(jax.tree.leaves((ua, a_state)), jax.tree.leaves((ub, b_state))):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
