"""ShareGPT conversations (mtp.data.sharegpt) on small files made here (the
extra is not needed): record-by-record reading with a cut tail, filters,
the held-out split, teacher-forced examples' loss masks; and the hidden
cache's resumed and row-reusing builds (train.hidden_cache.build)."""

import io
import json
import os

import numpy as np
import pytest

from mtp.bpe import BPETokenizer
from mtp.data import sharegpt
from tests import tiny_bpe
from train import hidden_cache as cache_lib


def _rec(cid, *turns, roles=None):
  roles = roles or ["human", "gpt"] * len(turns)
  return {"id": cid, "conversations": [{"from": r, "value": t} for r, t in zip(roles, turns)]}


def _file(records, cut_tail=True):
  text = json.dumps(records, indent=2)
  if cut_tail:
    text = text[:-1].rstrip() + ',\n  {"id": "cut_0", "conversations": [{"from": "human", "va'
  return io.BytesIO(text.encode())


def test_records_are_read_one_by_one_and_a_cut_tail_is_counted():
  recs = [_rec(f"c{i}_0", f"question {i}?", f"answer {i}.") for i in range(5)]
  convs, st = sharegpt.read_conversations(_file(recs), heldout_per_10k=0)
  assert st.records == 5 and st.truncated_tail and st.kept == 5
  assert [c.turns for c in convs] == [(f"question {i}?", f"answer {i}.") for i in range(5)]
  convs, st = sharegpt.read_conversations(_file(recs, cut_tail=False), heldout_per_10k=0)
  assert st.records == 5 and not st.truncated_tail
  with pytest.raises(ValueError, match="not a JSON array"):
    sharegpt.read_conversations(io.BytesIO(b'{"id": 1}'))


def test_filters_and_the_alternation_cut():
  recs = [
      _rec("a_0", "hi", "hello", "more?", "", roles=["human", "gpt", "human", "gpt"]),  # cut at ""
      _rec("b_0", "x", "y", roles=["gpt", "human"]),                   # starts with the assistant
      _rec("c_0", "q" * 50, "a"),                                       # over-long prompt
      _rec("d_0", "Привет, как дела у тебя сегодня?", "Хорошо, спасибо!"),  # non-text
      _rec("e_0", "  HI  ", "again"),                                   # duplicate of a_0's turn
      _rec("f_0", "sys", "u", "a", roles=["system", "human", "gpt"]),
  ]
  convs, st = sharegpt.read_conversations(_file(recs, False), max_prompt_chars=40,
                                          heldout_per_10k=0)
  assert [c.id for c in convs] == ["a_0"] and convs[0].turns == ("hi", "hello")
  assert st.dropped == {"no_user_assistant_pair": 2, "over_long_prompt": 1, "non_text": 1,
                        "duplicate": 1}


def test_the_heldout_split_is_stable_and_keeps_the_parts_of_one_conversation_together():
  ids = [f"conv{i}_{p}" for i in range(400) for p in range(3)]
  splits = {i: sharegpt.split_of(i, 1000) for i in ids}
  assert splits == {i: sharegpt.split_of(i, 1000) for i in ids}
  for i in range(400):
    assert len({splits[f"conv{i}_{p}"] for p in range(3)}) == 1
  share = sum(s == "heldout" for s in splits.values()) / len(ids)
  assert 0.05 < share < 0.16          # 10 % expected; binomial sd over 400 bases ~1.5 %
  assert all(sharegpt.split_of(i, 0) == "train" for i in ids)


def test_overlap_with_the_heldout_prompts_is_dropped():
  convs = [sharegpt.Conversation("a_0", ("Translate 'good morning' into French.", "Bonjour."), "train"),
           sharegpt.Conversation("b_0", ("Tell me a joke about cats.", "..."), "train")]
  kept, dropped = sharegpt.drop_overlapping(convs, ["Translate 'good morning' into French."])
  assert [c.id for c in kept] == ["b_0"] and dropped[0][0] == "a_0"


@pytest.fixture(scope="module")
def chat_tokenizer():
  tk = tiny_bpe.train_tiny_bpe()
  ids = {s: tk.token_to_id(s) for s in tiny_bpe.SPECIALS}
  return BPETokenizer(tk, bos_id=None, eos_id=ids["<|im_end|>"], pad_id=ids["<pad>"],
                      stop_ids=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                      chat_template=tiny_bpe.CHAT_TEMPLATE)


