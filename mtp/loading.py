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
  """(config, step) of checkpoint ``step`` (default: the latest) of a
  workdir, or of an exported directory (its recorded step; ``step`` must be
  None). Reads no parameters of a workdir.

  Raises CheckpointError (no checkpoint, unreadable config, bad export).
  """
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
  """The parameters (an nnx State) of checkpoint ``step`` of ``path`` (a
  workdir, or an exported directory with ``step`` None), placed like
  ``abstract_params`` (a pytree of ``jax.ShapeDtypeStruct``, with shardings
  where wanted: a workdir's arrays are restored straight into them).
  Optimizer state, step and data position are not read.

  Raises CheckpointError (missing, unreadable, non-finite or not matching
  ``abstract_params``).
  """
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
  """Loads a trained model for inference from a training workdir (checkpoint
  ``step``, default the latest) or from a directory written by ``python -m
  mtp.export`` (``step`` must then be None).

  Returns (config, model, step): ``model`` a ``mtp.model.Transformer`` with
  its parameters as jax arrays on the first device. Raises CheckpointError when the
  workdir has no readable checkpoint or the export cannot be read.

  A workdir that a training run is writing (its ``train.lock``) loads its
  newest complete step: see ``mtp.checkpoint.Checkpointer.read_step`` (so do
  ``load_config`` and ``load_params``).
  """
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
  """``cfg`` with the inference-time settings a reader may change without
  touching the parameters' architecture: ``dtype`` sets ``model.dtype`` and
  ``model.param_dtype`` (decode a float32-trained or imported model in
  bfloat16), ``attention_impl`` sets ``model.attention_impl`` (a checkpoint
  saved before "auto" existed stores "blockwise"). None keeps the saved
  value. The result goes through ``mtp.config``'s validation, so a bad value
  is the ConfigError line that names the field and its allowed values."""
  changes = {}
  if dtype is not None:
    changes.update(dtype=dtype, param_dtype=dtype)
  if attention_impl is not None:
    changes["attention_impl"] = attention_impl
  return cfg.replace(model=changes) if changes else cfg


def override_model(cfg: Config, model, *, dtype: str | None = None,
                   attention_impl: str | None = None):
  """(config, model) for ``overridden_config(cfg, ...)``: ``model`` rebuilt
  for the new config (its modules read dtype and attention implementation
  when built) with its floating parameters cast to the new
  ``model.param_dtype`` once, here, so no decode step casts weights again;
  integer parameters (a draft vocabulary's ids) are kept. Returns ``(cfg,
  model)`` unchanged when nothing changes. Raises ConfigError (see
  ``overridden_config``)."""
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
