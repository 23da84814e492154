"""Library side of ``python -m mtp.export``: load a checkpoint (``mtp.loading``)
and the workdir's tokenizer (``mtp.tokenizer.load_tokenizer``), and write it
as a Hugging Face directory (``mtp.export.write_export``), or write its MTP
modules as a modules file (``export_modules``: ``mtp.export.modules``).
Outside the ``mtp.export`` package: ``mtp.loading`` imports that package,
which imports no ``mtp.loading`` (no import circle)."""

from __future__ import annotations

import datetime
import json
import os

from mtp import export as export_lib
from mtp import loading
from mtp import tokenizer as tok

METRICS_FILE = "metrics.jsonl"          # train.workdir.METRICS_FILE (mtp does not import train)
IMPORT_FILE = "import.json"             # mtp.importers.IMPORT_FILE


def export(workdir: str, out: str, *, step: int | None = None, overwrite: bool = False) -> str:
  """Exports checkpoint ``step`` (default latest) of ``workdir`` to ``out``
  (``python -m mtp.export``); returns the absolute path. Raises
  CheckpointError (no readable checkpoint) or ExportError (as
  ``write_export``, or an unreadable tokenizer)."""
  out_abs = export_lib.check_out(out, overwrite, source=workdir)   # fail before the (slow) restore
  try:
    tokenizer = tok.load_tokenizer(workdir)          # the byte tokenizer for byte models
  except tok.TokenizerError as e:
    raise export_lib.ExportError(str(e)) from e
  cfg, model, step = loading.load_model(workdir, step)
  return export_lib.write_export(model, cfg, out_abs, step=step, overwrite=overwrite,
                                 tokenizer=tokenizer)


def last_eval_row(workdir: str, step: int) -> dict | None:
  """The last ``split == "eval"`` row of ``workdir/metrics.jsonl`` whose
  step is <= ``step`` (the rows ``decode.auto.calibrate.stage_prior`` reads for
  that checkpoint), or None (no file, no such row). Unreadable lines are
  skipped, as stage_prior does."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.isfile(path):
    return None
  row = None
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        d = json.loads(line)
      except ValueError:
        continue
      if isinstance(d, dict) and d.get("split") == "eval" and d.get("step", 0) <= step:
        row = d
  return row


def target_facts(workdir: str, cfg) -> dict:
  """What is known of the import the modules' target came from: the
  ``import.json`` of ``workdir`` or of its ``train.init_from`` (format,
  ``general.name``, file name and size), and that folder; {} when neither
  has one."""
  for folder in (workdir, cfg.train.init_from):
    path = os.path.join(folder, IMPORT_FILE) if folder else ""
    if path and os.path.isfile(path):
      try:
        with open(path, encoding="utf-8") as f:
          d = json.load(f)
      except (OSError, ValueError):
        continue
      src = d.get("source")
      return {"import_workdir": folder, "format": d.get("format"),
              "general.name": d.get("general.name"),
              "source_file": os.path.basename(src) if isinstance(src, str) else None,
              "size_bytes": d.get("size_bytes")}
  return {}


def export_modules(workdir: str, out: str, *, step: int | None = None, dtype: str = "bfloat16",
                   command: str | None = None, overwrite: bool = False) -> str:
  """Writes the MTP modules and draft vocabulary of checkpoint ``step`` (default
  latest) of ``workdir`` to the modules file ``out`` (``mtp.export.modules``),
  floats in ``dtype`` ("bfloat16" or "float32"), with ``last_eval_row`` and
  provenance; returns the absolute path. Raises CheckpointError, or
  ModulesFileError (unwritable ``out``, bad dtype, no MTP modules)."""
  from mtp import report
  from mtp.export import modules
  out_abs = modules.check_modules_out(out, overwrite)   # fail before the (slow) restore
  if dtype not in modules.DTYPES:
    raise modules.ModulesFileError(f"--modules_dtype={dtype!r}: must be one of {modules.DTYPES}")
  cfg, model, step = loading.load_model(workdir, step)
  provenance = {"commit": report.git_commit(), "date": datetime.datetime.now(
      datetime.timezone.utc).isoformat(timespec="seconds"), "command": command,
      "workdir": workdir}
  return modules.write_modules_file(model, cfg, out_abs, step=step, dtype=dtype,
                                    eval_row=last_eval_row(workdir, step), provenance=provenance,
                                    target=target_facts(workdir, cfg), overwrite=overwrite)
