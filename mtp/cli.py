"""Command-line helpers shared by the scripts under scripts/: a help
formatter, comma-list and range validation that fail like argparse (exit
status 2, naming the flag), ``--quick`` defaults, the entry-point guard
that prints input errors in one line (and ends a Ctrl-C, a closed pipe
or a full disk in one line), ``check_output_path`` (an output flag checked
before any work), ``write_atomic`` (every file the project writes, whole or
not at all), and the exit after an interrupted training run; and for the
absl CLIs (``python -m train``, ``decode``,
``mtp.export``) the flag parser that exits with the documented bad-input
status 2 (absl's own exits 1). Report writing lives in ``mtp.report``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import sys
import tempfile

from mtp.files import write_atomic  # noqa: F401  (re-exported: the CLIs' one writer)

DATA_DIR_HELP = ("TFDS data dir (default: $MTP_DATA_DIR if set, else "
                 "~/.cache/mtp/tensorflow_datasets)")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """Keeps the description's line breaks and appends "(default: X)" to every
  flag's help that has a help text, a meaningful default (not None / False /
  "") and does not mention its default already."""

  def _get_help_string(self, action):
    text = action.help or ""
    if (action.option_strings and "default" not in text.lower()
        and action.default not in (None, False, "", argparse.SUPPRESS)):
      text += " (default: %(default)s)"
    return text


class OneLineParser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line ``error: ...`` on stderr
  and exit status 2, without the usage block (``check_range``,
  ``parse_list`` and the rest call ``ap.error`` and so fail in one line)."""

  def error(self, message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(BAD_INPUT)


def _fmt(v) -> str:
  return f"{v:g}" if isinstance(v, float) else str(v)


def split_items(flag: str, text) -> list[str]:
  """``--flag``'s comma list -> its items, stripped, in order. Raises
  ValueError "--flag=TEXT: ..." for an empty list or an empty item
  (``"a,,b"``, a trailing comma): a dropped item would change a run without
  a word."""
  items = [x.strip() for x in str(text if text is not None else "").split(",")]
  if not any(items):
    raise ValueError(f"--{flag}={text!r}: empty; give a comma list")
  if not all(items):
    raise ValueError(f"--{flag}={text!r}: item {items.index('') + 1} is empty; give a comma "
                     "list without empty items")
  return items


def list_items(ap: argparse.ArgumentParser, flag: str, text) -> list[str]:
  """``split_items`` with its error as ``ap.error`` (exit status 2)."""
  try:
    return split_items(flag, text)
  except ValueError as e:
    ap.error(str(e))


def parse_list(ap: argparse.ArgumentParser, flag: str, text, typ=float, lo=None, hi=None,
               choices=None, lo_open: bool = False, duplicates: str = "drop") -> list:
  """Parses ``--flag``'s comma list of ``typ`` values, each in [lo, hi]
  ((lo, hi] with ``lo_open``; None: unbounded on that side; floats must be
  finite) or one of ``choices``.

  Returns the values in order (``duplicates="drop"``: repeated values
  dropped; ``"error"``: refused). Errors: ``ap.error`` (exit status 2) with
  "--flag=TEXT: ..." naming the allowed values, for an empty list, an empty
  item (``"0.9,,0.8"``, a trailing comma), a value that is not a ``typ``, or
  one out of range.
  """
  if choices is not None:
    allowed = "one of " + ", ".join(map(str, choices))
  elif lo is not None and hi is not None:
    allowed = f"in {'(' if lo_open else '['}{_fmt(lo)}, {_fmt(hi)}]"
  elif lo is not None:
    allowed = f"{'>' if lo_open else '>='} {_fmt(lo)}"
  elif hi is not None:
    allowed = f"<= {_fmt(hi)}"
  else:
    allowed = f"a {typ.__name__}"
  kind = {int: "integers", float: "numbers"}.get(typ, "values")
  try:
    items = split_items(flag, text)
  except ValueError as e:
    ap.error(f"{e} ({kind}, every value {allowed})")
  try:
    vals = [typ(x) for x in items]
  except ValueError:
    ap.error(f"--{flag}={text!r}: must be a comma list of {kind}, every value {allowed}")

  def ok(v):
    if choices is not None:
      return v in choices
    if isinstance(v, float) and not math.isfinite(v):
      return False
    return ((lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or v <= hi))
  bad = [v for v in vals if not ok(v)]
  if bad:
    ap.error(f"--{flag}={text!r}: every value must be {allowed} (got {_fmt(bad[0])})")
  if len(set(vals)) != len(vals):
    if duplicates == "error":
      ap.error(f"--{flag}={text!r}: duplicate values")
    vals = list(dict.fromkeys(vals))
  return vals


def check_range(ap: argparse.ArgumentParser, args, **bounds) -> None:
  """``ap.error`` unless every ``args.NAME`` lies in its bounds: ``NAME=lo``
  (>= lo) or ``NAME=(lo, hi)`` ([lo, hi]; hi None: unbounded)."""
  for name, b in bounds.items():
    lo, hi = b if isinstance(b, tuple) else (b, None)
    v = getattr(args, name)
    if v is None or v < lo or (hi is not None and v > hi) or (isinstance(v, float) and not math.isfinite(v)):
      rng = f"in [{_fmt(lo)}, {_fmt(hi)}]" if hi is not None else f">= {_fmt(lo)}"
      ap.error(f"--{name}={v}: must be {rng}")


def refuse_bad_flags(argv=None, **bounds) -> None:
  """For a script whose module imports jax (or a module that does) at its
  top, called under ``if __name__ == "__main__":`` before those imports:
  parses only the flags in ``bounds`` (other arguments are left to the
  script's own parser, which still checks everything) and exits with status
  2 and one line naming the flag when a given one is not of its type or out
  of its range. ``NAME=(type, lo)`` (>= lo), ``NAME=(type, lo, hi)`` ([lo,
  hi]; None: unbounded), ``NAME=(type, lo, hi, True)`` ((lo, hi]);
  ``NAME=(list, type, lo[, hi[, True]])``: a comma list (``parse_list``). A
  flag not given is not checked."""
  ap = OneLineParser(add_help=False, allow_abbrev=False)
  for name, b in bounds.items():
    ap.add_argument(f"--{name}", type=str if b[0] is list else b[0], default=None)
  args, _ = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
  for name, b in bounds.items():
    v = getattr(args, name)
    if v is None:
      continue
    if b[0] is list:
      lo, hi, lo_open = (tuple(b[2:]) + (None, None, False))[:3]
      parse_list(ap, name, v, b[1], lo, hi, lo_open=lo_open)
      continue
    lo, hi, lo_open = (tuple(b[1:]) + (None, False))[:3]
    if lo_open and not v > lo:
      ap.error(f"--{name}={_fmt(v)}: must be "
               + (f"in ({_fmt(lo)}, {_fmt(hi)}]" if hi is not None else f"> {_fmt(lo)}"))
    check_range(ap, args, **{name: (lo, hi) if hi is not None else lo})


def check_positive(ap: argparse.ArgumentParser, args, names) -> None:
  """``ap.error`` naming the flag unless every ``args.NAME`` is >= 1."""
  check_range(ap, args, **{name: 1 for name in names})


def apply_quick(ap: argparse.ArgumentParser, args, **values) -> None:
  """``--quick``: sets each ``args.NAME`` to ``values[NAME]`` only where the
  user left it at the parser's default (compared by value: a flag given
  explicitly with its default value counts as not given). Validate after
  calling this. Also ``quick_out``."""
  for name, v in values.items():
    if getattr(args, name) == ap.get_default(name):
      setattr(args, name, v)
  quick_out(ap, args)


QUICK_OUT_DIR = os.path.join("runs", "quick")


def quick_out(ap: argparse.ArgumentParser, args) -> None:
  """``--quick`` with ``--out`` left at its default ``results/NAME``: writes
  to ``runs/quick/NAME`` instead, so a smoke run never overwrites the
  committed full-run report of the same name."""
  default = ap.get_default("out")
  if (getattr(args, "quick", False) and isinstance(default, str) and args.out == default
      and os.path.normpath(default).split(os.sep)[0] == "results"):
    args.out = os.path.join(QUICK_OUT_DIR, os.path.relpath(default, "results"))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)


