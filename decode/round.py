"""One speculative-decoding round as pure, traced functions (docs/design.md
section 5), shared by the chain (here) and token trees (``decode.tree``).
For a row with tokens x_0..x_{n-1}: ``propose`` drafts d_1..d_g ~ q_1..q_g
and verifies [x_{n-1}, d_1..d_g] at positions n-1..n+g-1 in one target
forward, p_j = warp(l_j); the rule (``acceptance.chain_rule``) accepts a
drafts plus one residual/bonus token; ``commit`` sets n' = n + e, e <= a+1,
cut after the first stop id and at the budget. g = 0 is the AR step;
``chain_round`` is the three together.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from decode import acceptance
from decode.kv_cache import commit_prefix, gather_rows
from decode.errors import ERROR_DRAFTER, ERROR_NONE, ERROR_TARGET
from decode.sampling import SamplingParams, warped_probs
from decode.state import DecodeState
from mtp import tokenizer as tok
from mtp.model import Transformer


NO_DRAFT = -1     # a draft id marking "no draft" (outside the vocabulary: always rejected)


def drafted_rows(drafter, n):
  """[B] bool: n [B] int32 >= ``drafter.min_length`` (default 2: drafts
  read position n-2, the convention of ``decode.drafters``)."""
  return n >= getattr(drafter, "min_length", 2)


def undrafted_as_absent(drafted, draft_tokens, draft_q):
  """(draft_tokens [B, w] int32, draft_q [B, r, V]) with rows where
  ``drafted`` [B] bool is False set to ``NO_DRAFT`` and q = 0, so the rule
  emits an AR step's token from p_0."""
  return (jnp.where(drafted[:, None], draft_tokens, NO_DRAFT),
          jnp.where(drafted[:, None, None], draft_q, 0.0).astype(draft_q.dtype))


class Proposal(NamedTuple):
  """What ``propose`` hands to the rule and ``commit``: draft_tokens [B, g]
  int32 (``NO_DRAFT`` in undrafted rows), draft_q [B, g, V] float32 (both
  None for an AR step), p [B, g+1, V] float32 (warped; logits when greedy),
  h0 [B, g+1, D] (what the drafter stores), key (None when greedy)."""
  draft_tokens: jax.Array | None
  draft_q: jax.Array | None
  p: jax.Array
  h0: jax.Array
  key: jax.Array | None


def split_keys(state: DecodeState, params: SamplingParams):
  """(state with the key advanced, drafting key, acceptance key); greedy
  ``params``: key not advanced, acceptance key None."""
  if params.greedy:
    return state, state.key, None
  with jax.named_scope("rng"):
    key, k_draft, k_accept = jax.random.split(state.key, 3)
  return state.replace(key=key), k_draft, k_accept


def flag_non_finite(state: DecodeState, target_logits, draft_q, n, positions=None, *,
                    allowed, draft_allowed=None) -> DecodeState:
  """Sets ``error``/``error_pos`` of active, not yet failed rows whose
  target logits [B, T, V] or draft q [B, G, V] hold NaN/+-inf at an id in
  ``allowed`` / ``draft_allowed`` [V] bool. error_pos: n-1+j for target row
  j (``positions[:, j]`` [B, T] for a tree), n-1 for the drafter; the
  target is named when both are bad."""
  bad_t = jnp.any(~jnp.isfinite(target_logits) & allowed, -1)          # [B, T]
  code = jnp.where(jnp.any(bad_t, -1), ERROR_TARGET, ERROR_NONE)
  row = jnp.argmax(bad_t, -1).astype(jnp.int32)
  pos = (n - 1 + row if positions is None
         else jnp.take_along_axis(positions, row[:, None], 1)[:, 0])
  if draft_q is not None:        # the target is named when both are bad (the drafter reads it)
    d_allowed = allowed if draft_allowed is None else draft_allowed
    bad_d = jnp.any(~jnp.isfinite(draft_q) & d_allowed, (-1, -2)) & (code == ERROR_NONE)
    code = jnp.where(bad_d, ERROR_DRAFTER, code)
    pos = jnp.where(bad_d, n - 1, pos)
  fresh = (state.error == ERROR_NONE) & ~state.done & (code != ERROR_NONE)
  return state.replace(error=jnp.where(fresh, code, state.error),
                       error_pos=jnp.where(fresh, pos, state.error_pos))


def verify_block(target: Transformer, state: DecodeState, block, positions, params: SamplingParams,
                 **backbone_kw):
  """The target over a verify block [B, T] int32 at positions [B, T]:
  (h_draft [B, T, D], logits [B, T, V], p [B, T, V] float32 warped (logits
  when greedy), new cache); ``backbone_kw``: a tree's write_offsets / mask."""
  with jax.named_scope("verify"):
    with jax.named_scope("forward"):
      h0, h_draft, cache = target.backbone_features(block, positions, cache=state.cache,
                                                    **backbone_kw)
    with jax.named_scope("head"):
      logits = target.head(h0)
    with jax.named_scope("warp"):
      p = logits if params.greedy else warped_probs(logits, params)
  return h_draft, logits, p, cache


