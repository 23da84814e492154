"""Checkpoint saves that fail on a full disk, and reads of a workdir whose
training run is writing or rotating the checkpoints being read.

A failed save (fault injected: orbax's JSON writes raise ENOSPC, or a file
size limit makes tensorstore's writes fail) must end with one line naming
the step, its path and the errno, no traceback, and the previous step as
the resume point. A reader must pass over a step a live training run is
writing or removing, and advise deleting a step only when no run is live.
"""

import errno
import json
import logging
import os
import resource
import shutil
import socket
import subprocess
import sys

import pytest

from mtp import checkpoint as ckpt_lib
from mtp import loading
from tests.conftest import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}


@pytest.fixture(scope="module")
def state():
  """(cfg, TrainState) of the tiny model, freshly initialised."""
  from train.loop import Trainer
  cfg = tiny_config()
  return cfg, Trainer(cfg).init_state()


def _save(workdir, cfg, st, *steps, keep=5):
  ckpt = ckpt_lib.Checkpointer(workdir, keep=keep)
  try:
    for step in steps:
      ckpt.save(step, st.params, st.opt_state, None, cfg)
  finally:
    ckpt.close()


@pytest.fixture(scope="module")
def two_steps(state, tmp_path_factory):
  """A workdir with complete checkpoints at steps 3 and 6."""
  path = str(tmp_path_factory.mktemp("two_steps"))
  _save(path, *state, 3, 6)
  return path


def _copy(src, dst):
  shutil.copytree(src, dst)
  return str(dst)


def _disk_full_at(monkeypatch, step):
  """Orbax's write of the config item of step ``step`` (JSON, written in a
  background thread while other threads write the arrays) raises ENOSPC,
  as on a full disk: the save fails midway."""
  from etils.epath import abstract_path
  folder = f"{os.sep}{step}.orbax-checkpoint-tmp{os.sep}config"
  original = abstract_path.Path.write_text

  def write_text(self, *args, **kwargs):
    if folder in str(self):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
    return original(self, *args, **kwargs)

  monkeypatch.setattr(abstract_path.Path, "write_text", write_text)


# -- a save that fails --------------------------------------------------------------------------

def test_a_full_disk_during_a_save_is_one_error_and_the_previous_step_stays(
    state, tmp_path, monkeypatch, capfd, caplog):
  cfg, st = state
  workdir = str(tmp_path / "wd")
  directory = ckpt_lib.checkpoint_dir(workdir)
  ckpt = ckpt_lib.Checkpointer(workdir)
  try:
    ckpt.save(3, st.params, st.opt_state, None, cfg)
    capfd.readouterr()
    caplog.clear()
    with monkeypatch.context() as m:
      _disk_full_at(m, 6)
      with pytest.raises(ckpt_lib.CheckpointWriteError) as info:
        ckpt.save(6, st.params, st.opt_state, None, cfg)
    assert str(info.value) == (
        f"checkpoint step 6 was not written to {directory}/6: [Errno 28] No space left on "
        "device; the last complete checkpoint is step 3 (resume from it after freeing space)")
    _, err = capfd.readouterr()
    assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-3000:]
    assert sorted(os.listdir(directory)) == ["3"]          # the partial folder is gone
    reader = ckpt_lib.Checkpointer(workdir, read_only=True)
    try:
      assert reader.latest_step() == 3 and reader.all_steps() == [3]
    finally:
      reader.close()
    ckpt.save(6, st.params, st.opt_state, None, cfg)       # space freed: the same writer saves
    assert ckpt.all_steps() == [3, 6]
  finally:
    ckpt.close()


def test_os_errno_finds_the_errno_behind_orbax_and_tensorstore_errors():
  try:
    try:
      raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as e:
      raise RuntimeError("save failed") from e
  except RuntimeError as e:
    wrapped = e
  assert ckpt_lib.os_errno(wrapped) == errno.ENOSPC
  tensorstore = ValueError(
      'OUT_OF_RANGE: Error writing "params.x/0" in OCDBT database at local file "/w/6.orbax-'
      'checkpoint-tmp/": Failed to write 115184 bytes to file 7: No space left on device '
      "[os_error_code='28']")
  assert ckpt_lib.os_errno(RuntimeError("x").with_traceback(None)) is None
  assert ckpt_lib.os_errno(tensorstore) == errno.ENOSPC
  group = ExceptionGroup("writes", [ValueError("a"), PermissionError(errno.EACCES, "denied")])
  assert ckpt_lib.os_errno(group) == errno.EACCES
  assert ckpt_lib.os_errno(ValueError("shape mismatch")) is None


