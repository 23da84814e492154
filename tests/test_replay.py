"""experiments/replay_schedule.py's replay: schedules replayed on recorded
greedy answers give exactly the target calls and draft lengths of real
decoding (the tiny Markov model, D = 2, drafts past D from module 2
reused); at T > 0 the replay on AR-sampled answers has the law of real
speculative decoding (a two-sample test of mean target calls, and a replay
with the wrong acceptance probabilities fails it)."""

import numpy as np
import pytest

from decode.auto.schedule import AutoSchedule
from decode.decoder import Decoder, SamplingParams
from experiments import replay_schedule as rp
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
  for p in random_prompts([3, 6, 8], seed=5):     # one prompt bucket (8): one shape
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


def test_sampled_acceptance_tends_to_greedy_as_temperature_falls(recorded):
  """The T > 0 path (warped p and q, min(p, q)(x) / p(x)) at T = 1e-3 on the
  greedy answers: the same 0/1 acceptance as the argmax path, position by
  position (an off-by-one in either path breaks it)."""
  model, rows = recorded
  for p, ans, acc in rows:
    rho = rp.acceptance_probs(model, p, ans, 3, SamplingParams(1e-3))
    assert rho.dtype == np.float32 and rho.shape == acc.shape
    assert np.mean((rho > 0.5) == acc) > 0.98


def _mean_se(x):
  x = np.asarray(x, np.float64)
  return x.mean(), x.std(ddof=1) / np.sqrt(len(x))


def test_sampled_replay_has_the_law_of_real_decoding(trained_markov):
  """At T = 1 (and top-p 0.9) replaying G = 3 on AR-sampled answers with
  acceptance drawn from ``acceptance_probs`` gives the same mean target calls
  per answer as real speculative decoding (two-sample z-test, |z| < 4 over
  N = 96 + 96 answers; measured |z| < 1), while the replay with slightly
  wrong probabilities rho^1.5 is rejected (|z| > 4; measured 6.4-7.0).
  Modules with noise 1.5 x std: alpha_1 ~0.35, so every draft position
  matters."""
  model = with_noisy_mtp(trained_markov[1], 1.5, seed=3)
  prompt = random_prompts([6], seed=11)[0]
  n, g = 96, 3
  for params in (SamplingParams(1.0), SamplingParams(1.0, 0, 0.9)):
    real = Decoder(model, "mtp", g).generate([prompt] * n, MAX_NEW, params, seed=1)
    answers = Decoder(model, "ar").generate([prompt] * n, MAX_NEW, params, seed=2).tokens
    rng = np.random.default_rng(0)
    right, wrong = [], []
    for ans in answers:
      rho = rp.acceptance_probs(model, prompt, np.asarray(ans, np.int32), g, params)
      right.append(rp.replay(rp.draw_acceptance(rho, rng), COSTS, MAX_NEW, g=g).rounds)
      wrong.append(rp.replay(rp.draw_acceptance(rho ** 1.5, rng), COSTS, MAX_NEW, g=g).rounds)
    (m_real, se_real), (m_right, se_right), (m_wrong, se_wrong) = map(
        _mean_se, (np.asarray(real.target_calls), right, wrong))
    z_right = (m_right - m_real) / np.hypot(se_real, se_right)
    z_wrong = (m_wrong - m_real) / np.hypot(se_real, se_wrong)
    assert 15 < m_real < MAX_NEW - 5                     # drafts neither always nor never accepted
    assert abs(z_right) < 4, (params, m_real, m_right, z_right)
    assert abs(z_wrong) > 4, (params, m_real, m_wrong, z_wrong)


