"""Issue 50, item 4: docstrings in mtp/, train/ and decode/ are contracts (what, shapes, dtypes, units, errors, the equation), with
history and measurements in docs/ or CHANGELOG.md. Checks what can be checked
cheaply: no docstring there is longer than MAX_LINES lines, and the core
files stay near 20 % docstring."""

import ast
import glob
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 15
CORE = {"mtp/model.py": 0.25, "train/losses.py": 0.25, "train/loop.py": 0.25,
        "train/workdir.py": 0.25, "mtp/checkpoint.py": 0.25,
        "decode/drafters.py": 0.25, "decode/sampling.py": 0.25, "decode/state.py": 0.25,
        "decode/auto/schedule.py": 0.25, "decode/auto/calibrate.py": 0.25,
        "decode/decoder.py": 0.25, "decode/acceptance.py": 0.25, "decode/round.py": 0.25,
        "decode/loops.py": 0.25, "decode/compiled.py": 0.25}   # file -> largest docstring share


def _files():
  pats = ("mtp/**/*.py", "train/*.py", "decode/**/*.py")
  return sorted({os.path.relpath(p, REPO) for pat in pats
                 for p in glob.glob(os.path.join(REPO, pat), recursive=True)})


def _docstrings(path):
  """[(name, first line, number of lines)] of every module, class and function docstring."""
  src = open(os.path.join(REPO, path), encoding="utf-8").read()
  out = []
  for node in ast.walk(ast.parse(src)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
          and isinstance(body[0].value.value, str)):
        d = body[0]
        out.append((getattr(node, "name", "<module>"), d.lineno, d.end_lineno - d.lineno + 1))
  return out, len(src.splitlines())


def test_no_docstring_over_max_lines():
  long = [f"{path}:{line} {name} ({n} lines)" for path in _files()
          for name, line, n in _docstrings(path)[0] if n > MAX_LINES]
  assert not long, f"docstrings over {MAX_LINES} lines (move history to docs/ or CHANGELOG.md): {long}"


def test_core_files_docstring_share():
  over = []
  for path, limit in CORE.items():
    docs, total = _docstrings(path)
    share = sum(n for _, _, n in docs) / max(total, 1)
    if share > limit:
      over.append(f"{path}: {share:.0%} > {limit:.0%}")
  assert not over, over
