"""Adaptive draft length: choose G per segment of rounds from measured acceptance and cost.

``Decoder(..., num_draft_tokens="auto")`` compiles one round function per
draft length g = 0 (a plain AR step), 1, ..., G_max. Every choice covers a
segment of ``rounds_per_choice`` rounds: in the while_loop form an outer
``lax.while_loop`` picks g and then runs the inner while_loops of g = 0..G_max
one after the other, of which only the chosen one iterates (a ``lax.switch``
over them would copy every KV cache on entering a branch; sequential loops
update their carry in place), and the stream form picks g on the host between rounds and calls
the round compiled for it; given the same costs both run the same sequence
of draft lengths, so they emit the same tokens for a seed (each form
measures its own costs: the stream form's include the host round trip of
every round, which favours longer drafts). No recompilation and, in the
while_loop form, no host round trip when the
choice changes. The first segment and probe segments are
``probe_rounds`` long. The choice maximises the expected tokens per second
of the batch,

    g* = argmax_g  sum_{b active} E_b[tokens | g] / cost(g),
    E_b[tokens | g] = 1 + sum_{j=1..g} prod_{i<=j} alpha_{b,i},

the expected accepted length of Leviathan et al. 2023 (section 3.1, eq. 1,
with per-position rather than i.i.d. acceptance), where alpha_{b,i} is a
running estimate of row b's acceptance rate at draft position i (an
exponential moving average of "d_i accepted" over the rounds that tested
d_i) and cost(g) the measured wall time of one round at g (timed on the
device for the decoder's batch size and cache length before the first
generation, then moved after every generation toward the decoding time its
rounds took; ``decode.auto.calibrate``). The estimates start at the prior for the
sampling mode: a fixed 0.8, or per draft position the stage's own
validation acceptance (``python -m decode`` reads it from the workdir:
``decode.auto.calibrate.stage_prior``; T = 0 from the argmax agreement, T > 0
from E[sum min(p, q)]).

A generation for which no g >= 1 is expected to finish sooner than AR
(``AutoSchedule.drafting_pays``: at the prior and the measured round costs,
charging the modules' prefill and, at B > 1, the rounds the batch's slowest
row needs, ``batch_rounds``) runs as a plain AR decoder instead, without
the modules' prefill or probes (on a shallow target with batched rows a
round of drafting can cost more than it emits).

Exploration: while g* = 0 nothing is drafted, so nothing is learnt about
acceptance. Acceptance comes in streaks (a run of rejected drafts in one
stretch of an answer says little about the next stretch), so every AR round
moves each row's estimates a fraction ``relax`` of the way back to the prior
(a mean-reverting belief: the stage's validation acceptance is the long-run
rate; with relax = 0.05 an AR segment of 16 rounds goes 1 - 0.95^16 = 56 %
of the way back), and drafting resumes by itself once the estimate crosses
the break-even again. Without it (relax = 0) a streak of misses early in an
answer could keep the rest of it in AR (scripts/replay_schedule.py replays
schedules on recorded answers to compare them). Where the prior itself is
below the break-even relaxing cannot resume drafting, so after
``probe_interval`` AR segments a probe segment of ``probe_rounds`` rounds
drafts g = 1 (the cheapest draft) and folds its outcome with the weight
``probe_ema`` (one fully accepted probe round takes an estimate of 0.1 to
0.55 at 0.5), so text that turns predictable (a repeated line, a list,
code) is drafted again; the interval doubles after every probe that leaves
the choice at AR (up to ``max_probe_interval``) and resets when drafting
wins. No probe where no g could pay even if every draft were accepted
((g + 1) cost(0) <= cost(g) for all g: a shallow target whose module
costs about what it saves). Worst case (every probe rejected) the probes cost

    probe_rounds (cost(1) / cost(0) - 1) / (probe_interval rounds_per_choice)

AR steps per AR round (defaults, cost(1) = 1.3 cost(0): 2 x 0.3 / 64 = 0.9 %,
falling to 2 x 0.3 / 512 = 0.12 % after the interval's doublings), plus
the modules' catch-up over the AR stretch before a probe drafts (FLOP-bound
on a CPU, a per-position cost that spacing the probes does not lower:
64 positions cost ~0.15 AR steps on SmolLM2-135M at B = 1, 0.2 % of the
AR steps they follow, but 2.4-3.5 on the demo model at B = 4, 4-5 %).

Lossless whatever the schedule: the choice is a function of the state left
by earlier rounds only (estimates, counters, costs), never of the current
round's random draws, so given the past, the round is an ordinary
speculative round with a fixed G and emits tokens with the target's law
(docs/speculative_sampling.md, "Adaptive draft length").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from statistics import NormalDist

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class AutoSchedule:
  """Per-round choice of the draft length (module docstring).

  Attributes:
    max_draft_tokens: G_max >= 1, the longest draft considered.
    prior: initial acceptance estimate, in (0, 1): one value for every
      position, or one per draft position 1..n (positions past n take the
      last; e.g. a stage's validation acceptance per depth,
      ``decode.auto.calibrate.stage_prior``). Used when sampling (T > 0), and at
      T = 0 unless ``greedy_prior`` is given.
    greedy_prior: the same for greedy decoding (T = 0), or None.
    ema: weight of the newest round in the estimates, in (0, 1].
    rounds_per_choice: rounds of one segment (one choice of g), >= 1.
    probe_rounds: rounds of the first segment and of probe segments, >= 1.
    probe_interval: AR segments before a probe segment (g = 1), >= 1.
    max_probe_interval: cap of the doubling interval.
    probe_ema: weight of a probe round's outcome in the estimates, in (0, 1]
      (at least ``ema`` is used).
    relax: fraction of the way back to the prior that a row's estimates move
      in each AR round (g = 0), in [0, 1); 0 = estimates frozen during AR.
  """
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
    """[G_max] float32: the initial estimate per draft position (``prior``,
    or ``greedy_prior`` when ``greedy`` and given; a short tuple extended
    with its last value)."""
    v = self.greedy_prior if greedy and self.greedy_prior is not None else self.prior
    vals = list(v) if isinstance(v, tuple) else [v]
    g = self.max_draft_tokens
    return jnp.asarray((vals + [vals[-1]] * g)[:g], jnp.float32)

  def init_state(self, batch: int, costs) -> dict:
    """Schedule state for ``batch`` rows: alpha [B, G_max] float32 estimates,
    prior [B, G_max] float32 (where AR rounds relax them to; ``with_costs``
    sets both for the sampling mode), tested [B, G_max] bool (position ever
    tested in that row), costs [G_max+1] float32 seconds per round, round (choices made) /
    probe_wait / probe_interval int32 scalars, probing bool scalar (the
    current segment is a probe), force int32 (-1; >= 0 forces that g)."""
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
    """[B, G_max] float32: the estimates the choice uses. A position never
    tested in a row keeps the prior, which can exceed what the row showed at
    the positions before it (positions past D reuse module D); such a
    position counts as at most the effective estimate of the position before
    it, so untried long drafts do not look better than the tried short ones."""
    cols = [alpha[:, 0]]
    for j in range(1, alpha.shape[1]):
      cols.append(jnp.where(tested[:, j], alpha[:, j], jnp.minimum(alpha[:, j], cols[-1])))
    return jnp.stack(cols, axis=1)

  def drafting_pays(self, costs, greedy: bool, budget: int | None = None,
                    extra_prefill_s: float = 0.0, batch: int = 1,
                    ar_step_s: float | None = None) -> bool:
    """Host side, before a generation: whether some g >= 1 is expected to
    finish sooner than AR at the prior and the round costs ``costs``
    [G_max+1] seconds (the value ``choose`` maximises, with every row at
    the prior). Without a ``budget``: when E[tokens | g] / cost(g) >
    1 / cost(0). With ``budget`` new tokens per row: when
    ``extra_prefill_s`` (what the modules' prefill adds to the target's,
    seconds) + rounds(g) x cost(g) < budget x cost(0), where rounds(g) is the
    expected number of rounds until the slowest of ``batch`` rows has its
    budget (``batch_rounds``). When it is False, ``choose``'s first segment
    would be AR (or the prefill and the batch's slowest row would eat the
    gain), and the decoder runs the whole generation as plain AR instead
    (``Decoder.generate``): no module prefill and no probes, which a
    generation that is not expected to draft cannot win back.
    ``ar_step_s``: seconds per step of that plain AR decoder
    (``calibrate.plain_ar_calibration``), the alternative drafting has to
    beat; default ``costs[0]``, "auto"'s own AR round, which also feeds the
    modules and can cost more."""
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
    """Host side, before anything is measured: whether ``drafting_pays``
    could be True for a generation of ``budget`` new tokens per row and
    ``batch`` rows at any round costs in which a drafting round (g >= 1)
    costs at least the plain AR step. It is True only if some g needs fewer
    rounds than AR, rounds(g) < budget (``batch_rounds`` at the prior, the
    batch's slowest row): else rounds(g) x cost(g) >= budget x AR step for
    every g, and ``drafting_pays`` is False whatever the calibration
    measures (the modules' prefill only adds to drafting's side). The
    premise is the device's, not a measurement's: a drafting round runs
    the AR step's target call over more positions and the modules besides
    (a measured cost below the AR step is noise, and a decision it would
    have made is dropped). A short budget at a large batch is the case:
    some row of the batch rejects its first draft."""
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
    """Folds a round with static draft length g into the estimates:
    position j = 1..g was tested in rows with accepted >= j-1 (and active),
    and passed when accepted >= j, with weight ``ema`` (``probe_ema`` in a
    probe segment, ``sched["probing"]``). An AR round (g = 0) moves the estimates
    of active rows ``relax`` of the way back to the prior (the state itself
    when relax = 0). accepted: [B] int32; active: [B] bool."""
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
  """Expected rounds until every one of ``batch`` rows has emitted
  ``budget`` tokens, drafting g = len(alpha) tokens a round accepted with
  per-position rates ``alpha`` [g] (draft j kept with probability alpha_j
  given d_1..d_{j-1} were): a round emits 1 + A tokens, P(A >= j) = prod_{i
  <= j} alpha_i, mean mu and variance s^2; a row needs R(budget) rounds in
  expectation, computed exactly (R(n) = 1 + sum_a P(A = a) R(n - 1 - a),
  R(n <= 0) = 0: at least one round however small the budget, where the
  renewal estimate budget / mu would promise a fraction), with standard
  deviation sqrt(budget s^2 / mu^3) by the renewal central limit theorem,
  and the slowest of B independent rows Phi^-1((B - 0.375) /
  (B + 0.25)) standard deviations more (Blom's approximation of the
  expected maximum of B standard normals). A
  batch's loop runs until its slowest row is done, so drafting pays less at
  B > 1 than the mean tau says; AR (g = 0) needs exactly ``budget``.
  Returns float rounds."""
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
  """Expected rounds for one row to emit ``budget`` tokens when a round
  emits 1 + A, P(A >= j) = ``reach[j - 1]`` (j = 1..g): the renewal
  recursion R(n) = 1 + sum_a P(A = a) R(n - 1 - a), R(n <= 0) = 0, solved
  exactly in O(budget g). Float rounds (0.0 for budget <= 0)."""
  import numpy as np
  reach = np.asarray(reach, np.float64)
  p_ge = np.concatenate([[1.0], reach])                       # P(A >= a), a = 0..g
  p_eq = p_ge - np.concatenate([reach, [0.0]])                # P(A = a)
  steps = 1 + np.arange(len(p_eq))
  r = np.zeros(max(int(budget), 0) + 1)
  for n in range(1, len(r)):
    r[n] = 1.0 + p_eq @ r[np.maximum(n - steps, 0)]
  return float(r[-1])
