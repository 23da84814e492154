"""Hugging Face export format: a trained model as a ``LlamaForCausalLM``
directory with the MTP modules under DeepSeek-V3 naming, and back
(``load_exported``, bitwise-identical parameters; ``mtp.loading.load_model``
accepts such a directory in place of a workdir).

``python -m mtp.export`` (``mtp/export/__main__.py``) calls
``mtp.exporting.export``, which loads the checkpoint and calls
``write_export`` here; this module is the format only and imports neither
``mtp.checkpoint`` nor ``mtp.loading``. The directory: ``config.json``
(LlamaConfig + ``num_nextn_predict_layers`` = D + an ``mtp`` entry),
``model.safetensors`` (module k as layer L + k - 1, ``hf_name_map``),
``generation_config.json`` (``suppress_tokens`` = the ids our head never
emits) and the tokenizer files. Table and limits: docs/export.md. Writing
needs numpy and safetensors only (jax/flax inside functions).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from mtp.bpe import bytes_to_unicode
from mtp import config as config_lib
from mtp import tokenizer as tok
from mtp.config import Config, ModelConfig

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"

# ModelConfig fields that config.json expresses (see _hf_config). A new field
# is refused by check_exportable until the exporter learns to write it.
# attention_impl / attention_block_size choose how a KV cache is read and
# matmul_precision how exactly matmuls run, not what the model computes
# (LlamaForCausalLM has no equivalent to write; the "mtp" entry keeps them).
_EXPORTABLE_MODEL_FIELDS = frozenset({
    "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
    "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings", "dtype", "param_dtype",
    "tokenizer", "num_tokens", "never_emitted", "attention_impl", "attention_block_size",
    "matmul_precision"})

# How a tensor is stored, from our parameter to the HF tensor:
#   "copy":      same array ([V, D] embeddings, [D] RMSNorm scales)
#   "transpose": nnx.Linear kernel [in, out] -> torch weight [out, in]
#   "eh_proj":   our MTP projection kernel [2D, D] over [hnorm(h); enorm(e)] ->
#                DeepSeek's eh_proj weight [D, 2D] over [enorm(e); hnorm(h)]
#                (halves of the input swapped, then transposed)
_TRANSFORMS = ("copy", "transpose", "eh_proj")


class ExportError(ValueError):
  """A model or directory that cannot be exported or imported, or a bad
  output path; the message names the field, tensor or path."""


@dataclasses.dataclass(frozen=True)
class TensorMapping:
  """One row of the mapping table: our parameter path (as in
  ``nnx.to_flat_state(nnx.state(model, nnx.Param))``), the HF tensor name and
  the transform (``"copy"``, ``"transpose"`` or ``"eh_proj"``). ``alias_of``:
  for the DeepSeek-V3 copies of shared tensors (``model.layers.{i}.embed_tokens``,
  ``.shared_head.head``), the HF name of the tensor they duplicate."""
  path: tuple
  hf_name: str
  transform: str
  alias_of: str | None = None


def _block_rows(prefix: tuple, layer: str) -> list[TensorMapping]:
  rows = [TensorMapping(prefix + ("attn_norm", "scale"), f"{layer}.input_layernorm.weight", "copy"),
          TensorMapping(prefix + ("mlp_norm", "scale"), f"{layer}.post_attention_layernorm.weight",
                        "copy")]
  for ours in ("q_proj", "k_proj", "v_proj", "o_proj"):
    rows.append(TensorMapping(prefix + ("attn", ours, "kernel"), f"{layer}.self_attn.{ours}.weight",
                              "transpose"))
  for ours, hf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
    rows.append(TensorMapping(prefix + ("mlp", ours, "kernel"), f"{layer}.mlp.{hf}.weight",
                              "transpose"))
  return rows


def hf_name_map(model_cfg: ModelConfig, mtp_depth: int) -> list[TensorMapping]:
  """The full mapping table for a model (``docs/export.md`` prints it).

  Backbone block i -> ``model.layers.{i}``; MTP module k (1-based) ->
  ``model.layers.{num_layers + k - 1}`` with ``hnorm`` (our hidden_norm),
  ``enorm`` (embed_norm), ``eh_proj`` (proj), ``shared_head.norm`` (out_norm),
  its block under the Llama layer names, and alias rows for the shared
  ``embed_tokens`` and ``shared_head.head``.
  """
  rows = [TensorMapping(("embed", "embedding"), "model.embed_tokens.weight", "copy")]
  for i in range(model_cfg.num_layers):
    rows += _block_rows(("blocks", i), f"model.layers.{i}")
  rows.append(TensorMapping(("final_norm", "scale"), "model.norm.weight", "copy"))
  if model_cfg.tie_embeddings:
    head = "model.embed_tokens.weight"
  else:
    rows.append(TensorMapping(("lm_head", "kernel"), "lm_head.weight", "transpose"))
    head = "lm_head.weight"
  for k in range(1, mtp_depth + 1):
    layer = f"model.layers.{model_cfg.num_layers + k - 1}"
    m = ("mtp", k - 1)
    rows += [TensorMapping(m + ("hidden_norm", "scale"), f"{layer}.hnorm.weight", "copy"),
             TensorMapping(m + ("embed_norm", "scale"), f"{layer}.enorm.weight", "copy"),
             TensorMapping(m + ("proj", "kernel"), f"{layer}.eh_proj.weight", "eh_proj"),
             TensorMapping(m + ("out_norm", "scale"), f"{layer}.shared_head.norm.weight", "copy")]
    rows += _block_rows(m + ("block",), layer)
    rows += [TensorMapping(("embed", "embedding"), f"{layer}.embed_tokens.weight", "copy",
                           alias_of="model.embed_tokens.weight"),
             TensorMapping(("embed", "embedding") if model_cfg.tie_embeddings
                           else ("lm_head", "kernel"), f"{layer}.shared_head.head.weight",
                           "copy" if model_cfg.tie_embeddings else "transpose", alias_of=head)]
  return rows


def _to_hf(x: np.ndarray, transform: str) -> np.ndarray:
  if transform == "copy":
    return np.ascontiguousarray(x)
  if transform == "transpose":
    return np.ascontiguousarray(x.T)
  d = x.shape[1]                                   # eh_proj: x is [2D, D]
  return np.ascontiguousarray(np.concatenate([x[d:], x[:d]], axis=0).T)


def _from_hf(w: np.ndarray, transform: str) -> np.ndarray:
  if transform == "copy":
    return np.ascontiguousarray(w)
  if transform == "transpose":
    return np.ascontiguousarray(w.T)
  d = w.shape[0]                                   # eh_proj: w is [D, 2D]
  k = w.T                                          # [2D, D] over [enorm(e); hnorm(h)]
  return np.ascontiguousarray(np.concatenate([k[d:], k[:d]], axis=0))


def check_exportable(cfg: Config) -> None:
  """Raises ExportError naming the first ``model.*`` field that config.json
  cannot express (any field this exporter does not know). Every current
  ModelConfig setting maps onto LlamaConfig (docs/export.md). A reduced
  draft vocabulary (``mtp.draft_vocab_size`` > 0) is refused."""
  if cfg.mtp.draft_vocab_size:
    raise ExportError(f"mtp.draft_vocab_size={cfg.mtp.draft_vocab_size}: the model's MTP heads "
                      "draft from a reduced vocabulary (mtp.model.DraftVocab), which the Hugging "
                      "Face layout (LlamaForCausalLM + DeepSeek-V3 MTP layers) cannot express; "
                      "decode from the workdir instead")
  for f in dataclasses.fields(cfg.model):
    if f.name not in _EXPORTABLE_MODEL_FIELDS:
      raise ExportError(f"model.{f.name}={getattr(cfg.model, f.name)!r} has no LlamaForCausalLM "
                        f"equivalent: mtp.export can only write the fields "
                        f"{sorted(_EXPORTABLE_MODEL_FIELDS)}")


def hf_state_dict(model, cfg: Config) -> dict[str, np.ndarray]:
  """HF tensors of ``model`` (a ``mtp.model.Transformer`` built from ``cfg``):
  ``{hf_name: numpy array}`` in ``model.param_dtype`` (torch layout, C-order).

  Raises:
    ExportError: a setting Llama cannot express, or a parameter the table does
      not cover (names it).
  """
  import jax
  from flax import nnx
  check_exportable(cfg)
  flat = {tuple(p): np.asarray(jax.device_get(v[...]))
          for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  rows = hf_name_map(cfg.model, cfg.mtp.depth)
  unmapped = sorted(set(flat) - {r.path for r in rows})
  if unmapped:
    raise ExportError(f"parameter {'.'.join(map(str, unmapped[0]))} has no Hugging Face name in "
                      "mtp.export's mapping table")
  return {r.hf_name: _to_hf(flat[r.path], r.transform) for r in rows}


def check_tokenizer(cfg: Config, tokenizer=None):
  """The tokenizer whose files an export of ``cfg``'s model holds: the byte
  tokenizer for ``model.tokenizer = "byte"`` (``tokenizer`` None or a
  ``ByteTokenizer``); for ``"bpe"`` ``tokenizer`` itself, which must be the
  workdir's BPE tokenizer (``mtp.tokenizer.load_tokenizer``) with
  ``model.num_tokens`` tokens.

  Raises ExportError naming the field when they do not fit.
  """
  kind = cfg.model.tokenizer
  if kind == "byte":
    if tokenizer is not None and tokenizer.kind != "byte":
      raise ExportError(f"model.tokenizer='byte' but a {tokenizer.kind!r} tokenizer was given")
    return tok.ByteTokenizer()
  if tokenizer is None or tokenizer.kind != kind:
    raise ExportError(f"model.tokenizer={kind!r}: the export needs the workdir's tokenizer "
                      "(mtp.tokenizer.load_tokenizer(workdir)), got "
                      f"{'none' if tokenizer is None else repr(tokenizer.kind)}")
  if tokenizer.vocab_size != cfg.model.num_tokens:
    raise ExportError(f"model.num_tokens={cfg.model.num_tokens} but the tokenizer has "
                      f"{tokenizer.vocab_size} tokens")
  return tokenizer


def _hf_config(cfg: Config, step: int, tokenizer=None) -> dict[str, Any]:
  m = cfg.model
  tokenizer = check_tokenizer(cfg, tokenizer)
  extra = {} if tokenizer.kind == "byte" else {"tokenizer": tokenizer.to_dict()}
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": m.vocab_size,
      "hidden_size": m.d_model,
      "intermediate_size": m.mlp_dim,
      "num_hidden_layers": m.num_layers,
      "num_attention_heads": m.num_heads,
      "num_key_value_heads": m.num_kv_heads,
      "head_dim": m.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": m.max_seq_len,
      "rms_norm_eps": m.norm_eps,
      # transformers >= 5 reads rope_parameters; older readers rope_theta.
      "rope_theta": m.rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
      "attention_bias": False,
      "attention_dropout": 0.0,
      "mlp_bias": False,
      "pretraining_tp": 1,
      "tie_word_embeddings": m.tie_embeddings,
      "initializer_range": 0.02,
      "use_cache": True,
      "bos_token_id": tokenizer.bos_id,
      "eos_token_id": tokenizer.eos_id,
      "pad_token_id": tokenizer.pad_id,
      "dtype": m.param_dtype,
      "torch_dtype": m.param_dtype,
      "num_nextn_predict_layers": cfg.mtp.depth,
      "mtp": {"format_version": FORMAT_VERSION, "step": int(step),
              "eh_proj_input_order": "[enorm(embedding); hnorm(hidden)]",
              "config": cfg.to_dict(), **extra},
  }


def _generation_config(cfg: Config, tokenizer=None) -> dict[str, Any]:
  """BOS/EOS/PAD ids (``eos_token_id``: every stop id, a list for BPE) and
  ``suppress_tokens`` = the ids our head never emits (``tok.head_mask``)."""
  tokenizer = check_tokenizer(cfg, tokenizer)
  never = np.flatnonzero(~tok.head_mask(cfg.model))
  eos = tok.EOS_ID if tokenizer.kind == "byte" else [int(i) for i in tokenizer.stop_ids]
  return {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos, "pad_token_id": tokenizer.pad_id,
          "suppress_tokens": [int(i) for i in never]}


def _bos_post_processor(name: str, bos_id: int) -> dict[str, Any]:
  """A ``tokenizers`` TemplateProcessing that prepends ``name`` (id ``bos_id``)."""
  return {"type": "TemplateProcessing",
          "single": [{"SpecialToken": {"id": name, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}}],
          "pair": [{"SpecialToken": {"id": name, "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}},
                   {"Sequence": {"id": "B", "type_id": 1}}],
          "special_tokens": {name: {"id": name, "ids": [int(bos_id)], "tokens": [name]}}}


def bpe_tokenizer_files(tokenizer) -> dict[str, dict[str, Any]]:
  """The tokenizer files of a ``mtp.bpe.BPETokenizer`` (name -> JSON
  object): its ``tokenizers`` model (a post-processor prepending BOS when
  the tokenizer adds BOS), and ``tokenizer_config.json`` with the special
  tokens' names, ``add_bos_token`` and the chat template, so that
  transformers' ``AutoTokenizer`` gives our ids and our chat ids."""
  model = tokenizer.tokenizers_json()
  name = lambda i: None if i is None else tokenizer.id_to_token(i)
  if tokenizer.add_bos and tokenizer.bos_id is not None:
    model["post_processor"] = _bos_post_processor(name(tokenizer.bos_id), tokenizer.bos_id)
  else:
    model["post_processor"] = None
  names = {k: name(i) for k, i in (("bos_token", tokenizer.bos_id),
                                   ("eos_token", tokenizer.eos_id),
                                   ("pad_token", tokenizer.pad_id)) if i is not None}
  tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **names,
                      "add_bos_token": bool(tokenizer.add_bos), "add_eos_token": False,
                      "clean_up_tokenization_spaces": False, "model_max_length": None}
  if tokenizer.chat_template:
    tokenizer_config["chat_template"] = tokenizer.chat_template
  return {TOKENIZER_FILE: model, TOKENIZER_CONFIG_FILE: tokenizer_config,
          SPECIAL_TOKENS_FILE: names}


