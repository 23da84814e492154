"""Cached backbone hidden states for the frozen-backbone stage
(``train.freeze_backbone`` + ``train.hidden_cache``): h^0 of every train row
is computed once and the MTP modules train from it
(``Transformer.forward_from_hidden``), as Medusa-1 and FastMTP do.

Cache folder ``WORKDIR/hidden_cache/`` or ``train.hidden_cache_dir``/<digest>
(shared by runs that agree on backbone, rows, tokenizer, seq_len, dtype),
built beside it and renamed (a killed build resumes, never is read):
``h0.npy`` [N, T, D] ([N, T, (m + 1) D] with m feature layers) in
``model.dtype`` (bfloat16 as uint16 bits), read as a memmap; ``rows.npz``
(tokens, segment_ids, positions, loss_mask: int32 [N, T]); ``meta.json``
(``source`` and ``rows`` fingerprints, shape, dtype, build cost). A cache is
reused iff its ``source`` matches. ``CacheIterator`` state is checkpointed;
resuming on other rows raises ``HiddenCacheError``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mtp import checkpoint as ckpt_lib
from mtp.files import write_atomic

CACHE_DIR = "hidden_cache"
META_FILE = "meta.json"
H0_FILE = "h0.npy"
ROWS_FILE = "rows.npz"
ROW_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")
FORMAT = 1


class HiddenCacheError(ckpt_lib.CheckpointError):
  """An unreadable cache, rows that do not fit the run, or a resumed run
  whose checkpointed position refers to other rows; one line naming the path."""


def cache_dir(workdir: str) -> str:
  """A run's own cache folder, ``WORKDIR/hidden_cache`` (absolute)."""
  return os.path.join(os.path.abspath(workdir), CACHE_DIR)


def cache_folder(workdir: str, shared_dir: str, source: Mapping[str, Any],
                 rows: Mapping[str, np.ndarray] | None = None) -> str:
  """The folder a run's cache lives in: ``cache_dir(workdir)`` when
  ``shared_dir`` (``train.hidden_cache_dir``) is empty, else
  ``shared_dir/<16 hex digits of sha256(source, rows_fingerprint(rows))>``
  (absolute), so runs with one ``source_fingerprint`` and the same rows (a
  dataset regenerated under its old name has other rows) share a cache and
  runs with others never replace it. ``rows`` (``check_rows`` output) is
  required with ``shared_dir``."""
  if not shared_dir:
    return cache_dir(workdir)
  if rows is None:
    raise ValueError("cache_folder: a shared cache folder is keyed by the rows; pass rows")
  key = _digest({"source": dict(source), "rows": rows_fingerprint(rows)})
  return os.path.join(os.path.abspath(shared_dir), key)


def _digest(obj: Any) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def source_fingerprint(cfg, tokenizer, frozen_params) -> dict[str, Any]:
  """What decides the cached states before the rows are read: a digest of
  the frozen parameters' CRC-32s (``mtp.checkpoint.array_checksums``; equal
  for every checkpoint of one frozen stage and for its ``train.init_from``
  step), the data fields choosing the rows (name, files, text feature, train
  split), ``train.seq_len``, a digest of the tokenizer, the activation dtype
  and ``mtp.feature_layers``. Not ``train.init_from`` itself nor the modules:
  stages that attach other modules (D = 1..3, another initialisation) to one
  frozen target cache the same states and share a ``train.hidden_cache_dir``
  folder. JSON-native dict."""
  d = cfg.data
  tk = tokenizer.to_dict()
  inner = getattr(tokenizer, "_tok", None)
  if inner is not None and hasattr(inner, "to_str"):
    tk = {**tk, "model": hashlib.sha256(inner.to_str().encode()).hexdigest()}
  return {"backbone": _digest(ckpt_lib.array_checksums(frozen_params)),
          "data": {"name": d.name, "files": d.files, "text_feature": d.text_feature,
                   "train_split": d.train_split},
          "seq_len": cfg.train.seq_len, "tokenizer": _digest(tk), "dtype": cfg.model.dtype,
          **({"feature_layers": cfg.mtp.feature_layers} if cfg.mtp.feature_layers else {})}


