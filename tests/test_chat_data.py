"""Chat prompts (mtp.data.chat): the training prompt builder is deterministic
and covers its categories; the hand-written held-out set has its six
categories and shares no 8-word run and no 40-character substring with the
training prompts; the JSONL reader names the line of a bad entry."""

import json

import pytest

from mtp.data import DataError, chat

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
    assert m["role"] == "user" and 30 < len(m["content"]) <= chat.MAX_CONTEXT_CHARS + 400
    assert p["source"].startswith(("python_stdlib/", "python_docs/"))
  assert len({p["messages"][0]["content"] for p in train_prompts}) == N      # no repeats
  only = chat.chat_prompts(4, seed=3, data_dir=data_dir, categories=("qa",))
  assert [p["category"] for p in only] == ["qa"] * 4


def test_validation_prompts_come_from_validation_documents(data_dir):
  from mtp.data import split_for_name
  for p in chat.chat_prompts(14, seed=0, split="validation", data_dir=data_dir):
    corpus, name = p["source"].split("/", 1)
    assert split_for_name(corpus, name) == "validation"


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
  with any of the first 300 training prompts of seed 0 or the first 100 of
  the validation split."""
  held = chat.heldout_chat_prompts()
  by_cat = {}
  for p in held:
    by_cat.setdefault(p["category"], []).append(p)
  assert set(chat.HELDOUT_CATEGORIES) <= set(by_cat)
  assert all(len(by_cat[c]) >= 8 for c in chat.HELDOUT_CATEGORIES)
  assert len({p["prompt"] for p in held}) == len(held)
  training = (chat.chat_prompts(300, seed=0, data_dir=data_dir)
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
