"""experiments/simulate_speedup.py: the Monte Carlo round process agrees with the
closed forms of Leviathan et al. 2023 (and would catch a wrong one), the
optimal draft length, the DeepSeek-V3 numbers, and the CLI end to end."""

import json
import os

import numpy as np
import pytest
from scipy import stats

from decode.cli import theory
from tests.conftest import md_command
from tests.test_scripts import _experiment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "results", "bench_decode_tiny.json")


@pytest.fixture(scope="module")
def sim():
  return _experiment("simulate_speedup")


CASES = [(a, g) for a in (0.3, 0.6, 0.9) for g in (1, 3, 8)]


@pytest.mark.parametrize("alpha,g", CASES)
def test_monte_carlo_matches_closed_forms(sim, alpha, g):
  c = 0.1
  r = sim.simulate_rounds(alpha, g, c, 40_000, np.random.default_rng(1000 * g + int(10 * alpha)))
  tau = float(theory.closed_form_tau(alpha, g))
  assert tau == pytest.approx((1 - alpha ** (g + 1)) / (1 - alpha))
  assert abs(r["tau_hat"] - tau) < 4 * r["tau_stderr"]
  sp = float(theory.closed_form_speedup(alpha, g, c))
  assert sp == pytest.approx(tau / (g * c + 1))
  assert abs(r["speedup_hat"] - sp) < 4 * r["speedup_stderr"]
  # A wrong formula (one draft too many) is far outside the Monte Carlo error bars
  # wherever it differs materially (by alpha^(G+1) >= 0.05).
  wrong = float(theory.closed_form_tau(alpha, g + 1))
  if alpha ** (g + 1) >= 0.05:
    assert abs(r["tau_hat"] - wrong) > 8 * r["tau_stderr"]
  # The accepted-length histogram follows alpha^k (1 - alpha), alpha^G at k = G.
  law = theory.accepted_length_law(alpha, g)
  assert law.sum() == pytest.approx(1.0)
  hist = np.asarray(r["histogram"])
  assert hist.sum() == 40_000 and len(hist) == g + 1
  keep = law * hist.sum() >= 5
  obs = np.append(hist[keep], hist[~keep].sum())
  exp = np.append(law[keep], law[~keep].sum()) * hist.sum()
  obs, exp = (obs, exp) if exp[-1] > 0 else (obs[:-1], exp[:-1])
  assert stats.chisquare(obs, exp).pvalue > 1e-3


def test_simulate_rounds_edges_and_errors(sim):
  rng = np.random.default_rng(0)
  assert sim.simulate_rounds(1.0, 4, 0.5, 100, rng)["tau_hat"] == 5.0
  r = sim.simulate_rounds(0.0, 4, 0.5, 100, rng)
  assert r["tau_hat"] == 1.0 and r["speedup_hat"] == pytest.approx(1 / 3)
  for bad, pattern in [(dict(alpha=1.5), "alpha="), (dict(g=0), "G="), (dict(c=-0.1), "c="),
                       (dict(num_rounds=1), "num_rounds=")]:
    with pytest.raises(ValueError, match=pattern):
      sim.simulate_rounds(**(dict(alpha=0.5, g=2, c=0.1, num_rounds=100, rng=rng) | bad))


def test_optimal_num_draft_tokens(sim):
  alphas = np.linspace(0.3, 0.9, 7)
  costs = np.array([0.0, 0.05, 0.25, 1.0])
  a, c = np.meshgrid(alphas, costs)
  g_opt, best = sim.optimal_num_draft_tokens(a, c, 8)
  brute = np.array([[max(range(1, 9), key=lambda g: theory.closed_form_speedup(x, g, y))
                     for x in alphas] for y in costs])
  np.testing.assert_array_equal(g_opt, brute)
  assert (g_opt[0] == 8).all()                           # c = 0: more drafts always help
  assert (np.diff(g_opt, axis=0) <= 0).all()             # dearer drafts -> shorter drafts
  assert (np.diff(g_opt, axis=1) >= 0).all()             # better acceptance -> longer drafts
  assert best[-1, 0] < 1 < best[0, 0]                    # c = 1, alpha = 0.3: AR wins
  with pytest.raises(ValueError, match="g_max"):
    sim.optimal_num_draft_tokens(0.5, 0.1, 0)


