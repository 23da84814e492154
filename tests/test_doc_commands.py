"""Issue 51: every command README.md and docs/*.md show runs as written on a
fresh clone. Walks the fenced ```bash blocks and the inline `python -m ...`,
`python scripts/...` and `make ...` spans, and checks, without running any
job: the module or script exists; every --flag is accepted by its CLI
(read from its --help); every `make TARGET` is a target of the Makefile;
every path named exists in the clone (git ls-files) or is made by an
earlier command (README first, then docs/*.md in name order), and an
output's missing parent folders are made by its CLI. Also `make help`."""

import functools
import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
PYTHONS = ("python", "python3", ".venv/bin/python", "$(PY)")
# (CLI, flag) whose value is a path the command writes; True: the CLI makes its missing parents
OUTPUTS = {("train", "workdir"): True, ("mtp.importers", "workdir"): True,
           ("mtp.export", "out"): True, ("mtp.export", "modules_out"): True,
           ("scripts.self_prompts", "out"): True, ("decode", "json"): False,
           ("train", "config.train.hidden_cache_dir"): True, ("train", "config.data.data_dir"): True,
           ("scripts.sharegpt_data", "out_dir"): True, ("scripts.sharegpt_data", "prompts_out"): True,
           ("scripts.self_distill", "carry"): False}
# what a make target leaves behind (the Makefile's defaults)
MAKE_MAKES = {"install": [".venv"], "demo": ["runs/smollm_demo", ".venv"],
              "demo-tiny": ["runs/tiny", ".venv"], "smollm": ["runs/smollm", ".venv"],
              "reference": ["runs/reference", ".venv"],
              "smollm-mtp": ["runs/smollm", "runs/smollm_d1", "runs/smollm_mtp", "runs/data"]}
PATH_ROOTS = ("configs", "assets", "scripts", "results", "docs", "tests", "runs", "exports", ".ci")


def doc_commands(path: str) -> list[str]:
  """The command lines of one markdown file: each logical line of its fenced
  bash/sh blocks (backslash continuations joined) and each inline code span
  that starts with python, python3, .venv/bin/python or make."""
  text = open(os.path.join(REPO, path), encoding="utf-8").read()
  out = []
  for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
    if m.group(1) in ("bash", "sh", "shell"):
      out += [ln.strip() for ln in m.group(2).replace("\\\n", " ").splitlines() if ln.strip()]
  prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S).replace("\n", " ")
  out += [m.group(1) for m in re.finditer(r"`((?:python3?|\.venv/bin/python|make) [^`]+)`", prose)]
  return out


def split_commands(line: str) -> list[list[str]]:
  """One shell line -> its simple commands' words (comments dropped; split at
  && ; |; leading VAR=value and `cd DIR &&` dropped)."""
  try:
    words = shlex.split(line, comments=True)
  except ValueError:        # an unbalanced quote: a multi-line --command='...' (scaling.md)
    return []
  cmds, cur = [], []
  for w in words + ["&&"]:
    if w in ("&&", ";", "|", "||"):
      while cur and re.fullmatch(r"[A-Z_]+=.*", cur[0]):
        cur = cur[1:]
      if cur and cur[0] != "cd":
        cmds.append(cur)
      cur = []
    else:
      cur.append(w)
  return cmds


def all_commands() -> list[tuple[str, list[str]]]:
  return [(doc, words) for doc in DOCS for line in doc_commands(doc)
          for words in split_commands(line)
          if words[0] in PYTHONS or words[0] == "make"]


@functools.lru_cache(maxsize=None)
def clone_paths() -> frozenset:
  """Files and folders of a fresh clone (``git ls-files``)."""
  r = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
  if r.returncode != 0:
    pytest.skip("not a git checkout: a fresh clone's files are unknown")
  files = r.stdout.split()
  paths = set(files)
  for f in files:
    while "/" in f:
      f = f.rpartition("/")[0]
      paths.add(f)
  return frozenset(paths)


@functools.lru_cache(maxsize=None)
def make_targets() -> frozenset:
  text = open(os.path.join(REPO, "Makefile")).read()
  return frozenset(m.group(1) for m in re.finditer(r"^([a-z][a-z0-9-]*):(?!=)", text, re.M))


def source_of(cli: str) -> str:
  """The file ``python -m cli`` (or ``python cli``, a script path) runs."""
  if cli.endswith(".py"):
    return os.path.join(REPO, cli)
  base = os.path.join(REPO, *cli.split("."))
  return os.path.join(base, "__main__.py") if os.path.isdir(base) else base + ".py"


