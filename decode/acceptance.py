"""Acceptance rules of speculative decoding, pure functions of the target's
and drafter's distributions: ``rejection_sample`` (Leviathan et al. 2023,
Algorithm 1 = Chen et al. 2023, Algorithm 2), ``greedy_verify``,
``chain_rule``; for a token tree ``tree_rejection_sample`` (Jeon et al. 2024),
``tree_greedy_verify``, ``tree_accept``. Derivations in
docs/speculative_sampling.md. Axes: B batch, G draft length, N tree nodes, V
vocabulary."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from decode.sampling import SamplingParams, categorical_from_uniform, sample, uniform_open
from decode.tree_spec import TreeSpec

__all__ = [
  "rejection_sample",
  "greedy_verify",
  "greedy_chain",
  "ar_greedy",
  "ar_sample",
  "chain_rule",
  "tree_rejection_sample",
  "tree_greedy_verify",
  "tree_accept",
]

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
  """Leviathan et al. 2023, Algorithm 1: d_j is accepted with probability
  min(1, p_{j-1}(d_j) / q_j(d_j)) in order; at the first rejection one token
  from norm(max(0, p_{j-1} - q_j)), after G accepts a bonus token from p_G.

  target_probs [B, G+1, V] float (warped p_0..p_G), draft_probs [B, G, V]
  float (q_1..q_G), draft_tokens [B, G] integer; one uniform draw [B, G + V]
  from ``key``. q(d) = 0 counts as ratio +inf, ids outside [0, V) are
  rejected, a residual summing to 0 falls back to p.
  Returns (num_accepted [B] int32 in 0..G, next_token [B] int32).
  Raises ValueError on inconsistent shapes or non-integer draft_tokens.
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
  """Temperature-0 verification: accepts d_j while it is the argmax of
  target row j-1; next token the argmax at the first mismatch (or row G);
  ties to the lowest id. target_logits_or_probs [B, G+1, V], draft_tokens
  [B, G] integer. Returns (num_accepted [B] int32 in 0..G, next_token [B]
  int32). Raises ValueError on inconsistent shapes."""
  x = jnp.asarray(target_logits_or_probs)
  d = jnp.asarray(draft_tokens)
  _check_verify_shapes("greedy_verify", x, d)
  g = x.shape[1] - 1
  best = jnp.argmax(x, axis=-1).astype(jnp.int32)  # [B, G+1]
  match = d.astype(jnp.int32) == best[:, :g]
  num_accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
  next_token = jnp.take_along_axis(best, num_accepted[:, None], axis=1)[:, 0]
  return num_accepted.astype(jnp.int32), next_token



def greedy_chain(key, target, draft_q, draft_tokens):
  """``greedy_verify`` in the chain rules' signature (``chain_rule``):
  ``key`` and ``draft_q`` are unused. target: [B, G+1, V] logits;
  draft_tokens: [B, G] int32. Returns (num_accepted [B], next_token [B])."""
  return greedy_verify(target, draft_tokens)


def ar_greedy(key, target, draft_q=None, draft_tokens=None):
  """An AR step at temperature 0 in the chain rules' signature: nothing
  accepted, the next token the argmax of target [B, 1, V] (ties to the
  lowest id). Returns (zeros [B] int32, next_token [B] int32)."""
  return jnp.zeros(target.shape[0], jnp.int32), jnp.argmax(target[:, 0], -1).astype(jnp.int32)


def ar_sample(key, target, draft_q=None, draft_tokens=None):
  """An AR step at T > 0 in the chain rules' signature: nothing accepted,
  the next token sampled from p_0 = target [B, 1, V] (warped
  probabilities) with ``key``. Returns (zeros [B] int32, next_token [B] int32)."""
  return jnp.zeros(target.shape[0], jnp.int32), sample(key, target[:, 0])


def chain_rule(params: SamplingParams, g: int):
  """The rule of a chain round at static draft length g (0 = AR step):
  ``rejection_sample``, ``greedy_chain``, ``ar_sample`` or ``ar_greedy``, each
  ``rule(key, target [B, g+1, V], draft_q [B, g, V], draft_tokens [B, g]) ->
  (num_accepted [B] int32, next_token [B] int32)`` (logits when greedy)."""
  if params.greedy:
    return greedy_chain if g else ar_greedy
  return rejection_sample if g else ar_sample

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
  """Temperature-0 verification of a tree: from the root, move to the first
  child whose token is the target argmax at the current node; next token the
  argmax at the last accepted node (ties to the lowest id).

  target_logits_or_probs [B, N+1, V] (root row 0, node i row 1+i),
  node_tokens [B, N] integer in BFS order, spec static. Returns (num_accepted
  [B] int32 in 0..m, next_token [B] int32, path [B, m] int32: accepted node
  at depth d in column d-1, arbitrary valid nodes after). Raises ValueError
  on shapes that do not match ``spec``.
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
  """Recursive rejection sampling of a tree whose children c_1..c_b were
  drawn from q without replacement (Jeon et al. 2024; (T1)-(T3) of
  docs/speculative_sampling.md). With r_1 = p, for i = 1..b: accept c_i
  with probability min(1, r_i(c_i) / q_i(c_i)) (T1), else r_{i+1} =
  norm(max(0, r_i - q_i)) (T2); all rejected: a token from r_{b+1}; at a
  leaf a bonus token from p. Children past q's support are skipped.

  target_probs [B, N+1, V] float, draft_probs [B, N_internal, V] float,
  node_tokens [B, N] integer (BFS, siblings in drawing order), spec static;
  one uniform draw [B, N + V]. Returns (num_accepted [B] int32 in 0..m,
  next_token [B] int32, path [B, m] int32). Raises ValueError on shapes that
  do not match ``spec``.
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
