"""Issue 51, the CLIs at the edges: every file is written whole or not at all
(``mtp.cli.write_atomic``: a full disk keeps the old report); output paths
are checked before any work (``check_output_path``); Ctrl-C ends a CLI at
once with status 130 and one line; a second run on a busy workdir says so;
a full disk is one line and status 2; a closed stdout (``| head``) ends
quietly with status 141; device_check's flag errors are one line.

A full or read-only disk is a tiny tmpfs (root only; skipped elsewhere)."""

import contextlib
import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mtp import cli
from mtp import report
from tests import tiny_bpe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


def _run(args, timeout=300, **kw):
  return subprocess.run([sys.executable, *args], cwd=REPO, env=_env(), capture_output=True,
                        text=True, timeout=timeout, **kw)


def _one_error_line(stderr: str, needle: str) -> str:
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], stderr[-3000:]
  return lines[0]


@contextlib.contextmanager
def _tmpfs(path, options: str):
  os.makedirs(path, exist_ok=True)
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                     capture_output=True, text=True)
  if r.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode})")
  try:
    yield str(path)
  finally:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def full_disk(tmp_path):
  """A 64 KiB tmpfs filled up to its last byte, with a small file ``old``."""
  with _tmpfs(tmp_path / "full", "size=64k") as d:
    with open(os.path.join(d, "filler"), "wb", buffering=0) as f:
      try:
        while True:
          f.write(b"\0" * 4096)
      except OSError as e:
        assert e.errno == errno.ENOSPC
    yield d


@pytest.fixture
def read_only_dir(tmp_path):
  with _tmpfs(tmp_path / "ro", "size=64k,ro") as d:
    yield d


@pytest.fixture(scope="module")
def chat_workdir(tmp_path_factory):
  """A tiny imported target with a chat template and one MTP module."""
  return tiny_bpe.import_tiny_workdir(str(tmp_path_factory.mktemp("edges_wd")), mtp_depth=1)


# -- 1. atomic writes ----------------------------------------------------------------------------

def test_a_report_written_on_a_full_disk_keeps_the_old_report(tmp_path):
  with _tmpfs(tmp_path / "small", "size=64k") as d:
    out = os.path.join(d, "r")
    report.write_report(out, {"command": "old"}, {"x": 1}, "old table\n")
    with open(os.path.join(d, "filler"), "wb", buffering=0) as f:   # the disk fills up
      with contextlib.suppress(OSError):
        while True:
          f.write(b"\0" * 4096)
    with pytest.raises(OSError) as e:
      report.write_report(out, {"command": "new"}, {"x": "y" * 40_000}, "new table\n")
    assert json.load(open(out + ".json")) == {"meta": {"command": "old"}, "results": {"x": 1}}
    assert e.value.errno == errno.ENOSPC and e.value.filename == out + ".json"
    assert sorted(os.listdir(d)) == ["filler", "r.json", "r.md"]        # no temporary file


def test_write_atomic_keeps_the_old_file_and_no_temporary_file_on_failure(tmp_path, monkeypatch):
  path = tmp_path / "a.jsonl"
  path.write_text("old\n")
  os.chmod(path, 0o640)

  def full(fd):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(os, "fsync", full)
  with pytest.raises(OSError) as e:
    cli.write_atomic(str(path), "new\n")
  assert e.value.errno == errno.ENOSPC and e.value.filename == str(path)
  assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["a.jsonl"]
  monkeypatch.undo()
  assert cli.write_atomic(str(path), b"new\n") == str(path)
  assert path.read_text() == "new\n" and os.listdir(tmp_path) == ["a.jsonl"]
  assert os.stat(path).st_mode & 0o777 == 0o640                # the file keeps its mode


def test_a_partial_batch_has_a_temporary_file_of_its_own(tmp_path, monkeypatch):
  """Two writers of one ``.partial`` batch never share (and rename away) one
  temporary file: the bug behind issue 51's FileNotFoundError."""
  import numpy as np

  from mtp.data import distilled
  path = str(tmp_path / "b0.npz")
  (tmp_path / "b0.npz.tmp.npz").write_bytes(b"another writer's")
  distilled.save_partial_batch(path, [np.arange(3, dtype=np.int32)], np.ones(1, np.int64))
  answers, calls = distilled.load_partial_batch(path, 1)
  assert answers[0].tolist() == [0, 1, 2] and calls.tolist() == [1]
  assert (tmp_path / "b0.npz.tmp.npz").read_bytes() == b"another writer's"


# -- 2. output paths checked first -------------------------------------------------------------

def test_check_output_path(tmp_path, capsys):
  f = tmp_path / "f"
  f.write_text("x")
  assert cli.output_path_problem(str(tmp_path / "new" / "deeper" / "r.json")) is None
  assert cli.output_path_problem(str(tmp_path / "stage"), "dir") is None
  assert cli.output_path_problem(str(tmp_path / "r"), "prefix") is None
  assert "is a directory" in cli.output_path_problem(str(tmp_path))
  assert "not a directory" in cli.output_path_problem(str(f), "dir")
  assert "not a directory" in cli.output_path_problem(str(f / "r.json"))
  with pytest.raises(SystemExit) as e:
    cli.check_output_path("out", str(tmp_path))
  assert e.value.code == 2
  _one_error_line(capsys.readouterr().err, f"--out={str(tmp_path)!r}: is a directory")
  assert os.listdir(tmp_path) == ["f"]                               # the probe is gone


