"""python -m decode --compare read in one pass: per method a block of its
timed repeats (medians with min-max), a speedup line that is the ratio of
the blocks' median tokens/s, Theorem 3.8's prediction from the measured tau
and round cost, and one line naming the term that decides; the per-category
comparison compiles nothing inside its timed repeats. No timed assertions:
the numbers are checked against each other, never against a speed."""

import io
import json
import re

import jax
import numpy as np
import pytest

from decode.cli import compare as compare_lib
from decode.cli import theory
from decode.cli.run import DecodeRequest, run
from decode.decoder import Decoder, SamplingParams

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
SPAN = r"([\d.]+) ms \(([\d.]+)-([\d.]+)\)"


@pytest.fixture(scope="module")
def workdir(markov_workdir):
  return markov_workdir


# -- the prediction and the verdict, from injected numbers ----------------------


def _pred(tau, r, g=1, form="chain", alphas=None):
  return compare_lib.predict_speedup(tau=tau, alphas=alphas, mean_draft_tokens=g,
                                     round_s=r * 1e-3, ar_step_s=1e-3, form=form)


def test_prediction_is_theorem_3_8_with_the_measured_cost():
  """c = (round / AR step - 1) / G, and the prediction tau / (G c + 1): for a
  chain through chain_speedup with the alphas (whose chain_tau is tau)."""
  alphas = [0.8, 0.5]
  tau = theory.chain_tau(alphas)                        # 1 + 0.8 + 0.4
  p = _pred(tau, 1.6, g=2, alphas=alphas)
  assert p["cost_ratio"] == pytest.approx(0.3) and p["round_ar_steps"] == pytest.approx(1.6)
  assert p["predicted_speedup"] == pytest.approx(tau / 1.6)
  assert p["predicted_speedup"] == pytest.approx(theory.chain_speedup(alphas, 0.3))
  q = _pred(1.7, 1.5, g=0.8, form="auto")               # auto: a mean G, tau measured
  assert q["cost_ratio"] == pytest.approx(0.5 / 0.8)
  assert q["predicted_speedup"] == pytest.approx(theory.speedup_from_tau(1.7, 0.8, 0.625))
  assert q["predicted_speedup"] == pytest.approx(1.7 / 1.5)
  none = _pred(1.0, 1.02, g=0, form="auto")             # auto ran AR: G = 0
  assert none["cost_ratio"] is None and none["predicted_speedup"] == 1.0
  assert theory.cost_ratio_from_round(1.48, 1) == pytest.approx(0.48)
  with pytest.raises(ValueError, match="num_draft_tokens"):
    theory.cost_ratio_from_round(1.2, 0)


def test_verdict_when_drafting_does_not_pay():
  p = _pred(1.455, 1.48)
  line = compare_lib.verdict_line(p, 0.96, 0.93, 1.01, decode_speedup=0.98)
  assert line == ("tau 1.455 but a round costs 1.480 AR steps (c = 0.480 per draft token): "
                  "drafting does not pay here; predicted 0.98x, measured 0.96x (0.93-1.01x)")


def test_verdict_when_drafting_pays():
  p = _pred(2.4, 1.6, g=2, form="auto")
  line = compare_lib.verdict_line(p, 1.48, 1.40, 1.55, decode_speedup=1.5)
  assert line.startswith("tau 2.400 over a round of 1.600 AR steps (c = 0.300 per draft token): "
                         "drafting pays here; predicted 1.50x, measured 1.48x (1.40-1.55x)")
  assert "outside" not in line
  tree = compare_lib.verdict_line(_pred(2.4, 1.6, g=4, form="tree"), 1.5, 1.4, 1.6)
  assert "(c = 0.150 per drafted node)" in tree


def test_verdict_says_when_auto_drafted_in_some_repeats_only():
  """A pooled tau and round over repeats where "auto" drafted and repeats
  where it ran AR describe neither: the line names the count and the
  per-repeat predictions' range; all or none drafting adds nothing."""
  p = _pred(1.125, 1.036, g=0.25, form="auto")
  line = compare_lib.verdict_line(p, 0.98, 0.97, 1.00, auto_repeats=(1, 3, 1.0, 1.0001))
  assert ("predicted 1.09x, measured 0.98x (0.97-1.00x) (auto drafted in 1 of 3 repeats: the "
          "pooled tau and round mix them; per-repeat predictions 1.00-1.00x); outside") in line
  for every in ((3, 3, 1.05, 1.2), (0, 3, 1.0, 1.0)):
    assert "auto drafted" not in compare_lib.verdict_line(p, 0.98, 0.97, 1.0, auto_repeats=every)


