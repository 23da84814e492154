"""Adaptive draft length (``num_draft_tokens="auto"``): ``AutoSchedule``
picks per segment of rounds the g in 0..G_max (0: an AR step) with the most
expected tokens per second (Leviathan et al. 2023, eq. 1, per-position rates),

    g* = argmax_g  sum_{b active} (1 + sum_{j<=g} prod_{i<=j} alpha_{b,i}) / cost(g),

alpha_{b,i} an EMA of row b's acceptance of d_i, cost(g) seconds per round
(``decode.auto.calibrate``). Choices read only the past, so the output keeps
the target's law (docs/speculative_sampling.md, docs/results/auto_schedule.md)."""

from __future__ import annotations

import dataclasses
import functools
import math
from statistics import NormalDist

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class AutoSchedule:
  """Per-round choice of the draft length (module docstring); ValueError
  for a field out of its range.

  max_draft_tokens: G_max >= 1. prior / greedy_prior: initial acceptance in
    (0, 1), one value or one per draft position (later ones take the last;
    ``calibrate.stage_prior``); greedy_prior for T = 0, None: prior.
  ema / probe_ema: weight of a round / probe round in the estimates, (0, 1].
  rounds_per_choice / probe_rounds: rounds of a segment / of the first and
    probe segments, >= 1. probe_interval: AR segments before a probe (g = 1),
    doubled after each probe left at AR, up to max_probe_interval; rejected
    probes cost <= probe_rounds (cost(1) / cost(0) - 1) / (probe_interval
    rounds_per_choice) AR steps per AR round.
  relax: fraction of the way back to the prior per AR round, in [0, 1)."""
  max_draft_tokens: int
  prior: float | tuple[float, ...] = 0.8
  ema: float = 0.2
  rounds_per_choice: int = 16
  probe_rounds: int = 2
  probe_interval: int = 4
  max_probe_interval: int = 32
  probe_ema: float = 0.5
  greedy_prior: float | tuple[float, ...] | None = None
  relax: float = 0.05

  def __post_init__(self):
    if not (isinstance(self.max_draft_tokens, int) and self.max_draft_tokens >= 1):
      raise ValueError(f"max_draft_tokens={self.max_draft_tokens!r} must be an integer >= 1")
    for name in ("prior", "greedy_prior"):
      v = getattr(self, name)
      vals = v if isinstance(v, tuple) else (v,)
      if (v is not None or name == "prior") and not (
          vals and all(isinstance(x, (int, float)) and 0 < x < 1 for x in vals)):
        raise ValueError(f"{name}={v!r} must be in (0, 1) (a number or a non-empty tuple of them)")
    if not 0 < self.ema <= 1:
      raise ValueError(f"ema={self.ema!r} must be in (0, 1]")
    if not 0 < self.probe_ema <= 1:
      raise ValueError(f"probe_ema={self.probe_ema!r} must be in (0, 1]")
    if not 0 <= self.relax < 1:
      raise ValueError(f"relax={self.relax!r} must be in [0, 1)")
    if not 1 <= self.probe_interval <= self.max_probe_interval:
      raise ValueError(f"probe_interval={self.probe_interval!r} must be in [1, max_probe_interval]")
    for name in ("rounds_per_choice", "probe_rounds"):
      if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
        raise ValueError(f"{name}={getattr(self, name)!r} must be an integer >= 1")

  def prior_alpha(self, greedy: bool = False) -> jax.Array:
    """[G_max] float32 initial estimates (``greedy_prior`` when ``greedy`` and
    set, else ``prior``; a short tuple extended with its last value)."""
    v = self.greedy_prior if greedy and self.greedy_prior is not None else self.prior
    vals = list(v) if isinstance(v, tuple) else [v]
    g = self.max_draft_tokens
    return jnp.asarray((vals + [vals[-1]] * g)[:g], jnp.float32)

  def init_state(self, batch: int, costs) -> dict:
    """Schedule state of ``batch`` rows: alpha, prior [B, G_max] float32,
    tested [B, G_max] bool, costs [G_max+1] float32 seconds per round, int32
    scalars round / probe_wait / probe_interval / force (-1, or g forced),
    probing bool. Raises ValueError when costs is not [G_max+1]."""
    g = self.max_draft_tokens
    costs = jnp.asarray(costs, jnp.float32)
    if costs.shape != (g + 1,):
      raise ValueError(f"costs must have shape ({g + 1},), got {costs.shape}")
    prior = jnp.broadcast_to(self.prior_alpha(), (batch, g))
    return {"alpha": prior, "prior": jnp.copy(prior),     # two buffers: the state is donated
            "tested": jnp.zeros((batch, g), bool), "costs": costs,
            "round": jnp.int32(0), "probe_wait": jnp.int32(0),
            "probe_interval": jnp.int32(self.probe_interval), "probing": jnp.bool_(False),
            "force": jnp.int32(-1)}

  def expected_tokens(self, alpha) -> jax.Array:
    """[B, G_max+1] float32: E[tokens per round | g] per row from alpha [B, G_max]."""
    reach = jnp.cumprod(alpha, axis=1)
    zero = jnp.zeros(alpha.shape[:1] + (1,), alpha.dtype)
    return 1.0 + jnp.cumsum(jnp.concatenate([zero, reach], axis=1), axis=1)

  @staticmethod
  def effective_alpha(alpha, tested) -> jax.Array:
    """[B, G_max] float32 estimates the choice uses: a position never tested in
    a row counts at most as much as the position before it."""
    cols = [alpha[:, 0]]
    for j in range(1, alpha.shape[1]):
      cols.append(jnp.where(tested[:, j], alpha[:, j], jnp.minimum(alpha[:, j], cols[-1])))
    return jnp.stack(cols, axis=1)

  def drafting_pays(self, costs, greedy: bool, budget: int | None = None,
                    extra_prefill_s: float = 0.0, batch: int = 1,
                    ar_step_s: float | None = None) -> bool:
    """Host side: whether some g >= 1 beats the AR step (``ar_step_s``, the
    plain AR decoder's; default costs[0]) at the prior and ``costs`` [G_max+1]
    seconds: cost(g) / E[tokens | g] < AR step, or with a ``budget``:
    ``extra_prefill_s`` + ``batch_rounds`` x cost(g) < budget x AR step."""
    import numpy as np
    alpha = self.prior_alpha(greedy)
    costs = np.asarray(costs, np.float64)
    ar = costs[0] if ar_step_s is None else float(ar_step_s)
    if budget is None:
      per_token = costs / np.asarray(self.expected_tokens(alpha[None]))[0]
      return bool(per_token[1:].min() < ar)
    rounds = np.array([batch_rounds(np.asarray(alpha)[:g], budget, batch)
                       for g in range(len(costs))])
    return bool(extra_prefill_s + (rounds[1:] * costs[1:]).min() < budget * ar)

  def drafting_can_pay(self, greedy: bool, budget: int, batch: int = 1) -> bool:
    """Host side, before measuring: whether ``drafting_pays`` could be True at
    any costs with cost(g) >= AR step, i.e. some g has ``batch_rounds`` < budget."""
    import numpy as np
    alpha = np.asarray(self.prior_alpha(greedy))
    return any(batch_rounds(alpha[:g], budget, batch) < budget
               for g in range(1, self.max_draft_tokens + 1))

  def choose(self, sched: dict, active) -> tuple[jax.Array, jax.Array, dict]:
    """(g, rounds, updated schedule state) for the next segment, from the
    past only: draft length g and number of rounds (int32 scalars).
    active: [B] bool, rows still generating."""
    alpha = self.effective_alpha(sched["alpha"], sched["tested"])
    tokens = self.expected_tokens(alpha)                                 # [B, G+1]
    value = jnp.sum(tokens * active[:, None], axis=0) / sched["costs"]
    best = jnp.argmax(value).astype(jnp.int32)
    g_all = jnp.arange(1, sched["costs"].shape[0], dtype=jnp.float32)
    could_pay = jnp.any((g_all + 1) * sched["costs"][0] > sched["costs"][1:])   # at alpha = 1
    probe = (best == 0) & (sched["probe_wait"] >= sched["probe_interval"]) & could_pay
    wait = jnp.where(best == 0, jnp.where(probe, 0, sched["probe_wait"] + 1), 0)
    g = jnp.where(probe, 1, best)
    interval = jnp.where(best > 0, self.probe_interval,
                         jnp.where(probe, jnp.minimum(2 * sched["probe_interval"],
                                                      self.max_probe_interval),
                                   sched["probe_interval"]))
    rounds = jnp.where(probe | (sched["round"] == 0), self.probe_rounds, self.rounds_per_choice)
    g = jnp.where(sched["force"] >= 0, sched["force"], g)
    return g, rounds.astype(jnp.int32), {
        **sched, "probe_wait": wait.astype(jnp.int32),
        "probe_interval": interval.astype(jnp.int32), "probing": probe,
        "round": sched["round"] + 1}

  def update(self, sched: dict, g: int, accepted, active) -> dict:
    """Folds a round of static length g into the estimates: position j <= g
    tested where accepted >= j-1 (and active), passed where accepted >= j,
    weight ``ema`` (``probe_ema`` when probing). g = 0 moves active rows
    ``relax`` toward the prior. accepted: [B] int32; active: [B] bool."""
    if g == 0:
      if self.relax == 0:
        return sched
      alpha = sched["alpha"]
      back = alpha + self.relax * (sched["prior"] - alpha)
      return {**sched, "alpha": jnp.where(active[:, None], back, alpha)}
    j = jnp.arange(1, g + 1)[None, :]
    tested = (accepted[:, None] >= j - 1) & active[:, None]
    passed = (accepted[:, None] >= j).astype(jnp.float32)
    alpha = sched["alpha"]
    head = alpha[:, :g]
    w = jnp.where(sched.get("probing", False), max(self.ema, self.probe_ema), self.ema)
    head = jnp.where(tested, head + w * (passed - head), head)
    return {**sched, "alpha": alpha.at[:, :g].set(head),
            "tested": sched["tested"].at[:, :g].set(sched["tested"][:, :g] | tested)}


