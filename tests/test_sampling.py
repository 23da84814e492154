"""Tests for decode/sampling.py and decode/acceptance.py: warping and the speculative acceptance rule.

Statistical tests: chi-square goodness of fit (scipy.stats.chisquare) against
exact laws computed in float64 from the same float32 p and q the kernel sees,
with fixed seeds and significance level SIG = 1e-3: a correct implementation
passes deterministically (the seeds are fixed), and the same harness rejects
deliberately wrong rules (``test_harness_rejects_wrong_rule``), which shows
the tests have power. Bins with expected count < 5 are merged; a count in a
bin of probability exactly 0 is an exact failure (p-value 0).

Each kernel is jitted once per shape through the module-level wrappers below,
and many independent trials run as one batch (large B) instead of a Python
loop.
"""

from __future__ import annotations

import functools
import pathlib
import re
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from decode import sampling, acceptance as verify

SIG = 1e-3  # significance level of every chi-square test
DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "speculative_sampling.md"



def _stat_key(seed):
  """Key for the large statistical harnesses. The kernels accept any typed
  key; the "rbg" implementation (XLA RngBitGenerator) compiles 2-4x faster
  than the default threefry on CPU, which dominates this file's runtime. The
  direct kernel tests below use default (threefry) keys."""
  return jax.random.key(seed, impl="rbg")


_warp = jax.jit(sampling.warp_logits)
_warp_grid = jax.jit(jax.vmap(sampling.warp_logits, in_axes=(None, 0, 0, 0)))
_probs = jax.jit(sampling.probs_from_logits)
_sample = jax.jit(sampling.sample)
_rejection = jax.jit(verify.rejection_sample)
_greedy = jax.jit(verify.greedy_verify)


# ---------------------------------------------------------------------------
# Helpers: exact laws, chi-square, batched trial runners.


def _chisq_pvalue(counts, probs, min_expected=5.0):
  """Chi-square p-value of ``counts`` against ``probs``.

  Any count in a bin of probability exactly 0 is impossible under ``probs``:
  the p-value is then 0.0 (a certain rejection, not a statistical one).
  """
  counts = np.asarray(counts, np.float64).ravel()
  probs = np.asarray(probs, np.float64).ravel()
  zero = probs <= 0
  if counts[zero].sum() > 0:
    return 0.0
  counts, probs = counts[~zero], probs[~zero] / probs[~zero].sum()
  n = counts.sum()
  assert n > 0
  expected = n * probs
  small = expected < min_expected
  if small.any():
    counts = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] < min_expected and len(expected) > 2:  # fold into the smallest big bin
      i = int(np.argmin(expected[:-1]))
      counts[i] += counts[-1]
      expected[i] += expected[-1]
      counts, expected = counts[:-1], expected[:-1]
  if len(counts) < 2:
    return 1.0
  return float(stats.chisquare(counts, expected).pvalue)


def _exact_laws(p, q):
  """float64 exact laws for p [G+1, V], q [G, V] (one round, fixed rows).

  Returns (alphas [G], accepted-length law [G+1], stop rows [G+1, V]) where
  stop row j < G is the residual norm(max(0, p_j - q_{j+1})) (p_j if that is
  all zero) and stop row G is p_G.
  """
  p = np.asarray(p, np.float64)
  q = np.asarray(q, np.float64)
  p = p / p.sum(-1, keepdims=True)
  q = q / q.sum(-1, keepdims=True)
  g = q.shape[0]
  alphas = np.minimum(p[:g], q).sum(-1)
  law = np.array([np.prod(alphas[:k]) * (1 - alphas[k]) for k in range(g)] + [np.prod(alphas)])
  rows = []
  for j in range(g):
    r = np.maximum(p[j] - q[j], 0.0)
    rows.append(r / r.sum() if r.sum() > 0 else p[j])
  rows.append(p[g])
  return alphas, law, np.stack(rows)


def _dirichlet_rows(rng, rows, vocab, conc=1.0):
  """float32 probability rows [rows, V], strictly positive, summing to ~1."""
  x = rng.dirichlet(np.full(vocab, conc), size=rows).astype(np.float32)
  x = np.maximum(x, 1e-3).astype(np.float32)
  return (x / x.sum(-1, keepdims=True)).astype(np.float32)


@functools.partial(jax.jit, static_argnames=("rule", "n"))
def _one_round(key, p, q, *, rule, n):
  """n independent rounds with fixed rows p [G+1, V], q [G, V], drafts ~ q.

  Returns (drafts [n, G], num_accepted [n], next_token [n]).
  """
  k_draft, k_rule = jax.random.split(key)
  pb = jnp.broadcast_to(p, (n,) + p.shape)
  qb = jnp.broadcast_to(q, (n,) + q.shape)
  drafts = sampling.sample(k_draft, qb)
  num_accepted, next_token = rule(k_rule, pb, qb, drafts)
  return drafts, num_accepted, next_token


