"""The grain pipeline: packed training and evaluation batches, one epoch as
packed rows (``epoch_rows``), and an iterator state that survives JSON.

Text documents are tokenized (byte tokenizer: ``[BOS] + UTF-8 + [EOS]``)
and packed concat-then-split into rows of ``seq_len``: long documents
continue into the next row; ``segment_ids`` number the pieces 1, 2, ... (0 =
padding), ``positions`` restart at 0 per piece and row. Padding (pad id,
segment 0) occurs only at the end of a finite stream. ``data.packing =
"first_fit"`` (token datasets) packs whole examples first-fit, padding the
rows; an example longer than a row keeps its last ``seq_len`` tokens.
Batches: ``tokens``, ``segment_ids``, ``positions`` int32 [B, seq_len], and
for token datasets ``loss_mask`` (token j may be a target iff
``loss_mask[b, j] == 1``; absent means all ones).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

import grain
import numpy as np

from mtp import tokenizer as tok
from mtp.config import DataConfig
from mtp.data.corpora import DataError
from mtp.data.sources import _as_text, load_source

_TOKENIZER = tok.ByteTokenizer()


def pad_id_of(tokenizer) -> int:
  """The padding id of ``tokenizer`` (None = the byte tokenizer: ``PAD_ID``):
  its ``pad_id``, else 0 (padding positions have segment 0 and are masked)."""
  pad = getattr(tokenizer or _TOKENIZER, "pad_id", None)
  return 0 if pad is None else int(pad)


@dataclasses.dataclass(frozen=True)
class _Tokenize:
  """Record -> ``{"tokens": int32[n]}`` (text: ``tokenizer.encode(text,
  add_bos=True, add_eos=True)``, by default [BOS] + UTF-8 bytes + [EOS]) or,
  for a token dataset, ``{"tokens", "loss_mask"}`` int32 [n] as stored.
  Picklable (runs in grain worker processes)."""

  text_feature: str
  tokenizer: Any = None               # None: the byte tokenizer
  token_dataset: bool = False

  def __call__(self, record: Mapping[str, Any]) -> dict[str, np.ndarray]:
    tk = self.tokenizer or _TOKENIZER
    if not self.token_dataset:
      text = _as_text(record[self.text_feature])
      return {"tokens": np.asarray(tk.encode(text, add_bos=True, add_eos=True), np.int32)}
    tokens = np.asarray(record["tokens"], np.int32).reshape(-1)
    mask = (np.asarray(record["loss_mask"], np.int32).reshape(-1) if "loss_mask" in record
            else np.ones_like(tokens))
    if mask.shape != tokens.shape:
      raise DataError(f"token example {_name(record)}: loss_mask has {mask.size} entries, "
                      f"tokens {tokens.size}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= tk.vocab_size):
      raise DataError(f"token example {_name(record)}: id {int(tokens.max())} is outside the "
                      f"{getattr(tk, 'kind', '?')} tokenizer's vocabulary [0, {tk.vocab_size}); "
                      "pass the model's tokenizer (tokenizer=mtp.tokenizer.load_tokenizer(workdir))")
    return {"tokens": tokens, "loss_mask": mask}


def _name(record: Mapping[str, Any]) -> str:
  n = record.get("name", b"?")
  return repr(bytes(n).decode("utf-8", "replace") if isinstance(n, (bytes, np.bytes_)) else n)


@dataclasses.dataclass(frozen=True)
class _Finalize:
  """ConcatThenSplit output -> our batch dict (padding tokens set to
  ``pad_id``; ``loss_mask`` 0 on padding, present iff packed)."""

  pad_id: int = tok.PAD_ID

  def __call__(self, packed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    seg = np.asarray(packed["tokens_segment_ids"], np.int32)
    tokens = np.where(seg == 0, self.pad_id, packed["tokens"]).astype(np.int32)
    out = {"tokens": tokens, "segment_ids": seg,
           "positions": np.asarray(packed["tokens_positions"], np.int32)}
    if "loss_mask" in packed:
      out["loss_mask"] = np.where(seg == 0, 0, packed["loss_mask"]).astype(np.int32)
    return out


_finalize = _Finalize()     # the byte tokenizer's (kept for callers of the old name)


def _json_safe(x: Any) -> Any:
  """State with tuples -> lists and numpy scalars -> Python scalars."""
  if isinstance(x, Mapping):
    return {k: _json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_json_safe(v) for v in x]
  if isinstance(x, np.generic):
    return x.item()
  return x


def _restore_slices(x: Any) -> Any:
  """Inverse of the one lossy step of ``_json_safe``: ConcatThenSplit compares
  its ``remainder_slices`` entries to the tuple ``(-1, -1)``, so JSON lists
  must become tuples again (a list there silently drops a document)."""
  if isinstance(x, Mapping):
    out = {}
    for k, v in x.items():
      if k == "remainder_slices" and isinstance(v, Mapping):
        out[k] = {f: tuple(s) for f, s in v.items()}
      else:
        out[k] = _restore_slices(v)
    return out
  if isinstance(x, list):
    return [_restore_slices(v) for v in x]
  return x


class _JsonStateIterator(grain.DatasetIterator):
  """Passes elements through; ``get_state`` is a JSON-native dict and
  ``set_state`` accepts it back (also after a JSON round trip)."""

  def __next__(self):
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return _json_safe(self._parent.get_state())

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(_restore_slices(state))

  def __str__(self) -> str:
    return "JsonStateIterator"


class JsonStateIterDataset(grain.IterDataset):
  """Wraps a pipeline so its iterator state survives ``json.dumps``/``loads``
  (as done by grain's orbax ``CheckpointHandler``)."""

  def __iter__(self) -> grain.DatasetIterator:
    return _JsonStateIterator(self._parent.__iter__())

  def __str__(self) -> str:
    return "JsonStateIterDataset"


def _check_sharding(batch_size: int, seq_len: int, process_index: int, process_count: int) -> int:
  if seq_len < 1:
    raise DataError(f"seq_len must be >= 1, got {seq_len}")
  if batch_size < 1:
    raise DataError(f"batch_size must be >= 1, got {batch_size}")
  if process_count < 1 or not 0 <= process_index < process_count:
    raise DataError(f"need 0 <= process_index < process_count, got process_index="
                    f"{process_index}, process_count={process_count}")
  if batch_size % process_count:
    raise DataError(f"global batch_size={batch_size} is not divisible by "
                    f"process_count={process_count}")
  return batch_size // process_count


def _is_token_source(src) -> bool:
  """Whether a data source holds token examples (a ``tokens`` feature)."""
  info = getattr(src, "dataset_info", None)
  features = getattr(info, "features", None)
  if features is not None and hasattr(features, "keys"):
    return "tokens" in features.keys()
  return len(src) > 0 and "tokens" in src[0]


# Bins of first-fit packing: rows are 0.85 / 0.88 / 0.91 filled at 8 / 16 / 32 on
# SmolLM2's chat answers (mean example 236 tokens, rows of 512).
FIRST_FIT_BINS = 16


@dataclasses.dataclass(frozen=True)
class _KeepTail:
  """A token example longer than ``seq_len`` -> its last ``seq_len`` tokens
  (the answer end of a chat example keeps the most context)."""

  seq_len: int

  def __call__(self, ex: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v[-self.seq_len:] for k, v in ex.items()}


def _packed_rows(cfg: DataConfig, docs: grain.MapDataset, seq_len: int,
                 read_options: grain.ReadOptions, tokenizer=None,
                 token_dataset: bool = False, *, seed: int = 0,
                 shuffle_bins: bool = False) -> grain.IterDataset:
  """Tokenized documents packed into rows of ``seq_len`` by ``cfg.packing``
  (module docstring). Raises DataError for first_fit on a text dataset."""
  ds = docs.map(_Tokenize(cfg.text_feature, tokenizer, token_dataset))
  lengths = {"tokens": seq_len, **({"loss_mask": seq_len} if token_dataset else {})}
  if cfg.packing == "first_fit":
    if not token_dataset:
      raise DataError(f"data.packing='first_fit' packs whole token examples; '{cfg.name}' is a "
                      "text dataset, whose documents span many rows: use data.packing='concat'")
    ds = ds.map(_KeepTail(seq_len)).to_iter_dataset(read_options)
    return grain.experimental.FirstFitPackIterDataset(
        ds, length_struct=lengths, num_packing_bins=FIRST_FIT_BINS, seed=int(seed) % 2**32,
        shuffle_bins=shuffle_bins)
  ds = ds.to_iter_dataset(read_options)
  return grain.experimental.ConcatThenSplitIterDataset(ds, length_struct=lengths)


def make_train_dataset(cfg: DataConfig, *, seq_len: int, batch_size: int, seed: int,
                       process_index: int = 0, process_count: int = 1,
                       tokenizer=None) -> grain.IterDataset:
  """Infinite, shuffled, packed training batches for this process.

  Documents of ``cfg.train_split`` go to process ``i % process_count``, are
  shuffled with ``seed`` (mod 2**32; a new order every epoch), tokenized by
  ``tokenizer`` (None: bytes; token datasets as is), packed (module
  docstring) and batched; ``cfg.num_workers > 0`` uses grain worker processes
  (another, still deterministic, row order). seq_len: T; batch_size: global
  rows. Yields ``dict(tokens, segment_ids, positions[, loss_mask])`` numpy
  int32 [B, T], B = batch_size // process_count; the iterator's
  ``get_state()`` is JSON and ``set_state`` resumes the exact stream.

  Raises DataError: as ``load_source``; batch_size not divisible by
  process_count; fewer documents than processes; bad sizes."""
  per_process = _check_sharding(batch_size, seq_len, process_index, process_count)
  src = load_source(cfg, cfg.train_split)
  if len(src) < process_count:
    raise DataError(f"split '{cfg.train_split}' of '{cfg.name}' has {len(src)} documents, fewer "
                    f"than process_count={process_count}")
  docs = grain.MapDataset.source(src)[process_index::process_count]
  docs = docs.shuffle(seed=int(seed) % 2**32).repeat()
  # One document feeds many rows and records are local: reading in the calling
  # thread was fastest (2 CPU cores; threads only add GIL contention).
  ds = _packed_rows(cfg, docs, seq_len, grain.ReadOptions(num_threads=0, prefetch_buffer_size=0),
                    tokenizer, _is_token_source(src), seed=seed, shuffle_bins=True)
  ds = ds.batch(per_process, drop_remainder=True).map(_Finalize(pad_id_of(tokenizer)))
  if cfg.num_workers > 0:
    from absl import flags
    if not flags.FLAGS.is_parsed():
      # grain workers read absl flags; outside an absl app use their defaults.
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers))
  return JsonStateIterDataset(ds)


