"""Library side of ``python -m mtp.export``: load a checkpoint (``mtp.loading``)
and the workdir's tokenizer (``mtp.tokenizer.load_tokenizer``), and write it as a Hugging Face directory (``mtp.export.write_export``)."""

from __future__ import annotations

from mtp import export as export_lib
from mtp import loading
from mtp import tokenizer as tok


def export(workdir: str, out: str, *, step: int | None = None, overwrite: bool = False) -> str:
  """Exports checkpoint ``step`` (default: latest) of ``workdir`` to ``out``
  (``python -m mtp.export``). Returns the absolute output path.

  Raises:
    mtp.checkpoint.CheckpointError: no readable checkpoint in ``workdir``.
    mtp.export.ExportError: as ``mtp.export.write_export``, or an unreadable
      tokenizer (``mtp.tokenizer.TokenizerError``, named with its file).
  """
  out_abs = export_lib.check_out(out, overwrite)      # fail before the (slow) restore
  try:
    tokenizer = tok.load_tokenizer(workdir)          # the byte tokenizer for byte models
  except tok.TokenizerError as e:
    raise export_lib.ExportError(str(e)) from e
  cfg, model, step = loading.load_model(workdir, step)
  return export_lib.write_export(model, cfg, out_abs, step=step, overwrite=overwrite,
                                 tokenizer=tokenizer)