def propose(drafter, target: Transformer, draft: Transformer | None, state: DecodeState,
            params: SamplingParams, g: int) -> tuple[DecodeState, Proposal]:
  """Drafts g tokens (static; 0 = AR step) and verifies them in one target
  call. ``draft``: an independent draft model or None (MTP modules draft).
  Returns (state with drafts written, cache extended, key advanced,
  non-finite rows flagged; the ``Proposal``)."""
  state, k_draft, k_accept = split_keys(state, params)
  tokens, n = state.tokens, state.length
  d_tok = d_q = None
  if g:
    with jax.named_scope("draft"):
      dstate, tokens, d_tok, d_q = drafter.draft(draft if draft is not None else target,
                                                 state.drafter, tokens, n, k_draft, params, g)
      d_tok, d_q = undrafted_as_absent(drafted_rows(drafter, n), d_tok, d_q)
    state = state.replace(drafter=dstate)
  block_pos = (n - 1)[:, None] + jnp.arange(g + 1, dtype=jnp.int32)[None, :]
  h0, logits, p, cache = verify_block(target, state, gather_rows(tokens, block_pos),
                                             block_pos, params)
  with jax.named_scope("check"):
    state = flag_non_finite(state, logits, d_q, n, allowed=tok.head_mask(target.cfg),
                            draft_allowed=(target.draft_mask() if draft is None
                                           and target.draft_vocab_size else None))
  return state.replace(tokens=tokens, cache=cache), Proposal(d_tok, d_q, p, h0, k_accept)


def commit(drafter, state: DecodeState, draft_tokens, a, nxt, h0) -> DecodeState:
  """Emits d_1..d_a then ``nxt`` per row, cut after the first stop id (kept)
  and at the token budget; updates lengths, done flags, the round count,
  statistics and the drafter state. Done or failed rows emit nothing. draft_tokens [B, w]
  int32 (a chain's drafts or a tree's path; None for AR), a / nxt [B]
  int32, h0 [B, w+1, D]."""
  w = 0 if draft_tokens is None else draft_tokens.shape[1]
  n, done = state.length, state.done
  b = n.shape[0]
  cand = (jnp.concatenate([jnp.maximum(draft_tokens, 0), jnp.zeros((b, 1), jnp.int32)], 1) if w
          else jnp.zeros((b, 1), jnp.int32))
  idx = jnp.arange(w + 1)[None, :]
  cand = jnp.where(idx == a[:, None], nxt[:, None], cand)         # d_1..d_a, next
  is_stop = jnp.any(cand[:, :, None] == state.stop_ids[:, None, :], -1) & (idx <= a[:, None])
  first_stop = jnp.where(jnp.any(is_stop, 1), jnp.argmax(is_stop, 1), w + 1)
  remaining = state.max_new - (n - state.prompt_len)
  e = jnp.minimum(jnp.minimum(a + 1, remaining), first_stop + 1)
  active = ~done
  failed = state.error != ERROR_NONE
  e = jnp.where(active & ~failed, e, 0)                           # nothing from bad logits
  tokens, new_n = commit_prefix(state.tokens, cand, n, e)   # a done row's writes: never read
  done = done | failed | (first_stop < e) | (new_n - state.prompt_len >= state.max_new)
  hist = state.accepted_histogram + jax.nn.one_hot(
      a, state.accepted_histogram.shape[1], dtype=jnp.int32) * active[:, None]
  state = state.replace(tokens=tokens, length=new_n, done=done, rounds=state.rounds + 1,
                        target_calls=state.target_calls + active, accepted_histogram=hist)
  if drafter is not None:
    state = state.replace(drafter=drafter.after_verify(state.drafter, h0, n))
  return state


def record_auto(schedule, state: DecodeState, g: int, a, active, drafted=None) -> DecodeState:
  """"auto": folds a round of static length g with accepted counts a [B]
  int32 into the segment's rounds left, the schedule's estimates and the
  per-position statistics, for rows ``active`` [B] and not failed;
  undrafted rows (``drafted`` [B]) count at g = 0 and stay out of the
  estimates."""
  auto = state.auto
  ok = active & (state.error == ERROR_NONE)
  if g and drafted is not None:
    ok = ok & drafted
    dlh = (auto.draft_length_histogram.at[:, g].add((active & drafted).astype(jnp.int32))
           .at[:, 0].add((active & ~drafted).astype(jnp.int32)))
  else:
    dlh = auto.draft_length_histogram.at[:, g].add(active.astype(jnp.int32))
  auto = auto.replace(draft_length_histogram=dlh, left=jnp.maximum(auto.left - 1, 0))
  auto = auto.replace(schedule=schedule.update(auto.schedule, g, a, ok))
  if g:
    j = jnp.arange(1, auto.position_tested.shape[1] + 1)[None, :]
    tested = (j <= g) & (a[:, None] >= j - 1) & ok[:, None]
    auto = auto.replace(position_tested=auto.position_tested + tested,
                        position_accepted=auto.position_accepted + (tested & (a[:, None] >= j)))
  return state.replace(auto=auto)


def chain_round(drafter, target: Transformer, draft: Transformer | None, state: DecodeState,
                params: SamplingParams, g: int, *, schedule=None,
                accept_rule=acceptance.chain_rule) -> DecodeState:
  """One draft-verify-accept-commit round at static draft length g (0 = AR
  step) for every row (done rows unchanged). ``schedule``: "auto"'s
  ``AutoSchedule`` or None; ``accept_rule(params, g)`` picks the rule at
  trace time (default ``acceptance.chain_rule``)."""
  active = ~state.done
  drafted = drafted_rows(drafter, state.length) if g else None
  state, prop = propose(drafter, target, draft, state, params, g)
  with jax.named_scope("accept"):
    rule = accept_rule(params, g)
    a, nxt = rule(prop.key, prop.p, prop.draft_q, prop.draft_tokens)
  with jax.named_scope("commit"):
    state = commit(drafter, state, prop.draft_tokens, a, nxt, prop.h0)
  if schedule is not None:
    with jax.named_scope("schedule"):
      state = record_auto(schedule, state, g, a, active, drafted)
  return state
