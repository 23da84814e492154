"""The import graph of mtp/, train/, decode/, scripts/ and experiments/ has
no cycle, with imports inside functions counted too (issue 20), and the
rooms' arrows point one way (docs/design.md section 2): mtp imports neither
train nor decode; train and decode do not import each other; nothing
outside scripts/ and experiments/ imports scripts/ (the decoder never
depends on the benchmarks); nothing outside experiments/ imports
experiments/ (the one-off studies; they may import every other room).
decode/ holds the decoder only: no benchmark, replay or self-distillation
module; inside it the engine never imports the CLI side (decode.cli), and
"auto" (decode.auto) imports no engine module but the mesh."""

import ast
import fnmatch
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("mtp", "train", "decode", "scripts", "experiments")


def _modules() -> dict[str, str]:
  """Dotted module name -> file, for every .py under PACKAGES."""
  out = {}
  for pkg in PACKAGES:
    for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
      for f in files:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
          if rel[-1] == "__init__":
            rel = rel[:-1]
          out[".".join(rel)] = os.path.join(dirpath, f)
  return out


def import_graph() -> dict[str, set[str]]:
  """Module -> the project modules it imports anywhere in its file (module
  level or inside functions). ``from a import b`` counts as importing
  ``a.b`` when that is a module, else ``a``. (Importing ``a.b`` also runs
  package ``a``'s ``__init__``; that implicit step is not an edge: a package
  that re-exports its submodules is not a circle.)"""
  mods = _modules()
  graph = {}
  for name, path in mods.items():
    is_pkg = path.endswith("__init__.py")
    edges = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = name.split(".")
          anchor = parts if is_pkg else parts[:-1]
          anchor = anchor[:len(anchor) - node.level + 1]
          base = ".".join(anchor + ([base] if base else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
      else:
        continue
      for t in targets:
        while t and t not in mods:      # import a.b.c where only a.b is ours: a.b
          t = t.rpartition(".")[0]
        if t and t != name:
          edges.add(t)
    graph[name] = edges
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle as a list of modules (first == last), or None."""
  state, stack = {}, []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for n in sorted(graph.get(m, ())):
      if state.get(n) == 1:
        return stack[stack.index(n):] + [n]
      if n not in state:
        found = visit(n)
        if found:
          return found
    stack.pop()
    state[m] = 2
    return None

  for m in sorted(graph):
    if m not in state:
      found = visit(m)
      if found:
        return found
  return None


def test_find_cycle_finds_one():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle():
  graph = import_graph()
  assert {"mtp.loading", "mtp.checkpoint", "mtp.export", "mtp.data.pipeline",
          "train.workdir", "decode.cli.run"} <= set(graph)
  assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_rooms_import_one_way():
  graph = import_graph()
  room = lambda m: m.split(".")[0]
  bad = sorted((m, n) for m, ns in graph.items() for n in ns
               if (room(m) == "mtp" and room(n) in ("train", "decode", "scripts"))
               or {room(m), room(n)} == {"train", "decode"}
               or (room(m) not in ("scripts", "experiments") and room(n) == "scripts")
               or (room(m) != "experiments" and room(n) == "experiments"))
  assert not bad, bad
  # the experiments do import the other rooms (the rule above is not vacuous)
  assert {room(n) for m, ns in graph.items() if room(m) == "experiments" for n in ns} == {
      "mtp", "train", "decode", "scripts", "experiments"}
  # the loader sits above the two formats it tells apart: no module of them imports it
  below = [m for m in graph if m in ("mtp.checkpoint", "mtp.export") or m.startswith("mtp.export.")]
  assert not [m for m in below if "mtp.loading" in graph[m] and not m.endswith("__main__")]
  assert "mtp.export" not in graph["mtp.checkpoint"]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
  """``graph`` with each subpackage (``mtp.export``, ``mtp.data``, ...) and its
  modules as one node; ``__main__`` modules (entry points, imported by
  nothing) left out. Importing ``a.b`` runs package ``a``, so a package that
  imports X while X imports one of its modules is a circle too."""
  mods = _modules()
  pkgs = {m for m, p in mods.items() if p.endswith("__init__.py") and "." in m}

  def unit(m):
    return next((p for p in sorted(pkgs, key=len, reverse=True) if m == p or
                 m.startswith(p + ".")), m)
  out = {}
  for m, ns in graph.items():
    if m.endswith("__main__"):
      continue
    out.setdefault(unit(m), set()).update(unit(n) for n in ns if unit(n) != unit(m))
  return out


def test_no_import_cycle_between_packages():
  assert find_cycle(package_graph({"mtp.loading": {"mtp.export"}, "mtp.export.run":
                                   {"mtp.loading"}, "mtp.export": set()})) == [
      "mtp.export", "mtp.loading", "mtp.export"]
  graph = package_graph(import_graph())
  assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_decode_holds_the_decoder_only():
  """The benchmarks (bench*), the schedule replay (replay*) and
  self-distillation (self_distill*) live in scripts/; decode/ has none of
  them (the shim of ``python -m decode.self_distill`` is gone too)."""
  names = [m for m in _modules() if m.startswith("decode.")]
  bad = sorted(m for m in names for pat in ("bench*", "replay*", "self_distill*", "llamacpp*")
               if fnmatch.fnmatch(m.split(".")[-1], pat))
  assert not bad, bad


def test_decode_engine_apart_from_cli():
  """decode/ is the engine (decode.decoder and the modules beside it), with
  "auto" in decode.auto and the CLI and its reports in decode.cli: the
  engine and "auto" never import decode.cli (the arrow points one way),
  and decode.auto needs nothing of the engine but decode.mesh."""
  graph = import_graph()
  cli = lambda m: m == "decode.cli" or m.startswith("decode.cli.")
  auto = lambda m: m == "decode.auto" or m.startswith("decode.auto.")
  engine = [m for m in graph if m.startswith("decode.") and not cli(m) and not auto(m)
            and not m.endswith("__main__")]
  assert {"decode.decoder", "decode.compiled", "decode.acceptance", "decode.kv_cache",
          "decode.drafters", "decode.round"} <= set(engine)
  bad = sorted((m, n) for m in engine + [a for a in graph if auto(a)] for n in graph[m] if cli(n))
  assert not bad, bad
  bad = sorted((m, n) for m in graph if auto(m) for n in graph[m]
               if n.startswith("decode.") and not auto(n) and n != "decode.mesh")
  assert not bad, bad
  # the rule is not vacuous: the CLI does import the engine and "auto"
  assert {"decode.decoder", "decode.auto.calibrate"} <= graph["decode.cli.run"]