def test_verdict_names_the_term_when_measured_and_predicted_disagree():
  """Outside the per-repeat range the line says which left-out term accounts
  for more of the gap: the prefill (the whole call against the decoding
  phase) or rounds emitting fewer tokens than tau (the decoding phase
  against the prediction)."""
  p = _pred(2.0, 1.4)                                   # predicts 1.43x
  prefill = compare_lib.verdict_line(p, 1.05, 1.00, 1.10, decode_speedup=1.40,
                                     prefill_share=(0.35, 0.20))
  assert "predicted 1.43x, measured 1.05x (1.00-1.10x); outside the measured range" in prefill
  assert "the prefill and per-call work decide it" in prefill
  assert "mtp 35% of its wall, AR 20%; decoding phase alone 1.40x" in prefill
  cut = compare_lib.verdict_line(p, 1.05, 1.00, 1.10, decode_speedup=1.08,
                                 emitted_per_round=1.55)
  assert "rounds emit fewer tokens than tau (1.55 per row and batched round vs tau 2.00" in cut
  assert "prefill" not in cut
  faster = compare_lib.verdict_line(_pred(1.2, 1.3), 1.30, 1.25, 1.35, decode_speedup=1.32)
  assert "drafting does not pay here" in faster and "ran faster than its rounds predict" in faster
  ar_only = compare_lib.verdict_line(_pred(1.0, 1.0, g=0, form="auto"), 0.99, 0.97, 1.01)
  assert ar_only.startswith("mtp ran plain AR steps") and "outside" not in ar_only
  assert ar_only.endswith("predicted 1.00x, measured 0.99x (0.97-1.01x)")
  # within the printed rounding of the range is agreement
  assert "outside" not in compare_lib.verdict_line(p, 1.40, 1.38, 1.42, decode_speedup=1.4)


# -- the printed report of a real --compare ---------------------------------------


def _blocks(err: str) -> dict:
  """{name: {"tok/s": (median, min, max), ...}} of the printed timed blocks."""
  out = {}
  for m in re.finditer(r"^\[(\w+)\] timed: median \(min-max\) over (\d+) interleaved repeats\n"
                       r"  throughput ([\d.]+) tok/s \(([\d.]+)-([\d.]+)\)  wall " + SPAN +
                       r".*\n  TTFT " + SPAN + "  ITL p50 " + SPAN + "  p90 " + SPAN, err, re.M):
    v = [float(x) for x in m.groups()[2:]]
    out[m.group(1)] = {"repeats": int(m.group(2)), "tok/s": v[0:3], "wall": v[3:6],
                       "ttft": v[6:9], "itl_p50": v[9:12], "itl_p90": v[12:15]}
  return out


