"""Chat prompts (mtp.data.chat): the training prompt builder is deterministic
and covers its categories; the hand-written held-out set has its six
categories and shares no 8-word run and no 40-character substring with the
training prompts; the JSONL reader names the line of a bad entry."""

import json

import pytest

from mtp.data import DataError, chat, chat_general

N = 70


@pytest.fixture(scope="module")
def train_prompts(data_dir):
  return chat.chat_prompts(N, seed=0, data_dir=data_dir)


def test_chat_prompts_deterministic_by_category(train_prompts, data_dir):
  again = chat.chat_prompts(N, seed=0, data_dir=data_dir)
  assert again == train_prompts
  assert chat.chat_prompts(10, seed=0, data_dir=data_dir) == train_prompts[:10]   # a prefix
  assert chat.chat_prompts(N, seed=1, data_dir=data_dir) != train_prompts
  cats = [p["category"] for p in train_prompts]
  assert cats == [chat.CATEGORIES[i % len(chat.CATEGORIES)] for i in range(N)]
  for p in train_prompts:
    assert set(p) == {"category", "messages", "source"}
    (m,) = p["messages"]
    assert m["role"] == "user" and 15 < len(m["content"]) <= chat.MAX_CONTEXT_CHARS + 400
    assert p["source"].startswith(("python_stdlib/", "python_docs/", "generated/"))
    if p["category"] in chat_general.GENERAL_CATEGORIES:
      assert p["source"] == f"generated/{p['category']}" or (
          p["category"] == "translate" and p["source"].startswith("python_docs/"))
    else:
      assert not p["source"].startswith("generated/")
  assert len({p["messages"][0]["content"] for p in train_prompts}) == N      # no repeats
  only = chat.chat_prompts(4, seed=3, data_dir=data_dir, categories=("qa",))
  assert [p["category"] for p in only] == ["qa"] * 4


def test_validation_prompts_come_from_validation_documents(data_dir):
  from mtp.data import split_for_name
  val = chat.chat_prompts(44, seed=0, split="validation", data_dir=data_dir)
  for p in val:
    corpus, name = p["source"].split("/", 1)
    if corpus != "generated":
      assert split_for_name(corpus, name) == "validation"
  # composed prompts (math, translate, write, general): no validation prompt is a
  # training prompt, and validation topics are a part of each list training never draws
  train = {chat.prompt_text(p) for p in chat.chat_prompts(440, seed=0, data_dir=data_dir)}
  gen = [p for p in val if p["source"].startswith("generated/")]
  assert len(gen) >= 12 and not any(chat.prompt_text(p) in train for p in gen)
  train_topics = " ".join(train)
  held_topics = chat_general._TOPICS[::10] + chat_general._CONCEPTS[::10]
  assert not any(t in train_topics for t in held_topics)


@pytest.mark.parametrize("kw, needle", [
    (dict(n=-1), "n=-1 must be an integer >= 0"),
    (dict(n=2, seed=-3), "seed=-3"),
    (dict(n=2, categories=("poetry",)), "each must be one of"),
    (dict(n=2, max_context_chars=10), "max_context_chars=10 must be an integer >= 200"),
])
def test_chat_prompts_bad_arguments(kw, needle, data_dir):
  with pytest.raises(DataError, match=needle):
    chat.chat_prompts(data_dir=data_dir, **kw)


def test_heldout_set_categories_and_no_overlap(data_dir):
  """Overlap is checked by ``chat.overlaps``: lower-cased, whitespace
  collapsed, no shared run of 8 words and no common 40-character substring
  with any of the first 1,100 training prompts of seeds 0, 1 and 2 (the
  stage's recipe, ``make smollm-mtp``, and the added data of docs/results.md
  13.12) or the first 100 of the validation split; a
  short prompt (< 8 words) overlaps when its words appear in order in the
  other."""
  held = chat.heldout_chat_prompts()
  by_cat = {}
  for p in held:
    by_cat.setdefault(p["category"], []).append(p)
  assert set(chat.HELDOUT_CATEGORIES) <= set(by_cat)
  assert all(len(by_cat[c]) >= 8 for c in chat.HELDOUT_CATEGORIES)
  assert len({p["prompt"] for p in held}) == len(held)
  training = (sum((chat.chat_prompts(1100, seed=s, data_dir=data_dir) for s in (0, 1, 2)), [])
              + chat.chat_prompts(100, seed=0, split="validation", data_dir=data_dir))
  hits = chat.overlaps([chat.prompt_text(p) for p in held],
                       [chat.prompt_text(p) for p in training])
  assert hits == [], [(held[i]["prompt"], s) for i, s in hits]


