"""GGUF (llama.cpp) import: a ``llama``-architecture file into a workdir.

Read with ``gguf.GGUFReader`` (memmap); F32, F16, BF16, Q8_0, Q4_0 and Q4_1
tensors are dequantized to float32 (then ``--dtype``). Names follow
llama.cpp's tensor map (``token_embd`` -> ``model.embed_tokens``,
``blk.i.attn_q`` -> ``self_attn.q_proj``, ...; no ``output``: tied); ggml
shape [ne0, ne1] is the array [ne1, ne0]. ``unpermute_qk`` undoes the
converter's Q/K row permutation for interleaved RoPE (docs/import.md).
Metadata ``llama.*`` gives the ``ModelConfig``; another architecture, rope
scaling, a sliding window, experts, partial rotary, biases or an
unsupported tensor type are refused, naming the key.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from mtp.importers import ModelImportError, default_never_emitted, model_config
from mtp.importers import mtp_init_provenance, params_from_hf_tensors, write_workdir

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str | None:
  """The Hugging Face Llama name of a GGUF tensor name, or None if unknown."""
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
  if m and m.group(2) in _BLOCK_NAMES:
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.weight"
  return None


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's converter permutation (rotate-half rows -> interleaved):
  w [n*H, D] -> same shape. For tests and writers."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverse of ``permute_qk``: interleaved-RoPE rows back to rotate-half
  rows, w [n*H, D] (n = heads of this projection)."""
  return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def _value(field) -> Any:
  v = field.contents()
  return v


def read_gguf(path: str):
  """(metadata {key: value}, tensors {gguf name: (type name, numpy data)})
  of a GGUF file; data is the raw (possibly quantized) array of the reader.
  Raises ModelImportError naming the file for an unreadable, truncated or
  corrupt file."""
  try:
    import gguf
  except ImportError as e:
    raise ModelImportError("reading GGUF needs the 'gguf' package: pip install gguf") from e
  if not os.path.isfile(path):
    raise ModelImportError(f"{path}: no such file")
  try:
    reader = gguf.GGUFReader(path)
    meta = {}
    for key, field in reader.fields.items():
      if key.startswith("GGUF."):
        continue
      meta[key] = _value(field)
    tensors = {}
    size = os.path.getsize(path)
    for t in reader.tensors:
      end = int(t.data_offset) + int(t.n_bytes)
      if end > size:
        raise ValueError(f"tensor {t.name!r} ends at byte {end}, past the end of the file "
                         f"({size} bytes): truncated")
      tensors[t.name] = (t.tensor_type.name, t.data, [int(x) for x in t.shape])
  except ModelImportError:
    raise
  except Exception as e:   # the reader raises ValueError, KeyError, struct/numpy errors
    msg = str(e).strip().splitlines()
    raise ModelImportError(f"{path}: not a readable GGUF file ({type(e).__name__}"
                           f"{': ' + msg[0][:200] if msg else ''})") from e
  return meta, tensors


def dequantize(name: str, type_name: str, data: np.ndarray, shape, path: str) -> np.ndarray:
  """float32 array in numpy order (ggml shape reversed) of one tensor.
  Raises ModelImportError for an unsupported type."""
  import gguf
  if type_name not in SUPPORTED_TYPES:
    raise ModelImportError(f"{path}: tensor '{name}' has type {type_name}, not supported "
                           f"(supported: {', '.join(SUPPORTED_TYPES)})")
  qtype = gguf.GGMLQuantizationType[type_name]
  try:
    out = gguf.quants.dequantize(np.asarray(data), qtype)
    return np.asarray(out, np.float32).reshape(tuple(reversed(shape)))
  except Exception as e:
    raise ModelImportError(f"{path}: tensor '{name}' ({type_name}, shape {shape}) cannot be "
                           f"dequantized ({type(e).__name__}: {e})") from e


