"""experiments/sweep_draft_vocab.py (with experiments/vocab_sweep.py)
on a tiny random BPE target with one MTP module and a token dataset with a
loss_mask: the report's structure, nested V' sets, the mass outside V'
never smaller for a smaller V', and tau from the per-step rates."""

import json

import numpy as np
import pytest

from decode.cli import theory
from mtp import data
from experiments import sweep_draft_vocab as script
from tests import tiny_bpe
from tests.conftest import md_command
from experiments import vocab_sweep

SIZES = (8, 64)


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
  root = tmp_path_factory.mktemp("vsweep")
  wd = tiny_bpe.import_tiny_workdir(str(root), mtp_depth=1)
  rng = np.random.default_rng(0)

  def examples(n):      # Zipf-like answer ids, so V' by frequency is not arbitrary
    out = []
    for i in range(n):
      p, a = int(rng.integers(3, 8)), int(rng.integers(10, 40))
      toks = np.r_[rng.integers(4, 290, p), np.minimum(rng.zipf(1.3, a) + 3, 295)]
      mask = np.r_[np.zeros(p), np.ones(a)].astype(np.int32)
      out.append((f"{i:07d}", {"tokens": toks.astype(np.int32), "loss_mask": mask,
                               "category": "qa"}))
    return out
  data.write_token_dataset("vs_chat", str(root / "data"),
                           {"train": examples(40), "validation": examples(8)}, {"g": "test"})
  return wd, str(root / "data")


def test_script_writes_a_well_formed_report(stage, tmp_path):
  wd, data_dir = stage
  out = str(tmp_path / "sweep")
  argv = ["--workdir", wd, "--data_dir", data_dir, "--data_name", "vs_chat",
          "--draft_vocab", ",".join(map(str, SIZES)) + ",full", "--eval_batches", "1",
          "--batch_size", "2", "--recursive_steps", "2", "--temperatures", "0", "--repeats", "1",
          "--iters", "2", "--prompt_len", "16", "--out", out]
  assert script.main(argv) == 0
  assert md_command(out + ".md") == "python -m experiments.sweep_draft_vocab " + " ".join(argv)
  res = json.load(open(out + ".json"))
  assert {"commit", "date", "device_kind", "wall_s", "settings"} <= set(res["meta"])
  acc = res["results"]["acceptance"]
  assert [r["draft_vocab"] for r in acc] == [*map(str, SIZES), "full"]
  for r in acc:
    assert [d["k"] for d in r["depths"]] == [1, 2, 3]
    for d in r["depths"]:
      assert 0 <= d["alpha_t0"] <= 1 and 0 <= d["alpha_t1"] <= 1 + 1e-6 and d["positions"] > 0
      assert d["alpha_t1"] <= 1 - d["mass_outside"] + 1e-5      # alpha <= p(V')
  # a smaller V' never has less mass outside than a larger one (the sets are nested)
  for small, large in zip(acc, acc[1:]):
    assert small["covers"] <= large["covers"] + 1e-12
    for ds, dl in zip(small["depths"], large["depths"]):
      assert ds["mass_outside"] >= dl["mass_outside"] - 1e-6
  assert acc[-1]["covers"] == 1.0 and all(d["mass_outside"] == 0.0 for d in acc[-1]["depths"])
  costs = res["results"]["costs"]
  assert costs["G"] == 3 and set(costs["rows"]) == {*map(str, SIZES), "full"}
  for r in costs["rows"].values():
    assert set(r) == {"0.0"}
    assert all(r[t]["c"]["median"] > 0 and r[t]["draft_s"]["n"] == 1 for t in r)
  rows = res["results"]["speedups"]
  assert len(rows) == len(acc) * 3 and {r["temperature"] for r in rows} == {0.0}
  for r in rows:
    a = next(x for x in acc if x["draft_vocab"] == r["draft_vocab"])
    key = "alpha_t0" if r["temperature"] == 0 else "alpha_t1"
    alphas = [d[key] for d in a["depths"][:r["G"]]]
    assert r["tau"] == pytest.approx(1 + np.cumprod(alphas).sum())
    assert r["speedup_min"] <= r["speedup"] <= r["speedup_max"]
  assert "| full |" in open(out + ".md").read()


def test_vocab_sets_are_nested_and_keep_the_stop_ids(stage):
  wd, data_dir = stage
  st = vocab_sweep.load_stage(wd, batch_size=1, num_batches=1, data_dir=data_dir,
                              data_name="vs_chat")
  sets = vocab_sweep.vocab_sets(st, [*SIZES, None])
  assert list(sets) == [*map(str, SIZES), "full"] and sets["full"] is None
  for a, b in zip(SIZES, SIZES[1:]):
    assert set(sets[str(a)]) <= set(sets[str(b)]) and len(sets[str(a)]) == a
  assert all(set(st.tokenizer.stop_ids) <= set(sets[str(n)]) for n in SIZES)
  assert vocab_sweep.vocab_sets(st, [10_000]) == {"full": None}   # every emittable id: no V'


def test_chain_tau_reduces_to_the_iid_form():
  assert theory.chain_tau([0.7] * 3) == pytest.approx(theory.expected_accepted_length(0.7, 3))
  assert theory.chain_tau([0.5, 0.4]) == pytest.approx(1 + 0.5 + 0.2)
  assert theory.chain_speedup([0.7] * 2, 0.1) == pytest.approx(theory.ideal_speedup(0.7, 2, 0.1))
