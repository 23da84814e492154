"""decode.replay: schedules replayed on recorded greedy answers give exactly
the target calls and draft lengths of real decoding (the tiny Markov model,
D = 2, drafts past D from module 2 reused)."""

import numpy as np
import pytest

from decode import replay as rp
from decode.schedule import AutoSchedule
from decode.speculative import Decoder, SamplingParams
from tests.conftest import random_prompts, with_noisy_mtp

MAX_NEW = 40
COSTS = [1.0, 1.3, 1.5, 1.7]


@pytest.fixture(scope="module")
def recorded(trained_markov):
  """(model, [(prompt, greedy answer, acceptance [L, 3])]) with noisy modules,
  so drafts are rejected often enough for every round length to occur."""
  _, model, _ = trained_markov
  model = with_noisy_mtp(model, 0.6, seed=3)
  ar = Decoder(model, "ar")
  out = []
  for p in random_prompts([3, 9, 20], seed=5):
    ans = np.asarray(ar.generate([p], MAX_NEW, SamplingParams(0.0), seed=0).tokens[0])
    out.append((p, ans, rp.greedy_acceptance(model, p, ans, 3)))
  return model, out


def test_fixed_draft_lengths_replay_real_target_calls(recorded):
  model, rows = recorded
  for g in (1, 3):                     # 3 > D: module 2 reused
    dec = Decoder(model, "mtp", g)
    for p, ans, acc in rows:
      real = dec.generate([p], MAX_NEW, SamplingParams(0.0), seed=0)
      assert np.array_equal(np.asarray(real.tokens[0]), ans)          # lossless at T = 0
      r = rp.replay(acc, COSTS, MAX_NEW, g=g)
      assert r.rounds == int(real.target_calls[0]) and r.tokens == len(ans)
      assert r.time_s == pytest.approx(r.rounds * COSTS[g])
  # the acceptance is neither all True nor all False: the comparison has teeth
  allacc = np.concatenate([acc for _, _, acc in rows])
  assert 0.1 < allacc[:, 0].mean() < 0.95
  assert rp.replay(rows[0][2], COSTS, MAX_NEW, g=0).rounds == len(rows[0][1])     # AR


def test_auto_schedule_replays_the_real_choices(recorded):
  model, rows = recorded
  sched = AutoSchedule(3, prior=0.7, ema=0.3, rounds_per_choice=4, probe_rounds=2,
                       probe_interval=1)
  dec = Decoder(model, "mtp", "auto", max_draft_tokens=3, schedule=sched, auto_costs=COSTS)
  seen = set()
  for p, ans, acc in rows:
    real = dec.generate([p], MAX_NEW, SamplingParams(0.0), seed=0)
    r = rp.replay(acc, COSTS, MAX_NEW, schedule=sched)
    hist = np.bincount(r.draft_lengths, minlength=4)
    assert hist.tolist() == np.asarray(real.draft_length_histogram)[0].tolist()
    assert r.rounds == int(real.target_calls[0])
    seen |= set(r.draft_lengths)
  assert len(seen) >= 2                # the schedule changed its choice somewhere


def test_bad_arguments(recorded, trained_markov):
  model, rows = recorded
  p, ans, acc = rows[0]
  with pytest.raises(ValueError, match="exactly one"):
    rp.replay(acc, COSTS, MAX_NEW)
  with pytest.raises(ValueError, match="prompt of >= 2"):
    rp.greedy_acceptance(model, p[:1], ans, 2)
  with pytest.raises(ValueError, match="max_draft_tokens"):
    rp.greedy_acceptance(model, p, ans, 0)


@pytest.mark.slow
def test_script_records_once_and_replays(tmp_path, capsys):
  from scripts import replay_schedule as script
  from tests import tiny_bpe
  target = tiny_bpe.import_tiny_workdir(str(tmp_path), mtp_depth=1)
  out, rec = str(tmp_path / "replay"), str(tmp_path / "rec.npz")
  argv = ["--workdir", target, "--per_category", "1", "--max_new_tokens", "8",
          "--costs", "1,1.2,1.4", "--max_draft_tokens", "2", "--records", rec,
          "--variants", "slow:ema=0.05,relax=0.0", "--out", out]
  assert script.main(argv) == 0
  import json
  res = json.load(open(out + ".json"))
  rows = res["results"]["rows"]
  assert len(rows) == 6 and {r["category"] for r in rows} >= {"code", "math", "writing"}
  for r in rows:
    assert r["G0"]["rounds"] == r["tokens"] and r["G0"]["speedup"] == 1.0
    assert {"G1", "G2", "auto", "slow", "auto/best", "slow/best"} <= set(r)
    assert sum(r["auto"]["draft_lengths"]) == r["auto"]["rounds"]
  assert res["meta"]["relative_costs"] == [1.0, 1.2, 1.4]
  capsys.readouterr()
  assert script.main(argv) == 0                      # the records are read, nothing decoded
  assert "read 6 recorded answers" in capsys.readouterr().out
  assert json.load(open(out + ".json"))["results"]["rows"] == rows
  with pytest.raises(SystemExit):
    script.main([*argv[:-2], "--costs", "1,2", "--out", out])   # G_max = 2 needs 3 costs
