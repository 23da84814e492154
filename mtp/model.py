"""Causal transformer backbone with D sequential MTP modules (Flax NNX):
pre-norm RoPE/GQA/SwiGLU blocks, head W_out (tied to E or not), h^0 the last
block's output; MTP module k = 1..D (DeepSeek-V3, section 2.2) shares E and
W_out and has its own output RMSNorm:

    h'^k_i = M_k [ RMSNorm(h^{k-1}_i) ; RMSNorm(E(t_{i+k})) ]     eq. 21
    h^k    = TRM_k(h'^k)                                          eq. 22
    P^k_{i+k+1} = softmax(W_out(RMSNorm_k(h^k_i)))               eq. 23

KV cache ``LayerCache`` {"k", "v"}: [B, S, K, H], slot s holds position s;
a call writes T entries from ``positions[:, 0]`` (or ``write_offsets``),
query t sees slots s <= position (or ``mask`` [B, T, S]), so rolling back
is choosing the next positions. Axes: docs/design.md section 3."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mtp import tokenizer as tok
from mtp.config import ATTENTION_IMPLS, Config, ModelConfig

LayerCache = dict[str, jax.Array]          # {"k": [B,S,K,H], "v": [B,S,K,H]}

# The token an MTP module reads past the end of a row (module k at the last k
# positions, recursive steps past T): any valid id, since those positions'
# targets do not exist and the loss masks them; nothing else attends to them
# (they are the last positions of their segment). 0 exists in every
# vocabulary (the byte tokenizer's PAD 256 is an ordinary token of a BPE one).
MTP_FILL_ID = 0


@dataclasses.dataclass
class ModelOutput:
  """Result of ``Transformer.__call__``: ``logits`` [B, T, V] float32 (i
  predicts i+1), ``mtp_logits`` D (+R) arrays [B, T, V] (depth k at i
  predicts i+k+1), ``hidden`` h^0..h^D [B, T, D], ``draft_mask`` [V] bool
  with a draft vocabulary V' (else None), ``compact_ids`` [V'] int32 when
  every logits array is over V' only (else None)."""
  logits: jax.Array
  mtp_logits: tuple[jax.Array, ...]
  hidden: tuple[jax.Array, ...]
  draft_mask: jax.Array | None = None
  compact_ids: jax.Array | None = None


def _dtype(name: str):
  return jnp.dtype(name)


def matmul_precision(cfg: ModelConfig) -> jax.lax.Precision | None:
  """The ``jax.lax.Precision`` every matmul of the model carries
  (``model.matmul_precision``): HIGHEST, HIGH, or None for JAX's default.
  "highest" keeps float32 matmuls float32 on GPU/TPU, so greedy float32
  output does not depend on the cache size or attention implementation."""
  name = cfg.matmul_precision
  return None if name == "default" else jax.lax.Precision[name.upper()]


def _dense_attention(q, k, v, mask, precision, implementation=None):
  """``jax.nn.dot_product_attention`` with its einsums at ``precision``
  (traced inside ``jax.default_matmul_precision``; None: no context)."""
  if precision is None:
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
  with jax.default_matmul_precision(precision.name.lower()):
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding (Su et al. 2021), rotate-half form.

  x: [B, T, N, H]; positions: [B, T] int. Returns x rotated, same shape/dtype.
  """
  h = x.shape[-1]
  freqs = theta ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)        # [H/2]
  angles = positions.astype(jnp.float32)[..., None] * freqs             # [B,T,H/2]
  sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def attention_mask(q_positions, kv_positions, q_segments=None, kv_segments=None) -> jax.Array:
  """Boolean mask [B, 1, T, S]: key s is visible to query t iff
  kv_positions[s] <= q_positions[t] (and the segments match when given)."""
  mask = kv_positions[:, None, :] <= q_positions[:, :, None]
  if q_segments is not None:
    mask &= q_segments[:, :, None] == kv_segments[:, None, :]
  return mask[:, None]


def write_cache(cache: jax.Array, new: jax.Array, offsets: jax.Array) -> jax.Array:
  """Writes new [B, T, K, H] into cache [B, S, K, H] at per-row slot offsets [B]."""
  return jax.vmap(lambda c, x, o: jax.lax.dynamic_update_slice_in_dim(c, x, o, axis=0))(
      cache, new.astype(cache.dtype), offsets)


def _slot_limit(positions, mask, s: int):
  """One past the furthest cache slot any query of the call can see: int32
  scalar in [0, S]. Default rule: max(positions) + 1; with ``mask`` [B, T, S]:
  one past the last slot any row allows."""
  if mask is None:
    return jnp.clip(jnp.max(positions) + 1, 0, s).astype(jnp.int32)
  slots = jnp.arange(1, s + 1, dtype=jnp.int32)
  return jnp.max(jnp.where(jnp.any(mask, axis=(0, 1)), slots, 0))


CUDNN_DTYPES = ("bfloat16", "float16")              # cuDNN fused attention's operand dtypes
CUDNN_MAX_HEAD_DIM = 128    # cuDNN flash attention: H <= 128 and H % 8 == 0 (256 from Hopper on)


def attention_backend() -> str:
  """The platform name ``resolve_attention_impl`` takes, read when traced:
  ``jax.default_backend()``, except a GPU is "cuda" when cuDNN's fused
  attention runs on it (NVIDIA, compute capability >= 8.0), else "gpu"."""
  backend = jax.default_backend()
  if backend != "gpu":
    return backend
  device = jax.devices()[0]
  if "cuda" not in str(getattr(device.client, "platform_version", "")).lower():
    return "gpu"
  major = str(getattr(device, "compute_capability", "0")).split(".")[0]
  return "cuda" if major.isdigit() and int(major) >= 8 else "gpu"


def resolve_attention_impl(impl: str, backend: str, dtype, head_dim: int | None = None) -> str:
  """The implementation ``cached_attention`` runs for ``impl`` on ``backend``
  with activation ``dtype`` and ``head_dim`` (None: unchecked), pure. "auto":
  "blockwise" on "cpu"; "cudnn" on "cuda" for 16-bit dtypes with head_dim %
  8 == 0 and <= 128; "dense" elsewhere. Raises ValueError for an unknown impl."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"model.attention_impl={impl!r}: must be one of "
                     + ", ".join(repr(i) for i in ATTENTION_IMPLS))
  if impl != "auto":
    return impl
  if backend == "cpu":
    return "blockwise"
  head_ok = head_dim is None or (head_dim % 8 == 0 and head_dim <= CUDNN_MAX_HEAD_DIM)
  if backend == "cuda" and jnp.dtype(dtype).name in CUDNN_DTYPES and head_ok:
    return "cudnn"
  return "dense"