def check_rows(rows: Mapping[str, np.ndarray], seq_len: int, vocab_size: int) -> dict[str, np.ndarray]:
  """``rows`` (``epoch_rows``: tokens, segment_ids, positions and optional
  loss_mask, int [N, seq_len]) as contiguous int32 arrays, loss_mask all
  ones when absent. Raises HiddenCacheError for a missing key, another
  shape, no rows, or token ids outside [0, vocab_size)."""
  if "tokens" not in rows:
    raise HiddenCacheError("epoch_rows returned no 'tokens'")
  n = np.shape(rows["tokens"])[0]
  out = {}
  for k in ROW_KEYS:
    if k not in rows:
      if k != "loss_mask":
        raise HiddenCacheError(f"epoch_rows returned no {k!r} (needs {', '.join(ROW_KEYS[:3])})")
      out[k] = np.ones((n, seq_len), np.int32)
      continue
    v = np.ascontiguousarray(rows[k], np.int32)
    if v.shape != (n, seq_len):
      raise HiddenCacheError(f"epoch_rows: {k} has shape {v.shape}, expected ({n}, {seq_len})")
    out[k] = v
  if n == 0:
    raise HiddenCacheError("epoch_rows returned no rows (empty train split)")
  if out["tokens"].min() < 0 or out["tokens"].max() >= vocab_size:
    raise HiddenCacheError(f"epoch_rows: token ids outside [0, model.vocab_size={vocab_size})")
  return out


def rows_fingerprint(rows: Mapping[str, np.ndarray]) -> dict[str, int]:
  """{"num_rows": N, "crc32": CRC-32 over the row arrays (``ROW_KEYS`` order, C order)}."""
  crc = 0
  for k in ROW_KEYS:
    crc = zlib.crc32(np.ascontiguousarray(rows[k], np.int32).tobytes(), crc)
  return {"num_rows": int(rows["tokens"].shape[0]), "crc32": int(crc)}


@dataclasses.dataclass
class Cache:
  """A loaded cache: ``rows`` (int32 [N, T] arrays, ``ROW_KEYS``), ``h0``
  [N, T, D] (a read-only memmap in the activation dtype) and ``meta``."""
  rows: dict[str, np.ndarray]
  h0: np.ndarray
  meta: dict[str, Any]

  @property
  def fingerprint(self) -> dict[str, Any]:
    return {"source": self.meta["source"], "rows": self.meta["rows"]}

  @property
  def num_rows(self) -> int:
    return int(self.rows["tokens"].shape[0])


def _storage(dtype: str) -> tuple[np.dtype, str]:
  """(numpy dtype on disk, name): bfloat16 as its uint16 bits (numpy's .npy
  has no bfloat16)."""
  if dtype == "bfloat16":
    return np.dtype(np.uint16), "bfloat16-as-uint16"
  return np.dtype(dtype), dtype


PROGRESS_FILE = "done.npy"       # bool [N]: rows of a build in progress whose h^0 is written
REUSE_KEYS = ("backbone", "seq_len", "tokenizer", "dtype", "feature_layers")


def row_digests(rows: Mapping[str, np.ndarray]) -> list[bytes]:
  """Per row, a digest of what decides its h^0 (tokens, segment_ids,
  positions): equal digests under one backbone give equal h^0."""
  keys = ("tokens", "segment_ids", "positions")
  arrs = [np.ascontiguousarray(rows[k], np.int32) for k in keys]
  return [hashlib.sha1(b"".join(a[i].tobytes() for a in arrs)).digest()
          for i in range(arrs[0].shape[0])]


def _reusable(parent: str, source: Mapping[str, Any], skip: str):
  """Finished caches beside ``skip`` in ``parent`` whose h^0 came from the
  same backbone, seq_len, tokenizer, dtype and features (any data)."""
  want = {k: source.get(k) for k in REUSE_KEYS}
  for name in sorted(os.listdir(parent)) if os.path.isdir(parent) else ():
    path = os.path.join(parent, name)
    if path == skip or name.startswith("."):
      continue
    try:
      cache = load(path)
    except HiddenCacheError:
      continue
    if cache is not None and {k: cache.meta["source"].get(k) for k in REUSE_KEYS} == want:
      yield path, cache


