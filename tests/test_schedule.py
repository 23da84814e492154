"""The adaptive draft-length schedule (decode.auto.schedule): its expected-token
formula, its choice, exploration and estimate updates, on hand-made states."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from decode.auto.schedule import AutoSchedule
from tests.schedules import CyclingSchedule


def test_expected_tokens_is_leviathan_eq1_per_position():
  s = AutoSchedule(3)
  alpha = jnp.asarray([[0.5, 0.5, 0.5], [1.0, 0.0, 1.0]])
  want = [[1, 1.5, 1.75, 1.875], [1, 2, 2, 2]]
  np.testing.assert_allclose(s.expected_tokens(alpha), want)


def test_choice_maximises_expected_tokens_per_second():
  s = AutoSchedule(3, prior=0.9)
  active = jnp.asarray([True, True])
  # cheap drafting: the longest draft wins
  st = s.init_state(2, [1.0, 1.05, 1.1, 1.15])
  g, _, _ = s.choose(st, active)
  assert int(g) == 3
  # a drafting round as expensive as 4 target steps: even tau 3.44 loses, AR wins
  st = s.init_state(2, [1.0, 4.0, 4.0, 4.0])
  g, _, _ = s.choose(st, active)
  assert int(g) == 0
  # by hand: alpha 0.9, costs 1, 1.5, 2.2, 3.0 -> tokens 1, 1.9, 2.71, 3.439 -> per cost
  # 1, 1.267, 1.232, 1.146: G = 1
  st = s.init_state(2, [1.0, 1.5, 2.2, 3.0])
  g, _, _ = s.choose(st, active)
  assert int(g) == 1
  # only active rows count: a done row with perfect acceptance does not pull G up
  st = {**s.init_state(2, [1.0, 1.2, 1.4, 1.6]), "alpha": jnp.asarray([[0.1] * 3, [1.0] * 3])}
  assert int(s.choose(st, jnp.asarray([True, False]))[0]) == 0
  assert int(s.choose(st, jnp.asarray([False, True]))[0]) == 3


def test_probe_after_ar_segments_with_doubling_interval():
  s = AutoSchedule(2, prior=0.1, probe_interval=2, max_probe_interval=4, rounds_per_choice=16,
                   probe_rounds=3)
  st = s.init_state(1, [1.0, 1.9, 2.8])     # G = 1 would pay at alpha > 0.9
  active = jnp.asarray([True])
  chosen, lengths = [], []
  for _ in range(16):
    g, rounds, st = s.choose(st, active)
    chosen.append(int(g))
    lengths.append(int(rounds))
  # 2 AR rounds, a probe, then the interval doubles to 4 (the cap): 4 AR rounds per probe
  assert chosen[:4] == [0, 0, 1, 0] and chosen.count(0) > 10
  probes = [i for i, g in enumerate(chosen) if g]
  assert np.diff(probes).tolist() == [5, 5]
  # the first segment and probes are short, the others rounds_per_choice long
  assert lengths[0] == 3 and all(lengths[i] == (3 if chosen[i] else 16) for i in range(1, 16))
  forced = {**st, "force": jnp.int32(2)}
  assert int(s.choose(forced, active)[0]) == 2


def test_update_is_an_ema_over_tested_positions_only():
  s = AutoSchedule(3, prior=0.5, ema=0.5)
  st = s.init_state(3, [1, 1, 1, 1])
  accepted = jnp.asarray([0, 1, 2])
  out = s.update(st, 2, accepted, jnp.asarray([True, True, False]))["alpha"]
  # row 0: d_1 tested and rejected, d_2 not tested; row 1: d_1 passed, d_2 failed;
  # row 2 inactive; position 3 beyond g = 2 untouched
  np.testing.assert_allclose(out, [[0.25, 0.5, 0.5], [0.75, 0.25, 0.5], [0.5, 0.5, 0.5]])
  frozen = AutoSchedule(3, prior=0.5, ema=0.5, relax=0.0)
  assert frozen.update(st, 0, accepted, jnp.asarray([True] * 3)) is st


def test_ar_rounds_relax_the_estimates_back_to_the_prior():
  """An AR round learns nothing about acceptance; the estimates of active
  rows move ``relax`` of the way back to the prior, so a streak of misses
  does not keep a row in AR for the rest of its answer."""
  s = AutoSchedule(2, prior=0.5, ema=0.5, relax=0.25, rounds_per_choice=1, probe_interval=64,
                   max_probe_interval=64)
  st = s.init_state(2, [1.0, 1.3, 1.6])
  for _ in range(2):                                     # two misses at d_1 in both rows
    st = s.update(st, 1, jnp.asarray([0, 0]), jnp.asarray([True, True]))
  np.testing.assert_allclose(st["alpha"][:, 0], [0.125, 0.125])
  st1 = s.update(st, 0, jnp.asarray([0, 0]), jnp.asarray([True, False]))
  # row 0: 0.125 + 0.25 (0.5 - 0.125); row 1 inactive: unchanged; position 2 at the prior stays
  np.testing.assert_allclose(st1["alpha"], [[0.21875, 0.5], [0.125, 0.5]])
  # AR is chosen after the misses (G = 1 pays above alpha 0.3); after k AR
  # rounds alpha = 0.5 - 0.375 * 0.75^k crosses 0.3 at k = 3, so the 4th choice
  # drafts again, without a probe (the probe interval is 64 segments); frozen
  # estimates (relax = 0) stay in AR
  active = jnp.asarray([True, True])
  for sched, want in ((s, [0, 0, 0, 1]), (dataclasses.replace(s, relax=0.0), [0, 0, 0, 0])):
    cur, chosen = st, []
    for _ in range(4):
      g, _, cur = sched.choose(cur, active)
      chosen.append(int(g))
      cur = sched.update(cur, int(g), jnp.asarray([0, 0]), active)
    assert chosen == want


def test_untested_positions_count_at_most_the_position_before():
  """Positions never tested keep the prior; the choice caps them by the
  effective estimate before them, so after d_1..d_2 were mostly rejected an
  untried G = 4 does not look better than the tried G = 1 (reviewer case:
  --max_draft_tokens > D chose long drafts from the untouched prior)."""
  s = AutoSchedule(4, prior=0.8, ema=1.0)
  st = s.init_state(1, [1.0, 1.2, 1.3, 1.4, 1.5])
  for a in (1, 0, 1):                                  # three rounds at g = 2
    st = s.update(st, 2, jnp.asarray([a]), jnp.asarray([True]))
  assert st["tested"].tolist() == [[True, True, False, False]]
  eff = s.effective_alpha(st["alpha"], st["tested"])
  np.testing.assert_allclose(eff, [[1.0, 0.0, 0.0, 0.0]])
  # raw estimates [1, 0, 0.8, 0.8]; effective: positions 3-4 capped at position 2's 0
  np.testing.assert_allclose(st["alpha"], [[1.0, 0.0, 0.8, 0.8]])
  # the choice: alpha 0.9 / 0.5 measured at positions 1-2, the prior 0.8 at 3-4.
  # By hand, costs 1, 1.3, 1.6, 1.8, 2.0: untested positions taken at face value give
  # tokens 1, 1.9, 2.35, 2.71, 2.998 -> per cost 1, 1.462, 1.469, 1.506, 1.499: G = 3;
  # capped at 0.5 they give 2.575 and 2.688 for G = 3, 4 -> 1.431, 1.344: G = 2.
  st = {**s.init_state(1, [1.0, 1.3, 1.6, 1.8, 2.0]),
        "alpha": jnp.asarray([[0.9, 0.5, 0.8, 0.8]]),
        "tested": jnp.asarray([[True, True, False, False]])}
  assert int(s.choose(st, jnp.asarray([True]))[0]) == 2
  # the same numbers measured (tested) are believed: G = 3
  assert int(s.choose({**st, "tested": jnp.ones((1, 4), bool)}, jnp.asarray([True]))[0]) == 3


def test_cycling_schedule_and_bad_settings():
  s = CyclingSchedule(2, offset=1)
  st = s.init_state(1, [1, 1, 1])
  seq = []
  for _ in range(5):
    g, _, st = s.choose(st, jnp.asarray([True]))
    seq.append(int(g))
  assert seq == [1, 2, 0, 1, 2]
  for bad in (dict(max_draft_tokens=0), dict(max_draft_tokens=2, prior=1.0),
              dict(max_draft_tokens=2, ema=0.0), dict(max_draft_tokens=2, probe_interval=0),
              dict(max_draft_tokens=2, relax=1.0), dict(max_draft_tokens=2, relax=-0.1)):
    with pytest.raises(ValueError):
      AutoSchedule(**bad)
  with pytest.raises(ValueError, match="costs"):
    AutoSchedule(2).init_state(1, [1.0, 2.0])


def _drive(s, st, n_rounds, accepted):
  """Runs ``choose`` / ``update`` of schedule ``s`` for ``n_rounds`` rounds
  of one row whose round at draft length g accepts ``accepted(g)`` drafts.
  Returns (draft length per round, state)."""
  active = jnp.asarray([True])
  gs = []
  while len(gs) < n_rounds:
    g, rounds, st = s.choose(st, active)
    for _ in range(min(int(rounds), n_rounds - len(gs))):
      gs.append(int(g))
      st = s.update(st, int(g), jnp.asarray([accepted(int(g))]), active)
  return gs, st


def test_probes_notice_text_that_turns_easy_at_a_bounded_cost():
  """Issue 49 item 6. The prior (0.1) is below the break-even (G = 1 pays
  above alpha 0.6 at these costs), so relaxing toward it never resumes
  drafting: only probes can. After 300 rounds of hard text (every draft
  rejected) the text turns easy (every draft accepted): the next probe
  must re-enable drafting, and most of the easy stretch is drafted. On the
  hard stretch the probes cost at most probe_rounds (cost(1) / cost(0) - 1)
  / (probe_interval rounds_per_choice) AR steps per round (the bound in
  ``AutoSchedule``'s docstring)."""
  costs = [1.0, 1.6, 1.7, 1.8]
  s = AutoSchedule(3, prior=0.1)
  hard, st = _drive(s, s.init_state(1, costs), 300, lambda g: 0)
  extra = sum(costs[g] / costs[0] - 1 for g in hard)
  bound = s.probe_rounds * (costs[1] / costs[0] - 1) / (s.probe_interval * s.rounds_per_choice)
  assert 0 < extra / len(hard) <= bound, (extra / len(hard), bound)
  assert set(hard) == {0, 1}                       # probes draft the cheapest draft, g = 1
  easy, _ = _drive(s, st, 600, lambda g: g)
  first = next(i for i, g in enumerate(easy) if g)
  # the first probe drafts within the current probe interval, and drafting then stays on
  assert first <= (int(st["probe_interval"]) + 1) * s.rounds_per_choice
  assert all(easy[first:]), easy[first:first + 40]


def test_no_probe_where_drafting_cannot_pay_even_at_full_acceptance():
  """A G = 1 round that costs 2.2 AR steps emits at most 2 tokens (the
  demo model at B = 4 on a CPU): no draft length can pay whatever the
  text, so a schedule that stopped drafting never probes (each probe would
  cost the module's catch-up besides). At cheaper drafts the probes
  return."""
  s = AutoSchedule(2, prior=0.1)
  gs, _ = _drive(s, s.init_state(1, [1.0, 2.2, 3.4]), 400, lambda g: g)
  assert set(gs) == {0}
  gs, _ = _drive(s, s.init_state(1, [1.0, 1.6, 2.2]), 400, lambda g: g)
  assert any(gs)
