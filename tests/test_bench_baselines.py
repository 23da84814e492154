"""``scripts.baseline_decoders`` (transformers' greedy ``generate``, prompt
lookup decoding, llama.cpp) beside our AR decoder in one interleaved
``measure_point``, and ``scripts/bench_baselines.py`` /
``scripts/bench_chat.py --baselines``, on a tiny random Llama written by
transformers (``tests.tiny_bpe.write_tiny_hf_llama``): the transformers
baselines give our AR tokens exactly; llama.cpp is skipped with one line
when it is not installed or the model is not a GGUF file.

Runs in ``make test-hf`` (MTP_REQUIRE_HF=1; a missing torch / transformers
is then an error), skipped otherwise: ``make test`` needs no torch.
"""

import json
import os

import numpy as np
import pytest

if os.environ.get("MTP_REQUIRE_HF") != "1":
  pytest.skip("transformers baselines: make test-hf (MTP_REQUIRE_HF=1)", allow_module_level=True)

import torch  # noqa: E402,F401
import transformers  # noqa: E402,F401

from decode.decoder import Decoder, SamplingParams  # noqa: E402
from scripts import baseline_decoders, bench_chat, bench_hf, bench_lib  # noqa: E402
from tests import tiny_bpe  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(HF directory, workdir imported from it with one MTP module)."""
  from mtp.importers.hf import import_hf_dir
  root = tmp_path_factory.mktemp("baselines")
  path = str(root / "llama")
  tiny_bpe.write_tiny_hf_llama(path, seed=7)
  return path, import_hf_dir(path, str(root / "wd"), mtp_depth=1)


def test_parse_specs():
  specs = baseline_decoders.parse_specs(
      "transformers, prompt_lookup:3,prompt_lookup,llamacpp,transformers,llamacpp:1")
  assert [s.label for s in specs] == ["hf_greedy", "hf_lookup3", "hf_lookup10", "llamacpp",
                                      "llamacpp_t1"]
  assert specs[4].threads == 1 and specs[3].threads is None
  assert baseline_decoders.parse_specs("") == ()
  for bad in ("vllm", "prompt_lookup:0", "prompt_lookup:x", "transformers:3", "llamacpp:0",
              "prompt_lookup,,llamacpp", "transformers,"):
    with pytest.raises(ValueError, match="baseline"):
      baseline_decoders.parse_specs(bad)


def test_hf_baselines_beside_ar_in_one_point(tiny):
  path, _ = tiny
  pair = bench_hf.load_hf_dir_pair(path)
  specs = baseline_decoders.parse_specs("transformers,prompt_lookup:3,llamacpp")
  lines = []
  fns, info = baseline_decoders.build(specs, path, pair.cfg.model, pair.tokenizer, log=lines.append)
  # a directory is no GGUF file: llama.cpp is skipped with one line, whatever is installed
  assert list(fns) == ["hf_greedy", "hf_lookup3"] and info["labels"] == list(fns)
  assert list(info["skipped"]) == ["llamacpp"] and len(lines) == 1 and "skipped" in lines[0]
  assert info["prompt_lookup_num_tokens"] == [3]
  prompts = [pair.tokenizer.apply_chat_template([{"role": "user", "content": t}])
             for t in ("hello world", "def main(argv):")]
  wrong = lambda ids, n: (fns["hf_greedy"](ids, n) + 1) % pair.tokenizer.vocab_size
  decs = {"ar": Decoder(pair.model, "ar", tokenizer=pair.tokenizer)}
  rows = bench_lib.measure_point(decs, prompts, 1, 12, SamplingParams(0.0), 2,
                             baselines={**fns, "wrong": wrong})
  by = {r["label"]: r for r in rows}
  assert set(by) == {"ar", "hf_greedy", "hf_lookup3", "wrong"}
  ar_tokens = by["hf_greedy"]["ar_tokens"]
  for label in ("hf_greedy", "hf_lookup3"):
    r = by[label]
    assert r["method"] == "baseline" and r["identical_to_ar"], label
    assert r["new_tokens"] == ar_tokens and r["agreement_tokens"] == min(ar_tokens)
    assert r["wall_s_min"] <= r["wall_s_median"] <= r["wall_s_max"] and r["speedup"] > 0
    assert r["tokens_per_s"] == pytest.approx(np.mean(r["new_tokens"]) / r["wall_s_median"])
    assert r["tau"] is None and r["speedup_decode"] is None
  assert not by["wrong"]["identical_to_ar"] and by["wrong"]["agreement_tokens"] == 0
  with pytest.raises(ValueError, match="B = 1"):
    bench_lib.measure_point(decs, prompts, 2, 4, SamplingParams(0.0), 1, baselines=fns)


def test_llamacpp_missing_is_one_line(tiny, monkeypatch):
  path, _ = tiny
  monkeypatch.setattr(baseline_decoders, "llamacpp_available", lambda: False)
  lines = []
  fns, info = baseline_decoders.build(baseline_decoders.parse_specs("llamacpp"), path, None, None,
                                    log=lines.append)
  assert fns == {} and lines == [f"llama.cpp baseline skipped: {info['skipped']['llamacpp']}"]
  assert "not installed" in lines[0]


def test_chat_template_ids_match(tiny):
  path, wd = tiny
  from mtp import tokenizer as tok_lib
  tk = tok_lib.load_tokenizer(wd)
  msgs = bench_chat.heldout_messages(bench_chat.chat_lib.HELDOUT_CHAT_PATH, 2, ("code", "writing"))
  ids = {c: [tk.apply_chat_template(m) for m in ms] for c, ms in msgs.items()}
  got = baseline_decoders.check_prompt_ids(path, msgs, ids)
  assert got == {"prompts": 4, "identical": 4, "differ": []}


def test_scripts_side_by_side(tiny, tmp_path, capsys):
  path, wd = tiny
  from scripts import bench_baselines as script
  out = str(tmp_path / "b")
  assert script.main(["--workdir", wd, "--baseline_model", path, "--quick", "--num_draft_tokens", "1",
                      "--baselines", "transformers,prompt_lookup:3,llamacpp", "--out", out]) == 0
  assert "llama.cpp baseline skipped" in capsys.readouterr().out
  res = json.load(open(out + ".json"))["results"]
  assert {r["label"] for r in res["rows"]} == {"ar", "mtp_G1", "hf_greedy", "hf_lookup3"}
  assert all(r["identical_to_ar"] for r in res["rows"] if r["method"] == "baseline")
  assert res["baselines"]["prompt_ids"]["identical"] == 1
  md = open(out + ".md").read()
  assert "## Side by side" in md and "| code | hf_greedy | " in md
  from scripts import bench_chat as chat_script
  out2 = str(tmp_path / "c")
  assert chat_script.main(["--workdir", wd, "--baseline_model", path, "--quick", "--categories",
                           "math", "--temperatures", "0,0.5", "--baselines", "transformers",
                           "--out", out2]) == 0
  rows = json.load(open(out2 + ".json"))["results"]["rows"]
  assert {(r["label"], r["temperature"]) for r in rows} == {
      ("ar", 0.0), ("mtp_G1", 0.0), ("hf_greedy", 0.0), ("ar", 0.5), ("mtp_G1", 0.5)}