def test_compare_prints_timed_blocks_whose_medians_make_the_speedup(workdir):
  err = io.StringIO()
  report = run(DecodeRequest(workdir, ["abca"], method="mtp", num_draft_tokens=2, max_new_tokens=24,
                             sampling=SamplingParams(temperature=0.0), compare=True, repeats=3),
               out=io.StringIO(), err=err).to_json()
  text = err.getvalue()
  blocks = _blocks(text)
  assert set(blocks) == {"ar", "mtp"} and all(b["repeats"] == 3 for b in blocks.values())
  for b in blocks.values():                            # medians inside their spreads
    for key in ("tok/s", "wall", "ttft", "itl_p50", "itl_p90"):
      med, lo, hi = b[key]
      assert lo <= med <= hi, (key, b[key])
  # the answer's own block shows no timing: it is the first repeat, in the blocks
  answer = text[text.index("[mtp, the answer above]"):text.index("--compare:")]
  assert "throughput" not in answer and "this answer is mtp's first timed repeat" in answer
  (line,) = [l for l in text.splitlines() if l.startswith("speedup over AR:")]
  m = re.match(r"speedup over AR: ([\d.]+)x = ([\d.]+) / ([\d.]+) tok/s, the median throughputs "
               r"above \(3 interleaved repeats, per repeat ([\d.]+)x-([\d.]+)x", line)
  assert m, line
  speedup, num, den, lo, hi = map(float, m.groups())
  assert (num, den) == (blocks["mtp"]["tok/s"][0], blocks["ar"]["tok/s"][0])
  assert speedup == pytest.approx(num / den, abs=0.005 + num / den * (0.05 / num + 0.05 / den))
  assert "(greedy outputs identical)" in line
  # the report carries the same numbers
  timed = report["timed"]
  for k in ("ar", "mtp"):
    assert report["tokens_per_s"][k] == timed[k]["tokens_per_s"]["median"]
    assert f"{timed[k]['tokens_per_s']['median']:.1f}" == f"{blocks[k]['tok/s'][0]:.1f}"
    assert set(timed[k]["ttft_s"]) == {"median", "min", "max"} and timed[k]["repeats"] == 3
  assert report["speedup"] == pytest.approx(timed["mtp"]["tokens_per_s"]["median"]
                                            / timed["ar"]["tokens_per_s"]["median"])
  assert f"{report['speedup']:.2f}" == f"{speedup:.2f}"
  assert min(report["speedup_per_repeat"]) == pytest.approx(lo, abs=0.006)
  assert max(report["speedup_per_repeat"]) == pytest.approx(hi, abs=0.006)
  # the prediction and the verdict follow the speedup line
  lines = text.splitlines()
  i = lines.index(line)
  assert lines[i + 1].startswith("predicted by Theorem 3.8 (decode.cli.theory.speedup_from_tau): ")
  pred = report["prediction"]
  assert lines[i + 2] == pred["line"] and "drafting" in pred["line"]
  assert f"predicted {pred['predicted_speedup']:.2f}x, measured {speedup:.2f}x" in pred["line"]
  assert pred["tau"] == pytest.approx(timed["mtp"]["tokens"] / timed["mtp"]["target_calls"])
  assert len(pred["predicted_per_repeat"]) == 3 and pred["draft_tokens"] == 2
  assert "ar_stats" in report and "[ar] tokens" not in text      # AR's untimed run: JSON only
  # T = 0 and a correct rule: the greedy check finds nothing and prints no verdict line
  assert report["greedy_check"] == {"identical": True, "mismatches": [], "bug": False}
  assert "(greedy outputs identical)" in line and "near-tie" not in text and "a bug" not in text
  json.dumps(report)


def test_category_compare_compiles_nothing_while_timing(workdir, monkeypatch):
  """Each category's smaller batch is a new shape: the method's decoder is
  warmed up for it before its timed repeats, so no compilation lands in
  them (for AR as well)."""
  compiles, timing = [], [False]

  def on_compile(event, duration, **_):
    if event == COMPILE_EVENT and timing[0]:
      compiles.append(duration)
  real = compare_lib.interleaved_times

  def timed(*a, **k):
    timing[0] = True
    try:
      return real(*a, **k)
    finally:
      timing[0] = False
  monkeypatch.setattr(compare_lib, "interleaved_times", timed)
  jax.monitoring.register_event_duration_secs_listener(on_compile)
  try:
    prompts = [{"prompt": "abca", "category": "x"}, {"prompt": "fed", "category": "y"}]
    report = run(DecodeRequest(workdir, prompts, method="mtp", num_draft_tokens=1, max_new_tokens=8,
                               sampling=SamplingParams(temperature=0.0), compare=True, repeats=1),
                 out=io.StringIO(), err=io.StringIO()).to_json()
  finally:
    jax.monitoring.unregister_event_duration_listener(on_compile)
  assert set(report["per_category"]) == {"x", "y"}
  assert all(np.isfinite(v["speedup"]) for v in report["per_category"].values())
  assert compiles == []


# -- every printed number rebuilt from the others and from the --json report ------

NUM = r"(\d+(?:\.\d+)?)"


def _one(pattern: str, text: str) -> tuple:
  """The groups of the one line matching ``pattern`` (re.M), as strings."""
  found = re.findall(pattern, text, re.M)
  assert len(found) == 1, (pattern, text)
  return found[0] if isinstance(found[0], tuple) else (found[0],)


