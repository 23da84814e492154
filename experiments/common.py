"""What several experiments share: the command their reports record, the
--config flag read into a Config, --quick defaults, and saving a figure."""

from __future__ import annotations

import argparse
import os

from mtp import cli, report
from mtp import config as config_lib


def command_line(script_file: str, argv=None) -> str:
  """The command that ran an experiment, as ``python -m experiments.NAME
  ARG ...`` (``mtp.report.command_line``'s arguments, shell-quoted): the
  form that runs from the repository root with or without the package
  installed. ``script_file``: the experiment's ``__file__``; ``argv``: its
  arguments, default ``sys.argv[1:]``."""
  rel = os.path.relpath(os.path.abspath(script_file), report.REPO)
  script = f"python {rel}"
  cmd = report.command_line(script_file, argv)
  assert cmd.startswith(script), (cmd, script)
  return f"python -m {os.path.splitext(rel)[0].replace(os.sep, '.')}{cmd[len(script):]}"


def load_config(ap: argparse.ArgumentParser, path: str) -> config_lib.Config:
  """The config file of ``--config``; ``ap.error`` when it is missing or
  invalid."""
  if not os.path.isfile(path):
    ap.error(f"--config={path!r}: no such file")
  try:
    return config_lib.load_config_file(path)
  except config_lib.ConfigError as e:
    ap.error(f"--config: {e}")


def parse_with_defaults(ap: argparse.ArgumentParser, argv: list[str], defaults: dict) -> argparse.Namespace:
  """``ap.parse_args(argv)`` with every flag left at None set from
  ``defaults`` ({flag: (full, quick)}: the second under --quick), and
  --quick's default --out moved under runs/quick/ (``mtp.cli.quick_out``),
  and --out checked as a report prefix before any work (exit 2, one line)."""
  args = ap.parse_args(argv)
  for k, (full, quick) in defaults.items():
    if getattr(args, k) is None:
      setattr(args, k, quick if args.quick else full)
  cli.quick_out(ap, args)
  cli.check_output_path("out", args.out, "prefix")
  return args


def save_figure(fig, path: str, **savefig_kw) -> None:
  """Lays out ``fig``, writes it to ``path`` atomically
  (``mtp.report.save_figure``) and closes it."""
  import matplotlib.pyplot as plt       # the caller chose the backend (Agg)
  from mtp import report
  fig.tight_layout()
  report.save_figure(fig, path, **savefig_kw)
  plt.close(fig)