def _epoch_stack(cfg: DataConfig, split: str, seq_len: int, tokenizer, limit: int | None
                 ) -> tuple[dict[str, np.ndarray] | None, bool]:
  """Packed rows of ``split`` in stored order (at most ``limit``), stacked
  ([N, T] int32 per key; None when there is no row), and whether the source
  holds tokens."""
  src = load_source(cfg, split)
  token_dataset = _is_token_source(src)
  ds = _packed_rows(cfg, grain.MapDataset.source(src), seq_len,
                    grain.ReadOptions(num_threads=0, prefetch_buffer_size=0), tokenizer,
                    token_dataset)
  fin = _Finalize(pad_id_of(tokenizer))
  it = iter(ds) if limit is None else itertools.islice(iter(ds), limit)
  rows = [fin(r) for r in it]
  if not rows:
    return None, token_dataset
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}, token_dataset


def _pad_rows(stacked: dict[str, np.ndarray], n_pad: int, seq_len: int, pad_id: int) -> None:
  if n_pad:
    stacked["tokens"] = np.concatenate(
        [stacked["tokens"], np.full((n_pad, seq_len), pad_id, np.int32)])
    for k in stacked:
      if k != "tokens":
        stacked[k] = np.concatenate([stacked[k], np.zeros((n_pad, seq_len), np.int32)])


