"""Self-written prompts (mtp.data.self_prompts, scripts/self_prompts.py): each
filter rejects what it names, dedupe, held-out overlap, the user-turn
prefix, sampling determinism on a tiny BPE target, the JSONL output read
by the project's prompt reader, and mixing sources by weight."""

import json
import os

import numpy as np
import pytest

from mtp import tokenizer as tok
from mtp.data import chat as chat_lib
from mtp.data import self_prompts as sp
from mtp.data.corpora import DataError
from scripts import self_prompts as sps
from tests import tiny_bpe

GOOD = "Write a short poem about the sea at night."


@pytest.fixture(scope="module")
def bpe_workdir(tmp_path_factory):
  return tiny_bpe.import_tiny_workdir(str(tmp_path_factory.mktemp("self_prompts_wd")))


@pytest.fixture(scope="module")
def decoder(bpe_workdir):
  from decode.decoder import Decoder
  from mtp import loading
  _, model, _ = loading.load_model(bpe_workdir)
  return Decoder(model, "ar", tokenizer=tok.load_tokenizer(bpe_workdir))


# -- filters ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text,reason", [
    ("", "empty"),
    ("  \n\t ", "empty"),
    ("Hi there", "too_short"),                                  # 8 characters
    ("Supercalifragilistic", "too_short"),                      # one word
    ("Tell me " * 300, "too_long"),
    ("Please explain this \x07 bell character.", "non_printable"),
    ("Bytes that did not decode \ufffd here.", "non_printable"),
    ("Zero\u200bwidth space inside this request.", "non_printable"),
    ("tell me a story " * 4, "repetition"),                     # a 3-gram 4 times
    ("What is this?" + "!" * 20, "repetition"),                 # a run of 21
    ("yes no maybe no yes yes maybe no no yes maybe maybe yes no", "repetition"),  # 3 of 14 distinct
    ("Hello, how can I assist you today?", "assistant_like"),
    ("As an AI language model, I cannot browse the web.", "assistant_like"),
    ("Sure, here is a poem about the sea.", "assistant_like"),
    (GOOD, None),
    ("Hello! Can you help me plan a trip to Rome?", None),
    ("How can I help my daughter learn to read?", None),
    ("Traduis en français : « le chat dort ».", None),
    ("Write a Python function\n\treturning the sum of a list.", None),
])
def test_each_filter_rejects_what_it_names(text, reason):
  assert sp.check_text(text) == reason
  kept, reasons = sp.filter_prompts([text], heldout=[])
  assert reasons == [reason] and kept == ([] if reason else [text.strip()])


def test_thresholds_are_settings_and_validated():
  assert sp.check_text(GOOD, sp.FilterSettings(max_chars=20)) == "too_long"
  assert sp.check_text("Hi there", sp.FilterSettings(min_chars=1, min_words=1)) is None
  with pytest.raises(DataError, match=r"^max_chars=5 must be an integer >= min_chars=12$"):
    sp.filter_prompts([GOOD], sp.FilterSettings(max_chars=5), heldout=[])
  with pytest.raises(DataError, match=r"^min_distinct_words=2 must be in \[0, 1\]$"):
    sp.FilterSettings(min_distinct_words=2).validate()


def test_exact_and_near_duplicates_are_dropped_across_calls():
  texts = ["Write a poem about cats.", "write a poem about CATS!", "Write  a poem,  about cats",
           "Write a poem about dogs."]
  seen = set()
  kept, reasons = sp.filter_prompts(texts, heldout=[], seen=seen)
  assert kept == [texts[0], texts[3]]
  assert reasons == [None, "duplicate", "duplicate", None]
  kept2, reasons2 = sp.filter_prompts(["WRITE A POEM ABOUT DOGS", "A new request here."],
                                      heldout=[], seen=seen)
  assert reasons2 == ["duplicate", None] and kept2 == ["A new request here."]


def test_heldout_overlap_is_rejected_with_the_projects_check():
  held = chat_lib.heldout_chat_prompts()
  text = chat_lib.prompt_text(held[0])
  candidate = "Here is my question for you today. " + text
  kept, reasons = sp.filter_prompts([candidate, GOOD])          # default: the package's set
  assert reasons == ["heldout_overlap", None] and kept == [GOOD]
  # the same rule as chat.overlaps, with an explicit reference
  assert chat_lib.overlaps([candidate], [text])
  assert sp.filter_prompts([candidate], heldout=[])[1] == [None]


# -- the user-turn prefix and sampling ----------------------------------------------------------