def _close(printed: float, exact: float, decimals: int) -> bool:
  """``printed`` is ``exact`` shown with ``decimals`` decimals."""
  return abs(printed - exact) <= 0.5 * 10 ** -decimals + 1e-9


def _rebuild(report: dict, text: str, method: str = "mtp") -> None:
  """Every ratio and derived number of --compare's printed report rebuilt
  from the printed inputs beside it (to their printed rounding) and from
  the JSON report (exactly)."""
  report = json.loads(json.dumps(report))            # what --json writes
  timed, n = report["timed"], report["repeats"]
  # the answer IS the method's first timed repeat: its statistics are that run's
  assert report["answer_repeat"] == 0
  assert report["stats"]["wall_time_s"] == report["wall_times_s"][method][0]
  assert report["stats"]["num_tokens"] == report["new_tokens"][method][0]
  # the answer's block: tau = tokens / target calls
  tokens, calls, tau = _one(rf"^\[{method}, the answer above\] tokens (\d+)  target calls (\d+)"
                            rf"  tau {NUM} \(tokens / target calls", text)
  assert int(tokens) == report["stats"]["num_tokens"] == len(report["results"][0]["tokens"])
  assert int(calls) == report["stats"]["target_calls"]
  assert _close(float(tau), int(tokens) / int(calls), 3)
  # each block: throughput = new tokens / wall; the decoding phase; tau = tokens / calls
  rounds = {}
  for k in ("ar", method):
    tps, wall, new = _one(rf"^\[{k}\] timed: .*\n  throughput {NUM} tok/s .*  wall {NUM} ms .*"
                          rf"new tokens {NUM} per call", text)
    t = timed[k]
    assert float(new) == t["new_tokens"] == np.mean(report["new_tokens"][k])
    assert _close(float(wall), 1e3 * np.median(report["wall_times_s"][k]), 2)
    assert _close(float(tps), t["new_tokens"] / np.median(report["wall_times_s"][k]), 1)
    rmed, rlo, rhi, rnd = _one(rf"^\[{k}\] timed: (?:.*\n){{3}}  decoding phase: {NUM} ms "
                               rf"\({NUM}-{NUM}\) per round, {NUM} rounds per call \(mean", text)
    assert _close(float(rmed), 1e3 * t["round_s"]["median"], 3)
    assert float(rlo) <= float(rmed) <= float(rhi)
    assert _close(float(rnd), t["rounds_mean"], 1)
    assert t["rounds_mean"] * n == t["target_calls"]            # one row: a round is a call
    rounds[k] = float(rmed)
  tau, tokens, calls, g = map(float, _one(
      rf"^\[{method}\] timed: (?:.*\n){{4}}  tau {NUM} = (\d+) tokens / (\d+) target calls over "
      rf"the {n} repeats .* drafted per call", text)[:3] + _one(
      rf"^  tau .* G {NUM} drafted per call", text))
  t = timed[method]
  assert tokens == t["tokens"] == sum(report["new_tokens"][method])
  assert calls == t["target_calls"] and _close(tau, tokens / calls, 3)
  per_round = float(new) / float(rnd)                         # new tokens per call / rounds
  assert abs(tau - per_round) <= 0.0005 + per_round * 0.05 / float(rnd)
  assert _close(g, t["mean_draft_tokens"], 2)
  # the speedup: the ratio of the printed medians; the per-repeat ratios' range and median
  line = _one(r"^(speedup over AR: .*)$", text)[0]
  sp, num, den, lo, hi = map(float, re.match(
      rf"speedup over AR: {NUM}x = {NUM} / {NUM} tok/s, the median throughputs above "
      rf"\({n} interleaved repeats, per repeat {NUM}x-{NUM}x", line).groups())
  assert (num, den) == (float(_one(rf"^\[{method}\] timed: .*\n  throughput {NUM}", text)[0]),
                        float(_one(r"^\[ar\] timed: .*\n  throughput " + NUM, text)[0]))
  assert _close(sp, report["speedup"], 2)
  assert report["speedup"] == pytest.approx(t["tokens_per_s"]["median"]
                                            / timed["ar"]["tokens_per_s"]["median"])
  ratios = [(nm / wm) / (na / wa) for na, wa, nm, wm in zip(
      report["new_tokens"]["ar"], report["wall_times_s"]["ar"], report["new_tokens"][method],
      report["wall_times_s"][method])]
  assert report["speedup_per_repeat"] == pytest.approx(ratios)
  assert _close(lo, min(ratios), 2) and _close(hi, max(ratios), 2)
  median = float(np.median(ratios))
  assert report["speedup_per_repeat_median"] == pytest.approx(median)
  if f"{median:.2f}" != f"{sp:.2f}":                  # printed beside it where they differ
    assert f"median {median:.2f}x" in line
  else:
    assert ", median " not in line
  # the prediction: only figures of the blocks, every input printed
  pred = report["prediction"]
  pline = _one(r"^(predicted by Theorem 3\.8.*)$", text)[0]
  if pred["draft_tokens"] == 0:                       # auto ran plain AR steps: G = 0
    assert pline.startswith("predicted by Theorem 3.8: 1.00x (G = 0") and tau == 1.0
    assert pred["predicted_speedup"] == 1.0 and pred["cost_ratio"] is None
    vline = _one(rf"^({method} ran plain AR steps.*)$", text)[0]
    assert vline == pred["line"] and f"measured {sp:.2f}x ({lo:.2f}-{hi:.2f}x)" in vline
    return
  ptext, ptau = _one(rf"^predicted by Theorem 3\.8 \(decode\.cli\.theory\.speedup_from_tau\): "
                     rf"{NUM}x = tau {NUM} /", text)
  r_round, r_ar, r = map(float, re.search(rf"r = round {NUM} ms / AR step {NUM} ms = {NUM}, "
                                          "the blocks' medians", pline).groups())
  assert float(ptau) == tau and r_round == rounds[method] and r_ar == rounds["ar"]
  assert abs(r - r_round / r_ar) <= 0.0005 + r * (0.0005 / r_round + 0.0005 / r_ar)
  assert pred["round_ar_steps"] == pytest.approx(t["round_s"]["median"]
                                                 / timed["ar"]["round_s"]["median"])
  assert pred["tau"] == pytest.approx(t["tau"]) and pred["draft_tokens"] == t["mean_draft_tokens"]
  c_match = re.search(r"x c (-?\d+\.\d+) \+ 1\), c = \(r - 1\) / ", pline)
  if pred["draft_tokens"] >= compare_lib.MIN_DRAFTED_PER_ROUND:
    c = float(c_match.group(1))
    assert _close(c, (pred["round_ar_steps"] - 1) / pred["draft_tokens"], 3)
    # c to its printed rounding, r's (0.0005) over G and G's (0.005) in (r - 1) / G
    assert abs(c - (r - 1) / g) <= 0.0006 + 0.0005 / g + abs(r - 1) * 0.0051 / (g * g - 0.005 * g)
    assert pred["cost_ratio"] == pytest.approx((pred["round_ar_steps"] - 1)
                                               / pred["draft_tokens"])
  else:                                               # too few drafts: c is not printed
    assert c_match is None and "c n/a (drafted " in pline and pred["cost_ratio"] is None
  assert pred["predicted_speedup"] == pytest.approx(pred["tau"] / pred["round_ar_steps"])
  assert _close(float(ptext), pred["predicted_speedup"], 2)
  assert abs(float(ptext) - tau / r) <= 0.005 + (tau / r) * (0.0005 / tau + 0.0005 / r)
  # the verdict: the prediction's printed tau and r, the measured speedup and its range
  vline = _one(r"^((?:tau|mtp ran) .*predicted .*)$", text)[0]
  assert vline == pred["line"]
  vtau, vr = _one(rf"^tau {NUM} (?:over a round of|but a round costs) {NUM} AR steps", text)
  assert float(vtau) == tau and float(vr) == r
  assert (f"predicted {ptext}x, measured {sp:.2f}x ({lo:.2f}-{hi:.2f}x)") in vline
  assert ("drafting pays here" in vline) == (float(vtau) > float(vr))
  # "auto" that drafted in some repeats only says so, with the per-repeat predictions
  per, drafted = pred["predicted_per_repeat"], pred["drafted_repeats"]
  some = t["form"] == "auto" and 0 < drafted < len(report["wall_times_s"][method])
  clause = re.search(rf"auto drafted in (\d+) of (\d+) repeats: .*per-repeat predictions "
                     rf"{NUM}-{NUM}x\)", vline)
  assert (clause is not None) == some, vline
  if some:
    assert clause.groups()[:2] == (str(drafted), str(len(report["wall_times_s"][method])))
    assert _close(float(clause.group(3)), min(per), 2) and _close(float(clause.group(4)), max(per), 2)


