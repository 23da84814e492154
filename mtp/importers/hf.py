"""Hugging Face directory import: ``LlamaForCausalLM`` and
``MistralForCausalLM`` (without a sliding window) into a workdir.

Reads ``config.json``, ``model.safetensors`` (or its index's shards) and the
tokenizer files; names map through ``mtp.export.hf_name_map`` (q/k rows
already rotate-half). Refused, naming the ``config.json`` field: another
architecture, biases, a non-SiLU activation, rope scaling, a sliding window
shorter than the context, a ``tie_word_embeddings`` the tensors disagree with.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from mtp.importers import ModelImportError, default_never_emitted, model_config
from mtp.importers import mtp_init_provenance, params_from_hf_tensors, write_workdir

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
MODEL_TYPES = ("llama", "mistral")
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _read_json(path: str) -> Any:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ModelImportError(f"{path}: unreadable JSON ({e})") from e


def config_from_llama(hf: Mapping[str, Any], path: str, *, dtype: str, mtp_depth: int,
                      num_tokens: int, never_emitted=()):
  """Our Config from a Llama/Mistral ``config.json`` dict. Raises
  ModelImportError naming the field."""
  where = os.path.join(path, CONFIG)
  arch = hf.get("architectures") or []
  if len(arch) != 1 or arch[0] not in ARCHITECTURES:
    raise ModelImportError(f"{where}: architectures={arch!r} is not supported (supported: "
                           f"{', '.join(ARCHITECTURES)})")
  if hf.get("model_type") not in MODEL_TYPES:
    raise ModelImportError(f"{where}: model_type={hf.get('model_type')!r} is not supported")
  for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
    if key in hf and hf[key] != want:
      raise ModelImportError(f"{where}: {key}={hf[key]!r} is not supported by mtp.model "
                             f"(must be {want!r})")
  if hf.get("rope_scaling"):
    raise ModelImportError(f"{where}: rope_scaling={hf['rope_scaling']!r}: only unscaled RoPE "
                           "is supported by mtp.model")
  rope = hf.get("rope_parameters") or {}
  if rope.get("rope_type", "default") != "default":
    raise ModelImportError(f"{where}: rope_parameters.rope_type={rope.get('rope_type')!r}: only "
                           "'default' is supported by mtp.model")
  theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))

  def need(key):
    if hf.get(key) is None:
      raise ModelImportError(f"{where}: no '{key}' field")
    return hf[key]

  ctx = need("max_position_embeddings")
  window = hf.get("sliding_window")
  if window is not None and int(window) < int(ctx):
    raise ModelImportError(f"{where}: sliding_window={window} (< max_position_embeddings={ctx}) "
                           "is not supported by mtp.model (full causal attention only)")
  heads = need("num_attention_heads")
  vocab = need("vocab_size")
  if num_tokens > vocab:
    raise ModelImportError(f"{where}: the tokenizer has {num_tokens} tokens, more than "
                           f"vocab_size={vocab}")
  return model_config(
      source=where, vocab_size=vocab, d_model=need("hidden_size"),
      num_layers=need("num_hidden_layers"), num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or need("hidden_size") // heads,
      mlp_dim=need("intermediate_size"), max_seq_len=ctx, rope_theta=theta,
      norm_eps=need("rms_norm_eps"), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      dtype=dtype, num_tokens=num_tokens, never_emitted=never_emitted, mtp_depth=mtp_depth)


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of ``path/model.safetensors`` or of the shards of
  ``model.safetensors.index.json``, as float32 numpy arrays. Raises
  ModelImportError naming the file for a missing, truncated or corrupt one."""
  from safetensors import safe_open
  index = os.path.join(path, INDEX)
  if os.path.isfile(index):
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise ModelImportError(f"{index}: no 'weight_map'")
    files = sorted(set(weight_map.values()))
  elif os.path.isfile(os.path.join(path, WEIGHTS)):
    weight_map, files = None, [WEIGHTS]
  else:
    raise ModelImportError(f"{path}: no {WEIGHTS} or {INDEX}")
  out = {}
  for name in files:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
      raise ModelImportError(f"{file}: missing (listed in {INDEX})")
    try:
      with safe_open(file, framework="flax") as f:   # jax arrays: bfloat16 supported
        for key in f.keys():
          if weight_map is not None and weight_map.get(key) != name:
            raise ModelImportError(f"{file}: tensor '{key}' is not listed for this file in "
                                   f"{INDEX}")
          out[key] = np.asarray(f.get_tensor(key), np.float32)
    except ModelImportError:
      raise
    except Exception as e:   # safetensors raises SafetensorError / OSError for damage
      msg = str(e).strip().splitlines()
      raise ModelImportError(f"{file}: not a readable safetensors file ({type(e).__name__}"
                             f"{': ' + msg[0][:200] if msg else ''})") from e
  if weight_map is not None:
    absent = sorted(set(weight_map) - set(out))
    if absent:
      raise ModelImportError(f"{index}: tensor '{absent[0]}' is listed but in no shard")
  return out


