"""Main + MTP cross-entropy with the right shifts and masks (DeepSeek-V3
eq. 24-25), and distillation from the main head (docs/design.md section 9):

    L = L_main + (lambda / D) * sum_{k=1..D+R} L^k
    L^k = (1 - w) * CE_k + w * tau^2 * KL( softmax(z^main_{i+k} / tau) || softmax(z^k_i / tau) )

The main head at i predicts t_{i+1}, depth k at i predicts t_{i+k+1}. A
target counts iff it exists (i + offset < T), is not padding and is in
position i's document (equal non-zero segment id); each L^k is the mean over
its valid targets, the teacher under a stop-gradient. ``distill_divergence``
"tv" puts TV(p, q) = 1 - alpha (Leviathan et al. 2023) in place of the KL,
"mix" (1 - a) KL + a TV. With a draft vocabulary V' the CE drops targets
outside V', the KL's teacher is the main head restricted to V' and
renormalised, and the TV stays the full-vocabulary value (``teacher_tv``).
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
  """Targets and validity mask for a head that predicts ``offset`` ahead.

  tokens: [B, T] int32; segment_ids: [B, T] int32 (0 = padding) or None
  (one document per row); loss_mask: [B, T] int (1 = token j may be a
  target) or None (all ones); pad_id: an id never counted as a target (the
  byte tokenizer's PAD, for rows without segment ids) or None (validity from
  the segment ids alone: a BPE tokenizer's ids are all real tokens). Returns
  (targets [B, T] int32, mask [B, T] bool): targets[b, i] = tokens[b, i +
  offset], and mask[b, i] iff i + offset < T, segment_ids[b, i + offset] ==
  segment_ids[b, i] != 0, the target is not ``pad_id`` and
  loss_mask[b, i + offset] == 1.
  """
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
  """Per-token cross-entropy [B, T] float32 (nats) of float logits [B, T, V].
  Out-of-vocabulary targets (PAD with a toy vocabulary) are clipped; callers
  mask them."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  targets = jnp.clip(targets, 0, logits.shape[-1] - 1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def head_sums(logits, targets, mask, byte_level: bool = True) -> dict[str, jax.Array]:
  """Sums over valid targets, for exact aggregation across batches:
  ``nll`` (nats), ``count``, ``correct`` (top-1 hits), and with
  ``byte_level`` (the byte tokenizer) ``byte_nll`` / ``byte_count`` over
  targets that are UTF-8 bytes (for bits per byte)."""
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
  float32 (nats) of logits [B, T, V], with a stop-gradient on the teacher
  (``optax.losses.kl_divergence_with_log_targets``). Vocabulary entries the
  teacher gives probability 0 (logit -inf: padding) are left out."""
  t = jax.lax.stop_gradient(teacher_logits.astype(jnp.float32)) / temperature
  log_p = jax.nn.log_softmax(t, axis=-1)
  log_q = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
  return optax.losses.kl_divergence_with_log_targets(log_q, log_p, where=jnp.isfinite(log_p))


def teacher_tv(teacher_logits: jax.Array, student_logits: jax.Array,
               temperature: float = 1.0, teacher_logsumexp: jax.Array | None = None) -> jax.Array:
  """Per-position total variation TV(p, q) = 0.5 * sum_v |p(v) - q(v)| [B, T]
  float32 of the teacher p = softmax(teacher / tau) (stop-gradient) and the
  draft q = softmax(student / tau), logits [B, T, V] (-inf where a
  distribution is 0). 1 - TV(p, q) = sum_v min(p, q) = alpha, the
  acceptance probability of one draft (Leviathan et al. 2023, Thm 3.5).

  Compact form (logits [B, T, V'] over V' only): pass ``teacher_logsumexp``
  [B, T] float32, the *full*-vocabulary logsumexp of teacher / tau; then
  p(v) = exp(t_v / tau - lse) and, q being 0 outside V',

      TV(p, q) = 0.5 * (sum_{v in V'} |p(v) - q(v)| + p(outside V')),

  the full form's value (the outside term changes the value, not the
  gradient). Gradients are finite everywhere, including p == q."""
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
  """logsumexp(logits / tau) [B, T] float32 over the last axis of full-vocabulary
  logits [B, T, V] (stop-gradient): the normaliser ``teacher_tv`` needs in the
  compact reduced-vocabulary form."""
  return jax.nn.logsumexp(jax.lax.stop_gradient(logits.astype(jnp.float32)) / temperature, -1)


def restrict_teacher(teacher_logits: jax.Array, draft_mask: jax.Array) -> jax.Array:
  """Teacher logits [B, T, V] float32 restricted to the draft vocabulary V'
  (``draft_mask`` [V] bool): -inf outside V', so softmax gives p restricted
  to V' and renormalised, p(v) 1[v in V'] / p(V').

  That is the right teacher for a module whose q is supported on V' (q = 0
  outside it, ``Transformer.mtp_head``): forward KL(p || q) = -H(p) -
  sum_{v in V'} p(v) log q(v) (+inf unless q covers p's support, so the
  full-vocabulary KL is useless), and over distributions q on V' the cross
  term -sum_{v in V'} p(v) log q(v) is minimised by q = p|V' / p(V') (Gibbs'
  inequality), which is also the minimiser of KL(p|V' / p(V') || q). The
  mass p puts outside V' is lost to any such draft: per position the
  acceptance rate is sum_v min(p, q) <= p(V')."""
  return jnp.where(draft_mask, teacher_logits, -jnp.inf)


def draft_vocab_sums(logits, targets, mask, teacher_logits, draft_mask, byte_level: bool = True):
  """Per-head sums of an MTP depth whose head drafts from V' (``draft_mask``
  [V] bool), and its teacher restricted to V' (``restrict_teacher``).

  logits, teacher_logits: [B, T, V] float32 (module and main head, aligned);
  targets [B, T] int32, mask [B, T] bool (``shifted_targets``).
  Returns (sums, restricted teacher logits [B, T, V]). sums is
  ``head_sums`` over the targets in V' only (a target outside V' has
  module probability 0 and infinite cross-entropy: it is masked out of the
  CE, so ``count`` counts the targets in V') plus, over every valid
  position (``mask``): ``positions`` (their count), ``outside`` (the full
  teacher's probability mass outside V', which bounds acceptance there:
  alpha <= 1 - mass outside) and ``agree_full`` (the module's argmax equals
  the full teacher's: a T = 0 draft's acceptance). ``mtp_loss`` adds
  ``kl`` / ``agree`` against the restricted teacher and averages the
  distillation term over ``positions``."""
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
  """sum over valid positions of sum_v min(p, q): p [B, T, V] the full
  teacher's probabilities, q = softmax(logits) the module's (0 outside V').
  Per position this is the acceptance probability of one T = 1 draft from q
  against p (Leviathan et al. 2023, section 3.3: alpha = sum min(p, q))."""
  q = jax.nn.softmax(jax.lax.stop_gradient(logits.astype(jnp.float32)), -1)
  return jnp.sum(jnp.where(mask, jnp.sum(jnp.minimum(p, q), -1), 0.0))


def compact_targets(targets, mask, ids):
  """Targets [B, T] (full ids) as indices into V' = ``ids`` [V'] (sorted
  int32), and the mask [B, T] bool narrowed to targets inside V' (the
  compact form of ``draft_vocab_sums``' restriction)."""
  pos = jnp.clip(jnp.searchsorted(ids, targets), 0, ids.shape[0] - 1).astype(jnp.int32)
  return pos, mask & (ids[pos] == targets)


def mtp_loss(output: ModelOutput, tokens: jax.Array, segment_ids: jax.Array | None,
             loss_weight: float, *, depth: int | None = None, distill_weight: float = 0.0,
             distill_temperature: float = 1.0, distill_divergence: str = "kl",
             tv_weight: float = 0.5, teacher_logsumexp: jax.Array | None = None,
             loss_mask: jax.Array | None = None, byte_level: bool = True):
  """The module docstring's objective and per-head sums. ``output.mtp_logits``
  holds D + R depths; tokens, segment_ids (or None), loss_mask (target iff
  == 1, or None): [B, T] int32; loss_weight lambda >= 0; depth D (default
  len(mtp_logits)); distill_weight w in [0, 1]; distill_temperature tau > 0;
  distill_divergence "kl", "tv" or "mix" (a = ``tv_weight``);
  teacher_logsumexp: ``full_logsumexp`` of the main logits, needed for a
  compact output with a TV part; byte_level: PAD is never a target and
  bits-per-byte sums are kept (False for BPE).
  Returns (loss scalar float32, sums): sums["main"], sums["mtp_k"] (k =
  1..D+R) are ``head_sums`` dicts, the mtp ones with ``kl`` (nats, tau = 1)
  and ``agree`` against the teacher (restricted to V' when the model has
  one, plus ``draft_vocab_sums``). Raises ValueError for an unknown
  divergence, or a compact TV without ``teacher_logsumexp``.
  """
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
  """Head sums (possibly accumulated) as metrics: ``{head}/loss`` (nats per
  token), ``{head}/accuracy`` (top-1), ``main/bits_per_byte`` (byte
  tokenizer), ``mtp_k/teacher_kl`` (nats, tau = 1), ``mtp_k/teacher_agreement``
  (argmax equal) and, outside the compact form, ``mtp_k/teacher_overlap``
  (mean sum_v min(p, q): a T = 1 draft's acceptance). With V' the teacher
  ones are against the restricted teacher (also as ``*_restricted``), plus
  ``teacher_mass_outside`` (alpha <= 1 - it), ``teacher_agreement_full``
  and ``targets_in_draft_vocab``."""
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
