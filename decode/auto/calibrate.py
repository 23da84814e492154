"""Round costs for ``num_draft_tokens="auto"``: seconds per round at g =
0..G_max, measured on this device per (batch size, cache length, sampling
mode, form) before the first generation (``round_costs``,
``decoder_round_costs``) and moved by later generations (``learn_costs``).
``AutoCalibration`` is what a ``Decoder`` with "auto" holds; ``start``
prepares a generation or falls back to plain AR (docs/results/auto_schedule.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from mtp.timing import interleaved_times

CALIBRATION_ROUNDS = 16    # rounds per timed call (at most)
CALIBRATION_REPEATS = 7    # interleaved timed calls per draft length (at most)
MIN_CALIBRATION_REPEATS = 3   # ... at least (a median of three)
CALIBRATION_ROWS = 16      # rows up to which every call runs the full plan (calibration_plan)
PREFILL_REPEATS = 5       # interleaved timed prefills of "auto" and of its AR fallback (at most)
OUTLIER = 10.0             # a generation slower than this x the predicted time teaches nothing


def calibration_plan(batch: int) -> tuple[int, int]:
  """(rounds per timed call, timed calls per draft length) at ``batch`` rows:
  ``CALIBRATION_ROUNDS`` x ``CALIBRATION_REPEATS`` up to ``CALIBRATION_ROWS``
  rows; above, rows x rounds stay those of ``CALIBRATION_ROWS`` rows (fewer
  calls down to ``MIN_CALIBRATION_REPEATS``, then fewer rounds down to one).
  Timed at the batch itself."""
  work = CALIBRATION_ROWS * CALIBRATION_ROUNDS * CALIBRATION_REPEATS
  batch = max(int(batch), 1)
  repeats = min(CALIBRATION_REPEATS,
                max(MIN_CALIBRATION_REPEATS, work // (batch * CALIBRATION_ROUNDS)))
  rounds = min(CALIBRATION_ROUNDS, max(1, work // (batch * repeats)))
  return rounds, repeats


def prefill_repeats(batch: int) -> int:
  """Timed prefills per decoder at ``batch`` rows: ``PREFILL_REPEATS`` up to
  ``CALIBRATION_ROWS`` rows, then fewer (rows prefilled kept), at least one."""
  return min(PREFILL_REPEATS, max(1, PREFILL_REPEATS * CALIBRATION_ROWS // max(int(batch), 1)))


class Calibration(NamedTuple):
  """What ``round_costs`` measured. costs: [G_max+1] float64 seconds per
  round at g = 0..G_max, the call's fixed cost taken off; call_s: seconds of
  a call that runs no round (that fixed cost; 0.0 when not measured)."""
  costs: np.ndarray
  call_s: float


def round_costs(run_rounds: Callable[[int], tuple[float, int]], max_draft_tokens: int, *,
                repeats: int = CALIBRATION_REPEATS,
                run_none: Callable[[], float] | None = None) -> Calibration:
  """``Calibration`` of g = 0..G_max (``max_draft_tokens`` >= 0), timed in
  ``repeats`` interleaved calls per g (``mtp.timing.interleaved_times``):
  cost(g) = median over repeats of its ratio to the AR step's (g = 0) call
  x the fastest AR step, made non-decreasing in g.
  ``run_rounds(g)`` runs some rounds, blocks, and returns (seconds, rounds);
  its first call per g compiles and is not used. ``run_none()`` (optional)
  times the same call with no round: its median, ``call_s``, is taken off
  each call (keeping at least half) before dividing by the rounds."""
  got = {g: [] for g in range(max_draft_tokens + 1)}
  none = []

  def call(g):
    seconds, rounds = run_rounds(g)
    got[g].append((seconds, max(int(rounds), 1)))
  fns = {str(g): (lambda g=g: call(g)) for g in got}
  if run_none is not None:
    fns["none"] = lambda: none.append(run_none())
  interleaved_times(fns, repeats, warmup=1)
  call_s = float(np.median(none[1:])) if run_none is not None else 0.0
  t = np.array([[max(sec - call_s, sec / 2) / n for sec, n in got[g][1:]] for g in got])
  costs = np.median(t / t[:1], axis=1) * t[0].min()              # t: [G+1, repeats]
  return Calibration(np.maximum.accumulate(costs), call_s)


def _timed_generate(decoder, state, sp) -> tuple[float, object]:
  """(seconds, final state) of ``decoder``'s jitted while_loop program on
  ``state`` (ready before the clock starts), until its lengths are ready."""
  import time

  import jax
  t0 = time.perf_counter()
  state = decoder.rounds_program(sp)(state)
  jax.block_until_ready(state.length)
  return time.perf_counter() - t0, state


def decoder_round_costs(decoder, state, sp, form: str) -> Calibration:
  """``round_costs`` of a "auto" ``Decoder`` after the prefill ``state``
  (each call on a copy). While_loop form: the generation's own program with
  g forced and a budget of n (g + 1) tokens, and on all-done rows for
  ``call_s``; stream form: n rounds at g forced, one per call from Python
  with its host sync (the stream's own program).
  n and the calls: ``calibration_plan``."""
  import time

  import jax
  import jax.numpy as jnp
  n, repeats = calibration_plan(state.tokens.shape[0])

  def fresh(g):
    s = jax.tree.map(jnp.copy, state)
    # g forced from the state's own committed scalar: an uncommitted jnp.int32(g)
    # would give the calibration a program of its own, and the generation would
    # compile again inside its timed decoding phase
    s = s.replace(auto=s.auto.replace(schedule={**s.auto.schedule, "force": jnp.full_like(
        s.auto.schedule["force"], g)}))
    if form == "while":
      s = s.replace(max_new=jnp.minimum(s.max_new, n * (g + 1)))
    return jax.block_until_ready(s)

  if form == "while":
    def run_rounds(g):
      seconds, s = _timed_generate(decoder, fresh(g), sp)
      return seconds, int(s.rounds)

    def run_none():
      s = jax.block_until_ready(fresh(0).replace(done=jnp.ones_like(state.done)))
      return _timed_generate(decoder, s, sp)[0]
    return round_costs(run_rounds, decoder.longest_draft, repeats=repeats, run_none=run_none)
  step = decoder.rounds_program(sp, round_limit=1)

  def run_stream_rounds(g):
    s = fresh(g)
    t0 = time.perf_counter()
    for _ in range(n):
      s = step(s)
      if jax.device_get((s.length, s.done, s.error))[1].all():
        break
    return time.perf_counter() - t0, int(s.rounds)
  return round_costs(run_stream_rounds, decoder.longest_draft, repeats=repeats)


def plain_ar_calibration(ar_decoder, state, sp, form: str) -> Calibration:
  """``Calibration`` (costs [1], the step) of the plain AR decoder "auto"
  falls back to (``Decoder.plain_ar``), timed as ``decoder_round_costs``
  after that decoder's prefill ``state``; ``drafting_pays`` compares with
  it rather than "auto"'s g = 0 round, which also feeds the modules."""
  import time

  import jax
  import jax.numpy as jnp
  n, repeats = calibration_plan(state.tokens.shape[0])

  def fresh(done=False):
    s = jax.tree.map(jnp.copy, state)
    s = s.replace(max_new=jnp.minimum(s.max_new, n))
    return jax.block_until_ready(s.replace(done=jnp.ones_like(s.done)) if done else s)

  if form == "while":
    def run_rounds(_):
      seconds, s = _timed_generate(ar_decoder, fresh(), sp)
      return seconds, int(jnp.max(s.target_calls))
    return round_costs(run_rounds, 0, repeats=repeats,
                       run_none=lambda: _timed_generate(ar_decoder, fresh(done=True), sp)[0])

  step = ar_decoder.rounds_program(sp, round_limit=1)

  def run_stream_rounds(_):
    s = fresh()
    t0 = time.perf_counter()
    for _ in range(n):
      s = step(s)
      if jax.device_get((s.length, s.done, s.error))[1].all():
        break
    return time.perf_counter() - t0, int(jnp.max(s.target_calls))
  return round_costs(run_stream_rounds, 0, repeats=repeats)


def extra_prefill_seconds(decoder, prompts, max_new_tokens: int, repeats: int | None = None,
                          stops=None, warmup: int = 1) -> float:
  """Seconds (>= 0) the "auto" decoder's prefill (target and modules) takes
  beyond its plain AR fallback's on ``prompts`` and ``stops``: median of
  ``repeats`` (default ``prefill_repeats``) interleaved timings of each, the
  first ``warmup`` calls untimed; charged to drafting by ``drafting_pays``."""
  import time

  import jax
  ar = decoder.plain_ar()
  repeats = prefill_repeats(len(prompts)) if repeats is None else repeats
  got = {"auto": [], "ar": []}

  def call(name):
    dec = decoder if name == "auto" else ar
    state, p_len = dec.prepare(prompts, max_new_tokens, 0, stops)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    jax.block_until_ready(dec.prefill(state, p_len))
    got[name].append(time.perf_counter() - t0)
  interleaved_times({n: (lambda n=n: call(n)) for n in got}, repeats, warmup=warmup)
  return max(0.0, float(np.median(got["auto"][warmup:]) - np.median(got["ar"][warmup:])))


def updated_costs(costs, rounds, seconds: float, step: float = 0.5) -> np.ndarray:
  """Round costs [G_max+1] float64 moved toward one generation that ran
  ``rounds`` [G_max+1] rounds per g (the batch's maximum over rows) in
  ``seconds`` (decoding phase): a normalised LMS (Widrow-Hoff) step
  c + step n (T - n.c) / n.n, step in (0, 1], then >= 1/4 of the old cost and
  non-decreasing in g. Unchanged when no round ran, ``seconds`` <= 0 or
  ``seconds`` > ``OUTLIER`` x the prediction n.c."""
  c = np.asarray(costs, np.float64)
  n = np.asarray(rounds, np.float64)
  if not 0 < step <= 1:
    raise ValueError(f"step={step!r} must be in (0, 1]")
  if n.shape != c.shape:
    raise ValueError(f"rounds has shape {n.shape}, costs {c.shape}")
  nn = float(n @ n)
  if nn == 0 or not seconds > 0 or seconds > OUTLIER * float(n @ c):
    return c
  new = c + step * n * (seconds - float(n @ c)) / nn
  return np.maximum.accumulate(np.maximum(new, c / 4))


def learn_costs(costs: dict, key, gen, call_s: float = 0.0) -> None:
  """Moves ``costs[key]`` (None key: fixed ``auto_costs``, nothing) toward
  the decoding time of ``gen`` (a "auto" ``Generation``) less ``call_s``,
  by ``updated_costs`` of the rounds it ran per g."""
  if key is None or gen.draft_length_histogram is None:
    return
  rounds = np.asarray(gen.draft_length_histogram).max(axis=0)
  costs[key] = updated_costs(costs[key], rounds,
                             gen.wall_time_s - gen.prefill_time_s - max(call_s, 0.0))


def learn_ar_step(plain: dict, key, gen) -> None:
  """Moves the plain AR step ``plain[key]`` (a ``Calibration``) toward the
  decoding time of ``gen``, an AR fallback generation (``updated_costs``);
  nothing when ``key`` is None."""
  if key is None or key not in plain:
    return
  rounds = np.array([np.asarray(gen.target_calls).max()], np.float64)
  cal = plain[key]
  plain[key] = cal._replace(costs=updated_costs(
      cal.costs, rounds, gen.wall_time_s - gen.prefill_time_s - max(cal.call_s, 0.0)))


def stage_prior(workdir: str, max_draft_tokens: int) -> dict | None:
  """The acceptance prior of "auto" from a stage's ``metrics.jsonl`` (last
  evaluation at or before the latest checkpoint): {"greedy": (alpha_1, ...),
  "sampling": (...)} per draft position 1..min(max_draft_tokens, depths),
  greedy from ``mtp_k/teacher_agreement_full`` (else ``teacher_agreement``),
  sampling from ``mtp_k/teacher_overlap`` (E[sum min(p, q)]; else greedy),
  clipped to [0.02, 0.98]. None when no evaluation has MTP metrics."""
  import json
  import os
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    return None
  steps = [int(d) for d in os.listdir(os.path.join(workdir, "checkpoints"))
           if d.isdigit()] if os.path.isdir(os.path.join(workdir, "checkpoints")) else []
  last = max(steps) if steps else None
  row = None
  with open(path) as f:
    for line in f:
      try:
        d = json.loads(line)
      except ValueError:
        continue
      if d.get("split") == "eval" and (last is None or d.get("step", 0) <= last) \
          and "mtp_1/teacher_agreement" in d:
        row = d
  if row is None:
    return None
  clip = lambda x: float(min(max(x, 0.02), 0.98))
  greedy, sampling = [], []
  for k in range(1, max_draft_tokens + 1):
    g = row.get(f"mtp_{k}/teacher_agreement_full", row.get(f"mtp_{k}/teacher_agreement"))
    if g is None:
      break
    greedy.append(clip(g))
    sampling.append(clip(row.get(f"mtp_{k}/teacher_overlap", g)))
  return {"greedy": tuple(greedy), "sampling": tuple(sampling), "step": row.get("step")}


@dataclasses.dataclass
class AutoCalibration:
  """What a ``Decoder`` with "auto" measured, per cost key (batch size,
  cache length, greedy, filtering, form), each key measured once.

  fixed: the decoder's ``auto_costs`` ([G_max+1] float64 seconds) or None.
  costs: {key: [G_max+1] float64 seconds per round}; call_s: {key: seconds
    of a call that runs no round}; plain: {key: the AR fallback's
    ``Calibration``}; prefill_extra: {key: seconds the modules add to prefill}.
  key, ar_step_s, extra_prefill_s: the current generation's key (None: fixed
    costs, a key's first generation), AR step and prefill charge.
  """
  fixed: np.ndarray | None = None
  costs: dict = dataclasses.field(default_factory=dict)
  call_s: dict = dataclasses.field(default_factory=dict)
  plain: dict = dataclasses.field(default_factory=dict)
  prefill_extra: dict = dataclasses.field(default_factory=dict)
  key: tuple | None = None
  ar_step_s: float | None = None
  extra_prefill_s: float = 0.0

  def record(self, schedule) -> dict:
    """{"prior", "greedy_prior", "round_costs_s": {"B, S, greedy, filtering,
    form": [seconds at g = 0..G_max]} (or {"fixed": ...}), "call_s", "plain_ar_step_s"}."""
    as_list = lambda v: None if v is None else [float(x) for x in np.atleast_1d(v)]
    costs = ({"fixed": as_list(self.fixed)} if self.fixed is not None else
             {", ".join(map(str, k)): as_list(v) for k, v in self.costs.items()})
    return {"prior": as_list(schedule.prior),
            "greedy_prior": as_list(schedule.greedy_prior), "round_costs_s": costs,
            "call_s": {", ".join(map(str, k)): float(v) for k, v in self.call_s.items()},
            "plain_ar_step_s": {", ".join(map(str, k)): float(v.costs[0])
                                for k, v in self.plain.items()}}

  def drafting_can_pay(self, schedule, sp, max_new_tokens: int, batch: int) -> bool:
    """False when no costs could make drafting pay for this budget and batch
    (``AutoSchedule.drafting_can_pay``); True with fixed costs or no "auto"."""
    if schedule is None or self.fixed is not None:
      return True
    if schedule.drafting_can_pay(sp.greedy, max_new_tokens, batch):
      return True
    self.key, self.ar_step_s, self.extra_prefill_s = None, None, 0.0
    return False

  def drafting_pays(self, schedule, costs, sp, max_new_tokens: int, batch: int) -> bool:
    """``AutoSchedule.drafting_pays`` at ``costs`` [G_max+1] seconds with the
    key's prefill charge and AR step; True without "auto"."""
    if schedule is None:
      return True
    return schedule.drafting_pays(np.asarray(costs, np.float64), sp.greedy, max_new_tokens,
                                  self.extra_prefill_s, batch=batch, ar_step_s=self.ar_step_s)

  def learn(self, gen) -> None:
    """``learn_costs`` from a drafting generation ``gen`` for its key."""
    learn_costs(self.costs, self.key, gen, self.call_s.get(self.key, 0.0))

  def fallback(self, gen, g_max: int, learn: bool = True):
    """The AR fallback's ``Generation`` in "auto"'s shape (``as_auto``); with
    ``learn`` and not interrupted it also moves the AR step (``learn_ar_step``)."""
    if learn and not gen.interrupted:
      learn_ar_step(self.plain, self.key, gen)
    return as_auto(gen, g_max)


def as_auto(gen, g_max: int):
  """An AR ``Generation`` in "auto"'s shape: G_max, every round g = 0, no
  position tested (histograms [B, G_max+1] and [B, G_max] int64)."""
  b = len(gen.tokens)
  rounds = np.asarray(gen.target_calls, np.int64)
  hist = np.zeros((b, g_max + 1), np.int64)
  hist[:, 0] = rounds
  zeros = np.zeros((b, g_max), np.int64)
  return dataclasses.replace(gen, num_draft_tokens=g_max, accepted_histogram=hist,
                             draft_length_histogram=hist.copy(), position_tested=zeros,
                             position_accepted=zeros.copy())


def start(decoder, prompts, max_new_tokens: int, sp, seed: int, stops, form: str,
          budget: int | None = None):
  """``decoder.prepare``'s (state, prefill_len) with "auto"'s round costs,
  or None where "auto" runs the plain AR decoder: drafting cannot pay at
  any costs (nothing measured) or at the measured ones, decided on the host
  before any drafting state is built. Without "auto": the prepared state."""
  cal = decoder.calibration
  if decoder.schedule is None:
    return decoder.prepare(prompts, max_new_tokens, seed, stops, budget)
  decoder.check_prompts(prompts, max_new_tokens)    # before any budget-sized host work
  if not cal.drafting_can_pay(decoder.schedule, sp, max_new_tokens, len(prompts)):
    return None
  costs = measured_costs(decoder, prompts, max_new_tokens, sp, form, stops)
  if not cal.drafting_pays(decoder.schedule, costs, sp, max_new_tokens, len(prompts)):
    return None
  state, prefill_len = decoder.prepare(prompts, max_new_tokens, seed, stops, budget)
  return with_costs(decoder, state, sp, costs), prefill_len


def measured_costs(decoder, prompts, max_new_tokens: int, sp, form: str = "while",
                   stops=None) -> np.ndarray:
  """Round costs [G_max+1] float64 seconds for this batch size, cache
  length, mode and ``form`` ("while"/"stream"); sets the key, AR step and
  prefill charge. A key's first call measures them on ``prompts`` and ``stops``
  (``decoder_round_costs``, ``plain_ar_calibration``, ``extra_prefill_seconds``);
  later ones learn. Fixed ``auto_costs``: AR step costs[0], no charge."""
  cal = decoder.calibration
  cal.key, cal.extra_prefill_s, cal.ar_step_s = None, 0.0, None
  if cal.fixed is not None:
    return np.asarray(cal.fixed, np.float64)
  cache_len = decoder.cache_length(prompts, max_new_tokens)
  key = (len(prompts), cache_len, sp.greedy, sp.filtering, form)
  first = key not in cal.costs
  if first:           # a probe batch of its own: the generation's state is prepared later
    probe, prefill_len = decoder.prepare(prompts, max_new_tokens, 0, stops)
    cal.costs[key], cal.call_s[key] = decoder_round_costs(
        decoder, decoder.prefill(probe, prefill_len), sp, form)
    ar = decoder.plain_ar()
    probe, prefill_len = ar.prepare(prompts, max_new_tokens, 0, stops)
    cal.plain[key] = plain_ar_calibration(ar, ar.prefill(probe, prefill_len), sp, form)
    # both prefills ran at these shapes above: nothing left to compile there
    cal.prefill_extra[key] = extra_prefill_seconds(decoder, prompts, max_new_tokens,
                                                   stops=stops, warmup=0)
  cal.extra_prefill_s = cal.prefill_extra.get(key, 0.0)
  cal.ar_step_s = float(cal.plain[key].costs[0])
  cal.key = None if first else key
  return np.asarray(cal.costs[key], np.float64)


def with_costs(decoder, state, sp, costs):
  """"auto": ``state`` with round costs ``costs`` [G_max+1] as float32 and
  estimates reset to ``AutoSchedule.prior_alpha(sp.greedy)``, replicated on
  the decoder's mesh. Without "auto" ``state`` unchanged."""
  if decoder.schedule is None:
    return state
  import jax
  import jax.numpy as jnp
  from decode import mesh as decode_mesh
  costs = jnp.asarray(costs, jnp.float32)
  old_alpha = state.auto.schedule["alpha"]
  alpha = jnp.broadcast_to(decoder.schedule.prior_alpha(sp.greedy), old_alpha.shape)
  if decoder.mesh is not None:
    costs = jax.device_put(costs, decode_mesh.replicated(decoder.mesh))
    alpha = jax.device_put(alpha, old_alpha.sharding)
  auto = state.auto
  # alpha moves, prior stays (AR rounds relax alpha toward it); two buffers, as the state is donated
  return state.replace(auto=auto.replace(schedule={**auto.schedule, "costs": costs,
                                                   "alpha": alpha, "prior": jnp.copy(alpha)}))
