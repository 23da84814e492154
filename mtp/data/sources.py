"""Where datasets live and how their records are read: the data dir
(``resolve_data_dir``), a split as a random-access source (``load_source``:
builds an embedded corpus or a ``text_files`` set on first use; any other
TFDS dataset must be prepared already) and its documents as text.

A mixture ``data.name="a+b+c"`` reads the datasets of one data dir one
after another as one source (``ConcatSource``): e.g. self-distilled chat
sets generated with different seeds (``scripts.self_distill --seed``), so more
data is added without regenerating what exists.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.core import read_only_builder

from mtp.config import DataConfig
from mtp.data.corpora import (
    _EMBEDDED_BUILDERS, DATA_DIR_ENV, DEFAULT_DATA_DIR, EMBEDDED_DATASETS, TEXT_FILES, DataError,
    prepare_embedded, prepare_text_files)

# Record formats tfds can read by index without TensorFlow.
_RANDOM_ACCESS_FORMATS = ("array_record", "parquet")

def resolve_data_dir(cfg: DataConfig) -> str:
  """The TFDS data dir: ``cfg.data_dir`` if non-empty, else ``$MTP_DATA_DIR``
  if set, else ``~/.cache/mtp/tensorflow_datasets``; user-expanded, absolute.
  Embedded corpora live below it in per-interpreter config folders."""
  path = cfg.data_dir or os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR
  return os.path.abspath(os.path.expanduser(path))


def _prepared_datasets(data_dir: str) -> list[str]:
  """Names of the folders in ``data_dir`` that look like TFDS datasets."""
  try:
    return sorted(d for d in os.listdir(data_dir) if not d.startswith((".", "downloads"))
                  and os.path.isdir(os.path.join(data_dir, d)))
  except OSError:
    return []


def _is_known_tfds_name(name: str) -> bool:
  """Whether the TFDS catalogue (local registry only, no network) knows ``name``."""
  base = name.split("/")[0].split(":")[0]
  try:
    tfds.builder_cls(base)
    return True
  except Exception:  # noqa: BLE001 - unknown, or its module fails to import
    return False


MIXTURE_SEP = "+"


def mixture_names(name: str) -> tuple[str, ...]:
  """The datasets of ``data.name``: ``"a+b"`` -> ``("a", "b")``; a single
  name -> ``(name,)``. Raises DataError for an empty part or a repeated one."""
  parts = tuple(p.strip() for p in name.split(MIXTURE_SEP))
  if not all(parts):
    raise DataError(f"data.name={name!r}: a mixture is non-empty dataset names joined by "
                    f"'{MIXTURE_SEP}', e.g. 'smollm_chat+smollm_chat_s1'")
  if len(set(parts)) != len(parts):
    raise DataError(f"data.name={name!r} names a dataset twice (a mixture reads each once)")
  if len(parts) > 1 and TEXT_FILES in parts:
    raise DataError(f"data.name={name!r}: '{TEXT_FILES}' cannot be part of a mixture")
  return parts


class ConcatSource:
  """Random-access sources read one after another: record ``i`` of the
  mixture is record ``i - offset_k`` of part ``k`` (negative i from the
  end; an integer index only). ``parts`` names the datasets read, in order
  (the mixture's parts that have the split); ``dataset_info`` is the first
  of them's (``load_source`` checks that all parts hold the same kind of
  records: token ids or text)."""

  def __init__(self, sources, names: tuple[str, ...]):
    self._sources = list(sources)
    self.parts = tuple(names)
    self._ends = np.cumsum([len(s) for s in self._sources]).tolist()

  @property
  def dataset_info(self):
    return getattr(self._sources[0], "dataset_info", None)

  def __len__(self) -> int:
    return self._ends[-1] if self._ends else 0

  def __getitem__(self, i):
    n = len(self)
    i = operator.index(i)
    if not -n <= i < n:
      raise IndexError(f"record {i} of a mixture of {n}")
    i %= n
    k = int(np.searchsorted(self._ends, i, side="right"))
    return self._sources[k][i - (self._ends[k - 1] if k else 0)]

  def __repr__(self) -> str:
    return f"ConcatSource({MIXTURE_SEP.join(self.parts)}, {len(self)} records)"


def _open_builder(cfg: DataConfig, data_dir: str) -> tfds.core.DatasetBuilder:
  name = cfg.name
  if name in _EMBEDDED_BUILDERS:
    return prepare_embedded(name, data_dir)
  if name == TEXT_FILES:
    return prepare_text_files(cfg.files, data_dir)
  try:
    # Reads only what is on disk (dataset_info.json, features.json); never
    # runs the dataset's generation code (which may need TensorFlow) and never
    # downloads. Same reader as tfds.data_source(..., download=False).
    builder = read_only_builder.builder_from_files(name, data_dir=data_dir)
  except Exception as e:  # noqa: BLE001 - DatasetNotFoundError, bad name syntax, ...
    on_disk = _prepared_datasets(data_dir)
    if _is_known_tfds_name(name):
      what = (f"TFDS dataset '{name}' is not prepared in data_dir '{data_dir}' (nothing is "
              f"downloaded automatically). Prepare it where there is network, e.g. `tfds build "
              f"{name} --data_dir={data_dir} --file_format=array_record`")
    else:
      what = (f"unknown dataset '{name}': not an embedded corpus {EMBEDDED_DATASETS}, not in "
              f"the TFDS catalogue and not prepared in data_dir '{data_dir}'")
    raise DataError(f"{what}. Datasets found in data_dir: {on_disk or 'none'}. "
                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
  fmt = builder.info.file_format
  fmt_name = getattr(fmt, "value", str(fmt))
  if fmt_name not in _RANDOM_ACCESS_FORMATS:
    raise DataError(f"dataset '{name}' in data_dir '{data_dir}' is stored as '{fmt_name}', which "
                    f"cannot be read by index without TensorFlow; re-prepare it with "
                    f"--file_format=array_record (or convert it with `tfds convert_format`)")
  return builder


def is_token_dataset(builder: tfds.core.DatasetBuilder) -> bool:
  """Whether a dataset holds token ids (a ``tokens`` feature, as written by
  ``write_token_dataset``) rather than text."""
  features = builder.info.features
  return hasattr(features, "keys") and "tokens" in features.keys()


def _check_text_feature(builder: tfds.core.DatasetBuilder, cfg: DataConfig, data_dir: str):
  features = builder.info.features
  keys = sorted(features.keys()) if hasattr(features, "keys") else []
  if "tokens" in keys:
    feature = features["tokens"]
    if tuple(getattr(feature, "shape", ())) != (None,) or np.dtype(
        getattr(feature, "np_dtype", np.float32)).kind not in "iu":
      raise DataError(f"feature 'tokens' of dataset '{cfg.name}' in data_dir '{data_dir}' must "
                      f"be a 1-D integer tensor (token ids), got {feature!r}")
    return                      # a token dataset: read as is, no text feature needed
  if cfg.text_feature not in keys:
    raise DataError(f"dataset '{cfg.name}' in data_dir '{data_dir}' has no feature "
                    f"'{cfg.text_feature}' (data.text_feature); its features are {keys}")
  feature = features[cfg.text_feature]
  np_dtype = getattr(feature, "np_dtype", None)
  is_text = isinstance(feature, tfds.features.Text) or (
      tuple(getattr(feature, "shape", (None,))) == ()
      and np_dtype is not None and np.dtype(np_dtype).kind in "OSU")
  if not is_text:
    raise DataError(f"feature '{cfg.text_feature}' of dataset '{cfg.name}' in data_dir "
                    f"'{data_dir}' is not a scalar text feature ({feature!r}); pick one of {keys}")


def load_source(cfg: DataConfig, split: str):
  """Random-access source of the documents of ``split`` (an embedded corpus is
  built on first use): ``tfds.data_source`` semantics, ``download=False``;
  ``src[i][cfg.text_feature]`` is the document's bytes, or for a token
  dataset ``src[i]["tokens"]`` and ``["loss_mask"]`` int32 [n]; TFDS's
  deterministic order; usable as a ``grain.MapDataset.source``. A mixture
  ``"a+b"`` is a ``ConcatSource`` over the parts that have ``split``.

  Raises DataError naming the dataset, data dir and what is missing: unknown
  name, not prepared or not random-access, unknown split, missing or
  non-text feature; a malformed mixture, mixed kinds or no part with split."""
  parts = mixture_names(cfg.name)
  if len(parts) > 1:
    return _load_mixture(cfg, split, parts)
  data_dir = resolve_data_dir(cfg)
  builder = _open_builder(cfg, data_dir)
  _check_text_feature(builder, cfg, data_dir)
  try:
    builder.info.splits[split]
    return builder.as_data_source(split=split)
  except (ValueError, KeyError, NotImplementedError, OSError) as e:
    raise DataError(f"dataset '{cfg.name}' in data_dir '{data_dir}' has no usable split "
                    f"'{split}' (splits: {sorted(builder.info.splits.keys())}): {e}") from e


def _load_mixture(cfg: DataConfig, split: str, parts: tuple[str, ...]) -> ConcatSource:
  data_dir = resolve_data_dir(cfg)
  sources, names, kinds = [], [], {}
  for name in parts:
    part = dataclasses.replace(cfg, name=name)
    try:
      builder = _open_builder(part, data_dir)
      _check_text_feature(builder, part, data_dir)
    except DataError as e:
      raise DataError(f"data.name={cfg.name!r}, part {name!r}: {e}") from e
    kinds[name] = "token ids" if is_token_dataset(builder) else "text"
    if split in builder.info.splits:
      sources.append(builder.as_data_source(split=split))
      names.append(name)
  if len(set(kinds.values())) > 1:
    raise DataError(f"data.name={cfg.name!r} mixes token-id and text datasets ({kinds}); a "
                    "mixture's parts must hold the same kind of records")
  if not sources:
    raise DataError(f"no dataset of the mixture data.name={cfg.name!r} in data_dir "
                    f"'{data_dir}' has a split '{split}'")
  return ConcatSource(sources, tuple(names))


def _as_text(value: Any) -> str:
  """A text feature value (bytes, str or 0-d array of either) as ``str``;
  invalid UTF-8 becomes U+FFFD."""
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value.item()
  if isinstance(value, (bytes, np.bytes_)):
    return bytes(value).decode("utf-8", errors="replace")
  if isinstance(value, str):
    return str(value)
  raise DataError(f"text feature value must be bytes or str, got {type(value).__name__}")


def load_documents(cfg: DataConfig, split: str, limit: int | None = None) -> list[str]:
  """The first ``limit`` (all if None) documents of ``split`` as ``str``, in
  the source's stored order (UTF-8 decoded with ``errors="replace"``).

  Raises:
    DataError: as ``load_source``.
  """
  src = load_source(cfg, split)
  n = len(src) if limit is None else min(int(limit), len(src))
  return [_as_text(src[i][cfg.text_feature]) for i in range(n)]



def as_bytes(value: Any) -> bytes:
  """A TFDS text feature value (bytes, str or 0-d array) as bytes (str as UTF-8)."""
  if isinstance(value, np.ndarray):
    value = value.item()
  return value.encode("utf-8") if isinstance(value, str) else bytes(value)


def named_documents(cfg: DataConfig, split: str) -> list[tuple[str, str]]:
  """Every document of ``split`` as ``(key, text)`` in the source's stored
  order: the key is the document's ``name`` feature where it has one, else
  its index (7 digits); text decoded from UTF-8 with ``errors="replace"``.
  TFDS orders records by key, so a dataset written from these pairs
  (``write_dataset``) is read back in the same order.

  Raises:
    DataError: as ``load_source``.
  """
  src = load_source(cfg, split)
  return [(as_bytes(src[i]["name"]).decode("utf-8", "replace") if "name" in src[i]
           else f"{i:07d}", as_bytes(src[i][cfg.text_feature]).decode("utf-8", "replace"))
          for i in range(len(src))]
