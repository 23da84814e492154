"""The KV cache's rules, in one place: how many slots a generation holds,
how a round reads and writes per-row slots, how it keeps or rolls back
what it wrote, and how a token tree's accepted path is moved into place.

Slot s holds position s (docs/design.md sections 5-6). A row with committed
tokens x_0..x_{n-1} has a valid target cache at slots 0..n-2; a drafter's
caches keep their own committed lengths (module k of the MTP drafter: c_k,
``module_lengths``). A round writes past the committed length (the verify
block at n-1..n-1+g, drafter windows); a query at position p attends to
slots 0..p only (``mtp.model``), so entries past the new length are never
read before the next round overwrites them. Rolling back is therefore
setting the length (``commit_prefix``): nothing is copied or cleared. The
attention over the cache and its writes are ``mtp.model``'s
(``cached_attention``, ``write_cache``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mtp.model import write_cache

PROMPT_BUCKET = 64      # prompt lengths are padded to a multiple: no recompile per length


def headroom(g: int, module_depth: int = 0, tree_scratch: int = 0) -> int:
  """Cache slots past prompt + budget that a round may write: 2g + 4 for
  the verify block of draft length g and the chain drafter's windows (g + k
  positions from c_k), plus ``module_depth`` (D, for an MTP drafter: its
  windows reach D further) and ``tree_scratch`` (a token tree's verify
  block and module entries, ``TreeMTPDrafter.scratch_slots``)."""
  return 2 * g + 4 + module_depth + tree_scratch


def cache_length(prompt_len: int, max_new_tokens: int, headroom: int) -> tuple[int, int]:
  """(prompt bucket P, cache slots S): P = the longest prompt rounded up to
  ``PROMPT_BUCKET`` (no recompile per length), S = P + max_new_tokens +
  ``headroom`` (scratch room past the budget for verify blocks and drafter
  windows) rounded up the same way."""
  p = PROMPT_BUCKET * math.ceil(prompt_len / PROMPT_BUCKET)
  return p, PROMPT_BUCKET * math.ceil((p + max_new_tokens + headroom) / PROMPT_BUCKET)


def gather_rows(buf: jax.Array, idx: jax.Array) -> jax.Array:
  """buf [B, S, ...] at per-row indices idx [B, W] -> [B, W, ...] (clipped to S-1)."""
  idx = jnp.clip(idx, 0, buf.shape[1] - 1)
  idx = idx.reshape(idx.shape + (1,) * (buf.ndim - 2))
  return jnp.take_along_axis(buf, idx, axis=1)


def commit_prefix(tokens, block, n, e):
  """A round's emitted ``block`` [B, w+1] int32 written into ``tokens``
  [B, S] at slots n..n+w, and the new committed length n + e [B] int32
  (0 <= e <= w+1): (tokens, n + e). Entries past n + e (in the token
  buffer and in every cache the round wrote) are rolled back by that
  length alone: stale, never read, overwritten by a later round."""
  return write_cache(tokens, block, n), n + e


def module_lengths(n, modules: int):
  """[B, modules] int32: c_k = max(n - k, 0) for k = 1..modules, the
  committed cache length of MTP module k when the committed length is n
  [B] int32 (module k's entry j has inputs (h^{k-1}_j, x_{j+k}), true
  while j + k <= n - 1)."""
  ks = jnp.arange(1, modules + 1, dtype=jnp.int32)[None, :]
  return jnp.maximum(n[:, None] - ks, 0)


def move_path_kv(cache, path, n):
  """Copies the target K/V of the accepted path's nodes (slot n + node
  index) to slots n..n+m-1 of every layer: path [B, m] int32 node indices,
  n [B]. All sources are gathered before the write (BFS order makes the
  source slot >= the destination)."""
  src = n[:, None] + path
  out = []
  for layer in cache:
    out.append({name: write_cache(arr, gather_rows(arr, src), n) for name, arr in layer.items()})
  return out