def dense_attention(q, keys, values, positions, mask=None, *, precision=jax.lax.Precision.HIGHEST):
  """Attention of q [B, T, N, H] over every slot of keys, values [B, S, K, H]
  (after this call's write; GQA: head j reads KV head j // (N / K)), masked
  (query t sees slot s iff s <= positions[b, t], or ``mask`` [B, T, S]).
  Returns [B, T, N, H] in q's dtype: softmax_s(q_t . k_s / sqrt(H)) . v,
  float32 scores and sums, einsums at ``precision`` in the operands' dtype.
  A query that sees no slot gets zeros."""
  b, t, n, h = q.shape
  s, kv = keys.shape[1], keys.shape[2]
  qg = q.reshape(b, t, kv, n // kv, h)
  keys, values = keys.astype(q.dtype), values.astype(q.dtype)
  sc = jnp.einsum("btkgh,bskh->bkgts", qg, keys, precision=precision,
                  preferred_element_type=jnp.float32) * jnp.float32(1.0 / math.sqrt(h))
  if mask is None:
    slots = jnp.arange(s, dtype=jnp.int32)
    vis = slots[None, None, None, None, :] <= positions[:, None, None, :, None]   # [B, 1, 1, T, S]
  else:
    vis = mask[:, None, None]                                      # [B, 1, 1, T, S]
  sc = jnp.where(vis, sc, -jnp.inf)                                # [B, K, G, T, S]
  m = jnp.max(sc, -1, keepdims=True)
  p = jnp.exp(sc - jnp.where(jnp.isneginf(m), 0.0, m))           # no inf - inf when nothing is seen
  l = jnp.sum(p, -1)                                               # [B, K, G, T]
  y = jnp.einsum("bkgts,bskh->btkgh", p.astype(values.dtype), values, precision=precision,
                 preferred_element_type=jnp.float32)
  y = y / jnp.where(l > 0, l, 1.0).transpose(0, 3, 1, 2)[..., None]
  return y.reshape(b, t, n, h).astype(q.dtype)


def blockwise_attention(q, keys, values, positions, mask=None, *, block_size: int = 128,
                        precision=jax.lax.Precision.HIGHEST):
  """``dense_attention`` reading only the blocks that can be visible, with an
  online softmax across blocks (Milakov & Gimelshein 2018; FlashAttention).
  Blocks of C = min(block_size, S); ceil(``_slot_limit`` / C) >= 1 of them (a
  traced trip count: one program for every length); a last block past S is
  read from S - C with its counted slots masked. Float32 throughout; einsums
  at ``precision``. Forward only (a ``while_loop``): decoding, not training."""
  b, t, n, h = q.shape
  s, kv = keys.shape[1], keys.shape[2]
  g = n // kv
  c = min(block_size, s)
  r = g * t                       # query rows per KV head, ordered (group, query)
  # [B, K, G*T, H]: the layout of a batched matmul against a [B, C, K, H] block
  # (measured faster on CPU than contracting [B, T, K, G, H] inside the loop)
  qg = (q.reshape(b, t, kv, g, h).astype(jnp.float32) * jnp.float32(1.0 / math.sqrt(h)))
  qg = qg.transpose(0, 2, 3, 1, 4).reshape(b, kv, r, h)
  n_blocks = jnp.clip((_slot_limit(positions, mask, s) + c - 1) // c, 1, -(-s // c))
  offs = jnp.arange(c, dtype=jnp.int32)
  if mask is None:
    row_pos = jnp.broadcast_to(positions[:, None, :], (b, g, t)).reshape(b, 1, r)

  def body(i, carry):
    m_run, l_run, acc = carry                          # [B,K,R], [B,K,R], [B,K,R,H]
    first = i * c
    start = jnp.minimum(first, s - c)
    kb = jax.lax.dynamic_slice_in_dim(keys, start, c, axis=1).astype(jnp.float32)   # [B,C,K,H]
    vb = jax.lax.dynamic_slice_in_dim(values, start, c, axis=1).astype(jnp.float32)
    slots = start + offs                                                     # [C]
    if mask is None:
      vis = slots[None, None, None, :] <= row_pos[..., None]                 # [B,1,R,C]
    else:
      mb = jax.lax.dynamic_slice_in_dim(mask, start, c, axis=2)              # [B,T,C]
      vis = jnp.broadcast_to(mb[:, None], (b, g, t, c)).reshape(b, 1, r, c)
    vis &= slots >= first
    sc = jnp.einsum("bkrh,bckh->bkrc", qg, kb, precision=precision)
    sc = jnp.where(vis, sc, -jnp.inf)
    m_new = jnp.maximum(m_run, jnp.max(sc, -1))
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)       # no inf - inf while nothing is seen
    p = jnp.exp(sc - m_safe[..., None])
    corr = jnp.exp(m_run - m_safe)
    l_new = l_run * corr + jnp.sum(p, -1)
    acc = acc * corr[..., None] + jnp.einsum("bkrc,bckh->bkrh", p, vb, precision=precision)
    return m_new, l_new, acc

  init = (jnp.full((b, kv, r), -jnp.inf, jnp.float32), jnp.zeros((b, kv, r), jnp.float32),
          jnp.zeros((b, kv, r, h), jnp.float32))
  _, l_run, acc = jax.lax.fori_loop(0, n_blocks, body, init)
  out = acc / jnp.where(l_run > 0, l_run, 1.0)[..., None]
  out = out.reshape(b, kv, g, t, h).transpose(0, 3, 1, 2, 4)
  return out.reshape(b, t, n, h).astype(q.dtype)


def cached_attention(q, keys, values, positions, mask=None, *, impl: str = "auto",
                     block_size: int = 128, precision=jax.lax.Precision.HIGHEST):
  """Attention of a cached call's queries over the whole cache. Arguments and
  result as ``dense_attention``; ``impl``: "blockwise"
  (``blockwise_attention``), "dense" (``dense_attention``), "cudnn"
  (``jax.nn.dot_product_attention``'s cuDNN kernel, 16-bit) or "auto"
  (``resolve_attention_impl``, when traced); ``precision`` of every matmul
  (cuDNN ignores it). Raises ValueError for another impl."""
  backend = attention_backend() if impl == "auto" else None
  impl = resolve_attention_impl(impl, backend, q.dtype, q.shape[-1])
  if impl == "blockwise":
    return blockwise_attention(q, keys, values, positions, mask, block_size=block_size,
                               precision=precision)
  if impl == "dense":
    return dense_attention(q, keys, values, positions, mask, precision=precision)
  b, s = keys.shape[0], keys.shape[1]
  if mask is None:
    mask = attention_mask(positions, jnp.broadcast_to(jnp.arange(s), (b, s)))
  else:
    mask = mask[:, None]
  return _dense_attention(q, keys.astype(q.dtype), values.astype(q.dtype), mask, precision,
                          implementation="cudnn")


class Attention(nnx.Module):
  """Causal multi-head attention with RoPE and grouped-query attention."""

  def __init__(self, cfg: ModelConfig, *, out_scale: float, rngs: nnx.Rngs):
    d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dt, pdt = _dtype(cfg.dtype), _dtype(cfg.param_dtype)
    self.precision = matmul_precision(cfg)
    lin = lambda i, o, scale=1.0: nnx.Linear(
        i, o, use_bias=False, dtype=dt, param_dtype=pdt, rngs=rngs, precision=self.precision,
        kernel_init=nnx.initializers.variance_scaling(scale, "fan_in", "normal"))
    self.q_proj = lin(d, n * h)
    self.k_proj = lin(d, k * h)
    self.v_proj = lin(d, k * h)
    self.o_proj = lin(n * h, d, out_scale)
    self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
    self.rope_theta = cfg.rope_theta
    self.attention_impl = cfg.attention_impl
    self.attention_block_size = cfg.attention_block_size

  def project(self, x, positions):
    """Rotated queries and keys and the values of x [B, T, D] at positions
    [B, T]: (q [B, T, N, H], k [B, T, K, H], v [B, T, K, H])."""
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    return rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta), v

  def attend_chain(self, q, ctx_k, ctx_v, ctx_mask, chain_k, chain_v):
    """Attention of per-position chains (``Transformer.mtp_recursive``): query
    t sees context keys ``ctx_k[s]`` where ``ctx_mask[b, 0, t, s]`` and its own
    chain's keys ``chain_k[j][t]``. q: [B, T, N, H]; ctx_k, ctx_v: [B, S, K,
    H]; ctx_mask: [B, 1, T, S] bool; chain_k, chain_v: C arrays [B, T, K, H].
    Returns [B, T, D] after the output projection; float32 softmax, einsums at
    ``matmul_precision``."""
    b, t, n, h = q.shape
    kv = self.num_kv_heads
    qg = q.reshape(b, t, kv, n // kv, h).astype(jnp.float32) / math.sqrt(h)
    ck, cv = jnp.stack(chain_k, 2), jnp.stack(chain_v, 2)                  # [B, T, C, K, H]
    prec = self.precision
    s_ctx = jnp.einsum("btkgh,bskh->bkgts", qg, ctx_k.astype(jnp.float32), precision=prec)
    s_ctx = jnp.where(ctx_mask[:, :, None], s_ctx, -jnp.inf)
    s_chain = jnp.einsum("btkgh,btckh->bkgtc", qg, ck.astype(jnp.float32), precision=prec)
    w = jax.nn.softmax(jnp.concatenate([s_ctx, s_chain], -1), axis=-1)
    s = ctx_k.shape[1]
    y = (jnp.einsum("bkgts,bskh->btkgh", w[..., :s], ctx_v.astype(jnp.float32), precision=prec)
         + jnp.einsum("bkgtc,btckh->btkgh", w[..., s:], cv.astype(jnp.float32), precision=prec))
    return self.o_proj(y.reshape(b, t, n * h).astype(q.dtype))

  def __call__(self, x, positions, segment_ids=None, cache: LayerCache | None = None,
               write_offsets=None, mask=None):
    """x: [B, T, D]; positions: [B, T] int32; segment_ids: [B, T] int32 or
    None. With a cache, optionally ``write_offsets`` [B] int32 (slot of the
    first new entry; default ``positions[:, 0]``) and ``mask`` [B, T, S] bool
    (default: slot s visible iff s <= position): the module docstring's cache.
    Returns (y [B, T, D], updated cache or None)."""
    b, t, _ = x.shape
    q, k, v = self.project(x, positions)
    if cache is None:
      mask = attention_mask(positions, positions, segment_ids, segment_ids)
      if segment_ids is None:   # positions alone: also require key index <= query index
        idx = jnp.arange(t)
        mask &= (idx[None, :] <= idx[:, None])[None, None]
      y = _dense_attention(q, k, v, mask, self.precision)
      new_cache = None
    else:             # write the new entries first, then read the cache (model.attention_impl)
      offsets = positions[:, 0] if write_offsets is None else write_offsets
      keys = write_cache(cache["k"], k, offsets)
      values = write_cache(cache["v"], v, offsets)
      new_cache = {"k": keys, "v": values}
      y = cached_attention(q, keys, values, positions, mask, impl=self.attention_impl,
                           block_size=self.attention_block_size, precision=self.precision)
    return self.o_proj(y.reshape(b, t, self.num_heads * self.head_dim)), new_cache


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x)) (Shazeer 2020)."""

  def __init__(self, cfg: ModelConfig, *, out_scale: float, rngs: nnx.Rngs):
    dt, pdt = _dtype(cfg.dtype), _dtype(cfg.param_dtype)
    lin = lambda i, o, scale=1.0: nnx.Linear(
        i, o, use_bias=False, dtype=dt, param_dtype=pdt, rngs=rngs,
        precision=matmul_precision(cfg),
        kernel_init=nnx.initializers.variance_scaling(scale, "fan_in", "normal"))
    self.gate = lin(cfg.d_model, cfg.mlp_dim)
    self.up = lin(cfg.d_model, cfg.mlp_dim)
    self.down = lin(cfg.mlp_dim, cfg.d_model, out_scale)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """Pre-norm transformer block: x + Attn(RMSNorm(x)), then + MLP(RMSNorm(.))."""

  def __init__(self, cfg: ModelConfig, *, out_scale: float, rngs: nnx.Rngs):
    norm = lambda: nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=_dtype(cfg.dtype),
                               param_dtype=_dtype(cfg.param_dtype), rngs=rngs)
    self.attn_norm = norm()
    self.attn = Attention(cfg, out_scale=out_scale, rngs=rngs)
    self.mlp_norm = norm()
    self.mlp = MLP(cfg, out_scale=out_scale, rngs=rngs)

  def __call__(self, x, positions, segment_ids=None, cache=None, write_offsets=None, mask=None):
    a, cache = self.attn(self.attn_norm(x), positions, segment_ids, cache, write_offsets, mask)
    x = x + a
    return x + self.mlp(self.mlp_norm(x)), cache


class DraftVocab(nnx.Param):
  """The draft vocabulary V' of a model: [V'] int32, sorted, unique ids. An
  ``nnx.Param`` so that it travels with the parameters through every
  ``nnx.state(model, nnx.Param)`` reader (checkpoints, loading, the decoder,
  sharding); never trained (``train.loop.split_trainable``), not counted by
  ``count_params``, refused by ``mtp.export``."""


class FeatureFuse(nnx.Module):
  """Module 1's draft input from m lower layers and h^0 (``mtp.feature_layers``,
  EAGLE-3): f_i = W_f [RMSNorm_1(h^{(l_1)}_i); ...; RMSNorm_m(h^{(l_m)}_i);
  h^0_i] [B, T, D]. W_f [(m+1) D, D] starts as [0; ...; 0; I] (f = h^0), and
  no random numbers are drawn, so attaching it changes nothing until trained."""

  def __init__(self, cfg: ModelConfig, num_lower: int):
    dt, pdt = _dtype(cfg.dtype), _dtype(cfg.param_dtype)
    d = cfg.d_model
    self.num_lower = num_lower
    self.norms = nnx.List([nnx.RMSNorm(d, epsilon=cfg.norm_eps, dtype=dt, param_dtype=pdt,
                                       rngs=nnx.Rngs(0)) for _ in range(num_lower)])
    kernel = jnp.concatenate([jnp.zeros((num_lower * d, d)), jnp.eye(d)], 0).astype(pdt)
    self.proj = nnx.Linear((num_lower + 1) * d, d, use_bias=False, dtype=dt, param_dtype=pdt,
                           precision=matmul_precision(cfg), kernel_init=lambda *_: kernel,
                           rngs=nnx.Rngs(0))

  def __call__(self, lower, h0):
    """lower: [B, T, m * D] (the m layers' outputs, concatenated in
    ``feature_layers`` order); h0: [B, T, D]. Returns f [B, T, D]."""
    parts = jnp.split(lower, self.num_lower, axis=-1)
    x = [norm(p.astype(h0.dtype)) for norm, p in zip(self.norms, parts)] + [h0]
    return self.proj(jnp.concatenate(x, -1))


class MTPModule(nnx.Module):
  """One MTP module (eq. 21-22): RMSNorm both inputs, project [2D -> D] with
  M_k, one transformer block, and its own output RMSNorm before the shared
  head; module 1 with ``num_lower`` > 0 also holds the ``FeatureFuse``."""

  def __init__(self, cfg: ModelConfig, *, out_scale: float, rngs: nnx.Rngs, num_lower: int = 0):
    dt, pdt = _dtype(cfg.dtype), _dtype(cfg.param_dtype)
    norm = lambda: nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dt, param_dtype=pdt,
                               rngs=rngs)
    self.hidden_norm = norm()
    self.embed_norm = norm()
    self.proj = nnx.Linear(2 * cfg.d_model, cfg.d_model, use_bias=False, dtype=dt,
                           param_dtype=pdt, precision=matmul_precision(cfg), rngs=rngs)
    self.block = Block(cfg, out_scale=out_scale, rngs=rngs)
    self.out_norm = norm()
    if num_lower:
      self.fuse = FeatureFuse(cfg, num_lower)

  def block_input(self, h_prev, next_embeds):
    """h'^k = M_k[RMSNorm(h^{k-1}); RMSNorm(E(t_{i+k}))] (eq. 21), [B, T, D]."""
    return self.proj(jnp.concatenate([self.hidden_norm(h_prev), self.embed_norm(next_embeds)], -1))

  def __call__(self, h_prev, next_embeds, positions, segment_ids=None, cache=None,
               write_offsets=None, mask=None):
    return self.block(self.block_input(h_prev, next_embeds), positions, segment_ids, cache,
                      write_offsets, mask)


