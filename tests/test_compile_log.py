"""tests/compile_log.py: per-test compile counts, written only when asked."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from tests import compile_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, log: str | None, nested: bool = False):
  test = tmp_path / "test_two.py"
  test.write_text(textwrap.dedent("""
      import jax, jax.numpy as jnp

      def test_compiles():
        assert jax.jit(lambda x: x * 3 + 1)(jnp.arange(5)).sum() == 35

      def test_plain():
        assert 1 + 1 == 2
  """))
  env = {k: v for k, v in os.environ.items() if k not in (compile_log.ENV, compile_log._OWNER)}
  env.update(PYTHONPATH=ROOT, **({compile_log.ENV: log} if log else {}),   # this backend
             **({compile_log._OWNER: "1"} if nested else {}))
  env["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(dir=tmp_path)   # a fresh compile, no hit
  return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "-p", "tests.compile_log", str(test)],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_one_line_per_test_a_fresh_file_per_session_and_nothing_when_not_asked(tmp_path):
  log = tmp_path / "compile.jsonl"
  assert _run(tmp_path, None).returncode == 0
  assert not log.exists()
  log.write_text('{"test": "old::row"}\n')               # a previous session's rows go
  assert _run(tmp_path, "compile.jsonl").returncode == 0   # relative to the session's cwd
  rows = {r["test"].split("::")[1]: r for r in map(json.loads, log.read_text().splitlines())}
  assert set(rows) == {"test_compiles", "test_plain"}
  got = rows["test_compiles"]
  assert got["programs"] >= 1 and got["compile_s"] > 0 and got["cache_hits"] == 0
  assert got["trace_s"] > 0 and got["lower_s"] > 0
  assert len(got["misses"]) == got["programs"] >= 1            # each compile, its key
  assert all(n.startswith("jit_") and len(k) == 16 and t > 0 for n, k, t in got["misses"])
  assert got["worker"] == "main" and got["wall_s"] > 0   # no xdist here (env from a worker or not)
  assert got["start"] <= rows["test_plain"]["start"]            # the file's order
  assert rows["test_plain"]["programs"] == 0 and rows["test_plain"]["compile_s"] == 0
  (name, counts), = compile_log.summarize(compile_log.read(str(log)))
  assert name.endswith("test_two.py") and counts["programs"] == got["programs"]
  # a pytest that a test of a logging session starts writes nothing
  before = log.read_text()
  assert _run(tmp_path, str(log), nested=True).returncode == 0
  assert log.read_text() == before


def test_an_unwritable_log_stops_the_session_before_any_test(tmp_path):
  out = _run(tmp_path, str(tmp_path / "no_such_dir" / "x.jsonl"))
  assert out.returncode == 4, out.stdout + out.stderr
  assert "MTP_TEST_COMPILE_LOG=" in out.stderr and "cannot write it" in out.stderr
  assert "passed" not in out.stdout


def test_summary_table_adds_up_and_bad_logs_get_one_line(tmp_path, capsys):
  log = tmp_path / "c.jsonl"
  row = lambda t, p, h, w, start, wall, misses: json.dumps(
      {"test": t, "trace_s": 1.0, "lower_s": 0.5, "compile_s": 2.0, "programs": p,
       "cache_hits": h, "misses": misses, "worker": w, "start": start, "wall_s": wall})
  f, g = ("jit_f", "k1" * 8), ("jit_g", "k2" * 8)
  log.write_text("\n".join([row("tests/a.py::x", 5, 1, "gw0", 100.0, 4.0, [[*f, 1.0], [*g, 0.5]]),
                            row("tests/a.py::y", 3, 0, "gw1", 100.5, 2.5, [[*f, 1.5]]),
                            row("tests/b.py::z", 2, 2, "gw1", 103.0, 7.5,
                                [[*f, 0.7], [*g, 0.4], ["jit_h", "k3" * 8, 9.0]])]) + "\n\n")
  assert compile_log.main([str(log)]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].split() == ["wall_s", "trace_s", "lower_s", "compile_s", "programs",
                              "cache_hits", "compiled", "file"]
  assert lines[1].split() == ["7.5", "1.0", "0.5", "2.0", "2", "2", "0", "tests/b.py"]
  assert lines[2].split() == ["6.5", "2.0", "1.0", "4.0", "8", "1", "7", "tests/a.py"]
  assert lines[3].split() == ["14.0", "3.0", "1.5", "6.0", "10", "3", "7", "total"]
  # gw0 ran 100-104, gw1 100.5-103 and 103-110.5: gw0 then waited 6.5 s for gw1
  assert lines[4] == "worker gw0: 4.0 s in tests, done at 4.0 s, idle tail 6.5 s"
  assert lines[5] == "worker gw1: 10.0 s in tests, done at 10.5 s, idle tail 0.0 s"
  # jit_f compiled 3 times (1.5 + 0.7 s after its first), jit_g twice (0.4 s), jit_h once
  assert lines[6] == "compiled more than once: 2 programs, 3 repeat compiles, 2.6 s"
  assert lines[7].split() == ["2.2", "s", "3x", "jit_f", "tests/a.py", "tests/b.py"]
  assert lines[8].split() == ["0.4", "s", "2x", "jit_g", "tests/a.py", "tests/b.py"]
  assert len(lines) == 9
  assert compile_log.main([str(log), "--programs"]) == 0
  assert [ln.split() for ln in capsys.readouterr().out.splitlines()] == [
      ["compile_s", "compiles", "program"], ["9.0", "1", "jit_h"], ["3.2", "3", "jit_f"],
      ["0.9", "2", "jit_g"]]
  # a log written before worker, start and wall_s were logged: the table, no worker lines
  old = {"test": "tests/a.py::x", "trace_s": 1.0, "lower_s": 0.5, "compile_s": 2.0,
         "programs": 5, "cache_hits": 1}
  log.write_text(json.dumps(old) + "\n")
  assert compile_log.main([str(log)]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[1].split() == ["0.0", "1.0", "0.5", "2.0", "5", "1", "4", "tests/a.py"]
  assert len(lines) == 3
  log.write_text(json.dumps(old) + "\n" + '{"test": "t::u", "trace_s"\n')
  with pytest.raises(SystemExit, match=r"c\.jsonl:2: not a row of MTP_TEST_COMPILE_LOG"):
    compile_log.main([str(log)])
  log.write_text(json.dumps({**old, "programs": "five"}) + "\n")
  with pytest.raises(SystemExit, match=r"c\.jsonl:1: not a row"):
    compile_log.main([str(log)])
  log.write_text("")
  with pytest.raises(SystemExit, match="has no rows"):
    compile_log.main([str(log)])
  with pytest.raises(SystemExit, match="No such file"):
    compile_log.main([str(tmp_path / "missing.jsonl")])

