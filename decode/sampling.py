"""Logits warping and the speculative-sampling acceptance rule.

Pure, jittable functions with no model inside (docs/design.md, sections 3 and 5):

- ``warp_logits``: temperature, then top-k, then top-p (nucleus), applied
  identically to target and draft logits.
- ``probs_from_logits``: float32 softmax with exact zeros at removed tokens.
- ``sample``: categorical sampling that never returns a 0-probability token.
- ``rejection_sample``: the stochastic verification rule of Leviathan et al.
  2023, "Fast Inference from Transformers via Speculative Decoding",
  Algorithm 1 (the same rule as Chen et al. 2023, "Accelerating Large
  Language Model Decoding with Speculative Sampling", Algorithm 2), vectorised
  over the batch B and the draft length G.
- ``greedy_verify``: the temperature-0 special case (accept while the draft is
  the target argmax).
- Token trees (``TreeSpec``): ``sample_without_replacement`` (Gumbel-top-k,
  Kool et al. 2019), ``tree_rejection_sample`` (recursive rejection sampling
  over children drawn without replacement, Jeon et al. 2024, "Recursive
  Speculative Decoding") and ``tree_greedy_verify`` (the longest path of
  target argmaxes). Derivation: docs/speculative_sampling.md, "Token trees".

Shapes use the axis letters of docs/design.md: B batch, G draft length (gamma),
V vocabulary. Internally everything is float32. The derivation of why the
rule is lossless, with a worked example, is in docs/speculative_sampling.md.

Sampling parameters (``temperature``, ``top_k``, ``top_p``) may be Python
scalars or traced jnp scalars, so one compiled function serves every setting;
shapes (B, G, V) are the only things that trigger recompilation.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "Warp",
  "warp_logits",
  "warped_probs",
  "probs_from_logits",
  "sample",
  "sample_from_uniform",
  "rejection_sample",
  "greedy_verify",
  "TreeSpec",
  "sample_without_replacement",
  "tree_rejection_sample",
  "tree_greedy_verify",
]

_NEG_INF = -jnp.inf


def _check_python_params(temperature, top_k, top_p) -> None:
  """Validates sampling parameters given as Python scalars (traced ones pass)."""
  if isinstance(temperature, numbers.Real) and not temperature >= 0:
    raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature!r}")
  if isinstance(top_k, numbers.Real):
    if isinstance(top_k, float) and not float(top_k).is_integer():
      raise ValueError(f"top_k must be an integer, got {top_k!r}")
    if not top_k >= 0:
      raise ValueError(f"top_k must be >= 0 (0 disables top-k), got {top_k!r}")
  if isinstance(top_p, numbers.Real) and not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1] (1 disables top-p), got {top_p!r}")


def _top_k_top_p(z, k, top_p):
  """Top-k then top-p on temperature-scaled logits z [..., V] (-inf = removed)."""
  vocab = z.shape[-1]
  idx = jnp.arange(vocab, dtype=jnp.int32)
  # Rank of every token by decreasing scaled logit, ties to the lowest index.
  order = jnp.argsort(-z, axis=-1, stable=True)  # [..., V], best first
  rank = jnp.argsort(order, axis=-1, stable=True)  # inverse permutation

  # Top-k by rank (exactly k survivors among tokens with finite logits).
  keep_k = (k <= 0) | (rank < k)
  z = jnp.where(keep_k, z, _NEG_INF)

  # Top-p over the top-k-filtered distribution, in sorted order. Filtering by
  # rank keeps the sort order valid (removed tokens are a suffix).
  z_sorted = jnp.take_along_axis(z, order, axis=-1)
  p_sorted = jax.nn.softmax(z_sorted, axis=-1)
  cum = jnp.cumsum(p_sorted, axis=-1)
  before = jnp.concatenate([jnp.zeros_like(cum[..., :1]), cum[..., :-1]], axis=-1)
  keep_sorted = (before < top_p) | (idx == 0)
  keep_p = jnp.take_along_axis(keep_sorted, rank, axis=-1) | (top_p >= 1.0)
  z = jnp.where(keep_p, z, _NEG_INF)

  return z


def warp_logits(logits, temperature, top_k, top_p):
  """Applies temperature, then top-k, then top-p to logits.

  Standard nucleus sampling (Holtzman et al. 2020, "The Curious Case of Neural
  Text Degeneration", section 3.1) after temperature and top-k; the same warp
  must be applied to the target's and the drafter's logits so that the
  speculative rule (Leviathan et al. 2023, Algorithm 1) is lossless with
  respect to sampling the target under these settings.

  Semantics:
    - Temperature: finite logits are shifted by their row maximum and divided
      by ``temperature`` (softmax is shift invariant, and the shift keeps tiny
      temperatures from overflowing to +inf). ``temperature == 0`` (or any
      traced value <= 0) is greedy: only the argmax of ``logits`` keeps a
      finite logit (0.0), ties going to the lowest index as in ``jnp.argmax``,
      so the softmax is exactly one-hot. Greedy ignores top-k and top-p (the
      argmax is in every top-k / top-p set anyway).
    - Top-k: keeps the ``top_k`` highest-scoring tokens, exactly ``top_k`` of
      them: ties at the boundary go to the lowest index. ``top_k <= 0`` or
      ``top_k >= V`` disables it.
    - Top-p: over the temperature-scaled, top-k-filtered distribution, keeps
      the smallest prefix of tokens sorted by decreasing probability (ties:
      lowest index first) whose cumulative probability reaches ``top_p``,
      always at least the top token. ``top_p >= 1`` disables it.
    - Removed tokens get logit -inf. Input entries that are already -inf
      (masked vocabulary padding) stay -inf under every setting, so their
      probability is exactly 0 and they are never the greedy choice (unless
      the whole row is -inf, which is invalid input: the row stays all -inf
      and its softmax is NaN).

  Args:
    logits: [..., V] float (any float dtype; computed in float32). May contain
      -inf for masked tokens; must not contain NaN or +inf.
    temperature: scalar, Python float or traced jnp scalar, >= 0.
    top_k: scalar, Python int or traced jnp integer scalar, >= 0 (0: off).
    top_p: scalar, Python float or traced jnp scalar in (0, 1] (1: off).

  Returns:
    [..., V] float32 warped logits, removed tokens at -inf. At least one entry
    per row is finite (given at least one finite input entry).

  Raises:
    ValueError: if a parameter given as a Python scalar is out of range
      (temperature < 0, top_k < 0 or non-integral, top_p outside (0, 1]).
      Traced parameters cannot be checked: a traced temperature <= 0 is
      greedy, top_k <= 0 disables top-k, top_p <= 0 keeps only the top token.
  """
  _check_python_params(temperature, top_k, top_p)
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
  # temperature 0), which is the common case and costs a visible share of a
  # small model's decoding step on CPU.
  filtering = (t > 0) & ((k > 0) | (top_p < 1.0))
  z = jax.lax.cond(filtering, _top_k_top_p, lambda z, k, top_p: z, z, k, top_p)

  return jnp.where(t > 0, z, greedy)


@jax.tree_util.register_pytree_node_class
class Warp:
  """Sampling settings as decoding's jitted functions see them.

  ``temperature``, ``top_k``, ``top_p`` are pytree children (traced scalars:
  one compilation serves every value); ``greedy`` (temperature == 0) and
  ``filtering`` (top-k or top-p active) are static, part of the tree
  structure, so each of the three combinations compiles its own lean
  program: greedy decoding takes argmaxes and never builds a softmax, a
  residual or a random number; sampling without top-k/top-p never compiles
  the vocabulary sort. ``Warp.of(t, k, p)`` derives the flags from Python
  values; iterating gives ``(temperature, top_k, top_p)`` so that
  ``warp_logits(x, *warp)`` works as with a plain tuple.
  """

  def __init__(self, temperature, top_k, top_p, greedy: bool = False, filtering: bool = True):
    self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
    self.greedy, self.filtering = bool(greedy), bool(filtering)

  @classmethod
  def of(cls, temperature: float, top_k: int = 0, top_p: float = 1.0) -> "Warp":
    """Traced float32/int32 scalars with the static flags of these values.
    Raises ValueError for out-of-range values (as ``warp_logits``)."""
    _check_python_params(temperature, top_k, top_p)
    return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
               greedy=temperature == 0, filtering=top_k > 0 or top_p < 1.0)

  def tree_flatten(self):
    return (self.temperature, self.top_k, self.top_p), (self.greedy, self.filtering)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)

  def __iter__(self):
    return iter((self.temperature, self.top_k, self.top_p))

  def __repr__(self):
    return (f"Warp(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, "
            f"greedy={self.greedy}, filtering={self.filtering})")


def warped_probs(logits, warp):
  """Probabilities [..., V] float32 of ``logits`` under ``warp``: exactly
  ``probs_from_logits(warp_logits(logits, *warp))``.

  With a ``Warp`` that is not greedy, the temperature-0 branch is not built
  and the top-k/top-p sort only when ``warp.filtering`` (same values, fewer
  operations). ``warp`` may also be a plain (temperature, top_k, top_p)
  tuple (the general, traced path).
  """
  if not isinstance(warp, Warp) or warp.greedy:
    return probs_from_logits(warp_logits(logits, *warp))
  x = jnp.asarray(logits, jnp.float32)
  t = jnp.asarray(warp.temperature, jnp.float32)
  valid = x > _NEG_INF
  row_max = jnp.max(x, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  z = jnp.where(valid, (x - row_max) / t, _NEG_INF)
  if warp.filtering:
    z = _top_k_top_p(z, jnp.asarray(warp.top_k).astype(jnp.int32),
                     jnp.asarray(warp.top_p, jnp.float32))
  return probs_from_logits(z)


def probs_from_logits(warped_logits):
  """Softmax of (warped) logits in float32.

  Args:
    warped_logits: [..., V] float, removed tokens at -inf (at least one finite
      entry per row).

  Returns:
    [..., V] float32 probabilities summing to 1 over V; exactly 0.0 where the
    logit is -inf.

  Raises:
    Nothing (an all -inf row gives NaN, like ``jax.nn.softmax``).
  """
  return jax.nn.softmax(jnp.asarray(warped_logits, jnp.float32), axis=-1)


def _uniform_open(key, shape):
  """float32 uniforms in [tiny, 1): usable both as u ~ U[0, 1) and for Gumbel noise."""
  return jax.random.uniform(key, shape, jnp.float32, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)


def _categorical_from_uniform(probs, u):
  """Gumbel-max sampling: argmax(log probs - log(-log u)) over the last axis.

  probs [..., V] float32 >= 0, u [..., V] float32 in (0, 1). A 0-probability
  token has score -inf and is never chosen while some entry is positive
  (the Gumbel noise is finite). Scale invariant in probs.
  """
  logp = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), _NEG_INF)
  return jnp.argmax(logp - jnp.log(-jnp.log(u)), axis=-1).astype(jnp.int32)


def sample_from_uniform(probs, u):
  """``sample`` with the uniforms given: probs [..., V] float >= 0 (at least
  one positive entry per row), u [..., V] float32 in (0, 1) (e.g. one
  ``jax.random.uniform`` draw for several samples). Returns [...] int32.
  A 0-probability token is never returned."""
  return _categorical_from_uniform(jnp.asarray(probs, jnp.float32), u)


def uniform_open(key, shape):
  """float32 uniforms in [tiny, 1) of ``shape``, the draws ``sample`` and
  ``rejection_sample`` use."""
  return _uniform_open(key, shape)


def sample(key, probs):
  """Draws one token per row from a categorical distribution.

  Gumbel-max over log(probs) (as ``jax.random.categorical``): a token with
  probability exactly 0 has log-probability -inf and is never returned. The
  probabilities need not be normalised (only ratios matter).

  Args:
    key: a ``jax.random`` key.
    probs: [..., V] float, non-negative, at least one positive entry per row.

  Returns:
    [...] int32 sampled token ids.

  Raises:
    ValueError: if ``probs`` has no vocabulary axis.
  """
  probs = jnp.asarray(probs, jnp.float32)
  if probs.ndim < 1:
    raise ValueError(f"probs must have a vocabulary axis, got shape {probs.shape}")
  return _categorical_from_uniform(probs, _uniform_open(key, probs.shape))


def _check_verify_shapes(name, target, draft_tokens, draft_probs=None):
  """Static (trace-time) shape checks for the verification functions."""
  if target.ndim != 3:
    raise ValueError(f"{name}: target must be [B, G+1, V], got shape {target.shape}")
  b, g1, v = target.shape
  if draft_tokens.ndim != 2 or draft_tokens.shape != (b, g1 - 1):
    raise ValueError(
      f"{name}: draft_tokens must be [B, G] = [{b}, {g1 - 1}] to match target "
      f"{target.shape}, got {draft_tokens.shape}"
    )
  if not jnp.issubdtype(draft_tokens.dtype, jnp.integer):
    raise ValueError(f"{name}: draft_tokens must be integer, got {draft_tokens.dtype}")
  if draft_probs is not None and draft_probs.shape != (b, g1 - 1, v):
    raise ValueError(
      f"{name}: draft_probs must be [B, G, V] = [{b}, {g1 - 1}, {v}], got {draft_probs.shape}"
    )


def rejection_sample(key, target_probs, draft_probs, draft_tokens):
  """Speculative-sampling verification of G drafted tokens per row.

  Leviathan et al. 2023, Algorithm 1 (= Chen et al. 2023, Algorithm 2), with
  the indices of docs/design.md section 5: for j = 1..G in order, draft d_j is
  accepted with probability min(1, p_{j-1}(d_j) / q_j(d_j)), where
  p_{j-1} = ``target_probs[:, j-1]`` and q_j = ``draft_probs[:, j-1]``. At the
  first rejection j* the round emits one token from the residual
  norm(max(0, p_{j*-1} - q_{j*})) and stops; if all G drafts are accepted it
  emits a bonus token from p_G = ``target_probs[:, G]``. With a accepted
  drafts the round emits ``draft_tokens[:, :a]`` followed by ``next_token``;
  each emitted token, given the tokens before it, follows the target's
  distribution, so the output has exactly the target's law, provided each d_j
  was really sampled from q_j (derivation: docs/speculative_sampling.md).

  Implementation: all randomness of the round is one uniform draw of shape
  [B, G + V] from ``key``: u_j (j = 1..G) for the acceptance tests, accept iff
  u_j < p/q (so p >= q always accepts and p == 0 never does), and V more for
  the Gumbel-max draw of the stop token. The accepted count is the length of
  the leading run of accepts (cumulative product), so there is no loop over
  G. The residual is formed only for the stop row.

  Edge cases (decisions):
    - p(d) == 0: never accepted, and never emitted (the residual and the
      bonus row give it probability 0), whatever q(d) is.
    - q(d) == 0 (impossible if d was sampled from q; an adversarial or buggy
      drafter): the ratio is taken as +inf, i.e. accepted iff p(d) > 0. The
      output is then no longer guaranteed to follow p: losslessness requires
      drafts sampled from q.
    - Draft ids outside [0, V) are rejected.
    - Residual summing to 0 (only through rounding when p == q, or with an
      adversarial q(d) == 0, p(d) == 0 draft on a row where p == q): falls
      back to sampling from p itself.

  Args:
    key: a ``jax.random`` key (one uniform draw of shape [B, G + V]).
    target_probs: [B, G+1, V] float, the warped target distributions p_0..p_G
      (rows sum to 1).
    draft_probs: [B, G, V] float, q_1..q_G, the distributions the drafts were
      actually sampled from (after the same warp).
    draft_tokens: [B, G] integer, the drafts d_1..d_G.

  Returns:
    (num_accepted, next_token): [B] int32 in 0..G, and [B] int32, the residual
    token (num_accepted < G) or the bonus token (num_accepted == G).

  Raises:
    ValueError: on inconsistent shapes or non-integer draft_tokens (at trace
      time; G is static, one compilation per (B, G, V)).
  """
  p = jnp.asarray(target_probs, jnp.float32)
  q = jnp.asarray(draft_probs, jnp.float32)
  d = jnp.asarray(draft_tokens)
  _check_verify_shapes("rejection_sample", p, d, q)
  b, g1, v = p.shape
  g = g1 - 1
  d = d.astype(jnp.int32)
  uniforms = _uniform_open(key, (b, g + v))
  u, u_stop = uniforms[:, :g], uniforms[:, g:]  # [B, G] in [0, 1), [B, V]

  # Acceptance tests for all G drafts at once.
  in_range = (d >= 0) & (d < v)
  d_safe = jnp.clip(d, 0, v - 1)[..., None]
  p_d = jnp.take_along_axis(p[:, :g], d_safe, axis=-1)[..., 0]  # [B, G]
  q_d = jnp.take_along_axis(q, d_safe, axis=-1)[..., 0]  # [B, G]
  ratio = jnp.where(
    q_d > 0,
    p_d / jnp.where(q_d > 0, q_d, 1.0),
    jnp.where(p_d > 0, jnp.inf, 0.0),
  )
  accept = (u < ratio) & (p_d > 0) & in_range
  num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)

  # The stop row: residual max(0, p_a - q_{a+1}) for a < G, p_G for a == G
  # (q padded with a zero row at index G).
  q_pad = jnp.concatenate([q, jnp.zeros((b, 1, v), jnp.float32)], axis=1)
  row = num_accepted[:, None, None]
  p_row = jnp.take_along_axis(p, row, axis=1)[:, 0]  # [B, V]
  q_row = jnp.take_along_axis(q_pad, row, axis=1)[:, 0]  # [B, V]
  residual = jnp.maximum(p_row - q_row, 0.0)
  total = jnp.sum(residual, axis=-1, keepdims=True)
  residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p_row)
  next_token = _categorical_from_uniform(residual, u_stop)
  return num_accepted.astype(jnp.int32), next_token


def greedy_verify(target_logits_or_probs, draft_tokens):
  """Greedy (temperature 0) verification of G drafted tokens per row.

  Accepts d_j while d_j == argmax of target row j-1 (j = 1..G); the next
  token is the argmax at the first mismatch position, or at position G (the
  bonus) when all drafts match. This is ``rejection_sample`` with one-hot p
  and q (Leviathan et al. 2023, Algorithm 1 at temperature 0): p(d)/q(d) is 1
  iff d is the argmax and 0 otherwise, and the residual max(0, p - q) is then
  the one-hot argmax. Ties go to the lowest index (``jnp.argmax``), matching
  ``warp_logits`` at temperature 0. Deterministic: no key.

  Args:
    target_logits_or_probs: [B, G+1, V] float, target logits or probabilities
      (only the argmax is used; -inf entries are never chosen).
    draft_tokens: [B, G] integer drafts d_1..d_G.

  Returns:
    (num_accepted, next_token): [B] int32 in 0..G and [B] int32.

  Raises:
    ValueError: on inconsistent shapes or non-integer draft_tokens.
  """
  x = jnp.asarray(target_logits_or_probs)
  d = jnp.asarray(draft_tokens)
  _check_verify_shapes("greedy_verify", x, d)
  g = x.shape[1] - 1
  best = jnp.argmax(x, axis=-1).astype(jnp.int32)  # [B, G+1]
  match = d.astype(jnp.int32) == best[:, :g]
  num_accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
  next_token = jnp.take_along_axis(best, num_accepted[:, None], axis=1)[:, 0]
  return num_accepted.astype(jnp.int32), next_token


# ---------------------------------------------------------------------------
# Token trees.


@dataclasses.dataclass(frozen=True)
class TreeSpec:
  """A static draft tree given by its branching per depth.

  ``branching`` (b_1, .., b_m): the root (the newest committed token x_{n-1})
  has b_1 children, every depth-1 node b_2 children, and so on; depth m is
  the tree's depth. Nodes are numbered in breadth-first order (all depth-1
  nodes, then all depth-2 nodes, ...; the children of one parent are
  consecutive, in the order they were drafted), node i in 0..N-1. Verify
  blocks put the root at block index 0 and node i at block index 1 + i, so
  the internal nodes (root and depths 1..m-1) are the first
  ``num_internal`` block indices.

  Hashable (a static argument under ``jax.jit``); the derived index arrays
  are numpy (static).
  """
  branching: tuple[int, ...]

  def __post_init__(self):
    b = tuple(self.branching)
    if not b or not all(isinstance(x, (int, np.integer)) and x >= 1 for x in b):
      raise ValueError(f"tree branching must be a non-empty tuple of integers >= 1, got {b!r}")
    object.__setattr__(self, "branching", tuple(int(x) for x in b))

  @property
  def depth(self) -> int:
    """m, the number of levels below the root."""
    return len(self.branching)

  @functools.cached_property
  def counts(self) -> tuple[int, ...]:
    """(n_0, n_1, .., n_m): nodes per depth, n_0 = 1 (the root), n_d = n_{d-1} b_d."""
    out = [1]
    for b in self.branching:
      out.append(out[-1] * b)
    return tuple(out)

  @property
  def num_nodes(self) -> int:
    """N = n_1 + .. + n_m (the root excluded): drafted tokens per round."""
    return sum(self.counts[1:])

  @property
  def num_internal(self) -> int:
    """Nodes with children, root included: n_0 + .. + n_{m-1}."""
    return sum(self.counts[:-1])

  @functools.cached_property
  def offsets(self) -> tuple[int, ...]:
    """offsets[d] = first node index of depth d (d = 1..m; offsets[0] = -1
    stands for the root, which is not a node); offsets[m+1] = N."""
    out, acc = [-1], 0
    for c in self.counts[1:]:
      out.append(acc)
      acc += c
    return tuple(out + [acc])

  @functools.cached_property
  def depths(self) -> np.ndarray:
    """[N] int32, depth 1..m of every node."""
    return np.concatenate([np.full(c, d, np.int32) for d, c in enumerate(self.counts) if d])

  @functools.cached_property
  def parents(self) -> np.ndarray:
    """[N] int32, node index of every node's parent, -1 for the root's children."""
    out = [np.full(self.counts[1], -1)]
    for d in range(2, self.depth + 1):
      out.append(self.offsets[d - 1] + np.arange(self.counts[d]) // self.branching[d - 1])
    return np.concatenate(out).astype(np.int32)

  @functools.cached_property
  def ancestors(self) -> np.ndarray:
    """[N, N] bool: ancestors[i, j] iff node j is node i or one of its
    ancestors (the root excluded)."""
    n = self.num_nodes
    out = np.eye(n, dtype=bool)
    for i in range(n):
      j = self.parents[i]
      while j >= 0:
        out[i, j] = True
        j = self.parents[j]
    return out

  @functools.cached_property
  def block_ancestors(self) -> np.ndarray:
    """[N+1, N+1] bool over verify-block indices (root 0, node i at 1+i):
    ancestor-or-self, the root an ancestor of every node (the tree
    attention mask of the verify block)."""
    n = self.num_nodes
    out = np.zeros((n + 1, n + 1), bool)
    out[:, 0] = True
    out[1:, 1:] = self.ancestors
    return out

  def __str__(self):
    return ",".join(map(str, self.branching))


def sample_without_replacement(probs, u, k: int):
  """k ordered draws without replacement from categorical ``probs``.

  The Gumbel-top-k trick (Kool, van Hoof and Welling 2019, "Stochastic
  Beams and Where to Find Them", section 3): the indices of the k largest
  log p(x) + G_x, G_x = -log(-log u_x) i.i.d. Gumbel, in decreasing order,
  are distributed as sequential sampling without replacement: the first
  ~ p, the i-th ~ p restricted to the tokens not yet drawn, renormalised.
  Only the first ``count = #{x: p(x) > 0}`` draws are real; when count < k
  the rest are marked invalid (their ids are arbitrary zero-probability
  tokens).

  Args:
    probs: [..., V] float >= 0 (need not be normalised).
    u: [..., V] float32 uniforms in (0, 1) (``uniform_open``).
    k: static number of draws, 1 <= k <= V.
  Returns:
    (tokens [..., k] int32, valid [..., k] bool).
  """
  probs = jnp.asarray(probs, jnp.float32)
  logp = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), _NEG_INF)
  scores, idx = jax.lax.top_k(logp - jnp.log(-jnp.log(u)), k)
  return idx.astype(jnp.int32), scores > _NEG_INF


def _check_tree_shapes(name, spec, target, node_tokens, draft_probs=None):
  if not isinstance(spec, TreeSpec):
    raise ValueError(f"{name}: spec must be a TreeSpec, got {type(spec).__name__}")
  n = spec.num_nodes
  if target.ndim != 3 or target.shape[1] != n + 1:
    raise ValueError(f"{name}: target must be [B, N+1, V] with N = {n} nodes of tree {spec}, "
                     f"got shape {target.shape}")
  b, _, v = target.shape
  if node_tokens.shape != (b, n) or not jnp.issubdtype(node_tokens.dtype, jnp.integer):
    raise ValueError(f"{name}: node_tokens must be integer [B, N] = [{b}, {n}], got "
                     f"{node_tokens.shape} {node_tokens.dtype}")
  if draft_probs is not None and draft_probs.shape != (b, spec.num_internal, v):
    raise ValueError(f"{name}: draft_probs must be [B, N_internal, V] = [{b}, {spec.num_internal}, "
                     f"{v}], got {draft_probs.shape}")


def _walk(spec, bsz, choose):
  """Descends the tree from the root: ``choose(d, parent [B])`` (the
  current node's index within depth d) returns (found [B] bool, child rank
  [B] in 0..b_{d+1}-1). Returns (num_accepted [B] int32, path [B, m] int32
  node indices; entries past num_accepted are arbitrary valid nodes)."""
  alive = jnp.ones((bsz,), bool)
  a = jnp.zeros((bsz,), jnp.int32)
  cur = jnp.zeros((bsz,), jnp.int32)
  path = []
  for d in range(spec.depth):
    found, j = choose(d, cur)
    alive = alive & found
    a = a + alive
    cur = cur * spec.branching[d] + j
    path.append(spec.offsets[d + 1] + cur)
  return a, jnp.stack(path, 1).astype(jnp.int32)


def _stop_block(path, a):
  """Block index of the last accepted node (0 = root when a = 0)."""
  last = jnp.take_along_axis(path, jnp.maximum(a - 1, 0)[:, None], 1)[:, 0]
  return jnp.where(a > 0, last + 1, 0)


def tree_greedy_verify(target_logits_or_probs, node_tokens, spec: TreeSpec):
  """Greedy (temperature 0) verification of a token tree.

  From the root, repeatedly move to the first child whose token is the
  target argmax at the current node; stop where no child matches. The next
  token is the argmax at the last accepted node (its bonus when that is a
  leaf). This is the longest path on which every node is the target argmax
  at its parent, so the emitted tokens are exactly the target's greedy
  continuation: the tree version of ``greedy_verify`` (Leviathan et al.
  2023, Algorithm 1 at temperature 0). Ties go to the lowest index.

  Args:
    target_logits_or_probs: [B, N+1, V] float, target rows of the verify
      block (root at 0, node i at 1+i; only argmaxes are used).
    node_tokens: [B, N] integer, the drafted token of every node (BFS order).
    spec: the tree (static).
  Returns:
    (num_accepted [B] int32 in 0..m, next_token [B] int32, path [B, m] int32:
    node index of the accepted node at depth d in column d-1, for
    d <= num_accepted; later columns are arbitrary valid node indices).
  Raises:
    ValueError: on shapes that do not match ``spec``.
  """
  x = jnp.asarray(target_logits_or_probs)
  toks = jnp.asarray(node_tokens)
  _check_tree_shapes("tree_greedy_verify", spec, x, toks)
  best = jnp.argmax(x, axis=-1).astype(jnp.int32)                         # [B, N+1]
  toks = toks.astype(jnp.int32)

  def choose(d, parent):
    b = spec.branching[d]
    block = parent + (1 + spec.offsets[d] if d else 0)                    # parent's block index
    want = jnp.take_along_axis(best, block[:, None], 1)                   # [B, 1]
    kids = spec.offsets[d + 1] + parent[:, None] * b + jnp.arange(b)[None]
    match = jnp.take_along_axis(toks, kids, 1) == want                    # [B, b]
    return jnp.any(match, 1), jnp.argmax(match, 1).astype(jnp.int32)

  a, path = _walk(spec, x.shape[0], choose)
  nxt = jnp.take_along_axis(best, _stop_block(path, a)[:, None], 1)[:, 0]
  return a, nxt, path


def tree_rejection_sample(key, target_probs, draft_probs, node_tokens, spec: TreeSpec):
  """Lossless verification of a token tree whose children were drawn
  without replacement: recursive rejection sampling (Jeon et al. 2024,
  "Recursive Speculative Decoding", arXiv:2402.14160; the same rule as
  Yang et al. 2024, "Multi-Candidate Speculative Decoding"), applied at
  every node along the accepted path. Derivation and equations (T1)-(T3):
  docs/speculative_sampling.md, "Token trees".

  At a node with target distribution p (``target_probs`` at its block row)
  and draft distribution q (``draft_probs`` at its row), whose children
  c_1..c_b were drawn from q without replacement (``sample_without_replacement``:
  c_i ~ q_i = q restricted to tokens other than c_1..c_{i-1}, renormalised),
  with r_1 = p, for i = 1..b:

      accept c_i with probability min(1, r_i(c_i) / q_i(c_i));         (T1)
      otherwise r_{i+1} = norm(max(0, r_i - q_i))                        (T2)

  and after the first acceptance continue at c_i (its own p and q); if all
  children are rejected, emit one token from r_{b+1} and stop; at a leaf
  emit a bonus token from its p. Every emitted token then follows the
  target's conditional distribution (T3), whatever q is, provided the
  children really were drawn as stated. Children past the number of
  nonzero entries of q (top-k / top-p supports smaller than b) are invalid:
  skipped, no update.

  Implementation: the outcome at every internal node is computed at once
  (independent uniforms per node, one vectorised pass per depth and child
  rank), then the path is walked from the root; the randomness is one
  uniform draw of shape [B, N + V] from ``key`` (one per node for (T1),
  V for the final Gumbel-max draw). Edge cases as in ``rejection_sample``:
  p(c) = 0 is never accepted or emitted; a residual that sums to 0
  (rounding when r_i == q_i) falls back to r_i.

  Args:
    key: a ``jax.random`` key.
    target_probs: [B, N+1, V] float, warped target distributions of the
      verify block (root at 0, node i at 1+i).
    draft_probs: [B, N_internal, V] float, q at every internal node (block
      order: root, then depths 1..m-1), the distribution its children were
      drawn from without replacement.
    node_tokens: [B, N] integer, node tokens in BFS order (the children of
      internal node j at consecutive indices, in drawing order).
    spec: the tree (static).
  Returns:
    (num_accepted [B] int32 in 0..m, next_token [B] int32, path [B, m]
    int32), as ``tree_greedy_verify``.
  Raises:
    ValueError: on shapes that do not match ``spec``.
  """
  p = jnp.asarray(target_probs, jnp.float32)
  q = jnp.asarray(draft_probs, jnp.float32)
  toks = jnp.asarray(node_tokens)
  _check_tree_shapes("tree_rejection_sample", spec, p, toks, q)
  toks = toks.astype(jnp.int32)
  bsz, n1, v = p.shape
  n = n1 - 1
  uniforms = _uniform_open(key, (bsz, n + v))
  u_acc, u_stop = uniforms[:, :n], uniforms[:, n:]
  vocab = jnp.arange(v, dtype=jnp.int32)

  accepted, residuals = [], []            # per depth d = 0..m-1
  for d in range(spec.depth):
    b, nd = spec.branching[d], spec.counts[d]
    lo = 1 + spec.offsets[d] if d else 0                                  # block rows of depth d
    r = p[:, lo:lo + nd]                                                  # [B, nd, V]
    qd = q[:, lo:lo + nd]
    kids = slice(spec.offsets[d + 1], spec.offsets[d + 1] + nd * b)
    ct = toks[:, kids].reshape(bsz, nd, b)
    cu = u_acc[:, kids].reshape(bsz, nd, b)
    support = jnp.sum(qd > 0, -1)                                         # [B, nd]
    qrem = qd
    acc = jnp.full((bsz, nd), b, jnp.int32)                               # b = none accepted
    for i in range(b):
      c = jnp.clip(ct[..., i], 0, v - 1)
      valid = (i < support) & (ct[..., i] >= 0) & (ct[..., i] < v)
      searching = valid & (acc == b)
      if i == 0:
        qi = qd                                                           # q_1 = q as given
      else:
        mass = jnp.sum(qrem, -1, keepdims=True)
        qi = qrem / jnp.where(mass > 0, mass, 1.0)                        # q_i
      rc = jnp.take_along_axis(r, c[..., None], -1)[..., 0]
      qc = jnp.take_along_axis(qi, c[..., None], -1)[..., 0]
      ratio = jnp.where(qc > 0, rc / jnp.where(qc > 0, qc, 1.0), jnp.where(rc > 0, jnp.inf, 0.0))
      ok = searching & (cu[..., i] < ratio) & (rc > 0)
      acc = jnp.where(ok, i, acc)
      res = jnp.maximum(r - qi, 0.0)
      tot = jnp.sum(res, -1, keepdims=True)
      res = jnp.where(tot > 0, res / jnp.where(tot > 0, tot, 1.0), r)
      r = jnp.where((searching & ~ok)[..., None], res, r)
      qrem = jnp.where(valid[..., None] & (vocab == c[..., None]), 0.0, qrem)
    accepted.append(acc)
    residuals.append(r)

  def choose(d, parent):
    j = jnp.take_along_axis(accepted[d], parent[:, None], 1)[:, 0]
    b = spec.branching[d]
    return j < b, jnp.minimum(j, b - 1)

  a, path = _walk(spec, bsz, choose)
  stop_rows = jnp.concatenate(residuals + [p[:, 1 + spec.offsets[spec.depth]:]], 1)  # [B, N+1, V]
  row = jnp.take_along_axis(stop_rows, _stop_block(path, a)[:, None, None], 1)[:, 0]
  return a, _categorical_from_uniform(row, u_stop), path