def test_deepseek_v3_check(sim):
  ds = sim.deepseek_v3_check()
  lo, hi = ds["ends"]
  assert lo["tau"] == pytest.approx(1.85) and hi["tau"] == pytest.approx(1.90)
  assert lo["speedup_c0"] == pytest.approx(1.85)
  for e in ds["ends"]:
    assert float(theory.closed_form_speedup(e["alpha"], 1, e["c_for_reported"])) == pytest.approx(1.8)
  assert ds["c_range_for_reported"] == pytest.approx([1.85 / 1.8 - 1, 1.90 / 1.8 - 1])
  assert not ds["reproduces_at_c0"]                       # 1.85-1.90 > 1.8
  assert ds["c_one_layer"] == pytest.approx(1 / 61)
  assert ds["c_one_layer"] < ds["c_with_head"] < 0.1


def test_cli_quick_with_two_bench_files(sim, tmp_path):
  out = str(tmp_path / "sim")
  res = sim.main(["--quick", "--bench", BENCH, "--bench", BENCH, "--out", out])
  report = json.load(open(out + ".json"))
  assert {"commit", "date", "rounds", "bench", "quick"} <= set(report["meta"])
  r = report["results"]
  rows = json.load(open(BENCH))["results"]
  bench_rows = [x for x in rows if isinstance(x["num_draft_tokens"], int) and x["num_draft_tokens"]
                and not x.get("tree")]
  assert any(x["num_draft_tokens"] == "auto" for x in rows)     # skipped: no single G
  assert len(r["measured"]) == 2 * len(bench_rows)
  for m in r["measured"]:
    assert m["predicted_speedup"] == pytest.approx(m["ideal_speedup_in_file"], rel=1e-6)
  assert len(r["table"]) == len(r["alphas"]) and len(r["table"][0]["tau"]) == 8
  mc = r["monte_carlo"]
  assert mc["cells"] == len(r["alphas"]) * 8 * len(r["costs"]) and mc["frac_within_3se"] > 0.9
  assert res["deepseek_v3"]["ends"][0]["alpha"] == 0.85
  md = open(out + ".md").read()
  assert md_command(out + ".md") == f"python -m experiments.simulate_speedup --quick --bench {BENCH} " \
      f"--bench {BENCH} --out {out}"
  assert "DeepSeek-V3" in md and "does not reproduce 1.8x at c = 0" in md
  assert "0.0278" in md and "0.0556" in md               # the computed c range, not hard-coded
  for name in ("_curves.png", "_optimal_g.png"):
    size = os.path.getsize(out + name)
    assert 5_000 < size < 150_000


def test_cli_errors(sim, tmp_path, capsys):
  missing = str(tmp_path / "nope.json")
  with pytest.raises(SystemExit):
    sim.main(["--quick", "--bench", missing, "--out", str(tmp_path / "x")])
  err = capsys.readouterr().err
  assert "--bench" in err and "nope.json" in err
  bad = tmp_path / "bad.json"
  bad.write_text(json.dumps({"results": [{"num_draft_tokens": 2, "method": "mtp"}]}))
  with pytest.raises(SystemExit):
    sim.main(["--quick", "--bench", str(bad), "--out", str(tmp_path / "x")])
  assert "--bench" in capsys.readouterr().err
  for flags, name in [(["--g_max", "0"], "--g_max"), (["--costs", "0,-1"], "--costs"),
                      (["--alpha_min", "0.9", "--alpha_max", "0.3"], "--alpha_min")]:
    with pytest.raises(SystemExit):
      sim.main(["--quick", "--out", str(tmp_path / "x")] + flags)
    assert name in capsys.readouterr().err
  assert not os.path.exists(str(tmp_path / "x.json"))