@pytest.mark.parametrize("num_draft_tokens", [2, "auto"])
def test_compare_numbers_rebuild_from_the_printed_ones_and_the_json(workdir, num_draft_tokens):
  """A real --compare (tiny model, a few seconds of decoding): the answer's
  statistics are those of the method's first timed repeat; each block's tau
  is its printed tokens / target calls; the speedup the ratio of the printed
  median throughputs, with the per-repeat ratios' range and (where it
  differs) median; the prediction tau / (G c + 1) from the blocks' printed
  tau, G and median rounds; the verdict with the same figures."""
  err = io.StringIO()
  report = run(DecodeRequest(workdir, ["abca"], method="mtp", num_draft_tokens=num_draft_tokens,
                             max_new_tokens=23, sampling=SamplingParams(temperature=0.0),
                             compare=True, repeats=3), out=io.StringIO(), err=err).to_json()
  _rebuild(report, err.getvalue())


def test_c_is_not_printed_from_too_few_drafts():
  """c = (r - 1) / G from a repeat that drafted 2 tokens in 126 calls is
  noise over G: n/a, with the count, below MIN_DRAFTED_PER_ROUND; the
  prediction is still tau / r."""
  p = compare_lib.predict_speedup(tau=1.01, alphas=None, mean_draft_tokens=2 / 126,
                                  round_s=1.13e-3, ar_step_s=1e-3, form="auto",
                                  drafted_tokens=2, rounds=126)
  assert p["cost_ratio"] is None and p["predicted_speedup"] == pytest.approx(1.01 / 1.13)
  line = compare_lib.prediction_line(p)
  assert "c n/a (drafted 2 tokens in 126 target calls: under 0.25 per call" in line
  assert "0.89x = tau 1.010 / r, r = round 1.130 ms / AR step 1.000 ms = 1.130" in line
  verdict = compare_lib.verdict_line(p, 0.9, 0.8, 1.0)
  assert verdict.startswith("tau 1.010 but a round costs 1.130 AR steps (c n/a (drafted 2 ")
  enough = compare_lib.predict_speedup(tau=2.0, alphas=None, mean_draft_tokens=0.25,
                                       round_s=1.1e-3, ar_step_s=1e-3, form="auto")
  assert enough["cost_ratio"] == pytest.approx(0.4)


