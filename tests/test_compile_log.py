"""tests/compile_log.py: per-test compile counts, written only when asked."""

import json
import os
import subprocess
import sys
import textwrap

from tests import compile_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, log: str | None):
  test = tmp_path / "test_two.py"
  test.write_text(textwrap.dedent("""
      import jax, jax.numpy as jnp

      def test_compiles():
        assert jax.jit(lambda x: x * 3 + 1)(jnp.arange(5)).sum() == 35

      def test_plain():
        assert 1 + 1 == 2
  """))
  env = {k: v for k, v in os.environ.items() if k != "MTP_TEST_COMPILE_LOG"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             **({"MTP_TEST_COMPILE_LOG": log} if log else {}))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)       # a fresh compile, not a cache hit
  out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "tests.compile_log", str(test)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout + out.stderr


def test_one_line_per_test_with_its_compiles_and_nothing_without_the_variable(tmp_path):
  log = tmp_path / "compile.jsonl"
  _run(tmp_path, None)
  assert not log.exists()
  _run(tmp_path, str(log))
  rows = {r["test"].split("::")[1]: r for r in map(json.loads, log.read_text().splitlines())}
  assert set(rows) == {"test_compiles", "test_plain"}
  assert rows["test_compiles"]["compiles"] >= 1 and rows["test_compiles"]["compile_s"] > 0
  assert rows["test_compiles"]["trace_s"] > 0 and rows["test_compiles"]["lower_s"] > 0
  assert rows["test_plain"]["compiles"] == 0 and rows["test_plain"]["compile_s"] == 0
  (name, counts), = compile_log.summarize(str(log))
  assert name.endswith("test_two.py")
  assert counts["compiles"] == rows["test_compiles"]["compiles"]