def config_from_gguf(meta: dict, tensors: dict, path: str, *, dtype: str, mtp_depth: int,
                     num_tokens: int, never_emitted=()):
  """Our Config from GGUF metadata (module docstring). Raises
  ModelImportError naming the key."""
  arch = meta.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ModelImportError(f"{path}: general.architecture={arch!r} is not supported (supported: "
                           f"{', '.join(SUPPORTED_ARCHITECTURES)})")

  def need(key):
    k = f"{arch}.{key}"
    if k not in meta:
      raise ModelImportError(f"{path}: no '{k}' metadata")
    return meta[k]

  for key in ("expert_count", "attention.sliding_window"):
    v = meta.get(f"{arch}.{key}")
    if v:
      raise ModelImportError(f"{path}: {arch}.{key}={v!r} is not supported by mtp.model")
  scaling = meta.get(f"{arch}.rope.scaling.type")
  if scaling not in (None, "none") or (meta.get(f"{arch}.rope.scaling.factor") or 1.0) != 1.0:
    raise ModelImportError(f"{path}: {arch}.rope.scaling.type={scaling!r}: only unscaled RoPE is "
                           "supported by mtp.model")
  if "rope_freqs.weight" in tensors:
    raise ModelImportError(f"{path}: tensor 'rope_freqs.weight' (llama3-style RoPE frequency "
                           "factors) is not supported by mtp.model")
  d_model, heads = int(need("embedding_length")), int(need("attention.head_count"))
  kv = int(meta.get(f"{arch}.attention.head_count_kv", heads))
  head_dim = int(meta.get(f"{arch}.attention.key_length", d_model // heads))
  value_dim = int(meta.get(f"{arch}.attention.value_length", head_dim))
  rot = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
  if value_dim != head_dim:
    raise ModelImportError(f"{path}: {arch}.attention.value_length={value_dim} differs from "
                           f"key_length={head_dim}; not supported by mtp.model")
  if rot != head_dim:
    raise ModelImportError(f"{path}: {arch}.rope.dimension_count={rot} != head_dim={head_dim} "
                           "(partial rotary embedding) is not supported by mtp.model")
  if "token_embd.weight" not in tensors:
    raise ModelImportError(f"{path}: no tensor 'token_embd.weight'")
  vocab = int(tensors["token_embd.weight"][2][1])
  if f"{arch}.vocab_size" in meta and int(meta[f"{arch}.vocab_size"]) != vocab:
    raise ModelImportError(f"{path}: {arch}.vocab_size={meta[f'{arch}.vocab_size']} differs from "
                           f"token_embd.weight's {vocab} rows")
  if num_tokens > vocab:
    raise ModelImportError(f"{path}: the tokenizer has {num_tokens} tokens, more than the "
                           f"embedding's {vocab} rows")
  return model_config(
      source=path, vocab_size=vocab, d_model=d_model, num_layers=need("block_count"),
      num_heads=heads, num_kv_heads=kv, head_dim=head_dim, mlp_dim=need("feed_forward_length"),
      max_seq_len=need("context_length"), rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
      norm_eps=need("attention.layer_norm_rms_epsilon"),
      tie_embeddings="output.weight" not in tensors, dtype=dtype, num_tokens=num_tokens,
      never_emitted=never_emitted, mtp_depth=mtp_depth)


def load_gguf(path: str, *, dtype: str = "float32", mtp_depth: int = 0, seed: int = 0,
              never_emitted=None, mtp_init: str = "random", mtp_init_scale: float = 1.0,
              mtp_modules: str | None = None, allow_other_target: bool = False):
  """Reads a GGUF file into (config, model, tokenizer, provenance) without
  writing anything. ``never_emitted``: ids the head never emits (default
  ``mtp.importers.default_never_emitted``). ``mtp_modules``: an MTP modules
  file (``mtp.export.modules``) whose trained modules, mtp section and draft
  vocabulary are attached instead of new modules (excludes ``mtp_depth``,
  ``mtp_init``, ``mtp_init_scale``, ``seed``; ``mtp.importers.attach``);
  ``allow_other_target``: attach them to a backbone other than the one they
  were trained against. Raises ModelImportError."""
  from mtp.bpe import BPETokenizer
  from mtp.importers import attach
  from mtp.tokenizer import TokenizerError
  attach.check_exclusive(mtp_modules, attach.new_module_options(mtp_depth, mtp_init,
                                                                mtp_init_scale, seed))
  mf = attach.read(mtp_modules) if mtp_modules else None   # fails before the GGUF is read
  path = os.path.abspath(os.path.expanduser(path))
  meta, raw = read_gguf(path)
  try:
    tokenizer = BPETokenizer.from_gguf_metadata(meta, source=path)
  except ImportError as e:
    raise ModelImportError(f"the BPE tokenizer needs 'tokenizers': {e}") from e
  except TokenizerError as e:
    raise ModelImportError(str(e)) from e
  if never_emitted is None:
    never_emitted = default_never_emitted(tokenizer)
  tokenizer = tokenizer.with_never_emitted(never_emitted)
  cfg = config_from_gguf(meta, raw, path, dtype=dtype, mtp_depth=mtp_depth,
                         num_tokens=tokenizer.vocab_size, never_emitted=never_emitted)
  cfg, mtp_params = attach.attach_to_import(cfg, mf, path)
  tensors, types = {}, {}
  for name, (type_name, data, shape) in raw.items():
    hf = hf_name(name)
    if hf is None:
      raise ModelImportError(f"{path}: tensor '{name}' has no place in mtp.model (biases and "
                             "other extra tensors are not supported)")
    w = dequantize(name, type_name, data, shape, path)
    if ".attn_q." in name:
      w = unpermute_qk(w, cfg.model.num_heads)
    elif ".attn_k." in name:
      w = unpermute_qk(w, cfg.model.num_kv_heads)
    tensors[hf] = w
    types[type_name] = types.get(type_name, 0) + 1
  model = params_from_hf_tensors(cfg, tensors, path, seed=seed, mtp_init=mtp_init,
                                 mtp_init_scale=mtp_init_scale, mtp_params=mtp_params)
  provenance = {"format": "gguf", "source": path, "size_bytes": os.path.getsize(path),
                "tensor_types": types, "general.name": meta.get("general.name"),
                "general.license": meta.get("general.license"), "dtype": dtype,
                "mtp_depth": mtp_depth, "mtp_seed": seed if mtp_depth else None,
                **mtp_init_provenance(mtp_depth, mtp_init, mtp_init_scale),
                **attach.provenance_entries(model, mf, path, allow_other_target)}
  return cfg, model, tokenizer, provenance


def import_gguf(path: str, workdir: str, *, dtype: str = "float32", mtp_depth: int = 0,
                seed: int = 0, never_emitted=None, mtp_init: str = "random",
                mtp_init_scale: float = 1.0, mtp_modules: str | None = None,
                allow_other_target: bool = False) -> str:
  """Imports a GGUF file into a new ``workdir`` (``mtp.importers``; with
  ``mtp_modules``, as ``load_gguf``, plus the file's evaluation row in
  ``metrics.jsonl``). Returns the absolute workdir. Raises
  ModelImportError; nothing is written then."""
  from mtp.importers import _check_workdir, attach
  _check_workdir(workdir)                     # fail before the slow part
  cfg, model, tokenizer, provenance = load_gguf(
      path, dtype=dtype, mtp_depth=mtp_depth, seed=seed, never_emitted=never_emitted,
      mtp_init=mtp_init, mtp_init_scale=mtp_init_scale, mtp_modules=mtp_modules,
      allow_other_target=allow_other_target)
  return write_workdir(workdir, cfg, model, tokenizer, provenance,
                       metrics_rows=attach.carried_rows(provenance.get("mtp_modules")))
