"""Tests for the token-tree kernels of decode/sampling.py and decode/acceptance.py: drawing children
without replacement, recursive rejection sampling over a tree
(``tree_rejection_sample``) and greedy tree verification.

Statistical tests follow tests/test_sampling.py: chi-square goodness of fit
against exact laws computed in float64 by enumeration, fixed seeds,
significance level SIG = 1e-3 (bins with expected count < 5 merged; a count
in a bin of probability 0 is an exact failure). The world is a Markov
source over V = 5 tokens: the target's distribution after token x is P[x],
the drafter's Q[x], so the target's law of a continuation is a product of
rows and every node of a tree knows its p and q from its own token.

- One round: the law of the emitted sequence (accepted path + next token)
  equals the exact law of the algorithm (enumerating every ordered draw of
  children without replacement and every acceptance outcome).
- Losslessness: the first three tokens emitted over as many rounds as
  needed follow P[r](x1) P[x1](x2) P[x2](x3), the target's own law.
- Power: the same harness rejects plausible wrong rules (top-k children
  verified as if drawn; children drawn with replacement but verified as if
  drawn without).
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode import sampling, acceptance as verify
from decode.tree_spec import TreeSpec
from tests.test_sampling import SIG, _chisq_pvalue, _doc_numbers

V = 5
TREE = TreeSpec((3, 2))
_tree_rs = jax.jit(verify.tree_rejection_sample, static_argnums=4)
_tree_greedy = jax.jit(verify.tree_greedy_verify, static_argnums=2)
_rs = jax.jit(verify.rejection_sample)


def _world():
  """P [V, V], Q [V, V] float32 rows. Token 4 is never emitted by the target
  but proposed by the drafter; Q[0] has only 2 tokens in its support (so a
  third child of a token-0 node is invalid); Q[2] gives 0 to token 1, which
  the target likes (only the residual can emit it there)."""
  rng = np.random.default_rng(3)
  p = rng.dirichlet(np.full(V, 0.8), size=V)
  q = rng.dirichlet(np.full(V, 0.8), size=V)
  p[:, 4] = 0.0
  q[0] = [0.0, 0.7, 0.0, 0.3, 0.0]
  q[2, 1] = 0.0
  p = np.maximum(p, 0.02 * (p > 0))
  q = np.maximum(q, 0.02 * (q > 0))
  p /= p.sum(1, keepdims=True)
  q /= q.sum(1, keepdims=True)
  return p.astype(np.float32), q.astype(np.float32)


P, Q = _world()
ROOT = 2


# -- exact law of one round, by enumeration ---------------------------------------

def _ordered_draws(q, k):
  """{(c_1..c_j): prob} of k draws without replacement from q (j = min(k, support))."""
  support = [x for x in range(len(q)) if q[x] > 0]
  j = min(k, len(support))
  out = {}
  for tup in itertools.permutations(support, j):
    prob, left = 1.0, 1.0
    for c in tup:
      prob *= q[c] / left
      left -= q[c]
    out[tup] = prob
  return out


def exact_round_law(p_rows, q_rows, root, branching):
  """{emitted tuple: prob}, float64: one round of the tree rule from token
  ``root``, the children of a node with token x drawn without replacement
  from q_rows[x] (only min(b, support) of them are real, as in the kernel),
  the node's target row p_rows[x]."""
  p_rows = np.asarray(p_rows, np.float64)
  q_rows = np.asarray(q_rows, np.float64)
  p_rows /= p_rows.sum(1, keepdims=True)
  q_rows /= q_rows.sum(1, keepdims=True)
  m = len(branching)

  @functools.lru_cache(maxsize=None)
  def node(x, d):
    p = p_rows[x]
    if d == m:
      return {(y,): p[y] for y in range(V) if p[y] > 0}
    q = q_rows[x]
    out = defaultdict(float)
    for tup, prob in _ordered_draws(q, branching[d]).items():
      r, qrem, reach = p.copy(), q.copy(), prob
      for i, c in enumerate(tup):
        qi = q if i == 0 else qrem / qrem.sum()
        acc = 0.0 if r[c] == 0 else min(1.0, r[c] / qi[c])
        if acc > 0:
          for seq, pr in node(c, d + 1).items():
            out[(c,) + seq] += reach * acc * pr
        reach *= 1 - acc
        res = np.maximum(r - qi, 0)
        r = res / res.sum() if res.sum() > 0 else r
        qrem[c] = 0.0
      for y in range(V):
        if r[y] > 0:
          out[(y,)] += reach * r[y]
    return dict(out)

  return node(root, 0)


