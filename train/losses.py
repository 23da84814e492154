"""Main + MTP cross-entropy with the right shifts and masks.

DeepSeek-V3 technical report, eq. 24-25:

    L = L_main + (lambda / D) * sum_{k=1..D} L^k

The main head at position i predicts token i+1; MTP depth k at position i
predicts token i+k+1 (its input already contains t_{i+k}). A target counts
only when it exists (i + offset < T), is not padding, and lies in the same
document as position i (equal, non-zero segment id): in packed sequences no
target crosses a document boundary, for the main head or any depth. Each
L^k is the mean over its own valid targets.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mtp import tokenizer as tok
from mtp.model import ModelOutput


def shifted_targets(tokens: jax.Array, segment_ids: jax.Array | None, offset: int):
  """Targets and validity mask for a head that predicts ``offset`` ahead.

  tokens: [B, T] int32; segment_ids: [B, T] int32 (0 = padding) or None
  (one document per row). Returns (targets [B, T] int32, mask [B, T] bool):
  targets[b, i] = tokens[b, i + offset] where mask[b, i] is True.
  """
  b, t = tokens.shape
  if segment_ids is None:
    segment_ids = jnp.ones_like(tokens)
  pad = lambda x, v: jnp.concatenate([x[:, offset:], jnp.full((b, offset), v, x.dtype)], 1)
  targets = pad(tokens, tok.PAD_ID)
  target_segments = pad(segment_ids, 0)
  mask = (target_segments == segment_ids) & (segment_ids != 0) & (targets != tok.PAD_ID)
  return targets, mask


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Per-token cross-entropy [B, T] float32 (nats) of float logits [B, T, V].
  Out-of-vocabulary targets (PAD with a toy vocabulary) are clipped; callers
  mask them."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  targets = jnp.clip(targets, 0, logits.shape[-1] - 1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def head_sums(logits, targets, mask) -> dict[str, jax.Array]:
  """Sums over valid targets, for exact aggregation across batches:
  ``nll`` (nats), ``count``, ``correct`` (top-1 hits), and ``byte_nll`` /
  ``byte_count`` over targets that are UTF-8 bytes (for bits per byte)."""
  # Masked positions may hold targets the head gives -inf (PAD): their inf
  # cross-entropy must not reach the sums (inf * 0 is NaN).
  ce = jnp.where(mask, token_cross_entropy(logits, targets), 0.0)
  m = mask.astype(jnp.float32)
  byte = m * (targets < tok.NUM_BYTES)
  correct = (jnp.argmax(logits, -1) == targets) * m
  return {"nll": jnp.sum(ce * m), "count": jnp.sum(m), "correct": jnp.sum(correct),
          "byte_nll": jnp.sum(ce * byte), "byte_count": jnp.sum(byte)}


def mtp_loss(output: ModelOutput, tokens: jax.Array, segment_ids: jax.Array | None,
             loss_weight: float):
  """Training objective and per-head sums.

  Args:
    output: model output with D = len(output.mtp_logits) depths.
    tokens: [B, T] int32; segment_ids: [B, T] int32 or None.
    loss_weight: lambda >= 0.
  Returns:
    (loss scalar float32, sums) where sums["main"] and sums["mtp_k"]
    (k = 1..D) are ``head_sums`` dicts.
  """
  depth = len(output.mtp_logits)
  sums = {"main": head_sums(output.logits, *shifted_targets(tokens, segment_ids, 1))}
  loss = sums["main"]["nll"] / jnp.maximum(sums["main"]["count"], 1.0)
  if depth:
    mtp_total = 0.0
    for k, logits in enumerate(output.mtp_logits, start=1):
      s = head_sums(logits, *shifted_targets(tokens, segment_ids, k + 1))
      sums[f"mtp_{k}"] = s
      mtp_total = mtp_total + s["nll"] / jnp.maximum(s["count"], 1.0)
    loss = loss + (loss_weight / depth) * mtp_total
  return loss, sums


def summarize(sums: dict[str, dict[str, jax.Array]]) -> dict[str, float]:
  """Turns (possibly accumulated) head sums into metrics: ``{head}/loss``
  (nats per token), ``{head}/accuracy`` (top-1) and ``main/bits_per_byte``."""
  out = {}
  for head, s in sums.items():
    count = max(float(s["count"]), 1.0)
    out[f"{head}/loss"] = float(s["nll"]) / count
    out[f"{head}/accuracy"] = float(s["correct"]) / count
    if head == "main":
      out["main/bits_per_byte"] = float(s["byte_nll"]) / max(float(s["byte_count"]), 1.0) / math.log(2)
  return out
