"""Which path a generation takes: a fixed G (or AR) never enters "auto"'s
calibration (issue 50)."""

import numpy as np
import pytest

from decode.auto import calibrate
from decode.decoder import Decoder, SamplingParams
from tests.conftest import random_prompts


@pytest.mark.parametrize("kw", [dict(method="mtp", num_draft_tokens=3), dict(method="ar")])
def test_fixed_g_never_enters_calibration(trained_markov, monkeypatch, kw):
  _, model, _ = trained_markov
  called = []
  for name in ("start", "with_costs", "decoder_round_costs", "plain_ar_calibration"):
    monkeypatch.setattr(calibrate, name, lambda *a, name=name, **k: called.append(name))
  dec = Decoder(model, **kw)
  prompts = random_prompts([5, 7])
  sp = SamplingParams(0.0)
  dec.warm_up(prompts, 8, sp)
  gens = [dec.generate(prompts, 8, sp), dec.stream(prompts, 8, sp)]
  assert called == []
  assert all(len(t) == 8 for g in gens for t in g.tokens)
  np.testing.assert_array_equal(gens[0].tokens, gens[1].tokens)


def _compiled(dec, prompts, g):
  """(flops, bytes copied) of ``dec``'s compiled round at draft length g
  (None: its G)."""
  import re
  state, _ = dec.prepare(prompts, 16, 0)
  c = dec.programs.round.lower(dec.target_params, dec.draft_params,
                               SamplingParams(0.0).validate(), state, g).compile()
  cost = c.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  copied = 0
  for dtype, dims in re.findall(r"= ([a-z]+\d*)\[([\d,]*)\]\{[^}]*\} copy\(", c.as_text()):
    copied += int(np.prod([int(d) for d in dims.split(",") if d])) * int(dtype[-2:] if dtype[-2:].isdigit() else 8) // 8
  return cost["flops"], copied


def test_a_non_drafting_round_does_the_ar_steps_work(trained_markov):
  """Issue 51: an "auto" round at g = 0 is the plain AR step's program plus
  the schedule's bookkeeping and the target's hidden state stored for the
  modules: the same flops (the modules do not run) and no more bytes copied
  than the AR step's and that [B, 1, D] block (no cache copied), while a
  drafting round does more."""
  _, model, _ = trained_markov
  prompts = random_prompts([5, 7, 9, 3])
  ar_flops, ar_copied = _compiled(Decoder(model, "ar"), prompts, None)
  auto = Decoder(model, "mtp", num_draft_tokens="auto", max_draft_tokens=2)
  flops0, copied0 = _compiled(auto, prompts, 0)
  flops1, _ = _compiled(auto, prompts, 1)
  assert flops0 == pytest.approx(ar_flops, rel=1e-3)
  h0_block = len(prompts) * model.cfg.d_model * 4       # [B, 1, D] float32 stored for the modules
  assert copied0 <= ar_copied + h0_block, (copied0, ar_copied)
  assert flops1 > 1.2 * ar_flops


def test_the_fallback_builds_nothing_of_the_drafting_decoder(trained_markov, monkeypatch):
  """Issue 51: where "auto" decides not to draft, the decision is made on
  the host from its costs before any state of the drafting decoder is
  built, and no call merges the models again (a merge walks every module):
  the fallback's extra work over AR is the decision, and its tokens are
  AR's."""
  from decode import compiled as programs
  _, model, _ = trained_markov
  prompts = random_prompts([5, 7])
  sp = SamplingParams(0.0)
  auto = Decoder(model, "mtp", num_draft_tokens="auto", max_draft_tokens=2,
                 auto_costs=[1.0, 1e3, 1e3])            # no draft length can pay
  ar_gen = Decoder(model, "ar").generate(prompts, 8, sp)
  auto.generate(prompts, 8, sp)                         # compiles; builds the plain AR decoder
  prepared, merged = [], []
  real_prepare, real_models = Decoder.prepare, programs.ProgramSpec.models
  monkeypatch.setattr(Decoder, "prepare",
                      lambda self, *a, **k: prepared.append(self.method) or real_prepare(self, *a, **k))
  monkeypatch.setattr(programs.ProgramSpec, "models",
                      lambda self, *a: merged.append(1) or real_models(self, *a))
  gens = [auto.generate(prompts, 8, sp), auto.stream(prompts, 8, sp)]
  assert prepared == ["ar", "ar"], prepared
  assert merged == []
  for gen in gens:
    assert np.asarray(gen.draft_length_histogram)[:, 1:].sum() == 0
    np.testing.assert_array_equal(gen.tokens, ar_gen.tokens)


def test_auto_refuses_a_budget_past_max_seq_len_before_any_host_work(trained_markov,
                                                                     monkeypatch):
  """Issue 51 (break test): a budget of 2**31 - 1 tokens is refused as too
  long for the model before "auto"'s decision runs, whose expected rounds
  grow with the budget (it ran for minutes and meant 17 GB)."""
  from decode.errors import DecodeError
  _, model, _ = trained_markov
  auto = Decoder(model, "mtp", num_draft_tokens="auto", max_draft_tokens=2)
  decided = []
  monkeypatch.setattr(calibrate.AutoCalibration, "drafting_can_pay",
                      lambda *a, **k: decided.append(1) or True)
  with pytest.raises(DecodeError, match="max_seq_len"):
    auto.generate(random_prompts([5]), 2 ** 31 - 1, SamplingParams(0.0))
  assert decided == []