def build(folder: str, rows: Mapping[str, np.ndarray], hidden_fn: Callable[[dict], np.ndarray],
          *, batch_size: int, d_model: int, dtype: str, source: Mapping[str, Any],
          log: Callable[[str], None] = print, save_every: int = 16) -> Cache:
  """Runs ``hidden_fn`` (a jitted backbone: batch dict of int32 [B, T] ->
  h^0 [B, T, D] in ``dtype``) over the rows in batches of ``batch_size``
  (the last one padded with copies of its first row, one compiled shape)
  and writes the cache into ``folder`` (module docstring), replacing an
  existing one. Resumable: the build folder ``.hidden_cache.build-<digest
  of source and rows>`` beside ``folder`` keeps its written rows
  (``done.npy``, saved every ``save_every`` batches), so a killed build
  continues where it stopped; rows equal to rows of a finished cache beside
  ``folder`` with the same backbone (``REUSE_KEYS``) are copied, not
  recomputed. Logs progress, time (seconds) and size; returns the cache.

  rows: ``check_rows`` output. Raises HiddenCacheError for an h^0 of another
  shape."""
  n, t = rows["tokens"].shape
  disk, disk_name = _storage(dtype)
  out = os.path.abspath(folder)
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.join(parent, f".{CACHE_DIR}.build-"
                     f"{_digest({'source': dict(source), 'rows': rows_fingerprint(rows)})}")
  h0_path, done_path = os.path.join(tmp, H0_FILE), os.path.join(tmp, PROGRESS_FILE)
  start = time.perf_counter()
  done = None
  if os.path.isfile(done_path):
    try:
      done = np.load(done_path)
      h0 = np.lib.format.open_memmap(h0_path, mode="r+")
      if done.shape != (n,) or h0.shape != (n, t, d_model) or h0.dtype != disk:
        done = None
    except (OSError, ValueError):
      done = None
  if done is None:
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    h0 = np.lib.format.open_memmap(h0_path, mode="w+", dtype=disk, shape=(n, t, d_model))
    done = np.zeros(n, bool)
  else:
    log(f"hidden cache: resuming the build in {tmp} ({int(done.sum())}/{n} rows written)")

  def save_progress():
    h0.flush()
    buf = io.BytesIO()
    np.save(buf, done)
    write_atomic(done_path, buf.getvalue())

  if not done.all():
    digests = row_digests(rows)
    where: dict[bytes, list[int]] = {}
    for i in np.flatnonzero(~done):
      where.setdefault(digests[i], []).append(int(i))
    for path, other in _reusable(parent, source, out):
      hits = [(j, where.pop(d)) for j, d in enumerate(row_digests(other.rows)) if d in where]
      for j, targets in hits:
        raw = np.asarray(other.h0[j]).view(disk) if dtype == "bfloat16" else other.h0[j]
        h0[targets] = raw
        done[targets] = True
      if hits:
        log(f"hidden cache: {sum(len(x) for _, x in hits)} rows copied from {path}")
    save_progress()
  todo = np.flatnonzero(~done)
  rate_t0, batches = time.perf_counter(), 0
  try:
    for lo in range(0, len(todo), batch_size):
      chunk = todo[lo:lo + batch_size]
      idx = np.concatenate([chunk, np.full(batch_size - len(chunk), chunk[0])])
      h = np.asarray(hidden_fn({k: rows[k][idx] for k in ("tokens", "positions", "segment_ids")}))
      if h.shape != (batch_size, t, d_model):
        raise HiddenCacheError(f"{out}: the backbone returned h0 of shape {h.shape}, expected "
                               f"{(batch_size, t, d_model)}")
      h = h[:len(chunk)]
      h0[chunk] = h.view(np.uint16) if dtype == "bfloat16" else h.astype(disk)
      done[chunk] = True
      batches += 1
      if batches % save_every == 0:
        save_progress()
        rate = batches * batch_size * t / (time.perf_counter() - rate_t0)
        log(f"hidden cache: {int(done.sum())}/{n} rows ({rate:.0f} tokens/s)")
    save_progress()
    del h0
    np.savez(os.path.join(tmp, ROWS_FILE), **{k: rows[k] for k in ROW_KEYS})
    seconds = time.perf_counter() - start
    size = sum(os.path.getsize(os.path.join(tmp, f)) for f in (H0_FILE, ROWS_FILE))
    meta = {"format": FORMAT, "source": dict(source), "rows": rows_fingerprint(rows),
            "shape": [n, t, d_model], "dtype": dtype, "storage": disk_name,
            "build_s": round(seconds, 3), "bytes": int(size)}
    with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as f:
      json.dump(meta, f, indent=2, sort_keys=True)
      f.write("\n")
      f.flush()
      os.fsync(f.fileno())
    os.remove(done_path)
    if os.path.lexists(out):
      shutil.rmtree(out)
    os.rename(tmp, out)
  except HiddenCacheError:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  except BaseException:
    try:
      save_progress()       # kept: the next build with these rows continues from here
    except Exception:
      pass
    raise
  log(f"hidden cache: built {out} in {seconds:.1f} s: {n} rows x {t} tokens, h0 {dtype} "
      f"[{n}, {t}, {d_model}], {size / 2**20:.1f} MiB ({size / max(n * t, 1):.0f} bytes/token)")
  return load(out)


