"""Drafters for speculative decoding: the trained MTP modules, or an
independent small draft model.

Conventions (docs/design.md sections 5-6). Each row has committed tokens
x_0..x_{n-1} in a token buffer ``tokens`` [B, S] int32; the target has
processed positions 0..n-2. A drafter proposes d_1..d_G for positions
n..n+G-1 together with q_1..q_G [B, G, V] float32, and writes the drafts
into ``tokens`` at n..n+G-1 so the verify block [x_{n-1}, d_1..d_G] can be
read straight from the buffer. q is what verification needs:

- sampling (``warp.greedy`` False): the warped distributions the drafts were
  really sampled from (``sampling.warped_probs``), one uniform draw of shape
  [B, G, V] per round feeding Gumbel-max sampling;
- greedy (``warp.greedy`` True, temperature 0): the raw draft logits; each
  draft is their argmax (ties to the lowest id, as ``warp_logits`` at
  temperature 0), and no softmax, warp or random number is computed.

Either way a non-finite entry of q at an emittable id means the drafter
produced NaN/inf logits (``Decoder`` stops that row with an error).

Drafters are stateless objects holding static settings; their state is a
pytree (``init_state``) threaded through jitted functions. Both keep their
KV caches consistent with what the model saw in training: a draft's
distribution equals that of a cache-free forward over the committed tokens
followed by the earlier drafts (tests/test_decode.py checks this).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from decode import sampling
from mtp.model import Transformer, init_layer_caches


def gather_rows(buf: jax.Array, idx: jax.Array) -> jax.Array:
  """buf [B, S, ...] at per-row indices idx [B, W] -> [B, W, ...] (clipped to S-1)."""
  idx = jnp.clip(idx, 0, buf.shape[1] - 1)
  idx = idx.reshape(idx.shape + (1,) * (buf.ndim - 2))
  return jnp.take_along_axis(buf, idx, axis=1)


def write_rows(buf: jax.Array, new: jax.Array, offsets: jax.Array) -> jax.Array:
  """Writes new [B, W, ...] into buf [B, S, ...] at per-row offsets [B] (in place under donation)."""
  return jax.vmap(lambda b, x, o: jax.lax.dynamic_update_slice_in_dim(b, x, o, axis=0))(
      buf, new.astype(buf.dtype), offsets)


def warped_probs(logits: jax.Array, warp) -> jax.Array:
  """probs [..., V] float32 after ``sampling.warp_logits`` with warp = (temperature, top_k, top_p)
  (a ``sampling.Warp`` or a plain tuple)."""
  return sampling.warped_probs(logits, warp)


def draft_uniforms(key, batch: int, num_draft_tokens: int, vocab: int, warp):
  """The round's uniforms for drafting, [B, G, V] float32 (one draw), or
  None when ``warp`` is greedy (no randomness)."""
  if getattr(warp, "greedy", False):
    return None
  return sampling.uniform_open(key, (batch, num_draft_tokens, vocab))


def pick(logits: jax.Array, u, warp):
  """One draft per row from logits [B, V] float32: (token [B] int32, q [B, V]).

  Greedy ``warp``: the argmax and the logits themselves. Otherwise a
  Gumbel-max sample (uniforms u [B, V]) from q = the warped probabilities,
  the distribution the token was really drawn from."""
  if getattr(warp, "greedy", False):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits
  q = warped_probs(logits, warp)
  return sampling.sample_from_uniform(q, u), q


class MTPDrafter:
  """Drafts with the target's own MTP modules (docs/design.md section 6).

  All drafts of the round starting at n come from position n-2: module 1
  reads h^0_{n-2} and x_{n-1}; module k reads h^{k-1}_{n-2} and d_{k-1}.
  Module k keeps its own KV cache with committed length c_k (entries j < c_k
  have inputs (h^{k-1}_j, x_{j+k}) with x_{j+k} committed). Each round it runs
  a window of G+k positions from c_k (the first n-1-c_k of them, a+k after a
  round that accepted a, are real; the rest are scratch entries past n-2 that
  causal masking hides and later rounds overwrite), then sets c_k := n-k.
  Committed hidden states h^{k-1} live in per-depth buffers
  ``hidden[k-1]`` [B, S, D]; at speculative positions module k reads the
  values module k-1 wrote in the same round, exactly as teacher forcing
  would have produced them. The buffers are separate arrays per depth (a
  list), so each round writes a few rows of one buffer in place (a stacked
  [used, B, S, D] array made XLA copy it whole every round).

  G < D uses modules 1..G. G > D reuses module D for steps D+1..G the way
  vLLM does: step k feeds module D its own previous hidden state and the
  previous draft one position further on. Those steps were never trained,
  so expect acceptance to decay there.

  Variable draft length (``max_draft_tokens``, for ``num_draft_tokens="auto"``):
  ``draft(..., num_draft_tokens=g)`` drafts g <= G_max tokens with modules
  1..min(g, D); modules past g do not run and their committed lengths fall
  behind (after an AR round, g = 0, all of them). Windows are G_max + k
  positions, which covers the gap a + k left by any round in which module k
  ran; a module that is further behind first catches up over committed
  positions only, in chunks of its window inside a ``lax.while_loop`` (zero
  iterations in the common case), after module k-1 has run in the same
  round, so the hidden states it reads are those of teacher forcing. The
  drafts therefore stay exactly those of a cache-free forward, whatever the
  sequence of draft lengths.

  Args:
    num_draft_tokens: G >= 1, the default draft length of ``draft``.
    depth: D >= 1 of the target model.
    max_draft_tokens: G_max >= G for variable draft lengths (None: fixed G).
  """

  def __init__(self, num_draft_tokens: int, depth: int, max_draft_tokens: int | None = None):
    if depth < 1:
      raise ValueError("the MTP drafter needs a checkpoint with mtp.depth >= 1 (this one has D = 0)")
    if num_draft_tokens < 1:
      raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    if max_draft_tokens is not None and max_draft_tokens < num_draft_tokens:
      raise ValueError(f"max_draft_tokens={max_draft_tokens} < num_draft_tokens={num_draft_tokens}")
    self.num_draft_tokens = num_draft_tokens
    self.depth = depth
    self.variable = max_draft_tokens is not None
    self.max_draft_tokens = max_draft_tokens or num_draft_tokens
    self.used = min(self.max_draft_tokens, depth)     # modules run in the exact chain

  def init_state(self, target: Transformer, batch: int, cache_len: int):
    cfg = target.cfg
    caches = [init_layer_caches(cfg, 1, batch, cache_len)[0] for _ in range(self.used)]
    hidden = [jnp.zeros((batch, cache_len, cfg.d_model), jnp.dtype(cfg.dtype))
              for _ in range(self.used)]
    return {"caches": caches, "hidden": hidden,
            "committed": jnp.zeros((self.used, batch), jnp.int32)}

  def prefill(self, target: Transformer, state, tokens, lengths, h0, prefill_len: int):
    """Runs modules 1..used over positions 0..prefill_len-1 (``h0`` [B, P-1, D]
    is the target's output there) and commits c_k = max(n-1-k, 0)."""
    b = tokens.shape[0]
    pos = jnp.broadcast_to(jnp.arange(prefill_len, dtype=jnp.int32), (b, prefill_len))
    hidden = list(state["hidden"])
    hidden[0] = hidden[0].at[:, :prefill_len].set(h0.astype(hidden[0].dtype))
    caches = list(state["caches"])
    h = h0
    for k in range(1, self.used + 1):
      nxt = gather_rows(tokens, pos + k)
      h, caches[k - 1] = target.mtp_forward(k, h, nxt, pos, cache=caches[k - 1])
      if k < self.used:
        hidden[k] = hidden[k].at[:, :prefill_len].set(h.astype(hidden[k].dtype))
    ks = jnp.arange(1, self.used + 1, dtype=jnp.int32)[:, None]
    committed = jnp.maximum(lengths[None, :] - 1 - ks, 0)
    return {"caches": caches, "hidden": hidden, "committed": committed}

  def _catch_up(self, target: Transformer, k: int, caches, hidden, tokens, c, n):
    """Module k over committed positions only, in chunks of its window,
    until every row's gap n-1-c_k fits the window (variable G). Returns
    (caches, hidden, c)."""
    w = self.max_draft_tokens + k

    def cond(carry):
      return jnp.any(n - 1 - carry[2] > w)

    def body(carry):
      cache_k, hid, c = carry
      pos = c[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
      h, cache_k = target.mtp_forward(k, gather_rows(hidden[k - 1], pos), gather_rows(tokens, pos + k),
                                      pos, cache=cache_k)
      if hid is not None:
        hid = write_rows(hid, h, c)
      return cache_k, hid, jnp.minimum(c + w, n - k)      # entries < n-k have true inputs

    hid = hidden[k] if k < self.used else None
    cache_k, hid, c = jax.lax.while_loop(cond, body, (caches[k - 1], hid, c))
    caches[k - 1] = cache_k
    if hid is not None:
      hidden[k] = hid
    return caches, hidden, c

  def draft(self, target: Transformer, state, tokens, n, key, warp, num_draft_tokens=None):
    """key: the round's drafting key (one [B, G, V] uniform draw when
    sampling); warp: ``sampling.Warp``. Returns (state, tokens with the
    drafts written at n..n+G-1, draft_tokens [B, G] int32, q [B, G, V]
    float32: the warped draft distributions, or the draft logits when
    greedy; see the module docstring)."""
    g = num_draft_tokens or self.num_draft_tokens
    run = min(g, self.used)                                        # modules of the exact chain
    width = self.max_draft_tokens if self.variable else g          # window of module k: width + k
    with jax.named_scope("sample"):
      u = draft_uniforms(key, tokens.shape[0], g, target.cfg.vocab_size, warp)
    caches, hidden, committed = list(state["caches"]), list(state["hidden"]), state["committed"]
    drafts, qs = [], []
    h_last = None
    for k in range(1, run + 1):
      c = committed[k - 1]
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
          hidden[k] = write_rows(hidden[k], h, c)
        h_last = gather_rows(h, (n - 2 - c)[:, None])              # [B, 1, D] at position n-2
      with jax.named_scope("head"):
        logits = target.mtp_head(k, h_last)[:, 0]
      with jax.named_scope("sample"):
        d, q = pick(logits, None if u is None else u[:, k - 1], warp)
      with jax.named_scope("buffers"):
        tokens = write_rows(tokens, d[:, None], n - 1 + k)
      drafts.append(d)
      qs.append(q)
    for k in range(self.used + 1, g + 1):                          # reuse module D
      # (only when g > D: then every module ran, so h_last is module D's output)
      pos = (n - 2 + k - self.depth)[:, None]
      with jax.named_scope(f"module{self.depth}_reuse"):
        h_last, caches[-1] = target.mtp_forward(self.depth, h_last, drafts[-1][:, None], pos,
                                                cache=caches[-1])
      with jax.named_scope("head"):
        logits = target.mtp_head(self.depth, h_last)[:, 0]
      with jax.named_scope("sample"):
        d, q = pick(logits, None if u is None else u[:, k - 1], warp)
      with jax.named_scope("buffers"):
        tokens = write_rows(tokens, d[:, None], n - 1 + k)
      drafts.append(d)
      qs.append(q)
    ks = jnp.arange(1, self.used + 1, dtype=jnp.int32)[:, None]
    ran = jnp.arange(1, self.used + 1)[:, None] <= run               # modules past g keep c_k
    committed = jnp.where(ran, jnp.maximum(n[None, :] - ks, 0), committed)
    state = {"caches": caches, "hidden": hidden, "committed": committed}
    return state, tokens, jnp.stack(drafts, 1), jnp.stack(qs, 1)

  def after_verify(self, state, h0_block, n):
    """Stores the target's h^0 for the verify block (positions n-1..n+G-1)."""
    hidden = list(state["hidden"])
    hidden[0] = write_rows(hidden[0], h0_block, n - 1)
    return {**state, "hidden": hidden}


class DraftModelDrafter:
  """Classic speculative decoding with an independent draft model (Leviathan
  et al. 2023; Chen et al. 2023) that shares the tokenizer.

  The draft model keeps its own KV cache over positions 0..n-2 like the
  target. Each round feeds [x_{n-2}, x_{n-1}] (re-feeding n-2 makes the cache
  complete after a round that accepted all G drafts, when d_G was never fed)
  to get q_1, then feeds each draft to get the next q: G calls per round.
  """

  def __init__(self, num_draft_tokens: int):
    if num_draft_tokens < 1:
      raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    self.num_draft_tokens = num_draft_tokens

  def init_state(self, draft: Transformer, batch: int, cache_len: int):
    return {"cache": init_layer_caches(draft.cfg, draft.cfg.num_layers, batch, cache_len)}

  def prefill(self, draft: Transformer, state, tokens, lengths, prefill_len: int):
    b = tokens.shape[0]
    pos = jnp.broadcast_to(jnp.arange(prefill_len, dtype=jnp.int32), (b, prefill_len))
    _, cache = draft.backbone(tokens[:, :prefill_len], pos, cache=state["cache"])
    return {"cache": cache}

  def draft(self, draft: Transformer, state, tokens, n, key, warp):
    g = self.num_draft_tokens
    u = draft_uniforms(key, tokens.shape[0], g, draft.cfg.vocab_size, warp)
    cache = state["cache"]
    pos = (n - 2)[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
    inp = gather_rows(tokens, pos)
    drafts, qs = [], []
    for j in range(1, g + 1):
      h, cache = draft.backbone(inp, pos, cache=cache)
      d, q = pick(draft.head(h[:, -1:])[:, 0], None if u is None else u[:, j - 1], warp)
      tokens = write_rows(tokens, d[:, None], n - 1 + j)
      drafts.append(d)
      qs.append(q)
      inp, pos = d[:, None], (n - 1 + j)[:, None]
    return {"cache": cache}, tokens, jnp.stack(drafts, 1), jnp.stack(qs, 1)
