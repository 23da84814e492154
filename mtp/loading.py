"""The one loader: a trained model from whatever directory holds it.

``kind``: ``"workdir"`` (a training or import run directory, orbax through
``mtp.checkpoint``, several steps, the latest by default) or ``"exported"``
(a ``python -m mtp.export`` Hugging Face directory, ``config.json`` +
``model.safetensors``, one set of weights). Every reader (decode,
``train.init_from``, export, the scripts) goes through here. Imports
``mtp.checkpoint`` and ``mtp.export``; neither imports this module.
"""

from __future__ import annotations

import json
import os

import jax
from flax import nnx

from mtp import checkpoint as ckpt_lib
from mtp import export as export_lib
from mtp.checkpoint import CheckpointError
from mtp.config import Config
from mtp.model import build_model

WORKDIR = "workdir"
EXPORTED = "exported"


def kind(path: str) -> str:
  """``"exported"`` for a directory written by ``mtp.export`` that has no
  ``checkpoints/`` folder, else ``"workdir"`` (whether or not it holds a
  checkpoint yet: the readers below say what is missing)."""
  if export_lib.is_exported(path) and not os.path.isdir(ckpt_lib.checkpoint_dir(path)):
    return EXPORTED
  return WORKDIR


def _exported(path: str, step: int | None):
  if step is not None:
    raise CheckpointError(f"{path!r} is an exported model (one set of weights); "
                          f"step={step} cannot be chosen")
  try:
    return export_lib.load_exported(path)
  except export_lib.ExportError as e:
    raise CheckpointError(str(e)) from e


def load_config(path: str, step: int | None = None) -> tuple[Config, int]:
  """(config, step) of checkpoint ``step`` (default latest) of a workdir, or of
  an export (``step`` None); reads no parameters. Raises CheckpointError."""
  if kind(path) == EXPORTED:
    if step is not None:
      _exported(path, step)
    try:
      with open(os.path.join(path, export_lib.CONFIG_FILE), encoding="utf-8") as f:
        hf = json.load(f)
      cfg = export_lib.config_from_hf(hf, os.path.abspath(path))
    except (OSError, ValueError) as e:     # ExportError is a ValueError
      raise CheckpointError(f"cannot read the export in {path!r}: {e}") from e
    return cfg, int((hf.get("mtp") or {}).get("step", 0))
  ckpt = ckpt_lib.Checkpointer(path, read_only=True)
  try:       # closed on errors too: an open manager spews asyncio errors at exit
    return ckpt.read_step(step, lambda s: (ckpt.restore_config(s), s))
  finally:
    ckpt.close()


def load_params(path: str, step: int | None, abstract_params):
  """The parameters (nnx State) of checkpoint ``step`` of ``path`` (an export:
  ``step`` None), placed like ``abstract_params`` (``ShapeDtypeStruct``s,
  with shardings where wanted). Raises CheckpointError (missing, unreadable,
  non-finite or not matching)."""
  if kind(path) == EXPORTED:
    _, model, _ = _exported(path, step)
    params = nnx.state(model, nnx.Param)
    try:
      return jax.tree.map(lambda x, a: jax.device_put(x, getattr(a, "sharding", None)),
                          params, abstract_params)
    except ValueError as e:
      raise CheckpointError(f"the export in {path!r} does not match the model: {e}") from e
  ckpt = ckpt_lib.Checkpointer(path, read_only=True)
  try:
    params, _ = ckpt.read_step(step, lambda s: ckpt.restore(s, abstract_params))
  finally:
    ckpt.close()
  return params


def load_model(path: str, step: int | None = None):
  """(config, model, step) for inference from a workdir (checkpoint ``step``,
  default the newest complete one, also while a run writes it) or a
  ``python -m mtp.export`` directory (``step`` None); the parameters are jax
  arrays on the first device. Raises CheckpointError."""
  if kind(path) == EXPORTED:
    return _exported(path, step)
  ckpt = ckpt_lib.Checkpointer(path, read_only=True)
  try:       # closed on errors too: an open manager spews asyncio errors at exit
    return ckpt.read_step(step, lambda s: _read_model(ckpt, s))
  finally:
    ckpt.close()


def _read_model(ckpt, step: int):
  """(config, model, step) of checkpoint ``step`` of open Checkpointer ``ckpt``
  (``load_model``)."""
  cfg = ckpt.restore_config(step)
  model = nnx.eval_shape(lambda: build_model(cfg))
  graphdef, abstract_params = nnx.split(model, nnx.Param)
  # with a sharding orbax restores device arrays, without one numpy arrays
  # (which every jitted call would then copy to the device again)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          abstract_params)
  params, _ = ckpt.restore(step, abstract)
  return cfg, nnx.merge(graphdef, params), step


def overridden_config(cfg: Config, *, dtype: str | None = None,
                      attention_impl: str | None = None) -> Config:
  """``cfg`` with the inference-time settings that leave the architecture alone:
  ``dtype`` (``model.dtype`` and ``param_dtype``) and ``attention_impl``; None
  keeps the saved value. Validated: a bad value raises ConfigError naming the
  field."""
  changes = {}
  if dtype is not None:
    changes.update(dtype=dtype, param_dtype=dtype)
  if attention_impl is not None:
    changes["attention_impl"] = attention_impl
  return cfg.replace(model=changes) if changes else cfg


def override_model(cfg: Config, model, *, dtype: str | None = None,
                   attention_impl: str | None = None):
  """(config, model) for ``overridden_config(cfg, ...)``: the model rebuilt with
  floating parameters cast once to the new ``param_dtype`` (integer ones
  kept); unchanged when nothing changes. Raises ConfigError."""
  new_cfg = overridden_config(cfg, dtype=dtype, attention_impl=attention_impl)
  if new_cfg == cfg:
    return cfg, model
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build_model(new_cfg)), nnx.Param)
  params = nnx.state(model, nnx.Param)

  def cast(x, a):
    if x.dtype == a.dtype or not jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
      return x
    return x.astype(a.dtype)
  return new_cfg, nnx.merge(graphdef, jax.tree.map(cast, params, abstract))
