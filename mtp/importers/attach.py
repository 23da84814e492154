"""Trained MTP modules from a modules file (``mtp.export.modules``) attached
to an imported target (``python -m mtp.importers ... --mtp_modules FILE``).

``read`` (before the slow part), ``attached_config`` (the target's config
with the file's ``mtp`` section; another architecture is refused),
``module_params`` (names, shapes, dtype cast, draft vocabulary checked),
``check_target`` (the backbone fingerprint; ``allow_other_target`` makes it
a note in ``import.json``) and ``carried_rows`` (the source's evaluation row
at step 0, for ``decode.auto.calibrate.stage_prior``). Errors are
``ModelImportError`` naming the modules file and the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

from mtp.importers import ModelImportError


def read(path: str):
  """``mtp.export.modules.read_modules_file(path)``, its errors as
  ModelImportError (same one-line message)."""
  from mtp.export import modules
  try:
    return modules.read_modules_file(path)
  except modules.ModulesFileError as e:
    raise ModelImportError(str(e)) from None


def attached_config(target_cfg, mf, target: str):
  """``target_cfg`` with the ``mtp`` section of modules file ``mf``. Raises
  ModelImportError listing every mismatching ``MATCHED_FIELDS`` field between
  the target (named ``target``) and the modules' source, or an mtp section
  the target cannot take."""
  from mtp import config as config_lib
  from mtp.export.modules import MATCHED_FIELDS
  a, b = mf.cfg.to_dict()["model"], target_cfg.to_dict()["model"]
  bad = [f"{f}: {a[f[6:]]!r} (modules) != {b[f[6:]]!r} (target)" for f in MATCHED_FIELDS
         if a[f[6:]] != b[f[6:]]]
  if bad:
    raise ModelImportError(f"{mf.path}: the modules were trained for another architecture than "
                           f"the target {target}: {'; '.join(bad)}")
  try:
    return target_cfg.replace(mtp=mf.cfg.to_dict()["mtp"])
  except config_lib.ConfigError as e:
    raise ModelImportError(f"{mf.path}: its mtp section does not fit the target {target}: "
                           f"{e}") from e


def module_params(mf, cfg) -> dict[tuple, np.ndarray]:
  """{flat path tuple: numpy array} of every MTP-module parameter (and
  ``draft_vocab``) of the model ``cfg`` describes, from ``mf``: floats cast
  to ``param_dtype``, the draft vocabulary checked. Raises ModelImportError
  naming the tensor: missing, unexpected, misshapen, or bad ids."""
  import jax.numpy as jnp
  from flax import nnx
  from mtp import draft_vocab as dv
  from mtp.model import build_model
  abstract = nnx.eval_shape(lambda: build_model(cfg))
  want = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))
          if p[0] == "mtp" or tuple(p) == ("draft_vocab",)}
  names = {".".join(map(str, p)): p for p in want}
  missing = sorted(set(names) - set(mf.tensors))
  if missing:
    raise ModelImportError(f"{mf.path}: no tensor '{missing[0]}' ({len(missing)} missing) for "
                           f"mtp.depth={cfg.mtp.depth}, mtp.draft_vocab_size="
                           f"{cfg.mtp.draft_vocab_size}")
  extra = sorted(set(mf.tensors) - set(names))
  if extra:
    raise ModelImportError(f"{mf.path}: tensor '{extra[0]}' has no place in the model "
                           f"({len(extra)} unexpected)")
  pdt = jnp.dtype(cfg.model.param_dtype)
  out = {}
  for name, path in names.items():
    a = mf.tensors[name]
    if tuple(a.shape) != tuple(want[path].shape):
      raise ModelImportError(f"{mf.path}: tensor '{name}' has shape {tuple(a.shape)}; the target "
                             f"needs {tuple(want[path].shape)}")
    if path == ("draft_vocab",):
      try:
        out[path] = dv.check_ids(a, cfg.mtp.draft_vocab_size, cfg.model.vocab_size)
      except ValueError as e:
        raise ModelImportError(f"{mf.path}: tensor 'draft_vocab': {e}") from None
    else:
      out[path] = np.asarray(a).astype(pdt)
  return out


def check_target(model, mf, target: str, allow_other_target: bool = False) -> dict:
  """The ``import.json`` entry of the attachment (file, SHA-256, step, dtype,
  provenance, both backbone fingerprints, whether they match). Raises
  ModelImportError when ``model``'s fingerprint differs from the one ``mf``
  was trained against, unless ``allow_other_target``."""
  from mtp.export.modules import model_fingerprint
  fp = model_fingerprint(model)
  if fp != mf.fingerprint and not allow_other_target:
    raise ModelImportError(f"{mf.path}: the modules were trained against another target (backbone "
                           f"fingerprint {mf.fingerprint[:16]}..., {target} has {fp[:16]}...); pass "
                           "--allow_other_target to attach them anyway")
  h = hashlib.sha256()
  with open(mf.path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return {"file": mf.path, "sha256": h.hexdigest(), "step": mf.step, "dtype": mf.dtype,
          "format_version": mf.meta.get("format_version"), "provenance": mf.provenance,
          "source_target": mf.meta.get("target"), "target_fingerprint": fp,
          "fingerprint_matches": fp == mf.fingerprint, "eval_row": mf.eval_row}


def carried_rows(entry: Mapping | None) -> list[dict]:
  """The new workdir's ``metrics.jsonl`` rows: the source's evaluation row at
  step 0 (its own step as ``source_step``), for
  ``decode.auto.calibrate.stage_prior``; [] when none (or no modules file)."""
  if not entry or not entry.get("eval_row"):
    return []
  row = dict(entry["eval_row"])
  row["source_step"] = row.get("step")
  row["step"] = 0
  row["split"] = row.get("split", "eval")
  row["source"] = "mtp_modules"
  return [row]


def attach_to_import(cfg, mf, target: str):
  """(cfg, mtp_params) of an import: ``cfg`` unchanged and None without a
  modules file (``mf`` None); else the config with the file's mtp section
  (``attached_config``) and the file's ``module_params`` for it."""
  if mf is None:
    return cfg, None
  cfg = attached_config(cfg, mf, target)
  return cfg, module_params(mf, cfg)


def provenance_entries(model, mf, target: str, allow_other_target: bool) -> dict:
  """The ``import.json`` entries of attached modules (``check_target``:
  refuses another target unless ``allow_other_target``); {} without ``mf``."""
  if mf is None:
    return {}
  return {"mtp_depth": mf.cfg.mtp.depth, "mtp_seed": None, "mtp_init": "mtp_modules",
          "mtp_init_scale": None,
          "mtp_modules": check_target(model, mf, target, allow_other_target)}


def check_exclusive(mtp_modules, given) -> None:
  """Raises ModelImportError when ``mtp_modules`` is given together with any
  of the new-module options named in ``given`` (e.g. ``["--mtp_depth"]``):
  the file decides the MTP depth and the modules' weights."""
  if mtp_modules and given:
    raise ModelImportError(f"--mtp_modules={mtp_modules!r} excludes {', '.join(given)}: the "
                           "modules file gives the MTP depth and the modules' weights")


def new_module_options(mtp_depth: int, mtp_init: str, mtp_init_scale: float, seed: int) -> list:
  """The new-module options of a library call that differ from their
  defaults (``check_exclusive``'s ``given``)."""
  return [name for name, v, default in (("--mtp_depth", mtp_depth, 0),
                                        ("--mtp_init", mtp_init, "random"),
                                        ("--mtp_init_scale", mtp_init_scale, 1.0),
                                        ("--seed", seed, 0)) if v != default]
