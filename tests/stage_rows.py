"""Test helpers for the frozen stage with cached hidden states: packed rows
built here (the shape of ``mtp.data.epoch_rows``' result), and stand-ins for
``epoch_rows`` / ``make_eval_batches(tokenizer=...)`` where the data
pipeline does not offer them (``install_row_data``)."""

from __future__ import annotations

import inspect

import numpy as np

TEXTS = ["def main(argv):\n    return 0\n", "import os\nimport sys\n", "hello world, hello there",
         "The quick brown fox jumps over the lazy dog.", "for i in range(10):\n    print(i)\n",
         "class A:\n    pass\n", "x = [i * i for i in range(5)]\n"] * 3


def pack_rows(docs, seq_len: int) -> dict[str, np.ndarray]:
  """Concat-then-split packing of token arrays ``docs`` into int32 [N,
  seq_len] rows (tokens, segment_ids numbered 1.. per row, positions from 0
  in every piece, loss_mask ones), the last row padded (token 0, segment 0)."""
  rows, cur, seg, pos = [], [], [], []
  def flush():
    pad = seq_len - len(cur)
    rows.append((cur + [0] * pad, seg + [0] * pad, pos + [0] * pad))
  for doc in docs:
    doc, p = list(map(int, doc)), 0
    piece = 0
    while p < len(doc):
      room = seq_len - len(cur)
      take = doc[p:p + room]
      sid = (seg[-1] if seg else 0) + 1
      cur += take
      seg += [sid] * len(take)
      pos += list(range(len(take)))
      p += len(take)
      piece += 1
      if len(cur) == seq_len:
        flush()
        cur, seg, pos = [], [], []
  if cur:
    flush()
  t, s, q = (np.asarray(x, np.int32) for x in zip(*rows))
  return {"tokens": t, "segment_ids": s, "positions": q, "loss_mask": np.ones_like(t)}


def text_rows(tokenizer, seq_len: int, texts=TEXTS) -> dict[str, np.ndarray]:
  return pack_rows([tokenizer.encode(x, add_bos=True, add_eos=True) for x in texts], seq_len)


def eval_batches(rows, batch_size: int, num_batches: int) -> list[dict[str, np.ndarray]]:
  out = []
  for lo in range(0, min(len(rows["tokens"]), batch_size * num_batches), batch_size):
    b = {k: v[lo:lo + batch_size] for k, v in rows.items() if k != "loss_mask"}
    n = batch_size - len(b["tokens"])
    if n:
      b = {k: np.concatenate([v, np.zeros((n,) + v.shape[1:], np.int32)]) for k, v in b.items()}
    out.append(b)
  return out


def install_row_data(data_module, texts=TEXTS, force: bool = False) -> None:
  """Gives ``data_module`` (``mtp.data``) an ``epoch_rows`` and a
  tokenizer-aware ``make_eval_batches`` built on ``text_rows`` where it has
  none (``force``: always), so a stage on a BPE model runs before the
  pipeline offers them."""
  if force or not hasattr(data_module, "epoch_rows"):
    def epoch_rows(cfg, *, seq_len, tokenizer=None, split=None):
      from mtp import tokenizer as tok
      return text_rows(tokenizer or tok.ByteTokenizer(), seq_len, texts)
    data_module.epoch_rows = epoch_rows
  original = data_module.make_eval_batches
  if force or "tokenizer" not in inspect.signature(original).parameters:
    def make_eval_batches(cfg, *, seq_len, batch_size, num_batches, process_index=0,
                          process_count=1, tokenizer=None):
      from mtp import tokenizer as tok
      return eval_batches(text_rows(tokenizer or tok.ByteTokenizer(), seq_len, texts[:5]),
                          batch_size, num_batches)
    data_module.make_eval_batches = make_eval_batches