def test_conversation_example_masks_exactly_the_assistant_turns(chat_tokenizer):
  tk = chat_tokenizer
  conv = sharegpt.Conversation("a_0", ("hello world", "hello there", "for i?", "print(i)"), "train")
  ex = sharegpt.conversation_example(tk, conv, seq_len=512)
  full = tk.apply_chat_template(conv.messages(), add_generation_prompt=False)
  np.testing.assert_array_equal(ex["tokens"], full)
  end = tk.token_to_id("<|im_end|>")
  # the masked tokens are each answer's ids followed by its end-of-turn id
  want = []
  for a in (1, 3):
    p = tk.apply_chat_template(conv.messages(a), add_generation_prompt=True)
    ans = tk.apply_chat_template(conv.messages(a + 1), add_generation_prompt=False)[len(p):]
    want += list(ans[:list(ans).index(end) + 1])
  assert list(ex["tokens"][ex["loss_mask"] == 1]) == want
  assert tk.decode(ex["tokens"][ex["loss_mask"] == 1]) == "hello thereprint(i)"
  short = sharegpt.conversation_example(tk, conv, seq_len=26)   # prompt: 23 ids
  assert len(short["tokens"]) == 26 and short["loss_mask"].sum() == 3
  assert sharegpt.conversation_example(tk, conv, seq_len=23) is None     # the prompt fills the row


# -- hidden cache: resumed and reused builds ------------------------------------

T, D = 8, 3


def _rows(n, seed):
  rng = np.random.default_rng(seed)
  tok = rng.integers(0, 50, (n, T)).astype(np.int32)
  return {"tokens": tok, "segment_ids": np.ones((n, T), np.int32),
          "positions": np.tile(np.arange(T, dtype=np.int32), (n, 1)),
          "loss_mask": np.ones((n, T), np.int32)}


class _Backbone:
  """h^0 = a fixed function of the tokens; counts the rows it computes."""

  def __init__(self, fail_after=None):
    self.rows, self.calls, self.fail_after = [], 0, fail_after

  def __call__(self, b):
    if self.fail_after is not None and self.calls >= self.fail_after:
      raise KeyboardInterrupt
    self.calls += 1
    self.rows.append(b["tokens"].copy())
    t = b["tokens"].astype(np.float32)
    return np.stack([t, t * 2 + b["positions"], -t], -1)


def _build(folder, rows, fn, source):
  return cache_lib.build(folder, rows, fn, batch_size=4, d_model=D, dtype="float32",
                         source=source, log=lambda s: None, save_every=1)


SOURCE = {"backbone": "b1", "seq_len": T, "tokenizer": "t", "dtype": "float32", "data": {"name": "x"}}


def test_a_killed_build_resumes_where_it_stopped(tmp_path):
  rows = _rows(18, 0)
  with pytest.raises(KeyboardInterrupt):
    _build(str(tmp_path / "c"), rows, _Backbone(fail_after=3), SOURCE)
  assert not os.path.exists(tmp_path / "c")           # never read half-built
  again = _Backbone()
  cache = _build(str(tmp_path / "c"), rows, again, SOURCE)
  assert again.calls == 2                              # 18 rows, 4 a batch: 3 done, 2 left
  np.testing.assert_array_equal(cache.h0, _Backbone()(rows).astype(np.float32))
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_rows_of_a_cache_from_the_same_backbone_are_copied_not_recomputed(tmp_path):
  old = _rows(10, 1)
  _build(str(tmp_path / "old"), old, _Backbone(), SOURCE)
  new = {k: np.concatenate([v[:7], _rows(5, 2)[k]]) for k, v in old.items()}
  fn = _Backbone()
  cache = _build(str(tmp_path / "new"), new, fn, {**SOURCE, "data": {"name": "y"}})
  assert sum(len(r) for r in fn.rows) == 8 and fn.calls == 2     # 5 new rows, padded to 4s
  np.testing.assert_array_equal(cache.h0, _Backbone()(new))
  other = _Backbone()
  _build(str(tmp_path / "third"), new, other, {**SOURCE, "backbone": "b2"})
  assert other.calls == 3                                         # another backbone: all 12