def test_compare_averages_draws(recorded):
  """compare at T > 0: one row per record, rounds averaged over the draws
  (histograms summed), AR rounds = tokens, the same seed the same rows and
  another seed other ones; bool records are replayed once."""
  _, rows = recorded
  recs = [{"category": "c", "index": i, "sample": 0, "prompt": p, "answer": ans,
           "acc": np.where(acc, 0.7, 0.2).astype(np.float32)} for i, (p, ans, acc) in enumerate(rows)]
  sched = {"auto": AutoSchedule(3)}
  out = rp.compare(recs, COSTS, MAX_NEW, sched, draws=5, seed=3)
  assert len(out) == len(recs)
  for r, rec in zip(out, recs):
    assert r["G0"]["rounds"] == len(rec["answer"]) and r["G0"]["speedup"] == 1.0
    assert sum(r["G2"]["draft_lengths"]) == pytest.approx(5 * r["G2"]["rounds"])
    assert r["G2"]["draft_lengths"][2] == sum(r["G2"]["draft_lengths"])
  assert rp.compare(recs, COSTS, MAX_NEW, sched, draws=5, seed=3) == out
  assert rp.compare(recs, COSTS, MAX_NEW, sched, draws=5, seed=4) != out
  greedy = rp.compare([{**recs[0], "acc": rows[0][2]}], COSTS, MAX_NEW, sched, draws=5)
  assert sum(greedy[0]["G1"]["draft_lengths"]) == greedy[0]["G1"]["rounds"]     # one replay
  summary = rp.by_category(out, ["G0", "G1", "G2", "G3", "auto"], ["auto"])
  assert set(summary) == {"c", "all"} and summary["all"]["answers"] == len(recs)
  assert summary["all"]["auto/best_min"] <= summary["all"]["auto/best"]
  with pytest.raises(ValueError, match="draws"):
    rp.compare(recs, COSTS, MAX_NEW, {}, draws=0)


@pytest.mark.slow
def test_script_records_once_and_replays(tmp_path, capsys):
  from experiments import replay_schedule as script
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
  with pytest.raises(SystemExit):
    script.main([*argv[:-2], "--ar_step", "0", "--out", out])
  out3 = str(tmp_path / "plain")                     # a plain AR step below auto's g = 0 round
  assert script.main([*argv[:-2], "--ar_step", "0.5", "--out", out3]) == 0
  res3 = json.load(open(out3 + ".json"))
  assert res3["meta"]["relative_costs"] == [2.0, 2.4, 2.8] and res3["meta"]["ar_step"] == 0.5
  for r in res3["results"]["rows"]:
    assert r["G0"]["time"] == pytest.approx(0.5 * r["tokens"])
  # --answers: the same answers rescored with the same modules give the same rows
  out2 = str(tmp_path / "rescored")
  i = argv.index("--records")
  assert script.main([*argv[:i], *argv[i + 2:-2], "--answers", rec, "--out", out2]) == 0
  assert "rescored 6 answers" in capsys.readouterr().out
  assert json.load(open(out2 + ".json"))["results"]["rows"] == rows
  with pytest.raises(SystemExit):
    script.main([*argv[:-2], "--answers", rec, "--out", out2])   # with --records


@pytest.mark.slow
def test_script_replays_sampled_answers(tmp_path, capsys):
  """--temperature 1: two sampled answers per prompt, probabilities in the
  records, a per-category table; records of another temperature are refused
  before anything is decoded."""
  from experiments import replay_schedule as script
  from tests import tiny_bpe
  import json
  target = tiny_bpe.import_tiny_workdir(str(tmp_path), mtp_depth=1)
  out, rec = str(tmp_path / "replay"), str(tmp_path / "rec.npz")
  argv = ["--workdir", target, "--per_category", "1", "--max_new_tokens", "8",
          "--costs", "1,1.2,1.4", "--max_draft_tokens", "2", "--records", rec,
          "--temperature", "1", "--samples", "2", "--draws", "3", "--out", out]
  assert script.main(argv) == 0
  res = json.load(open(out + ".json"))
  rows = res["results"]["rows"]
  assert len(rows) == 12 and {r["sample"] for r in rows} == {0, 1}
  assert res["meta"]["sampling"] == [1.0, 0, 1.0] and res["meta"]["draws"] == 3
  assert "all" in res["results"]["by_category"]
  assert rp.load_sampling(rec) == (1.0, 0, 1.0)
  assert all(r["acc"].dtype == np.float32 for r in rp.load_records(rec))
  assert "## Per category" in open(out + ".md").read()
  capsys.readouterr()
  with pytest.raises(SystemExit):
    script.main([*argv[:-2], "--temperature", "0.7", "--out", out])
  assert "holds answers sampled at" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    script.main([*argv, "--temperature", "0"])          # samples 2 at T = 0