def test_check_output_path_read_only(read_only_dir, capsys):
  with pytest.raises(SystemExit):
    cli.check_output_path("workdir", os.path.join(read_only_dir, "stage"), "dir")
  _one_error_line(capsys.readouterr().err, "--workdir=")


@pytest.mark.parametrize("where", ["directory", "read_only"])
def test_self_prompts_refuses_its_out_before_sampling(where, chat_workdir, tmp_path, request,
                                                      capsys):
  from scripts import self_prompts
  out = str(tmp_path) if where == "directory" else os.path.join(
      request.getfixturevalue("read_only_dir"), "p.jsonl")
  with pytest.raises(SystemExit) as e:
    self_prompts.main(["--workdir", chat_workdir, "--out", out, "--num_prompts", "1",
                       "--max_rounds", "1", "--max_len", "4", "--batch_size", "2"])
  assert e.value.code == 2
  _one_error_line(capsys.readouterr().err, "--out=")                 # no "round 1" line first
  assert not os.path.exists(out + ".tmp")                   # the 0-byte file the old code left


def test_smollm_mtp_device_refuses_a_file_workdir_and_a_read_only_out(tmp_path, read_only_dir):
  f = tmp_path / "f"
  f.write_text("x")
  base = ["-m", "scripts.smollm_mtp_device", "--quick", "--base_workdir", str(tmp_path / "b"),
          "--init_workdir", str(tmp_path / "i"), "--data_dir", str(tmp_path / "d"),
          "--modules_out", str(tmp_path / "m.safetensors")]
  r = _run(base + ["--workdir", str(f), "--out", str(tmp_path / "r")], timeout=120)
  assert r.returncode == 2
  _one_error_line(r.stderr, f"--workdir={str(f)!r}: exists and is not a directory")
  r = _run(base + ["--workdir", str(tmp_path / "s"), "--out", os.path.join(read_only_dir, "r")],
           timeout=120)
  assert r.returncode == 2
  _one_error_line(r.stderr, "--out=")
  assert not os.path.exists(tmp_path / "s")


def test_device_check_refuses_an_out_under_a_file(tmp_path):
  f = tmp_path / "f"
  f.write_text("x")
  r = _run(["-m", "scripts.device_check", "--quick", "--out", str(f / "r")], timeout=120)
  assert r.returncode == 2
  _one_error_line(r.stderr, "--out=")


def test_device_check_flag_errors_are_one_line():
  r = _run(["-m", "scripts.device_check", "--budget_s", "1"], timeout=120)
  assert r.returncode == 2
  _one_error_line(r.stderr, "--budget_s=1")


# -- 3. Ctrl-C -----------------------------------------------------------------------------------

# a Ctrl-C that lands in a gc callback (as in jax's _xla_gc_callback): Python prints
# "Exception ignored in ..." and goes on, unless main_guard ends the process
GC_RUNNER = textwrap.dedent("""
  import gc, sys, time
  from mtp import cli
  def main(argv):
    fired = []
    def callback(phase, info):
      if not fired:
        fired.append(1)
        raise KeyboardInterrupt
    gc.callbacks.append(callback)
    gc.collect()
    time.sleep(0.2)
    print("went on after the Ctrl-C")
    return 0
  cli.main_guard(main)
""")


def test_a_ctrl_c_python_would_drop_ends_the_process():
  r = _run(["-c", GC_RUNNER], timeout=120)
  assert r.returncode == 130, r.stderr
  assert r.stdout == "" and r.stderr.strip() == "interrupted (Ctrl-C): stopped"


