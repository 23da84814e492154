"""The loops that run decoding rounds: the prefill, every round inside one
``lax.while_loop`` (throughput form), "auto" segments, and the host-driven
stream form (that program one round per call; Ctrl-C ends it at a round
boundary, ``InterruptFlag``). A round is a traced ``state -> state`` at a
static draft length g; these loops decide how many rounds run and at which
g. "auto": ``choose`` picks each segment's (g, rounds) from the past; the
inner loops of g = 0..G_max run in sequence, only the chosen one iterating
(docs/results/auto_schedule.md).
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from decode.state import DecodeState, repeat_row

Round = Callable[[DecodeState], DecodeState]     # one round at a static draft length


def prefill(drafter, target, draft, state: DecodeState, p: int) -> DecodeState:
  """The prefill, traced: the target over positions 0..p-1 (static) of
  ``state.tokens`` [B, S] writing its KV cache, then ``drafter.prefill``
  (on ``draft``, else the target's modules, with h^0 [B, p, D]); ``drafter``
  None for AR."""
  b = state.tokens.shape[0]
  with jax.named_scope("prefill"):
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    _, h0, cache = target.backbone_features(state.tokens[:, :p], pos, cache=state.cache)
    state = state.replace(cache=cache)
    if drafter is not None:
      model = draft if draft is not None else target
      state = state.replace(drafter=drafter.prefill(model, state.drafter, state.tokens,
                                                    state.length, h0, p))
  return state


def choose(schedule, state: DecodeState) -> DecodeState:
  """"auto": picks (g, rounds) of the next segment from the past
  (``AutoSchedule.choose``) into ``state.auto``."""
  with jax.named_scope("schedule"):
    g, rounds, sched = schedule.choose(state.auto.schedule, ~state.done)
  return state.replace(auto=state.auto.replace(schedule=sched, g=g, left=rounds))


def segment(round_fn: Round, state: DecodeState, g: int, more: Callable) -> DecodeState:
  """"auto": when ``state.auto.g`` is g (static), the segment's rounds
  (``round_fn``, capped by the budget) in one ``lax.while_loop`` until used
  up (``round.record_auto`` counts them down) or ``more(state)`` is False;
  otherwise nothing."""
  auto = state.auto
  left = jnp.minimum(auto.left, jnp.max(state.max_new) - state.rounds)
  state = state.replace(auto=auto.replace(left=left))

  def cond(s):
    return (s.auto.g == g) & (s.auto.left > 0) & more(s)

  return jax.lax.while_loop(cond, round_fn, state)


def generate_loop(spec, params, draft_params, sp, round_limit, state: DecodeState) -> DecodeState:
  """The program of both decoding forms: the rounds after the prefill in one
  ``lax.while_loop`` until every row is done, max_new rounds ran or
  ``round_limit`` (int32, traced: ``ALL_ROUNDS`` for generate, 1 per stream
  step) ran in this call. The loop body is the round itself
  (``spec.round_at``: ``round.chain_round`` or ``tree.tree_round`` at a
  static g). "auto" (``spec.schedule``): an outer loop of ``choose`` (when
  the segment is used up) then ``segment`` for g = 0..G_max."""
  round_at = spec.round_at(params, draft_params, sp)
  max_rounds, start = jnp.max(state.max_new), state.rounds

  def more(s):
    return ~jnp.all(s.done) & (s.rounds < max_rounds) & (s.rounds - start < round_limit)

  if spec.schedule is None:
    return jax.lax.while_loop(more, round_at(spec.longest_draft), state)

  def seg_body(s):
    s = jax.lax.cond(s.auto.left == 0, functools.partial(choose, spec.schedule), lambda s: s, s)
    for g in range(spec.longest_draft + 1):
      s = segment(round_at(g), s, g, more)
    return s
  return jax.lax.while_loop(more, seg_body, state)


class InterruptFlag:
  """Ctrl-C as a flag: inside the block the first SIGINT sets ``requested``
  and restores the previous handler (the loop stops at its next round
  boundary; a second Ctrl-C raises KeyboardInterrupt). Installed only in
  the main thread over Python's default handler."""

  def __init__(self):
    self.requested = False
    self._old = None

  def __enter__(self):
    if (threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
      self._old = signal.signal(signal.SIGINT, self._handle)
    return self

  def _handle(self, signum, frame):
    self.requested = True
    signal.signal(signal.SIGINT, self._old)

  def __exit__(self, *exc):
    if self._old is not None and signal.getsignal(signal.SIGINT) == self._handle:
      signal.signal(signal.SIGINT, self._old)


def stream_rounds(step: Callable[[DecodeState], DecodeState], state: DecodeState,
                  max_new_tokens: int, *, prefill_fn: Callable[[DecodeState, int], DecodeState],
                  prefill_len: int, watch,
                  stop_rows: Callable[[DecodeState, np.ndarray, np.ndarray], DecodeState],
                  interruptible: bool = False):
  """The stream form: ``prefill_fn(state, prefill_len)``, then one jitted
  round ``step(state)`` (the generate program with a round limit of 1) per
  host step until every row is done, a row failed or max_new_tokens rounds ran.
  ``watch`` (``decode.stops.StreamStops``) sees each row's new ids after
  every round; rows it stops are cut on the device with ``stop_rows(state,
  lengths [B], mask [B])`` before the next round. ``interruptible``: Ctrl-C
  or a KeyboardInterrupt inside a round ends the loop, rows keep the rounds
  handed on; otherwise it propagates.

  Returns (state, emit_times, kept, seconds since the prefill started,
  seconds of the prefill): emit_times per row, seconds to each kept token;
  kept None, or after an interrupt [B] int32 lengths handed on.
  """
  on_new = watch.on_new if watch.needed else None
  emit_times: list[list[float]] = [[] for _ in range(state.length.shape[0])]
  kept = None
  with (InterruptFlag() if interruptible else contextlib.nullcontext()) as interrupt:
    t0 = time.perf_counter()
    state = jax.block_until_ready(prefill_fn(state, prefill_len))   # else: dispatch time only
    prefill = time.perf_counter() - t0
    prev = np.asarray(state.length)
    for _ in range(max_new_tokens):
      if interrupt is not None and interrupt.requested:
        kept = prev
        break
      try:          # ``state`` is rebound after every jitted call: what ran is never lost
        state = step(state)
        length, done, error = (np.array(x) for x in
                               jax.device_get((state.length, state.done, state.error)))
        if error.any():
          break
        now = time.perf_counter() - t0
        grew = np.nonzero(length > prev)[0]
        if on_new is not None and len(grew):
          toks = np.asarray(state.tokens)
          cut = np.zeros(len(length), bool)
          for i in grew:
            keep, stopped = on_new(int(i), toks[i, prev[i]:length[i]])
            if stopped:
              cut[i], length[i] = True, prev[i] + keep
          if cut.any():
            state = stop_rows(state, length, cut)
            done = done | cut
      except KeyboardInterrupt:
        if interrupt is None:
          raise
        kept = prev
        break
      for i in grew:
        emit_times[i].extend([now] * int(length[i] - prev[i]))
      prev = length
      if done.all():
        break
  try:
    watch.flush()
  except KeyboardInterrupt:     # the callback that ended the loop, raising again
    if kept is None:
      raise
  return state, emit_times, kept, time.perf_counter() - t0, prefill


def timed_generate(prefill_fn: Callable[[DecodeState, int], DecodeState],
                   generate_fn: Callable[[DecodeState], DecodeState], state: DecodeState,
                   prefill_len: int, like=None) -> tuple[DecodeState, float, float]:
  """The while_loop form: ``prefill_fn(state, prefill_len)`` (repeated into
  ``like``'s batch when given), then ``generate_fn``, each blocked on.
  Returns (state, seconds of both, seconds of the prefill)."""
  jax.block_until_ready(state)
  t0 = time.perf_counter()
  state = prefill_fn(state, prefill_len)
  state = jax.block_until_ready(state if like is None else repeat_row(state, like))
  t1 = time.perf_counter()
  state = generate_fn(state)
  jax.block_until_ready(state.length)
  return state, time.perf_counter() - t0, t1 - t0


def warm_extras(state: DecodeState, stop_rows, cut: bool):
  """What a warm-up compiles after its round: ``stop_rows`` (no-op mask)
  when ``cut``. Returns the state, ready."""
  if cut:
    b = state.length.shape[0]
    state = stop_rows(state, np.asarray(jax.device_get(state.length)), np.zeros(b, bool))
  return jax.block_until_ready(state)
