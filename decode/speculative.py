"""KV-cached decoding: autoregressive baseline and speculative decoding with
an MTP or draft-model drafter, in two forms each.

- ``Decoder.stream(...)``: a jitted prefill and a jitted single round (one
  target call) driven from Python: streaming, per-token timing, early stop.
- ``Decoder.generate(...)``: prefill then every round inside one
  ``jax.lax.while_loop`` (throughput; one host round trip per generation).

Both run the same round function, so they emit identical tokens for the
same seed; with ``num_draft_tokens="auto"`` only given the same round costs
(``auto_costs``), since each form otherwise measures its own and may choose
other draft lengths (same output law either way). One round for a row with committed tokens x_0..x_{n-1} (target
cache valid for 0..n-2; docs/design.md section 5):

1. draft d_1..d_G with distributions q_1..q_G (``decode.drafters``);
2. verify: one target forward over [x_{n-1}, d_1..d_G] at positions
   n-1..n+G-1, p_j = warp(l_j);
3. accept with ``sampling.rejection_sample`` (Leviathan et al. 2023,
   Algorithm 1): a accepted drafts plus one residual/bonus token;
4. commit: n' = n + e where e <= a+1 is cut at EOS (kept) and at the token
   budget, never overshooting ``max_new_tokens``. Rolling back the caches is
   setting lengths; stale entries are masked and later overwritten.

The AR baseline is the same round with G = 0: one target call per token.
Caches and buffers are donated, so writes happen in place.

Sampling settings reach the jitted functions as a ``sampling.Warp``: values
traced, "greedy" (temperature 0) and "filtering" (top-k/top-p on) static, so
the greedy program is argmaxes only (drafts, verification, next token: no
softmax, no residual, no random numbers) and sampling without top-k/top-p
never compiles the vocabulary sort. Outputs are those of the general rule:
greedy verification is the acceptance rule with one-hot p and q.

Non-finite logits (target or drafter, at any emittable id) stop the row in
the round that produced them: a flag in the state, set inside the jitted
round (no host sync), so nothing computed from them is emitted; the host
then raises ``NonFiniteLogitsError`` naming the row and the position.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from decode import mesh as decode_mesh
from decode import sampling
from decode.schedule import AutoSchedule
from decode import tree as tree_lib
from decode.drafters import DraftModelDrafter, MTPDrafter, gather_rows, warped_probs, write_rows
from mtp import tokenizer as tok
from mtp.model import Transformer, init_layer_caches

METHODS = ("ar", "mtp", "draft")
_CALIBRATION_ROUNDS = 16    # rounds per timed call when measuring "auto" round costs
_CALIBRATION_REPEATS = 7    # interleaved timed calls per draft length
PROMPT_BUCKET = 64      # prompt lengths are padded to a multiple: no recompile per length


class DecodeError(ValueError):
  """Bad decoding input (the message names the flag or field)."""


class NonFiniteLogitsError(RuntimeError):
  """The target or the drafter produced NaN/inf logits during a generation
  (diverged or damaged weights, overflow in low precision).

  Attributes: ``rows`` (per row, the tokens emitted before it stopped),
  ``row`` and ``position`` (the first failing row and the position whose
  logits were non-finite), ``source`` ("target" or "drafter").
  """

  def __init__(self, message: str, *, rows=None, row=None, position=None, source=None):
    super().__init__(message)
    self.rows, self.row, self.position, self.source = rows, row, position, source


ERROR_NONE, ERROR_TARGET, ERROR_DRAFTER = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature >= 0 (0 = greedy), top_k >= 0 (0 = off), top_p in (0, 1] (1 = off)."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def validate(self):
    if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0
            and math.isfinite(self.temperature)):
      raise DecodeError(f"--temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
    if not (isinstance(self.top_k, int) and self.top_k >= 0):
      raise DecodeError(f"--top_k={self.top_k!r} must be an integer >= 0 (0 disables top-k)")
    if not (0 < self.top_p <= 1):
      raise DecodeError(f"--top_p={self.top_p!r} must be in (0, 1] (1 disables top-p)")
    return self

  def as_arrays(self) -> sampling.Warp:
    """The ``sampling.Warp`` of these settings (traced values, static
    greedy / filtering flags) that jitted decoding functions take."""
    return sampling.Warp.of(self.temperature, self.top_k, self.top_p)


@dataclasses.dataclass
class Generation:
  """Result of one batched generation.

  tokens: per row, the generated ids (int32 numpy, EOS included if emitted).
  prompt_lengths: per row, prompt length including BOS.
  accepted_histogram: [B, G+1] int64, rounds per number of accepted drafts a.
  target_calls: [B] int64, target verification calls while the row was active.
  emit_times: per row, seconds from the start of the request to each emitted
    token (stream form only; tokens of one round share a time).
  wall_time_s: seconds for the whole call (prefill included), after compilation.
  prefill_time_s: seconds of the prefill alone (target and drafter over the
    prompt bucket); wall_time_s - prefill_time_s is the decoding phase.
  num_draft_tokens: G, or G_max with ``num_draft_tokens="auto"``.
  draft_length_histogram: [B, G_max+1] int64, rounds per chosen draft length
    (0 = AR step) while the row was active (``"auto"`` only, else None).
  position_tested / position_accepted: [B, G_max] int64, rounds in which
    draft position k was tested (the round drafted >= k tokens and d_1..d_{k-1}
    were accepted) / accepted (``"auto"`` only: with a varying G the
    accepted-length histogram alone cannot give alpha_k).
  tree: the token tree's branching per depth (``Decoder(tree=...)``), else
    None; then accepted_histogram counts accepted path lengths a = 0..m and
    num_draft_tokens is the depth m.
  """
  tokens: list[np.ndarray]
  prompt_lengths: np.ndarray
  accepted_histogram: np.ndarray
  target_calls: np.ndarray
  emit_times: list[list[float]] | None
  wall_time_s: float
  num_draft_tokens: int
  prefill_time_s: float = 0.0
  draft_length_histogram: np.ndarray | None = None
  position_tested: np.ndarray | None = None
  position_accepted: np.ndarray | None = None
  tree: tuple[int, ...] | None = None


class Decoder:
  """Batched KV-cached decoder for one target model and one method.

  Args:
    target: trained ``Transformer``.
    method: "ar" (one target call per token), "mtp" (drafts from the
      target's MTP modules) or "draft" (independent ``draft`` model).
    num_draft_tokens: G >= 1 for "mtp"/"draft" (ignored for "ar"), or "auto"
      ("mtp" only): G in 0..G_max chosen every round from running acceptance
      estimates and measured round costs (``decode.schedule``).
    draft: draft model for method "draft" (same tokenizer / vocabulary).
    mesh: optional ``jax.sharding.Mesh`` (``mtp.sharding.make_mesh``):
      parameters tensor-parallel (and FSDP) sharded as in training, batch
      rows over ``data`` (``decode.mesh``); None = one device, unchanged.
    max_draft_tokens: G_max for "auto" (default D, the trained modules).
    schedule: an ``AutoSchedule`` for "auto" (default ``AutoSchedule(G_max)``).
    auto_costs: seconds per round for g = 0..G_max (skips the measurement
      made before the first generation of each batch size).
    tree: token tree for method "mtp", branching per depth (e.g. (3, 2, 1)
      or "3,2,1"; depth m in [1, D]): every round drafts the tree with the
      MTP modules and verifies all its nodes in one target call
      (``decode.tree``); ``num_draft_tokens`` is then not used (the depth m
      plays G's role in the statistics). None: the chain.
  Raises:
    DecodeError: unknown method, G < 1, "mtp" with D = 0, "auto" with
      another method or a bad G_max / costs, a draft model with another
      vocabulary, or a bad tree (one line naming --tree and the allowed
      range; a tree with a method other than "mtp" or with "auto").
    ConfigError: mesh axes that do not divide the model dimensions.
  """

  def __init__(self, target: Transformer, method: str = "mtp", num_draft_tokens: int | str = 2,
               draft: Transformer | None = None, mesh=None, *, max_draft_tokens: int | None = None,
               schedule: AutoSchedule | None = None, auto_costs=None, tree=None):
    if method not in METHODS:
      raise DecodeError(f"--method={method!r} must be one of {METHODS}")
    self.method = method
    self.tree = None
    if tree is not None:                # token trees: decode/tree.py
      if method != "mtp":
        raise DecodeError(f"--tree needs --method=mtp (the MTP modules draft the tree); got "
                          f"--method={method}")
      if target.mtp_depth < 1:
        raise DecodeError("--tree needs a checkpoint trained with mtp.depth >= 1; this one has D = 0")
      if num_draft_tokens == "auto":
        raise DecodeError("--tree and --num_draft_tokens=auto exclude each other: a tree has a "
                          "fixed shape (its depth takes the place of the draft length)")
      try:
        self.tree = tree_lib.parse_tree(tree, target.mtp_depth)
      except ValueError as e:
        raise DecodeError(str(e)) from None
      num_draft_tokens = self.tree.depth
    self.target_graphdef, self.target_params = nnx.split(target, nnx.Param)
    self.target_cfg = target.cfg
    self.draft_graphdef = self.draft_params = None
    self.schedule = None
    self._costs: dict = {}
    if method == "ar":
      self.G, self.drafter = 0, None
    elif num_draft_tokens == "auto":
      if method != "mtp":
        raise DecodeError(f"--num_draft_tokens=auto needs --method=mtp (got --method={method})")
      if target.mtp_depth < 1:
        raise DecodeError("--method=mtp needs a checkpoint trained with mtp.depth >= 1; this one "
                          "has D = 0 (use --method=ar or --method=draft)")
      g_max = target.mtp_depth if max_draft_tokens is None else max_draft_tokens
      if not (isinstance(g_max, int) and 1 <= g_max <= 16):
        raise DecodeError(f"--max_draft_tokens={g_max!r} must be an integer in [1, 16]")
      self.schedule = schedule or AutoSchedule(g_max)
      if self.schedule.max_draft_tokens != g_max:
        raise DecodeError(f"schedule.max_draft_tokens={self.schedule.max_draft_tokens} differs "
                          f"from --max_draft_tokens={g_max}")
      self.G = g_max
      self.drafter = MTPDrafter(g_max, target.mtp_depth, max_draft_tokens=g_max)
      if auto_costs is not None:
        costs = np.asarray(auto_costs, np.float64)
        if costs.shape != (g_max + 1,) or not np.all(costs > 0):
          raise DecodeError(f"auto_costs must be {g_max + 1} positive seconds per round "
                            f"(g = 0..{g_max}), got {auto_costs!r}")
        self._fixed_costs = costs
      else:
        self._fixed_costs = None
    else:
      if not (isinstance(num_draft_tokens, int) and num_draft_tokens >= 1):
        raise DecodeError(f"--num_draft_tokens={num_draft_tokens!r} must be an integer >= 1 "
                          "or 'auto'")
      self.G = num_draft_tokens
      if method == "mtp":
        if target.mtp_depth < 1:
          raise DecodeError("--method=mtp needs a checkpoint trained with mtp.depth >= 1; this one "
                            "has D = 0 (use --method=ar or --method=draft)")
        self.drafter = (MTPDrafter(num_draft_tokens, target.mtp_depth) if self.tree is None
                        else tree_lib.TreeMTPDrafter(self.tree, target.mtp_depth))
      else:
        if draft is None:
          raise DecodeError("--method=draft needs a draft model (--draft_workdir)")
        if draft.cfg.vocab_size != target.cfg.vocab_size:
          raise DecodeError(f"--draft_workdir model has vocab_size {draft.cfg.vocab_size}, the target "
                            f"has {target.cfg.vocab_size}: draft and target must share the vocabulary")
        self.drafter = DraftModelDrafter(num_draft_tokens)
        self.draft_graphdef, self.draft_params = nnx.split(draft, nnx.Param)
    self.mesh = mesh
    fns = (self._prefill, self._round, self._generate)
    if mesh is not None:
      self.target_params = decode_mesh.place_params(mesh, self.target_params, target.cfg)
      if self.draft_params is not None:
        self.draft_params = decode_mesh.place_params(mesh, self.draft_params, draft.cfg)
      fns = tuple(decode_mesh.constrain_state(f, mesh) for f in fns)
    self._prefill_fn = jax.jit(fns[0], donate_argnums=(2,), static_argnums=(3,))
    self._round_fn = jax.jit(fns[1], donate_argnums=(2,))
    self._generate_fn = jax.jit(fns[2], donate_argnums=(2,))
    if self.schedule is not None:
      wrap = (lambda f: f) if mesh is None else (lambda f: decode_mesh.constrain_state(f, mesh))
      # stream form: the choice, then the round compiled for the chosen g
      self._choose_fn = jax.jit(wrap(self._choose), donate_argnums=(0,))
      self._round_g_fns = [jax.jit(wrap(functools.partial(self._round_g, g=g)), donate_argnums=(2,))
                           for g in range(self.G + 1)]
      # cost measurement: rounds at a fixed g inside one fori_loop, state not donated
      self._calibrate_fns = [jax.jit(lambda p, dp, st, w, g=g: jax.lax.fori_loop(
          0, _CALIBRATION_ROUNDS, lambda i, x: self._round_g(p, dp, x, w, g), st))
          for g in range(self.G + 1)]

  @property
  def num_draft_tokens(self) -> int | str:
    """G, or "auto"."""
    return "auto" if self.schedule is not None else self.G

  def target(self) -> Transformer:
    """The target model."""
    return nnx.merge(self.target_graphdef, self.target_params)

  # -- pure pieces (traced) ---------------------------------------------------

  def _models(self, params, draft_params):
    target = nnx.merge(self.target_graphdef, params)
    draft = None if draft_params is None else nnx.merge(self.draft_graphdef, draft_params)
    return target, draft

  def _prefill(self, params, draft_params, state, p: int):
    """Target (and drafter) over positions 0..p-1 (p = prompt bucket - 1, static)."""
    target, draft = self._models(params, draft_params)
    tokens, n = state["tokens"], state["length"]
    b = tokens.shape[0]
    with jax.named_scope("prefill"):
      pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
      h0, cache = target.backbone(tokens[:, :p], pos, cache=state["cache"])
      state = {**state, "cache": cache}
      if self.method == "mtp":
        state["drafter"] = self.drafter.prefill(target, state["drafter"], tokens, n, h0, p)
      elif self.method == "draft":
        state["drafter"] = self.drafter.prefill(draft, state["drafter"], tokens, n, p)
    return state

  def _propose(self, target, draft, state, warp, g: int | None = None):
    """Draft and verify: returns (state with drafts written and the target
    cache extended, draft_tokens [B, G], q [B, G, V], p [B, G+1, V], h0
    [B, G+1, D], accept key or None).

    Sampling: q the warped draft distributions, p the warped target
    distributions. Greedy ``warp``: q and p are the raw draft and target
    logits (only their argmaxes matter) and no key is split (a drafter gets
    the state's key unchanged: the built-in ones draw nothing). Rows whose
    target or draft logits are non-finite at an emittable id get
    ``state["error"]`` (ERROR_TARGET / ERROR_DRAFTER) and
    ``state["error_pos"]`` (the position whose logits were bad) set here;
    ``_commit`` then emits nothing for them and stops them. ``g``: the
    draft length of this round (default G; 0..G_max with "auto").
    """
    g = self.G if g is None else g
    tokens, n = state["tokens"], state["length"]
    greedy = getattr(warp, "greedy", False)
    k_draft, k_accept = state["key"], None        # greedy: nothing random (key not advanced)
    if not greedy:
      with jax.named_scope("rng"):
        key, k_draft, k_accept = jax.random.split(state["key"], 3)
      state = {**state, "key": key}
    d_tok = d_q = None
    if g:
      model = target if self.method == "mtp" else draft
      extra = {"num_draft_tokens": g} if self.schedule is not None else {}
      with jax.named_scope("draft"):
        dstate, tokens, d_tok, d_q = self.drafter.draft(model, state["drafter"], tokens, n,
                                                        k_draft, warp, **extra)
      state["drafter"] = dstate
    with jax.named_scope("verify"):
      block_pos = (n - 1)[:, None] + jnp.arange(g + 1, dtype=jnp.int32)[None, :]
      with jax.named_scope("forward"):
        h0, cache = target.backbone(gather_rows(tokens, block_pos), block_pos, cache=state["cache"])
      with jax.named_scope("head"):
        logits = target.head(h0)                                    # [B, G+1, V]
      with jax.named_scope("warp"):
        p = logits if greedy else warped_probs(logits, warp)
    with jax.named_scope("check"):
      state = _flag_non_finite(state, logits, d_q, n)
    return {**state, "tokens": tokens, "cache": cache}, d_tok, d_q, p, h0, k_accept

  def _commit(self, state, d_tok, a, nxt, h0):
    """Emits d_1..d_a then ``nxt`` per row, cut after an EOS and at the token
    budget; updates lengths, done flags, statistics and drafter state.
    The round's draft length is that of ``d_tok`` (None: an AR step)."""
    g = 0 if d_tok is None else d_tok.shape[1]
    n, done = state["length"], state["done"]
    b = n.shape[0]
    cand = (jnp.concatenate([d_tok, jnp.zeros((b, 1), jnp.int32)], 1) if g
            else jnp.zeros((b, 1), jnp.int32))
    idx = jnp.arange(g + 1)[None, :]
    cand = jnp.where(idx == a[:, None], nxt[:, None], cand)         # d_1..d_a, next
    is_eos = (cand == tok.EOS_ID) & (idx <= a[:, None])
    first_eos = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1), g + 1)
    remaining = state["max_new"] - (n - state["prompt_len"])
    e = jnp.minimum(jnp.minimum(a + 1, remaining), first_eos + 1)
    active = ~done
    failed = state["error"] != ERROR_NONE if "error" in state else jnp.zeros_like(done)
    e = jnp.where(active & ~failed, e, 0)                           # nothing from bad logits
    new_n = n + e
    done = (done | failed | (first_eos < e)
            | (new_n - state["prompt_len"] >= state["max_new"]))
    # A done row's writes land past its length and are never read.
    state = {**state, "tokens": write_rows(state["tokens"], cand, n), "length": new_n,
             "done": done, "target_calls": state["target_calls"] + active,
             "accepted_histogram": state["accepted_histogram"]
             + jax.nn.one_hot(a, state["accepted_histogram"].shape[1], dtype=jnp.int32)
             * active[:, None]}
    if self.method == "mtp":
      state["drafter"] = self.drafter.after_verify(state["drafter"], h0, n)
    return state

  def _round(self, params, draft_params, state, warp):
    """One draft-verify-accept-commit round for every row (no-op for done
    rows). Not used with "auto", whose rounds are ``_round_g`` at the g
    that ``_choose`` picked."""
    if self.tree is not None:           # token trees: decode/tree.py
      target, _ = self._models(params, draft_params)
      return tree_lib.tree_round(self.drafter, target, state, warp,
                                 flag_non_finite=_flag_non_finite, commit=self._commit)
    return self._round_g(params, draft_params, state, warp, self.G)

  def _round_g(self, params, draft_params, state, warp, g: int):
    """A round with draft length g (static; 0 = AR step)."""
    target, draft = self._models(params, draft_params)
    active = ~state["done"]
    state, d_tok, d_q, p, h0, key = self._propose(target, draft, state, warp, g)
    with jax.named_scope("accept"):
      a, nxt = self._accept(key, p, d_q, d_tok, warp)
    with jax.named_scope("commit"):
      state = self._commit(state, d_tok, a, nxt, h0)
    if self.schedule is not None:
      with jax.named_scope("schedule"):
        ok = active & (state["error"] == ERROR_NONE)
        hist = state["draft_length_histogram"].at[:, g].add(active.astype(jnp.int32))
        state = {**state, "draft_length_histogram": hist}
        if g:
          j = jnp.arange(1, self.G + 1)[None, :]
          tested = (j <= g) & (a[:, None] >= j - 1) & ok[:, None]
          state = {**state, "schedule": self.schedule.update(state["schedule"], g, a, ok),
                   "position_tested": state["position_tested"] + tested,
                   "position_accepted": state["position_accepted"] + (tested & (a[:, None] >= j))}
    return state

  def _choose(self, state):
    """"auto": picks (g, rounds) of the next segment from the past
    (``AutoSchedule.choose``); both go into the schedule state."""
    with jax.named_scope("schedule"):
      g, rounds, sched = self.schedule.choose(state["schedule"], ~state["done"])
    return {**state, "schedule": {**sched, "g": g, "left": rounds}}

  def _segment(self, params, draft_params, state, warp, g: int):
    """"auto", while_loop form: when the segment's draft length
    ``schedule["g"]`` is g (static), its rounds in one ``lax.while_loop``
    until its round count (capped by the rounds left in the budget) is used
    up or every row is done; otherwise nothing (the loop's condition is
    false at once)."""
    max_rounds = jnp.max(state["max_new"])
    state = {**state, "schedule": {**state["schedule"], "left": jnp.minimum(
        state["schedule"]["left"], max_rounds - state["schedule"]["rounds"])}}
    def cond(s):
      return (s["schedule"]["g"] == g) & (s["schedule"]["left"] > 0) & ~jnp.all(s["done"])
    def body(s):
      s = self._round_g(params, draft_params, s, warp, g)
      return {**s, "schedule": {**s["schedule"], "left": s["schedule"]["left"] - 1,
                                "rounds": s["schedule"]["rounds"] + 1}}
    return jax.lax.while_loop(cond, body, state)

  def _accept(self, key, p, d_q, d_tok, warp):
    """(num_accepted [B], next_token [B]): greedy verification on logits, or
    the rejection rule of Leviathan et al. 2023 (Algorithm 1) on warped
    probabilities; for an AR step (no drafts) the next token alone."""
    if getattr(warp, "greedy", False):
      if d_tok is not None:
        return sampling.greedy_verify(p, d_tok)
      return jnp.zeros(p.shape[0], jnp.int32), jnp.argmax(p[:, 0], -1).astype(jnp.int32)
    if d_tok is not None:
      return sampling.rejection_sample(key, p, d_q, d_tok)
    return jnp.zeros(p.shape[0], jnp.int32), sampling.sample(key, p[:, 0])

  def _generate(self, params, draft_params, state, warp):
    """Every round inside one ``lax.while_loop`` (after ``_prefill``). With
    "auto", an outer while_loop over segments whose body chooses g
    (``_choose``) and then runs the inner while_loops of g = 0..G_max one
    after the other, of which only the chosen one iterates (``_segment``).
    Sequential loops, not a ``lax.switch`` over them: XLA copies every KV
    cache on entering a switch branch (it made "auto" visibly slower than
    the fixed G it chose at batch 4 on the reference model), while loops
    update their carry in place; and no host round trip per segment (a
    host-driven variant lost most on the demo model, whose rounds take
    fractions of a millisecond)."""
    max_rounds = jnp.max(state["max_new"])
    if self.schedule is not None:
      def seg_cond(s):
        return ~jnp.all(s["done"]) & (s["schedule"]["rounds"] < max_rounds)
      def seg_body(s):
        s = self._choose(s)
        for g in range(self.G + 1):
          s = self._segment(params, draft_params, s, warp, g)
        return s
      return jax.lax.while_loop(seg_cond, seg_body, state)
    def cond(carry):
      s, i = carry
      return jnp.logical_and(~jnp.all(s["done"]), i < max_rounds)
    def body(carry):
      s, i = carry
      return self._round(params, draft_params, s, warp), i + 1
    state, _ = jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
    return state

  # -- host side ---------------------------------------------------------------

  def prepare(self, prompts: Sequence[np.ndarray], max_new_tokens: int, seed: int):
    """Builds the initial state for a batch of token prompts (BOS included);
    returns (state, prefill_len).

    Raises DecodeError for an empty batch, a prompt without any token after
    BOS, prompt + max_new_tokens beyond the model's max_seq_len, or (with a
    mesh) a batch that the ``data`` axis does not divide.
    """
    if not prompts:
      raise DecodeError("no prompts given")
    if self.mesh is not None and len(prompts) % self.mesh.shape["data"]:
      raise DecodeError(f"{len(prompts)} prompts cannot be split over the mesh's data axis of size "
                        f"{self.mesh.shape['data']}: give a multiple of it")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
      raise DecodeError(f"--max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    max_len = self.target_cfg.max_seq_len
    for i, p in enumerate(prompts):
      if len(p) < 2:
        raise DecodeError(f"prompt {i} is empty: give at least one byte of text after BOS")
      if len(p) + max_new_tokens > max_len:
        room = max_len - len(p)
        raise DecodeError(
            f"prompt {i} has {len(p)} tokens (with BOS); with --max_new_tokens={max_new_tokens} it "
            f"exceeds the model's max_seq_len={max_len}"
            + (f" (at most {room} new tokens fit)" if room > 0 else
               f" (no room left to generate: with this --max_new_tokens a prompt may have at most "
               f"{max_len - max_new_tokens - 1} tokens without BOS)"
               if max_len - max_new_tokens > 1 else
               f" (--max_new_tokens must be at most {max_len - 2} to leave room for a prompt)"))
    b = len(prompts)
    p_len = PROMPT_BUCKET * math.ceil(int(lengths.max()) / PROMPT_BUCKET)
    # scratch room past the budget for verify blocks and drafter windows
    headroom = 2 * self.G + 4 + (self.drafter.depth if isinstance(self.drafter, MTPDrafter) else 0)
    if self.tree is not None:           # the verify block and module calls of a tree
      headroom += self.drafter.scratch_slots
    cache_len = PROMPT_BUCKET * math.ceil((p_len + max_new_tokens + headroom) / PROMPT_BUCKET)
    tokens = np.full((b, cache_len), tok.PAD_ID, np.int32)
    for i, p in enumerate(prompts):
      tokens[i, :len(p)] = p
    target = nnx.merge(self.target_graphdef, self.target_params)
    state = {
        "tokens": jnp.asarray(tokens),
        "length": jnp.asarray(lengths),
        "prompt_len": jnp.asarray(lengths),
        "max_new": jnp.full((b,), max_new_tokens, jnp.int32),
        "done": jnp.zeros((b,), bool),
        "key": jax.random.key(seed, impl="rbg"),
        "cache": init_layer_caches(self.target_cfg, self.target_cfg.num_layers, b, cache_len),
        "target_calls": jnp.zeros((b,), jnp.int32),
        "accepted_histogram": jnp.zeros((b, self.G + 1), jnp.int32),
        "error": jnp.zeros((b,), jnp.int32),
        "error_pos": jnp.zeros((b,), jnp.int32),
    }
    if self.schedule is not None:
      state["schedule"] = {**self.schedule.init_state(b, np.ones(self.G + 1, np.float32)),
                           "g": jnp.int32(0), "left": jnp.int32(0), "rounds": jnp.int32(0)}
      state["draft_length_histogram"] = jnp.zeros((b, self.G + 1), jnp.int32)
      state["position_tested"] = jnp.zeros((b, self.G), jnp.int32)     # rounds testing d_k
      state["position_accepted"] = jnp.zeros((b, self.G), jnp.int32)
    if self.method == "mtp":
      state["drafter"] = self.drafter.init_state(target, b, cache_len)
    elif self.method == "draft":
      draft = nnx.merge(self.draft_graphdef, self.draft_params)
      state["drafter"] = self.drafter.init_state(draft, b, cache_len)
    if self.mesh is not None:
      state = decode_mesh.shard_state(self.mesh, state)
    return state, p_len - 1

  def _result(self, state, emit_times, wall, prefill):
    auto = ("draft_length_histogram", "position_tested", "position_accepted")
    keys = ("tokens", "length", "prompt_len", "target_calls", "accepted_histogram", "error",
            "error_pos") + (auto if self.schedule is not None else ())
    host = jax.device_get({k: state[k] for k in keys})
    _raise_on_error(host)
    rows = [host["tokens"][i, host["prompt_len"][i]:host["length"][i]].copy()
            for i in range(host["tokens"].shape[0])]
    extra = {k: host[k].astype(np.int64) for k in auto if k in host}
    return Generation(rows, host["prompt_len"], host["accepted_histogram"].astype(np.int64),
                      host["target_calls"].astype(np.int64), emit_times, wall, self.G, prefill,
                      tree=None if self.tree is None else self.tree.branching, **extra)

  def _with_costs(self, state, warp, prompts, max_new_tokens: int, form: str = "while"):
    """"auto": ``state`` with the schedule's round costs for this batch size,
    cache length, sampling mode and form (``_auto_costs``); otherwise
    unchanged."""
    if self.schedule is None:
      return state
    costs = self._auto_costs(prompts, max_new_tokens, warp, form)
    sched = {**state["schedule"], "costs": jnp.asarray(costs, jnp.float32)}
    if self.mesh is not None:
      sched["costs"] = jax.device_put(sched["costs"], decode_mesh.replicated(self.mesh))
    return {**state, "schedule": sched}

  def _auto_costs(self, prompts, max_new_tokens: int, warp, form: str = "while") -> np.ndarray:
    """Seconds per round for g = 0..G_max, measured once per (batch size,
    cache length, sampling mode, form) on this device, after a prefill of
    these prompts. While_loop form: ``_CALIBRATION_ROUNDS`` rounds at each g
    inside one jitted fori_loop (no host dispatch). Stream form: as many
    rounds called one by one from Python with the host sync the stream loop
    makes (a round's host overhead is part of its cost there, which favours
    longer drafts). Both ``_CALIBRATION_REPEATS`` times with the g
    interleaved; each g's cost is its median ratio to the AR step timed in
    the same repeat times the fastest AR step, made non-decreasing in g (the
    compile and this measurement happen before any timed generation; a busy
    machine can still skew them, which only costs speed, never
    correctness). ``auto_costs`` given to the constructor replaces the
    measurement."""
    if self._fixed_costs is not None:
      return self._fixed_costs
    state, prefill_len = self.prepare(prompts, max_new_tokens, 0)
    key = (len(prompts), state["tokens"].shape[1], warp.greedy, warp.filtering, form)
    if key not in self._costs:
      state = self._prefill_fn(self.target_params, self.draft_params, state, prefill_len)
      p, dp = self.target_params, self.draft_params
      if form == "while":
        def timed(g):
          jax.block_until_ready(self._calibrate_fns[g](p, dp, state, warp))
      else:
        def timed(g):
          s = jax.tree.map(jnp.copy, state)
          for _ in range(_CALIBRATION_ROUNDS):
            s = self._round_g_fns[g](p, dp, s, warp)
            jax.device_get((s["length"], s["done"], s["error"]))
      for g in range(self.G + 1):                 # compile
        timed(g)
      times = [[] for _ in range(self.G + 1)]
      for _ in range(_CALIBRATION_REPEATS):      # interleaved, so noise hits every g alike
        for g in range(self.G + 1):
          t0 = time.perf_counter()
          timed(g)
          times[g].append((time.perf_counter() - t0) / _CALIBRATION_ROUNDS)
      # each g relative to the AR step timed just before it (the median ratio over
      # repeats), scaled by the fastest AR step: robust to slow drift and bursts
      t = np.asarray(times)                           # [G+1, repeats]
      costs = np.median(t / t[:1], axis=1) * t[0].min()
      # a longer draft never costs less: keep noise from inverting the order
      self._costs[key] = np.maximum.accumulate(costs)
    return self._costs[key]

  def generate(self, prompts, max_new_tokens: int, sampling_params: SamplingParams, seed: int = 0):
    """Whole generation in two jitted calls, the prefill, then every round in
    one ``while_loop`` (throughput form; the prefill is timed apart).

    Raises DecodeError for bad input (``prepare``) and NonFiniteLogitsError
    when the target or drafter produced NaN/inf logits (``_raise_on_error``).
    """
    warp = sampling_params.validate().as_arrays()
    state, prefill_len = self.prepare(prompts, max_new_tokens, seed)
    state = self._with_costs(state, warp, prompts, max_new_tokens)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state = self._prefill_fn(self.target_params, self.draft_params, state, prefill_len)
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    state = self._generate_fn(self.target_params, self.draft_params, state, warp)
    jax.block_until_ready(state["length"])
    return self._result(state, None, time.perf_counter() - t0, t1 - t0)

  def stream(self, prompts, max_new_tokens: int, sampling_params: SamplingParams, seed: int = 0,
             on_tokens: Callable[[int, np.ndarray], None] | None = None):
    """Jitted prefill + one jitted round per Python step (streaming form).

    ``on_tokens(row, new_ids)`` is called after each round with each row's
    newly emitted ids. Emits exactly what ``generate`` emits for the same seed
    (with "auto": given the same ``auto_costs``; see the module docstring).
    """
    warp = sampling_params.validate().as_arrays()
    state, prefill_len = self.prepare(prompts, max_new_tokens, seed)
    state = self._with_costs(state, warp, prompts, max_new_tokens, form="stream")
    jax.block_until_ready(state)
    b = len(prompts)
    emit_times: list[list[float]] = [[] for _ in range(b)]
    t0 = time.perf_counter()
    state = self._prefill_fn(self.target_params, self.draft_params, state, prefill_len)
    prev = np.asarray(state["length"])
    prefill = time.perf_counter() - t0
    left = 0
    for _ in range(max_new_tokens):
      if self.schedule is None:
        state = self._round_fn(self.target_params, self.draft_params, state, warp)
      else:          # the same segments as the while_loop form, g chosen between rounds
        if left == 0:
          state = self._choose_fn(state)
          g, left = (int(x) for x in jax.device_get((state["schedule"]["g"],
                                                      state["schedule"]["left"])))
        state = self._round_g_fns[g](self.target_params, self.draft_params, state, warp)
        left -= 1
      length, done, error = jax.device_get((state["length"], state["done"], state["error"]))
      if error.any():
        break
      now = time.perf_counter() - t0
      if on_tokens is not None and np.any(length > prev):
        toks = np.asarray(state["tokens"])
      for i in np.nonzero(length > prev)[0]:
        emit_times[i].extend([now] * int(length[i] - prev[i]))
        if on_tokens is not None:
          on_tokens(int(i), toks[i, prev[i]:length[i]])
      prev = length
      if done.all():
        break
    wall = time.perf_counter() - t0
    return self._result(state, emit_times, wall, prefill)


def _flag_non_finite(state, target_logits, draft_q, n, positions=None):
  """Sets ``error``/``error_pos`` of rows (still active and not yet failed)
  whose target logits [B, G+1, V] or draft q [B, G, V] (probabilities or
  logits) hold NaN or +-inf at an emittable id (``tok.emittable_mask``;
  the head's -inf at never-emitted ids is by design). error_pos is the
  position whose logits were bad: n-1+j for target block row j (or
  ``positions[:, j]``, [B, T] int32, for a token tree's block), n-1 for
  the drafter (its drafts for the round starting at n)."""
  allowed = tok.emittable_mask(target_logits.shape[-1])
  bad_t = jnp.any(~jnp.isfinite(target_logits) & allowed, -1)          # [B, G+1]
  code = jnp.where(jnp.any(bad_t, -1), ERROR_TARGET, ERROR_NONE)
  row = jnp.argmax(bad_t, -1).astype(jnp.int32)
  pos = (n - 1 + row if positions is None
         else jnp.take_along_axis(positions, row[:, None], 1)[:, 0])
  if draft_q is not None:        # the target is named when both are bad (the drafter reads it)
    bad_d = jnp.any(~jnp.isfinite(draft_q) & allowed, (-1, -2)) & (code == ERROR_NONE)
    code = jnp.where(bad_d, ERROR_DRAFTER, code)
    pos = jnp.where(bad_d, n - 1, pos)
  fresh = (state["error"] == ERROR_NONE) & ~state["done"] & (code != ERROR_NONE)
  return {**state, "error": jnp.where(fresh, code, state["error"]),
          "error_pos": jnp.where(fresh, pos, state["error_pos"])}


def _raise_on_error(host: dict) -> None:
  """Raises NonFiniteLogitsError for the first row whose ``error`` is set
  (host copies of the state's error, error_pos, prompt_len, length)."""
  bad = np.nonzero(host["error"])[0]
  if not len(bad):
    return
  r = int(bad[0])
  rows = [host["tokens"][i, host["prompt_len"][i]:host["length"][i]].copy()
          for i in range(host["tokens"].shape[0])]
  who = "target" if host["error"][r] == ERROR_TARGET else "drafter"
  pos = int(host["error_pos"][r])
  emitted = int(host["length"][r] - host["prompt_len"][r])
  more = f" ({len(bad) - 1} other row(s) too)" if len(bad) > 1 else ""
  raise NonFiniteLogitsError(
      f"the {who} produced non-finite logits (NaN or inf) for row {r} at position {pos} "
      f"(predicting token {pos + 1}, after {emitted} generated token(s)){more}; the row was "
      "stopped and nothing computed from those logits was emitted. The weights are damaged, "
      "diverged or overflow in this dtype", rows=rows, row=r, position=pos, source=who)
