"""--num_draft_tokens auto at a large batch: its start-up (the calibration of
round costs) does not grow with the batch beyond a fixed number of rounds
of each program it times, and nothing is calibrated or compiled for
drafting when no draft length can beat AR whatever the costs."""

import dataclasses

import numpy as np

from decode.auto import calibrate
from decode.auto.schedule import AutoSchedule
from decode.decoder import Decoder, SamplingParams
from tests.conftest import random_prompts


def test_the_plan_keeps_the_timed_work_of_sixteen_rows():
  """Up to CALIBRATION_ROWS rows the full plan (every benchmarked batch
  size gets the full plan); above, rows x rounds x calls per draft length
  stay those of CALIBRATION_ROWS rows until one round and three calls are
  left, and the prefill timings keep their rows the same way."""
  full = calibrate.CALIBRATION_ROUNDS * calibrate.CALIBRATION_REPEATS
  for b in range(1, calibrate.CALIBRATION_ROWS + 1):
    assert calibrate.calibration_plan(b) == (calibrate.CALIBRATION_ROUNDS,
                                             calibrate.CALIBRATION_REPEATS)
    assert calibrate.prefill_repeats(b) == calibrate.PREFILL_REPEATS
  for b in range(1, 20000, 7):
    rounds, repeats = calibrate.calibration_plan(b)
    assert 1 <= rounds <= calibrate.CALIBRATION_ROUNDS
    assert calibrate.MIN_CALIBRATION_REPEATS <= repeats <= calibrate.CALIBRATION_REPEATS
    assert b * rounds * repeats <= max(calibrate.CALIBRATION_ROWS * full,
                                       b * calibrate.MIN_CALIBRATION_REPEATS), b
    assert 1 <= b * calibrate.prefill_repeats(b) <= max(
        calibrate.CALIBRATION_ROWS * calibrate.PREFILL_REPEATS, b)
  assert calibrate.calibration_plan(1000) == (1, calibrate.MIN_CALIBRATION_REPEATS)


class Work:
  """Per jitted program a decoder runs (its ``Programs`` replaced by
  counting wrappers): calls, and rows x rounds (a prefill counts its rows,
  a generate call, while_loop or stream step, the rounds it ran)."""

  def __init__(self):
    self.work, self.calls = {}, {}

  def watch(self, dec: Decoder, name: str) -> None:
    def counting(field):
      real = getattr(dec.programs, field)

      def call(*args, **kw):
        state = args[4] if field == "generate" else args[2]  # (params, draft, sp, limit, state)
        rows, before = int(state.tokens.shape[0]), int(state.rounds)
        out = real(*args, **kw)                             # (the state is donated)
        rounds = int(out.rounds) - before if field == "generate" else 1
        key = f"{name}.{field}"
        self.work[key] = self.work.get(key, 0) + rows * rounds
        self.calls[key] = self.calls.get(key, 0) + 1
        return out
      return call
    dec.programs = dataclasses.replace(dec.programs, **{f: counting(f) for f in (
        "prefill", "generate")})


def _calibration_work(model, batch: int, form: str) -> Work:
  """The programs "auto" (G_max = 1) runs to calibrate one batch shape."""
  dec = Decoder(model, "mtp", "auto", max_draft_tokens=1)
  work = Work()
  work.watch(dec, "auto")
  work.watch(dec.plain_ar(), "ar")
  prompts = random_prompts([5] * batch, seed=batch)
  calibrate.measured_costs(dec, prompts, 64, SamplingParams(1.0).validate(), form=form)
  return work


def test_stream_calibration_at_a_large_batch_is_the_work_of_sixteen_rows(trained_markov):
  """The rows x rounds "auto" runs to calibrate 128 rows in the stream form
  are at most those of 16 rows under the full plan (16 x those of one row),
  its prefills two of the batch (one compiles, one is timed), all in no
  more calls than at one row: each program's share of the start-up stops
  growing with the batch (a fixed plan would run 128-fold the work of one
  row). The rounds still run at the batch itself, whose costs they are."""
  _, model, _ = trained_markov
  one, many = _calibration_work(model, 1, "stream"), _calibration_work(model, 128, "stream")
  assert set(one.work) == set(many.work) == {"auto.prefill", "auto.generate", "ar.prefill",
                                             "ar.generate"}
  for key in one.work:
    bound = calibrate.CALIBRATION_ROWS * one.work[key]
    if key.endswith("prefill"):
      bound = max(bound, 2 * 128)
    assert many.work[key] <= bound, (key, one.work, many.work)
    assert many.calls[key] <= one.calls[key], (key, one.calls, many.calls)


def test_while_calibration_at_a_large_batch_is_the_work_of_sixteen_rows(trained_markov):
  """The same in the while_loop form, whose calls run a budget of n (g + 1)
  tokens (their rounds: up to n (g + 1) for the batch's slowest row): at
  128 rows each program's rows x rounds stay within the full plan's at 16
  rows, all rounds of every call at their most."""
  _, model, _ = trained_markov
  many = _calibration_work(model, 128, "while")
  full = (calibrate.CALIBRATION_ROWS * calibrate.CALIBRATION_ROUNDS
          * (calibrate.CALIBRATION_REPEATS + 1))
  assert many.work["auto.generate"] <= full * (1 + 2), many.work       # g = 0, 1
  assert many.work["ar.generate"] <= full, many.work
  assert many.work["auto.prefill"] <= 128 * 2 and many.work["ar.prefill"] <= 128 * 2


def test_no_calibration_when_no_draft_length_can_beat_ar(trained_markov):
  """2 new tokens for 64 rows at a prior of 0.5: the batch's slowest row
  is expected to need both rounds at every G, so no measured costs could
  make drafting pay (``AutoSchedule.drafting_can_pay``); "auto" measures
  nothing, runs no program of its own, and returns the plain AR decoder's
  generation (the same tokens at T = 1 for the seed) in its shape. One row
  with the same budget can gain a round: that one is calibrated."""
  _, model, _ = trained_markov
  sched = AutoSchedule(2, prior=0.5)
  assert not sched.drafting_can_pay(False, 2, 64) and sched.drafting_can_pay(False, 2, 1)
  assert sched.drafting_can_pay(False, 64, 64)
  prompts = random_prompts([5] * 64, seed=3)
  sp = SamplingParams(1.0)
  for form in ("stream", "generate"):
    dec = Decoder(model, "mtp", "auto", schedule=sched)
    work = Work()
    work.watch(dec, "auto")
    gen = getattr(dec, form)(prompts, 2, sp, 7)
    ref = getattr(Decoder(model, "ar"), form)(prompts, 2, sp, 7)
    assert work.calls == {} and dec.calibration.costs == {} and dec.calibration.plain == {}
    for a, b in zip(gen.tokens, ref.tokens):
      np.testing.assert_array_equal(a, b)
    assert gen.num_draft_tokens == 2 and gen.draft_length_histogram[:, 1:].sum() == 0
