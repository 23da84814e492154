"""Shared plumbing for the benchmark and experiment scripts: provenance
metadata and report files. (Scripts put the repository root on sys.path so
they run as ``python scripts/NAME.py`` from a checkout.)"""

from __future__ import annotations

import datetime
import json
import os
import resource
import subprocess

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


def provenance(**extra) -> dict:
  """commit, jax_version, device_kind, device_count, cpu_count, date (ISO),
  peak_rss_mb of this process so far, plus ``extra``."""
  return {"commit": git_commit(), "jax_version": jax.__version__,
          "device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(),
          "cpu_count": os.cpu_count(), "date": datetime.date.today().isoformat(),
          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **extra}


def write_report(out: str, meta: dict, results, markdown: str | None = None) -> None:
  """Writes ``out.json`` ({"meta", "results"}) and, if given, ``out.md``."""
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out + ".json", "w") as f:
    json.dump({"meta": meta, "results": results}, f, indent=2)
  if markdown is not None:
    with open(out + ".md", "w") as f:
      f.write(markdown)