# -- drafting a tree in the Markov world (jitted, n independent rounds) ------------

def _draft_tree(key, roots, spec, p_rows, q_rows, drafting):
  """roots [n] int32 -> (node tokens [n, N], target rows [n, N+1, V], q rows
  [n, N_internal, V]). ``drafting``: "without" (the decoder's
  ``sample_without_replacement``), "topk" (WRONG: the b most likely tokens,
  deterministic) or "iid" (WRONG for this rule: i.i.d. with replacement)."""
  n = roots.shape[0]
  level, toks = roots[:, None], []
  keys = jax.random.split(key, spec.depth)
  for d, b in enumerate(spec.branching):
    q = q_rows[level]                                                   # [n, n_d, V]
    if drafting == "without":
      kids, _ = sampling.sample_without_replacement(q, sampling.uniform_open(keys[d], q.shape), b)
    elif drafting == "topk":
      kids = jax.lax.top_k(q, b)[1].astype(jnp.int32)
    else:
      kids = sampling.sample(keys[d], jnp.broadcast_to(q[:, :, None], q.shape[:2] + (b, V)))
    level = kids.reshape(n, -1)
    toks.append(level)
  toks = jnp.concatenate(toks, 1)
  block = jnp.concatenate([roots[:, None], toks], 1)
  return toks, p_rows[block], q_rows[block[:, :spec.num_internal]]


@functools.partial(jax.jit, static_argnames=("spec", "n", "drafting"))
def _one_round(key, p_rows, q_rows, root, *, spec, n, drafting="without"):
  k1, k2 = jax.random.split(key)
  roots = jnp.full((n,), root, jnp.int32)
  toks, p, q = _draft_tree(k1, roots, spec, p_rows, q_rows, drafting)
  a, nxt, path = verify.tree_rejection_sample(k2, p, q, toks, spec)
  return a, nxt, jnp.take_along_axis(toks, path, 1)


@functools.partial(jax.jit, static_argnames=("spec", "n", "num_tokens", "drafting"))
def _multi_round(key, p_rows, q_rows, root, *, spec, n, num_tokens, drafting="without"):
  """The first num_tokens tokens emitted by consecutive tree rounds from
  ``root`` (each round's root is the last emitted token), [n, num_tokens]."""
  m = spec.depth
  rows = jnp.arange(n)

  def one(carry, key_r):
    buf, length, last = carry
    k1, k2 = jax.random.split(key_r)
    toks, p, q = _draft_tree(k1, last, spec, p_rows, q_rows, drafting)
    a, nxt, path = verify.tree_rejection_sample(k2, p, q, toks, spec)
    path_tok = jnp.take_along_axis(toks, path, 1)
    for j in range(m + 1):
      t = jnp.where(j < a, path_tok[:, min(j, m - 1)], nxt)
      col = jnp.minimum(length + j, num_tokens)
      buf = buf.at[rows, col].set(jnp.where(j <= a, t, buf[rows, col]))
    return (buf, length + a + 1, nxt), None

  init = (jnp.zeros((n, num_tokens + 1), jnp.int32), jnp.zeros((n,), jnp.int32),
          jnp.full((n,), root, jnp.int32))
  (buf, _, _), _ = jax.lax.scan(one, init, jax.random.split(key, num_tokens))
  return buf[:, :num_tokens]