def tokenizer_files(tokenizer=None) -> dict[str, dict[str, Any]]:
  """The tokenizer files (name -> JSON object). For the byte tokenizer
  (``tokenizer`` None or a ``ByteTokenizer``): a ``tokenizers`` byte-level
  BPE with no merges whose vocabulary maps byte b to id b, plus ``<pad>``,
  ``<bos>``, ``<eos>`` at ``mtp.tokenizer``'s ids and a post-processor that
  prepends ``<bos>`` (as ``python -m decode`` does). For a BPE tokenizer:
  ``bpe_tokenizer_files``."""
  if tokenizer is not None and tokenizer.kind != "byte":
    return bpe_tokenizer_files(tokenizer)
  byte_chars = bytes_to_unicode()
  vocab = {byte_chars[b]: b for b in range(tok.NUM_BYTES)}
  specials = sorted(tok.SPECIAL_NAMES.items())
  vocab.update({name: i for i, name in specials})
  byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                "use_regex": False}
  bos = tok.SPECIAL_NAMES[tok.BOS_ID]
  tokenizer = {
      "version": "1.0",
      "truncation": None,
      "padding": None,
      "added_tokens": [{"id": i, "content": name, "single_word": False, "lstrip": False,
                        "rstrip": False, "normalized": False, "special": True}
                       for i, name in specials],
      "normalizer": None,
      "pre_tokenizer": byte_level,
      "post_processor": _bos_post_processor(bos, tok.BOS_ID),
      "decoder": byte_level,
      "model": {"type": "BPE", "dropout": None, "unk_token": None,
                "continuing_subword_prefix": None, "end_of_word_suffix": None,
                "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                "vocab": vocab, "merges": []},
  }
  names = {"bos_token": bos, "eos_token": tok.SPECIAL_NAMES[tok.EOS_ID],
           "pad_token": tok.SPECIAL_NAMES[tok.PAD_ID]}
  tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **names,
                      "add_bos_token": True, "add_eos_token": False,
                      "clean_up_tokenization_spaces": False,
                      "model_max_length": None}
  return {TOKENIZER_FILE: tokenizer, TOKENIZER_CONFIG_FILE: tokenizer_config,
          SPECIAL_TOKENS_FILE: names}