@pytest.mark.cpu_only
@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs RLIMIT_FSIZE")
def test_a_failed_tensorstore_write_is_one_line_too(tmp_path):
  """A real write failure in tensorstore's own threads: a file size limit
  (RLIMIT_FSIZE, no privileges needed) lets every file of a save through
  except the array data files, whose writes then fail with EFBIG."""
  code = (
      "import os, resource, signal, sys, time\n"
      "from mtp import checkpoint\n"
      "from tests.conftest import tiny_config\n"
      "from train.loop import Trainer\n"
      "cfg = tiny_config()\n"
      "st = Trainer(cfg).init_state()\n"
      "ckpt = checkpoint.Checkpointer(sys.argv[1])\n"
      "ckpt.save(3, st.params, st.opt_state, None, cfg)\n"
      "sizes = {}\n"
      "for root, _, files in os.walk(os.path.join(ckpt.directory, '3')):\n"
      "  for f in files:\n"
      "    p = os.path.join(root, f)\n"
      "    sizes[p] = os.path.getsize(p)\n"
      "data = max(s for p, s in sizes.items() if '/ocdbt.process_0/d/' in p)\n"
      "other = max(s for p, s in sizes.items() if '/ocdbt.process_0/d/' not in p)\n"
      "assert data > other + 1, (data, other)\n"
      "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
      "resource.setrlimit(resource.RLIMIT_FSIZE, (other + 1, resource.RLIM_INFINITY))\n"
      "try:\n"
      "  ckpt.save(6, st.params, st.opt_state, None, cfg)\n"
      "except checkpoint.CheckpointWriteError as e:\n"
      "  print(f'error: {e}', file=sys.stderr, flush=True)\n"
      "ckpt.close()\n"
      "time.sleep(1)\n")
  workdir = str(tmp_path / "wd")
  r = subprocess.run([sys.executable, "-c", code, workdir], cwd=REPO, env=ENV,
                     capture_output=True, text=True, timeout=300)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 0 and len(lines) == 1, r.stderr[-3000:]
  assert lines[0] == (f"error: checkpoint step 6 was not written to {workdir}/checkpoints/6: "
                      "[Errno 27] File too large; the last complete checkpoint is step 3 "
                      "(resume from it once the cause is fixed)")
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3"]


_INJECT = (
    "import errno, os, runpy, sys\n"
    "from etils.epath import abstract_path\n"
    "folder = f'{os.sep}{sys.argv[1]}.orbax-checkpoint-tmp{os.sep}config'\n"
    "original = abstract_path.Path.write_text\n"
    "def write_text(self, *a, **k):\n"
    "  if folder in str(self):\n"
    "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))\n"
    "  return original(self, *a, **k)\n"
    "abstract_path.Path.write_text = write_text\n"
    "sys.argv = ['train', *sys.argv[2:]]\n"
    "runpy.run_module('train', run_name='__main__', alter_sys=True)\n")


def _train_args(workdir, data_dir):
  return ["--config", "configs/tiny.py", "--workdir", workdir, f"--config.data.data_dir={data_dir}",
          "--config.model.d_model=32", "--config.model.num_layers=1", "--config.model.mlp_dim=64",
          "--config.model.head_dim=8", "--config.train.batch_size=2", "--config.train.seq_len=16",
          "--config.train.num_steps=4", "--config.checkpoint.every_steps=2",
          "--config.train.eval_every=100000", "--config.train.eval_batches=1",
          "--config.train.log_every=4"]