def load(folder: str) -> Cache | None:
  """The cache in ``folder`` (``cache_dir`` / ``cache_folder``); None when
  there is none. Raises HiddenCacheError for an unreadable or inconsistent
  one."""
  meta_path = os.path.join(folder, META_FILE)
  if not os.path.isfile(meta_path):
    return None
  try:
    with open(meta_path, encoding="utf-8") as f:
      meta = json.load(f)
    disk, _ = _storage(meta["dtype"])
    h0 = np.load(os.path.join(folder, H0_FILE), mmap_mode="r")
    with np.load(os.path.join(folder, ROWS_FILE)) as z:
      rows = {k: np.asarray(z[k], np.int32) for k in ROW_KEYS}
  except (OSError, ValueError, KeyError) as e:
    raise HiddenCacheError(f"{folder}: unreadable hidden cache ({type(e).__name__}: {e}); delete "
                           "the folder to rebuild it") from e
  if meta.get("format") != FORMAT or list(h0.shape) != meta["shape"] or h0.dtype != disk:
    raise HiddenCacheError(f"{folder}: h0.npy {h0.shape} {h0.dtype} does not match meta.json "
                           f"{meta.get('shape')} {meta.get('storage')}; delete the folder to rebuild it")
  if rows_fingerprint(rows) != meta["rows"]:
    raise HiddenCacheError(f"{folder}: rows.npz does not match its checksum in meta.json; delete "
                           "the folder to rebuild it")
  if meta["dtype"] == "bfloat16":
    import ml_dtypes
    h0 = h0.view(ml_dtypes.bfloat16)
  return Cache(rows, h0, meta)


def prepare(folder: str, source: Mapping[str, Any], rows_fn: Callable[[], Mapping[str, np.ndarray]],
            hidden_fn: Callable[[dict], np.ndarray], *, batch_size: int, d_model: int, dtype: str,
            vocab_size: int, log: Callable[[str], None] = print) -> Cache:
  """The run's cache in ``folder`` (``cache_folder``): the existing one
  when its ``source`` fingerprint equals ``source``, else one built there
  from ``rows_fn()`` (``epoch_rows``) with ``build`` (the reason logged). Raises HiddenCacheError (and whatever
  ``rows_fn`` raises: DataError)."""
  cache = load(folder)
  if cache is not None and cache.meta["source"] == dict(source):
    log(f"hidden cache: reusing {folder} ({cache.num_rows} rows, "
        f"{cache.meta['bytes'] / 2**20:.1f} MiB, built in {cache.meta['build_s']:.1f} s)")
    return cache
  if cache is not None:
    changed = sorted(k for k in set(source) | set(cache.meta["source"])
                     if source.get(k) != cache.meta["source"].get(k))
    log(f"hidden cache: {folder} was built for another {', '.join(changed)}; rebuilding")
  rows = check_rows(rows_fn(), source["seq_len"], vocab_size)
  return build(folder, rows, hidden_fn, batch_size=batch_size, d_model=d_model, dtype=dtype,
               source=source, log=log)


