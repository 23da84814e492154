"""The KV cache's rules: slots per generation (``cache_length``), per-row
reads and writes, rollback by length (``commit_prefix``) and a tree path's
move (``move_path_kv``). Slot s holds position s; a row with n committed
tokens has a valid target cache at 0..n-2; queries at p attend to slots
0..p only (``mtp.model``), so entries past the length are never read and
rolling back copies nothing (docs/design.md sections 5-6)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mtp.model import write_cache

PROMPT_BUCKET = 64      # lengths past it are padded to a multiple of it, shorter ones to a
MIN_BUCKET = 8          #   power of two >= MIN_BUCKET: few compiled shapes, little padding


def headroom(g: int, module_depth: int = 0, tree_scratch: int = 0) -> int:
  """Cache slots past prompt + budget a round may write: 2g + 4 (the verify
  block and chain windows of g + k positions), plus ``module_depth`` (D of an
  MTP drafter) and ``tree_scratch`` (``TreeMTPDrafter.scratch_slots``)."""
  return 2 * g + 4 + module_depth + tree_scratch


def bucket(n: int) -> int:
  """n >= 0 rounded up to a compiled length: the least power of two >= n in
  [MIN_BUCKET, PROMPT_BUCKET] (8, 16, 32, 64), past that a multiple of
  PROMPT_BUCKET (128, 192, ...)."""
  if n <= PROMPT_BUCKET:
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())
  return PROMPT_BUCKET * math.ceil(n / PROMPT_BUCKET)


def cache_length(prompt_len: int, max_new_tokens: int, headroom: int) -> tuple[int, int]:
  """(prompt bucket P, cache slots S): the longest prompt rounded up by
  ``bucket`` (what prefill computes), and P + max_new_tokens + ``headroom``
  rounded up by ``bucket`` to at least PROMPT_BUCKET (one decoding program
  for every short generation of a batch shape)."""
  p = bucket(prompt_len)
  return p, max(PROMPT_BUCKET, bucket(p + max_new_tokens + headroom))


def gather_rows(buf: jax.Array, idx: jax.Array) -> jax.Array:
  """buf [B, S, ...] at per-row indices idx [B, W] -> [B, W, ...] (clipped to S-1)."""
  idx = jnp.clip(idx, 0, buf.shape[1] - 1)
  idx = idx.reshape(idx.shape + (1,) * (buf.ndim - 2))
  return jnp.take_along_axis(buf, idx, axis=1)


def commit_prefix(tokens, block, n, e):
  """(tokens [B, S] with the round's ``block`` [B, w+1] int32 written at
  n..n+w, n + e [B] int32), 0 <= e <= w+1. Entries past n + e (tokens and
  caches) are rolled back by the length alone, overwritten later."""
  return write_cache(tokens, block, n), n + e


def module_lengths(n, modules: int):
  """[B, modules] int32: c_k = max(n - k, 0), k = 1..modules, MTP module k's
  committed cache length at committed length n [B] int32."""
  ks = jnp.arange(1, modules + 1, dtype=jnp.int32)[None, :]
  return jnp.maximum(n[:, None] - ks, 0)


def move_path_kv(cache, path, n):
  """Copies the target K/V of the path's nodes (slot n + node index; path
  [B, m] int32, n [B]) to slots n..n+m-1 of every layer, all sources gathered
  before the write."""
  src = n[:, None] + path
  out = []
  for layer in cache:
    out.append({name: write_cache(arr, gather_rows(arr, src), n) for name, arr in layer.items()})
  return out