@functools.partial(jax.jit, static_argnames=("rule", "n", "g", "num_tokens"))
def _multi_round(key, p_pos, q_pos, *, rule, n, g, num_tokens):
  """Decodes num_tokens tokens by speculative rounds, n sequences at once.

  The target's distribution at absolute position s is p_pos[s] and the
  drafter's is q_pos[s], whatever the prefix (so the target's joint law of the
  first tokens is the product p_pos[0] x p_pos[1] x ...). A round starting at
  position s drafts d_1..d_G ~ q_pos[s..s+G-1], verifies against
  p_pos[s..s+G] and emits a+1 tokens. p_pos, q_pos: [num_tokens + g + 1, V].

  Returns [n, num_tokens] int32: the first num_tokens emitted tokens.
  """
  rows = jnp.arange(n)
  width = num_tokens + g + 1

  def one_round(carry, key_r):  # each round emits >= 1 token: num_tokens rounds suffice
    buf, start = carry
    k_draft, k_rule = jax.random.split(key_r)
    s = jnp.minimum(start, num_tokens)  # rows already done keep running harmlessly
    tgt = p_pos[s[:, None] + jnp.arange(g + 1)]  # [n, G+1, V]
    qq = q_pos[s[:, None] + jnp.arange(g)]  # [n, G, V]
    drafts = sampling.sample(k_draft, qq)
    a, nxt = rule(k_rule, tgt, qq, drafts)
    for j in range(g + 1):
      tok = jnp.where(j < a, drafts[:, j], nxt) if j < g else nxt
      col = s + j
      buf = buf.at[rows, col].set(jnp.where(j <= a, tok, buf[rows, col]))
    return (buf, start + a + 1), None

  init = (jnp.zeros((n, width), jnp.int32), jnp.zeros((n,), jnp.int32))
  (buf, _), _ = jax.lax.scan(one_round, init, jax.random.split(key, num_tokens))
  return buf[:, :num_tokens]


def _round_pvalues(rule, p, q, seed, n):
  """p-values of every single-round law for ``rule`` on fixed rows p, q."""
  g = q.shape[0]
  drafts, a, nxt = (np.asarray(x) for x in _one_round(_stat_key(seed), p, q, rule=rule, n=n))
  assert a.min() >= 0 and a.max() <= g
  _, law, stop_rows = _exact_laws(p, q)
  out = {}
  first = np.where(a > 0, drafts[:, 0], nxt)
  out["first_token~p0"] = _chisq_pvalue(np.bincount(first, minlength=p.shape[1]), p[0])
  out["accepted_length"] = _chisq_pvalue(np.bincount(a, minlength=g + 1), law)
  for j in range(g + 1):
    sel = nxt[a == j]
    if len(sel) >= 50:
      name = "bonus~p_G" if j == g else f"residual_{j}"
      out[name] = _chisq_pvalue(np.bincount(sel, minlength=p.shape[1]), stop_rows[j])
  return out


def _joint_pvalue(rule, p_pos, q_pos, seed, n, g, num_tokens):
  """p-value of the first num_tokens emitted tokens against prod_s p_pos[s]."""
  vocab = p_pos.shape[1]
  toks = _multi_round(_stat_key(seed), p_pos, q_pos, rule=rule, n=n, g=g, num_tokens=num_tokens)
  toks = np.asarray(toks)
  flat = np.ravel_multi_index(tuple(toks.T), (vocab,) * num_tokens)
  pp = np.asarray(p_pos, np.float64)
  joint = functools.reduce(np.multiply.outer, [pp[s] / pp[s].sum() for s in range(num_tokens)])
  return _chisq_pvalue(np.bincount(flat, minlength=vocab**num_tokens), joint.ravel())


# Fixed test distributions (float32, as the kernel sees them).

V = 10


def _case_g3():
  """p [4, V], q [3, V] Dirichlet, with token V-1 masked in both (padding),
  token 0 impossible for the target but likely for the drafter, and token 1
  impossible for the drafter but possible for the target."""
  rng = np.random.default_rng(7)
  p = _dirichlet_rows(rng, 4, V)
  q = _dirichlet_rows(rng, 3, V)
  p[:, V - 1] = 0.0
  q[:, V - 1] = 0.0
  p[:, 0] = 0.0
  q[:, 0] = 0.3
  q[:, 1] = 0.0
  p /= p.sum(-1, keepdims=True)
  q /= q.sum(-1, keepdims=True)
  return p.astype(np.float32), q.astype(np.float32)