def _write_json(path: str, obj: Any) -> None:
  from mtp.files import write_atomic
  write_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def is_exported(path: str) -> bool:
  """Whether ``path`` looks like an export (has config.json and
  model.safetensors)."""
  return (os.path.isfile(os.path.join(path, CONFIG_FILE))
          and os.path.isfile(os.path.join(path, WEIGHTS_FILE)))


EXPORT_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE, GENERATION_CONFIG_FILE, TOKENIZER_FILE,
                          TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_FILE})


def _replace_refusal(path: str) -> str | None:
  """Why ``path`` (an existing folder) may not be replaced by an export, or
  None if it may: it must be empty, or hold only the files ``write_export``
  writes (``EXPORT_FILES``) with a config.json that has an ``mtp`` entry.
  A training or import workdir (checkpoints/, metrics.jsonl, ...) never
  qualifies, so --overwrite cannot delete one."""
  entries = os.listdir(path)
  if not entries:
    return None
  others = sorted(e for e in entries if e not in EXPORT_FILES
                  or not os.path.isfile(os.path.join(path, e))
                  or os.path.islink(os.path.join(path, e)))
  if others:
    shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
    return f"it holds {shown}, which mtp.export does not write"
  try:
    with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
      if "mtp" in json.load(f):
        return None
  except (OSError, ValueError):
    pass
  return f"its {CONFIG_FILE} has no 'mtp' entry"


