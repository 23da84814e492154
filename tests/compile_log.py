"""Per-test XLA compile seconds, for keeping the suite fast (docs/testing.md).

With ``MTP_TEST_COMPILE_LOG=FILE`` the test session empties FILE, then each
test process (each xdist worker) appends one JSON line per test: ``{"test":
nodeid, "trace_s": seconds tracing to jaxprs, "lower_s": lowering them to
MLIR, "compile_s": getting executables (compiling, or loading one from the
persistent cache), "programs": executables got, "cache_hits": of those, the
ones loaded, "misses": [[program name, cache key, seconds], ...] for each
executable compiled (not loaded), "worker": the xdist worker ("main"
without xdist), "start": Unix time the test began, "wall_s": its
seconds}``, counted from JAX's monitoring events over the test's setup,
call and teardown. Only the session's own processes write: a pytest that a
test starts (``scripts.device_check --quick``, a crashed test's rerun) logs
nothing. Without the variable nothing is registered. ``python -m
tests.compile_log FILE`` sums it by file, says how busy each worker was
(the idle tail is the suite's wall time that one worker spent waiting) and
which programs were compiled more than once (by two workers at the same
time, or after the cache was bypassed): seconds that sharing would save.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import pytest

ENV = "MTP_TEST_COMPILE_LOG"
_OWNER = "MTP_TEST_COMPILE_LOG_SESSION"     # set by the session that logs; its children skip
_COUNTS = {"trace_s": 0.0, "lower_s": 0.0, "compile_s": 0.0, "programs": 0, "cache_hits": 0}
_DURATIONS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
              "/jax/core/compile/backend_compile_duration": "compile_s"}
_path: str | None = None
_worker = "main"                              # this process's xdist worker id
_MISSES: list = []                            # [name, key, seconds] per compiled executable
_pending: list = []                           # the cache miss whose compile is timing now


def _note_miss(log_miss):
  """Wraps jax's cache-miss log call: remembers (module name, key) for the
  compile that follows it."""
  def note(module_name, cache_key, *a, **k):
    _pending[:] = [module_name, str(cache_key)[-16:]]   # the key's hash ends it
    return log_miss(module_name, cache_key, *a, **k)
  return note


def _on_duration(event: str, secs: float, **_) -> None:
  if event in _DURATIONS:
    _COUNTS[_DURATIONS[event]] += secs
  if event == "/jax/core/compile/backend_compile_duration":
    _COUNTS["programs"] += 1
    if _pending:
      _MISSES.append([*_pending, secs])
      _pending.clear()


def _on_event(event: str, **_) -> None:
  if event == "/jax/compilation_cache/cache_hits":
    _COUNTS["cache_hits"] += 1


def pytest_configure(config):
  """The controller (or a lone process) makes FILE empty, or stops with one
  line when it cannot write it; xdist workers log; nested sessions do not."""
  global _path, _worker
  path = os.environ.get(ENV)
  if not path:
    return
  worker = hasattr(config, "workerinput")
  if not worker:
    if os.environ.get(_OWNER):
      return                                   # a pytest started by a test of a logging session
    path = os.path.abspath(path)
    try:
      open(path, "w").close()
    except OSError as e:
      raise pytest.UsageError(f"{ENV}={path}: cannot write it ({e.strerror})") from None
    os.environ[ENV] = path                      # the workers (other cwd) get the absolute path
    os.environ[_OWNER] = str(os.getpid())
  _path = path
  _worker = config.workerinput["workerid"] if worker else "main"
  from jax import monitoring
  try:        # jax's private hook; without it rows have no misses
    from jax._src import compiler
    compiler.log_persistent_cache_miss = _note_miss(compiler.log_persistent_cache_miss)
  except (ImportError, AttributeError):
    pass
  monitoring.register_event_duration_secs_listener(_on_duration)
  monitoring.register_event_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  before, start = dict(_COUNTS), time.time()
  _MISSES.clear()
  yield
  if _path:
    row = {"test": item.nodeid, **{k: _COUNTS[k] - before[k] for k in _COUNTS},
           "misses": list(_MISSES), "worker": _worker, "start": start,
           "wall_s": time.time() - start}
    fd = os.open(_path, os.O_WRONLY | os.O_APPEND)   # one write per line: lines do not interleave
    try:
      os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
      os.close(fd)


def read(path: str) -> list[dict]:
  """The log's rows, parsed once for every summary below. Raises ValueError naming FILE:LINE for a line that is
  not a row. Rows from before worker/start/wall_s were logged get None/0."""
  rows = []
  with open(path) as f:
    for i, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
        rows.append({"file": row["test"].split("::")[0], **{k: row[k] + 0 for k in _COUNTS},   # + 0: TypeError on a non-number
                     "wall_s": float(row.get("wall_s", 0.0)), "worker": row.get("worker"),
                     "start": row.get("start"),
                     "misses": [(str(n), str(k), float(t)) for n, k, t in row.get("misses", [])]})
      except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{path}:{i}: not a row of {ENV}: {line.strip()[:80]}") from None
  return rows


def summarize(rows: list[dict]) -> list[tuple[str, dict]]:
  """[(file, its summed counts and wall_s)] from ``read``'s rows, the most
  wall seconds first (then trace + lower + compile seconds)."""
  by_file = collections.defaultdict(lambda: dict.fromkeys((*_COUNTS, "wall_s"), 0))
  for row in rows:
    acc = by_file[row["file"]]
    for k in acc:
      acc[k] += row[k]
  busy = lambda c: c["trace_s"] + c["lower_s"] + c["compile_s"]
  return sorted(by_file.items(), key=lambda r: (-r[1]["wall_s"], -busy(r[1])))


def workers(rows: list[dict]) -> dict[str, dict]:
  """{worker: {"tests_s": seconds in its tests, "done_s": when its last test
  ended, counted from the first test's start}}; empty for a log without
  worker and start fields. A worker's idle tail is max(done_s) - its done_s."""
  rows = [r for r in rows if r["worker"] is not None and r["start"] is not None]
  if not rows:
    return {}
  t0 = min(r["start"] for r in rows)
  out: dict[str, dict] = {}
  for r in rows:
    w = out.setdefault(r["worker"], {"tests_s": 0.0, "done_s": 0.0})
    w["tests_s"] += r["wall_s"]
    w["done_s"] = max(w["done_s"], r["start"] + r["wall_s"] - t0)
  return dict(sorted(out.items()))


def repeated_compiles(rows: list[dict]) -> list[dict]:
  """Programs compiled more than once, by cache key: [{"name", "compiles",
  "repeat_s": the seconds of every compile after the first (in log order),
  "files": the test files that compiled it}], the most repeat_s first."""
  by_key: dict[str, dict] = {}
  for row in rows:
    for name, key, secs in row["misses"]:
      r = by_key.setdefault(key, {"name": name, "compiles": 0, "repeat_s": 0.0, "files": []})
      r["repeat_s"] += secs if r["compiles"] else 0.0
      r["compiles"] += 1
      if row["file"] not in r["files"]:
        r["files"].append(row["file"])
  return sorted((r for r in by_key.values() if r["compiles"] > 1), key=lambda r: -r["repeat_s"])


def by_program(rows: list[dict]) -> list[tuple[str, int, float]]:
  """[(program name, compiles, seconds)] over the log's compiled (not
  loaded) executables, the most seconds first."""
  acc: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
  for row in rows:
    for name, _, secs in row["misses"]:
      acc[name][0] += 1
      acc[name][1] += secs
  return sorted(((n, c, t) for n, (c, t) in acc.items()), key=lambda r: -r[2])


def _repeat_lines(reps: list[dict], top: int = 8) -> str:
  """A total line, then the ``top`` programs with the most repeat seconds."""
  lines = [f"compiled more than once: {len(reps)} programs, "
           f"{sum(r['compiles'] - 1 for r in reps)} repeat compiles, "
           f"{sum(r['repeat_s'] for r in reps):.1f} s"]
  lines += [f"  {r['repeat_s']:6.1f} s  {r['compiles']}x  {r['name']}  {' '.join(r['files'])}"
            for r in reps[:top]]
  return "\n".join(lines)


def _table(rows: list[tuple[str, dict]]) -> str:
  """Rows and their total; ``compiled`` = programs - cache_hits."""
  keys = ("wall_s", "trace_s", "lower_s", "compile_s", "programs", "cache_hits", "compiled")
  total = {k: sum(c.get(k, 0) for _, c in rows) for k in (*_COUNTS, "wall_s")}
  lines = ["".join(f"{k:>11}" for k in keys) + "  file"]
  for name, c in rows + [("total", total)]:
    c = {**c, "compiled": c["programs"] - c["cache_hits"]}
    lines.append("".join(f"{float(c[k]):11.1f}" if k.endswith("_s") else f"{int(c[k]):11d}"
                         for k in keys) + f"  {name}")
  return "\n".join(lines)


def _worker_lines(ws: dict[str, dict]) -> str:
  """One line per worker: seconds in tests, when it finished, its idle tail."""
  end = max((w["done_s"] for w in ws.values()), default=0.0)
  return "\n".join(f"worker {name}: {w['tests_s']:.1f} s in tests, done at {w['done_s']:.1f} s, "
                   f"idle tail {end - w['done_s']:.1f} s" for name, w in ws.items())


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m tests.compile_log",
                               description=f"Sum a {ENV} file by test file.")
  ap.add_argument("log", help=f"the file {ENV} named")
  ap.add_argument("--programs", action="store_true",
                  help="instead: compile seconds by program name (jit_generate, jit_round, ...)")
  args = ap.parse_args(argv)
  try:
    log = read(args.log)
  except (OSError, ValueError) as e:
    raise SystemExit(f"tests.compile_log: {e}") from None
  if not log:
    raise SystemExit(f"tests.compile_log: {args.log} has no rows (was {ENV} set for a run?)")
  if args.programs:
    progs = by_program(log)
    print(f"{'compile_s':>11}{'compiles':>11}  program")
    print("\n".join(f"{t:11.1f}{c:11d}  {n}" for n, c, t in progs))
    return 0
  print(_table(summarize(log)))
  ws, reps = workers(log), repeated_compiles(log)
  if ws:
    print(_worker_lines(ws))
  if reps:
    print(_repeat_lines(reps))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