def load_hf_dir(path: str, *, dtype: str = "float32", mtp_depth: int = 0, seed: int = 0,
                never_emitted=None, mtp_init: str = "random", mtp_init_scale: float = 1.0,
                mtp_modules: str | None = None, allow_other_target: bool = False):
  """Reads a Hugging Face directory into (config, model, tokenizer,
  provenance) without writing anything. ``mtp_modules``,
  ``allow_other_target``: as ``mtp.importers.gguf.load_gguf``. Raises
  ModelImportError."""
  from mtp.bpe import BPETokenizer
  from mtp.importers import attach
  from mtp.tokenizer import TokenizerError
  attach.check_exclusive(mtp_modules, attach.new_module_options(mtp_depth, mtp_init,
                                                                mtp_init_scale, seed))
  mf = attach.read(mtp_modules) if mtp_modules else None   # fails before the weights are read
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    raise ModelImportError(f"{path}: not a directory")
  if not os.path.isfile(os.path.join(path, CONFIG)):
    raise ModelImportError(f"{path}: no {CONFIG}")
  hf = _read_json(os.path.join(path, CONFIG))
  try:
    tokenizer = BPETokenizer.from_hf_dir(path, hf)
  except TokenizerError as e:
    raise ModelImportError(str(e)) from e
  if never_emitted is None:
    never_emitted = default_never_emitted(tokenizer)
  tokenizer = tokenizer.with_never_emitted(never_emitted)
  cfg = config_from_llama(hf, path, dtype=dtype, mtp_depth=mtp_depth,
                          num_tokens=tokenizer.vocab_size, never_emitted=never_emitted)
  cfg, mtp_params = attach.attach_to_import(cfg, mf, os.path.join(path, CONFIG))
  tensors = read_safetensors(path)
  where = os.path.join(path, WEIGHTS)
  if cfg.model.tie_embeddings and "lm_head.weight" in tensors:
    if not np.array_equal(tensors["lm_head.weight"], tensors.get("model.embed_tokens.weight")):
      raise ModelImportError(f"{os.path.join(path, CONFIG)}: tie_word_embeddings=true but "
                             "lm_head.weight differs from model.embed_tokens.weight")
    del tensors["lm_head.weight"]
  if not cfg.model.tie_embeddings and "lm_head.weight" not in tensors:
    raise ModelImportError(f"{os.path.join(path, CONFIG)}: tie_word_embeddings=false but the "
                           "weights have no lm_head.weight")
  tensors.pop("model.rotary_emb.inv_freq", None)        # a buffer some old exports carry
  for k in [k for k in tensors if k.endswith(".rotary_emb.inv_freq")]:
    del tensors[k]
  model = params_from_hf_tensors(cfg, tensors, where, seed=seed, mtp_init=mtp_init,
                                 mtp_init_scale=mtp_init_scale, mtp_params=mtp_params)
  provenance = {"format": "hf", "source": path, "architecture": hf.get("architectures"),
                "dtype": dtype, "mtp_depth": mtp_depth, "mtp_seed": seed if mtp_depth else None,
                **mtp_init_provenance(mtp_depth, mtp_init, mtp_init_scale),
                **attach.provenance_entries(model, mf, path, allow_other_target)}
  return cfg, model, tokenizer, provenance


def import_hf_dir(path: str, workdir: str, *, dtype: str = "float32", mtp_depth: int = 0,
                  seed: int = 0, never_emitted=None, mtp_init: str = "random",
                  mtp_init_scale: float = 1.0, mtp_modules: str | None = None,
                  allow_other_target: bool = False) -> str:
  """Imports a Hugging Face directory into a new ``workdir`` (with
  ``mtp_modules`` as ``mtp.importers.gguf.import_gguf``). Returns the
  absolute workdir. Raises ModelImportError; nothing is written then."""
  from mtp.importers import _check_workdir, attach
  _check_workdir(workdir)
  cfg, model, tokenizer, provenance = load_hf_dir(
      path, dtype=dtype, mtp_depth=mtp_depth, seed=seed, never_emitted=never_emitted,
      mtp_init=mtp_init, mtp_init_scale=mtp_init_scale, mtp_modules=mtp_modules,
      allow_other_target=allow_other_target)
  return write_workdir(workdir, cfg, model, tokenizer, provenance,
                       metrics_rows=attach.carried_rows(provenance.get("mtp_modules")))