def check_out(out: str, overwrite: bool, source: str | None = None) -> str:
  """The absolute output path ``out`` after the checks ``write_export``
  makes before writing (raises ExportError as it does). ``source``: the
  workdir or export being exported; ``out`` may be neither it nor a folder
  that contains it."""
  out = os.path.abspath(os.path.expanduser(out))
  if source is not None:
    src = os.path.realpath(os.path.expanduser(source))
    real = os.path.realpath(out)
    if src == real or src.startswith(real.rstrip(os.sep) + os.sep):
      raise ExportError(f"--out={out!r} is, or contains, the --workdir being exported "
                        f"({src!r}); choose another folder")
  if os.path.lexists(out):
    if not os.path.isdir(out) or os.path.islink(out):
      raise ExportError(f"--out={out!r} exists and is not a directory")
    if not overwrite:
      raise ExportError(f"--out={out!r} already exists; pass --overwrite to replace it")
    why = _replace_refusal(out)
    if why is not None:
      raise ExportError(f"--out={out!r} is not an earlier export ({why}); refusing to replace "
                        "it even with --overwrite")
  parent = os.path.dirname(out)
  if not os.path.isdir(parent):
    raise ExportError(f"--out={out!r}: parent directory {parent!r} does not exist")
  return out


def write_export(model, cfg: Config, out: str, *, step: int = 0, overwrite: bool = False,
                 tokenizer=None) -> str:
  """Writes ``model`` (built from ``cfg``) as a Hugging Face directory at
  ``out`` (module docstring). ``tokenizer``: the workdir's tokenizer
  (required for ``model.tokenizer = "bpe"``; ``check_tokenizer``). Everything is written into a temporary sibling
  folder that is renamed to ``out`` at the end, so ``out`` is either absent,
  the previous export, or complete: never half-written.

  Returns the absolute output path.

  Raises:
    ExportError: ``out`` exists (without ``overwrite``), is a file, or is a
      non-empty folder not written by this exporter; its parent is missing;
      or the model has a setting Llama cannot express (names the field), or
      ``tokenizer`` does not fit the model (``check_tokenizer``).
  """
  out = check_out(out, overwrite)
  tokenizer = check_tokenizer(cfg, tokenizer)
  tensors = hf_state_dict(model, cfg)
  from safetensors.numpy import save
  from mtp.files import write_atomic
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=os.path.dirname(out))
  old = None
  try:
    write_atomic(os.path.join(tmp, WEIGHTS_FILE), save(tensors, metadata={"format": "pt"}))
    _write_json(os.path.join(tmp, CONFIG_FILE), _hf_config(cfg, step, tokenizer))
    _write_json(os.path.join(tmp, GENERATION_CONFIG_FILE), _generation_config(cfg, tokenizer))
    for name, obj in tokenizer_files(tokenizer).items():
      _write_json(os.path.join(tmp, name), obj)
    for name in os.listdir(tmp):                # mkdtemp / safetensors create 0700 / 0600
      os.chmod(os.path.join(tmp, name), 0o644)
    os.chmod(tmp, 0o755)
    if os.path.isdir(out):
      old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
      os.rename(out, os.path.join(old, "x"))
    os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    if old is not None and not os.path.exists(out):
      os.rename(os.path.join(old, "x"), out)     # put the previous export back
    raise
  finally:
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
  return out


