r"""The bare pieces of a decoding benchmark (``decode.bench``): one target
forward with a KV cache (``bare_forward_s``), one drafting step alone
(``draft_time_s``) and the drafting step's share of the round's FLOPs
(``draft_flop_share``), the inputs of the draft cost ratio c (Leviathan et
al. 2023, Theorem 3.8). Timing through ``mtp.timing.interleaved_times``;
the probes use the decoder's public pieces (``Decoder.prefill``,
``Decoder.models``, its ``drafter``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from decode.speculative import Decoder, SamplingParams
from mtp import tokenizer as tok
from mtp.model import init_layer_caches
from mtp.timing import interleaved_times, xla_flops


def encode_prompts(prompts) -> list:
  """Prompt rows for a Decoder: a text is encoded with the byte tokenizer
  (BOS first; the byte models' benchmarks), a sequence of ids (already
  encoded with the model's tokenizer, e.g. a chat-template prompt of a BPE
  target: ``decode.bench_chat``) is used as is."""
  return [tok.ByteTokenizer().encode(p, add_bos=True) if isinstance(p, str) else p
          for p in prompts]


def _median_per_iter(fn, args, iters: int, repeats: int) -> float:
  """Median seconds per iteration of ``fn(*args) -> args`` (donated carry,
  threaded through the calls), after one compiling call; each timed call
  runs ``iters`` iterations."""
  carry = [args]

  def step():
    carry[0] = fn(*carry[0])
    jax.block_until_ready(carry[0])
  times = interleaved_times({"fn": step}, repeats, warmup=1)["fn"]
  return float(np.median(times / iters))


def bare_forward_s(model, batch: int, length: int, cache_len: int, repeats: int,
                   in_loop: bool = False, iters: int = 20) -> float:
  """Median seconds of one target forward (backbone + head) over ``length``
  new tokens with a KV cache (donated), batch ``batch``. ``in_loop=False``:
  one jitted call per forward (includes the host dispatch, ~0.1-0.2 ms on
  CPU), max(repeats, 5) x 10 timed calls; ``in_loop=True``: ``iters``
  forwards inside one ``lax.fori_loop`` (device time only, comparable with
  the while_loop decoding form), max(repeats, 5) timed calls. Positions
  advance by one per iteration, as they do in decoding."""
  fn, args, iters = bare_forward_loop(model, batch, length, cache_len, in_loop, iters)
  return _median_per_iter(fn, args, iters, max(repeats, 5) * (1 if in_loop else 10))


def bare_forward_loop(model, batch: int, length: int, cache_len: int, in_loop: bool = True,
                      iters: int = 20):
  """``bare_forward_s``' timed program: (fn, args, iters) with ``fn(*args) ->
  args`` (jitted, the cache donated) running ``iters`` forwards (1 when not
  ``in_loop``), for timing it interleaved with other programs."""
  graphdef, params = nnx.split(model, nnx.Param)

  def forward(params, cache, toks, pos):
    m = nnx.merge(graphdef, params)
    h, cache = m.backbone(toks, pos, cache=cache)
    return m.head(h), cache

  def body(_, carry):
    params, cache, toks, pos = carry
    logits, cache = forward(params, cache, toks, pos)
    toks = jnp.argmax(logits, -1).astype(jnp.int32)      # data dependence: no hoisting
    # positions move on as in decoding (fixed ones would let XLA hoist the
    # RoPE angles and the attention mask out of the loop)
    return params, cache, toks, jnp.where(pos[:, -1:] + 1 < cache_len, pos + 1, pos - 16)
  if in_loop:
    fn = jax.jit(lambda *c: jax.lax.fori_loop(0, iters, body, c), donate_argnums=(1,))
  else:
    fn = jax.jit(lambda *c: body(0, c), donate_argnums=(1,))
    iters = 1
  cache = init_layer_caches(model.cfg, model.cfg.num_layers, batch, cache_len)
  toks = jnp.zeros((batch, length), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32) + cache_len // 2, (batch, length))
  return fn, (params, cache, toks, pos), iters


def _draft_step(decoder: Decoder, sp: SamplingParams):
  """``(params, dparams, dstate, tokens, n, key) -> drafter.draft(...)``: one
  drafting step of ``decoder`` (its MTP modules or its draft model) at its
  draft length G."""
  def draft_step(params, dparams, dstate, tokens, n, key):
    target, draft = decoder.models(params, dparams)
    model = target if decoder.method == "mtp" else draft
    return decoder.drafter.draft(model, dstate, tokens, n, key, sp, decoder.G)
  return draft_step


def draft_time_s(decoder: Decoder, prompts, max_new: int, sp: SamplingParams, repeats: int,
                 iters: int = 20) -> float:
  """Median seconds of one drafting step alone (G draft tokens, the drafter's
  forward passes, warps and samples), measured as ``iters`` steps inside one
  ``lax.fori_loop`` so that, like the while_loop decoding form, no host
  dispatch is counted; max(repeats, 5) timed calls after the prefill of
  ``prompts``. The cost ratio c is this over G AR steps."""
  fn, args = draft_loop(decoder, prefilled(decoder, prompts, max_new), sp, iters)
  return _median_per_iter(fn, args, iters, max(repeats, 5))


def prefilled(decoder: Decoder, prompts, max_new: int):
  """``decoder``'s DecodeState after the prefill of ``prompts`` (texts or id
  lists, ``encode_prompts``) with room for ``max_new`` tokens, seed 0."""
  state, prefill_len = decoder.prepare(encode_prompts(prompts), max_new, 0)
  return decoder.prefill(state, prefill_len)


def draft_loop(decoder: Decoder, state, sp: SamplingParams, iters: int = 20):
  """``draft_time_s``' timed program: (fn, args) with ``fn(*args) -> args``
  (jitted; the drafter state and tokens donated, so ``args`` holds copies
  of ``state``'s) running ``iters`` drafting steps from ``state`` (a
  ``prefilled`` state of this decoder, or of one whose drafter state has
  the same shapes: the same target with another draft vocabulary V')."""
  draft_step = _draft_step(decoder, sp)

  def body(_, carry):
    params, dparams, dstate, tokens, n, key = carry
    key, sub = jax.random.split(key)
    dstate, tokens, _, _ = draft_step(params, dparams, dstate, tokens, n, sub)
    return params, dparams, dstate, tokens, n, key
  fn = jax.jit(lambda *c: jax.lax.fori_loop(0, iters, body, c), donate_argnums=(2, 3))
  copy = lambda t: jax.tree.map(jnp.copy, t)
  return fn, (decoder.target_params, decoder.draft_params, copy(state.drafter),
              copy(state.tokens), state.length, state.key)


def _flops(fn, *args) -> float:
  return xla_flops(jax.jit(fn).lower(*args).compile()) or 0.0


def draft_flop_share(decoder: Decoder, prompts, max_new: int, sp: SamplingParams) -> float:
  """XLA-counted FLOPs of one drafting step / (G x FLOPs of one target
  forward over 1 token with the same cache): the cost ratio c that drafting
  would have if time followed FLOPs (NaN when XLA counts no target FLOPs)."""
  encoded = encode_prompts(prompts)
  state, _ = decoder.prepare(encoded, max_new, 0)

  def forward(params, cache, tokens, n):
    target, _ = decoder.models(params)
    h, cache = target.backbone(tokens[:, :1], n[:, None], cache=cache)
    return target.head(h), cache
  d = _flops(_draft_step(decoder, sp), decoder.target_params, decoder.draft_params,
             state.drafter, state.tokens, state.length, state.key)
  f = _flops(forward, decoder.target_params, state.cache, state.tokens, state.length)
  return d / (decoder.G * f) if f else float("nan")
