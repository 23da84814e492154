"""A crashed pytest-xdist worker gets one rerun, in a fresh process.

``make test`` runs the files on 2 xdist workers with ``--max-worker-restart
0`` (a restart can hang ``--dist loadfile``, pytest-xdist issue 784). A
worker can die of a segfault inside jaxlib in a test that passes alone
(docs/testing.md lists those seen). A crash is not a test failing: the test
never finished. This plugin, on the xdist controller:

- records the test each crashed worker was running
  (``pytest_handlecrashitem``) and every report; a test that failed with
  ``SystemError`` counts as crashed too: CPython raises it for an internal
  error of the interpreter or of a C extension (jaxlib's "error return
  without exception set"), never for a test's own assertion;
- at the end, when every failure of the run is a worker crash (a run with any
  ordinary failure keeps its failure status and reruns nothing), reruns the
  crashed tests and any collected test that never reported (a crash also
  stops the run), once, in one fresh ``python -m pytest`` subprocess without
  xdist;
- sets the exit status to that rerun's, and says so in the summary: the
  crashed test, the rerun's command and result.

A test that crashes twice fails the run. Nothing is rerun when the run was
interrupted or had collection errors, when any test failed without a crash,
when the crashes left more than ``MAX_RERUN_SHARE`` of the collected tests
unfinished (with ``--max-worker-restart 0`` a crash also drops the rest of
that worker's files: in CI on 2026-12-04 a crash at 90 % left 65 of 693), or with
``MTP_NO_CRASH_RERUN=1``. The rerun gets the run's own options (``-W``,
``-o``, ``-p``, ...) without the xdist ones. A limit by design: a crash
that only happens after some other test ran in the same process passes
when the crashed test reruns alone; the summary names every crash, so a
crash that recurs run after run at the same test shows there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A crash drops the rest of its worker's files; more than about one worker's
# share (of 2) never finishing is not one flaky crash. The serial rerun of a
# worker's share takes about as long as the run did (~23 min on 2 cores).
MAX_RERUN_SHARE = 0.6


def _is_controller(config) -> bool:
  """Not an xdist worker (the controller, or a run without xdist, where no
  worker can crash and the recorder stays idle)."""
  return not hasattr(config, "workerinput")


def rerun_plan(collected: list[str] | None, crashed: list[str], failed: set[str],
               reported: set[str], max_rerun: int | None = None) -> tuple[list[str], str]:
  """Which tests to rerun after a run whose workers crashed.

  Args:
    collected: node ids the workers collected (None: unknown).
    crashed: node ids a worker was running when it died.
    failed: node ids with a failed report (crash reports included).
    reported: node ids with any report.
    max_rerun: most tests to rerun; None: ``MAX_RERUN_SHARE`` of ``collected``
      (at least 64; 64 when the collection is unknown).
  Returns:
    (node ids to rerun, in collection order, crashed ones first when the
    collection is unknown; a reason when nothing is rerun, else "").
  """
  if not crashed:
    return [], "no worker crashed"
  ordinary = sorted(failed - set(crashed))
  if ordinary:
    return [], f"{len(ordinary)} test(s) failed without a crash (first: {ordinary[0]})"
  unrun = [i for i in (collected or []) if i not in reported]
  todo = list(dict.fromkeys(list(crashed) + unrun))
  if collected:
    order = {i: k for k, i in enumerate(collected)}
    todo.sort(key=lambda i: order.get(i, -1))
  if max_rerun is None:
    max_rerun = max(64, int(MAX_RERUN_SHARE * len(collected or [])))
  if len(todo) > max_rerun:
    return [], f"{len(todo)} tests never finished (more than {max_rerun})"
  return todo, ""


# xdist options (with their values) that the rerun, one process without
# xdist, must not get, and --rootdir, which it sets itself; every other
# option of the run is passed on.
_DROPPED = ("-n", "--numprocesses", "--dist", "--max-worker-restart", "--maxprocesses", "--tx",
            "--rsyncdir", "--rsyncignore", "-d", "--looponfail", "-f", "--rootdir")


def rerun_args(invocation: list[str], takes_value: dict[str, bool]) -> list[str]:
  """The run's command-line options for the rerun: ``invocation`` without
  its positional arguments (the run's test paths: the rerun names its
  tests) and without ``_DROPPED`` (``-n 2``, ``-n2``, ``--dist=loadfile``,
  ...). ``takes_value``: option string -> whether it consumes the next
  argument (from pytest's own parser), which tells values from paths."""
  out, i = [], 0
  while i < len(invocation):
    a = invocation[i]
    i += 1
    if not a.startswith("-") or a == "-":
      continue                                   # a test path
    name, has_eq = a.split("=", 1)[0], "=" in a
    value = [] if has_eq or not takes_value.get(name, False) else invocation[i:i + 1]
    i += len(value)
    if name in _DROPPED or (a.startswith("-n") and a[2:].isdigit()):
      continue
    out += [a, *value]
  return out


def _takes_value(config) -> dict[str, bool]:
  p = config._parser   # pytest's own (private) Parser: an argparse parser inside
  parser = p.optparser if hasattr(p, "optparser") else p._getparser()   # pytest >= 9 / 8
  return {opt: action.nargs != 0 for opt, action in parser._option_string_actions.items()}


# Failures that are the process's, not the test's: a report whose exception
# is one of these is recorded as a crash (CPython's SystemError: "internal
# error in the interpreter", e.g. a C extension returning NULL with no error).
INTERPRETER_ERRORS = ("SystemError",)


def interpreter_error(report) -> str | None:
  """The message of a failed report whose exception is an interpreter-level
  error (``INTERPRETER_ERRORS``), else None. Reads ``longrepr.reprcrash``,
  which survives xdist's serialization of reports."""
  crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
  msg = getattr(crash, "message", "") or ""
  name = msg.split(":", 1)[0].strip().rsplit(".", 1)[-1]
  return msg if report.failed and name in INTERPRETER_ERRORS else None


class _Recorder:
  """Controller-side recorder (a plugin object, so it holds the config): on
  the controller, xdist reports the workers' collections and crashes, and
  pytest_runtest_logreport / pytest_collectreport see the workers' reports,
  the crash reports and the collection errors."""

  def __init__(self, config):
    self.config = config
    self.st = dict(collected=None, crashed=[], failed=set(), reported=set(), interpreter={})

  @pytest.hookimpl(optionalhook=True)
  def pytest_xdist_node_collection_finished(self, node, ids):
    st = self.st
    if st["collected"] is None:
      st["collected"] = list(ids)

  @pytest.hookimpl(optionalhook=True)
  def pytest_handlecrashitem(self, crashitem, report, sched):
    self.st["crashed"].append(crashitem)

  def pytest_runtest_logreport(self, report):
    st = self.st
    if report.when in ("teardown", "???"):   # finished (a crash report says "???")
      st["reported"].add(report.nodeid)
    if report.failed:
      st["failed"].add(report.nodeid)
      msg = interpreter_error(report)
      if msg and report.nodeid not in st["crashed"]:
        st["crashed"].append(report.nodeid)
        st["interpreter"][report.nodeid] = msg.splitlines()[0][:120]

  def pytest_collectreport(self, report):
    if report.failed:   # a collection error is a failure of the run, never a crash
      self.st["failed"].add(report.nodeid or "<collection>")

  @pytest.hookimpl(trylast=True)
  def pytest_sessionfinish(self, session, exitstatus):
    st = self.st
    if not st["crashed"] or os.environ.get("MTP_NO_CRASH_RERUN") == "1":
      return
    tr = self.config.pluginmanager.get_plugin("terminalreporter")
    say = (lambda s: tr.write_line(s, yellow=True, bold=True)) if tr else print
    worker = [i for i in st["crashed"] if i not in st["interpreter"]]
    if worker:
      say(f"\nworker crash while running {', '.join(worker)}")
    for nodeid, msg in st["interpreter"].items():
      say(f"\ninterpreter error, treated as a crash: {nodeid} ({msg})")
    if exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
      say(f"no rerun: the run ended with {pytest.ExitCode(exitstatus).name} (interrupted, "
          "collection errors or a usage error), not only with failed tests")
      return
    todo, why = rerun_plan(st["collected"], st["crashed"], st["failed"], st["reported"])
    if not todo:
      say(f"no rerun: {why}")
      return
    inv = self.config.invocation_params
    cmd = [sys.executable, "-m", "pytest", *rerun_args(list(inv.args), _takes_value(self.config)),
           "-p", "no:xdist", "-p", "no:cacheprovider", "--rootdir", str(self.config.rootpath),
           *todo]
    say(f"rerunning {len(todo)} test(s) once in a fresh process: "
        f"{' '.join(cmd[1:len(cmd) - len(todo)])} ...")
    sys.stdout.flush()
    # the rerun does not rerun (an interpreter error there would recurse)
    rc = subprocess.call(cmd, cwd=str(inv.dir), env={**os.environ, "MTP_NO_CRASH_RERUN": "1"})
    self.verdict = (f"crash rerun: {'passed' if rc == 0 else f'FAILED (exit {rc})'}: the "
                    f"crash in {', '.join(st['crashed'])} reported above was rerun in a "
                    f"fresh process; the run's exit status is the rerun's ({rc})")
    say(self.verdict)
    session.exitstatus = pytest.ExitCode.OK if rc == 0 else pytest.ExitCode.TESTS_FAILED

  def pytest_unconfigure(self, config):
    if getattr(self, "verdict", None):   # again below the summary's "1 failed" line
      print(self.verdict, flush=True)


def pytest_configure(config):
  if _is_controller(config):
    config.pluginmanager.register(_Recorder(config), "mtp_crash_rerun_recorder")