def test_overlaps_finds_shingles_and_substrings():
  ref = ["Summarise this passage from the Python documentation in a few sentences: x"]
  assert chat.overlaps(["please SUMMARISE this   passage from the python documentation in a"],
                       ref)[0][0] == 0
  assert chat.overlaps(["zz" + "abcdefghij" * 4 + "zz"], ["--" + "abcdefghij" * 4])[0][0] == 0
  assert chat.overlaps(["What is the capital of France?"], ref) == []
  # short texts (< 8 words): caught when their words appear in order, either way round
  assert chat.overlaps(["Is 221 a prime number?"], ["Is 221 a prime number? Explain."]) == [
      (0, "is 221 a prime number")]
  assert chat.overlaps(["Please tell me: what is 17 multiplied by 23, exactly?"],
                       ["What is 17 multiplied by 23?"])[0][0] == 0
  assert chat.overlaps(["Is 222 a prime number?"], ["Is 221 a prime number? Explain."]) == []


def test_general_prompts_are_composed_and_deterministic():
  """math / translate / write / general prompts come from word lists and
  random numbers (no corpus); the same generator state gives the same prompt;
  the arithmetic of a linear equation and a division is consistent."""
  import re

  import numpy as np
  for cat in chat_general.GENERAL_CATEGORIES:
    a = [chat_general.general_prompt(cat, np.random.default_rng([5, i])) for i in range(40)]
    b = [chat_general.general_prompt(cat, np.random.default_rng([5, i])) for i in range(40)]
    assert a == b and len(set(a)) >= 30, cat
    assert all(15 < len(t) < 400 for t in a), cat
  seen = 0
  for i in range(400):
    t = chat_general.general_prompt("math", np.random.default_rng([1, i]))
    m = re.fullmatch(r"(?:Find x if|What value of x satisfies) (\d+)x ([+-]) (\d+) = (-?\d+)\.\??", t)
    if m:
      a, s, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
      assert (c - b if s == "+" else c + b) % a == 0, t      # an integer solution
      seen += 1
    m = re.fullmatch(r"Divide (\d+) by (\d+)\. What is the result\?", t)
    if m:
      assert int(m[1]) % int(m[2]) == 0, t
      seen += 1
  assert seen > 20
  t = chat_general.general_prompt("translate", np.random.default_rng(0),
                                  pydoc_sentence="The loop ends here.")
  assert "The loop ends here." in t and any(lang in t for lang in chat_general.LANGUAGES)
  with pytest.raises(ValueError, match="unknown general chat category"):
    chat_general.general_prompt("poetry", np.random.default_rng(0))
  assert chat_general.first_sentence("Returns a list.  More text here.") is None   # too short
  assert chat_general.first_sentence(
      "The mode argument selects how the file is opened. Later text.") == (
      "The mode argument selects how the file is opened.")
  assert chat_general.first_sentence("Use ``x = 1`` to set it, as shown in the example.") is None


def test_prompt_messages_and_text():
  p = {"category": "code", "prompt": "Hi", "system": "Be brief."}
  assert chat.prompt_messages(p) == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi"}]
  assert chat.prompt_text(p) == "Be brief.\nHi"
  assert chat.prompt_messages({"prompt": "x"}) == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("lines, needle", [
    (['{"prompt": "ok"}', '{"prompt": "a",}'], "line 2 is not valid JSON"),
    (['{"category": "x"}'], 'line 1: missing field "prompt"'),
    (['{"prompt": "a", "colour": "red"}'], r"line 1: unknown field\(s\) \['colour'\]"),
    (['{"prompt": ""}'], 'line 1: field "prompt" is empty'),
    (['{"prompt": 3}'], 'line 1: field "prompt" must be a string'),
    (['["a"]'], "line 1 must be a JSON object"),
    (['', '  '], "holds no prompt"),
])
def test_read_prompt_jsonl_errors_name_the_line(tmp_path, lines, needle):
  path = tmp_path / "p.jsonl"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(DataError, match=needle):
    chat.read_prompt_jsonl(str(path))


def test_read_prompt_jsonl_reads_fields(tmp_path):
  path = tmp_path / "p.jsonl"
  rows = [{"prompt": "a", "category": "math"}, {"prompt": "b", "system": "s"}]
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
  assert chat.read_prompt_jsonl(str(path)) == rows
