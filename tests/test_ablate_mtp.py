"""experiments/ablate_mtp.py: the D x lambda x seed grid end to end on the --quick
model (tables, plots, reuse of finished cells, resume of a partial grid) and
its pure pieces (grid, same-seed deltas, flag errors). No timing assertions."""

import json
import os

import pytest

from tests.conftest import md_command
from tests.test_scripts import _experiment
from experiments import ablation


@pytest.fixture(scope="module")
def ablate():
  return _experiment("ablate_mtp")


def _final(runs, name):
  with open(os.path.join(runs, name, "final_metrics.json")) as f:
    return json.load(f)


def _ckpt_steps(runs, name):
  return sorted(os.listdir(os.path.join(runs, name, "checkpoints")))


@pytest.mark.slow
def test_quick_grid_resumes_and_reports(ablate, data_dir, tmp_path, capsys):
  runs, out1, out2 = str(tmp_path / "runs"), str(tmp_path / "a1"), str(tmp_path / "a2")
  common = ["--quick", "--data_dir", data_dir, "--runs_dir", runs, "--seeds", "0"]
  # a partial grid: the D=0 baseline only (no D >= 1 cell: an empty decoding table)
  assert ablate.main(common + ["--depths", "0", "--out", out1]) == 0
  first = capsys.readouterr().out
  assert "[cell 1/1] D0_s0: trained" in first and "already finished" not in first
  assert "(no D >= 1 cell)" in open(out1 + ".md").read()
  assert md_command(out1 + ".md") == " ".join(
      ["python -m experiments.ablate_mtp", *common, "--depths", "0", "--out", out1])
  assert json.load(open(out1 + ".json"))["results"]["decode_table"] == []
  done = {n: (_final(runs, n), _ckpt_steps(runs, n)) for n in ("D0_s0",)}
  mtimes = {n: os.path.getmtime(os.path.join(runs, n, "final_metrics.json")) for n in done}

  # the grid with D=1: the D=0 cell is reused untouched (no new checkpoint step, same
  # metrics, file not rewritten), the D=1 cell is trained
  assert ablate.main(common + ["--depths", "0,1", "--out", out2]) == 0
  second = capsys.readouterr().out
  assert "[cell 1/2] D0_s0: reused" in second and "D0_s0 already finished at step 6" in second
  assert "[cell 2/2] D1_lam0.3_s0: trained" in second
  for n, (final, steps) in done.items():
    assert _final(runs, n) == final and _ckpt_steps(runs, n) == steps
    assert os.path.getmtime(os.path.join(runs, n, "final_metrics.json")) == mtimes[n]

  report = json.load(open(out2 + ".json"))
  meta, res = report["meta"], report["results"]
  assert {"commit", "jax_version", "date", "grid", "budget", "backbone", "cell_config", "decode",
          "command"} <= set(meta)
  assert meta["grid"]["depths"] == [0, 1] and meta["grid"]["seeds"] == [0]
  assert meta["budget"]["tokens_per_cell"] == 6 * 4 * 32
  cells = {c["name"]: c for c in res["cells"]}
  assert list(cells) == ["D0_s0", "D1_lam0.3_s0"]
  assert [cells[n]["reused"] for n in cells] == [True, False]
  for n, c in cells.items():   # table values are the runs' final eval metrics
    assert c["val_bpb"] == _final(runs, n)["eval"]["main/bits_per_byte"]
    assert c["step"] == 6

  # (a) training table: D=0 baseline row, delta per seed against the same seed's D=0
  rows = {(r["depth"], r["loss_weight"]): r for r in res["train_table"]}
  assert set(rows) == {(0, None), (1, 0.3)}
  r = rows[(1, 0.3)]
  assert r["delta_seeds"] == [0] and r["val_bpb"]["n"] == 1
  d1, d0 = cells["D1_lam0.3_s0"], cells["D0_s0"]
  assert r["delta_bpb"]["mean"] == pytest.approx(d1["val_bpb"] - d0["val_bpb"])
  assert r["delta_loss"]["mean"] == pytest.approx(d1["val_loss"] - d0["val_loss"])
  assert rows[(0, None)]["step_time_ratio"]["mean"] == pytest.approx(1.0)

  # (b) decoding: only D >= 1 cells, AR + MTP G=1 at T=0 and T=1
  assert "decode" not in cells["D0_s0"]
  for n in ("D1_lam0.3_s0",):
    kinds = {(d["method"], d["num_draft_tokens"], d["temperature"]) for d in cells[n]["decode"]}
    assert kinds == {("ar", 0, 0.0), ("mtp", 1, 0.0), ("ar", 0, 1.0), ("mtp", 1, 1.0)}
    for d in cells[n]["decode"]:
      assert d["tau"] >= 1 and d["speedup"] > 0
  drows = res["decode_table"]
  assert {(d["depth"], d["num_draft_tokens"], d["temperature"]) for d in drows} == \
      {(1, 1, 0.0), (1, 1, 1.0)}
  for d in drows:
    mtp = [x for x in cells["D1_lam0.3_s0"]["decode"]
           if x["method"] == "mtp" and x["temperature"] == d["temperature"]]
    assert d["seeds"] == [0] and d["tau"]["mean"] == pytest.approx(mtp[0]["tau"])
    assert 1 <= d["tau"]["mean"] <= 2      # G = 1: at most one draft + the bonus token
    assert d["acceptance_rate_per_position"] == mtp[0]["acceptance_rate_per_position"]

  md = open(out2 + ".md").read()
  assert "(a) Training benefit" in md and "(b) Decoding benefit" in md
  assert f"--depths 0,1 --out {out2}" in md
  assert "(baseline)" in md
  for suffix in ("_train.png", "_decode.png"):
    size = os.path.getsize(out2 + suffix)
    assert 1000 < size < 150_000

  # other settings on the same runs_dir are refused before anything trains
  with pytest.raises(SystemExit):
    ablate.main(common + ["--depths", "0", "--num_steps", "7", "--out", out1])
  err = capsys.readouterr().err
  assert "--runs_dir" in err and "train.num_steps: 6 != 7" in err
  assert _ckpt_steps(runs, "D0_s0") == done["D0_s0"][1]


