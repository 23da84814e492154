"""Which path a generation takes: a fixed G (or AR) never enters "auto"'s
calibration (issue 50)."""

import numpy as np
import pytest

from decode import calibrate
from decode.speculative import Decoder, SamplingParams
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