P3, Q3 = _case_g3()
_HAND_P1 = np.array(
  [[0.5, 0.2, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.2, 0.2]], np.float32
)
_HAND_Q1 = np.array([[0.1, 0.1, 0.3, 0.3, 0.05, 0.05, 0.1, 0.0]], np.float32)


# ---------------------------------------------------------------------------
# Deliberately wrong rules (test-only), same signature as rejection_sample.


def _wrong_argmax_rule(key, target_probs, draft_probs, draft_tokens):
  """WRONG: accept iff d_j == argmax p_{j-1}; at the stop row sample from p."""
  del draft_probs
  g = draft_tokens.shape[1]
  best = jnp.argmax(target_probs, -1)
  ok = draft_tokens == best[:, :g]
  a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), 1), 1)
  row = jnp.take_along_axis(target_probs, a[:, None, None], 1)[:, 0]
  return a.astype(jnp.int32), sampling.sample(key, row)


def _wrong_residual_is_p(key, target_probs, draft_probs, draft_tokens):
  """WRONG: correct acceptance, but a rejection resamples from p, not the residual."""
  k1, k2 = jax.random.split(key)
  pd = jnp.take_along_axis(target_probs[:, :-1], draft_tokens[..., None], -1)[..., 0]
  qd = jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0]
  ok = jax.random.uniform(k1, pd.shape) < pd / qd
  a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), 1), 1)
  row = jnp.take_along_axis(target_probs, a[:, None, None], 1)[:, 0]
  return a.astype(jnp.int32), sampling.sample(k2, row)


def _wrong_off_by_one(key, target_probs, draft_probs, draft_tokens):
  """WRONG: verifies d_j against p_j instead of p_{j-1} (shifted target rows)."""
  shifted = jnp.concatenate([target_probs[:, 1:], target_probs[:, -1:]], axis=1)
  return verify.rejection_sample(key, shifted, draft_probs, draft_tokens)


# ---------------------------------------------------------------------------
# warp_logits / probs_from_logits / sample.


def _support(logits):
  return set(np.nonzero(np.isfinite(np.asarray(logits)))[0].tolist())


def test_temperature_scaling():
  x = jnp.array([1.0, -2.0, 0.5, 3.0, 0.0, -jnp.inf, 2.5, -1.0])
  for t in (0.25, 0.5, 1.0, 2.0, 7.0):
    got = np.asarray(_probs(_warp(x, t, 0, 1.0)))
    want = np.asarray(jax.nn.softmax(x / t))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
  # Any float input dtype; float32 out.
  w = _warp(x.astype(jnp.bfloat16), 0.5, 3, 0.9)
  assert w.dtype == jnp.float32 and _probs(w).dtype == jnp.float32
  # A tiny temperature does not overflow: near one-hot, no NaN.
  got = np.asarray(_probs(_warp(x, 1e-6, 0, 1.0)))
  assert np.all(np.isfinite(got)) and got[3] == 1.0


def test_top_k_exact_set():
  x = jnp.array([1.0, 3.0, 2.0, 3.0, 0.0, -jnp.inf, 2.0, -1.0])
  assert _support(_warp(x, 1.0, 1, 1.0)) == {1}  # tie 1 vs 3: lowest index
  assert _support(_warp(x, 1.0, 2, 1.0)) == {1, 3}
  assert _support(_warp(x, 1.0, 3, 1.0)) == {1, 3, 2}  # tie 2 vs 6: lowest index
  assert _support(_warp(x, 1.0, 4, 1.0)) == {1, 3, 2, 6}
  assert _support(_warp(x, 1.0, 7, 1.0)) == {0, 1, 2, 3, 4, 6, 7}  # -inf never enters
  assert _support(_warp(x, 1.0, 100, 1.0)) == {0, 1, 2, 3, 4, 6, 7}
  assert _support(_warp(x, 1.0, 0, 1.0)) == {0, 1, 2, 3, 4, 6, 7}
  # Survivors keep their temperature-scaled logits (renormalised softmax).
  got = np.asarray(_probs(_warp(x, 2.0, 2, 1.0)))
  np.testing.assert_allclose(got[[1, 3]], [0.5, 0.5], rtol=1e-6)