# Run by one interpreter for every argparse CLI at once: each CLI's --help as
# ``python -m`` would run it (runpy, as __main__), its stdout kept. One import
# of jax for all of them instead of one per CLI (~2.5 s each on 2 cores).
HELP_DRIVER = r"""
import contextlib, io, json, runpy, sys
out = {}
for cli in sys.argv[1:]:
  buf = io.StringIO()
  sys.argv = [cli, "--help"]
  try:
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
      if cli.endswith(".py"):
        runpy.run_path(cli, run_name="__main__")
      else:
        runpy.run_module(cli, run_name="__main__", alter_sys=True)
  except SystemExit as e:
    out[cli] = buf.getvalue() if e.code in (0, None) else None
  except BaseException:
    out[cli] = None
  else:
    out[cli] = None
print(json.dumps(out))
"""


def _help_env() -> dict:
  return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}   # this checkout's packages


@functools.lru_cache(maxsize=None)
def batched_help() -> dict:
  """{cli: its --help text, or None} for the documented CLIs whose parser is
  argparse (absl's flags are one registry per process: those run alone)."""
  clis = sorted({c for _, w in all_commands() for c in [cli_of(w)[0]]
                 if c and not is_placeholder(c) and "NAME" not in c
                 and os.path.isfile(source_of(c)) and "absl" not in open(source_of(c)).read()})
  r = subprocess.run([sys.executable, "-c", HELP_DRIVER, *clis], cwd=REPO, capture_output=True,
                     text=True, timeout=600, env=_help_env())
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