# ----------------------------------------------------------------------------
# Import
# ----------------------------------------------------------------------------


def _require(hf: Mapping[str, Any], key: str, path: str):
  if key not in hf:
    raise ExportError(f"{path}/{CONFIG_FILE} has no '{key}' field")
  return hf[key]


def config_from_hf(hf: Mapping[str, Any], path: str = "<config>") -> Config:
  """Our Config from an exported ``config.json`` (a dict). Architecture
  fields come from the Llama fields (what transformers loads); the rest
  (activation dtype, training sections) from the ``mtp`` entry when present.

  Raises:
    ExportError: not a Llama config, a Llama feature this model does not have
      (biases, another activation, RoPE scaling), special-token ids other than
      ``mtp.tokenizer``'s (byte-tokenizer models), or invalid values (names the field).
  """
  if _require(hf, "model_type", path) != "llama":
    raise ExportError(f"{path}/{CONFIG_FILE}: model_type={hf['model_type']!r}, expected 'llama'")
  extra = hf.get("mtp") or {}
  byte = ((extra.get("config") or {}).get("model") or {}).get("tokenizer", "byte") == "byte"
  checks = (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False))
  if byte:               # a BPE export's ids are its tokenizer's (the mtp entry's "tokenizer")
    checks += (("bos_token_id", tok.BOS_ID), ("eos_token_id", tok.EOS_ID),
               ("pad_token_id", tok.PAD_ID))
  for key, want in checks:
    if key in hf and hf[key] != want:
      raise ExportError(f"{path}/{CONFIG_FILE}: {key}={hf[key]!r} is not supported by "
                        f"mtp.model (must be {want!r})")
  rope = hf.get("rope_parameters") or {"rope_type": "default", "rope_theta": hf.get("rope_theta")}
  if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
    raise ExportError(f"{path}/{CONFIG_FILE}: rope_parameters={rope!r}: only rope_type "
                      "'default' (no scaling) is supported by mtp.model")
  theta = rope.get("rope_theta", hf.get("rope_theta"))
  base = dict(extra.get("config") or {})
  dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  model = {**(base.get("model") or {}),
           "vocab_size": _require(hf, "vocab_size", path),
           "d_model": _require(hf, "hidden_size", path),
           "num_layers": _require(hf, "num_hidden_layers", path),
           "num_heads": _require(hf, "num_attention_heads", path),
           "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
           "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
           "mlp_dim": _require(hf, "intermediate_size", path),
           "max_seq_len": _require(hf, "max_position_embeddings", path),
           "rope_theta": 10000.0 if theta is None else theta,
           "norm_eps": _require(hf, "rms_norm_eps", path),
           "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
           "param_dtype": dtype}
  model.setdefault("dtype", dtype)
  base["model"] = model
  base["mtp"] = {**(base.get("mtp") or {}), "depth": int(hf.get("num_nextn_predict_layers", 0))}
  try:
    cfg = config_lib.from_dict(base)
  except config_lib.ConfigError as e:
    raise ExportError(f"{path}/{CONFIG_FILE} describes an invalid model: {e}") from e
  return cfg


