"""experiments/losslessness_study.py: the statistics on synthetic samples, the
deliberately wrong acceptance rule, and the --quick study end to end on the
Markov model (the correct rule passes, the wrong rule is rejected)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from tests.conftest import md_command
from tests.test_scripts import _experiment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ls():
  return _experiment("losslessness_study")


# -- statistics (no model) -------------------------------------------------------------

def test_holm_and_bonferroni(ls):
  p = [0.01, 0.04, 0.03, 0.005]
  np.testing.assert_allclose(ls.holm(p), [0.03, 0.06, 0.06, 0.02])
  np.testing.assert_allclose(ls.bonferroni(p), [0.04, 0.16, 0.12, 0.02])
  assert (ls.holm(p) <= ls.bonferroni(p)).all()
  assert ls.holm([]).shape == (0,)


def test_pooling_rule(ls):
  table = np.array([[100, 90, 3, 2, 1, 0], [95, 105, 1, 4, 2, 0]])
  pooled = ls.pool_small_categories(table)
  # columns with expected count < 5 (totals 4, 6, 3 over n = 403) pool into "other" (13 >= 10)
  np.testing.assert_array_equal(pooled, [[100, 90, 6], [95, 105, 7]])
  assert pooled.sum() == table.sum()
  # a small "other" merges into the largest column
  tiny = np.array([[100, 50, 2], [100, 52, 1]])
  np.testing.assert_array_equal(ls.pool_small_categories(tiny), [[102, 50], [101, 52]])
  n = pooled.sum()
  assert (pooled.sum(1).min() * pooled.sum(0) / n >= 5).all()


def test_two_sample_chi2(ls):
  rng = np.random.default_rng(0)
  law = np.array([0.5, 0.2, 0.15, 0.1, 0.04, 0.01])
  same = [ls.two_sample_chi2(rng.choice(6, 2000, p=law), rng.choice(6, 2000, p=law))["pvalue"]
          for _ in range(20)]
  assert min(same) > 1e-3 and stats.kstest(same, "uniform").pvalue > 1e-3
  other = law[[1, 0, 2, 3, 4, 5]]
  diff = ls.two_sample_chi2(rng.choice(6, 2000, p=law), rng.choice(6, 2000, p=other))
  assert diff["pvalue"] < 1e-10 and diff["tv"] == pytest.approx(0.3, abs=0.05)
  # unpooled case equals scipy on the raw table
  a, b = rng.choice(3, 500), rng.choice(3, 500)
  res = ls.two_sample_chi2(a, b)
  table = np.stack([np.bincount(a, minlength=3), np.bincount(b, minlength=3)])
  assert res["pvalue"] == pytest.approx(stats.chi2_contingency(table, correction=False).pvalue)
  assert res["dof"] == 2 and res["n_a"] == res["n_b"] == 500
  # n-grams: rows are categories; (0, 1) and (1, 0) differ
  x = np.array([[0, 1]] * 50 + [[1, 0]] * 50)
  y = np.array([[0, 1]] * 90 + [[1, 0]] * 10)
  assert ls.two_sample_chi2(x, y)["pvalue"] < 1e-6 and ls.two_sample_chi2(x, x)["pvalue"] == 1.0
  # one category: degenerate, no p-value
  deg = ls.two_sample_chi2(np.zeros(50, int), np.zeros(60, int))
  assert deg["pvalue"] is None and deg["dof"] == 0


def test_argmax_accept_rule(ls):
  v = 5
  p = jnp.asarray(np.tile(np.array([0.1, 0.6, 0.1, 0.1, 0.1], np.float32), (4000, 3, 1)))
  drafts = jnp.asarray(np.tile(np.array([1, 2], np.int32), (4000, 1)))    # d_1 = argmax, d_2 not
  a, nxt = jax.jit(ls.argmax_accept)(jax.random.key(0), p, drafts)
  assert (np.asarray(a) == 1).all()
  freq = np.bincount(np.asarray(nxt), minlength=v) / 4000                  # sampled from p_1
  np.testing.assert_allclose(freq, [0.1, 0.6, 0.1, 0.1, 0.1], atol=0.03)
  all_ok = jnp.asarray(np.tile(np.array([1, 1], np.int32), (4000, 1)))
  assert (np.asarray(ls.argmax_accept(jax.random.key(1), p, all_ok)[0]) == 2).all()


# -- end to end on the Markov model ------------------------------------------------------

@pytest.fixture(scope="module")
def quick(ls, markov_workdir, tmp_path_factory):
  import contextlib
  import io
  out = str(tmp_path_factory.mktemp("lossless") / "ll")
  console = io.StringIO()
  with contextlib.redirect_stdout(console):
    ls.main(["--workdir", markov_workdir, "--quick", "--out", out])
  return out, json.load(open(out + ".json")), console.getvalue()


@pytest.mark.slow
def test_quick_report_structure(quick, markov_workdir):
  out, report, _ = quick
  meta, res = report["meta"], report["results"]
  assert {"commit", "date", "config", "num_samples", "num_tokens", "temperatures", "top_ps",
          "num_draft_tokens"} <= set(meta)
  assert meta["num_draft_tokens"] == 2 and meta["num_tokens"] == 2
  assert res["complete"] is True and res["settings_done"] == res["settings_total"] == 4
  assert "Partial report" not in open(out + ".md").read()
  assert res["statistics"] == ["first_token", "first_2_tokens"]
  n_correct = len(res["prompts"]) * len(res["settings"]) * 2
  correct = [t for t in res["tests"] if t["rule"] == "mtp"]
  wrong = [t for t in res["tests"] if t["rule"] == "wrong_argmax"]
  assert len(correct) == n_correct and len(wrong) == len(res["prompts"]) * 2
  for t in res["tests"]:
    assert {"chi2", "dof", "pvalue", "n_a", "n_b", "tv", "statistic", "prompt_index"} <= set(t)
    assert t["n_a"] == t["n_b"] == meta["num_samples"]
  assert res["combined"]["correct"]["num_tests"] + res["combined"]["correct"]["num_degenerate"] \
      == n_correct
  # the speculative runs did accept drafts (the test exercises acceptance, not only residuals)
  for acc in res["acceptance"]:
    assert sum(acc["accepted_length_histogram"][1:]) > 0 and acc["tau"] > 1
  md = open(out + ".md").read()
  assert md_command(out + ".md") == " ".join(
      ["python -m experiments.losslessness_study --workdir", markov_workdir, "--quick --out", out])
  assert "Holm" in md and md.count("| wrong_argmax | first") == len(wrong)
  assert 5_000 < os.path.getsize(out + "_pvalues.png") < 150_000


@pytest.mark.slow
def test_a_stopped_study_keeps_its_finished_settings(ls, markov_workdir, tmp_path, monkeypatch):
  """A study stopped in its second setting leaves the report of the first
  (marked partial); a finished one is marked complete (``quick``)."""
  calls = []
  real = ls.sample_continuations

  def stop_on_third(*a, **k):
    calls.append(None)
    if len(calls) == 3:          # the first setting drew AR and MTP
      raise KeyboardInterrupt
    return real(*a, **k)

  monkeypatch.setattr(ls, "sample_continuations", stop_on_third)
  out = str(tmp_path / "ll")
  with pytest.raises(KeyboardInterrupt):
    ls.main(["--workdir", markov_workdir, "--quick", "--num_samples", "100", "--out", out])
  res = json.load(open(out + ".json"))["results"]
  assert res["complete"] is False and res["settings_done"] == 1 and res["settings_total"] == 4
  assert {(t["temperature"], t["top_p"]) for t in res["tests"]} == {(0.7, 1.0)}
  assert "Partial report: 1 of 4 settings" in open(out + ".md").read()


@pytest.mark.slow
def test_quick_correct_rule_passes(quick):
  _, report, _ = quick
  c = report["results"]["combined"]["correct"]
  assert c["num_tests"] >= 12
  assert c["holm_rejections_0.001"] == 0                 # Holm-corrected: nothing rejected
  pv = [t["pvalue"] for t in report["results"]["tests"] if t["rule"] == "mtp" and t["pvalue"]]
  assert np.median(pv) > 0.1                             # not all tiny either


@pytest.mark.slow
def test_quick_wrong_rule_is_detected(quick):
  _, report, _ = quick
  res = report["results"]
  wrong = [t for t in res["tests"] if t["rule"] == "wrong_argmax"]
  assert all(t["pvalue"] is not None and t["pvalue"] < 1e-3 for t in wrong)
  assert res["combined"]["wrong"]["holm_rejections_0.001"] == len(wrong)
  tv = {(t["rule"], t["prompt_index"]): t["tv"] for t in res["first_token_tv"]
        if (t["temperature"], t["top_p"]) == (1.0, 1.0)}
  for i in range(len(res["prompts"])):
    assert tv[("wrong_argmax", i)] > 2 * tv[("mtp", i)]


def test_wrong_rule_first_token_law(ls):
  """P(m) = q(m) + (1 - q(m)) p(m), the rest scaled by 1 - q(m); q(m) = 0 is AR."""
  p = np.array([0.5, 0.3, 0.2])
  law = ls.wrong_rule_first_token_law(p, np.array([0.4, 0.1, 0.5]))
  np.testing.assert_allclose(law, [0.4 + 0.6 * 0.5, 0.6 * 0.3, 0.6 * 0.2])
  np.testing.assert_allclose(ls.wrong_rule_first_token_law(p, np.array([0.0, 0.5, 0.5])), p)


def test_chi2_power_matches_simulation(ls):
  """The planned power (noncentral chi-square) agrees with the rejection rate
  of ``two_sample_chi2`` on simulated samples (400 studies of n = 600 per
  side), at a small and a large deviation; equal laws give power alpha and
  the power grows with n."""
  rng = np.random.default_rng(0)
  k = 12
  a = rng.dirichlet(np.ones(k))
  for shift in (0.15, 0.2):          # planned power 0.45 and 0.81
    b = ls.wrong_rule_first_token_law(a, np.full(k, shift))
    plan = ls.chi2_power(a, b, 600, 0.01)
    hits = 0
    for _ in range(400):
      xa, xb = rng.choice(k, 600, p=a), rng.choice(k, 600, p=b)
      hits += ls.two_sample_chi2(xa, xb)["pvalue"] < 0.01
    assert abs(hits / 400 - plan["power"]) < 0.08, (shift, hits / 400, plan)
  assert ls.chi2_power(a, a, 600, 0.01)["power"] == pytest.approx(0.01)
  assert ls.chi2_power(a, b, 2000, 0.01)["power"] > ls.chi2_power(a, b, 200, 0.01)["power"]


def test_cli_errors(ls, tmp_path, capsys):
  for flags, name in [(["--workdir", str(tmp_path / "none")], "--workdir"),
                      (["--workdir", "x", "--top_ps", "0"], "--top_ps"),
                      (["--workdir", "x", "--temperatures", "1,-1"], "--temperatures"),
                      (["--workdir", "x", "--num_samples", "5"], "--num_samples"),
                      (["--workdir", "x", "--prompt_indices", "1,-2"], "--prompt_indices"),
                      (["--workdir", "x", "--prompt_indices", "1", "--prompt", "ab"],
                       "--prompt_indices")]:
    with pytest.raises(SystemExit):
      ls.main(flags + ["--out", str(tmp_path / "o")])
    assert name in capsys.readouterr().err
  assert not os.path.exists(str(tmp_path / "o.json"))


def test_verdict_inconclusive_without_live_tests_or_power(ls):
  """0 non-degenerate tests, or a power check that failed: no conclusion
  either way (markdown, JSON and console share the verdict)."""
  combined = ls.combine([{"pvalue": None}, {"pvalue": None}])
  assert combined["num_tests"] == 0
  caught = ls.combine([{"pvalue": 1e-12}, {"pvalue": 1e-9}])          # wrong rule: detected twice
  missed = ls.combine([{"pvalue": 1e-12}, {"pvalue": 0.2}])           # ... once of twice
  fine = ls.combine([{"pvalue": 0.5}, {"pvalue": 0.3}])
  assert ls.power_check_passed(caught) and not ls.power_check_passed(missed)
  assert not ls.power_check_passed(combined)
  assert ls.verdict(combined, caught).startswith("Inconclusive: no test had enough samples")
  assert ls.verdict(fine, caught).startswith("No evidence")
  assert ls.verdict(fine, missed).startswith("Inconclusive: no Holm rejection at 0.01, but the "
                                             "power check failed")
  assert "1 of 2 tests" in ls.verdict(fine, missed)
  assert "REJECT" in ls.verdict(ls.combine([{"pvalue": 1e-9}, {"pvalue": 0.3}]), missed)


@pytest.mark.slow
def test_quick_console_and_markdown_give_the_same_verdict(ls, quick):
  out, report, console = quick
  res = report["results"]
  want = ls.verdict(res["combined"]["correct"], res["combined"]["wrong"])
  assert res["verdict"] == want and f"verdict: {want}" in console.splitlines()
  assert want in open(out + ".md").read()
  passed = ls.power_check_passed(res["combined"]["wrong"])
  assert f"power check {'passed' if passed else 'FAILED'}" in console