def input_errors() -> tuple:
  """The ``mtp`` input-error types (bad config, data or checkpoint): a script
  reports them in one line, without a traceback. (``mtp`` imports no
  ``decode``: a script that decodes adds ``decode.decoder.DecodeError``
  through ``main_guard(..., errors=...)``.)"""
  from mtp.checkpoint import CheckpointError
  from mtp.config import ConfigError
  from mtp.data import DataError
  return (ConfigError, DataError, CheckpointError)


EXIT_INTERRUPTED = 130     # 128 + SIGINT
EXIT_BROKEN_PIPE = 141     # 128 + SIGPIPE: what a shell reports for a C tool whose reader left
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _flush_stdout() -> None:
  """Flushes stdout; a reader that went away (``| head``) ends the process
  quietly with ``EXIT_BROKEN_PIPE`` (stdout pointed at /dev/null first, so
  the interpreter's own flush at exit does not complain)."""
  try:
    sys.stdout.flush()
  except BrokenPipeError:
    _exit_broken_pipe()
  except (OSError, ValueError):        # a closed or odd stdout: nothing more to say
    pass


def _exit_broken_pipe():
  try:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
  except (OSError, ValueError, AttributeError):
    pass
  os._exit(EXIT_BROKEN_PIPE)


def exit_interrupted() -> None:
  """Ctrl-C: one line on stderr and the end of the process with status 130,
  at once (``os._exit``: no interpreter teardown, which with XLA's threads
  running can crash; every file is written whole by ``write_atomic``, so
  nothing half-written remains)."""
  try:
    print("interrupted (Ctrl-C): stopped", file=sys.stderr, flush=True)
  except (OSError, ValueError):
    pass
  with contextlib.suppress(OSError, ValueError):
    sys.stdout.flush()
  os._exit(EXIT_INTERRUPTED)


