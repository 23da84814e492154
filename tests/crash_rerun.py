"""A crashed pytest-xdist worker gets one rerun, in a fresh process.

``make test`` runs the files on 2 xdist workers with ``--max-worker-restart
0`` (a restart can hang ``--dist loadfile``, pytest-xdist issue 784). About
one full run in ten, a worker died of a segfault inside jaxlib (XLA's CPU
compiler; seen 2026-12-03 locally and in CI on
``tests/test_bench_cache_length.py``, which passes alone every time) after
hundreds of compilations in the same process. A crash is not a test failing:
the test never finished. This plugin, on the xdist controller:

- records the test each crashed worker was running
  (``pytest_handlecrashitem``) and every report;
- at the end, when every failure of the run is a worker crash (a run with any
  ordinary failure keeps its failure status and reruns nothing), reruns the
  crashed tests and any collected test that never reported (a crash also
  stops the run), once, in one fresh ``python -m pytest`` subprocess without
  xdist;
- sets the exit status to that rerun's, and says so in the summary: the
  crashed test, the rerun's command and result.

A test that crashes twice fails the run. The rerun is off with
``MTP_NO_CRASH_RERUN=1`` and when the crashes exceed ``MAX_RERUN`` tests.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

MAX_RERUN = 64   # more never-finished tests than this is not one flaky crash
_STATE_KEY = pytest.StashKey[dict]()


def _state(config) -> dict:
  if _STATE_KEY not in config.stash:
    config.stash[_STATE_KEY] = dict(collected=None, crashed=[], failed=set(), reported=set())
  return config.stash[_STATE_KEY]


def _is_controller(config) -> bool:
  """Not an xdist worker (the controller, or a run without xdist, where no
  worker can crash and the recorder stays idle)."""
  return not hasattr(config, "workerinput")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
  st = _state(node.config)
  if st["collected"] is None:
    st["collected"] = list(ids)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
  _state(report.node.config)["crashed"].append(crashitem)


def rerun_plan(collected: list[str] | None, crashed: list[str], failed: set[str],
               reported: set[str], max_rerun: int = MAX_RERUN) -> tuple[list[str], str]:
  """Which tests to rerun after a run whose workers crashed.

  Args:
    collected: node ids the workers collected (None: unknown).
    crashed: node ids a worker was running when it died.
    failed: node ids with a failed report (crash reports included).
    reported: node ids with any report.
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
  if len(todo) > max_rerun:
    return [], f"{len(todo)} tests never finished (more than {max_rerun})"
  return todo, ""


class _Recorder:
  """Controller-side report recorder (a plugin object, so it holds the config:
  on the controller, pytest_runtest_logreport sees the workers' reports and
  the crash reports)."""

  def __init__(self, config):
    self.config = config

  def pytest_runtest_logreport(self, report):
    st = _state(self.config)
    st["reported"].add(report.nodeid)
    if report.failed:
      st["failed"].add(report.nodeid)

  @pytest.hookimpl(trylast=True)
  def pytest_sessionfinish(self, session, exitstatus):
    st = _state(self.config)
    if not st["crashed"] or os.environ.get("MTP_NO_CRASH_RERUN") == "1":
      return
    tr = self.config.pluginmanager.get_plugin("terminalreporter")
    say = (lambda s: tr.write_line(s, yellow=True, bold=True)) if tr else print
    todo, why = rerun_plan(st["collected"], st["crashed"], st["failed"], st["reported"])
    say(f"\nworker crash while running {', '.join(st['crashed'])}")
    if not todo:
      say(f"no rerun: {why}")
      return
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
           "--rootdir", str(self.config.rootpath), *todo]
    say(f"rerunning {len(todo)} test(s) once in a fresh process: {' '.join(cmd[1:6])} ...")
    sys.stdout.flush()
    rc = subprocess.call(cmd, cwd=str(self.config.rootpath))
    self.verdict = (f"crash rerun: {'passed' if rc == 0 else f'FAILED (exit {rc})'}: the "
                    f"worker crash in {', '.join(st['crashed'])} reported above was rerun in a "
                    f"fresh process; the run's exit status is the rerun's ({rc})")
    say(self.verdict)
    session.exitstatus = pytest.ExitCode.OK if rc == 0 else pytest.ExitCode.TESTS_FAILED

  def pytest_unconfigure(self, config):
    if getattr(self, "verdict", None):   # again below the summary's "1 failed" line
      print(self.verdict, flush=True)


def pytest_configure(config):
  if _is_controller(config):
    config.pluginmanager.register(_Recorder(config), "mtp_crash_rerun_recorder")
