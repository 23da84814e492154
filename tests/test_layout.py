"""The layout rules of docs/design.md section 2, checked on the source:
arrows one way between the packages, no import cycle anywhere (imports
inside functions count too), no script importing another script or editing
sys.path."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("mtp", "train", "decode", "scripts")


def _module_name(path: pathlib.Path) -> str:
  rel = path.relative_to(ROOT).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
  """module -> the project modules it imports (module level or inside
  functions; ``from pkg import mod`` counts as importing pkg.mod)."""
  files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
  names = {_module_name(p) for p in files}
  graph = {}
  for p in files:
    mod = _module_name(p)
    deps = set()
    for node in ast.walk(ast.parse(p.read_text(), str(p))):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
      else:
        continue
      for t in targets:
        while t and t not in names:
          t = t.rpartition(".")[0]
        if t and t != mod and not mod.startswith(t + ".") and not (
            p.name == "__init__.py" and t.startswith(mod + ".")):
          deps.add(t)
    graph[mod] = deps
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """A cycle as a list of modules, or None."""
  state, stack = {}, []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for d in sorted(graph.get(m, ())):
      if state.get(d) == 1:
        return stack[stack.index(d):] + [d]
      if d not in state and (c := visit(d)):
        return c
    state[m] = 2
    stack.pop()
    return None

  for m in sorted(graph):
    if m not in state and (c := visit(m)):
      return c
  return None


def test_no_import_cycle_and_arrows_one_way():
  graph = import_graph()
  assert find_cycle(graph) is None, find_cycle(graph)
  top = lambda m: m.split(".")[0]
  allowed = {"mtp": {"mtp"}, "train": {"mtp", "train"}, "decode": {"mtp", "decode"},
             "scripts": {"mtp", "train", "decode", "scripts"}}
  for mod, deps in graph.items():
    for d in deps:
      assert top(d) in allowed[top(mod)], f"{mod} imports {d}"


def test_cycle_finder_finds_a_cycle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_scripts_are_thin_clis():
  graph = import_graph()
  for mod, deps in graph.items():
    if mod.startswith("scripts.") and mod != "scripts":
      assert not any(d.startswith("scripts") for d in deps), f"{mod} imports {deps}"
  for p in (ROOT / "scripts").rglob("*.py"):
    assert "sys.path" not in p.read_text(), f"{p} edits sys.path"