def test_grid_has_one_baseline_per_seed(ablate):
  cells = ablation.grid([0, 1, 2, 3, 4], [0.1, 0.3, 1.0], [0, 1])
  assert len(cells) == 26
  assert [c["name"] for c in cells if c["depth"] == 0] == ["D0_s0", "D0_s1"]
  assert cells[1]["name"] == "D1_lam0.1_s0" and cells[-1]["name"] == "D4_lam1_s1"
  assert len({c["name"] for c in cells}) == 26


def test_train_table_pairs_same_seeds(ablate):
  def cell(d, lam, s, bpb, step=0.1, diverged=None):
    return {"depth": d, "loss_weight": lam, "seed": s, "val_bpb": bpb,
            "val_loss": None if bpb is None else bpb * 0.7,
            "step_time_s": step, "mtp_accuracy": [0.5] * d, "diverged": diverged}
  cells = [cell(0, None, 0, 3.0), cell(0, None, 1, 2.0, 0.2),
           cell(1, 0.3, 0, 2.9, 0.15), cell(1, 0.3, 1, 2.2, 0.3), cell(1, 0.3, 2, 1.0),
           cell(2, 0.3, 0, None, diverged="nan"), cell(2, 0.3, 1, 1.8)]
  rows = {(r["depth"], r["loss_weight"]): r for r in ablation.train_table(cells)}
  r = rows[(1, 0.3)]
  # seed 2 has no baseline: in the mean bpb, not in the deltas
  assert r["seeds"] == [0, 1, 2] and r["delta_seeds"] == [0, 1]
  assert r["val_bpb"]["mean"] == pytest.approx((2.9 + 2.2 + 1.0) / 3)
  assert r["delta_bpb"]["mean"] == pytest.approx((-0.1 + 0.2) / 2)
  assert (r["delta_bpb"]["min"], r["delta_bpb"]["max"]) == pytest.approx((-0.1, 0.2))
  assert r["step_time_ratio"]["mean"] == pytest.approx(1.5)
  r2 = rows[(2, 0.3)]
  assert r2["seeds"] == [1] and r2["diverged_seeds"] == [0]
  assert r2["delta_bpb"]["mean"] == pytest.approx(-0.2)
  assert rows[(0, None)]["delta_bpb"]["mean"] == pytest.approx(0.0)