class CacheIterator:
  """Training batches from a ``Cache``, forever: epoch e visits the rows in
  ``np.random.default_rng([seed, e]).permutation(N)`` order, N // batch_size
  batches per epoch (the remainder skipped). ``next(it)``: this process's
  rows of the global batch as ``dict(tokens, segment_ids, positions,
  loss_mask)`` int32 [b, T] and ``h0`` [b, T, D], b = batch_size //
  process_count. ``get_state``/``set_state`` (JSON bytes {"epoch",
  "position", "fingerprint"}) go into the checkpoint; ``set_state`` may come
  before ``attach``, which then refuses another fingerprint. Raises
  HiddenCacheError: fewer rows than batch_size, a fingerprint mismatch,
  ``next`` before ``attach``."""

  def __init__(self, batch_size: int, seed: int, process_index: int = 0, process_count: int = 1):
    self.batch_size, self.seed = int(batch_size), int(seed)
    self.process_index, self.process_count = process_index, process_count
    self.epoch, self.position = 0, 0
    self._cache: Cache | None = None
    self._order: np.ndarray | None = None
    self._pending_fingerprint = None

  def attach(self, cache: Cache) -> "CacheIterator":
    if cache.num_rows < self.batch_size:
      raise HiddenCacheError(f"the hidden cache holds {cache.num_rows} rows, fewer than "
                             f"train.batch_size={self.batch_size}: more data or a smaller batch")
    if self._pending_fingerprint is not None and self._pending_fingerprint != cache.fingerprint:
      raise HiddenCacheError(
          "the checkpoint's data position refers to a hidden cache with another fingerprint "
          f"(checkpoint {self._pending_fingerprint} != cache {cache.fingerprint}): the resumed "
          "run would not see the same batches; resume with the original backbone, data and "
          "train.seq_len, or start a new workdir")
    self._cache, self._order = cache, None
    return self

  def _epoch_order(self) -> np.ndarray:
    if self._order is None:
      self._order = np.random.default_rng([self.seed, self.epoch]).permutation(self._cache.num_rows)
    return self._order

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._cache is None:
      raise HiddenCacheError("CacheIterator: next() before attach(cache)")
    b = self.batch_size
    if (self.position + 1) * b > self._cache.num_rows:
      self.epoch, self.position, self._order = self.epoch + 1, 0, None
    rows = self._epoch_order()[self.position * b:(self.position + 1) * b]
    per = b // self.process_count
    rows = rows[self.process_index * per:(self.process_index + 1) * per]
    self.position += 1
    batch = {k: self._cache.rows[k][rows] for k in ROW_KEYS}
    ascending = np.argsort(rows)             # read the memmap in file order, then reorder
    h0 = np.empty((len(rows),) + self._cache.h0.shape[1:], self._cache.h0.dtype)
    h0[ascending] = self._cache.h0[rows[ascending]]
    batch["h0"] = h0
    return batch

  def get_state(self) -> bytes:
    fp = self._cache.fingerprint if self._cache is not None else self._pending_fingerprint
    return json.dumps({"epoch": self.epoch, "position": self.position, "fingerprint": fp},
                      sort_keys=True).encode()

  def set_state(self, state: bytes) -> None:
    s = json.loads(state.decode() if isinstance(state, bytes) else state)
    self.epoch, self.position, self._order = int(s["epoch"]), int(s["position"]), None
    self._pending_fingerprint = s.get("fingerprint")
    if self._cache is not None:
      self.attach(self._cache)

  def start_prefetch(self) -> None:
    """Called by grain's checkpoint handler after a restore; nothing to prefetch."""