def _unraisable_hook(previous):
  """A ``sys.unraisablehook`` that ends the process on a KeyboardInterrupt
  Python would otherwise print as "Exception ignored in ..." and drop (a
  Ctrl-C that lands in a gc callback, e.g. jax's ``_xla_gc_callback``, or in
  a ``__del__``)."""
  def hook(unraisable):
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
      exit_interrupted()
    previous(unraisable)
  hook.mtp_guard = True
  return hook


def no_space_error(e: BaseException) -> str | None:
  """"no space left on device writing PATH" (or "disk quota exceeded ...")
  when ``e`` or an exception it was raised from is an OSError ENOSPC /
  EDQUOT (or a library's error that says "No space left on device"); else
  None."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in NO_SPACE:
      what = (e.strerror or os.strerror(e.errno)).lower()
      return f"{what} writing {e.filename if e.filename is not None else '(unknown path)'}"
    if not isinstance(e, OSError) and "no space left on device" in str(e).lower():
      return f"no space left on device writing (unknown path: {type(e).__name__})"
    e = e.__cause__ or e.__context__
  return None


def main_guard(main, argv=None, errors: tuple = ()):
  """Runs ``main(argv)`` as a script's entry point and exits: with ``main``'s
  return value when it is an int (0 otherwise; a ``SystemExit`` from
  ``main``, e.g. absl's ``app.run``, passes through). One line on stderr
  and no traceback for: an input error (``input_errors()`` and the types in
  ``errors``, e.g. ``(DecodeError,)``): "error: ...", status 2; a full disk
  or quota (OSError ENOSPC / EDQUOT, anywhere): "error: no space left on
  device writing PATH", status 2; Ctrl-C (a KeyboardInterrupt that reaches
  here or that Python would drop, ``exit_interrupted``): status 130. A
  closed stdout (``| head``) ends quietly with status 141 (128 + SIGPIPE).
  Nothing is imported before ``main`` runs (a CLI may set ``JAX_PLATFORMS``
  first)."""
  if not getattr(sys.unraisablehook, "mtp_guard", False):
    sys.unraisablehook = _unraisable_hook(sys.unraisablehook)
  try:
    try:
      rc = main(argv)
    except SystemExit:
      _flush_stdout()
      raise
    _flush_stdout()
  except KeyboardInterrupt:
    exit_interrupted()
  except BrokenPipeError:
    _exit_broken_pipe()
  except Exception as e:
    if isinstance(e, input_errors() + tuple(errors)):
      print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
      sys.exit(BAD_INPUT)
    msg = no_space_error(e)
    if msg is None:
      raise
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(BAD_INPUT)
  sys.exit(rc if isinstance(rc, int) else 0)


def output_path_problem(path: str, kind: str = "file") -> str | None:
  """Why ``path`` cannot be written (None: it can): ``kind="file"``: not a
  directory, and its folder (or the nearest existing folder above, which
  ``os.makedirs`` extends) a directory this process can create files in;
  ``kind="dir"``: an existing directory or a creatable one, writable;
  ``kind="prefix"``: a report prefix (``mtp.report.write_report`` writes
  PATH.json and PATH.md), as the file PATH.json. Checked
  by creating and removing a temporary file there (a read-only mount, a
  full quota or missing permission all show)."""
  if kind not in ("file", "dir", "prefix"):
    raise ValueError(f"kind={kind!r} must be 'file', 'dir' or 'prefix'")
  p = os.path.abspath(os.fspath(path))
  if kind == "prefix":
    p, kind = p + ".json", "file"
  if os.path.lexists(p):
    if kind == "dir" and not os.path.isdir(p):
      return "exists and is not a directory"
    if kind == "file" and os.path.isdir(p):
      return "is a directory; give a file path"
    folder = p if kind == "dir" else os.path.dirname(p)
  else:
    folder = os.path.dirname(p)
  while not os.path.lexists(folder):
    folder = os.path.dirname(folder)
  if not os.path.isdir(folder):
    return f"{folder!r} is not a directory"
  try:
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".mtp_write_probe.")
  except OSError as e:
    return f"cannot create files in {folder!r} ({e.strerror or e})"
  os.close(fd)
  with contextlib.suppress(OSError):
    os.remove(probe)
  return None


def check_output_path(flag: str, path: str, kind: str = "file") -> None:
  """Exits with status 2 and one line "error: --FLAG=PATH: ..." unless
  ``path`` can be written (``output_path_problem``); call it before any
  heavy work, so a bad output flag does not cost a run."""
  problem = output_path_problem(path, kind)
  if problem is not None:
    print(f"error: --{flag.lstrip('-')}={os.fspath(path)!r}: {problem}", file=sys.stderr)
    sys.exit(BAD_INPUT)


def exit_if_interrupted(result: dict, num_steps: int, what: str, workdir: str) -> None:
  """After ``train.loop.train``: when the run stopped before ``num_steps``
  (a SIGINT / SIGTERM makes ``train`` checkpoint and return early), prints
  which run was interrupted and exits with 128 + signal (130 SIGINT, 143
  SIGTERM; 130 when the signal is unknown) instead of going on with a
  half-trained model."""
  step = int(result.get("step") or 0)
  if not result.get("interrupted") and step >= num_steps:
    return
  sig = result.get("signal") or 2
  print(f"interrupted (signal {sig}): {what} in {workdir} stopped at step {step} of {num_steps} "
        "(checkpoint saved); re-run the same command to resume it", file=sys.stderr, flush=True)
  sys.exit(128 + int(sig))


@contextlib.contextmanager
def compile_cache(path: str | None):
  """JAX's persistent compilation cache in ``path`` for the block (None: no
  change); the previous setting is restored after. Cells of the same D and
  lambda compile the same train step, and cells of the same D the same
  decoding programs, so later cells load them from disk."""
  if path is None:
    yield
    return
  import jax
  from jax.experimental.compilation_cache import compilation_cache as cc
  prev = jax.config.jax_compilation_cache_dir
  os.makedirs(path, exist_ok=True)
  cc.set_cache_dir(path)
  cc.reset_cache()            # takes effect even if this process compiled before
  try:
    yield
  finally:
    cc.set_cache_dir(prev)
    cc.reset_cache()


BAD_INPUT = 2


def parse_flags_or_exit(argv: list[str]) -> list[str]:
  """absl ``flags.FLAGS(argv)`` for ``app.run(main, flags_parser=...)``: on
  an unknown or malformed flag, or a stray positional argument (these CLIs
  take flags only: an unquoted ``--prompt def main(`` leaves ``main(``),
  prints one line ``error: ...`` (and a hint) to stderr and exits with
  status 2, the project's bad-input status."""
  from absl import flags
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    print(f"error: {e}\nPass --helpfull to see the flags.", file=sys.stderr)
    sys.exit(BAD_INPUT)
  if len(rest) > 1:
    print(f"error: unexpected arguments {' '.join(map(repr, rest[1:]))}: these are flags only "
          "(quote a value that holds spaces, e.g. --prompt='def main(')", file=sys.stderr)
    sys.exit(BAD_INPUT)
  return rest


HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml", "?")


def asks_for_help(argv) -> bool:
  """Whether the command line has one of absl's help flags (--help, -?,
  --helpshort, --helpfull, --helpxml)."""
  return any(a.lstrip("-").split("=", 1)[0] in HELP_FLAGS for a in argv[1:]
             if a.startswith("-"))


def help_exits_zero(parse):
  """``parse`` (an absl ``flags_parser``), except that a help flag exits
  with status 0: absl prints the help and exits 1, which a shell, make or a
  CI step reads as a failure of a request that succeeded."""
  def parse_flags(argv):
    try:
      return parse(argv)
    except SystemExit as e:
      if e.code == 1 and asks_for_help(argv):
        sys.exit(0)
      raise
  return parse_flags


def flags_parser(check=None):
  """The absl ``flags_parser`` of the project's absl CLIs: as
  ``parse_flags_or_exit`` but each error is one line; help exits 0; then
  ``check()`` (the flag ranges, before jax or any model code loads): a
  ValueError it raises is printed as ``error: ...``, exit status 2."""
  def parse(argv):
    from absl import flags
    try:
      rest = flags.FLAGS(argv)
    except flags.Error as e:
      print(f"error: {e} (--helpfull lists the flags)", file=sys.stderr)
      sys.exit(BAD_INPUT)
    except SystemExit as e:
      if e.code == 1 and asks_for_help(argv):
        sys.exit(0)
      raise
    try:
      if len(rest) > 1:
        raise ValueError(f"unexpected arguments {' '.join(map(repr, rest[1:]))}: these are flags "
                         "only (quote a value that holds spaces, e.g. --prompt='def main(')")
      if check is not None:
        check()
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(BAD_INPUT)
    return rest
  return parse
