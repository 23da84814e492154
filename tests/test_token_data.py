"""Token datasets in the data pipeline (issue 22): a dataset with a
``tokens`` feature is packed as is with its ``loss_mask`` alongside; text
datasets keep their batches (no loss_mask) and can be encoded by a BPE
tokenizer; ``epoch_rows`` covers every document once, in stored order."""

import os
import shutil

import numpy as np
import pytest

from mtp import bpe
from mtp import data
from mtp import tokenizer as tok
from mtp.config import DataConfig
from mtp.data import pipeline
from tests.tiny_bpe import gguf_tokenizer_metadata, train_tiny_bpe

T = 16


def _examples(n, seed=0):
  """n token examples: a 'prompt' of 2..6 ids (mask 0), an 'answer' of
  1..12 ids (mask 1); ids encode (example, position) so packing is checkable."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    p, a = int(rng.integers(2, 7)), int(rng.integers(1, 13))
    toks = (np.arange(p + a) + 20 * i) % 250
    mask = np.r_[np.zeros(p), np.ones(a)].astype(np.int32)
    out.append((f"{i:07d}", {"tokens": toks.astype(np.int32), "loss_mask": mask,
                             "category": ["qa", "code"][i % 2]}))
  return out


@pytest.fixture(scope="module")
def token_cfg(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("tokds"))
  rows = _examples(23)
  data.write_token_dataset("tok_ds", d, {"train": rows, "validation": _examples(5, 1)},
                           {"generator": "test"})
  return DataConfig(name="tok_ds", data_dir=d), dict(rows)


def _flat(rows, key):
  """The real (segment > 0) entries of ``rows[key]``, row after row."""
  return rows[key][rows["segment_ids"] > 0]


def test_epoch_rows_token_dataset_covers_every_example_once(token_cfg):
  cfg, by_key = token_cfg
  rows = data.epoch_rows(cfg, seq_len=T)
  assert set(rows) == {"tokens", "segment_ids", "positions", "loss_mask"}
  assert all(v.dtype == np.int32 and v.shape == rows["tokens"].shape for v in rows.values())
  src = data.load_source(cfg, "train")
  stored = [by_key[bytes(src[i]["name"]).decode()] for i in range(len(src))]   # file order
  # one pass in stored order: the rows, read row after row, are the examples concatenated
  np.testing.assert_array_equal(_flat(rows, "tokens"), np.concatenate([e["tokens"] for e in stored]))
  np.testing.assert_array_equal(_flat(rows, "loss_mask"),
                                np.concatenate([e["loss_mask"] for e in stored]))
  starts = (rows["positions"] == 0) & (rows["segment_ids"] > 0)
  cut = len(rows["tokens"]) - 1                # a row may start mid-example
  assert len(stored) <= starts.sum() <= len(stored) + cut
  n_tok = sum(len(e["tokens"]) for e in stored)
  assert rows["tokens"].shape == (-(-n_tok // T), T)
  pad = rows["segment_ids"] == 0
  assert pad.sum() == rows["tokens"].size - n_tok and pad[:-1].sum() == 0   # last row only
  assert (rows["loss_mask"][pad] == 0).all() and (rows["tokens"][pad] == tok.PAD_ID).all()
  val = data.epoch_rows(cfg, seq_len=T, split="validation")
  assert _flat(val, "tokens").size == sum(len(e["tokens"]) for _, e in _examples(5, 1))


def test_train_batches_carry_loss_mask(token_cfg):
  cfg, by_key = token_cfg
  ds = data.make_train_dataset(cfg, seq_len=T, batch_size=4, seed=0)
  it = iter(ds)
  docs = {tuple(int(x) for x in e["tokens"]): e["loss_mask"] for e in by_key.values()}
  checked = 0
  for _ in range(3):
    b = next(it)
    assert set(b) == {"tokens", "segment_ids", "positions", "loss_mask"}
    assert b["loss_mask"].shape == (4, T) and b["loss_mask"].dtype == np.int32
    assert (b["segment_ids"] > 0).all()                            # training rows are full
    for r in range(4):     # every piece starting a document carries that document's mask
      for s in range(1, b["segment_ids"][r].max() + 1):
        idx = np.flatnonzero(b["segment_ids"][r] == s)
        if s > 1 and idx[-1] < T - 1:          # neither the row's first nor last: whole
          key = tuple(int(x) for x in b["tokens"][r, idx])
          np.testing.assert_array_equal(b["loss_mask"][r, idx], docs[key])
          checked += 1
  assert checked >= 3
  evals = data.make_eval_batches(cfg, seq_len=T, batch_size=4, num_batches=10)
  last = evals[-1]
  assert "loss_mask" in last and (last["loss_mask"][last["segment_ids"] == 0] == 0).all()


def test_text_pipeline_unchanged_and_bpe_text(data_dir):
  cfg = DataConfig(name="python_docs", data_dir=data_dir)
  b = next(iter(data.make_train_dataset(cfg, seq_len=T, batch_size=2, seed=0)))
  assert set(b) == {"tokens", "segment_ids", "positions"}           # byte path: no loss_mask
  b2 = next(iter(data.make_train_dataset(cfg, seq_len=T, batch_size=2, seed=0,
                                         tokenizer=tok.ByteTokenizer())))
  for k in b:
    np.testing.assert_array_equal(b[k], b2[k])
  rows = data.epoch_rows(cfg, seq_len=64, split="validation")
  docs = data.load_documents(cfg, "validation")
  starts = rows["tokens"][(rows["positions"] == 0) & (rows["segment_ids"] > 0)]
  assert (starts == tok.BOS_ID).sum() == len(docs)
  assert (rows["loss_mask"] == (rows["segment_ids"] > 0)).all()
  assert int((rows["segment_ids"] > 0).sum()) == sum(len(d.encode()) + 2 for d in docs)
  # a BPE tokenizer encodes text with its BOS / EOS and pads with its pad id
  bt = bpe.BPETokenizer.from_gguf_metadata(gguf_tokenizer_metadata(train_tiny_bpe(320)))
  rows = data.epoch_rows(cfg, seq_len=64, split="validation", tokenizer=bt)
  want = sum(len(bt.encode(d, add_bos=True, add_eos=True)) for d in docs)
  assert int((rows["segment_ids"] > 0).sum()) == want
  first = rows["tokens"][0][rows["segment_ids"][0] == 1]
  np.testing.assert_array_equal(first, bt.encode(docs[0], add_bos=True, add_eos=True)[:len(first)])
  assert (rows["tokens"][rows["segment_ids"] == 0] == bt.pad_id).all()
  assert pipeline.pad_id_of(bt) == bt.pad_id and pipeline.pad_id_of(None) == tok.PAD_ID


def test_token_ids_outside_the_tokenizer_are_refused(tmp_path):
  d = str(tmp_path)
  data.write_token_dataset("big_ids", d, {"train": [("0000000", {
      "tokens": np.array([1, 300, 2], np.int32), "loss_mask": np.array([0, 1, 1], np.int32)})]},
      {})
  with pytest.raises(data.DataError, match="id 300 is outside the byte tokenizer's vocabulary"):
    data.epoch_rows(DataConfig(name="big_ids", data_dir=d), seq_len=4)


def test_write_token_dataset_checks_examples(tmp_path):
  bad = {"tokens": np.arange(3, dtype=np.int32), "loss_mask": np.array([0, 2, 1], np.int32)}
  with pytest.raises(data.DataError, match="train/k: loss_mask must hold only 0 and 1"):
    data.write_token_dataset("bad_ds", str(tmp_path), {"train": [("k", bad)]}, {})
  bad = {"tokens": np.arange(3, dtype=np.int32), "loss_mask": np.ones(2, np.int32)}
  with pytest.raises(data.DataError, match="same length"):
    data.write_token_dataset("bad_ds", str(tmp_path), {"train": [("k", bad)]}, {})


def _whole_examples(rows, by_key, seq_len):
  """Every real segment of ``rows`` as (tokens, loss_mask) tuples; checks each
  is a whole stored example (or the last seq_len tokens of a longer one)
  whose positions count 0, 1, ... and that padding carries loss_mask 0."""
  whole = {tuple(int(x) for x in e["tokens"][-seq_len:]): e["loss_mask"][-seq_len:]
           for e in by_key.values()}
  seen = []
  for r in range(rows["tokens"].shape[0]):
    seg = rows["segment_ids"][r]
    assert (rows["loss_mask"][r][seg == 0] == 0).all()
    for s in range(1, seg.max() + 1):
      idx = np.flatnonzero(seg == s)
      key = tuple(int(x) for x in rows["tokens"][r, idx])
      assert key in whole, key                       # never a piece of an example
      np.testing.assert_array_equal(rows["loss_mask"][r, idx], whole[key])
      np.testing.assert_array_equal(rows["positions"][r, idx], np.arange(idx.size))
      seen.append(key)
  return seen


def test_first_fit_packing_keeps_every_example_whole(token_cfg):
  """data.packing = "first_fit": one epoch holds every stored example exactly
  once, whole (an example longer than a row: its last TF tokens), each with
  its own mask; concat-then-split (the default) cuts some of them."""
  import dataclasses
  cfg, by_key = token_cfg
  TF = 10                                       # shorter than some examples
  ff = dataclasses.replace(cfg, packing="first_fit")
  assert any(len(e["tokens"]) > TF for e in by_key.values())    # the tail rule is exercised
  rows = data.epoch_rows(ff, seq_len=TF)
  seen = _whole_examples(rows, by_key, TF)
  assert sorted(seen) == sorted(tuple(int(x) for x in e["tokens"][-TF:]) for e in by_key.values())
  assert (rows["segment_ids"] == 0).sum() > 0                  # rows end in padding
  concat = data.epoch_rows(cfg, seq_len=TF)
  with pytest.raises(AssertionError):
    _whole_examples(concat, by_key, TF)
  # training batches: whole examples too, and the JSON state resumes the exact stream
  import json
  ds = data.make_train_dataset(ff, seq_len=TF, batch_size=4, seed=3)
  it = iter(ds)
  first = [next(it) for _ in range(3)]
  for b in first:
    assert set(b) == {"tokens", "segment_ids", "positions", "loss_mask"}
    _whole_examples(b, by_key, TF)
  state = json.loads(json.dumps(it.get_state()))
  after = [next(it) for _ in range(4)]
  it2 = iter(data.make_train_dataset(ff, seq_len=TF, batch_size=4, seed=3))
  it2.set_state(state)
  for a, b in zip(after, [next(it2) for _ in range(4)]):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  again = iter(data.make_train_dataset(ff, seq_len=TF, batch_size=4, seed=3))
  np.testing.assert_array_equal(next(again)["tokens"], first[0]["tokens"])


def test_first_fit_packing_refuses_text_and_bad_values(data_dir):
  import dataclasses

  from mtp.config import Config, ConfigError, validate
  cfg = DataConfig(name="python_docs", data_dir=data_dir, packing="first_fit")
  with pytest.raises(data.DataError, match="data.packing='first_fit' packs whole token"):
    data.epoch_rows(cfg, seq_len=64, split="validation")
  c = Config()
  with pytest.raises(ConfigError, match="data.packing='best' is not allowed: must be"):
    validate(dataclasses.replace(c, data=dataclasses.replace(c.data, packing="best")))


def test_a_mixture_reads_its_parts_one_after_another(token_cfg, tmp_path):
  """data.name="a+b": every record of each part once, parts in order; a part
  without the split adds nothing to it; malformed names and mixed kinds are
  refused with the field named."""
  cfg, by_key = token_cfg
  d = str(tmp_path)
  extra = _examples(7, 2)
  data.write_token_dataset("tok_more", d, {"train": extra}, {"generator": "test"})   # no validation
  shutil.copytree(os.path.join(cfg.data_dir, "tok_ds"), os.path.join(d, "tok_ds"))
  mix = DataConfig(name="tok_ds+tok_more", data_dir=d)
  a, b = data.load_source(DataConfig(name="tok_ds", data_dir=d), "train"), \
      data.load_source(DataConfig(name="tok_more", data_dir=d), "train")
  src = data.load_source(mix, "train")
  assert isinstance(src, data.ConcatSource) and src.parts == ("tok_ds", "tok_more")
  assert len(src) == len(a) + len(b) == 30
  names = [bytes(src[i]["name"]).decode() for i in range(len(src))]
  assert names == [bytes(a[i]["name"]).decode() for i in range(len(a))] + \
      [bytes(b[i]["name"]).decode() for i in range(len(b))]
  np.testing.assert_array_equal(src[-1]["tokens"], b[len(b) - 1]["tokens"])
  with pytest.raises(IndexError):
    src[len(src)]
  with pytest.raises(TypeError):
    src[1.7]
  # the packed epoch covers both parts' tokens; the training stream carries loss_mask
  rows = data.epoch_rows(mix, seq_len=T)
  n_tok = sum(len(e["tokens"]) for _, e in _examples(23)) + sum(len(e["tokens"]) for _, e in extra)
  assert int((rows["segment_ids"] > 0).sum()) == n_tok
  assert "loss_mask" in next(iter(data.make_train_dataset(mix, seq_len=T, batch_size=2, seed=0)))
  val = data.load_source(mix, "validation")
  assert val.parts == ("tok_ds",) and len(val) == 5
  for name, match in (("tok_ds+", "non-empty dataset names"), ("tok_ds+tok_ds", "twice"),
                      ("tok_ds+text_files", "text_files"),
                      ("tok_ds+nowhere", "data.name='tok_ds\\+nowhere', part 'nowhere': unknown")):
    with pytest.raises(data.DataError, match=match):
      data.load_source(DataConfig(name=name, data_dir=d), "train")
  with pytest.raises(data.DataError, match="split 'test'"):
    data.load_source(mix, "test")
  data.write_dataset("text_ds", d, {"train": [("k0", "some text"), ("k1", "more text")]}, {})
  with pytest.raises(data.DataError, match="mixes token-id and text"):
    data.load_source(DataConfig(name="tok_ds+text_ds", data_dir=d), "train")
  import dataclasses
  from mtp.config import Config, ConfigError, validate
  with pytest.raises(ConfigError, match="data.name"):
    validate(dataclasses.replace(Config(), data=DataConfig(name="tok_ds++tok_more")))