def test_user_turn_prefix_is_the_templates_text_before_a_users_content(bpe_workdir):
  tk = tok.load_tokenizer(bpe_workdir)
  prefix = sp.user_turn_prefix(tk)
  assert tk.decode(prefix, skip_special_tokens=False) == "<|im_start|>user\n"
  full = tk.apply_chat_template([{"role": "user", "content": GOOD}], add_generation_prompt=False)
  np.testing.assert_array_equal(full[:len(prefix)], prefix)
  with pytest.raises(DataError, match="chat template"):
    sp.user_turn_prefix(tok.ByteTokenizer())


def test_sampling_is_deterministic_by_seed(decoder):
  prefix = sp.user_turn_prefix(decoder.tokenizer)
  s = sp.SampleSettings(max_len=24, batch_size=8, seed=3)
  a = sps.sample_user_turns(decoder, prefix, s, 0)
  assert a == sps.sample_user_turns(decoder, prefix, s, 0)
  assert a != sps.sample_user_turns(decoder, prefix, s, 1)
  other = sps.sample_user_turns(decoder, prefix, sp.SampleSettings(max_len=24, batch_size=8,
                                                                  seed=4), 0)
  assert a != other and len(a) == 8
  assert all(t is None or isinstance(t, str) for t in a)
  loose = sp.FilterSettings(min_chars=1, min_words=1)
  run = lambda seed: sps.generate_self_prompts(
      decoder, 4, sp.SampleSettings(max_len=24, batch_size=8, seed=seed, max_rounds=2), loose)
  p1, s1 = run(0)
  assert (p1, s1) == run(0)
  assert s1["sampled"] == 16 and s1["rounds"] == 2 or s1["kept"] == 4
  assert s1["kept"] + sum(s1["rejected"].values()) <= s1["sampled"]


def test_generator_stops_when_enough_are_kept_and_counts_reasons(decoder, monkeypatch):
  rounds = [[GOOD, None, "", "Hi"], [GOOD.upper(), "Name three rivers in Africa, please.", None,
                                      "Explain how a rainbow forms in the sky."],
            ["never reached: this round is not sampled"]]
  calls = []

  def fake(dec, prefix, settings, round_index):
    calls.append(round_index)
    return rounds[round_index]
  monkeypatch.setattr(sps, "sample_user_turns", fake)
  prompts, stats = sps.generate_self_prompts(decoder, 3, sp.SampleSettings(batch_size=4),
                                            heldout=[])
  assert calls == [0, 1]
  assert prompts == [{"category": "self_written", "prompt": t}
                     for t in (GOOD, "Name three rivers in Africa, please.",
                               "Explain how a rainbow forms in the sky.")]
  assert stats["sampled"] == 8 and stats["kept"] == 3 and stats["rounds"] == 2
  assert stats["rejected"] == {"unfinished": 2, "empty": 1, "too_short": 1, "too_long": 0,
                               "non_printable": 0, "repetition": 0, "assistant_like": 0, "duplicate": 1,
                               "heldout_overlap": 0}
  monkeypatch.setattr(sps, "sample_user_turns", lambda *a: [None] * 4)
  prompts, stats = sps.generate_self_prompts(decoder, 3, sp.SampleSettings(max_rounds=3),
                                            heldout=[])
  assert prompts == [] and stats["rounds"] == 3 and stats["rejected"]["unfinished"] == 12


@pytest.mark.parametrize("kw,needle", [(dict(max_len=0), r"^max_len=0 must be an integer >= 1$"),
                                       (dict(top_p=0.0), r"^top_p=0\.0 must be in \(0, 1\]$"),
                                       (dict(temperature=-1.0), r"^temperature=-1\.0 must be >= 0$")])
def test_sample_settings_are_validated(kw, needle):
  with pytest.raises(DataError, match=needle):
    sp.SampleSettings(**kw).validate()


# -- output, reader, mixing -----------------------------------------------------------------------

def test_output_is_read_by_the_projects_jsonl_reader(tmp_path, bpe_workdir):
  prompts = [{"category": "self_written", "prompt": GOOD},
             {"category": "self_written", "prompt": "Écris « bonjour »\nen trois langues."}]
  path = str(tmp_path / "p.jsonl")
  sp.write_prompt_jsonl(path, prompts)
  assert chat_lib.read_prompt_jsonl(path) == prompts
  chat = sp.read_self_prompts(path)
  assert chat[0] == {"category": "self_written", "source": "self_written",
                     "messages": [{"role": "user", "content": GOOD}]}
  # the form scripts.self_distill.answer_examples renders with the chat template
  tk = tok.load_tokenizer(bpe_workdir)
  ids = tk.apply_chat_template(chat[1]["messages"], add_generation_prompt=True)
  assert tk.decode(ids).startswith("user\nÉcris")


