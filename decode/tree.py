"""Token trees drafted by the MTP modules and verified in one target call.

A static tree (``decode.tree_spec.TreeSpec``, branching b_1..b_m, m <= D):
module k drafts all depth-k nodes in one call (``TreeMTPDrafter``: top-b_k
at T = 0, Gumbel-top-k without replacement at T > 0); one target forward
over [x_{n-1}, node_1..node_N] with a tree mask (``verify_mask``) verifies
them; ``acceptance.tree_greedy_verify`` / ``tree_rejection_sample`` pick a
path per row; ``tree_commit`` moves its K/V into place and commits it.
Node u of depth m_u (BFS order) stands for position n-1+m_u. Module k's
call covers its committed window (W = m + 1 positions from c_k) and one
entry per node of depth < k (N_{<k}, at scratch slots c_k+W+i, RoPE at
their true positions n-1-k+m_u). Shapes are
static in the tree (docs/design.md section 6; docs/speculative_sampling.md,
"Token trees")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from decode import round as round_lib
from decode import acceptance, sampling
from decode.kv_cache import gather_rows, module_lengths, move_path_kv
from decode.drafters import MTPDrafter, MTPDraftState
from decode.sampling import SamplingParams
from decode.state import DecodeState
from decode.tree_spec import MAX_BRANCHING, MAX_NODES, TreeSpec, parse_tree  # noqa: F401 (the API)
from mtp import tokenizer as tok
from mtp.model import Transformer, write_cache



def _slot_mask(rel, table):
  """Places a per-row table [B, R, C] bool at key slots: out[b, r, s] =
  table[b, r, rel[b, s]] where 0 <= rel[b, s] < C, else False. rel: [B, S]."""
  c = table.shape[-1]
  inside = (rel >= 0) & (rel < c)
  idx = jnp.broadcast_to(jnp.clip(rel, 0, c - 1)[:, None, :], table.shape[:2] + rel.shape[-1:])
  return jnp.take_along_axis(table, idx, axis=2) & inside[:, None, :]


def verify_mask(spec: TreeSpec, n, cache_len: int):
  """[B, N+1, S] bool attention mask of the verify block written at slots
  n-1..n-1+N: committed slots <= n-2, plus ancestors-or-self in the tree
  (the root is every node's ancestor)."""
  slots = jnp.arange(cache_len, dtype=jnp.int32)[None, :]
  rel = slots - (n - 1)[:, None]                                          # [B, S]
  table = jnp.broadcast_to(jnp.asarray(spec.block_ancestors), (n.shape[0],) + spec.block_ancestors.shape)
  return (rel < 0)[:, None, :] | _slot_mask(rel, table)


def module_mask(spec: TreeSpec, k: int, window: int, c, n, cache_len: int):
  """[B, W + N_{<k}, S] bool mask of module k's call (k >= 2): window rows
  causal over their slots c + i; node rows: committed slots <= n-1-k, plus
  the entries (slots c + W + i) of their ancestors-or-self, except ancestors
  at negative positions."""
  nk = spec.offsets[k]                                                    # nodes of depth < k
  slots = jnp.arange(cache_len, dtype=jnp.int32)[None, :]
  win_pos = c[:, None] + jnp.arange(window, dtype=jnp.int32)[None, :]
  win_rows = slots[:, None, :] <= win_pos[:, :, None]                     # [B, W, S]
  depth = jnp.asarray(spec.depths[:nk])
  pos_ok = ((n - 1 - k)[:, None] + depth[None, :]) >= 0                   # [B, nk]
  anc = jnp.asarray(spec.ancestors[:nk, :nk])
  table = anc[None] & (pos_ok[:, None, :] | jnp.eye(nk, dtype=bool)[None])
  node_rows = (slots <= (n - 1 - k)[:, None])[:, None, :] | _slot_mask(slots - (c + window)[:, None],
                                                                        table)
  return jnp.concatenate([win_rows, node_rows], 1)


class TreeMTPDrafter(MTPDrafter):
  """Drafts a token tree with the MTP modules 1..m (module docstring); state,
  prefill and ``after_verify`` are the chain drafter's with G = m.

  Args: spec: the tree, depth m in [1, D]; depth: D of the target model.
  Raises ValueError when m > D (``parse_tree`` gives the CLI message).
  """

  def __init__(self, spec: TreeSpec, depth: int):
    if spec.depth > depth:
      raise ValueError(f"tree {spec} has depth {spec.depth} > the model's MTP depth D = {depth}")
    super().__init__(depth, spec.depth)
    self.spec = spec
    self.window = spec.depth + 1

  def settings(self):
    """As ``MTPDrafter.settings``: the tree and D."""
    return (self.spec, self.depth) if type(self) is TreeMTPDrafter else id(self)

  @property
  def scratch_slots(self) -> int:
    """Cache slots a round may write past the committed length n: the
    verify block reaches n-1+N, module k reaches c_k+W+N_{<k}-1 <= n+m+N."""
    return self.spec.num_nodes + self.window + 2

  def draft(self, target: Transformer, state: MTPDraftState, tokens, n, key,
            params: SamplingParams, g: int | None = None):
    """One tree of drafts for the round starting at n [B] int32 from
    ``target``'s MTP modules; ``tokens`` [B, S] int32 is not written to;
    ``key``: one [B, N_internal, V] uniform draw when sampling; ``g`` unused.
    Returns (state, tokens, node_tokens [B, N] int32 in BFS order, q
    [B, N_internal, V] float32 per internal node: the warped distribution its
    children were drawn from without replacement, or the logits when greedy).
    """
    spec, w = self.spec, self.window
    greedy = params.greedy
    bsz, cache_len = tokens.shape
    vocab = target.cfg.vocab_size
    u = None
    if not greedy:
      with jax.named_scope("sample"):
        u = sampling.uniform_open(key, (bsz, spec.num_internal, vocab))
    caches, hidden, committed = list(state.caches), list(state.hidden), state.committed
    node_tok, qs = [], []
    prev_win = prev_nodes = prev_c = None
    for k in range(1, spec.depth + 1):
      c = committed[:, k - 1]
      with jax.named_scope("buffers"):
        win_pos = c[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
        h_in = gather_rows(hidden[k - 1], win_pos)
        t_in = gather_rows(tokens, win_pos + k)
      if k == 1:
        with jax.named_scope("module1"):
          h, caches[0] = target.mtp_forward(1, h_in, t_in, win_pos, cache=caches[0])
        win_out, node_out = h, h[:, :0]
        parents_h = gather_rows(h, (n - 2 - c)[:, None])                   # [B, 1, D] at n-2
      else:
        nk = spec.offsets[k]                                              # nodes of depth 1..k-1
        with jax.named_scope("buffers"):
          h_root = gather_rows(prev_win, (n - k - prev_c)[:, None])         # module k-1 at n-k
          h_nodes = [jnp.broadcast_to(h_root, (bsz, spec.counts[1], h_root.shape[-1]))]
          if nk > spec.counts[1]:
            h_nodes.append(prev_nodes[:, spec.parents[spec.counts[1]:nk]])
          node_pos = (n - 1 - k)[:, None] + jnp.asarray(spec.depths[:nk])[None, :]
          x_h = jnp.concatenate([h_in] + h_nodes, 1)
          x_t = jnp.concatenate([t_in] + node_tok, 1)                     # depths 1..k-1
          pos = jnp.concatenate([win_pos, node_pos], 1)
          mask = module_mask(spec, k, w, c, n, cache_len)
        with jax.named_scope(f"module{k}"):
          h, caches[k - 1] = target.mtp_forward(k, x_h, x_t, pos, cache=caches[k - 1],
                                                write_offsets=c, mask=mask)
        win_out, node_out = h[:, :w], h[:, w:]
        parents_h = node_out[:, spec.offsets[k - 1]:nk]                   # depth k-1 entries
      with jax.named_scope("buffers"):
        if k < spec.depth:
          hidden[k] = write_cache(hidden[k], win_out, c)
      with jax.named_scope("head"):
        logits = target.mtp_head(k, parents_h)                            # [B, n_{k-1}, V]
      b = spec.branching[k - 1]
      with jax.named_scope("sample"):
        if greedy:
          kids = jax.lax.top_k(logits, b)[1].astype(jnp.int32)
          q = logits
        else:
          q = sampling.warped_probs(logits, params)
          lo = sum(spec.counts[:k - 1])                                   # block row of depth k-1
          kids, _ = sampling.sample_without_replacement(q, u[:, lo:lo + spec.counts[k - 1]], b)
      node_tok.append(kids.reshape(bsz, spec.counts[k]))
      qs.append(q)
      prev_win, prev_nodes, prev_c = win_out, node_out, c
    state = MTPDraftState(caches=caches, hidden=hidden, committed=module_lengths(n, spec.depth))
    return state, tokens, jnp.concatenate(node_tok, 1), jnp.concatenate(qs, 1)


def tree_propose(drafter: TreeMTPDrafter, target: Transformer, state: DecodeState,
                 params: SamplingParams) -> tuple[DecodeState, round_lib.Proposal]:
  """Draft the tree and verify it in one target call (``round.propose`` with
  a tree). Returns (state, ``round.Proposal``: draft_tokens [B, N] int32,
  draft_q [B, N_internal, V], p [B, N+1, V] warped target probabilities (the
  logits when greedy), h0 [B, N+1, D]). A row with one committed token gets
  node ids ``round.NO_DRAFT`` and q = 0, so it emits an AR step's token.
  """
  spec = drafter.spec
  state, k_draft, k_accept = round_lib.split_keys(state, params)
  tokens, n = state.tokens, state.length
  with jax.named_scope("draft"):
    dstate, tokens, node_tok, q = drafter.draft(target, state.drafter, tokens, n, k_draft, params)
    node_tok, q = round_lib.undrafted_as_absent(round_lib.drafted_rows(drafter, n), node_tok, q)
  block = jnp.concatenate([gather_rows(tokens, (n - 1)[:, None]), node_tok], 1)
  depth = jnp.asarray(np.concatenate([[0], spec.depths]), jnp.int32)
  pos = (n - 1)[:, None] + depth[None, :]
  mask = verify_mask(spec, n, tokens.shape[1])
  h0, logits, p, cache = round_lib.verify_block(target, state, block, pos, params,
                                             write_offsets=n - 1, mask=mask)
  with jax.named_scope("check"):
    state = round_lib.flag_non_finite(state, logits, q, n, positions=pos,
                                      allowed=tok.head_mask(target.cfg),
                                      draft_allowed=(target.draft_mask()
                                                     if target.draft_vocab_size else None))
  state = state.replace(tokens=tokens, cache=cache, drafter=dstate)
  return state, round_lib.Proposal(node_tok, q, p, h0, k_accept)


def tree_commit(drafter: TreeMTPDrafter, state: DecodeState, node_tokens, path, a, nxt,
                h0) -> DecodeState:
  """Moves the accepted path's target K/V to slots n..n+m-1
  (``move_path_kv``) and commits it (``round.commit``: path tokens, then
  ``nxt``, cut at EOS and the budget; h^0 of [root, path] stored). path [B, m]
  int32 node indices, a [B] path length, nxt [B], h0 [B, N+1, D].
  """
  n = state.length
  cache = move_path_kv(state.cache, path, n)
  path_tok = jnp.take_along_axis(node_tokens, path, 1)
  h0_path = gather_rows(h0, jnp.concatenate([jnp.zeros_like(path[:, :1]), 1 + path], 1))
  return round_lib.commit(drafter, state.replace(cache=cache), path_tok, a, nxt, h0_path)


def tree_round(drafter: TreeMTPDrafter, target: Transformer, state: DecodeState,
               params: SamplingParams) -> DecodeState:
  """One draft-verify-accept-commit round with a token tree, for every row
  (``tree_propose``, ``acceptance.tree_accept``, ``tree_commit``)."""
  state, prop = tree_propose(drafter, target, state, params)
  with jax.named_scope("accept"):
    a, nxt, path = acceptance.tree_accept(prop.key, prop.p, prop.draft_q, prop.draft_tokens,
                                      drafter.spec, params)
  with jax.named_scope("commit"):
    return tree_commit(drafter, state, prop.draft_tokens, path, a, nxt, prop.h0)