def test_top_p_exact_set():
  # probs by index: 0.1, 0.4, 0.2, 0.3, 0 (masked); sorted 0.4(1) 0.3(3) 0.2(2) 0.1(0).
  # Cumulative: 0.4, 0.7, 0.9, 1.0.
  x = jnp.log(jnp.array([0.1, 0.4, 0.2, 0.3, 0.0]))
  assert _support(_warp(x, 1.0, 0, 0.3)) == {1}
  assert _support(_warp(x, 1.0, 0, 0.65)) == {1, 3}
  assert _support(_warp(x, 1.0, 0, 0.75)) == {1, 3, 2}
  assert _support(_warp(x, 1.0, 0, 0.95)) == {0, 1, 2, 3}
  assert _support(_warp(x, 1.0, 0, 1.0)) == {0, 1, 2, 3}
  got = np.asarray(_probs(_warp(x, 1.0, 0, 0.75)))
  np.testing.assert_allclose(got[[1, 3, 2]], [4 / 9, 3 / 9, 2 / 9], rtol=1e-5)
  # Top-p is over the top-k-filtered distribution: top-2 renormalises to
  # 0.4/0.7 = 0.571, 0.3/0.7 = 0.429, so top_p 0.5 keeps one token, 0.6 two.
  assert _support(_warp(x, 1.0, 2, 0.5)) == {1}
  assert _support(_warp(x, 1.0, 2, 0.6)) == {1, 3}
  # ... and over the temperature-scaled one: at T = 2 the probs are
  # proportional to sqrt(p): 0.325, 0.282, 0.230, 0.163, so 0.35 needs two.
  assert _support(_warp(x, 2.0, 0, 0.35)) == {1, 3}
  assert _support(_warp(x, 1.0, 0, 0.35)) == {1}
  # Ties are broken by the lowest index, deterministically: sorted
  # 0.3(2) 0.3(5) 0.2(0) 0.2(3) 0(1, masked) 0(4, masked).
  y = jnp.log(jnp.array([0.2, 0.0, 0.3, 0.2, 0.0, 0.3]))
  assert _support(_warp(y, 1.0, 0, 0.25)) == {2}
  assert _support(_warp(y, 1.0, 0, 0.5)) == {2, 5}
  assert _support(_warp(y, 1.0, 0, 0.7)) == {2, 5, 0}
  assert _support(_warp(y, 1.0, 0, 0.85)) == {2, 5, 0, 3}


def _reference_kept(z, k, top_p):
  """float64 numpy reference of the top-k / top-p kept set of one row z [V]
  (ranks by decreasing z, ties to the lowest index), and the distance of the
  nearest rank's preceding mass to top_p (a float32 result may differ from
  float64 within rounding of that boundary)."""
  z = np.asarray(z, np.float64)
  order = np.lexsort((np.arange(z.size), -z))
  keep = np.isfinite(z[order])
  if k > 0:
    keep &= np.arange(z.size) < k
  w = np.where(keep, np.exp(z[order] - z[order][0]), 0.0)
  w /= w.sum()
  before = np.concatenate([[0.0], np.cumsum(w)[:-1]])
  margin = np.inf
  if top_p < 1.0:
    margin = float(np.min(np.abs(before[keep] - top_p)))
    keep &= (before < top_p) | (np.arange(z.size) == 0)
  kept = np.zeros(z.size, bool)
  kept[order[keep]] = True
  return kept, margin


_filter = jax.jit(sampling._top_k_top_p, static_argnames="candidates")