def test_mix_prompt_sources_by_weight():
  a = [f"a{i}" for i in range(10)]
  b = [f"b{i}" for i in range(10)]
  c = [f"c{i}" for i in range(10)]
  mixed = sp.mix_prompt_sources({"templated": a, "self": b, "other": c},
                                {"templated": 1, "self": 3}, 8, seed=0)
  assert sorted(mixed) == sorted(a[:2] + b[:6])                  # first items of each, 2:6
  assert mixed == sp.mix_prompt_sources({"templated": a, "self": b}, {"templated": 1, "self": 3},
                                        8, seed=0)
  assert mixed != sp.mix_prompt_sources({"templated": a, "self": b}, {"templated": 1, "self": 3},
                                        8, seed=1)
  odd = sp.mix_prompt_sources({"x": a, "y": b, "z": c}, {"x": 1, "y": 1, "z": 1}, 7)
  assert len(odd) == 7 and sum(s.startswith("a") for s in odd) == 3    # remainder to the first
  with pytest.raises(DataError, match="unknown source"):
    sp.mix_prompt_sources({"x": a}, {"y": 1}, 3)
  with pytest.raises(DataError, match="not all 0"):
    sp.mix_prompt_sources({"x": a}, {"x": 0}, 3)
  with pytest.raises(DataError, match=r"prompt source 'x' has 10 prompts; its weight asks for 12"):
    sp.mix_prompt_sources({"x": a, "y": b}, {"x": 3, "y": 1}, 16)


def test_cli_writes_prompts_and_metadata(bpe_workdir, tmp_path, capsys):
  from scripts import self_prompts as cli
  out = str(tmp_path / "sp.jsonl")
  rc = cli.main(["--workdir", bpe_workdir, "--out", out, "--num_prompts", "2", "--max_len", "24",
                 "--batch_size", "8", "--max_rounds", "2", "--min_chars", "1", "--min_words", "1",
                 "--seed", "0"])
  meta = json.load(open(out + ".meta.json"))
  assert rc == (0 if meta["kept"] else 1)
  assert meta["generator"] == "scripts.self_prompts" and meta["sampling"]["max_len"] == 24
  assert meta["rounds"] <= 2 and meta["sampled"] == 8 * meta["rounds"]
  lines = open(out).read().splitlines()
  assert len(lines) == meta["kept"]
  if lines:
    assert all(p["category"] == "self_written" for p in chat_lib.read_prompt_jsonl(out))
  assert cli.main(["--workdir", bpe_workdir, "--out", out, "--top_p", "0"]) == 2
  assert "top_p=0.0 must be in (0, 1]" in capsys.readouterr().err
  assert os.path.exists(out)
  # a workdir that does not exist is named as such (not "a byte tokenizer has no chat template")
  assert cli.main(["--workdir", str(tmp_path / "nope"), "--out", str(tmp_path / "x.jsonl")]) == 2
  err = capsys.readouterr().err
  assert "nope" in err and "chat template" not in err and len(err.strip().splitlines()) == 1


def test_a_full_share_builds_no_templated_prompt(tmp_path, monkeypatch):
  """``self_distill.training_chat_prompts`` builds only the templated
  prompts the mix takes: none at share 1 (asking the corpora for thousands
  of unique prompts it does not use failed a 6,000-prompt ShareGPT run), and
  at share 0.5 exactly the mix of the full templated list (a list of n
  extends a shorter one)."""
  from scripts import self_distill as sd
  rows = [{"category": "sharegpt", "prompt": f"question number {i}?"} for i in range(8)]
  path = tmp_path / "p.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  asked = []
  fake = lambda n, split, **kw: asked.append(n) or [
      {"category": "code", "messages": [{"role": "user", "content": f"t{i}"}]} for i in range(n)]
  monkeypatch.setattr(sd.data_lib, "chat_prompts", fake)
  full = sd.ChatRecipe(self_prompts=str(path), self_prompt_share=1.0)
  got = sd.training_chat_prompts(full, 6, "train", {})
  assert asked == [] and len(got) == 6
  half = sd.ChatRecipe(self_prompts=str(path), self_prompt_share=0.5)
  got = sd.training_chat_prompts(half, 6, "train", {})
  assert asked == [3]
  assert got == sp.mix_prompt_sources({"templated": fake(6, "train"),
                                       "self_written": sp.read_self_prompts(str(path))},
                                      {"templated": 0.5, "self_written": 0.5}, 6, seed=half.seed)
