"""Verification: the acceptance rules of speculative decoding, for a chain of
drafts and for a token tree (whose static shape is ``decode.tree_spec.TreeSpec``).

Pure, jittable functions with no model inside (docs/design.md section 5;
derivations in docs/speculative_sampling.md):

- ``rejection_sample``: the stochastic verification rule of Leviathan et al.
  2023, "Fast Inference from Transformers via Speculative Decoding",
  Algorithm 1 (the same rule as Chen et al. 2023, Algorithm 2), vectorised
  over the batch B and the draft length G.
- ``greedy_verify``: the temperature-0 special case (accept while the draft is
  the target argmax).
- ``accept``: the rule a decoding round applies, picked by the static
  ``SamplingParams.greedy`` flag (and the AR step, G = 0).
- Token trees (``TreeSpec``): ``tree_rejection_sample`` (recursive rejection
  sampling over children drawn without replacement, Jeon et al. 2024,
  "Recursive Speculative Decoding"), ``tree_greedy_verify`` (the longest path
  of target argmaxes) and ``tree_accept``.

Warping and sampling (the distributions these rules compare, the draws they
use) live in ``decode.sampling``. Shapes use the axis letters of
docs/design.md: B batch, G draft length, N tree nodes, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from decode.sampling import (SamplingParams, categorical_from_uniform, sample, uniform_open,
                             warped_probs)
from decode.state import DecodeState
from decode.tree_spec import TreeSpec
from mtp.model import Transformer

__all__ = [
  "verify_block",
  "rejection_sample",
  "greedy_verify",
  "accept",
  "tree_rejection_sample",
  "tree_greedy_verify",
  "tree_accept",
]

def verify_block(target: Transformer, state: DecodeState, block, positions, params: SamplingParams,
                 **backbone_kw):
  """The target over a verify block: (h_draft [B, T, D], logits [B, T, V], p
  [B, T, V] (warped probabilities; the logits when greedy), new cache).
  h_draft is what the MTP drafter stores for module 1
  (``Transformer.backbone_features``: h^0, or the fused lower-layer features
  with ``mtp.feature_layers``). block / positions: [B, T] int32;
  ``backbone_kw``: write_offsets / mask for token trees."""
  with jax.named_scope("verify"):
    with jax.named_scope("forward"):
      h0, h_draft, cache = target.backbone_features(block, positions, cache=state.cache,
                                                    **backbone_kw)
    with jax.named_scope("head"):
      logits = target.head(h0)
    with jax.named_scope("warp"):
      p = logits if params.greedy else warped_probs(logits, params)
  return h_draft, logits, p, cache


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
  uniforms = uniform_open(key, (b, g + v))
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
  next_token = categorical_from_uniform(residual, u_stop)
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



def accept(key, target, draft_q, draft_tokens, params: SamplingParams):
  """The acceptance of one chain round: (num_accepted [B] int32, next_token
  [B] int32).

  Greedy ``params`` (static flag): ``greedy_verify`` on logits (no key).
  Otherwise ``rejection_sample`` (Leviathan et al. 2023, Algorithm 1) on
  warped probabilities. An AR step (``draft_tokens`` None, target [B, 1, V])
  emits the argmax, or a sample of p_0, and accepts nothing.

  Args:
    key: the round's acceptance key (None when greedy).
    target: [B, G+1, V] target logits (greedy) or warped probabilities.
    draft_q: [B, G, V] draft logits (greedy) or the warped draft
      distributions the drafts were sampled from; None for an AR step.
    draft_tokens: [B, G] int32 drafts, or None for an AR step.
    params: the sampling settings (only their static ``greedy`` flag is read).
  """
  if params.greedy:
    if draft_tokens is not None:
      return greedy_verify(target, draft_tokens)
    return jnp.zeros(target.shape[0], jnp.int32), jnp.argmax(target[:, 0], -1).astype(jnp.int32)
  if draft_tokens is not None:
    return rejection_sample(key, target, draft_q, draft_tokens)
  return jnp.zeros(target.shape[0], jnp.int32), sample(key, target[:, 0])

# -- token trees ------------------------------------------------------------------

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
  uniforms = uniform_open(key, (bsz, n + v))
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
  return a, categorical_from_uniform(row, u_stop), path


def tree_accept(key, target, draft_q, node_tokens, spec: "TreeSpec", params: SamplingParams):
  """The acceptance of one tree round: (num_accepted [B], next_token [B],
  path [B, m]) from ``tree_greedy_verify`` (greedy ``params``, no key) or
  ``tree_rejection_sample``. Shapes as those functions."""
  if params.greedy:
    return tree_greedy_verify(target, node_tokens, spec)
  return tree_rejection_sample(key, target, draft_q, node_tokens, spec)
