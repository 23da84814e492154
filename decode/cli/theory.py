"""Speedup theory of speculative decoding (Leviathan et al. 2023, section
3.4): tau(alpha, G) (eq. 1) and its inverse, the walltime improvement of
Theorem 3.8 (i.i.d. and per-position alpha_k, scalar and vectorised), the
law of a, and c from a measured round. alpha in [0, 1]; G the draft length;
c >= 0 the draft cost per token relative to one target step."""

from __future__ import annotations

import numpy as np


def expected_accepted_length(alpha: float, num_draft_tokens: int) -> float:
  """E[tokens per target call] = (1 - alpha^(G+1)) / (1 - alpha) for i.i.d.
  acceptance rate alpha in [0, 1] (Leviathan et al. 2023, eq. 1); G+1 at alpha = 1."""
  return float(sum(alpha ** k for k in range(num_draft_tokens + 1)))   # no cancellation near 1


def ideal_speedup(alpha: float, num_draft_tokens: int, cost_ratio: float) -> float:
  """Expected walltime improvement (1 - alpha^(G+1)) / ((1 - alpha)(G c + 1))
  (Leviathan et al. 2023, Theorem 3.8); c = drafting time per draft token /
  one target step."""
  return expected_accepted_length(alpha, num_draft_tokens) / (num_draft_tokens * cost_ratio + 1)


def chain_tau(alphas) -> float:
  """E[tokens per target call] = 1 + sum_{j=1..G} prod_{i<=j} alpha_i for
  per-position rates alpha_i = P(d_i accepted | d_1..d_{i-1} accepted),
  G = len(alphas): eq. 1 of Leviathan et al. 2023 without i.i.d. acceptance."""
  return float(1.0 + np.cumprod(np.asarray(alphas, np.float64)).sum())


def chain_speedup(alphas, cost_ratio: float) -> float:
  """Theorem 3.8's walltime improvement with per-position rates:
  ``chain_tau(alphas)`` / (G c + 1), G = len(alphas) (the theorem's proof
  needs only E[tokens per call]; with equal alphas it is ``ideal_speedup``)."""
  return chain_tau(alphas) / (len(alphas) * cost_ratio + 1)


def alpha_from_tau(tau: float, num_draft_tokens: int) -> float:
  """The i.i.d. acceptance rate alpha in [0, 1] whose expected accepted length
  (``expected_accepted_length``) equals tau (bisection; tau clipped to [1, G+1])."""
  lo, hi = 0.0, 1.0
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if expected_accepted_length(mid, num_draft_tokens) < tau else (lo, mid)
  return (lo + hi) / 2


def closed_form_tau(alpha, g):
  """tau(alpha, G) = (1 - alpha^(G+1)) / (1 - alpha), tokens per target call
  (Leviathan et al. 2023, eq. 1). alpha in [0, 1], G >= 0 int; broadcasts
  (numpy arrays or scalars) -> float64 array of the broadcast shape."""
  return np.vectorize(expected_accepted_length, otypes=[np.float64])(alpha, g)


def closed_form_speedup(alpha, g, c):
  """Expected walltime improvement tau(alpha, G) / (G c + 1) (Leviathan et al.
  2023, Theorem 3.8); c >= 0 = draft time per token / target step.
  Broadcasts -> float64 array."""
  return np.vectorize(ideal_speedup, otypes=[np.float64])(alpha, g, c)


def accepted_length_law(alpha: float, g: int) -> np.ndarray:
  """P(a = k), k = 0..G [G+1] float64, under i.i.d. acceptance:
  alpha^k (1 - alpha) for k < G and alpha^G for k = G."""
  k = np.arange(g + 1)
  law = alpha ** k * (1 - alpha)
  law[g] = alpha ** g
  return law


def cost_ratio_from_round(round_cost_ar_steps: float, num_draft_tokens: float) -> float:
  """Theorem 3.8's c from a measured round: a round of G drafts costs G c + 1
  target steps, so c = (``round_cost_ar_steps`` - 1) / G, G =
  ``num_draft_tokens`` > 0 (the mean G with "auto"). Negative when a round
  measured cheaper than an AR step (noise)."""
  if not num_draft_tokens > 0:
    raise ValueError(f"num_draft_tokens={num_draft_tokens!r} must be > 0 (no round drafted: "
                     "c is undefined)")
  return (float(round_cost_ar_steps) - 1.0) / float(num_draft_tokens)


def speedup_from_tau(tau: float, num_draft_tokens: float, cost_ratio: float) -> float:
  """Theorem 3.8's tau / (G c + 1) with a measured tau (tokens per target
  call): for "auto" (G the mean drafted length) or a tree (G the nodes per
  round), where no single alpha fits."""
  return float(tau) / (float(num_draft_tokens) * float(cost_ratio) + 1.0)
