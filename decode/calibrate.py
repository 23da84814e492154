"""Round costs for ``num_draft_tokens="auto"``: seconds per round at each
draft length g = 0..G_max, measured on this device before the first timed
generation of a (batch size, cache length, sampling mode, form), and put
into the "auto" state (``with_costs``).

The measurement (``round_costs``): each g's rounds timed with the g
interleaved (``mtp.timing.interleaved_times``), so noise hits every g
alike; each g's cost is its median ratio to the AR step (g = 0) timed in
the same repeat, times the fastest AR step (robust to slow drift and
bursts), made non-decreasing in g (a longer draft never costs less: noise
must not invert the order). A busy machine can still skew the costs, which
only costs speed, never correctness: the schedule's choices depend on the
past only.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mtp.timing import interleaved_times

CALIBRATION_ROUNDS = 16    # rounds per timed call
CALIBRATION_REPEATS = 7    # interleaved timed calls per draft length


def round_costs(run_rounds: Callable[[int], None], max_draft_tokens: int, *,
                rounds: int = CALIBRATION_ROUNDS, repeats: int = CALIBRATION_REPEATS) -> np.ndarray:
  """[G_max+1] float64 seconds per round for g = 0..G_max.

  Args:
    run_rounds: ``run_rounds(g)`` runs ``rounds`` rounds at draft length g
      and blocks until they are done (the first call per g compiles; it is
      not timed).
    max_draft_tokens: G_max >= 1.
    rounds: rounds per call (the per-round cost is the call's time / rounds).
    repeats: interleaved timed calls per g.
  """
  times = interleaved_times({g: (lambda g=g: run_rounds(g)) for g in range(max_draft_tokens + 1)},
                            repeats, warmup=1)
  t = np.stack([times[g] for g in range(max_draft_tokens + 1)]) / rounds     # [G+1, repeats]
  costs = np.median(t / t[:1], axis=1) * t[0].min()
  return np.maximum.accumulate(costs)


def decoder_round_costs(decoder, state, sp, form: str) -> np.ndarray:
  """``round_costs`` of a ``Decoder`` with "auto", after the prefill
  ``state`` (not donated). While_loop form: ``CALIBRATION_ROUNDS`` rounds
  inside one jitted fori_loop (no host dispatch). Stream form: rounds called
  one by one from Python with the host sync the stream loop makes (its host
  overhead is part of a round's cost there, which favours longer drafts)."""
  import jax
  import jax.numpy as jnp
  p, dp = decoder.target_params, decoder.draft_params
  if form == "while":
    def run_rounds(g):
      jax.block_until_ready(decoder._calibrate_jit(p, dp, state, sp, g))
  else:
    def run_rounds(g):
      s = jax.tree.map(jnp.copy, state)
      for _ in range(CALIBRATION_ROUNDS):
        s = decoder._round_jit(p, dp, s, sp, g)
        jax.device_get((s.length, s.done, s.error))
  return round_costs(run_rounds, decoder.G)


def with_costs(decoder, state, sp, prompts, max_new_tokens: int, form: str = "while"):
  """"auto": ``state`` (a ``DecodeState`` from ``decoder.prepare``) with the
  schedule's round costs [G_max+1] float32 seconds for this batch size,
  cache length, sampling mode and form (``"while"`` or ``"stream"``),
  measured once each (``decoder_round_costs`` on a probe batch of
  ``prompts``, kept in ``decoder._costs``); ``auto_costs`` given to the
  ``Decoder`` replace the measurement. Replicated on the decoder's mesh.
  Without "auto" ``state`` is returned unchanged."""
  if decoder.schedule is None:
    return state
  import jax
  import jax.numpy as jnp
  from decode import mesh as decode_mesh
  costs = decoder._fixed_costs
  if costs is None:
    probe, prefill_len = decoder.prepare(prompts, max_new_tokens, 0)
    key = (len(prompts), probe.tokens.shape[1], sp.greedy, sp.filtering, form)
    if key not in decoder._costs:
      decoder._costs[key] = decoder_round_costs(decoder, decoder.prefill(probe, prefill_len),
                                                sp, form)
    costs = decoder._costs[key]
  costs = jnp.asarray(costs, jnp.float32)
  if decoder.mesh is not None:
    costs = jax.device_put(costs, decode_mesh.replicated(decoder.mesh))
  auto = state.auto
  return state.replace(auto=auto.replace(schedule={**auto.schedule, "costs": costs}))
