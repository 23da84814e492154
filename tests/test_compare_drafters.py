"""experiments/compare_drafters.py: draft architecture choice, draft training and
reuse, and an end-to-end --quick comparison on the Markov model (timings are
not asserted)."""

import json
import math
import os

import pytest

from mtp.model import count_params
from scripts import draft_models
from tests.conftest import md_command, tiny_config
from tests.test_scripts import REPO, _experiment


@pytest.fixture(scope="module")
def cd():
  return _experiment("compare_drafters")


def test_tiny_config_param_matched_draft(cd):
  from mtp import config as config_lib
  cfg = config_lib.load_config_file(os.path.join(REPO, "configs/tiny.py"))
  target = draft_models.param_count(cfg)
  assert (target["backbone"], target["mtp"]) == (821_376, 460_032)
  (layers, width), cands = draft_models.param_matched_arch(cfg, target["mtp"])
  # 4 x 96 (456,288) is closer but as deep as the target; 2 x 128 is within 10 %
  assert (layers, width) == (2, 128)
  assert {(c["num_layers"], c["d_model"]): c["params"] for c in cands}[2, 128] == 427_648
  assert cands[0]["params"] == 456_288 and (cands[0]["num_layers"], cands[0]["d_model"]) == (4, 96)
  assert draft_models.param_matched_arch(cfg, 460_032, tolerance=0.0)[0] == (4, 96)
  small = draft_models.draft_config(cfg, 1, 32)
  assert (small.mtp.depth, small.model.num_heads, small.model.num_kv_heads, small.model.head_dim,
          small.model.mlp_dim) == (0, 1, 1, 32, 96)
  assert small.train == cfg.train and small.data == cfg.data
  assert draft_models.cost_candidates(cfg) == [(1, 32), (1, 64), (1, 128)]


@pytest.mark.slow
def test_compare_quick_with_given_draft(cd, markov_workdir, trained_markov, data_dir, tmp_path):
  """The Markov target drafted by an identical copy of itself: every draft
  equals the target's own choice, so every draft is accepted (tau = G + 1)."""
  out = str(tmp_path / "cmp")
  cd.main(["--workdir", markov_workdir, "--draft_workdir", f"self={markov_workdir}",
           "--data_dir", data_dir, "--quick", "--out", out])
  report = json.load(open(out + ".json"))
  meta, res = report["meta"], report["results"]
  assert {"commit", "jax_version", "device_kind", "date", "config", "command"} <= set(meta)
  counts = count_params(trained_markov[1])
  by = {d["label"]: d for d in res["drafters"]}
  assert set(by) == {"mtp", "self"}
  assert by["mtp"]["extra_params"] == counts["mtp"] > 0
  assert by["self"]["extra_params"] == counts["backbone"] > 0
  # the same compiled train step (same config) as the target: FLOP ratio of
  # the draft's separate run = 1 + the MTP modules' extra FLOPs
  assert by["mtp"]["extra_train_cost_flops"] > 0
  assert by["self"]["extra_train_cost_flops"] == pytest.approx(1 + by["mtp"]["extra_train_cost_flops"])
  assert by["mtp"]["extra_train_cost_time"] is not None and by["self"]["extra_train_cost_time"] > 0
  rows = res["decode"]
  got = {(r["drafter"], r["num_draft_tokens"], r["temperature"]) for r in rows}
  assert got == {("ar", 0, t) for t in (0.0, 1.0)} | {
      (d, 2, t) for d in ("mtp", "self") for t in (0.0, 1.0)}
  for r in rows:
    assert r["speedup"] > 0 and r["batch_size"] == 1
    if r["method"] == "ar":
      assert r["tau"] == 1.0
      continue
    g = r["num_draft_tokens"]
    assert 1.0 <= r["tau"] <= g + 1 and len(r["acceptance_rate_per_position"]) == g
    assert r["draft_cost_ratio_c"] > 0 and r["draft_cost_ratio_c_flops"] > 0
    if r["drafter"] == "self":
      assert r["tau"] == pytest.approx(g + 1) and r["acceptance_rate_per_position"] == [1.0] * g
  md = open(out + ".md").read()
  assert md_command(out + ".md") == meta["command"] == " ".join([
      "python -m experiments.compare_drafters", "--workdir", markov_workdir, "--draft_workdir",
      f"self={markov_workdir}", "--data_dir", data_dir, "--quick", "--out", out])
  assert "## Drafters" in md and "## Decoding" in md
  assert len([l for l in md.splitlines() if l.startswith("| 0 |") or l.startswith("| 1 |")]) == len(rows)
  assert 5_000 < os.path.getsize(out + ".png") < 150_000


