"""Logits warping and sampling, pure and jittable (docs/design.md sections
3 and 5; the acceptance rules are ``decode.acceptance``'s):
``SamplingParams``; ``warp_logits`` (temperature, top-k, top-p, the same for
target and drafter), ``warped_probs``, ``probs_from_logits``; ``sample``
(never a 0-probability token), ``sample_without_replacement`` (Gumbel-top-k,
for trees), ``pick`` (one draft and its q). Axes: B batch, G draft length,
V vocabulary; computed in float32."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from decode import limits
from decode.errors import DecodeError
from decode.limits import MAX_TOP_K  # noqa: F401 (decode.sampling's API)

__all__ = [
  "SamplingParams",
  "check_values",
  "warp_logits",
  "warped_probs",
  "probs_from_logits",
  "uniform_open",
  "categorical_from_uniform",
  "sample",
  "sample_from_uniform",
  "sample_without_replacement",
  "draft_uniforms",
  "pick",
]

_NEG_INF = -jnp.inf


def check_values(temperature, top_k, top_p) -> None:
  """Range checks of sampling settings given as Python or numpy numbers
  (arrays pass unchecked): temperature finite >= 0 (0 = greedy), top_k an
  integer in [0, 2**31 - 1] (0 = off), top_p in (0, 1] (1 = off). Raises
  DecodeError (a ValueError), one line naming the flag and its range."""
  limits.check_sampling(temperature, top_k, top_p,
                        is_array=lambda x: isinstance(x, (jax.Array, np.ndarray)))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Sampling settings: temperature >= 0 (0 = greedy), top_k >= 0 (0 = off),
  top_p in (0, 1] (1 = off). A pytree: the values are float32 / int32 /
  float32 leaves (traced under ``jax.jit``), the static flags ``greedy``
  (argmaxes only) and ``filtering`` (top-k or top-p on: the vocabulary sort
  is compiled) its structure. ``validate()`` raises DecodeError naming the
  flag; construction does not check."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  _flags: tuple | None = dataclasses.field(default=None, repr=False, compare=False)

  def validate(self) -> "SamplingParams":
    """Returns self; raises DecodeError for out-of-range values (``check_values``)."""
    check_values(self.temperature, self.top_k, self.top_p)
    return self

  @property
  def greedy(self) -> bool:
    """Static: temperature == 0."""
    return self._flags[0] if self._flags is not None else self.temperature == 0

  @property
  def filtering(self) -> bool:
    """Static: top-k or top-p active (the vocabulary sort is compiled)."""
    if self._flags is not None:
      return self._flags[1]
    return self.top_k > 0 or self.top_p < 1.0

  def tree_flatten(self):
    leaves = (self.temperature, self.top_k, self.top_p)
    if self._flags is None:          # Python values: fixed device dtypes, no weak types
      leaves = (np.float32(self.temperature), np.int32(min(int(self.top_k), MAX_TOP_K)),
                np.float32(self.top_p))
    return leaves, (self.greedy, self.filtering)

  @classmethod
  def tree_unflatten(cls, flags, leaves):
    return cls(*leaves, _flags=tuple(flags))

# Top-k / top-p rank the 1,024 best tokens first (``jax.lax.top_k``, a partial
# sort, far cheaper than sorting a large vocabulary); a batch where some row's
# kept set may reach past them ranks 4,096, and only a batch past those sorts
# the whole vocabulary.
TOP_CANDIDATES = (1024, 4096)


def _cumulative(x):
  """[R, n] -> (mass before each entry [R, n] (0 first), total [R, 1]), one cumsum."""
  cum = jnp.cumsum(x, axis=-1)
  return jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=-1), cum[:, -1:]


def _scatter_rows(values, ids, vocab):
  """Bool [R, V]: ``values`` [R, n] placed at vocabulary ids ``ids`` [R, n]."""
  rows = jnp.arange(values.shape[0], dtype=jnp.int32)[:, None]
  return jnp.zeros((values.shape[0], vocab), bool).at[rows, ids].set(values)


def _top_k_keep(zs, k, top_p):
  """Kept mask [R, m] of ranked logits zs [R, m] (best first, every rank
  top-k may keep included: k <= m) under top-k k > 0 and top-p."""
  pos = jnp.arange(zs.shape[-1], dtype=jnp.int32)
  in_k = pos < k
  lse = jax.nn.logsumexp(jnp.where(in_k, zs, _NEG_INF), axis=-1, keepdims=True)
  before, _ = _cumulative(jnp.where(in_k, jnp.exp(zs - lse), 0.0))
  return in_k & ((top_p >= 1.0) | (before < top_p) | (pos == 0))


def _top_p_keep(zs, lse, last, top_p):
  """Top-p kept mask [R, m] of ranks a..a+m (zs [R, m], best first) of rows
  with normaliser ``lse`` [R, 1] and mass ``last`` [R, 1] before rank a, and
  the mass before rank a+m [R, 1] (summed once per segment and reused)."""
  before, total = _cumulative(jnp.exp(zs - lse))
  return (last + before) < top_p, last + total


def _top_k_top_p(z, k, top_p, candidates=TOP_CANDIDATES):
  """Top-k then top-p (the sets ``warp_logits`` documents) on scaled logits
  z [..., V], removed entries -inf. Ranks come from ``jax.lax.top_k`` over
  the first n1, then n2 candidates (static ``candidates = (n1, n2)`` or one
  int), a full sort past them: a batch takes the narrowest tier that holds
  every row's kept set. Each segment's masses are computed once and reused,
  so a row's kept set does not depend on its batch's tier.
  """
  shape, vocab = z.shape, z.shape[-1]
  zf = z.reshape((-1, vocab))
  tiers = (candidates,) if isinstance(candidates, int) else tuple(candidates)
  n = min(int(tiers[0]), vocab)
  n2 = min(int(tiers[1]), vocab) if len(tiers) > 1 and int(tiers[1]) > n else vocab
  head, ids = jax.lax.top_k(zf, n)                 # [R, n], best first
  pos = jnp.arange(n, dtype=jnp.int32)
  top_k_on = k > 0
  p_on = top_p < 1.0
  # top-k off: the normaliser is the whole row's; ranks [0, n)
  lse = jax.nn.logsumexp(zf, axis=-1, keepdims=True)
  keep_p, last = _top_p_keep(head, lse, 0.0, top_p)
  keep_off = ~p_on | keep_p | (pos == 0)
  keep_head = jnp.where(top_k_on, _top_k_keep(head, jnp.minimum(k, n), top_p), keep_off)
  if n == vocab:
    return jnp.where(_scatter_rows(keep_head, ids, vocab).reshape(shape), z, _NEG_INF)
  inside = (top_k_on & (k <= n)) | (~top_k_on & p_on & jnp.all(last >= top_p))

  def drop_tail(_):
    return _scatter_rows(keep_head, ids, vocab)

  def full_sort(prefix, keep_prefix, last_prefix):
    m = prefix.shape[-1]

    def run(_):
      order = jnp.argsort(-zf, axis=-1, stable=True)   # ranks < m: the prefix's tokens
      tail = jnp.take_along_axis(zf, order[:, m:], axis=-1)
      keep_tail, _ = _top_p_keep(tail, lse, last_prefix, top_p)
      off = jnp.concatenate([keep_prefix, ~p_on | keep_tail], axis=-1)
      on = _top_k_keep(jnp.concatenate([prefix, tail], axis=-1), k, top_p)   # k > m
      return _scatter_rows(jnp.where(top_k_on, on, off), order, vocab)
    return run

  if n2 == vocab:
    fallback = full_sort(head, keep_off, last)
  else:
    def fallback(_):
      zs2, ids2 = jax.lax.top_k(zf, n2)            # ranks < n: the tokens ``ids``
      # ranks [n, n2) summed over the whole [R, n2] block, the first n masked
      # to 0: slicing zs2 first lets XLA fold the slice into the sort, and its
      # CPU backend then runs a full sort instead of its TopK kernel
      rank2 = jnp.arange(n2, dtype=jnp.int32)
      before2, total2 = _cumulative(jnp.where(rank2 >= n, jnp.exp(zs2 - lse), 0.0))
      keep2, last2 = (last + before2[:, n:]) < top_p, last + total2
      keep_off2 = jnp.concatenate([keep_off, ~p_on | keep2], axis=-1)
      fits = (top_k_on & (k <= n2)) | (~top_k_on & p_on & jnp.all(last2 >= top_p))

      def second_tier(_):
        on = _top_k_keep(zs2, jnp.minimum(k, n2), top_p)        # n < k <= n2
        return _scatter_rows(jnp.where(top_k_on, on, keep_off2), ids2, vocab)
      return jax.lax.cond(fits, second_tier, full_sort(zs2, keep_off2, last2), None)

  keep = jax.lax.cond(inside, drop_tail, fallback, None)
  return jnp.where(keep.reshape(shape), z, _NEG_INF)


def warp_logits(logits, temperature, top_k, top_p):
  """Temperature, then top-k, then top-p on logits (nucleus sampling,
  Holtzman et al. 2020, section 3.1); target and drafter get the same warp.

  Temperature: logits shifted by their row maximum, divided by it; <= 0 is
  greedy (only the argmax, ties to the lowest id, keeps 0.0). Top-k: the
  ``top_k`` highest (ties to the lowest id); <= 0 or >= V is off. Top-p: the
  shortest prefix by decreasing top-k-filtered probability reaching
  ``top_p``, at least the top token; >= 1 is off. Removed tokens get -inf.

  logits: [..., V] float, no NaN or +inf (an all -inf row gives NaN
  probabilities); temperature, top_k, top_p: scalars (``check_values``).
  Returns [..., V] float32. Raises DecodeError (a ValueError) for a
  Python-scalar parameter out of range (traced ones are not checked).
  """
  check_values(temperature, top_k, top_p)
  x = jnp.asarray(logits, jnp.float32)
  if x.ndim < 1:
    raise ValueError(f"logits must have a vocabulary axis, got shape {x.shape}")
  vocab = x.shape[-1]
  t = jnp.asarray(temperature, jnp.float32)
  k = jnp.asarray(top_k).astype(jnp.int32)
  top_p = jnp.asarray(top_p, jnp.float32)
  valid = x > _NEG_INF

  # Greedy (temperature 0): one finite logit at the argmax of the raw logits.
  idx = jnp.arange(vocab, dtype=jnp.int32)
  greedy_tok = jnp.argmax(x, axis=-1)[..., None]
  greedy = jnp.where((idx == greedy_tok) & valid, 0.0, _NEG_INF)

  # Temperature, on max-shifted logits: values <= 0, underflow goes to -inf.
  row_max = jnp.max(x, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  safe_t = jnp.where(t > 0, t, 1.0)
  z = jnp.where(valid, (x - row_max) / safe_t, _NEG_INF)

  # Top-k / top-p need a sort; skip it at run time when both are off (or at
  # temperature 0), the common case.
  filtering = (t > 0) & ((k > 0) | (top_p < 1.0))
  z = jax.lax.cond(filtering, _top_k_top_p, lambda z, k, top_p: z, z, k, top_p)

  return jnp.where(t > 0, z, greedy)



def warped_probs(logits, params: SamplingParams):
  """Probabilities [..., V] float32 of ``logits`` under ``params``, exactly
  ``probs_from_logits(warp_logits(...))``; only the branches ``params``'
  static flags need are built."""
  if params.greedy:
    return probs_from_logits(warp_logits(logits, params.temperature, params.top_k, params.top_p))
  x = jnp.asarray(logits, jnp.float32)
  t = jnp.asarray(params.temperature, jnp.float32)
  valid = x > _NEG_INF
  row_max = jnp.max(x, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  z = jnp.where(valid, (x - row_max) / t, _NEG_INF)
  if params.filtering:
    z = _top_k_top_p(z, jnp.asarray(params.top_k).astype(jnp.int32),
                     jnp.asarray(params.top_p, jnp.float32))
  return probs_from_logits(z)


def probs_from_logits(warped_logits):
  """Softmax of warped logits [..., V] in float32: probabilities summing to
  1 over V, exactly 0.0 at -inf logits (an all -inf row gives NaN)."""
  return jax.nn.softmax(jnp.asarray(warped_logits, jnp.float32), axis=-1)



def uniform_open(key, shape):
  """float32 uniforms in [tiny, 1) of ``shape``: usable both as u ~ U[0, 1)
  and for Gumbel noise (the draws ``sample`` and the acceptance rules use)."""
  return jax.random.uniform(key, shape, jnp.float32, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)


def categorical_from_uniform(probs, u):
  """Gumbel-max: argmax(log probs - log(-log u)) over the last axis, probs
  [..., V] float32 >= 0, u [..., V] in (0, 1) -> [...] int32. A 0-probability
  token is never chosen while some entry is positive."""
  probs = jnp.asarray(probs, jnp.float32)
  logp = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), _NEG_INF)
  return jnp.argmax(logp - jnp.log(-jnp.log(u)), axis=-1).astype(jnp.int32)


def sample_from_uniform(probs, u):
  """``sample`` with the uniforms given: probs [..., V] float >= 0 (one
  positive entry per row), u [..., V] float32 in (0, 1). Returns [...] int32,
  never a 0-probability token."""
  return categorical_from_uniform(probs, u)


def sample(key, probs):
  """One token per row ([...] int32) from categorical ``probs`` [..., V]
  float >= 0 (unnormalised is fine) by Gumbel-max, never a 0-probability
  token. Raises ValueError without a vocabulary axis."""
  probs = jnp.asarray(probs, jnp.float32)
  if probs.ndim < 1:
    raise ValueError(f"probs must have a vocabulary axis, got shape {probs.shape}")
  return categorical_from_uniform(probs, uniform_open(key, probs.shape))


def sample_without_replacement(probs, u, k: int):
  """k ordered draws without replacement from ``probs`` [..., V] float >= 0
  by Gumbel-top-k (Kool et al. 2019, section 3), u [..., V] float32 uniforms
  in (0, 1), k static in [1, V]. Returns (tokens [..., k] int32, valid [..., k]
  bool: only the first #{x: p(x) > 0} draws are real)."""
  probs = jnp.asarray(probs, jnp.float32)
  logp = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), _NEG_INF)
  scores, idx = jax.lax.top_k(logp - jnp.log(-jnp.log(u)), k)
  return idx.astype(jnp.int32), scores > _NEG_INF


def draft_uniforms(key, batch: int, num_draft_tokens: int, vocab: int, params: SamplingParams):
  """The round's uniforms for drafting, [B, G, V] float32 (one draw), or
  None when ``params`` is greedy (no randomness)."""
  if params.greedy:
    return None
  return uniform_open(key, (batch, num_draft_tokens, vocab))


def pick(logits, u, params: SamplingParams):
  """One draft per row from logits [B, V] float32: (token [B] int32, q [B, V]):
  greedy, the argmax and the logits; else a Gumbel-max sample (uniforms u
  [B, V]) from q = the warped probabilities."""
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits
  q = warped_probs(logits, params)
  return sample_from_uniform(q, u), q