def _round_pvalue(spec, seed, n, drafting="without"):
  key = jax.random.key(seed, impl="rbg")
  a, nxt, path_tok = (np.asarray(x) for x in _one_round(key, P, Q, ROOT, spec=spec, n=n,
                                                        drafting=drafting))
  seqs = [tuple(path_tok[i, :a[i]]) + (nxt[i],) for i in range(n)]
  law = exact_round_law(P, Q, ROOT, spec.branching)
  keys = sorted(law)
  index = {s: i for i, s in enumerate(keys)}
  counts = np.zeros(len(keys) + 1)
  for s in seqs:
    counts[index.get(s, len(keys))] += 1
  probs = np.append([law[s] for s in keys], 0.0)
  return _chisq_pvalue(counts, probs), a


def _joint_pvalue(spec, seed, n, drafting="without"):
  toks = np.asarray(_multi_round(jax.random.key(seed, impl="rbg"), P, Q, ROOT, spec=spec, n=n,
                                 num_tokens=3, drafting=drafting))
  pp = P.astype(np.float64) / P.sum(1, keepdims=True)
  joint = pp[ROOT][:, None, None] * pp[:, :, None] * pp[None, :, :]
  flat = np.ravel_multi_index(tuple(toks.T), (V,) * 3)
  return _chisq_pvalue(np.bincount(flat, minlength=V**3), joint.ravel())


# -- tests ------------------------------------------------------------------------

def test_tree_spec_layout():
  s = TreeSpec((3, 2, 1))
  assert (s.depth, s.counts, s.num_nodes, s.num_internal) == (3, (1, 3, 6, 6), 15, 10)
  np.testing.assert_array_equal(s.depths, [1] * 3 + [2] * 6 + [3] * 6)
  np.testing.assert_array_equal(s.parents, [-1, -1, -1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8])
  assert s.ancestors[13].nonzero()[0].tolist() == [2, 7, 13]
  assert s.block_ancestors[0].nonzero()[0].tolist() == [0]
  assert s.block_ancestors[14].nonzero()[0].tolist() == [0, 3, 8, 14]
  for bad in ((), (0, 2), (2, -1), (1.5,)):
    with pytest.raises(ValueError, match="branching"):
      TreeSpec(bad)


def test_sample_without_replacement_law():
  """Ordered pairs from the Gumbel-top-k trick follow sequential sampling
  without replacement; a support of 2 < k = 3 marks the third draw invalid."""
  q = np.array([0.1, 0.5, 0.0, 0.25, 0.15], np.float32)
  n = 100_000
  u = sampling.uniform_open(jax.random.key(0, impl="rbg"), (n, V))
  toks, valid = jax.jit(sampling.sample_without_replacement, static_argnums=2)(
      jnp.broadcast_to(q, (n, V)), u, 2)
  toks = np.asarray(toks)
  assert np.asarray(valid).all() and (toks[:, 0] != toks[:, 1]).all()
  law = _ordered_draws(q.astype(np.float64) / q.sum(), 2)
  probs = np.zeros((V, V))
  for (a, b), pr in law.items():
    probs[a, b] = pr
  assert _chisq_pvalue(np.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V), probs.ravel()) > SIG
  toks, valid = sampling.sample_without_replacement(jnp.asarray([[0.0, 0.6, 0.0, 0.4, 0.0]]),
                                                    u[:1], 3)
  assert np.asarray(valid).tolist() == [[True, True, False]]
  assert set(np.asarray(toks)[0, :2].tolist()) == {1, 3}


@pytest.mark.parametrize("branching", [(3, 2), (2, 1, 2)])
def test_single_round_law_equals_enumeration(branching):
  """The emitted sequence of one round (accepted path + residual/bonus) has
  the exact law of the algorithm, invalid children (support 2 < b = 3)
  included; every path length occurs."""
  spec = TreeSpec(branching)
  pvalue, a = _round_pvalue(spec, 11, 150_000)
  assert pvalue > SIG, pvalue
  assert set(np.unique(a).tolist()) == set(range(spec.depth + 1))


@pytest.mark.parametrize("branching", [(3, 2), (1, 1)])
def test_emitted_tokens_follow_the_target_law(branching):
  """Losslessness: the first three emitted tokens ~ the target's joint law."""
  assert _joint_pvalue(TreeSpec(branching), 21, 150_000) > SIG


