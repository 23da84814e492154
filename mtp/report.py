"""Provenance and report files of the benchmarks and experiments.

Every number in a results file carries its config, commit, hardware and
date (docs/design.md section 7): ``provenance`` collects the hardware and
software half, ``command_line`` the command that ran, ``write_report``
writes ``OUT.json`` ({"meta", "results"}) and ``OUT.md`` (first line: the
command). Also the small formatting helpers the reports share (``machine``,
``plural``, ``fmt``). Timing statistics live in ``mtp.timing``; argparse
helpers in ``mtp.cli``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import resource
import shlex
import subprocess
import sys

# the checkout this package runs from (an editable install: the repository root)
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


# The checkout when this process imported the module: a script that runs for
# minutes reports the code it started with, not a commit made meanwhile.
COMMIT_AT_START = git_commit()


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
  """commit (``COMMIT_AT_START``: the checkout when the process started),
  commit_at_write (only when the checkout changed since: a commit made while
  the script ran), jax_version, device_kind, device_count, cpu_count,
  cpu_model, platform, date (ISO), peak_rss_mb of this process so far, plus
  ``extra``. (jax is imported here, not at the module's top: a CLI that
  imports this module refuses a bad flag before jax loads.)"""
  import jax
  now = git_commit()
  return {"commit": COMMIT_AT_START,
          **({"commit_at_write": now} if now != COMMIT_AT_START else {}),
          "jax_version": jax.__version__,
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
  from ``command_line``); each whole or not at all (``mtp.cli.write_atomic``).

  Raises ValueError when ``markdown`` is given and ``meta`` has no command.
  """
  if markdown is not None and not meta.get("command"):
    raise ValueError("write_report: meta['command'] (report.command_line) is required with markdown")
  from mtp.files import write_atomic
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  write_atomic(out + ".json", json.dumps({"meta": meta, "results": results}, indent=2))
  if markdown is not None:
    write_atomic(out + ".md", f"Command: {_code_span(meta['command'])}\n\n{markdown}")


def save_figure(fig, path: str, **kwargs) -> str:
  """``fig.savefig(path, **kwargs)`` (format from the extension, PNG by
  default) written whole or not at all (``mtp.cli.write_atomic``). Returns
  ``path``."""
  import io

  from mtp.files import write_atomic
  buf = io.BytesIO()
  fig.savefig(buf, format=os.path.splitext(path)[1].lstrip(".").lower() or "png", **kwargs)
  return write_atomic(path, buf.getvalue())


def fmt(x, spec: str = ".2f") -> str:
  """``format(x, spec)``, or "-" when ``x`` is None (a table cell that does not apply)."""
  return "-" if x is None else format(x, spec)