def make_eval_batches(cfg: DataConfig, *, seq_len: int, batch_size: int, num_batches: int,
                      process_index: int = 0, process_count: int = 1,
                      tokenizer=None) -> list[dict]:
  """The first ``num_batches`` packed batches of ``cfg.eval_split``, no shuffle.

  Every process packs the same global stream (stored order) and takes rows
  [process_index * B, (process_index + 1) * B) of each global batch: equal
  batch counts, disjoint rows, an eval set independent of process_count. A
  short split gives fewer batches, the last padded (segment 0, position 0,
  loss_mask 0). Returns a list of ``make_train_dataset``'s batches, int32
  [B, T], B = batch_size // process_count. Raises DataError: as
  ``load_source``; batch_size not divisible by process_count."""
  per_process = _check_sharding(batch_size, seq_len, process_index, process_count)
  if num_batches < 0:
    raise DataError(f"num_batches must be >= 0, got {num_batches}")
  stacked, _ = _epoch_stack(cfg, cfg.eval_split, seq_len, tokenizer, num_batches * batch_size)
  if stacked is None:
    return []
  _pad_rows(stacked, -len(stacked["tokens"]) % batch_size, seq_len, pad_id_of(tokenizer))
  out = []
  for start in range(0, len(stacked["tokens"]), batch_size):
    lo = start + process_index * per_process
    out.append({k: np.ascontiguousarray(v[lo:lo + per_process]) for k, v in stacked.items()})
  return out


def epoch_rows(cfg: DataConfig, *, seq_len: int, tokenizer=None, split: str | None = None
               ) -> dict[str, np.ndarray]:
  """One pass over ``split`` (default ``cfg.train_split``) packed as training
  packs it (module docstring), in stored order (no shuffle, sharding or
  repeat); the last row (with first_fit, any row) is padded (pad id, segment
  0, position 0, loss_mask 0). tokenizer as ``make_train_dataset``.

  Returns ``dict(tokens, segment_ids, positions, loss_mask)`` int32 [N, T] (N
  = 0 for an empty split); ``loss_mask`` is 1 on real tokens of a text
  dataset, the stored mask of a token dataset. Raises DataError: as
  ``load_source``; seq_len < 1."""
  if not (isinstance(seq_len, int) and seq_len >= 1):
    raise DataError(f"seq_len must be an integer >= 1, got {seq_len!r}")
  stacked, token_dataset = _epoch_stack(cfg, split or cfg.train_split, seq_len, tokenizer, None)
  if stacked is None:
    empty = np.zeros((0, seq_len), np.int32)
    return {k: empty.copy() for k in ("tokens", "segment_ids", "positions", "loss_mask")}
  if not token_dataset:
    stacked["loss_mask"] = (stacked["segment_ids"] > 0).astype(np.int32)
  return {k: np.ascontiguousarray(stacked[k], np.int32)
          for k in ("tokens", "segment_ids", "positions", "loss_mask")}
