"""scripts/bench_hf.py (library and CLI) on a tiny random Llama
written by transformers (``tests.tiny_bpe.write_tiny_hf_llama``): our AR
``Decoder`` and transformers' ``generate`` give identical tokens at B = 1
and 4 for exactly the token budget, timed side by side.

Needs torch and transformers (``make test-hf``); skipped without them
unless MTP_REQUIRE_HF=1, where a missing package is an error.
"""

import json
import os

import numpy as np
import pytest

if os.environ.get("MTP_REQUIRE_HF") == "1":
  import torch  # noqa: F401
  import transformers  # noqa: F401
else:
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  pytest.importorskip("tokenizers")

from scripts import bench_hf
from tests import tiny_bpe


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("bench_hf") / "llama")
  tiny_bpe.write_tiny_hf_llama(path, seed=5)
  return path


def test_no_stop_tokenizer_and_divergence():
  class Tok:
    stop_ids, eos_id, pad_id = (7, 8), 7, None
    vocab_size = 10
  t = bench_hf.NoStopTokenizer(Tok())
  assert t.stop_ids == () and t.pad_id == 7 and t.vocab_size == 10
  a = np.array([[1, 2, 3], [4, 5, 6]])
  assert bench_hf.first_divergence(a, a.copy()) is None
  b = a.copy()
  b[1, 2] = 0
  assert bench_hf.first_divergence(a, b) == 2
  assert bench_hf.first_divergence(a, a[:, :2]) == 2


def test_bench_decoder_vs_generate(tiny_dir):
  pair = bench_hf.load_hf_dir_pair(tiny_dir)
  lines, seen = [], []
  result = bench_hf.bench(pair, [1, 4], 12, 2, on_row=lambda r: seen.append(len(r["rows"])),
                          log=lines.append)
  assert seen == [1, 2] and len(lines) == 2
  for row, b in zip(result["rows"], (1, 4)):
    assert row["batch"] == b and row["new_tokens"] == 12 and row["repeats"] == 2
    assert row["identical_tokens"] and row["first_divergence"] is None
    assert row["ours_s_n"] == row["transformers_s_n"] == 2
    assert row["ours_s_min"] <= row["ours_s_median"] <= row["ours_s_max"]
    assert row["speedup_min"] <= row["speedup"] <= row["speedup_max"]
    assert row["ours_tokens_per_s"] == pytest.approx(b * 12 / row["ours_s_median"])
  assert "| 4 |" in bench_hf.markdown(result)
  # ours emits exactly the budget even where EOS would stop it: the tokens
  # compared are the Decoder's own (while_loop form) against generate's
  ids = bench_hf.chat_prompts(pair.tokenizer, 4)
  ours = bench_hf.ours_fn(pair, ids, 12)()
  theirs = bench_hf.theirs_fn(pair, ids, 12)()
  assert ours.shape == (4, 12) and np.array_equal(ours, theirs)


def test_bench_reports_differing_tokens(tiny_dir, monkeypatch):
  pair = bench_hf.load_hf_dir_pair(tiny_dir)
  real = bench_hf.theirs_fn

  def wrong(pair, ids, n):
    f = real(pair, ids, n)
    return lambda: (f() + 1) % pair.tokenizer.vocab_size
  monkeypatch.setattr(bench_hf, "theirs_fn", wrong)
  rows = []
  with pytest.raises(bench_hf.TokensDiffer, match="B=1"):
    bench_hf.bench(pair, [1], 4, 1, on_row=lambda r: rows.extend(r["rows"]), log=None)
  assert rows and not rows[0]["identical_tokens"] and rows[0]["first_divergence"] == 0


def test_script_quick(tiny_dir, tmp_path):
  from scripts import bench_hf as script
  out = str(tmp_path / "bench_hf")
  assert script.main(["--hf_dir", tiny_dir, "--quick", "--batch_sizes", "1,3", "--out", out]) == 0
  with open(out + ".json") as f:
    report = json.load(f)
  assert [r["batch"] for r in report["results"]["rows"]] == [1, 3]
  assert report["meta"]["source"] == tiny_dir and report["meta"]["repeats"] == 1
  assert all(r["identical_tokens"] for r in report["results"]["rows"])
  assert open(out + ".md").read().startswith("Command: ")