@pytest.mark.parametrize("flags, needle", [
    (["--depths", "0,17"], "--depths"),
    (["--loss_weights", "0"], "--loss_weights"),
    (["--seeds", "0,0"], "--seeds"),
    (["--num_steps", "0"], "--num_steps"),
    (["--temperatures", "x"], "--temperatures"),
    (["--seq_len", "2", "--depths", "0,4"], "seq_len"),
])
def test_bad_flags_name_the_flag(ablate, tmp_path, capsys, flags, needle):
  with pytest.raises(SystemExit) as e:
    ablate.main(["--quick", "--runs_dir", str(tmp_path / "r"), "--out", str(tmp_path / "o")] + flags)
  assert e.value.code == 2
  assert needle in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "r")


def test_decode_table_aggregates_seeds(ablate):
  def row(method, g, t, tau, alphas, speedup):
    return {"method": method, "num_draft_tokens": g, "temperature": t, "tau": tau, "speedup": speedup,
            "acceptance_rate_per_position": alphas, "draft_cost_ratio_c": 0.5, "ideal_speedup": 1.2}
  cells = [
      {"depth": 0, "loss_weight": None, "seed": 0},
      {"depth": 2, "loss_weight": 0.3, "seed": 0, "decode": [
          row("ar", 0, 0.0, 1.0, [], 1.0), row("mtp", 1, 0.0, 1.5, [0.5], 1.1),
          row("mtp", 2, 0.0, 2.0, [0.6, 0.4], 1.3)]},
      {"depth": 2, "loss_weight": 0.3, "seed": 1, "decode": [
          row("ar", 0, 0.0, 1.0, [], 1.0), row("mtp", 1, 0.0, 1.7, [0.7], 0.9),
          row("mtp", 2, 0.0, 1.6, [0.6, None], 1.1)]}]
  rows = {(r["depth"], r["num_draft_tokens"]): r for r in ablation.decode_table(cells)}
  assert set(rows) == {(2, 1), (2, 2)}            # no AR rows, no D=0 rows
  r = rows[(2, 2)]
  assert r["seeds"] == [0, 1] and r["tau"]["mean"] == pytest.approx(1.8)
  assert (r["tau"]["min"], r["tau"]["max"]) == (1.6, 2.0)
  assert r["speedup"]["mean"] == pytest.approx(1.2)
  assert r["acceptance_rate_per_position"] == pytest.approx([0.6, 0.4])   # None: no round reached k
  assert rows[(2, 1)]["acceptance_rate_per_position"] == pytest.approx([0.6])


def test_unreadable_cell_config_is_one_line(tmp_path):
  """A cell workdir whose config.json is not JSON stops the cell with one
  ConfigError line naming the file, before anything is trained or written."""
  from mtp.config import ConfigError
  from tests.conftest import tiny_config
  (tmp_path / "config.json").write_text('{"model": ')
  with pytest.raises(ConfigError, match=r"config.json is not valid JSON") as e:
    ablation.train_cell(tiny_config(), str(tmp_path), log=print)
  assert "\n" not in str(e.value) and os.listdir(tmp_path) == ["config.json"]