def test_train_drafts_trains_then_reuses(cd, data_dir, tmp_path):
  """Draft runs land in runs_dir under a name with their architecture and
  steps; a second call reuses the finished runs without training."""
  import argparse
  cfg = tiny_config(train=dict(num_steps=3, batch_size=2, seq_len=16, warmup_steps=1, log_every=1,
                               eval_every=3, eval_batches=1), checkpoint=dict(every_steps=3))
  args = argparse.Namespace(runs_dir=str(tmp_path / "runs"), draft_steps=2, data_dir=data_dir)
  archs = {"param": (1, 16), "cost": (1, 16)}        # same architecture: one run, both roles
  first = cd.train_drafts(args, cfg, archs)
  assert len(first) == 1 and first[0]["role"] == "param+cost" and first[0]["trained_now"]
  wd = first[0]["workdir"]
  assert os.path.basename(wd) == "draft_L1_d16_2steps"
  final = json.load(open(os.path.join(wd, "final_metrics.json")))
  assert final["step"] == 2 and final["params"]["mtp"] == 0 and cd.val_bpb(final) > 0
  saved = json.load(open(os.path.join(wd, "config.json")))
  assert saved["model"]["num_layers"] == 1 and saved["model"]["d_model"] == 16
  assert saved["mtp"]["depth"] == 0 and saved["data"]["data_dir"] == data_dir
  mtime = os.path.getmtime(os.path.join(wd, "final_metrics.json"))
  second = cd.train_drafts(args, cfg, archs)
  assert not second[0]["trained_now"] and second[0]["wall_s"] == first[0]["wall_s"] > 0
  assert os.path.getmtime(os.path.join(wd, "final_metrics.json")) == mtime


@pytest.mark.parametrize("flags,name", [(["--num_draft_tokens", "0"], "--num_draft_tokens"),
                                        (["--param_arch", "2by128"], "--param_arch"),
                                        (["--cost_arch", "0x64"], "--cost_arch"),
                                        (["--temperatures", "nan"], "--temperatures"),
                                        (["--draft_workdir", "/nonexistent/dir"], "--draft_workdir")])
def test_compare_bad_flags_name_the_flag(cd, flags, name, capsys, tmp_path):
  with pytest.raises(SystemExit):
    cd.main(["--workdir", str(tmp_path), *flags, "--out", str(tmp_path / "x")])
  assert name in capsys.readouterr().err


def test_select_archs_calibrates_once_then_reuses(cd, trained_markov, monkeypatch, tmp_path):
  """The cost-matched draft is chosen by measured drafting time, saved in
  runs_dir and reused; other candidates trigger a new calibration."""
  import argparse
  cfg, model, _ = trained_markov
  counts = count_params(model)
  args = argparse.Namespace(runs_dir=str(tmp_path), param_arch="auto", cost_arch="auto",
                            cost_candidates="1x8,1x16", max_new_tokens=8, calib_repeats=1)
  ap = argparse.ArgumentParser()
  archs, rec = cd.select_archs(args, ap, cfg, model, counts, "abc dea fbc")
  cal = rec["cost_calibration"]
  assert [(c["num_layers"], c["d_model"]) for c in cal] == [(1, 8), (1, 16)]
  for c in cal:
    assert c["draft_s"] > 0 and c["time_ratio_to_mtp"] == pytest.approx(c["draft_s"] / c["mtp_draft_s"])
  best = min(cal, key=lambda c: abs(math.log(c["time_ratio_to_mtp"])))
  assert archs["cost"] == (best["num_layers"], best["d_model"])
  assert archs["param"] == draft_models.param_matched_arch(cfg, counts["mtp"])[0]
  saved = json.load(open(tmp_path / cd.SELECTION_FILE))
  assert saved["cost_arch"] == list(archs["cost"]) and saved["param_arch"] == list(archs["param"])

  def no_calibration(*a, **k):
    raise AssertionError("calibrated again")
  monkeypatch.setattr(cd, "calibrate_cost_arch", no_calibration)
  assert cd.select_archs(args, ap, cfg, model, counts, "abc")[0] == archs
  args.cost_arch = "1x32"                          # forced: used as given, the saved choice kept
  assert cd.select_archs(args, ap, cfg, model, counts, "abc")[0] == {**archs, "cost": (1, 32)}
  args.cost_arch, args.cost_candidates = "auto", "1x8"
  with pytest.raises(AssertionError, match="calibrated again"):
    cd.select_archs(args, ap, cfg, model, counts, "abc")
