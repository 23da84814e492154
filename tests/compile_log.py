"""Per-test XLA compile seconds, for keeping the suite fast (docs/testing.md).

With ``MTP_TEST_COMPILE_LOG=FILE`` each test process (each xdist worker)
appends one JSON line per test to FILE: ``{"test": nodeid, "trace_s":
seconds tracing to jaxprs, "lower_s": lowering them to MLIR, "compile_s":
in XLA compiles, "compiles": count, "cache_hits": programs loaded from the
persistent cache}``, counted from JAX's monitoring events over the test's
setup, call and teardown (this process only, not its subprocesses). Without the variable nothing is
registered. ``python -m tests.compile_log FILE`` sums it by file.
"""

from __future__ import annotations

import collections
import json
import os
import sys

import pytest

_COUNTS = {"trace_s": 0.0, "lower_s": 0.0, "compile_s": 0.0, "compiles": 0, "cache_hits": 0}
_DURATIONS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
              "/jax/core/compile/backend_compile_duration": "compile_s"}


def _on_duration(event: str, secs: float, **_) -> None:
  if event in _DURATIONS:
    _COUNTS[_DURATIONS[event]] += secs
  if event == "/jax/core/compile/backend_compile_duration":
    _COUNTS["compiles"] += 1


def _on_event(event: str, **_) -> None:
  if event == "/jax/compilation_cache/cache_hits":
    _COUNTS["cache_hits"] += 1


def pytest_configure(config):
  if os.environ.get("MTP_TEST_COMPILE_LOG"):
    from jax import monitoring
    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  path = os.environ.get("MTP_TEST_COMPILE_LOG")
  before = dict(_COUNTS)
  yield
  if path:
    row = {"test": item.nodeid, **{k: _COUNTS[k] - before[k] for k in _COUNTS}}
    with open(path, "a") as f:       # one short line per write: appends do not interleave
      f.write(json.dumps(row) + "\n")


def summarize(path: str) -> list[tuple[str, dict]]:
  """[(file, its summed counts)] from a log, the most trace + lower +
  compile seconds first."""
  by_file = collections.defaultdict(lambda: dict.fromkeys(_COUNTS, 0))
  for line in open(path):
    row = json.loads(line)
    acc = by_file[row["test"].split("::")[0]]
    for k in acc:
      acc[k] += row.get(k, 0)
  busy = lambda c: c["trace_s"] + c["lower_s"] + c["compile_s"]
  return sorted(by_file.items(), key=lambda r: -busy(r[1]))


if __name__ == "__main__":
  rows = summarize(sys.argv[1])
  total = dict.fromkeys(_COUNTS, 0)
  print("".join(f"{k:>11}" for k in _COUNTS) + "  file")
  for f, c in rows + [("total", total)]:
    for k in _COUNTS:
      total[k] += c[k] if f != "total" else 0
    print("".join(f"{c[k]:11.1f}" if isinstance(c[k], float) else f"{c[k]:11d}"
                  for k in _COUNTS) + f"  {f}")