@pytest.fixture(scope="module")
def cli_full_disk(tmp_path_factory, data_dir):
  """(workdir, CompletedProcess) of ``python -m train`` (4 steps, checkpoints
  at 2 and 4) whose save of step 4 meets a full disk."""
  workdir = str(tmp_path_factory.mktemp("cli") / "run")
  r = subprocess.run([sys.executable, "-c", _INJECT, "4", *_train_args(workdir, data_dir)],
                     cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
  return workdir, r


@pytest.mark.cpu_only
def test_train_cli_full_disk_ends_with_one_line_and_resumes_from_the_previous_step(cli_full_disk):
  workdir, r = cli_full_disk
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2, r.stderr[-3000:]
  assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, r.stderr[-3000:]
  assert lines[-1] == (
      f"error: checkpoint step 4 was not written to {workdir}/checkpoints/4: [Errno 28] No space "
      "left on device; the last complete checkpoint is step 2 (resume from it after freeing "
      "space)")
  assert [l for l in lines if "error" in l.lower()] == lines[-1:]
  assert len(lines) <= 5, r.stderr          # params, progress, final eval, the error
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2"]
  reader = ckpt_lib.Checkpointer(workdir, read_only=True)   # what the next run resumes from
  try:
    assert reader.latest_step() == 2
  finally:
    reader.close()


@pytest.mark.cpu_only
@pytest.mark.slow
def test_train_cli_rerun_after_a_full_disk_resumes_and_finishes(cli_full_disk, data_dir):
  workdir, _ = cli_full_disk
  r = subprocess.run([sys.executable, "-m", "train", *_train_args(workdir, data_dir)], cwd=REPO,
                     env=ENV, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"resumed from {workdir}/checkpoints/2" in r.stderr, r.stderr[-3000:]
  reader = ckpt_lib.Checkpointer(workdir, read_only=True)
  try:
    assert reader.all_steps() == [2, 4]
  finally:
    reader.close()


# -- reading while a training run writes --------------------------------------------------------

@pytest.fixture
def lock_holder():
  """Starts a process that holds a workdir's training lock, as a running
  ``python -m train`` does; yields a function workdir -> Popen."""
  procs = []

  def hold(workdir):
    code = ("import sys, time\n"
            "from train.workdir import WorkdirLock\n"
            "WorkdirLock(sys.argv[1]).acquire()\n"
            "print('held', flush=True)\n"
            "time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code, workdir], cwd=REPO, env=ENV,
                         stdout=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout.readline() == "held\n"
    return p

  yield hold
  for p in procs:
    p.kill()
    p.wait()


def _half_written(workdir, step):
  """Step ``step`` of ``workdir`` without its state manifest, as while
  rotation removes it (or a save that is not whole yet)."""
  os.remove(os.path.join(workdir, "checkpoints", str(step), "state", "manifest.ocdbt"))


@pytest.mark.cpu_only
def test_a_step_a_live_training_run_is_writing_is_passed_over_with_a_notice(
    two_steps, tmp_path, lock_holder, capsys):
  workdir = _copy(two_steps, tmp_path / "busy")
  _half_written(workdir, 6)
  holder = lock_holder(workdir)
  _, _, step = loading.load_model(workdir)
  err = capsys.readouterr().err.strip().splitlines()
  assert step == 3
  assert err == [f"note: checkpoint step 6 is being written or removed by a training run "
                 f"(pid {holder.pid}); using step 3"]
  assert loading.load_config(workdir)[1] == 3
  with pytest.raises(ckpt_lib.CheckpointError) as info:    # a pinned step: no fallback
    loading.load_model(workdir, 6)
  message = str(info.value)
  assert "is incomplete" in message and f"training run (pid {holder.pid})" in message
  assert "do not delete it" in message and "delete that step directory" not in message


def test_a_step_removed_while_it_is_read_gives_way_to_the_newest_complete_one(
    state, tmp_path, monkeypatch, capsys):
  """Decoding lists step 3; before it reads it, a training run saves step 6
  and its rotation (keep=1) removes step 3."""
  cfg, st = state
  workdir = str(tmp_path / "rotating")
  _save(workdir, cfg, st, 3)
  original = ckpt_lib.Checkpointer.restore_config
  raced = []

  def restore_config(self, step=None):
    if not raced:
      raced.append(step)
      _save(workdir, cfg, st, 6, keep=1)
      assert not os.path.exists(os.path.join(workdir, "checkpoints", "3"))
    return original(self, step)

  monkeypatch.setattr(ckpt_lib.Checkpointer, "restore_config", restore_config)
  _, _, step = loading.load_model(workdir)
  err = capsys.readouterr().err.strip().splitlines()
  assert raced == [3] and step == 6
  assert err == ["note: checkpoint step 3 was removed while it was read (a training run's "
                 "checkpoint rotation, or by hand); using step 6"]


def test_without_a_live_training_run_an_incomplete_step_is_refused_with_delete_advice(
    two_steps, tmp_path):
  workdir = _copy(two_steps, tmp_path / "idle")
  _half_written(workdir, 6)
  want = (r"checkpoints/6 is incomplete: state/manifest.ocdbt is missing \(deleted or never "
          r"written\); delete that step directory to fall back to an earlier one")
  with pytest.raises(ckpt_lib.CheckpointError, match=want):
    loading.load_model(workdir)
  lock = os.path.join(workdir, ckpt_lib.TRAIN_LOCK_FILE)
  open(lock, "w").close()                            # released by a run that ended
  with pytest.raises(ckpt_lib.CheckpointError, match=want):
    loading.load_model(workdir)
  gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  with open(lock, "w") as f:                         # left by a killed run
    json.dump({"host": socket.gethostname(), "pid": int(gone.stdout), "started": "x"}, f)
  with pytest.raises(ckpt_lib.CheckpointError, match=want):
    loading.load_model(workdir)
