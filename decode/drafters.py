"""Drafters for speculative decoding (the ``Drafter`` protocol): the target's
MTP modules (``MTPDrafter``) or an independent draft model
(``DraftModelDrafter``). For the round starting at committed length n a
drafter proposes d_1..d_G for positions n..n+G-1, written into ``tokens``
[B, S] int32, with q [B, G, V] float32: the warped distributions the drafts
were sampled from (``sampling.warped_probs``, one [B, G, V] uniform draw),
or the raw draft logits when greedy (drafts their argmax). Non-finite q at
an emittable id stops the row. Caches keep drafts equal to a cache-free
forward (docs/design.md sections 5-6)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct

from decode.kv_cache import gather_rows, module_lengths
from decode.sampling import SamplingParams, draft_uniforms, pick
from mtp.model import Transformer, init_layer_caches, write_cache


def head_pick(target: Transformer, k: int, h, u, params: SamplingParams):
  """MTP depth k's head on h [B, 1, D]: (token [B] int32, q [B, V] float32)
  as ``sampling.pick``. With a draft vocabulary V' (``draft_vocab_size`` > 0)
  head, warp and sample run over V' (``u`` [B, V'], else [B, V]); the token
  is mapped back and q scattered to [B, V] (0, or -inf logits when greedy,
  outside V'): the same law as picking from the scattered full logits."""
  if not target.draft_vocab_size:
    with jax.named_scope("head"):
      logits = target.mtp_head(k, h)[:, 0]
    with jax.named_scope("sample"):
      return pick(logits, u, params)
  with jax.named_scope("head"):
    compact, ids = target.mtp_head_compact(k, h)
  with jax.named_scope("sample"):
    d, qc = pick(compact[:, 0], u, params)
    full = jnp.full((qc.shape[0], target.cfg.vocab_size), -jnp.inf if params.greedy else 0.0,
                    qc.dtype)
    return ids[d], full.at[:, ids].set(qc, indices_are_sorted=True, unique_indices=True)


@runtime_checkable
class Drafter(Protocol):
  """What a round needs of a drafter (``decode.round.propose``); ``model``
  is the target (MTP drafters) or the draft model. B rows, S slots, G drafts.

  min_length: the shortest committed length n drafted from (else an AR step).
  init_state(model, batch, cache_len) -> state pytree.
  prefill(model, state, tokens [B, S], lengths [B], h0 [B, P, D], prefill_len)
    -> state after the prompt.
  draft(model, state, tokens [B, S], n [B], key, params, g) -> (state, tokens
    with d_1..d_g at n..n+g-1, drafts [B, g] int32, q [B, g, V] float32).
  after_verify(state, h0_block [B, g + 1, D], n [B]) -> state.
  settings() -> hashable static settings (equal settings share programs).
  """
  min_length: int

  def init_state(self, model: Transformer, batch: int, cache_len: int) -> Any: ...
  def prefill(self, model: Transformer, state: Any, tokens: jax.Array, lengths: jax.Array,
              h0: jax.Array, prefill_len: int) -> Any: ...
  def draft(self, model: Transformer, state: Any, tokens: jax.Array, n: jax.Array, key: jax.Array,
            params: SamplingParams, g: int) -> tuple[Any, jax.Array, jax.Array, jax.Array]: ...
  def after_verify(self, state: Any, h0_block: jax.Array, n: jax.Array) -> Any: ...
  def settings(self) -> Any: ...


@struct.dataclass
class MTPDraftState:
  """State of ``MTPDrafter``: caches, a list over modules 1..used of one
  layer's {"k", "v"} [B, S, K, H]; hidden, a list over depths 0..used-1 of
  [B, S, D] committed hidden states h^k; committed [B, used] int32, module
  k's committed cache length c_k in column k-1."""
  caches: list
  hidden: list
  committed: jax.Array


@struct.dataclass
class DraftModelState:
  """State of ``DraftModelDrafter``: the draft model's KV cache (a list over
  its layers of {"k", "v"} [B, S, K, H])."""
  cache: list


class MTPDrafter:
  """Drafts with the target's MTP modules (docs/design.md section 6).

  Module 1 reads h^0_{n-2} and x_{n-1}, module k h^{k-1}_{n-2} and d_{k-1};
  module k runs a window of G+k positions from its committed length c_k and
  sets c_k := n-k. ``min_length`` is 2 (at n = 1 there is no position n-2).
  G < D uses modules 1..G; G > D reuses module D (as vLLM; never trained).
  ``variable`` ("auto"): ``draft(..., g)`` takes any g <= G_max; modules
  past g fall behind and catch up over committed positions first.

  Args:
    depth: D >= 1 of the target model.
    max_draft_tokens: G_max >= 1 (sizes the state; fixed G when not variable).
    variable: windows of G_max + k positions and the catch-up loop.
  Raises ValueError when D < 1 or G_max < 1.
  """

  min_length = 2        # drafts read h^0_{n-2}: a row needs 2 committed tokens

  def __init__(self, depth: int, max_draft_tokens: int, variable: bool = False):
    if depth < 1:
      raise ValueError("the MTP drafter needs a checkpoint with mtp.depth >= 1 (this one has D = 0)")
    if max_draft_tokens < 1:
      raise ValueError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
    self.depth = depth
    self.variable = variable
    self.max_draft_tokens = max_draft_tokens
    self.used = min(max_draft_tokens, depth)          # modules run in the exact chain

  def settings(self):
    """What traced rounds depend on: equal settings (and type) share compiled
    programs (``decode.compiled``); a subclass compares by identity unless it
    overrides this."""
    return (self.depth, self.max_draft_tokens, self.variable) if type(self) is MTPDrafter \
        else id(self)

  def __eq__(self, other):
    return type(other) is type(self) and self.settings() == other.settings()

  def __hash__(self):
    return hash((type(self), self.settings()))

  def init_state(self, target: Transformer, batch: int, cache_len: int):
    cfg = target.cfg
    caches = [init_layer_caches(cfg, 1, batch, cache_len)[0] for _ in range(self.used)]
    hidden = [jnp.zeros((batch, cache_len, cfg.d_model), jnp.dtype(cfg.dtype))
              for _ in range(self.used)]
    return MTPDraftState(caches=caches, hidden=hidden,
                         committed=jnp.zeros((batch, self.used), jnp.int32))

  def prefill(self, target: Transformer, state, tokens, lengths, h0, prefill_len: int):
    """Runs modules 1..used over positions 0..prefill_len-1 (``h0`` [B, P-1, D]
    is the target's output there) and commits c_k = max(n-1-k, 0)."""
    b = tokens.shape[0]
    pos = jnp.broadcast_to(jnp.arange(prefill_len, dtype=jnp.int32), (b, prefill_len))
    hidden = list(state.hidden)
    hidden[0] = hidden[0].at[:, :prefill_len].set(h0.astype(hidden[0].dtype))
    caches = list(state.caches)
    h = h0
    for k in range(1, self.used + 1):
      nxt = gather_rows(tokens, pos + k)
      h, caches[k - 1] = target.mtp_forward(k, h, nxt, pos, cache=caches[k - 1])
      if k < self.used:
        hidden[k] = hidden[k].at[:, :prefill_len].set(h.astype(hidden[k].dtype))
    return MTPDraftState(caches=caches, hidden=hidden,
                         committed=module_lengths(lengths - 1, self.used))

  def _catch_up(self, target: Transformer, k: int, caches, hidden, tokens, c, n):
    """Module k over committed positions only, window by window, until every
    row's gap n-1-c_k fits the window; rows already within it keep c_k (their
    window still holds n-2). Returns (caches, hidden, c)."""
    w = self.max_draft_tokens + k

    def cond(carry):
      return jnp.any(n - 1 - carry[2] > w)

    def body(carry):
      cache_k, hid, c = carry
      pos = c[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
      h, cache_k = target.mtp_forward(k, gather_rows(hidden[k - 1], pos), gather_rows(tokens, pos + k),
                                      pos, cache=cache_k)
      if hid is not None:
        hid = write_cache(hid, h, c)
      behind = n - 1 - c > w
      return cache_k, hid, jnp.where(behind, jnp.minimum(c + w, n - k), c)   # < n-k: true inputs

    hid = hidden[k] if k < self.used else None
    cache_k, hid, c = jax.lax.while_loop(cond, body, (caches[k - 1], hid, c))
    caches[k - 1] = cache_k
    if hid is not None:
      hidden[k] = hid
    return caches, hidden, c

  def draft(self, target: Transformer, state: MTPDraftState, tokens, n, key,
            params: SamplingParams, g: int):
    """Drafts g tokens (static, 1 <= g, <= G_max when ``variable``) for the
    round starting at n [B] int32; key: the round's drafting key ([B, g, V]
    uniforms, [B, g, V'] with a draft vocabulary). Returns (state, tokens with
    the drafts at n..n+g-1, drafts [B, g] int32, q [B, g, V] float32)."""
    run = min(g, self.used)                                        # modules of the exact chain
    width = self.max_draft_tokens if self.variable else g          # window of module k: width + k
    with jax.named_scope("sample"):
      u = draft_uniforms(key, tokens.shape[0], g, target.draft_vocab_size or target.cfg.vocab_size,
                         params)
    caches, hidden, committed = list(state.caches), list(state.hidden), state.committed
    drafts, qs = [], []
    h_last = None
    for k in range(1, run + 1):
      c = committed[:, k - 1]
      if self.variable:
        with jax.named_scope(f"catch_up{k}"):
          caches, hidden, c = self._catch_up(target, k, caches, hidden, tokens, c, n)
      with jax.named_scope("buffers"):
        pos = c[:, None] + jnp.arange(width + k, dtype=jnp.int32)[None, :]
        h_in = gather_rows(hidden[k - 1], pos)
        t_in = gather_rows(tokens, pos + k)
      with jax.named_scope(f"module{k}"):
        h, caches[k - 1] = target.mtp_forward(k, h_in, t_in, pos, cache=caches[k - 1])
      with jax.named_scope("buffers"):
        if k < self.used:
          hidden[k] = write_cache(hidden[k], h, c)
        h_last = gather_rows(h, (n - 2 - c)[:, None])              # [B, 1, D] at position n-2
      d, q = head_pick(target, k, h_last, None if u is None else u[:, k - 1], params)
      with jax.named_scope("buffers"):
        tokens = write_cache(tokens, d[:, None], n - 1 + k)
      drafts.append(d)
      qs.append(q)
    for k in range(self.used + 1, g + 1):                          # reuse module D
      # (only when g > D: then every module ran, so h_last is module D's output)
      pos = (n - 2 + k - self.depth)[:, None]
      with jax.named_scope(f"module{self.depth}_reuse"):
        h_last, caches[-1] = target.mtp_forward(self.depth, h_last, drafts[-1][:, None], pos,
                                                cache=caches[-1])
      d, q = head_pick(target, self.depth, h_last, None if u is None else u[:, k - 1], params)
      with jax.named_scope("buffers"):
        tokens = write_cache(tokens, d[:, None], n - 1 + k)
      drafts.append(d)
      qs.append(q)
    ks = jnp.arange(1, self.used + 1, dtype=jnp.int32)[None, :]
    ran = ks <= run                                                 # modules past g keep c_k
    committed = jnp.where(ran, module_lengths(n, self.used), committed)
    state = MTPDraftState(caches=caches, hidden=hidden, committed=committed)
    return state, tokens, jnp.stack(drafts, 1), jnp.stack(qs, 1)

  def after_verify(self, state, h0_block, n):
    """Stores the target's h^0 for the verify block (positions n-1..n+G-1)."""
    hidden = list(state.hidden)
    hidden[0] = write_cache(hidden[0], h0_block, n - 1)
    return state.replace(hidden=hidden)


class DraftModelDrafter:
  """Speculative decoding with an independent draft model sharing the
  tokenizer (Leviathan et al. 2023; Chen et al. 2023). Its KV cache covers
  0..n-2; a round feeds [x_{n-2}, x_{n-1}] for q_1 (re-feeding n-2 completes
  the cache after a fully accepted round), then each draft: g calls. At n = 1
  it feeds [x_0, x_1] and takes q_1 at position 0 (``min_length`` 1)."""

  min_length = 1        # a language model of its own: drafts x_1 from x_0

  def settings(self):
    """As ``MTPDrafter.settings``: none (every instance drafts alike)."""
    return () if type(self) is DraftModelDrafter else id(self)

  def __eq__(self, other):
    return type(other) is type(self) and self.settings() == other.settings()

  def __hash__(self):
    return hash((type(self), self.settings()))

  def init_state(self, draft: Transformer, batch: int, cache_len: int) -> DraftModelState:
    return DraftModelState(cache=init_layer_caches(draft.cfg, draft.cfg.num_layers, batch,
                                                   cache_len))

  def prefill(self, draft: Transformer, state: DraftModelState, tokens, lengths, h0,
              prefill_len: int) -> DraftModelState:
    """The draft model over positions 0..prefill_len-1 (``h0``, the
    target's, is not used)."""
    b = tokens.shape[0]
    pos = jnp.broadcast_to(jnp.arange(prefill_len, dtype=jnp.int32), (b, prefill_len))
    _, cache = draft.backbone(tokens[:, :prefill_len], pos, cache=state.cache)
    return DraftModelState(cache=cache)

  def draft(self, draft: Transformer, state: DraftModelState, tokens, n, key,
            params: SamplingParams, g: int):
    """As ``MTPDrafter.draft``, with the draft model's own cache."""
    u = draft_uniforms(key, tokens.shape[0], g, draft.cfg.vocab_size, params)
    cache = state.cache
    start = jnp.maximum(n - 2, 0)                        # 0 at n = 1: [x_0, scratch]
    pos = start[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
    inp = gather_rows(tokens, pos)
    last = (n - 1 - start)[:, None]                      # x_{n-1}'s index in the feed
    drafts, qs = [], []
    for j in range(1, g + 1):
      h, cache = draft.backbone(inp, pos, cache=cache)
      h_last = gather_rows(h, last) if j == 1 else h
      d, q = pick(draft.head(h_last)[:, 0], None if u is None else u[:, j - 1], params)
      tokens = write_cache(tokens, d[:, None], n - 1 + j)
      drafts.append(d)
      qs.append(q)
      inp, pos = d[:, None], (n - 1 + j)[:, None]
    return DraftModelState(cache=cache), tokens, jnp.stack(drafts, 1), jnp.stack(qs, 1)

  def after_verify(self, state: DraftModelState, h0_block, n) -> DraftModelState:
    """Nothing to keep of the verify block (the draft model re-feeds x_{n-2})."""
    return state
