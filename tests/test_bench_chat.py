"""scripts/bench_chat.py (library and CLI) on a tiny random BPE target
with one MTP module: rows per category with speedups, tau and alpha_k, and
clear errors for a bad category."""

import json

import pytest

from mtp import tokenizer as tok
from scripts import bench_chat
from tests import tiny_bpe


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  return tiny_bpe.import_tiny_workdir(str(tmp_path_factory.mktemp("chat")), mtp_depth=1)


def test_heldout_prompts_by_category(target):
  tk = tok.load_tokenizer(target)
  got = bench_chat.heldout_prompts(bench_chat.chat_lib.HELDOUT_CHAT_PATH, tk, 2, ("code", "math"))
  assert sorted(got) == ["code", "math"] and all(len(v) == 2 for v in got.values())
  assert all(p[-1] != tk.stop_ids[0] and len(p) > 5 for v in got.values() for p in v)
  with pytest.raises(ValueError, match="not in"):
    bench_chat.heldout_prompts(bench_chat.chat_lib.HELDOUT_CHAT_PATH, tk, 1, ("poetry",))
  with pytest.raises(ValueError, match="per_category"):
    bench_chat.heldout_prompts(bench_chat.chat_lib.HELDOUT_CHAT_PATH, tk, 0)


def test_script_quick_writes_rows_per_category(target, tmp_path):
  out = str(tmp_path / "bench")
  assert bench_chat.main(["--workdir", target, "--quick", "--categories", "code,math",
                      "--out", out]) == 0
  res = json.load(open(out + ".json"))
  rows = res["results"]["rows"] if "results" in res else res["rows"]
  assert {r["category"] for r in rows} == {"code", "math"}
  assert {r["label"] for r in rows} == {"ar", "mtp_G1"}
  mtp = [r for r in rows if r["label"] == "mtp_G1"]
  assert all(r["speedup"] > 0 and 1.0 <= r["tau"] <= 2.0 for r in mtp)
  assert "| code | mtp_G1 |" in open(out + ".md").read()


def test_script_trees_and_batch_sizes(target, tmp_path):
  out = str(tmp_path / "bench")
  assert bench_chat.main(["--workdir", target, "--quick", "--categories", "code", "--trees", "2",
                      "--batch_sizes", "1,2", "--out", out]) == 0
  res = json.load(open(out + ".json"))
  rows = res["results"]["rows"] if "results" in res else res["rows"]
  assert {(r["label"], r["batch_size"]) for r in rows} == {
      (label, b) for label in ("ar", "mtp_G1", "mtp_tree2") for b in (1, 2)}
  tree = [r for r in rows if r["label"] == "mtp_tree2"]
  assert all(r["tree"] == "2" and 1.0 <= r["tau"] <= 2.0 for r in tree)
  overall = res["results"]["overall"] if "results" in res else res["overall"]
  assert {(o["label"], o["batch_size"]) for o in overall} == {
      (r["label"], r["batch_size"]) for r in rows}
  assert "| 2 | 0 | code | mtp_tree2 |" in open(out + ".md").read()