@pytest.mark.parametrize("drafting", ["topk", "iid"])
def test_harness_rejects_wrong_rules(drafting):
  """Power: top-k children verified as if drawn from q (the plausible T = 1
  bug), and children drawn i.i.d. but verified as if drawn without
  replacement, both change the emitted law, and the same harness (seed,
  sample size) rejects them."""
  assert _joint_pvalue(TREE, 21, 150_000, drafting=drafting) < SIG


def test_single_round_harness_rejects_top_k_children():
  """Power of the single-round harness: deterministic top-k children give
  another law of the emitted sequence."""
  pvalue, _ = _round_pvalue(TREE, 11, 150_000, drafting="topk")
  assert pvalue < SIG, pvalue


def test_chain_tree_equals_rejection_sample():
  """Branching (1, .., 1) is the chain: same key, same accepted count and
  next token as ``rejection_sample``."""
  rng = np.random.default_rng(4)
  n, g = 4096, 3
  spec = TreeSpec((1,) * g)
  p = rng.dirichlet(np.ones(V), size=(n, g + 1)).astype(np.float32)
  q = rng.dirichlet(np.ones(V), size=(n, g)).astype(np.float32)
  d = np.asarray(sampling.sample(jax.random.key(1), q))
  a1, n1 = _rs(jax.random.key(2), p, q, d)
  a2, n2, path = _tree_rs(jax.random.key(2), p, q, d, spec)
  np.testing.assert_array_equal(a1, a2)
  np.testing.assert_array_equal(n1, n2)
  np.testing.assert_array_equal(path, np.broadcast_to(np.arange(g), (n, g)))
  assert len(set(np.asarray(a1).tolist())) == g + 1


def test_greedy_tree_verify_hand_example():
  """Tree (2, 2): the path follows the child equal to the target argmax."""
  spec = TreeSpec((2, 2))
  # block rows: root, n0, n1, n2 (n0's kids: n2, n3), n3, n4, n5 (n1's kids)
  best = [1, 3, 0, 2, 4, 2, 1]
  logits = jax.nn.one_hot(jnp.asarray([best]), V) * 5.0
  cases = {  # node tokens -> (a, next, accepted path)
      (0, 1, 9, 9, 3, 0): (2, 1, [1, 5]),     # root argmax 1 = n1; n1 argmax 0 = n5 (2nd kid)
      (1, 0, 3, 2, 9, 9): (2, 2, [0, 2]),     # n0 = 1; n0 argmax 3 = n2; bonus argmax at n2
      (0, 2, 3, 2, 9, 9): (0, 1, [0, 2]),     # no child of the root matches: emit argmax 1
      (1, 0, 9, 9, 3, 0): (1, 3, [0, 2]),     # n0 accepted, none of its kids: argmax 3
  }
  for toks, (a_want, next_want, path_want) in cases.items():
    a, nxt, path = _tree_greedy(logits, jnp.asarray([toks], jnp.int32) % V, spec)
    assert (int(a[0]), int(nxt[0])) == (a_want, next_want), toks
    assert np.asarray(path)[0, :a_want].tolist() == path_want[:a_want], toks


def test_greedy_equals_rule_with_one_hot_target():
  """At temperature 0 (one-hot p) the stochastic rule, with any q giving
  the distinct children positive mass, is the greedy walk."""
  spec = TreeSpec((3, 2))
  rng = np.random.default_rng(5)
  n = 2048
  logits = rng.normal(size=(n, spec.num_nodes + 1, V)).astype(np.float32)
  best = logits.argmax(-1)
  q = rng.dirichlet(np.ones(V), size=(n, spec.num_internal)).astype(np.float32)
  kids = np.argsort(rng.random((n, spec.num_internal, V)), -1)           # distinct children
  toks = np.concatenate([kids[:, :1, :3].reshape(n, 3), kids[:, 1:4, :2].reshape(n, 6)], 1)
  # make acceptance frequent: often put the parent's argmax among its kids
  hit = rng.random((n, spec.num_internal)) < 0.7
  for j, (lo, b) in enumerate([(0, 3), (3, 2), (5, 2), (7, 2)]):
    slot = rng.integers(0, b, n)
    clash = (toks[:, lo:lo + b] == best[:, j, None]).any(1)
    toks[np.arange(n), lo + slot] = np.where(hit[:, j] & ~clash, best[:, j],
                                             toks[np.arange(n), lo + slot])
  p = np.asarray(jax.nn.one_hot(best, V))
  a_g, n_g, path_g = _tree_greedy(logits, toks, spec)
  a_r, n_r, path_r = _tree_rs(jax.random.key(0), p, q, toks, spec)
  np.testing.assert_array_equal(a_g, a_r)
  np.testing.assert_array_equal(n_g, n_r)
  assert len(set(np.asarray(a_g).tolist())) == 3


