"""Main + MTP losses (DeepSeek-V3 eq. 24-25) with distillation from the main
head (docs/design.md section 9):

    L = L_main + (lambda / D) * sum_{k=1..D+R} L^k
    L^k = (1 - w) * CE_k + w * tau^2 * KL( softmax(z^main_{i+k} / tau) || softmax(z^k_i / tau) )

Depth k at i predicts t_{i+k+1}; a target counts iff it exists, is not
padding and is in position i's document; each L^k is a mean over its valid
targets, the teacher under a stop-gradient. "tv" / "mix" put TV(p, q) = 1 -
alpha in place of / beside the KL. With V' the CE drops targets outside V'
and the KL's teacher is restricted to V'; the TV stays full (``teacher_tv``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from mtp import tokenizer as tok
from mtp.model import ModelOutput


def shifted_targets(tokens: jax.Array, segment_ids: jax.Array | None, offset: int,
                    loss_mask: jax.Array | None = None, pad_id: int | None = tok.PAD_ID):
  """(targets, mask) [B, T] int32 / bool for a head predicting ``offset``
  ahead: targets[b, i] = tokens[b, i + offset]; mask[b, i] iff i + offset <
  T, segment_ids[b, i + offset] == segment_ids[b, i] != 0 (None: one document
  per row), the target is not ``pad_id`` (None: no such id) and
  loss_mask[b, i + offset] == 1 (None: all ones)."""
  b, t = tokens.shape
  if segment_ids is None:
    segment_ids = jnp.ones_like(tokens)
  pad = lambda x, v: jnp.concatenate([x[:, offset:], jnp.full((b, offset), v, x.dtype)], 1)
  targets = pad(tokens, 0 if pad_id is None else pad_id)
  target_segments = pad(segment_ids, 0)
  mask = (target_segments == segment_ids) & (segment_ids != 0)
  if pad_id is not None:
    mask &= targets != pad_id
  if loss_mask is not None:
    mask &= pad(jnp.asarray(loss_mask), 0) == 1
  return targets, mask


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Per-token cross-entropy [B, T] float32 (nats) of logits [B, T, V];
  out-of-vocabulary targets are clipped (callers mask them)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  targets = jnp.clip(targets, 0, logits.shape[-1] - 1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def head_sums(logits, targets, mask, byte_level: bool = True) -> dict[str, jax.Array]:
  """Sums over valid targets: ``nll`` (nats), ``count``, ``correct`` (top-1),
  and with ``byte_level`` ``byte_nll`` / ``byte_count`` (for bits per byte)."""
  # Masked positions may hold targets the head gives -inf (PAD): their inf
  # cross-entropy must not reach the sums (inf * 0 is NaN).
  ce = jnp.where(mask, token_cross_entropy(logits, targets), 0.0)
  m = mask.astype(jnp.float32)
  correct = (jnp.argmax(logits, -1) == targets) * m
  out = {"nll": jnp.sum(ce * m), "count": jnp.sum(m), "correct": jnp.sum(correct)}
  if byte_level:
    byte = m * (targets < tok.NUM_BYTES)
    out.update(byte_nll=jnp.sum(ce * byte), byte_count=jnp.sum(byte))
  return out


def shift_left(x: jax.Array, offset: int) -> jax.Array:
  """x [B, T, ...] shifted so that out[:, i] = x[:, i + offset] (zeros past T)."""
  pad = jnp.zeros((x.shape[0], offset) + x.shape[2:], x.dtype)
  return jnp.concatenate([x[:, offset:], pad], 1)[:, :x.shape[1]]


def teacher_kl(teacher_logits: jax.Array, student_logits: jax.Array,
               temperature: float = 1.0) -> jax.Array:
  """Per-position KL(softmax(teacher / tau) || softmax(student / tau)) [B, T]
  float32 (nats), teacher under a stop-gradient; ids the teacher gives
  probability 0 are left out."""
  t = jax.lax.stop_gradient(teacher_logits.astype(jnp.float32)) / temperature
  log_p = jax.nn.log_softmax(t, axis=-1)
  log_q = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
  return optax.losses.kl_divergence_with_log_targets(log_q, log_p, where=jnp.isfinite(log_p))


def teacher_tv(teacher_logits: jax.Array, student_logits: jax.Array,
               temperature: float = 1.0, teacher_logsumexp: jax.Array | None = None) -> jax.Array:
  """Per-position TV(p, q) = 0.5 sum_v |p(v) - q(v)| [B, T] float32, p =
  softmax(teacher / tau) (stop-gradient), q = softmax(student / tau); 1 - TV
  = alpha (Leviathan et al. 2023). Compact form: ``teacher_logsumexp`` [B, T]
  is the *full* logsumexp of teacher / tau, and TV = 0.5 (sum_{V'} |p - q| +
  p(outside V')), the full value. Gradients are finite, also at p == q."""
  t = jax.lax.stop_gradient(teacher_logits.astype(jnp.float32)) / temperature
  if teacher_logsumexp is None:
    p = jax.nn.softmax(t, -1)
    outside = 0.0
  else:
    p = jnp.exp(t - jax.lax.stop_gradient(teacher_logsumexp.astype(jnp.float32))[..., None])
    outside = jnp.clip(1.0 - jnp.sum(p, -1), 0.0, 1.0)
  q = jax.nn.softmax(student_logits.astype(jnp.float32) / temperature, -1)
  return 0.5 * (jnp.sum(jnp.abs(p - q), -1) + outside)


def full_logsumexp(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
  """logsumexp(logits / tau) [B, T] float32 of full logits [B, T, V]
  (stop-gradient): the normaliser of compact ``teacher_tv``."""
  return jax.nn.logsumexp(jax.lax.stop_gradient(logits.astype(jnp.float32)) / temperature, -1)


def restrict_teacher(teacher_logits: jax.Array, draft_mask: jax.Array) -> jax.Array:
  """Teacher logits [B, T, V] float32 restricted to V' (``draft_mask`` [V]
  bool): -inf outside, so softmax gives p|V' / p(V'), the minimiser of the
  forward KL over drafts q supported on V' (Gibbs' inequality). Per position
  alpha = sum_v min(p, q) <= p(V')."""
  return jnp.where(draft_mask, teacher_logits, -jnp.inf)


def draft_vocab_sums(logits, targets, mask, teacher_logits, draft_mask, byte_level: bool = True):
  """(sums, restricted teacher logits [B, T, V]) of a depth drafting from V'
  (``draft_mask`` [V] bool): ``head_sums`` over targets in V', plus over the
  valid positions ``positions``, ``outside`` (full teacher mass outside V':
  alpha <= 1 - it) and ``agree_full`` (argmax equal to the full teacher's)."""
  inside = draft_mask[jnp.clip(targets, 0, logits.shape[-1] - 1)]
  s = head_sums(logits, targets, mask & inside, byte_level)
  m = mask.astype(jnp.float32)
  p = jax.nn.softmax(jax.lax.stop_gradient(teacher_logits.astype(jnp.float32)), -1)
  outside = jnp.sum(jnp.where(draft_mask, 0.0, p), -1)
  s["positions"] = jnp.sum(m)
  s["outside"] = jnp.sum(jnp.where(mask, outside, 0.0))
  s["agree_full"] = jnp.sum((jnp.argmax(logits, -1) == jnp.argmax(teacher_logits, -1)) * m)
  s["overlap"] = overlap_sum(p, logits, mask)
  return s, restrict_teacher(teacher_logits, draft_mask)


def overlap_sum(p, logits, mask):
  """Sum over valid positions of sum_v min(p, q), p [B, T, V] the full
  teacher's probabilities, q = softmax(logits): per position a T = 1 draft's
  acceptance probability."""
  q = jax.nn.softmax(jax.lax.stop_gradient(logits.astype(jnp.float32)), -1)
  return jnp.sum(jnp.where(mask, jnp.sum(jnp.minimum(p, q), -1), 0.0))


def compact_targets(targets, mask, ids):
  """Targets [B, T] as indices into V' = ``ids`` [V'] (sorted int32), with the
  mask narrowed to targets inside V'."""
  pos = jnp.clip(jnp.searchsorted(ids, targets), 0, ids.shape[0] - 1).astype(jnp.int32)
  return pos, mask & (ids[pos] == targets)


def mtp_loss(output: ModelOutput, tokens: jax.Array, segment_ids: jax.Array | None,
             loss_weight: float, *, depth: int | None = None, distill_weight: float = 0.0,
             distill_temperature: float = 1.0, distill_divergence: str = "kl",
             tv_weight: float = 0.5, teacher_logsumexp: jax.Array | None = None,
             loss_mask: jax.Array | None = None, byte_level: bool = True):
  """The module docstring's objective: (loss scalar float32, sums). tokens,
  segment_ids, loss_mask: [B, T] int32 (the last two or None); depth D
  (default len(mtp_logits)); distill_divergence "kl", "tv" or "mix";
  teacher_logsumexp needed for a compact output with a TV part; byte_level:
  PAD never a target, bits-per-byte sums. sums: ``head_sums`` per head, the
  mtp ones with ``kl`` (nats, tau = 1), ``agree`` (and ``draft_vocab_sums``
  with V'). Raises ValueError: unknown divergence; compact TV without
  ``teacher_logsumexp``."""
  if distill_divergence not in ("kl", "tv", "mix"):
    raise ValueError(f"distill_divergence must be 'kl', 'tv' or 'mix', got {distill_divergence!r}")
  uses_tv = bool(distill_weight) and distill_divergence != "kl"
  if uses_tv and output.compact_ids is not None and teacher_logsumexp is None:
    raise ValueError("mtp_loss: a compact output with a TV term needs teacher_logsumexp "
                     "(the full teacher's normaliser, full_logsumexp)")
  n_heads = len(output.mtp_logits)
  depth = n_heads if depth is None else depth
  pad_id = tok.PAD_ID if byte_level else None
  to_compact = (lambda t, m: (t, m)) if output.compact_ids is None else (
      lambda t, m: compact_targets(t, m, output.compact_ids))
  main_t, main_m = to_compact(*shifted_targets(tokens, segment_ids, 1, loss_mask, pad_id))
  sums = {"main": head_sums(output.logits, main_t, main_m,
                            byte_level and output.compact_ids is None)}
  loss = sums["main"]["nll"] / jnp.maximum(sums["main"]["count"], 1.0)
  if n_heads:
    mtp_total = 0.0
    for k, logits in enumerate(output.mtp_logits, start=1):
      targets, mask = shifted_targets(tokens, segment_ids, k + 1, loss_mask, pad_id)
      teacher = shift_left(output.logits, k)         # the main head at i+k predicts t_{i+k+1} too
      full_teacher = teacher                         # TV: never restricted to V'
      if output.compact_ids is not None:             # every head over V' (the teacher restricted)
        valid = mask
        targets, mask = compact_targets(targets, mask, output.compact_ids)
        s = head_sums(logits, targets, mask, False)
        s["positions"] = jnp.sum(valid.astype(jnp.float32))
        mask = valid                                 # the KL counts every valid position
      elif output.draft_mask is None:
        s = head_sums(logits, targets, mask, byte_level)
        s["overlap"] = overlap_sum(jax.nn.softmax(jax.lax.stop_gradient(
            teacher.astype(jnp.float32)), -1), logits, mask)
      else:                                          # reduced draft vocabulary V'
        s, teacher = draft_vocab_sums(logits, targets, mask, teacher, output.draft_mask,
                                      byte_level)
      m = mask.astype(jnp.float32)
      kl = teacher_kl(teacher, logits)
      s["kl"] = jnp.sum(jnp.where(mask, kl, 0.0))     # not kl * m: kl is inf past the end
      s["agree"] = jnp.sum((jnp.argmax(logits, -1) == jnp.argmax(teacher, -1)) * m)
      sums[f"mtp_{k}"] = s
      count = jnp.maximum(s["count"], 1.0)
      kl_count = jnp.maximum(s["positions"], 1.0) if "positions" in s else count
      term = s["nll"] / count
      if distill_weight:
        a = {"kl": 0.0, "tv": 1.0, "mix": tv_weight}[distill_divergence]
        div = 0.0
        if a < 1.0:
          kl_t = kl if distill_temperature == 1.0 else teacher_kl(teacher, logits, distill_temperature)
          div = div + (1.0 - a) * jnp.sum(jnp.where(mask, kl_t, 0.0))
        if a > 0.0:
          lse = None if output.compact_ids is None else shift_left(teacher_logsumexp, k)
          tv_t = teacher_tv(full_teacher, logits, distill_temperature, lse)
          div = div + a * jnp.sum(jnp.where(mask, tv_t, 0.0))
        distill = distill_temperature ** 2 * div / kl_count
        term = (1.0 - distill_weight) * term + distill_weight * distill
      mtp_total = mtp_total + term
    loss = loss + (loss_weight / max(depth, 1)) * mtp_total
  return loss, sums


def summarize(sums: dict[str, dict[str, jax.Array]]) -> dict[str, float]:
  """Head sums as metrics: ``{head}/loss`` (nats/token), ``{head}/accuracy``,
  ``main/bits_per_byte`` (bytes), ``mtp_k/teacher_kl`` (nats, tau = 1),
  ``mtp_k/teacher_agreement``, ``mtp_k/teacher_overlap`` (not compact); with
  V' also ``*_restricted``, ``teacher_mass_outside``,
  ``teacher_agreement_full`` and ``targets_in_draft_vocab``."""
  out = {}
  for head, s in sums.items():
    count = max(float(s["count"]), 1.0)
    out[f"{head}/loss"] = float(s["nll"]) / count
    out[f"{head}/accuracy"] = float(s["correct"]) / count
    if "kl" in s and "positions" in s:     # reduced draft vocabulary V' (draft_vocab_sums)
      n = max(float(s["positions"]), 1.0)
      for name, key in (("teacher_kl_restricted", "kl"),
                        ("teacher_agreement_restricted", "agree"),
                        ("teacher_mass_outside", "outside"),
                        ("teacher_agreement_full", "agree_full"),
                        ("teacher_overlap", "overlap")):
        if key in s:     # not in the compact training form (no full-vocabulary teacher)
          out[f"{head}/{name}"] = float(s[key]) / n
      out[f"{head}/teacher_kl"] = out[f"{head}/teacher_kl_restricted"]
      out[f"{head}/teacher_agreement"] = out[f"{head}/teacher_agreement_restricted"]
      out[f"{head}/targets_in_draft_vocab"] = float(s["count"]) / n
    elif "kl" in s:
      out[f"{head}/teacher_kl"] = float(s["kl"]) / count
      out[f"{head}/teacher_agreement"] = float(s["agree"]) / count
      if "overlap" in s:
        out[f"{head}/teacher_overlap"] = float(s["overlap"]) / count
    if head == "main" and "byte_nll" in s:
      out["main/bits_per_byte"] = float(s["byte_nll"]) / max(float(s["byte_count"]), 1.0) / math.log(2)
  return out
