"""The loops that run decoding rounds: the prefill before them, every round
inside one ``lax.while_loop`` (throughput form), "auto" segments, and the
host-driven stream form (which Ctrl-C can end at a round boundary,
``InterruptFlag``).

A round is a traced ``round_g(state, g) -> state`` (``decode.round.chain_round``
or ``decode.tree.tree_round`` with the parameters bound; g static) and these
loops only decide how many rounds run and at which g.

"auto" (``decode.auto.schedule``): rounds come in segments; ``choose`` picks the
next segment's (g, rounds) from the past only, and a segment runs its
rounds at that g. In the while_loop form an outer loop over segments runs
the inner while_loops of g = 0..G_max one after the other, of which only
the chosen one iterates. Sequential loops, not a ``lax.switch`` over them:
XLA copies every KV cache on entering a switch branch, while loops update
their carry in place; and no host round trip per segment (it would cost
most where rounds are shortest).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from decode.state import DecodeState, repeat_row

RoundG = Callable[[DecodeState, int], DecodeState]


def prefill(drafter, target, draft, state: DecodeState, p: int) -> DecodeState:
  """The prefill, traced: ``target.backbone`` over positions 0..p-1 of
  ``state.tokens`` [B, S] (p = prompt bucket - 1, static) writing its KV
  cache, then ``drafter.prefill`` (on ``draft`` for a draft model, else the
  target's MTP modules, with h^0 [B, p, D], or module 1's fused input with
  ``mtp.feature_layers``); ``drafter`` None for AR."""
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


def segment(round_g: RoundG, state: DecodeState, g: int) -> DecodeState:
  """"auto", while_loop form: when the segment's draft length
  ``state.auto.g`` is g (static), its rounds in one ``lax.while_loop``
  until its round count (capped by the rounds left in the budget) is used
  up or every row is done; otherwise nothing (the loop's condition is
  false at once)."""
  max_rounds = jnp.max(state.max_new)
  auto = state.auto
  state = state.replace(auto=auto.replace(left=jnp.minimum(auto.left, max_rounds - auto.rounds)))

  def cond(s):
    return (s.auto.g == g) & (s.auto.left > 0) & ~jnp.all(s.done)

  def body(s):
    s = round_g(s, g)
    return s.replace(auto=s.auto.replace(left=s.auto.left - 1, rounds=s.auto.rounds + 1))

  return jax.lax.while_loop(cond, body, state)


def generate_loop(round_g: RoundG, state: DecodeState, g: int, schedule=None) -> DecodeState:
  """Every round of a generation inside one ``lax.while_loop`` (after the
  prefill), until every row is done or max_new rounds ran. Fixed draft
  length: ``round_g(state, g)`` each round. "auto" (``schedule`` given, g
  = G_max): an outer while_loop over segments (``choose``, then
  ``segment`` for each g = 0..G_max in sequence)."""
  max_rounds = jnp.max(state.max_new)
  if schedule is not None:
    def seg_cond(s):
      return ~jnp.all(s.done) & (s.auto.rounds < max_rounds)

    def seg_body(s):
      s = choose(schedule, s)
      for gi in range(g + 1):
        s = segment(round_g, s, gi)
      return s
    return jax.lax.while_loop(seg_cond, seg_body, state)

  def cond(carry):
    s, i = carry
    return jnp.logical_and(~jnp.all(s.done), i < max_rounds)

  def body(carry):
    s, i = carry
    return round_g(s, g), i + 1

  state, _ = jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
  return state


class InterruptFlag:
  """Ctrl-C as a flag while a stream runs: inside the block the first SIGINT
  sets ``requested`` and puts the previous handler back, so the loop stops at
  its next round boundary (the round in flight finishes, its tokens are
  kept) and a second Ctrl-C raises KeyboardInterrupt at once. Installed only
  in the main thread and only over Python's default handler (a caller with
  its own SIGINT handler keeps it); elsewhere ``requested`` stays False and
  a KeyboardInterrupt is all there is."""

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


def stream_rounds(step: RoundG, state: DecodeState, max_new_tokens: int, *,
                  prefill_fn: Callable[[DecodeState, int], DecodeState], prefill_len: int,
                  watch, stop_rows: Callable[[DecodeState, np.ndarray, np.ndarray], DecodeState],
                  choose_fn=None, interruptible: bool = False):
  """The stream form after ``Decoder.prepare``: ``prefill_fn(state,
  prefill_len)`` (blocked on), then host-driven rounds, ``step(state, g)``
  (a jitted round) one call per Python step, until every row is done, a
  row failed, or max_new_tokens rounds ran. With "auto" ``choose_fn(state)
  -> state`` (a jitted ``choose``) starts each segment and g is read back
  from the device; otherwise ``step`` is called with g = None.

  ``watch`` (a ``decode.stops.StreamStops``) sees each row's newly emitted
  ids after every round (``on_new(row, ids) -> (keep, stopped)``: how many
  to keep, whether the row stops there at a stop string); rows that stop
  are cut and stopped on the device with ``stop_rows(state, lengths [B],
  mask [B])`` before the next round, so nothing past a stop is ever handed
  on; ``watch.flush()`` hands on what it held back at the end.

  ``interruptible``: inside an ``InterruptFlag`` the loop ends early when
  Ctrl-C sets it (checked at every round boundary) or when a
  KeyboardInterrupt is raised inside a round (by ``step``, ``choose_fn`` or
  ``watch``), and every row keeps the tokens of the rounds completed and
  handed on before it. Otherwise a KeyboardInterrupt propagates.

  Returns (state, emit_times, kept, seconds since the prefill started,
  seconds of the prefill): emit_times per row, seconds from the prefill's
  start to each kept token (tokens of one round share a time); kept None,
  or after an interrupt [B] int32, each row's length at the last round
  boundary (what was handed on).
  """
  on_new = watch.on_new if watch.needed else None
  emit_times: list[list[float]] = [[] for _ in range(state.length.shape[0])]
  kept = None
  with (InterruptFlag() if interruptible else contextlib.nullcontext()) as interrupt:
    t0 = time.perf_counter()
    state = jax.block_until_ready(prefill_fn(state, prefill_len))   # else: dispatch time only
    prefill = time.perf_counter() - t0
    prev = np.asarray(state.length)
    g, left = None, 0
    for _ in range(max_new_tokens):
      if interrupt is not None and interrupt.requested:
        kept = prev
        break
      try:          # ``state`` is rebound after every jitted call: what ran is never lost
        if choose_fn is not None and left == 0:
          state = choose_fn(state)
          g, left = (int(x) for x in jax.device_get((state.auto.g, state.auto.left)))
        state = step(state, g)
        left -= 1
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
  """The while_loop form after ``Decoder.prepare``: ``prefill_fn(state,
  prefill_len)`` (its output repeated into ``like``'s batch,
  ``state.repeat_row``, when given), then ``generate_fn``, each blocked on.
  Returns (state, seconds of both, seconds of the prefill), the clock
  started with ``state`` ready."""
  jax.block_until_ready(state)
  t0 = time.perf_counter()
  state = prefill_fn(state, prefill_len)
  state = jax.block_until_ready(state if like is None else repeat_row(state, like))
  t1 = time.perf_counter()
  state = generate_fn(state)
  jax.block_until_ready(state.length)
  return state, time.perf_counter() - t0, t1 - t0


def warm_extras(state: DecodeState, step, stop_rows, cut: bool, g_max: int | None = None):
  """What a warm-up compiles after its round: ``stop_rows`` with a no-op
  mask when ``cut`` (there are stop strings), and with ``g_max`` (fixed
  "auto" costs: no calibration compiled them) ``step`` at every draft
  length 0..g_max. Returns the state, ready."""
  if cut:
    b = state.length.shape[0]
    state = stop_rows(state, np.asarray(jax.device_get(state.length)), np.zeros(b, bool))
  if g_max is not None:
    for g in range(g_max + 1):
      state = step(state, g)
  return jax.block_until_ready(state)