class Transformer(nnx.Module):
  """Backbone + ``mtp_depth`` D >= 0 sequential MTP modules sharing E and
  W_out (D = 0: a plain language model). ``draft_vocab_size``: |V'| (0 =
  none; the model then holds ``draft_vocab``); ``feature_layers``: sorted
  block indices < L - 1 feeding module 1 (``FeatureFuse``; () = eq. 21).
  Raises ValueError: D < 0, draft_vocab_size outside [0, V], or
  draft_vocab_size / feature_layers bad or given with D = 0."""

  def __init__(self, cfg: ModelConfig, mtp_depth: int, *, rngs: nnx.Rngs,
               draft_vocab_size: int = 0, feature_layers: tuple[int, ...] = ()):
    if mtp_depth < 0:
      raise ValueError(f"mtp_depth must be >= 0, got {mtp_depth}")
    self.cfg = cfg
    self.mtp_depth = mtp_depth
    dt, pdt = _dtype(cfg.dtype), _dtype(cfg.param_dtype)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=pdt, rngs=rngs,
                           embedding_init=nnx.initializers.normal(1.0 / math.sqrt(cfg.d_model)))
    out_scale = 1.0 / (2 * (cfg.num_layers + mtp_depth))
    self.blocks = nnx.List([Block(cfg, out_scale=out_scale, rngs=rngs)
                            for _ in range(cfg.num_layers)])
    self.final_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dt, param_dtype=pdt,
                                  rngs=rngs)
    if not cfg.tie_embeddings:
      self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dt,
                                param_dtype=pdt, precision=matmul_precision(cfg), rngs=rngs)
    feature_layers = tuple(int(i) for i in feature_layers)
    if feature_layers and (not mtp_depth or list(feature_layers) != sorted(set(feature_layers))
                           or not all(0 <= i <= cfg.num_layers - 2 for i in feature_layers)):
      raise ValueError(f"feature_layers must be sorted unique block indices in "
                       f"[0, {cfg.num_layers - 2}] with mtp_depth >= 1, got {feature_layers}")
    self.feature_layers = feature_layers
    self.mtp = nnx.List([MTPModule(cfg, out_scale=out_scale, rngs=rngs,
                                   num_lower=len(feature_layers) if k == 0 else 0)
                         for k in range(mtp_depth)])
    if not 0 <= draft_vocab_size <= cfg.vocab_size:
      raise ValueError(f"draft_vocab_size must be in [0, {cfg.vocab_size}], got {draft_vocab_size}")
    if draft_vocab_size and not mtp_depth:
      raise ValueError("draft_vocab_size > 0 needs mtp_depth >= 1 (there are no MTP heads)")
    self.draft_vocab_size = draft_vocab_size
    if draft_vocab_size:      # placeholder ids 0..V'-1 until set_draft_vocab / a checkpoint sets them
      self.draft_vocab = DraftVocab(jnp.arange(draft_vocab_size, dtype=jnp.int32))

  # -- pieces (used by decoding) ---------------------------------------------

  def backbone(self, tokens, positions, segment_ids=None, cache: list[LayerCache] | None = None,
               write_offsets=None, mask=None):
    """tokens, positions: [B, T] int32; with a cache, optional
    ``write_offsets`` [B] int32 and ``mask`` [B, T, S] bool (same for every
    layer; see the module docstring). Returns (h^0 [B, T, D], new per-layer
    caches or None)."""
    h0, _, new_cache = self._run_blocks(tokens, positions, segment_ids, cache, write_offsets,
                                        mask, collect=())
    return h0, new_cache

  def backbone_features(self, tokens, positions, segment_ids=None,
                        cache: list[LayerCache] | None = None, write_offsets=None, mask=None):
    """``backbone`` plus module 1's draft input: (h^0 [B, T, D], draft input [B,
    T, D], caches or None); the draft input is h^0 itself unless
    ``feature_layers`` is set (then ``FeatureFuse``)."""
    h0, lower, new_cache = self._run_blocks(tokens, positions, segment_ids, cache, write_offsets,
                                            mask, collect=self.feature_layers)
    return h0, self.draft_input(h0, lower), new_cache

  def backbone_hidden(self, tokens, positions, segment_ids=None):
    """What ``train.hidden_cache`` stores per token: [B, T, (m + 1) D] = [h^{(l_1)};
    ...; h^{(l_m)}; h^0] (h^0 alone without ``feature_layers``); ``split_hidden``
    splits it."""
    h0, lower, _ = self._run_blocks(tokens, positions, segment_ids, None, None, None,
                                    collect=self.feature_layers)
    return h0 if lower is None else jnp.concatenate([lower, h0], -1)

  def split_hidden(self, hidden):
    """``backbone_hidden``'s output -> (h^0 [B, T, D], lower [B, T, m D] or None)."""
    if not self.feature_layers:
      return hidden, None
    d = self.cfg.d_model
    return hidden[..., -d:], hidden[..., :-d]

  def draft_input(self, h0, lower):
    """Module 1's hidden input: h^0 without ``feature_layers``, else
    ``FeatureFuse``(lower [B, T, m D], h^0) [B, T, D]."""
    if lower is None:
      return h0
    return self.mtp[0].fuse(lower, h0)

  def _run_blocks(self, tokens, positions, segment_ids, cache, write_offsets, mask, collect):
    """(h^0, the outputs of blocks ``collect`` concatenated [B, T, len * D]
    or None when ``collect`` is empty, new caches or None)."""
    x = self.embed(tokens)
    new_cache = [] if cache is not None else None
    lower = []
    for i, block in enumerate(self.blocks):
      x, c = block(x, positions, segment_ids, None if cache is None else cache[i],
                   write_offsets, mask)
      if cache is not None:
        new_cache.append(c)
      if i in collect:
        lower.append(x)
    return x, (jnp.concatenate(lower, -1) if lower else None), new_cache

  def head(self, h, norm: nnx.RMSNorm | None = None) -> jax.Array:
    """Logits [B, T, V] float32 = W_out(norm(h)) (``norm`` defaults to the final
    norm); ids ``tokenizer.head_mask(cfg)`` forbids get -inf (probability 0 on
    every sampling path)."""
    h = (norm or self.final_norm)(h)
    if self.cfg.tie_embeddings:     # nnx.Embed.attend (promote, then h @ E^T) with a precision
      h, w = self.embed.promote_dtype((h, self.embed.embedding[...]), dtype=self.embed.dtype)
      logits = jnp.dot(h, w.T, precision=matmul_precision(self.cfg))
    else:
      logits = self.lm_head(h)
    logits = logits.astype(jnp.float32)
    return jnp.where(tok.head_mask(self.cfg), logits, -jnp.inf)

  def mtp_forward(self, k: int, h_prev, next_tokens, positions, segment_ids=None,
                  cache: LayerCache | None = None, write_offsets=None, mask=None):
    """Runs MTP module k (1-based) at positions i: inputs h^{k-1}_i [B,T,D]
    and t_{i+k} (``next_tokens`` [B,T] int32); optional ``write_offsets`` [B]
    and ``mask`` [B, T, S] as in ``backbone``. Returns (h^k [B,T,D], cache)."""
    if not 1 <= k <= self.mtp_depth:
      raise ValueError(f"MTP module index k={k} out of range [1, {self.mtp_depth}]")
    return self.mtp[k - 1](h_prev, self.embed(next_tokens), positions, segment_ids, cache,
                           write_offsets, mask)

  def mtp_head(self, k: int, h_k) -> jax.Array:
    """Logits [B, T, V] float32 of MTP depth k from h^k [B, T, D] (eq. 23).
    With a draft vocabulary V' only its rows of W_out are multiplied
    (``mtp_head_compact``) and scattered into a vector that is -inf outside V',
    so q is exactly 0 there; verification stays exact (the residual carries
    p's mass outside V'), only acceptance drops."""
    if not self.draft_vocab_size:
      return self.head(h_k, self.mtp[k - 1].out_norm)
    compact, ids = self.mtp_head_compact(k, h_k)
    full = jnp.full(compact.shape[:-1] + (self.cfg.vocab_size,), -jnp.inf, jnp.float32)
    return full.at[..., ids].set(compact, indices_are_sorted=True, unique_indices=True)

  def mtp_head_compact(self, k: int, h_k) -> tuple[jax.Array, jax.Array]:
    """Depth k's logits over V' only: (logits [B, T, V'] float32, ids [V']
    int32 sorted), -inf where the head mask forbids; one [.., D] x [D, V']
    matmul. Raises ValueError without a draft vocabulary."""
    if not self.draft_vocab_size:
      raise ValueError("mtp_head_compact needs a reduced draft vocabulary "
                       "(mtp.draft_vocab_size > 0)")
    return self._head_over(self.mtp[k - 1].out_norm(h_k)), self.draft_vocab[...]

  def head_compact(self, h) -> jax.Array:
    """The main head over V' only: [B, T, V'] float32 of backbone output h
    [B, T, D] (entry j = ``head(h)[..., draft_vocab[j]]``)."""
    return self._head_over(self.final_norm(h))

  def _head_over(self, h) -> jax.Array:
    """Logits [.., V'] float32 of normed hidden states h over the V' ids."""
    ids = self.draft_vocab[...]
    if self.cfg.tie_embeddings:     # as nnx.Embed.attend: promote, then h @ E[ids]^T
      w = jnp.take(self.embed.embedding[...], ids, axis=0, indices_are_sorted=True,
                   unique_indices=True)
      h, w = self.embed.promote_dtype((h, w), dtype=self.embed.dtype)
      logits = jnp.dot(h, w.T, precision=matmul_precision(self.cfg))
    else:                           # as nnx.Linear without bias: h @ W[:, ids]
      w = jnp.take(self.lm_head.kernel[...], ids, axis=1, indices_are_sorted=True,
                   unique_indices=True)
      h, w = self.lm_head.promote_dtype((h, w), dtype=self.lm_head.dtype)
      logits = jnp.dot(h, w, precision=matmul_precision(self.cfg))
    logits = logits.astype(jnp.float32)
    allowed = jnp.asarray(tok.head_mask(self.cfg))[ids]
    return jnp.where(allowed, logits, -jnp.inf)

  def draft_mask(self) -> jax.Array:
    """[V] bool: the ids an MTP head may give a finite logit: the head mask
    (``tokenizer.head_mask``) and, with a draft vocabulary, membership in V'."""
    allowed = jnp.asarray(tok.head_mask(self.cfg))
    if not self.draft_vocab_size:
      return allowed
    inside = jnp.zeros(self.cfg.vocab_size, bool).at[self.draft_vocab[...]].set(True)
    return allowed & inside

  def mtp_recursive(self, tokens, positions, segment_ids, h_prev, h_last, steps: int,
                    compact: bool = False):
    """Module D reused for R = ``steps`` steps past D, for every chain start i
    at once (h_0(i) = h^D_i; docs/design.md section 9):

        h_r(i) = TRM_D(M_D[RMSNorm(h_{r-1}(i)); RMSNorm(E(t_{i+D+r}))])   at position i+r

    logits_r(i) = W_out(RMSNorm_D(h_r(i))) predicts t_{i+D+r+1}. h_prev: h^{D-1}
    [B, T, D]; h_last: h^D. Returns R logits [B, T, V] float32 (over V' with
    ``compact``). Raises ValueError when D = 0."""
    d = self.mtp_depth
    if d < 1:
      raise ValueError("mtp_recursive needs mtp_depth >= 1")
    b, t = tokens.shape
    module = self.mtp[d - 1]
    attn = module.block.attn
    padded = jnp.concatenate([tokens, jnp.full((b, d + steps), MTP_FILL_ID, tokens.dtype)], 1)
    shift = lambda k: padded[:, k:k + t]                                  # t_{i+k} at i
    x0 = module.block_input(h_prev, self.embed(shift(d)))
    _, ctx_k, ctx_v = attn.project(module.block.attn_norm(x0), positions)
    ctx_mask = attention_mask(positions, positions, segment_ids, segment_ids)
    idx = jnp.arange(t)
    ctx_mask &= (idx[None, :] <= idx[:, None])[None, None]
    chain_k, chain_v, out, h = [], [], [], h_last
    for r in range(1, steps + 1):
      x = module.block_input(h, self.embed(shift(d + r)))
      q, k, v = attn.project(module.block.attn_norm(x), positions + r)
      chain_k.append(k)
      chain_v.append(v)
      x = x + attn.attend_chain(q, ctx_k, ctx_v, ctx_mask, chain_k, chain_v)
      h = x + module.block.mlp(module.block.mlp_norm(x))
      out.append(self.mtp_head_compact(d, h)[0] if compact else self.mtp_head(d, h))
    return tuple(out)

  # -- full forward (training, cache-free reference) ---------------------------

  def __call__(self, tokens, positions=None, segment_ids=None,
               recursive_steps: int = 0) -> ModelOutput:
    """Cache-free forward over packed sequences: tokens, positions (default
    arange(T)): [B, T] int32; segment_ids: [B, T] int32 (0 = padding) or
    None; recursive_steps: R >= 0 extra steps of module D appended to
    ``mtp_logits``. Module k at i reads t_{i+k} (``MTP_FILL_ID`` past T).
    Equals ``forward_from_hidden`` on the backbone's h^0."""
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h0, lower, _ = self._run_blocks(tokens, positions, segment_ids, None, None, None,
                                    collect=self.feature_layers)
    return self.forward_from_hidden(tokens, positions, segment_ids, h0, recursive_steps,
                                    lower=lower)

  def forward_from_hidden(self, tokens, positions, segment_ids, h0,
                          recursive_steps: int = 0, compact: bool = False,
                          lower=None) -> ModelOutput:
    """``__call__`` from a precomputed h0 [B, T, D] (the last block's output,
    before the final norm; cast to the activation dtype): the frozen-backbone
    stage (``train.hidden_cache``). Returns ``__call__``'s ``ModelOutput``;
    ``compact=True`` (needs V'): every head over V' only; ``lower`` [B, T, m D]
    is required exactly with ``feature_layers``. Raises ValueError for compact
    without V' or a missing or unexpected ``lower``."""
    if compact and not self.draft_vocab_size:
      raise ValueError("forward_from_hidden(compact=True) needs mtp.draft_vocab_size > 0")
    if (lower is None) != (not self.feature_layers):
      raise ValueError(f"forward_from_hidden: lower layers {'missing' if lower is None else 'given'}"
                       f" for feature_layers={self.feature_layers}")
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h0 = h0.astype(_dtype(self.cfg.dtype))
    h = self.draft_input(h0, lower) if self.mtp_depth else h0
    inputs, mtp_logits = [h], []           # module k's hidden input is inputs[k - 1]
    for k in range(1, self.mtp_depth + 1):
      shifted = jnp.concatenate([tokens[:, k:], jnp.full((b, k), MTP_FILL_ID, tokens.dtype)], 1)
      h, _ = self.mtp_forward(k, h, shifted, positions, segment_ids)
      inputs.append(h)
      mtp_logits.append(self.mtp_head_compact(k, h)[0] if compact else self.mtp_head(k, h))
    if recursive_steps:
      mtp_logits += self.mtp_recursive(tokens, positions, segment_ids, inputs[-2], inputs[-1],
                                       recursive_steps, compact)
    hidden = [h0] + inputs[1:]
    if compact:
      return ModelOutput(self.head_compact(hidden[0]), tuple(mtp_logits), tuple(hidden),
                         None, self.draft_vocab[...])
    return ModelOutput(self.head(hidden[0]), tuple(mtp_logits), tuple(hidden),
                       self.draft_mask() if self.draft_vocab_size else None)


