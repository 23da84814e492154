"""Import a pretrained Llama-family model into a workdir (docs/import.md).

``python -m mtp.importers --gguf FILE`` (``mtp.importers.gguf``) or ``--hf
DIR`` (``mtp.importers.hf``) ``--workdir DIR`` writes what
``mtp.loading.load_model`` reads like a trained workdir: ``checkpoints/0/``
(parameters, empty optimizer state, config), ``tokenizer/`` (BPE) and
``import.json`` (source file, format, tensor types). The config has
``model.tokenizer = "bpe"``, ``model.num_tokens`` and ``model.never_emitted``.
``--mtp_depth D`` adds new modules (``--mtp_init``: ``attach_init``);
``--mtp_modules FILE`` attaches trained ones (``mtp.importers.attach``).
Written into a temporary sibling renamed at the end: a failure leaves
nothing. Errors are ``ModelImportError`` naming the file and field or tensor.
Tensor names are Hugging Face Llama names (``mtp.export.hf_name_map``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

DTYPES = ("float32", "bfloat16")
MTP_INITS = ("random", "last_block")
IMPORT_FILE = "import.json"
METRICS_FILE = "metrics.jsonl"        # train.workdir.METRICS_FILE (mtp does not import train)


class ModelImportError(ValueError):
  """A file or directory that cannot be imported; the message is one line
  naming the file and what is wrong."""


def model_config(*, source: str, vocab_size: int, d_model: int, num_layers: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, mlp_dim: int, max_seq_len: int,
                 rope_theta: float, norm_eps: float, tie_embeddings: bool, dtype: str,
                 num_tokens: int, never_emitted=(), mtp_depth: int = 0):
  """A validated ``mtp.config.Config`` for an imported model (training
  sections at their defaults, ``train.seq_len`` capped by the context).
  Raises ModelImportError naming ``source`` and the field."""
  from mtp import config as config_lib
  if dtype not in DTYPES:
    raise ModelImportError(f"--dtype={dtype!r}: must be one of {DTYPES}")
  model = dict(vocab_size=int(vocab_size), d_model=int(d_model), num_layers=int(num_layers),
               num_heads=int(num_heads), num_kv_heads=int(num_kv_heads), head_dim=int(head_dim),
               mlp_dim=int(mlp_dim), max_seq_len=int(max_seq_len), rope_theta=float(rope_theta),
               norm_eps=float(norm_eps), tie_embeddings=bool(tie_embeddings), dtype=dtype,
               param_dtype=dtype, tokenizer="bpe", num_tokens=int(num_tokens),
               never_emitted=",".join(str(int(i)) for i in sorted(set(never_emitted))))
  seq_len = min(config_lib.TrainConfig.seq_len, int(max_seq_len))
  try:
    return config_lib.from_dict({"model": model, "mtp": {"depth": int(mtp_depth)},
                                 "train": {"seq_len": seq_len}})
  except config_lib.ConfigError as e:
    raise ModelImportError(f"{source}: the model cannot be expressed: {e}") from e


def default_never_emitted(tokenizer) -> tuple[int, ...]:
  """The PAD id when it is a distinct token (neither EOS nor a stop id):
  never a training target, so never a correct next token. Else ()."""
  pad = tokenizer.pad_id
  if pad is None or pad == tokenizer.eos_id or pad in tokenizer.stop_ids:
    return ()
  return (int(pad),)


def params_from_hf_tensors(cfg, tensors: Mapping[str, np.ndarray], source: str, *,
                           seed: int = 0, mtp_init: str = "random", mtp_init_scale: float = 1.0,
                           mtp_params: Mapping[tuple, np.ndarray] | None = None):
  """Our ``Transformer`` from Hugging Face Llama tensors (``{name: float
  array in torch layout}``; Q/K already in rotate-half order), through
  ``mtp.export.hf_name_map``. The backbone must be complete; MTP modules
  (``cfg.mtp.depth`` > 0) are newly initialised when absent: from ``seed``,
  then with ``mtp_init="last_block"`` overwritten by ``attach_init``
  (``mtp_init_scale`` s: the projection's pass-through block is s * I).
  ``mtp_params``: trained modules instead ({flat path: array} of every
  ``mtp/...`` parameter and ``draft_vocab``, already shaped and cast:
  ``mtp.importers.attach.module_params``).

  Raises ModelImportError naming ``source`` and the tensor for a missing,
  unexpected, misshapen or non-finite tensor.
  """
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from mtp import export as ex
  from mtp.model import build_model
  rows = [r for r in ex.hf_name_map(cfg.model, 0)]
  names = {r.hf_name for r in rows}
  missing = [n for n in (r.hf_name for r in rows) if n not in tensors]
  if missing:
    raise ModelImportError(f"{source}: no tensor '{missing[0]}' ({len(missing)} missing)")
  unexpected = sorted(set(tensors) - names)
  if unexpected:
    raise ModelImportError(f"{source}: tensor '{unexpected[0]}' has no place in mtp.model "
                           f"({len(unexpected)} unexpected; biases, rope_freqs or extra layers "
                           "are not supported)")
  pdt = np.dtype(jnp.dtype(cfg.model.param_dtype))
  if mtp_init not in MTP_INITS:
    raise ModelImportError(f"--mtp_init={mtp_init!r}: must be one of {MTP_INITS}")
  if not (math.isfinite(mtp_init_scale) and mtp_init_scale > 0):
    raise ModelImportError(f"--mtp_init_scale={mtp_init_scale!r}: must be a finite number > 0")
  if cfg.mtp.depth and mtp_params is None:
    model = build_model(cfg, seed)
  else:
    model = nnx.eval_shape(lambda: build_model(cfg, seed))
  graphdef, state = nnx.split(model, nnx.Param)
  flat = dict((tuple(p), v) for p, v in nnx.to_flat_state(state))
  leaves = {}
  for r in rows:
    w = np.asarray(tensors[r.hf_name])
    if not np.issubdtype(w.dtype, np.floating) and w.dtype.name != "bfloat16":
      raise ModelImportError(f"{source}: tensor '{r.hf_name}' has dtype {w.dtype}, not a float")
    w32 = w.astype(np.float32)
    bad = int(np.sum(~np.isfinite(w32)))
    if bad:
      raise ModelImportError(f"{source}: tensor '{r.hf_name}' {tuple(w.shape)} holds {bad} "
                             "non-finite value(s)")
    value = ex._from_hf(w32, r.transform)
    var = flat[r.path]
    want = var.get_value().shape
    if value.shape != tuple(want):
      raise ModelImportError(f"{source}: tensor '{r.hf_name}' has shape {tuple(w.shape)}; "
                             f"the config needs {tuple(ex._to_hf(np.zeros(want), r.transform).shape)}")
    leaves[r.path] = var.replace(jnp.asarray(value.astype(pdt)))
  for p, var in flat.items():
    if p not in leaves:
      if p[0] != "mtp" and p != ("draft_vocab",):
        raise ModelImportError(f"{source}: parameter {'.'.join(map(str, p))} has no tensor")
      if mtp_params is None:
        leaves[p] = var
      elif p not in mtp_params:
        raise ModelImportError(f"{source}: parameter {'.'.join(map(str, p))} has no value in the "
                               "MTP modules given")
      else:
        leaves[p] = var.replace(jnp.asarray(mtp_params[p]))
  if cfg.mtp.depth and mtp_init == "last_block":
    leaves = attach_init(leaves, cfg.model.num_layers, cfg.mtp.depth, scale=mtp_init_scale)
  return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def attach_init(leaves: dict, num_layers: int, depth: int, *, scale: float = 1.0) -> dict:
  """"last_block" initialisation of new MTP modules on an imported backbone:
  module k = 1..D starts as a copy of the last backbone block (``blocks/<L-1>``),
  its projection M_k [2D -> D] is [s * I; 0] (h'^k = s * h^{k-1} / rms(h^{k-1});
  the embedding enters once M_k learns to read it), hidden_norm and
  embed_norm are ones, out_norm is the final norm (module k's head is the
  main head). s = ``--mtp_init_scale`` (default 1; rms(h^0) is better). A
  starting point for training, not a working drafter (docs/import.md).

  leaves: {flat nnx path tuple: Param} of the whole model, in the layout of
  ``mtp.model.Transformer``; returns changed copies, other entries as given."""
  out = dict(leaves)
  last = num_layers - 1
  for path, var in leaves.items():
    if path[0] != "mtp":
      continue
    rest = tuple(path[2:])
    value = None
    if rest[0] == "block":
      value = leaves[("blocks", last) + rest[1:]].get_value()
    elif rest[0] == "out_norm":
      value = leaves[("final_norm",) + rest[1:]].get_value()
    elif rest[0] in ("hidden_norm", "embed_norm"):
      value = np.ones(var.get_value().shape, np.float32)
    elif rest[0] == "proj":
      w = np.zeros(var.get_value().shape, np.float32)          # kernel [2D, D] (in, out)
      d = w.shape[1]
      w[:d] = scale * np.eye(d, dtype=np.float32)
      value = w
    if value is not None:
      import jax.numpy as jnp
      out[path] = var.replace(jnp.asarray(value, dtype=var.get_value().dtype))
  return out


def mtp_init_provenance(mtp_depth: int, mtp_init: str, scale: float) -> dict:
  """The ``import.json`` entries of the modules' initialisation."""
  if not mtp_depth:
    return {"mtp_init": None}
  return {"mtp_init": mtp_init, "mtp_init_scale": float(scale) if mtp_init == "last_block" else None}


def _check_workdir(workdir: str) -> str:
  out = os.path.abspath(os.path.expanduser(workdir))
  if os.path.lexists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise ModelImportError(f"--workdir={out!r} already exists and is not an empty directory; "
                           "choose a new one")
  return out


def write_workdir(workdir: str, cfg, model, tokenizer, provenance: Mapping[str, Any],
                  metrics_rows=()) -> str:
  """Writes an imported model as a workdir (module docstring): checkpoint at
  step 0, tokenizer, ``import.json``, and ``metrics.jsonl`` with
  ``metrics_rows`` (dicts, one JSON line each) when there are any (the
  evaluation row an MTP modules file carries). Atomic: a temporary sibling
  folder is renamed to ``workdir``. Returns the absolute path.

  Raises ModelImportError when ``workdir`` exists and is not empty."""
  from flax import nnx
  from mtp import checkpoint as ckpt_lib
  from mtp import tokenizer as tok
  out = _check_workdir(workdir)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.import-", dir=os.path.dirname(out))
  try:
    ckpt = ckpt_lib.Checkpointer(tmp, keep=1)
    try:
      ckpt.save(0, nnx.state(model, nnx.Param), {}, None, cfg)
    finally:
      ckpt.close()
    tok.save_tokenizer(tokenizer, tmp)
    with open(os.path.join(tmp, IMPORT_FILE), "w", encoding="utf-8") as f:
      json.dump(dict(provenance), f, indent=2, sort_keys=True)
      f.write("\n")
    if metrics_rows:
      with open(os.path.join(tmp, METRICS_FILE), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(dict(r)) + "\n" for r in metrics_rows)
    os.chmod(tmp, 0o755)
    if os.path.isdir(out):
      os.rmdir(out)                      # empty (checked)
    os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out