def load_exported(path: str):
  """Loads a directory written by ``export`` (or ``write_export``) into a
  ``mtp.model.Transformer``; parameters are bitwise equal to the exported ones.

  Returns:
    (config, model, step): ``step`` is the training step recorded at export
    (0 if absent).

  Raises:
    ExportError: missing or unreadable files, an unsupported Llama feature,
      a missing, unexpected, wrongly shaped/typed or non-finite tensor, or a
      DeepSeek-V3 copy of a shared tensor that differs from the original
      (names it).
  """
  import jax
  from flax import nnx
  from safetensors.numpy import load_file
  from mtp.model import build_model
  path = os.path.abspath(os.path.expanduser(path))
  if not is_exported(path):
    raise ExportError(f"{path!r} is not an exported model directory (needs {CONFIG_FILE} and "
                      f"{WEIGHTS_FILE})")
  try:
    with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
      hf = json.load(f)
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
  except (OSError, ValueError) as e:
    raise ExportError(f"cannot read the export in {path!r}: {e}") from e
  cfg = config_from_hf(hf, path)
  rows = hf_name_map(cfg.model, cfg.mtp.depth)
  missing = [r.hf_name for r in rows if r.hf_name not in tensors]
  if missing:
    raise ExportError(f"{path}/{WEIGHTS_FILE} has no tensor '{missing[0]}' "
                      f"({len(missing)} missing)")
  unexpected = sorted(set(tensors) - {r.hf_name for r in rows})
  if unexpected:
    raise ExportError(f"{path}/{WEIGHTS_FILE} has tensor '{unexpected[0]}', which this model "
                      f"(num_hidden_layers={cfg.model.num_layers}, num_nextn_predict_layers="
                      f"{cfg.mtp.depth}) does not have")
  for name in sorted(tensors):
    x = tensors[name]
    bad = int(np.sum(~np.isfinite(x.astype(np.float32))))   # exact for f16/bf16/f32
    if bad:
      raise ExportError(f"{path}/{WEIGHTS_FILE}: tensor '{name}' {tuple(x.shape)} holds {bad} "
                        "non-finite value(s) (NaN or inf)")
  for r in rows:
    if r.alias_of is not None and not np.array_equal(tensors[r.hf_name], tensors[r.alias_of]):
      raise ExportError(f"{path}/{WEIGHTS_FILE}: '{r.hf_name}' differs from '{r.alias_of}'; "
                        "mtp.model shares the embedding and output head with every MTP module")
  abstract = nnx.eval_shape(lambda: build_model(cfg))
  graphdef, state = nnx.split(abstract, nnx.Param)
  flat = dict((tuple(p), v) for p, v in nnx.to_flat_state(state))
  by_path = {r.path: r for r in rows if r.alias_of is None}
  if set(by_path) != set(flat):
    raise ExportError(f"mtp.export's mapping table does not cover parameter "
                      f"{sorted(set(flat) ^ set(by_path))[0]}")
  leaves = {}
  for p, var in flat.items():
    r = by_path[p]
    value = _from_hf(tensors[r.hf_name], r.transform)
    want = var.get_value()                       # ShapeDtypeStruct
    if value.shape != want.shape or value.dtype != want.dtype:
      raise ExportError(f"{path}/{WEIGHTS_FILE}: tensor '{r.hf_name}' has shape "
                        f"{tuple(tensors[r.hf_name].shape)} dtype {value.dtype}; expected "
                        f"{tuple(_to_hf(np.zeros(want.shape, want.dtype), r.transform).shape)} "
                        f"dtype {want.dtype}")
    leaves[p] = var.replace(jax.numpy.asarray(value))
  params = nnx.from_flat_state(leaves)
  return cfg, nnx.merge(graphdef, params), int((hf.get("mtp") or {}).get("step", 0))
