"""Token trees drafted by the sequential MTP modules, verified in one target
call.

A static tree (``decode.tree_spec.TreeSpec``, branching b_1..b_m per depth, m <= D)
replaces the chain of drafts: module k proposes all depth-k nodes in one
call, the target verifies every node in one forward with a tree attention
mask, and the acceptance rule (``acceptance.tree_greedy_verify`` at T = 0,
``acceptance.tree_rejection_sample`` at T > 0: recursive rejection sampling
over children drawn without replacement, docs/speculative_sampling.md
"Token trees") picks one root-to-node path per row. Shapes are static
functions of the tree, so nothing recompiles per round; rows accept
different paths.

Indices (docs/design.md sections 5-6; one row, committed tokens
x_0..x_{n-1}, target cache valid for slots 0..n-2, slot s = position s).
Nodes are numbered breadth first (``TreeSpec``); node u has depth m_u and
stands for position n-1+m_u; the root is x_{n-1} (depth 0).

Drafting (``TreeMTPDrafter.draft``). Module k's entry at position j has
inputs (h^{k-1}_j, x_{j+k}); it is true when x_{j+k} is committed
(j <= n-1-k). Module k runs ONE call over

- its committed window: W = m + 1 positions from its committed length c_k
  (c_k = n_prev - k, so the true entries c_k..n-1-k are the e_prev <= m+1
  tokens emitted last round; the rest of the window is scratch), exactly
  the chain's window machinery, causal;
- one entry per node u of depth 1..k-1 (the nodes a branch of module k
  reads), at position n-1-k+m_u with inputs (h^{k-1} of module k-1's entry
  for parent(u), token of u); for m_u = 1, module k-1's committed output at
  position n-k. These entries are written at the scratch slots c_k+W+i
  (past every true entry; RoPE at the true positions) and attend to the
  committed slots <= n-1-k, their ancestors' entries and themselves
  (entries at negative positions, which a cache-free forward does not
  have, are hidden).

Module k's entries for the depth-(k-1) nodes (k = 1: the committed entry at
n-2, for the root) give q for their b_k children: the top-b_k tokens of the
logits at T = 0 (distinct, the first is the chain's argmax draft), an
ordered sample without replacement from the warped q at T > 0
(``sampling.sample_without_replacement``). Module caches need no repair
after the round: the next round recomputes the committed window from
c_k := n - k, as the chain does.

Verification (``tree_round``): one target forward over
[x_{n-1}, node_1..node_N] written at slots n-1..n-1+N, positions
n-1+depth, mask: committed slots <= n-2, the node's ancestors (root
included) and itself. After acceptance of the path u_1..u_a the target K/V
of u_i (slot n+index(u_i), >= n-1+i in BFS order) is copied to slot n-1+i
for every layer (all sources gathered before the contiguous write at n),
and h^0 of [root, u_1..u_a] goes to the drafter's depth-0 hidden buffer at
positions n-1..n-1+a. The rest is the chain's commit
(``decode.round.commit``): tokens u_1..u_a and the next token at n..n+a, cut at
EOS and at the token budget.

The cost of a round, relative to the chain of the same depth, is the
larger target block (1+N instead of 1+m tokens), module k's N_{<k} extra
entries, the top-k / sampling without replacement, the tree masks
([B, T, S] booleans) and the K/V copy of the accepted path (2 L small
gathers and writes, ``decode.kv_cache.move_path_kv``).
"""

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
  """Drafts a token tree with the MTP modules 1..m (module docstring).

  State, prefill and ``after_verify`` are the chain drafter's with G = m
  (caches and hidden buffers of modules 1..m; ``after_verify`` stores h^0
  of [root, accepted path] at positions n-1..n-1+m).

  Args:
    spec: the tree, depth m in [1, D].
    depth: D of the target model.
  Raises:
    ValueError: m > D (``parse_tree`` gives the CLI message).
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
    """One tree of drafts for the round starting at n [B] int32.

    Args:
      target: the model (its MTP modules draft).
      state: drafter state (``init_state`` / ``prefill``).
      tokens: [B, S] int32 committed tokens (not written to).
      key: the round's drafting key (one uniform draw [B, N_internal, V]
        when sampling; unused when greedy).
      params: sampling settings.
      g: unused (the tree's shape fixes the drafts; the chain's signature).
    Returns:
      (state, tokens unchanged, node_tokens [B, N] int32 in BFS order,
      q [B, N_internal, V] float32: per internal node (block order), the
      warped distribution its children were drawn from without replacement,
      or the raw draft logits when greedy).
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
  """Draft the tree and verify it in one target call (no acceptance yet):
  ``decode.round.propose`` with a tree.

  Returns (state with the drafter state, the extended target cache, the key
  advanced and non-finite rows flagged, a ``round.Proposal`` whose
  draft_tokens are node_tokens [B, N] int32, draft_q the drafter's q
  [B, N_internal, V] (``TreeMTPDrafter.draft``), p [B, N+1, V] (warped
  target probabilities; the logits when greedy), h0 [B, N+1, D]). A row
  with one committed token (no position n-2 for module 1) gets no tree:
  node ids ``round.NO_DRAFT`` and q = 0 (``round.undrafted_as_absent``),
  which the tree rules reject (an invalid child is skipped), so the row
  emits exactly an AR step's token from the root.
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
  """Moves the accepted path into place and commits it.

  path [B, m] int32 node indices (``acceptance.tree_*_verify``), a [B] accepted
  path length, nxt [B] the residual/bonus token, h0 [B, N+1, D] of the
  verify block. The target K/V of the path goes to slots n..n+m-1
  (``move_path_kv``); ``round.commit`` then emits the path tokens and the
  next token (cut at EOS and the budget) and stores h^0 of [root, path].
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