def test_ctrl_c_after_the_answer_keeps_it_and_its_statistics(workdir, monkeypatch):
  """The answer is the method's first timed repeat: a Ctrl-C in AR's run
  that follows it stops --compare but keeps the answer, its statistics and
  the report (marked interrupted, no speedup)."""
  real = Decoder.warm_up

  def warm_up(dec, *a, **k):
    if dec.method == "ar":
      raise KeyboardInterrupt
    return real(dec, *a, **k)
  monkeypatch.setattr(Decoder, "warm_up", warm_up)
  out, err = io.StringIO(), io.StringIO()
  report = run(DecodeRequest(workdir, ["abca"], method="mtp", num_draft_tokens=2, max_new_tokens=8,
                             sampling=SamplingParams(temperature=0.0), compare=True, repeats=2),
               out=out, err=err).to_json()
  (res,) = report["results"]
  assert report["interrupted"] is True and "speedup" not in report
  assert out.getvalue() == "abca" + res["text"] + "\n" and len(res["tokens"]) == 8
  assert report["stats"]["num_tokens"] == 8 and "interrupted" not in report["stats"]
  text = err.getvalue()
  assert "[mtp] tokens 8" in text and "throughput" in text     # no timed block follows
  assert "interrupted: --compare stopped; the results above are complete" in text