def test_tree_kernels_check_shapes():
  spec = TreeSpec((2, 1))
  p = jnp.ones((2, 5, V)) / V
  q = jnp.ones((2, 3, V)) / V
  toks = jnp.zeros((2, 4), jnp.int32)
  _tree_rs(jax.random.key(0), p, q, toks, spec)
  with pytest.raises(ValueError, match="N\\+1"):
    _tree_greedy(p[:, :4], toks, spec)
  with pytest.raises(ValueError, match="node_tokens"):
    _tree_greedy(p, toks[:, :3], spec)
  with pytest.raises(ValueError, match="draft_probs"):
    _tree_rs(jax.random.key(0), p, q[:, :2], toks, spec)


# -- the example in docs/speculative_sampling.md ("Token trees") --------------------

def _accept_prob(p, q, b, without_replacement):
  """Exact P(some child accepted) at one node, b children (Fractions)."""
  def residual(r, qi):
    raw = [max(Fraction(0), x - y) for x, y in zip(r, qi)]
    return [x / sum(raw) for x in raw]
  if not without_replacement:                 # SpecInfer: i.i.d. children, q_i = q
    total, reach, r = Fraction(0), Fraction(1), list(p)
    for _ in range(b):
      a = sum(min(x, y) for x, y in zip(r, q))
      total, reach = total + reach * a, reach * (1 - a)
      if reach == 0:
        break
      r = residual(r, q)
    return total
  total = Fraction(0)
  support = [x for x in range(len(q)) if q[x] > 0]
  for tup in itertools.permutations(support, min(b, len(support))):
    prob, left = Fraction(1), Fraction(1)
    for c in tup:
      prob, left = prob * q[c] / left, left - q[c]
    r, qrem, reach = list(p), list(q), Fraction(1)
    for c in tup:
      qi = [x / sum(qrem) for x in qrem]
      a = min(Fraction(1), r[c] / qi[c]) if r[c] > 0 else Fraction(0)
      total, reach = total + prob * reach * a, reach * (1 - a)
      if reach == 0:
        break
      r, qrem[c] = residual(r, qi), Fraction(0)
  return total


def test_doc_tree_example_numbers():
  got = _doc_numbers("tree-example")
  p = [Fraction(2, 5), Fraction(7, 20), Fraction(1, 4)]        # the worked example's p, q
  q = [Fraction(1, 5), Fraction(1, 5), Fraction(3, 5)]
  assert got["accept without replacement"] == [_accept_prob(p, q, b, True) for b in (1, 2, 3)]
  assert got["accept iid (SpecInfer)"] == [_accept_prob(p, q, b, False) for b in (1, 2, 3)]
  # and the kernel agrees: one node, two children drawn without replacement
  spec = TreeSpec((2,))
  n = 100_000
  pf, qf = np.array([float(x) for x in p], np.float32), np.array([float(x) for x in q], np.float32)
  k1, k2 = jax.random.split(jax.random.key(5, impl="rbg"))
  kids, _ = sampling.sample_without_replacement(jnp.broadcast_to(qf, (n, 3)),
                                                sampling.uniform_open(k1, (n, 3)), 2)
  a, _, _ = _tree_rs(k2, jnp.broadcast_to(pf, (n, 3, 3)), jnp.broadcast_to(qf, (n, 1, 3)), kids,
                     spec)
  accepted = int(np.asarray(a).sum())
  assert _chisq_pvalue([accepted, n - accepted], [39 / 40, 1 / 40]) > SIG
