"""Shared plumbing for the benchmark and experiment scripts: provenance
metadata and report files. (Scripts put the repository root on sys.path so
they run as ``python scripts/NAME.py`` from a checkout.)"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import resource
import shlex
import subprocess
import sys

import jax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
  """Short commit of the checkout ("+dirty" when tracked files changed), or "unknown"."""
  try:
    run = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=REPO)
    commit = run("rev-parse", "--short", "HEAD").stdout.strip()
    if commit and run("status", "--porcelain", "--untracked-files=no").stdout.strip():
      commit += "+dirty"
    return commit or "unknown"
  except OSError:
    return "unknown"


def cpu_model() -> str:
  """The CPU's model name (Linux: /proc/cpuinfo "model name"; else
  platform.processor()), or "unknown"."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.lower().startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def provenance(**extra) -> dict:
  """commit, jax_version, device_kind, device_count, cpu_count, cpu_model,
  platform, date (ISO), peak_rss_mb of this process so far, plus ``extra``."""
  return {"commit": git_commit(), "jax_version": jax.__version__,
          "device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(),
          "cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
          "date": datetime.date.today().isoformat(),
          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **extra}


def machine(meta: dict) -> str:
  """"DEVICE (N CPUs: MODEL)" for report headers, from ``provenance()``."""
  return f"{meta['device_kind']} ({meta['cpu_count']} CPUs: {meta.get('cpu_model', 'unknown')})"


def plural(n, word: str, words: str | None = None) -> str:
  """"1 repeat", "2 repeats" (``words``: irregular plural)."""
  return f"{n} {word if n == 1 else (words or word + 's')}"


# -- command line ------------------------------------------------------------------------

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


def _fmt(v) -> str:
  return f"{v:g}" if isinstance(v, float) else str(v)


def parse_list(ap: argparse.ArgumentParser, flag: str, text, typ=float, lo=None, hi=None,
               choices=None, lo_open: bool = False, duplicates: str = "drop") -> list:
  """Parses ``--flag``'s comma list of ``typ`` values, each in [lo, hi]
  ((lo, hi] with ``lo_open``; None: unbounded on that side; floats must be
  finite) or one of ``choices``.

  Returns the values in order (``duplicates="drop"``: repeated values
  dropped; ``"error"``: refused). Errors: ``ap.error`` (exit status 2) with
  "--flag=TEXT: ..." naming the allowed values, for an empty list, a value
  that is not a ``typ``, or one out of range.
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
    vals = [typ(x.strip()) for x in str(text if text is not None else "").split(",") if x.strip()]
  except ValueError:
    ap.error(f"--{flag}={text!r}: must be a comma list of {kind}, every value {allowed}")
  if not vals:
    ap.error(f"--{flag}={text!r}: empty; give a comma list of {kind}, every value {allowed}")

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


def apply_quick(ap: argparse.ArgumentParser, args, **values) -> None:
  """``--quick``: sets each ``args.NAME`` to ``values[NAME]`` only where the
  user left it at the parser's default (compared by value: a flag given
  explicitly with its default value counts as not given). Validate after
  calling this."""
  for name, v in values.items():
    if getattr(args, name) == ap.get_default(name):
      setattr(args, name, v)


def input_errors() -> tuple:
  """The project's input-error types (bad config, data, checkpoint or decode
  request): a script reports them in one line, without a traceback."""
  from decode.speculative import DecodeError
  from mtp.checkpoint import CheckpointError
  from mtp.config import ConfigError
  from mtp.data import DataError
  return (ConfigError, DataError, CheckpointError, DecodeError)


def main_guard(main, argv=None):
  """Runs ``main(argv)`` as a script's entry point and exits: with ``main``'s
  return value when it is an int (0 otherwise); with status 2 and one line
  "error: ..." on stderr (no traceback) on an input error
  (``input_errors()``)."""
  errors = input_errors()
  try:
    rc = main(argv)
  except errors as e:
    print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(2)
  sys.exit(rc if isinstance(rc, int) else 0)


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


def command_line(script_file: str, argv=None) -> str:
  """The command that ran a script, as a user would retype it:
  ``python scripts/NAME.py ARG ...`` (``script_file``: the script's
  ``__file__``; ``argv``: its arguments, default ``sys.argv[1:]``; each
  shell-quoted)."""
  args = list(sys.argv[1:] if argv is None else argv)
  rel = os.path.relpath(os.path.abspath(script_file), REPO)
  return " ".join(["python", shlex.quote(rel), *(shlex.quote(str(a)) for a in args)])


def _code_span(text: str) -> str:
  """``text`` as a markdown code span (a fence longer than any backtick run inside)."""
  longest = max((len(run) for run in re.findall("`+", text)), default=0)
  fence = "`" * (longest + 1)
  pad = " " if text.startswith("`") or text.endswith("`") else ""
  return f"{fence}{pad}{text}{pad}{fence}"


def write_report(out: str, meta: dict, results, markdown: str | None = None) -> None:
  """Writes ``out.json`` ({"meta", "results"}) and, if given, ``out.md``,
  whose first line is the command that produced it (``meta["command"]``,
  from ``command_line``).

  Raises ValueError when ``markdown`` is given and ``meta`` has no command.
  """
  if markdown is not None and not meta.get("command"):
    raise ValueError("write_report: meta['command'] (common.command_line) is required with markdown")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out + ".json", "w") as f:
    json.dump({"meta": meta, "results": results}, f, indent=2)
  if markdown is not None:
    with open(out + ".md", "w") as f:
      f.write(f"Command: {_code_span(meta['command'])}\n\n{markdown}")