def init_layer_caches(cfg: ModelConfig, num_layers: int, batch: int, max_len: int) -> list[LayerCache]:
  """Zeroed caches for ``num_layers`` attention layers: K/V [B, S=max_len, K, H]."""
  shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  return [{"k": jnp.zeros(shape, _dtype(cfg.dtype)), "v": jnp.zeros(shape, _dtype(cfg.dtype))}
          for _ in range(num_layers)]


def build_model(cfg: Config, seed: int = 0) -> Transformer:
  """The model described by ``cfg`` with parameters initialised from ``seed``."""
  from mtp.config import parse_id_list
  return Transformer(cfg.model, cfg.mtp.depth, rngs=nnx.Rngs(params=seed),
                     draft_vocab_size=cfg.mtp.draft_vocab_size,
                     feature_layers=parse_id_list(cfg.mtp.feature_layers, "mtp.feature_layers"))


def count_params(model: nnx.Module) -> dict[str, int]:
  """Parameter counts: total, backbone (incl. embedding/head) and MTP modules
  (the draft vocabulary's ids are not parameters and are not counted)."""
  state = nnx.state(model, nnx.All(nnx.Param, nnx.Not(DraftVocab)))
  total = sum(x.size for x in jax.tree.leaves(state))
  mtp = sum(x.size for x in jax.tree.leaves(nnx.state(model.mtp, nnx.Param))) if model.mtp_depth else 0
  return {"total": int(total), "backbone": int(total - mtp), "mtp": int(mtp)}
