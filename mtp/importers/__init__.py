"""Import a pretrained Llama-family model into a workdir.

``python -m mtp.importers --gguf FILE --workdir DIR`` (``mtp.importers.gguf``)
or ``--hf DIR`` (``mtp.importers.hf``: ``LlamaForCausalLM`` /
``MistralForCausalLM`` safetensors) writes a workdir that
``mtp.loading.load_model`` (and ``python -m decode --workdir DIR``,
``train.init_from``) reads like a trained one:

- ``checkpoints/0/``: an orbax checkpoint at step 0 (parameters; an empty
  optimizer state; the config) written by ``mtp.checkpoint.Checkpointer``;
- ``tokenizer/``: the BPE tokenizer (``mtp.tokenizer.save_tokenizer``);
- ``import.json``: where the weights came from (file, format, tensor types).

The model config says ``model.tokenizer = "bpe"``, ``model.num_tokens`` = the
tokenizer's vocabulary and ``model.never_emitted`` (by default the PAD id when
it is neither EOS nor a stop id, else nothing), so the head gives ids past the
vocabulary and those specials probability exactly 0. With ``--mtp_depth D``
the D MTP modules are new (randomly initialised from ``--seed``), for a
second training stage; the backbone is the imported one.

Everything is written into a temporary sibling folder renamed to the
workdir at the end: a failure (a corrupt file, an unsupported feature) leaves
nothing behind. Errors are ``ModelImportError``: one line naming the file and
the field or tensor.

The tensor names are Hugging Face Llama names; the table from them to our
parameters is ``mtp.export.hf_name_map`` (shared with the exporter).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

DTYPES = ("float32", "bfloat16")
IMPORT_FILE = "import.json"


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
                           seed: int = 0):
  """Our ``Transformer`` from Hugging Face Llama tensors (``{name: float
  array in torch layout}``; Q/K already in rotate-half order), through
  ``mtp.export.hf_name_map``. The backbone must be complete; MTP modules
  (``cfg.mtp.depth`` > 0) are newly initialised from ``seed`` when absent.

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
  if cfg.mtp.depth:
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
      if p[0] != "mtp":
        raise ModelImportError(f"{source}: parameter {'.'.join(map(str, p))} has no tensor")
      leaves[p] = var
  return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def _check_workdir(workdir: str) -> str:
  out = os.path.abspath(os.path.expanduser(workdir))
  if os.path.lexists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise ModelImportError(f"--workdir={out!r} already exists and is not an empty directory; "
                           "choose a new one")
  return out


def write_workdir(workdir: str, cfg, model, tokenizer, provenance: Mapping[str, Any]) -> str:
  """Writes an imported model as a workdir (module docstring): checkpoint at
  step 0, tokenizer, ``import.json``. Atomic: a temporary sibling folder is
  renamed to ``workdir``. Returns the absolute path.

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
    os.chmod(tmp, 0o755)
    if os.path.isdir(out):
      os.rmdir(out)                      # empty (checked)
    os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out
