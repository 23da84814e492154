"""Per-test XLA compile seconds, for keeping the suite fast (docs/testing.md).

With ``MTP_TEST_COMPILE_LOG=FILE`` each test process (each xdist worker)
appends one JSON line per test to FILE: ``{"test": nodeid, "compile_s":
seconds in backend compiles, "compiles": count, "cache_hits": programs
loaded from the persistent cache}``, counted from JAX's monitoring events
over the test's setup, call and teardown. Without the variable nothing is
registered. ``python -m tests.compile_log FILE`` sums it by file.
"""

from __future__ import annotations

import collections
import json
import os
import sys

import pytest

_COUNTS = {"compile_s": 0.0, "compiles": 0, "cache_hits": 0}


def _on_duration(event: str, secs: float, **_) -> None:
  if event == "/jax/core/compile/backend_compile_duration":
    _COUNTS["compile_s"] += secs
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


def summarize(path: str) -> list[tuple[str, float, int, int]]:
  """[(file, compile_s, compiles, cache_hits)] from a log, most compile time first."""
  by_file = collections.defaultdict(lambda: [0.0, 0, 0])
  for line in open(path):
    row = json.loads(line)
    acc = by_file[row["test"].split("::")[0]]
    acc[0] += row["compile_s"]
    acc[1] += row["compiles"]
    acc[2] += row["cache_hits"]
  return sorted(((f, *v) for f, v in by_file.items()), key=lambda r: -r[1])


if __name__ == "__main__":
  rows = summarize(sys.argv[1])
  print(f"{'compile_s':>10} {'compiles':>8} {'hits':>6}  file")
  for f, s, n, h in rows:
    print(f"{s:10.1f} {n:8d} {h:6d}  {f}")
  print(f"{sum(r[1] for r in rows):10.1f} {sum(r[2] for r in rows):8d} "
        f"{sum(r[3] for r in rows):6d}  total")