def test_top_candidates_agree_with_the_full_sort():
  """Every path of the ranked warp (``candidates`` = (8, 16) over 64 ids: 8
  ranks and the rest dropped, 16 ranks, the full sort) gives the kept sets of
  the float64 reference, identical to a full sort's, whatever the other rows
  of the batch are (each row alone, and batches that take each path)."""
  rng = np.random.default_rng(7)
  vocab, cand = 64, (8, 16)
  peaked = rng.normal(size=(4, vocab)) * 6           # nucleus inside 8 ranks
  middle = rng.normal(size=(4, vocab)) * 1.6         # some nuclei between 8 and 16 ranks
  flat = rng.normal(size=(4, vocab)) * 0.3           # nucleus past 16 ranks
  tied = rng.integers(0, 4, size=(4, vocab)) * 2.0   # ties across the boundaries
  x = np.concatenate([peaked, middle, flat, tied]).astype(np.float32)
  x[rng.random(x.shape) < 0.1] = -np.inf
  x[:, 0] = np.maximum(x[:, 0], -1.0)
  z = x - x.max(-1, keepdims=True)
  batches = {"all": np.arange(len(z)), "fit 8": np.arange(4), "fit 16": np.arange(8)}
  compared, tiers_seen = 0, set()
  for k in (0, 1, 5, 8, 9, 16, 17, 40):
    for top_p in (0.2, 0.7, 0.95, 1.0):
      args = (jnp.int32(k), jnp.float32(top_p))
      got = np.isfinite(np.asarray(_filter(jnp.asarray(z), *args, candidates=cand)))
      full = np.isfinite(np.asarray(_filter(jnp.asarray(z), *args, candidates=vocab)))
      np.testing.assert_array_equal(got, full, err_msg=f"k={k} top_p={top_p}")
      one_tier = np.isfinite(np.asarray(_filter(jnp.asarray(z), *args, candidates=8)))
      np.testing.assert_array_equal(one_tier, full, err_msg=f"one tier k={k} top_p={top_p}")
      for name, rows in batches.items():
        part = np.isfinite(np.asarray(_filter(jnp.asarray(z[rows]), *args, candidates=cand)))
        np.testing.assert_array_equal(part, got[rows], err_msg=f"{name} k={k} top_p={top_p}")
      for r in range(z.shape[0]):
        alone = np.isfinite(np.asarray(_filter(jnp.asarray(z[r:r + 1]), *args, candidates=cand)))[0]
        np.testing.assert_array_equal(alone, got[r], err_msg=f"row {r} k={k} top_p={top_p}")
        want, margin = _reference_kept(z[r], k, top_p)
        if margin > 1e-5:
          np.testing.assert_array_equal(got[r], want, err_msg=f"row {r} k={k} top_p={top_p}")
          compared += 1
          if 0 < top_p < 1 and k == 0:
            tiers_seen.add(min(t for t in (8, 16, vocab) if want.sum() <= t))
  assert compared > 450   # of 512: only rows whose boundary sits within rounding are skipped
  assert tiers_seen == {8, 16, vocab}      # the rows reach every path on their own


def test_temperature_zero_is_one_hot():
  x = jnp.array([[1.0, 3.0, 2.0, 3.0], [-jnp.inf, 0.5, 0.5, -jnp.inf], [-jnp.inf, -5.0, -jnp.inf, -7.0]])
  for k, top_p in ((0, 1.0), (1, 1.0), (3, 0.2), (0, 0.01)):
    probs = np.asarray(_probs(_warp(x, 0.0, k, top_p)))
    np.testing.assert_array_equal(probs, np.eye(4, dtype=np.float32)[[1, 1, 1]])
  rng = np.random.default_rng(0)
  y = rng.normal(size=(64, 12)).astype(np.float32)
  y[rng.random(y.shape) < 0.3] = -np.inf
  y[:, 5] = 0.0  # every row keeps a finite entry
  probs = np.asarray(_probs(_warp(y, 0.0, 0, 1.0)))
  np.testing.assert_array_equal(probs, np.eye(12, dtype=np.float32)[np.argmax(y, -1)])


def test_masked_tokens_never_get_probability():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(6, 12)).astype(np.float32) * 2
  x[:, [0, 7, 11]] = -np.inf  # padding, including index 0 (greedy tie target)
  x[1, :] = np.where(np.isfinite(x[1]), 4.0, -np.inf)  # all finite tied
  x[2, 1:] = -np.inf
  x[2, 3] = -1.0  # a single finite entry
  x[3, 5] = 1e30  # a huge logit next to -inf
  temps = [0.0, 0.3, 1.0, 5.0]
  ks = [0, 1, 3, 12]
  ps = [0.05, 0.5, 0.9, 1.0]
  grid = np.array([(t, k, p) for t in temps for k in ks for p in ps], np.float64)
  warped = _warp_grid(
    jnp.asarray(x),
    jnp.asarray(grid[:, 0], jnp.float32),
    jnp.asarray(grid[:, 1], jnp.int32),
    jnp.asarray(grid[:, 2], jnp.float32),
  )
  probs = np.asarray(_probs(warped))  # [settings, 6, 12]
  assert np.all(np.isfinite(probs))
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
  masked = ~np.isfinite(x)
  assert np.all(probs[:, masked] == 0.0)
  assert np.all(np.isneginf(np.asarray(warped)[:, masked]))
  draws = np.asarray(_sample(jax.random.key(3), jnp.broadcast_to(probs, (200,) + probs.shape)))
  assert not masked[np.arange(6)[None, None, :], draws].any()


def _counting_jit(fn):
  """(jitted fn, list that grows by one per trace) to assert single compiles."""
  traces = []

  def traced(*args):
    traces.append(None)
    return fn(*args)

  return jax.jit(traced), traces


