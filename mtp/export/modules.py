"""The MTP modules file: a workdir's trained MTP modules (and draft
vocabulary) as one safetensors file, attached again to a freshly imported
target (``python -m mtp.importers ... --mtp_modules FILE``). Written by
``python -m mtp.export --modules_out FILE`` via ``write_modules_file``; this
module is the format only (imports no checkpoint, loading or importers).

Tensors (nnx paths; kernels [in, out]; float in the file's ``dtype``):
``mtp.<k-1>.{hidden_norm,embed_norm,out_norm}.scale`` [D],
``mtp.<k-1>.proj.kernel`` [2D, D], ``mtp.<k-1>.block.*``, and ``draft_vocab``
[V'] int32 when there is one; not the shared embedding, head or backbone.
Metadata ``mtp_modules`` (JSON): format_version 1, dtype, step, config,
provenance, eval_row, target (``backbone_fingerprint``) and tensors (dtype,
shape, CRC-32, checked on read). Errors: ``ModulesFileError``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp import config as config_lib
from mtp.config import Config
from mtp.export import ExportError

FORMAT = "mtp-modules"
FORMAT_VERSION = 1
METADATA_KEY = "mtp_modules"
DTYPES = ("bfloat16", "float32")
DRAFT_VOCAB = "draft_vocab"
FINGERPRINT_ALGORITHM = ("sha256 over the backbone parameters (every parameter outside mtp/ and "
                         "draft_vocab, sorted by dotted name): name, shape, bytes rounded to "
                         "bfloat16")
# model.* fields a target must share with the modules' source (param_dtype
# excepted: the modules are cast to the target's).
MATCHED_FIELDS = tuple(f for f in config_lib.ARCHITECTURE_FIELDS
                       if f.startswith("model.") and f != "model.param_dtype")
_REQUIRED = ("format_version", "dtype", "step", "config", "target", "tensors")


class ModulesFileError(ExportError):
  """An MTP modules file that cannot be written, read or attached; the
  message is one line naming the file and the field or tensor."""


@dataclasses.dataclass(frozen=True)
class ModulesFile:
  """A read modules file (``read_modules_file``). ``tensors``: {name: numpy
  array} as stored (float params in ``dtype``, ``draft_vocab`` int32);
  ``cfg``: the source's config; ``eval_row``: dict or None; ``fingerprint``:
  the source backbone's ``backbone_fingerprint``; ``meta``: the whole
  ``mtp_modules`` metadata object."""
  path: str
  cfg: Config
  step: int
  dtype: str
  tensors: dict
  provenance: dict
  eval_row: dict | None
  fingerprint: str
  meta: dict

  @property
  def draft_vocab(self) -> np.ndarray | None:
    return self.tensors.get(DRAFT_VOCAB)


def _name(path) -> str:
  return ".".join(map(str, path))


def _is_module(path) -> bool:
  return path[0] == "mtp" or tuple(path) == (DRAFT_VOCAB,)


def _flat(model) -> dict:
  """{path tuple: numpy array} of a model's parameters (host copies)."""
  return {tuple(p): np.asarray(jax.device_get(v.get_value()))
          for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def backbone_fingerprint(params: Mapping[tuple, Any]) -> str:
  """Hex SHA-256 identifying a target: ``FINGERPRINT_ALGORITHM`` over
  ``params`` ({flat path tuple: array}, a whole model's; the MTP modules
  and ``draft_vocab`` are skipped). Rounding to bfloat16 first makes it
  independent of the target's param dtype (an import in float32 or bfloat16
  of the same file gives the same value). About 1 s for a 135M target."""
  h = hashlib.sha256()
  for name, path in sorted((_name(p), p) for p in params if not _is_module(p)):
    a = np.ascontiguousarray(np.asarray(jax.device_get(params[path])).astype(jnp.bfloat16))
    h.update(f"{name}:{list(a.shape)};".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def model_fingerprint(model) -> str:
  """``backbone_fingerprint`` of a ``mtp.model.Transformer``."""
  return backbone_fingerprint(_flat(model))


def module_tensors(model, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
  """{name: array} of ``model``'s MTP modules (float params cast to ``dtype``)
  and its ``draft_vocab`` [V'] int32 when it has one. Raises
  ModulesFileError when the model has no MTP modules or ``dtype`` is not
  one of ``DTYPES``."""
  if dtype not in DTYPES:
    raise ModulesFileError(f"--modules_dtype={dtype!r}: must be one of {DTYPES}")
  out = {}
  for path, a in _flat(model).items():
    if path[0] == "mtp":
      out[_name(path)] = np.ascontiguousarray(a.astype(jnp.dtype(dtype)))
    elif path == (DRAFT_VOCAB,):
      out[DRAFT_VOCAB] = np.ascontiguousarray(a.astype(np.int32))
  if not any(n.startswith("mtp.") for n in out):
    raise ModulesFileError("the model has no MTP modules (mtp.depth=0): nothing to write")
  return out


def check_modules_out(out: str, overwrite: bool) -> str:
  """The absolute path ``out`` if a modules file may be written there: its
  folder exists, and ``out`` is absent, or (with ``overwrite``) a modules
  file already. Raises ModulesFileError naming ``--modules_out``."""
  out = os.path.abspath(os.path.expanduser(out))
  if not os.path.isdir(os.path.dirname(out)):
    raise ModulesFileError(f"--modules_out={out!r}: folder {os.path.dirname(out)!r} does not exist")
  if os.path.lexists(out):
    if not os.path.isfile(out) or os.path.islink(out):
      raise ModulesFileError(f"--modules_out={out!r} exists and is not a file")
    if not overwrite:
      raise ModulesFileError(f"--modules_out={out!r} already exists; pass --overwrite to replace it")
    try:
      read_modules_file(out)
    except ModulesFileError:
      raise ModulesFileError(f"--modules_out={out!r} is not an MTP modules file; refusing to "
                             "replace it even with --overwrite") from None
  return out


def write_raw(out: str, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> str:
  """Writes ``tensors`` with metadata ``meta`` (the ``mtp_modules`` object;
  its ``tensors`` entry is computed here: dtype, shape, CRC-32) to ``out``,
  atomically (``mtp.cli.write_atomic``). For ``write_modules_file``, and for
  tests that need odd files. Returns ``out``. Raises OSError (a full disk:
  ENOSPC, naming ``out``)."""
  from safetensors.flax import save
  from mtp.files import write_atomic
  meta = dict(meta)
  meta["tensors"] = {n: {"dtype": np.asarray(a).dtype.name, "shape": list(np.shape(a)),
                         "crc32": zlib.crc32(np.ascontiguousarray(a).tobytes()) & 0xFFFFFFFF}
                     for n, a in sorted(tensors.items())}
  header = {"format": FORMAT, METADATA_KEY: json.dumps(meta, sort_keys=True)}
  return write_atomic(out, save({n: jnp.asarray(a) for n, a in tensors.items()}, metadata=header))


def write_modules_file(model, cfg: Config, out: str, *, step: int, dtype: str = "bfloat16",
                       eval_row: Mapping[str, Any] | None = None,
                       provenance: Mapping[str, Any] | None = None,
                       target: Mapping[str, Any] | None = None, overwrite: bool = False) -> str:
  """Writes the MTP modules of ``model`` (a ``Transformer`` built from
  ``cfg``, checkpoint ``step``) to ``out`` (module docstring): float params
  cast to ``dtype``, ``draft_vocab`` when ``mtp.draft_vocab_size`` > 0, the
  metadata with ``eval_row``, ``provenance`` and ``target`` (extra facts of
  the target; its ``fingerprint`` is computed here from ``model``).
  Returns the absolute path.

  Raises ModulesFileError: no MTP modules, a bad ``dtype``, or ``out`` not
  writable (``check_modules_out``). Nothing is left behind on failure.
  """
  out = check_modules_out(out, overwrite)
  tensors = module_tensors(model, dtype)
  meta = {"format_version": FORMAT_VERSION, "dtype": dtype, "step": int(step),
          "config": cfg.to_dict(), "provenance": dict(provenance or {}),
          "eval_row": None if eval_row is None else dict(eval_row),
          "target": {**dict(target or {}), "fingerprint": model_fingerprint(model),
                     "fingerprint_algorithm": FINGERPRINT_ALGORITHM}}
  return write_raw(out, tensors, meta)


def _load(path: str) -> tuple[dict | None, dict[str, np.ndarray]]:
  """(safetensors metadata or None, {name: numpy array}); raises
  ModulesFileError for a file safetensors cannot read."""
  from safetensors import safe_open
  try:
    with safe_open(path, framework="flax") as f:     # jax arrays: bfloat16 supported
      header = f.metadata()
      tensors = {k: np.asarray(f.get_tensor(k)) for k in f.keys()}
  except Exception as e:      # SafetensorError, OSError, ValueError for damage
    msg = str(e).strip().splitlines()
    raise ModulesFileError(f"{path}: not a readable safetensors file ({type(e).__name__}"
                           f"{': ' + msg[0][:200] if msg else ''})") from e
  return header, tensors


def _metadata(path: str, header: dict | None) -> dict:
  """The checked ``mtp_modules`` object of a file's safetensors metadata."""
  if not header or METADATA_KEY not in header:
    raise ModulesFileError(f"{path}: no '{METADATA_KEY}' metadata: not an MTP modules file "
                           "(python -m mtp.export --modules_out writes them)")
  try:
    meta = json.loads(header[METADATA_KEY])
  except ValueError as e:
    raise ModulesFileError(f"{path}: metadata '{METADATA_KEY}' is not JSON ({e})") from e
  if not isinstance(meta, dict):
    raise ModulesFileError(f"{path}: metadata '{METADATA_KEY}' is not a JSON object")
  if header.get("format") != FORMAT:
    raise ModulesFileError(f"{path}: metadata format={header.get('format')!r}, expected {FORMAT!r}")
  if meta.get("format_version") != FORMAT_VERSION:       # first: another version may differ
    raise ModulesFileError(f"{path}: metadata format_version={meta.get('format_version')!r} is "
                           f"not supported (this reader: {FORMAT_VERSION})")
  missing = [k for k in _REQUIRED if k not in meta]
  if missing:
    raise ModulesFileError(f"{path}: metadata '{METADATA_KEY}' has no '{missing[0]}' field")
  if meta["dtype"] not in DTYPES:
    raise ModulesFileError(f"{path}: metadata dtype={meta['dtype']!r}: must be one of {DTYPES}")
  fp = (meta["target"] or {}).get("fingerprint") if isinstance(meta["target"], dict) else None
  if not isinstance(fp, str) or not fp:
    raise ModulesFileError(f"{path}: metadata target has no 'fingerprint'")
  return meta


def _check_tensors(path: str, meta: dict, tensors: dict) -> None:
  """Tensors against the metadata's record (names, dtype, shape, CRC-32)
  and finite."""
  record = meta["tensors"] if isinstance(meta["tensors"], dict) else {}
  for name in sorted(set(record) | set(tensors)):
    if name not in tensors:
      raise ModulesFileError(f"{path}: no tensor '{name}' (listed in the metadata)")
    if name not in record:
      raise ModulesFileError(f"{path}: tensor '{name}' is not listed in the metadata")
    a, want = tensors[name], record[name]
    if a.dtype.name != want.get("dtype") or list(a.shape) != list(want.get("shape", ())):
      raise ModulesFileError(f"{path}: tensor '{name}' is {a.dtype.name} {list(a.shape)}, the "
                             f"metadata says {want.get('dtype')} {want.get('shape')}")
    if zlib.crc32(np.ascontiguousarray(a).tobytes()) & 0xFFFFFFFF != want.get("crc32"):
      raise ModulesFileError(f"{path}: tensor '{name}' does not match the CRC-32 recorded in its "
                             "metadata (the file was altered or damaged after it was written)")
    if name != DRAFT_VOCAB and a.dtype.name != meta["dtype"]:
      raise ModulesFileError(f"{path}: tensor '{name}' is {a.dtype.name}, not the file's dtype "
                             f"{meta['dtype']}")
    bad = 0 if name == DRAFT_VOCAB else int(np.sum(~np.isfinite(a.astype(np.float32))))
    if bad:
      raise ModulesFileError(f"{path}: tensor '{name}' {tuple(a.shape)} holds {bad} non-finite "
                             "value(s)")


def read_modules_file(path: str) -> ModulesFile:
  """Reads and checks an MTP modules file (module docstring).

  Raises ModulesFileError naming ``path`` and the field or tensor: no such
  file; not a (complete) safetensors file; no or unreadable ``mtp_modules``
  metadata, another ``format_version``, a missing field, an invalid
  ``config`` or one without MTP modules; a tensor not as recorded (dtype,
  shape, CRC-32: a damaged byte), missing, unlisted or non-finite.
  """
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isfile(path):
    raise ModulesFileError(f"{path}: no such file")
  header, tensors = _load(path)
  meta = _metadata(path, header)
  try:
    cfg = config_lib.from_dict(meta["config"])
  except (config_lib.ConfigError, TypeError, AttributeError) as e:
    raise ModulesFileError(f"{path}: metadata config is invalid: {e}") from e
  if cfg.mtp.depth < 1:
    raise ModulesFileError(f"{path}: metadata config has mtp.depth={cfg.mtp.depth}: no modules")
  _check_tensors(path, meta, tensors)
  try:
    step = int(meta["step"])
  except (TypeError, ValueError):
    raise ModulesFileError(f"{path}: metadata step={meta['step']!r} is not an int") from None
  row = meta.get("eval_row")
  return ModulesFile(path=path, cfg=cfg, step=step, dtype=meta["dtype"], tensors=tensors,
                     provenance=dict(meta.get("provenance") or {}),
                     eval_row=dict(row) if isinstance(row, dict) else None,
                     fingerprint=meta["target"]["fingerprint"], meta=meta)
