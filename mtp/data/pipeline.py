"""The grain pipeline: packed training and evaluation batches, and an
iterator state that survives a JSON round trip (checkpoints).

Pipeline (grain): documents are tokenized as ``[BOS] + UTF-8 bytes + [EOS]``
(``mtp.tokenizer.ByteTokenizer``) and packed by concat-then-split
(``grain.experimental.ConcatThenSplitIterDataset``) into rows of ``seq_len``
tokens. Long documents continue into the next row(s) instead of being
truncated. Per row, ``segment_ids`` number the document pieces 1, 2, ... (0 =
padding) and ``positions`` count from 0 within each piece, restarting at 0 in
every row, also for a piece that continues a document from the previous row
(which then does not start with BOS). Padding (tokens ``PAD_ID``, segment 0,
position 0) only occurs at the end of a finite stream (eval); training rows are
always full. Batches are ``dict(tokens, segment_ids, positions)`` of numpy
int32 ``[B, seq_len]``.
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

@dataclasses.dataclass(frozen=True)
class _Tokenize:
  """Record -> ``{"tokens": int32[n + 2]}`` = [BOS] + UTF-8 bytes + [EOS].
  Picklable (runs in grain worker processes)."""

  text_feature: str

  def __call__(self, record: Mapping[str, Any]) -> dict[str, np.ndarray]:
    text = _as_text(record[self.text_feature])
    return {"tokens": _TOKENIZER.encode(text, add_bos=True, add_eos=True)}


def _finalize(packed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """ConcatThenSplit output -> our batch dict (padding tokens set to PAD)."""
  seg = np.asarray(packed["tokens_segment_ids"], np.int32)
  tokens = np.where(seg == 0, tok.PAD_ID, packed["tokens"]).astype(np.int32)
  return {"tokens": tokens, "segment_ids": seg,
          "positions": np.asarray(packed["tokens_positions"], np.int32)}


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


def _packed_rows(cfg: DataConfig, docs: grain.MapDataset, seq_len: int,
                 read_options: grain.ReadOptions) -> grain.IterDataset:
  ds = docs.map(_Tokenize(cfg.text_feature)).to_iter_dataset(read_options)
  return grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={"tokens": seq_len})


def make_train_dataset(cfg: DataConfig, *, seq_len: int, batch_size: int, seed: int,
                       process_index: int = 0, process_count: int = 1) -> grain.IterDataset:
  """Infinite, shuffled, packed training batches for this process.

  Documents of ``cfg.train_split`` are sharded by process (document
  ``i`` goes to process ``i % process_count``, so processes read disjoint
  data), globally shuffled with ``seed`` (a new order every epoch: grain folds
  the epoch into the shuffle seed), tokenized, packed (module docstring) and
  batched. With ``cfg.num_workers > 0`` the work runs in that many grain worker
  processes (``mp_prefetch``), which changes the row order but stays
  deterministic for a given ``num_workers``.

  Args:
    cfg: data config.
    seq_len: tokens per row (T).
    batch_size: global batch size (rows over all processes).
    seed: shuffle seed (int >= 0; taken mod 2**32).
    process_index, process_count: this JAX process and the number of them.

  Returns:
    ``grain.IterDataset``; ``iter(ds)`` yields ``dict(tokens, segment_ids,
    positions)``, numpy int32 ``[B, T]`` with ``B = batch_size //
    process_count``. The iterator is checkpointable: ``it.get_state()`` is a
    JSON-serializable dict and ``it.set_state(state)`` resumes the exact
    stream.

  Raises:
    DataError: as ``load_source``; batch_size not divisible by process_count;
      fewer documents than processes; bad sizes.
  """
  per_process = _check_sharding(batch_size, seq_len, process_index, process_count)
  src = load_source(cfg, cfg.train_split)
  if len(src) < process_count:
    raise DataError(f"split '{cfg.train_split}' of '{cfg.name}' has {len(src)} documents, fewer "
                    f"than process_count={process_count}")
  docs = grain.MapDataset.source(src)[process_index::process_count]
  docs = docs.shuffle(seed=int(seed) % 2**32).repeat()
  # One document feeds many rows and records are local: reading in the calling
  # thread was fastest (2 CPU cores; threads only add GIL contention).
  ds = _packed_rows(cfg, docs, seq_len, grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  ds = ds.batch(per_process, drop_remainder=True).map(_finalize)
  if cfg.num_workers > 0:
    from absl import flags
    if not flags.FLAGS.is_parsed():
      # grain workers read absl flags; outside an absl app use their defaults.
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers))
  return JsonStateIterDataset(ds)


def make_eval_batches(cfg: DataConfig, *, seq_len: int, batch_size: int, num_batches: int,
                      process_index: int = 0, process_count: int = 1) -> list[dict]:
  """The first ``num_batches`` packed batches of ``cfg.eval_split``, no shuffle.

  Every process packs the same global stream (documents in stored order) and
  takes rows ``[process_index * B, (process_index + 1) * B)`` of each global
  batch. So all processes get the same number of batches (collectives stay in
  step), their rows are disjoint, and the global eval set does not depend on
  ``process_count``. If the split runs out, fewer batches come back and the
  last one is padded with PAD rows (segment 0, position 0).

  Args:
    cfg: data config.
    seq_len: tokens per row (T).
    batch_size: global batch size; num_batches: at most this many batches.
    process_index, process_count: this JAX process and the number of them.

  Returns:
    list of ``dict(tokens, segment_ids, positions)``, numpy int32 ``[B, T]``,
    ``B = batch_size // process_count``.

  Raises:
    DataError: as ``load_source``; batch_size not divisible by process_count.
  """
  per_process = _check_sharding(batch_size, seq_len, process_index, process_count)
  if num_batches < 0:
    raise DataError(f"num_batches must be >= 0, got {num_batches}")
  src = load_source(cfg, cfg.eval_split)
  ds = _packed_rows(cfg, grain.MapDataset.source(src), seq_len,
                    grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  rows = [_finalize(r) for r in itertools.islice(iter(ds), num_batches * batch_size)]
  if not rows:
    return []
  stacked = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  n_pad = -len(rows) % batch_size
  if n_pad:
    stacked["tokens"] = np.concatenate(
        [stacked["tokens"], np.full((n_pad, seq_len), tok.PAD_ID, np.int32)])
    for k in ("segment_ids", "positions"):
      stacked[k] = np.concatenate([stacked[k], np.zeros((n_pad, seq_len), np.int32)])
  out = []
  for start in range(0, len(stacked["tokens"]), batch_size):
    lo = start + process_index * per_process
    out.append({k: np.ascontiguousarray(v[lo:lo + per_process]) for k, v in stacked.items()})
  return out