@functools.lru_cache(maxsize=None)
def accepted_flags(cli: str, full: bool = False) -> frozenset:
  """The flags ``cli`` (a module, or a script path) accepts, read from its
  --help (``full``: absl's --helpfull, which adds absl's own flags). An
  argparse CLI's --help comes from ``batched_help``; a CLI it could not run
  there runs alone."""
  text = None if full else batched_help().get(cli)
  if text is None:
    argv = [sys.executable] + (["-m", cli] if not cli.endswith(".py") else [cli])
    r = subprocess.run(argv + ["--helpfull" if full else "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env=_help_env())
    assert r.stdout or full, f"{cli} --help printed nothing: {r.stderr[-1000:]}"
    text = r.stdout
  names = set()
  for m in re.finditer(r"--(\[no\])?([a-z][a-z0-9_]*)", text):
    names.add(m.group(2))
    if m.group(1):
      names.add("no" + m.group(2))
  return frozenset(names)


def cli_of(words: list[str]) -> tuple[str | None, list[str]]:
  """(the module or script a python command runs, its arguments); None for
  ``python -c`` or a bare ``python``."""
  if len(words) >= 3 and words[1] == "-m":
    return words[2], words[3:]
  if len(words) >= 2 and words[1].endswith(".py"):
    return words[1], words[2:]
  return None, []


def is_placeholder(value: str) -> bool:
  """A value the reader replaces: FILE, runs/NAME, W, <D>, ..., $I, $(...)."""
  return (value in ("...", "") or any(c in value for c in "<>$*{}")
          or bool(re.search(r"(^|/|\b)[A-Z][A-Z_]*[A-Z](\b|\.|$)|^[A-Z]$", value)))


def export_makes_parents(flag: str, tmp) -> bool:
  """Whether ``python -m mtp.export --FLAG`` under a missing folder makes it
  (a workdir without checkpoint: the run fails after that step)."""
  out = os.path.join(str(tmp), flag, "deeper", "x")
  r = subprocess.run([sys.executable, "-m", "mtp.export", "--workdir", os.path.join(str(tmp), "none"),
                      f"--{flag}", out], cwd=REPO, capture_output=True, text=True, timeout=300,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  return r.returncode == 2 and "no checkpoint" in r.stderr


def problems(tmp=None) -> list[str]:
  """One line per command that would not run as written (``tmp``: a folder
  for probing mtp.export's OUTPUTS entries the docs rely on)."""
  made, bad, probed = set(), [], {}

  def exists(p):
    p = os.path.normpath(p)
    return p in clone_paths() or any(p == m or p.startswith(m + "/") for m in made)

  for doc, words in all_commands():
    where = f"{doc}: {shlex.join(words)}"
    if words[0] == "make":
      for t in words[1:]:
        if "=" in t or t.startswith("-"):
          continue
        if t not in make_targets():
          bad.append(f"{where}: no make target {t!r}")
        made.update(MAKE_MAKES.get(t, []))
      continue
    cli, args = cli_of(words)
    if cli is None or is_placeholder(cli) or "NAME" in cli:
      continue
    if cli.endswith(".py"):
      if not os.path.isfile(os.path.join(REPO, cli)):
        bad.append(f"{where}: no script {cli}")
        continue
    elif not any(os.path.isfile(os.path.join(REPO, *cli.split("."), *f))
                 for f in (("__main__.py",), ())) and not os.path.isfile(
                     os.path.join(REPO, *cli.split(".")) + ".py"):
      bad.append(f"{where}: no module {cli}")
      continue
    key = cli[:-3].replace("/", ".") if cli.endswith(".py") else cli
    i, outputs = 0, []
    while i < len(args):
      a = args[i].strip("[]()|")
      i += 1
      if not a.startswith("--"):
        continue
      name, _, value = a[2:].partition("=")
      if not value and i < len(args) and not args[i].lstrip("[(").startswith("-"):
        value = args[i].strip("[]()")
        i += 1
      if name.startswith("config.") and key == "train":
        from mtp.config import ConfigError, check_override_keys
        try:
          check_override_keys([f"--{name}=x"])
        except ConfigError as e:
          bad.append(f"{where}: {e}")
      elif name not in accepted_flags(cli) and name not in accepted_flags(cli, full=True):
        bad.append(f"{where}: {cli} has no flag --{name}")
      value = value.split(":")[0] if name == "config" else value
      if (not value or is_placeholder(value) or os.path.isabs(value) or value.startswith("~")
          or "/" not in value or value.split("/")[0] not in PATH_ROOTS):
        continue
      if (key, name) in OUTPUTS:
        outputs.append((name, value))
      elif not exists(value):
        bad.append(f"{where}: --{name}={value} does not exist on a fresh clone and no earlier "
                   "command makes it")
    for name, value in outputs:
      parent = os.path.dirname(os.path.normpath(value))
      makes = OUTPUTS[(key, name)]
      if parent and not exists(parent) and makes and key == "mtp.export" and tmp is not None:
        if name not in probed:
          probed[name] = export_makes_parents(name, tmp)
        makes = probed[name]
      if parent and not exists(parent) and not makes:
        bad.append(f"{where}: --{name}={value}: its folder {parent} does not exist on a fresh "
                   f"clone and {cli} does not make it")
      made.add(os.path.normpath(value))
  return bad


def test_doc_commands_run_as_written(tmp_path):
  found = all_commands()
  assert len(found) > 50 and any(w[:3] == ["python", "-m", "mtp.export"] for _, w in found)
  bad = problems(tmp_path)
  assert not bad, "\n".join(bad)


def test_the_outputs_said_to_make_their_parents_do(tmp_path):
  """OUTPUTS' mtp.export entries (README: --out exports/tiny; exports/ is not
  in a clone): a missing parent is made, not refused."""
  assert export_makes_parents("out", tmp_path) and export_makes_parents("modules_out", tmp_path)


def test_the_walker_catches_what_it_should():
  assert split_commands("A=1 make demo ARGS='--json x' && cd d && python -m decode --x 1 # c") == [
      ["make", "demo", "ARGS=--json x"], ["python", "-m", "decode", "--x", "1"]]
  assert is_placeholder("runs/NAME") and is_placeholder("FILE.gguf") and is_placeholder("W")
  assert is_placeholder("runs/smollm_d<D>") and not is_placeholder("runs/tiny")
  assert not is_placeholder("configs/tiny.py") and not is_placeholder("m.safetensors")
  assert "help" in make_targets() and "demo" in make_targets()


def test_the_walker_finds_broken_commands(tmp_path, monkeypatch):
  doc = tmp_path / "doc.md"
  doc.write_text("\n".join([
      "```bash", "make no-such-target", "python -m decode --workdir runs/nowhere --no_such_flag 1",
      "python -m train --config configs/tiny.py --workdir runs/t --config.train.nope=1",
      "python -m decode --workdir runs/t --prompt x --json runs/t/r.json   # made above",
      "python -m decode --workdir runs/t --prompt x --json results/new/r.json",
      "python -m mtp.importers --gguf configs/missing.gguf --workdir runs/NAME", "```",
      "and `python -m no.such.module --x` inline."]))
  monkeypatch.setattr(sys.modules[__name__], "DOCS", [str(doc)])
  bad = problems()
  want = ["no make target 'no-such-target'", "has no flag --no_such_flag",
          "--workdir=runs/nowhere does not exist", "unknown config key 'train.nope'",
          "--json=results/new/r.json: its folder results/new does not exist",
          "--gguf=configs/missing.gguf does not exist", "no module no.such.module"]
  assert len(bad) == len(want), "\n".join(bad)
  for w in want:
    assert sum(w in b for b in bad) == 1, (w, bad)


def test_make_help_lists_every_target_once():
  r = subprocess.run(["make", "--no-print-directory", "help"], cwd=REPO, capture_output=True,
                     text=True, timeout=60)
  assert r.returncode == 0, r.stderr
  listed = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("make ")]
  assert sorted(listed) == sorted(make_targets()), r.stdout
  assert all(len(ln.split()) > 2 for ln in r.stdout.splitlines()), r.stdout   # a text each