def test_a_schedule_that_cannot_pay_replays_as_plain_ar(recorded):
  _, rows = recorded
  acc = rows[0][2]
  r = rp.replay(acc, [1.0, 3.0, 5.0, 7.0], MAX_NEW, schedule=AutoSchedule(3, prior=0.7))
  assert set(r.draft_lengths) == {0} and r.rounds == len(rows[0][1])
  r = rp.replay(acc, COSTS, MAX_NEW, schedule=AutoSchedule(3, prior=0.7))
  assert max(r.draft_lengths) > 0


def test_replay_decides_with_the_budget_and_prefill_as_the_decoder(recorded):
  """Per token G = 1 pays at these costs, but a 1-token budget cannot win
  back a round dearer than an AR step, nor a large budget a prefill charge
  above its whole saving: both replay as plain AR (``drafting_pays`` with
  the budget, as ``Decoder.generate`` decides)."""
  _, rows = recorded
  acc = rows[0][2]
  sched = AutoSchedule(3, prior=0.7)
  assert set(rp.replay(acc, COSTS, 1, schedule=sched).draft_lengths) == {0}
  assert max(rp.replay(acc, COSTS, MAX_NEW, schedule=sched).draft_lengths) > 0
  r = rp.replay(acc, COSTS, MAX_NEW, schedule=sched, extra_prefill_s=10.0 * MAX_NEW)
  assert set(r.draft_lengths) == {0}


def test_plain_ar_step_prices_g0_and_the_fallback(recorded):
  """``ar_step_s``: G0 and a schedule that falls back to plain AR cost the
  plain step per round, drafting rounds keep their costs (auto's own g = 0
  round included), and ``drafting_pays`` compares with the plain step: a
  cheaper plain AR step turns a schedule that drafts into plain AR."""
  _, rows = recorded
  acc, n = rows[0][2], len(rows[0][1])
  ar = rp.replay(acc, COSTS, MAX_NEW, g=0, ar_step_s=0.8)
  assert ar.rounds == n and ar.time_s == pytest.approx(0.8 * n)
  g1 = rp.replay(acc, COSTS, MAX_NEW, g=1, ar_step_s=0.8)
  assert g1.time_s == pytest.approx(g1.rounds * COSTS[1])
  sched = AutoSchedule(3, prior=0.7)
  drafts = rp.replay(acc, COSTS, MAX_NEW, schedule=sched, ar_step_s=1.0)
  assert max(drafts.draft_lengths) > 0
  assert drafts.time_s == pytest.approx(sum(COSTS[g] for g in drafts.draft_lengths))
  assert drafts == rp.replay(acc, COSTS, MAX_NEW, schedule=sched)      # default: costs[0]
  # at 0.45 per plain step no draft length beats AR per token at prior 0.7
  # (G = 1: 1.3 / 1.7 = 0.76 per token): the decoder would not draft
  fallback = rp.replay(acc, COSTS, MAX_NEW, schedule=sched, ar_step_s=0.45)
  assert set(fallback.draft_lengths) == {0} and fallback.time_s == pytest.approx(0.45 * n)
  recs = [{"category": "c", "index": 0, "sample": 0, "prompt": rows[0][0], "answer": rows[0][1],
           "acc": acc}]
  row = rp.compare(recs, COSTS, MAX_NEW, {"auto": sched}, ar_step_s=0.8)[0]
  assert row["G0"]["time"] == pytest.approx(0.8 * n)
  assert row["G1"]["speedup"] == pytest.approx(0.8 * n / g1.time_s)


def test_script_refuses_a_workdir_without_a_chat_template(markov_workdir, capsys):
  from experiments import replay_schedule as script
  with pytest.raises(SystemExit) as e:
    script.main(["--workdir", markov_workdir, "--costs", "1,1.2,1.4", "--max_draft_tokens", "2"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--workdir=" in err and "has no chat template" in err, err