def test_traced_parameters_match_python_scalars_and_compile_once():
  warp_jit, traces = _counting_jit(sampling.warp_logits)
  rng = np.random.default_rng(2)
  x = rng.normal(size=(5, 16)).astype(np.float32)
  x[:, 3] = -np.inf
  settings = [
    (1.0, 0, 1.0), (0.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
    (0.5, 4, 0.6), (2.0, 16, 0.99), (1.0, 1, 0.3), (0.0, 3, 0.5),
  ]  # fmt: skip
  for t, k, p in settings:
    got = warp_jit(jnp.asarray(x), jnp.float32(t), jnp.int32(k), jnp.float32(p))
    want = sampling.warp_logits(x, t, k, p)  # Python scalars, eager
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(np.asarray(_probs(got)), np.asarray(_probs(want)), rtol=1e-6, atol=1e-7)
  assert len(traces) == 1


def test_warp_rejects_bad_python_parameters():
  x = jnp.zeros((4,))
  for bad in ((-1.0, 0, 1.0), (1.0, -1, 1.0), (1.0, 1.5, 1.0), (1.0, 0, 0.0), (1.0, 0, 1.5)):
    with pytest.raises(ValueError):
      sampling.warp_logits(x, *bad)


def test_sample_follows_probs_and_never_picks_zero():
  probs = np.array([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0, 0.0], np.float32)
  draws = np.asarray(_sample(jax.random.key(11), jnp.broadcast_to(probs, (100_000, 8))))
  assert draws.dtype == np.int32 and draws.shape == (100_000,)
  assert _chisq_pvalue(np.bincount(draws, minlength=8), probs) > SIG
  assert np.asarray(_sample(jax.random.key(0), jnp.ones((2, 3, 5)) / 5)).shape == (2, 3)


# ---------------------------------------------------------------------------
# rejection_sample: exact laws.


@pytest.mark.parametrize(
  "p,q,seed,n",
  [(_HAND_P1, _HAND_Q1, 101, 100_000), (P3, Q3, 103, 100_000)],
  ids=["G1_hand", "G3_dirichlet"],
)
def test_single_round_laws(p, q, seed, n):
  """First token ~ p_0; accepted-length law; residual at each stop; bonus ~ p_G."""
  pvals = _round_pvalues(verify.rejection_sample, p, q, seed, n)
  g = q.shape[0]
  expected_keys = {"first_token~p0", "accepted_length", "bonus~p_G"} | {f"residual_{j}" for j in range(g)}
  assert set(pvals) == expected_keys, pvals  # every stop row had enough samples
  assert min(pvals.values()) > SIG, pvals


def _joint_case():
  """G = 2, V = 8 position-indexed rows p_pos, q_pos [6, V]; token 7 is
  padding for the target (p = 0) but not for the drafter."""
  rng = np.random.default_rng(5)
  p_pos = _dirichlet_rows(rng, 6, 8, conc=2.0)
  q_pos = _dirichlet_rows(rng, 6, 8, conc=2.0)
  p_pos[:, 7] = 0.0
  p_pos /= p_pos.sum(-1, keepdims=True)
  return p_pos, q_pos


def test_joint_law_of_emitted_tokens():
  """G = 2: the first three emitted tokens (over as many rounds as needed) are
  distributed as p_0 x p_1 x p_2, the target's own joint law."""
  p_pos, q_pos = _joint_case()
  assert _joint_pvalue(verify.rejection_sample, p_pos, q_pos, 211, 150_000, 2, 3) > SIG


@pytest.mark.parametrize("wrong_rule", [_wrong_argmax_rule, _wrong_residual_is_p, _wrong_off_by_one])
def test_harness_rejects_wrong_rule(wrong_rule):
  """Power: the very same harness and seeds reject deliberately wrong rules."""
  pvals = _round_pvalues(wrong_rule, P3, Q3, 103, 100_000)
  assert min(pvals.values()) < SIG, pvals


@pytest.mark.parametrize("wrong_rule", [_wrong_residual_is_p, _wrong_off_by_one])
def test_harness_rejects_wrong_rule_joint(wrong_rule):
  p_pos, q_pos = _joint_case()
  assert _joint_pvalue(wrong_rule, p_pos, q_pos, 211, 150_000, 2, 3) < SIG


# ---------------------------------------------------------------------------
# rejection_sample: exact edge cases.


def test_p_equals_q_accepts_everything():
  rng = np.random.default_rng(8)
  b, g = 4096, 4
  p = _dirichlet_rows(rng, b * (g + 1), 12).reshape(b, g + 1, 12)
  p[:, :, 11] = 0.0  # padding in both
  q = p[:, :g]
  drafts = _sample(jax.random.key(1), q)
  a, nxt = _rejection(jax.random.key(2), p, q, drafts)
  assert np.all(np.asarray(a) == g)
  assert np.all(np.asarray(nxt) != 11)


def test_zero_target_probability_never_accepted_or_emitted():
  b, g, vocab = 20_000, 3, 8
  p = np.full((b, g + 1, vocab), 1.0 / 6, np.float32)
  p[:, :, [2, 5]] = 0.0  # target never emits 2 or 5
  q = np.full((b, g, vocab), 1.0 / 8, np.float32)
  q[:, :, 2] = 0.4  # the drafter likes token 2, which the target never emits
  q[:, :, 5] = 0.0  # token 5 has q = 0: only an adversarial drafter passes it
  q /= q.sum(-1, keepdims=True)  # other tokens: q = 0.109 < p = 1/6
  rng = np.random.default_rng(9)
  drafts = rng.integers(0, vocab, size=(b, g)).astype(np.int32)
  a, nxt = (np.asarray(x) for x in _rejection(jax.random.key(4), p, q, drafts))
  bad = np.isin(drafts, [2, 5])
  first_bad = np.where(bad.any(1), np.argmax(bad, 1), g)
  # 2 and 5 are never accepted; every other draft has p/q > 1, so it is.
  np.testing.assert_array_equal(a, first_bad)
  assert not np.isin(nxt, [2, 5]).any()  # never emitted


def test_adversarial_zero_draft_probability():
  # q(d) = 0 < p(d): accepted (ratio taken as +inf; documented).
  p = jnp.array([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
  q = jnp.array([[[0.0, 1.0, 0.0]]])
  tile = lambda x, n: np.tile(np.asarray(x), (n, 1, 1))  # noqa: E731
  a, _ = _rejection(jax.random.key(0), tile(p, 512), tile(q, 512), np.zeros((512, 1), np.int32))
  assert np.all(np.asarray(a) == 1)
  # q(d) = 0 = p(d) on a row where p == q: rejected, and the residual
  # max(0, p - q) is all zero, so the fallback samples from p itself.
  p = np.array([[[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]], np.float32)
  q = np.array([[[0.5, 0.5, 0.0, 0.0]]], np.float32)
  n = 20_000
  a, nxt = _rejection(jax.random.key(5), tile(p, n), tile(q, n), np.full((n, 1), 2, np.int32))
  a, nxt = np.asarray(a), np.asarray(nxt)
  assert np.all(a == 0)
  assert _chisq_pvalue(np.bincount(nxt, minlength=4), p[0, 0]) > SIG
  # Out-of-range draft ids are rejected.
  p = np.tile(np.full((1, 2, 4), 0.25, np.float32), (4, 1, 1))
  q = p[:, :1]
  a, nxt = _rejection(jax.random.key(6), p, q, jnp.array([[-1], [4], [100], [3]], jnp.int32))
  np.testing.assert_array_equal(np.asarray(a), [0, 0, 0, 1])


def test_rejection_sample_shapes_dtypes_and_single_compile():
  rs_jit, traces = _counting_jit(verify.rejection_sample)
  rng = np.random.default_rng(10)
  for seed in range(3):
    p = _dirichlet_rows(rng, 5 * 4, 9).reshape(5, 4, 9)
    q = _dirichlet_rows(rng, 5 * 3, 9).reshape(5, 3, 9)
    d = rng.integers(0, 9, size=(5, 3)).astype(np.int32)
    a, nxt = rs_jit(jax.random.key(seed), p, q, d)
    assert a.shape == (5,) and nxt.shape == (5,)
    assert a.dtype == jnp.int32 and nxt.dtype == jnp.int32
  assert len(traces) == 1
  # G = 0 degenerates to sampling from p_0.
  a, nxt = verify.rejection_sample(jax.random.key(0), p[:, :1], q[:, :0], d[:, :0])
  assert np.all(np.asarray(a) == 0)
  with pytest.raises(ValueError):
    verify.rejection_sample(jax.random.key(0), p, q[:, :2], d)
  with pytest.raises(ValueError):
    verify.rejection_sample(jax.random.key(0), p, q, d[:, :2])
  with pytest.raises(ValueError):
    verify.rejection_sample(jax.random.key(0), p[0], q, d)
  with pytest.raises(ValueError):
    verify.greedy_verify(p, d.astype(np.float32))


# ---------------------------------------------------------------------------
# greedy_verify.


def test_greedy_verify_hand_examples():
  # Row argmaxes: [2, 0, 1] (row 1 has a tie 0/3 -> 0; -inf never chosen).
  logits = jnp.array([[[0.0, 1.0, 5.0, 2.0], [4.0, -jnp.inf, 1.0, 4.0], [-jnp.inf, 3.0, 0.0, 2.0]]])
  cases = {(2, 0): (2, 1), (2, 3): (1, 0), (0, 0): (0, 2), (1, 0): (0, 2)}
  for drafts, (a_want, next_want) in cases.items():
    a, nxt = _greedy(logits, jnp.array([drafts], jnp.int32))
    assert (int(a[0]), int(nxt[0])) == (a_want, next_want), drafts
  # Probabilities work as well as logits.
  a, nxt = _greedy(jax.nn.softmax(logits), jnp.array([[2, 0]], jnp.int32))
  assert (int(a[0]), int(nxt[0])) == (2, 1)


def test_greedy_verify_equals_rejection_sample_with_one_hot():
  rng = np.random.default_rng(12)
  b, g, vocab = 2048, 4, 8
  logits = rng.normal(size=(b, g + 1, vocab)).astype(np.float32)
  logits[..., 7] = -np.inf
  logits[: b // 4, :, 1] = logits[: b // 4, :, 2]  # ties
  best = np.argmax(logits, -1)
  drafts = np.where(rng.random((b, g)) < 0.75, best[:, :g], rng.integers(0, vocab, (b, g))).astype(np.int32)
  a_g, n_g = (np.asarray(x) for x in _greedy(logits, drafts))
  p = _probs(_warp(logits, 0.0, 0, 1.0))  # temperature 0: one-hot argmax
  q = jax.nn.one_hot(drafts, vocab, dtype=jnp.float32)
  a_r, n_r = (np.asarray(x) for x in _rejection(jax.random.key(13), p, q, drafts))
  np.testing.assert_array_equal(a_g, a_r)
  np.testing.assert_array_equal(n_g, n_r)
  assert len(set(a_g.tolist())) == g + 1  # every accepted length occurs


# ---------------------------------------------------------------------------
# The worked example in docs/speculative_sampling.md.


def _doc_numbers(tag: str = "worked-example"):
  """Parses a machine-checked block of docs/speculative_sampling.md
  (between ``<!-- TAG:begin -->`` and ``<!-- TAG:end -->``): lines
  ``name = v1 v2 ...`` -> {name: [Fraction, ...]}."""
  text = DOC.read_text()
  block = re.search(rf"<!-- {tag}:begin -->(.*?)<!-- {tag}:end -->", text, re.S)
  assert block, f"{tag} block missing from the doc"
  out = {}
  for line in block.group(1).splitlines():
    m = re.match(r"^\s*(.*\S)\s+=\s+([-0-9/. ]+)$", line)
    if m:
      out[m.group(1).strip()] = [Fraction(v) for v in m.group(2).split()]
  return out


def test_doc_worked_example_numbers():
  doc = _doc_numbers()
  p, q = doc["p"], doc["q"]
  assert sum(p) == 1 and sum(q) == 1 and len(p) == len(q) == 3
  m = [min(a, b) for a, b in zip(p, q)]
  alpha = sum(m)
  accept = [min(Fraction(1), a / b) for a, b in zip(p, q)]
  raw = [max(Fraction(0), a - b) for a, b in zip(p, q)]
  residual = [r / sum(raw) for r in raw]
  emit = [mi + (1 - alpha) * r for mi, r in zip(m, residual)]
  want = {
    "min(p, q)": m,
    "alpha": [alpha],
    "accept(x)": accept,
    "q(x) accept(x)": [b * c for b, c in zip(q, accept)],
    "max(0, p - q)": raw,
    "residual": residual,
    "P(emit x)": emit,
    "P(a = 0), P(a = 1)": [1 - alpha, alpha],
  }
  for name, value in want.items():
    assert doc.get(name) == value, (name, doc.get(name), value)
  assert emit == p
  # And the kernel itself follows those numbers (G = 1).
  pv = np.array([[float(x) for x in p], [0.2, 0.3, 0.5]], np.float32)
  qv = np.array([[float(x) for x in q]], np.float32)
  pvals = _round_pvalues(verify.rejection_sample, pv, qv, 301, 50_000)
  assert min(pvals.values()) > SIG, pvals


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's TopK kernel")
def test_candidate_tiers_compile_to_top_k_not_to_a_sort():
  """Both tiers of candidates reach XLA CPU's TopK kernel: an earlier form
  sliced the second tier's values, XLA folded the slice into the sort and ran
  a full sort there (as dear as the fallback it exists to avoid). The only
  sort left is the fallback's argsort."""
  z = jnp.zeros((2, 49152), jnp.float32)
  f = jax.jit(lambda z: sampling._top_k_top_p(z, jnp.int32(0), jnp.float32(0.9)))
  hlo = f.lower(z).compile().as_text()
  assert hlo.count('custom_call_target="TopK"') == len(sampling.TOP_CANDIDATES) == 2
  assert len(re.findall(r"= \([^)]*\) sort\(", hlo)) == 1