# a terminal's Ctrl-C: Python's own SIGINT handler even under a runner that ignores SIGINT
SIGINT_RUNNER = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler);"
                 "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def test_ctrl_c_ends_self_prompts_at_once_with_130_and_one_line(chat_workdir, tmp_path):
  out = tmp_path / "p.jsonl"
  # every prompt is too short: without the Ctrl-C the rounds would go on and on
  p = subprocess.Popen([sys.executable, "-c", SIGINT_RUNNER, "scripts.self_prompts",
                        "--workdir", chat_workdir, "--out", str(out), "--num_prompts", "5",
                        "--max_rounds", "100000", "--max_len", "4", "--batch_size", "2",
                        "--min_chars", "1000", "--max_chars", "1000"],
                       cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
  try:
    seen = []
    for line in p.stderr:
      seen.append(line)
      if line.startswith("round 2:"):
        break
    assert seen and seen[-1].startswith("round 2:"), "".join(seen)
    p.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, rest = p.communicate(timeout=120)
  finally:
    p.kill()
  assert p.returncode == 130, rest[-3000:]
  assert time.monotonic() - t0 < 60
  tail = [ln for ln in rest.strip().splitlines() if not ln.startswith("round ")]
  assert tail == ["interrupted (Ctrl-C): stopped"], rest[-3000:]
  assert os.listdir(tmp_path) == []                                 # nothing half-written


# device_check's pytest child runs in a session of its own (a terminal's Ctrl-C does not
# reach it): here it is a `sleep`, and a Ctrl-C arrives while device_check waits for it
CHILD_RUNNER = textwrap.dedent("""
  import os, signal, subprocess, sys, threading, types
  signal.signal(signal.SIGINT, signal.default_int_handler)
  from mtp import cli
  from scripts import device_check as dc
  real = subprocess.Popen
  def popen(cmd, **kw):
    p = real(["sleep", "600"], **kw)
    open(sys.argv[1], "w").write(str(p.pid))
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    return p
  subprocess.Popen = popen
  ctx = types.SimpleNamespace(
      quick=True, device={"platform": "cpu", "jax_platforms": "cpu"}, child=None,
      args=types.SimpleNamespace(tests_s=600.0, test_workers=0, compile_cache=""),
      budget=types.SimpleNamespace(elapsed=lambda: 0.0), out=sys.argv[2], write=lambda: None)
  cli.main_guard(lambda argv: dc.tests_part(ctx, {}, 600.0))
""")


def test_ctrl_c_in_device_check_stops_its_pytest_child(tmp_path):
  pid_file = tmp_path / "pid"
  r = _run(["-c", CHILD_RUNNER, str(pid_file), str(tmp_path / "device")], timeout=120)
  pid = int(pid_file.read_text())
  try:
    os.kill(pid, 0)
    alive = True
  except ProcessLookupError:
    alive = False
  finally:
    with contextlib.suppress(ProcessLookupError):
      os.kill(pid, signal.SIGKILL)
  assert not alive, "the pytest child outlived device_check"
  assert r.returncode == 130 and r.stderr.strip() == "interrupted (Ctrl-C): stopped", r.stderr


# -- 4. one run per workdir ----------------------------------------------------------------------

def test_workdir_lock_is_shared_within_a_process_and_exclusive_across(tmp_path):
  from train.workdir import WorkdirBusyError, WorkdirLock
  a, b = WorkdirLock(str(tmp_path)), WorkdirLock(str(tmp_path))
  a.acquire()
  b.acquire()                       # train.loop.train inside a command that holds the lock
  other = open(tmp_path / "train.lock", "a+")       # another process's view: a file of its own
  try:
    for holder in (a, b):
      with pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
      holder.release()
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)                # free after the last release
    with pytest.raises(WorkdirBusyError):
      WorkdirLock(str(tmp_path)).acquire()
  finally:
    other.close()


def test_a_second_smollm_mtp_device_run_on_a_busy_workdir_generates_nothing(tmp_path,
                                                                           monkeypatch, capsys):
  from scripts import smollm_mtp_device as smd
  stage = tmp_path / "stage"
  stage.mkdir()
  holder = open(stage / "train.lock", "a+")          # the first run holds the workdir
  fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
  done = []
  monkeypatch.setattr(smd, "ensure_init_workdir", lambda *a, **k: done.append("init"))
  monkeypatch.setattr(smd, "generate", lambda *a, **k: done.append("generate") or [])
  try:
    rc = smd.main(["--quick", "--workdir", str(stage), "--out", str(tmp_path / "r"),
                   "--base_workdir", str(tmp_path / "b"), "--init_workdir", str(tmp_path / "i"),
                   "--data_dir", str(tmp_path / "d"),
                   "--modules_out", str(tmp_path / "m.safetensors")])
  finally:
    holder.close()
  assert rc == 2 and done == []
  _one_error_line(capsys.readouterr().err, "is in use by another")


# -- 5. a full disk ------------------------------------------------------------------------------

def test_main_guard_makes_a_full_disk_one_line_and_status_2(capsys):
  def main(argv):
    raise OSError(errno.ENOSPC, "No space left on device", "/x/r.json")
  with pytest.raises(SystemExit) as e:
    cli.main_guard(main)
  assert e.value.code == 2
  assert capsys.readouterr().err == "error: no space left on device writing /x/r.json\n"


def test_export_modules_out_on_a_full_disk_is_one_line_and_status_2(chat_workdir, full_disk):
  out = os.path.join(full_disk, "m.safetensors")
  r = _run(["-m", "mtp.export", "--workdir", chat_workdir, "--modules_out", out], timeout=300)
  assert r.returncode == 2, r.stderr[-3000:]
  assert r.stderr.strip() == f"error: no space left on device writing {out}", r.stderr[-3000:]
  assert os.listdir(full_disk) == ["filler"]


# -- 6. a closed stdout --------------------------------------------------------------------------

def test_decode_into_a_closed_pipe_ends_quietly_with_141(chat_workdir):
  p = subprocess.Popen([sys.executable, "-m", "decode", "--workdir", chat_workdir, "--prompt",
                        "hello", "--method", "ar", "--max_new_tokens", "16"], cwd=REPO,
                       env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  p.stdout.close()                   # `| head -c 10` went away before the answer
  _, err = p.communicate(timeout=300)
  assert p.returncode == 141, err[-3000:]
  assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err