def batch_rounds(alpha, budget: int, batch: int = 1) -> float:
  """Expected rounds (float) until all ``batch`` rows have ``budget`` tokens
  at rates ``alpha`` [g] (a round emits 1 + A, P(A >= j) = prod_{i<=j}
  alpha_i; mean mu, variance s^2): ``expected_rounds`` plus, at B > 1,
  Phi^-1((B - 0.375) / (B + 0.25)) sqrt(budget s^2 / mu^3) (renewal CLT,
  Blom's expected maximum of B normals). g = 0 gives ``budget``."""
  import numpy as np
  return _batch_rounds(tuple(float(a) for a in np.asarray(alpha, np.float64).ravel()),
                       int(budget), int(batch))


@functools.lru_cache(maxsize=256)   # host side before every "auto" generation: the same prior each time
def _batch_rounds(alpha: tuple, budget: int, batch: int) -> float:
  """``batch_rounds`` on hashable arguments."""
  import numpy as np
  reach = np.cumprod(np.asarray(alpha, np.float64))        # P(A >= j), j = 1..g
  mu = 1.0 + reach.sum()
  var = float((np.arange(1, 2 * len(reach), 2) * reach).sum() - reach.sum() ** 2)
  spread = NormalDist().inv_cdf((batch - 0.375) / (batch + 0.25)) if batch > 1 else 0.0
  return (expected_rounds(reach, budget)
          + spread * math.sqrt(max(var, 0.0) * budget / mu ** 3))


def expected_rounds(reach, budget: int) -> float:
  """Expected rounds (float; 0.0 at budget <= 0) for one row to emit
  ``budget`` tokens, P(A >= j) = ``reach[j-1]``: R(n) = 1 + sum_a P(A = a)
  R(n - 1 - a), R(n <= 0) = 0, exact in O(budget g)."""
  import numpy as np
  reach = np.asarray(reach, np.float64)
  p_ge = np.concatenate([[1.0], reach])                       # P(A >= a), a = 0..g
  p_eq = p_ge - np.concatenate([reach, [0.0]])                # P(A = a)
  steps = 1 + np.arange(len(p_eq))
  r = np.zeros(max(int(budget), 0) + 1)
  for n in range(1, len(r)):
    r[n] = 1.0 + p_eq @ r[np.maximum(n - steps, 0)]
  return float(r[-1])
