"""Shifts and masks of the MTP objective on hand-worked examples."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp import tokenizer as tok
from mtp.model import ModelOutput
from train import losses

PAD = tok.PAD_ID


def test_hand_worked_shifts_and_masks():
  # row 0: doc A = [10, 11, 12], doc B = [20, 21]; row 1: doc C = [30, 31, 32] + 2 padding
  tokens = jnp.asarray([[10, 11, 12, 20, 21], [30, 31, 32, PAD, PAD]], jnp.int32)
  seg = jnp.asarray([[1, 1, 1, 2, 2], [1, 1, 1, 0, 0]], jnp.int32)
  t1, m1 = losses.shifted_targets(tokens, seg, 1)       # main head: i -> i+1
  np.testing.assert_array_equal(m1, [[1, 1, 0, 1, 0], [1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(np.where(m1, t1, -1), [[11, 12, -1, 21, -1], [31, 32, -1, -1, -1]])
  t2, m2 = losses.shifted_targets(tokens, seg, 2)       # depth 1: i -> i+2
  np.testing.assert_array_equal(m2, [[1, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
  np.testing.assert_array_equal(np.where(m2, t2, -1), [[12, -1, -1, -1, -1], [32, -1, -1, -1, -1]])
  t3, m3 = losses.shifted_targets(tokens, seg, 3)       # depth 2: i -> i+3
  assert not np.any(m3)
  # no segment ids: one document per row, padding still masked
  _, m = losses.shifted_targets(tokens, None, 1)
  np.testing.assert_array_equal(m, [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])


def _reference_loss(logits, mtp_logits, tokens, seg, lam):
  """Loop-based reference: an independent statement of eq. 24-25."""
  def head(lg, offset):
    total, n = 0.0, 0
    for b in range(tokens.shape[0]):
      for i in range(tokens.shape[1]):
        j = i + offset
        if j >= tokens.shape[1] or seg[b, i] == 0 or seg[b, j] != seg[b, i] or tokens[b, j] == PAD:
          continue
        row = lg[b, i].astype(np.float64)
        lse = np.log(np.sum(np.exp(row - row.max()))) + row.max()
        total += lse - row[tokens[b, j]]
        n += 1
    return total / max(n, 1)
  loss = head(logits, 1)
  if mtp_logits:
    loss += lam / len(mtp_logits) * sum(head(l, k + 1) for k, l in enumerate(mtp_logits, 1))
  return loss


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_loss_matches_reference(depth):
  rng = np.random.default_rng(depth)
  b, t, v = 3, 11, 16
  tokens = rng.integers(0, v, (b, t)).astype(np.int32)
  seg = np.asarray([[1] * 4 + [2] * 5 + [3] * 2, [1] * 11, [1] * 6 + [0] * 5], np.int32)
  tokens[seg == 0] = PAD
  logits = rng.normal(size=(b, t, v)).astype(np.float32) * 2
  mtp_logits = tuple(rng.normal(size=(b, t, v)).astype(np.float32) for _ in range(depth))
  out = ModelOutput(jnp.asarray(logits), tuple(map(jnp.asarray, mtp_logits)), ())
  loss, sums = losses.mtp_loss(out, jnp.asarray(tokens), jnp.asarray(seg), 0.3)
  np.testing.assert_allclose(float(loss), _reference_loss(logits, mtp_logits, tokens, seg, 0.3),
                             rtol=1e-5)
  assert set(sums) == {"main"} | {f"mtp_{k}" for k in range(1, depth + 1)}


def test_summarize_bits_per_byte_and_accuracy():
  # uniform logits over 4 classes: loss = ln 4 nats = 2 bits per byte-target
  logits = jnp.zeros((1, 4, 4))
  tokens = jnp.asarray([[0, 1, 2, 3]], jnp.int32)
  sums = {"main": losses.head_sums(logits, *losses.shifted_targets(tokens, None, 1))}
  m = losses.summarize(jax.device_get(sums))
  assert m["main/loss"] == pytest.approx(math.log(4), rel=1e-6)
  assert m["main/bits_per_byte"] == pytest.approx(2.0, rel=1e-6)
  # argmax of all-equal logits is class 0, never a target here
  assert m["main/accuracy"] == 0.0


def test_special_targets_excluded_from_bits_per_byte():
  logits = jnp.zeros((1, 3, tok.VOCAB_SIZE))
  tokens = jnp.asarray([[tok.BOS_ID, 65, tok.EOS_ID]], jnp.int32)
  s = jax.device_get(losses.head_sums(logits, *losses.shifted_targets(tokens, None, 1)))
  assert float(s["count"]) == 2 and float(s["byte_count"]) == 1


def test_teacher_overlap_is_the_t1_acceptance_sum_min_p_q():
  """``mtp_k/teacher_overlap`` = mean over valid positions of sum_v min(p, q)
  (p the main head at the aligned position, q the module): checked against
  numpy, 1 when the module equals the teacher, and under a reduced draft
  vocabulary against the full teacher (q = 0 outside V')."""
  rng = np.random.default_rng(0)
  b, t, v = 2, 9, 12
  tokens = jnp.asarray(rng.integers(3, v, (b, t)), jnp.int32)
  main = rng.normal(size=(b, t, v)).astype(np.float32) * 2
  mod = rng.normal(size=(b, t, v)).astype(np.float32) * 2
  sm = lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
  def overlap(module_logits, draft_mask=None):
    out = ModelOutput(jnp.asarray(main), (jnp.asarray(module_logits),), (), draft_mask=draft_mask)
    _, sums = losses.mtp_loss(out, tokens, None, 1.0, byte_level=False)
    return losses.summarize(jax.device_get(sums))["mtp_1/teacher_overlap"]
  # depth 1 at position i predicts t_{i+2}: teacher = main head at i+1; valid i < t - 2
  p, q = sm(main[:, 1:t - 1]), sm(mod[:, :t - 2])
  assert overlap(mod) == pytest.approx(float(np.minimum(p, q).sum(-1).mean()), rel=1e-5)
  assert overlap(np.roll(main, -1, axis=1)) == pytest.approx(1.0, rel=1e-5)
  keep = np.zeros(v, bool)
  keep[:6] = True
  masked = np.where(keep, mod, -np.inf)
  q2 = sm(masked[:, :t - 2])
  assert overlap(masked, jnp.asarray(keep)) == pytest.approx(
      float(np.minimum(p, q2).sum(-1).mean()), rel=1e-5)
