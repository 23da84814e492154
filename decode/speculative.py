"""KV-cached decoding: the autoregressive baseline and speculative decoding
with an MTP or draft-model drafter, in two forms each.

- ``Decoder.stream(...)``: a jitted prefill and a jitted single round (one
  target call) driven from Python: streaming, per-token timing, early stop.
- ``Decoder.generate(...)``: prefill then every round inside one
  ``jax.lax.while_loop`` (throughput; one host round trip per generation).

Both run the same round function, so they emit identical tokens for the
same seed; with ``num_draft_tokens="auto"`` only given the same round costs
(``auto_costs``), since each form otherwise measures its own and may choose
other draft lengths (same output law either way).

Where each job lives (docs/design.md section 2): the round's pure pieces in
``decode.round`` (propose / accept / commit) and ``decode.tree`` (token
trees), the acceptance rules in ``decode.verify``, warping and sampling in
``decode.sampling``, the loops in ``decode.loops``, the typed state in
``decode.state``, round-cost measurement in ``decode.calibrate``
(``with_costs`` puts the costs into an "auto" state). The
``Decoder`` validates its settings, builds the initial state (``prepare``)
and wires the jitted functions. Caches and buffers are donated, so writes
happen in place.

Non-finite logits (target or drafter, at any emittable id) stop the row in
the round that produced them: a flag in the state, set inside the jitted
round (no host sync), so nothing computed from them is emitted; the host
then raises ``NonFiniteLogitsError`` naming the row and the position.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from decode import calibrate, loops, stops as stops_lib, verify
from decode import mesh as decode_mesh
from decode import programs as programs_lib
from decode import state as state_lib
from decode import tree as tree_lib
from decode.drafters import DraftModelDrafter, MTPDrafter
from decode.errors import DecodeError, NonFiniteLogitsError  # noqa: F401 (the API's errors)
from decode.sampling import SamplingParams
from decode.schedule import AutoSchedule
from decode.state import DecodeState, Generation
from decode.stops import StopConditions
from mtp import tokenizer as tok
from mtp.model import Transformer

METHODS = ("ar", "mtp", "draft")
MAX_DRAFT_TOKENS = 16        # G (fixed) and auto's G_max: a draft longer than this never pays
WARMUP_TOKENS = 1            # tokens per row of ``Decoder.warm_up``


def _mtp_depth_check(target: Transformer, flag: str = "--method=mtp") -> None:
  if target.mtp_depth < 1:
    raise DecodeError(f"{flag} needs a checkpoint trained with mtp.depth >= 1; this one has "
                      "D = 0 (use --method=ar or --method=draft)")


def resolve_method(target: Transformer, method: str, num_draft_tokens, draft, *,
                   max_draft_tokens=None, schedule=None, auto_costs=None, tree=None):
  """Validates a decoder's settings; returns (G, drafter, schedule, tree
  spec, fixed auto costs or None). G: the draft length (fixed), G_max
  ("auto") or the tree depth m; 0 for AR.

  Raises DecodeError, one line naming the flag and the allowed range.
  """
  if method not in METHODS:
    raise DecodeError(f"--method={method!r} must be one of {METHODS}")
  if tree is not None:                  # token trees: decode/tree.py
    if method != "mtp":
      raise DecodeError(f"--tree needs --method=mtp (the MTP modules draft the tree); got "
                        f"--method={method}")
    _mtp_depth_check(target, "--tree")
    if num_draft_tokens == "auto":
      raise DecodeError("--tree and --num_draft_tokens=auto exclude each other: a tree has a "
                        "fixed shape (its depth takes the place of the draft length)")
    try:
      spec = tree_lib.parse_tree(tree, target.mtp_depth)
    except ValueError as e:
      raise DecodeError(str(e)) from None
    return spec.depth, tree_lib.TreeMTPDrafter(spec, target.mtp_depth), None, spec, None
  if method == "ar":
    return 0, None, None, None, None
  if num_draft_tokens == "auto":
    if method != "mtp":
      raise DecodeError(f"--num_draft_tokens=auto needs --method=mtp (got --method={method})")
    _mtp_depth_check(target)
    g_max = target.mtp_depth if max_draft_tokens is None else max_draft_tokens
    if not (isinstance(g_max, int) and 1 <= g_max <= MAX_DRAFT_TOKENS):
      raise DecodeError(f"--max_draft_tokens={g_max!r} must be an integer in "
                        f"[1, {MAX_DRAFT_TOKENS}]")
    schedule = schedule or AutoSchedule(g_max)
    if schedule.max_draft_tokens != g_max:
      raise DecodeError(f"schedule.max_draft_tokens={schedule.max_draft_tokens} differs "
                        f"from --max_draft_tokens={g_max}")
    costs = None
    if auto_costs is not None:
      costs = np.asarray(auto_costs, np.float64)
      if costs.shape != (g_max + 1,) or not np.all(costs > 0):
        raise DecodeError(f"auto_costs must be {g_max + 1} positive seconds per round "
                          f"(g = 0..{g_max}), got {auto_costs!r}")
    return g_max, MTPDrafter(target.mtp_depth, g_max, variable=True), schedule, None, costs
  if not (isinstance(num_draft_tokens, int) and not isinstance(num_draft_tokens, bool)
          and 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS):
    raise DecodeError(f"--num_draft_tokens={num_draft_tokens!r} must be an integer in "
                      f"[1, {MAX_DRAFT_TOKENS}] or 'auto'")
  if method == "mtp":
    _mtp_depth_check(target)
    return num_draft_tokens, MTPDrafter(target.mtp_depth, num_draft_tokens), None, None, None
  if draft is None:
    raise DecodeError("--method=draft needs a draft model (--draft_workdir)")
  if draft.cfg.vocab_size != target.cfg.vocab_size:
    raise DecodeError(f"--draft_workdir model has vocab_size {draft.cfg.vocab_size}, the target "
                      f"has {target.cfg.vocab_size}: draft and target must share the vocabulary")
  return num_draft_tokens, DraftModelDrafter(), None, None, None


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
    drafter: a drafter object replacing the method's own (same interface as
      ``decode.drafters``; for tests and experiments).
    accept_rule: the chain's acceptance rule (default ``verify.accept``;
      tests swap in wrong rules to check that the statistics catch them).
    tokenizer: the model's tokenizer (``mtp.tokenizer.load_tokenizer``;
      default the byte tokenizer, required for a BPE model): its stop ids
      (EOS, end of turn) end a row; its ``decode_bytes`` gives the text
      stop strings are matched against.
  Raises:
    DecodeError: unknown method, G < 1, "mtp" with D = 0, "auto" with
      another method or a bad G_max / costs, a draft model with another
      vocabulary, or a bad tree (one line naming the flag and the range).
    ConfigError: mesh axes that do not divide the model dimensions.
  """

  def __init__(self, target: Transformer, method: str = "mtp", num_draft_tokens: int | str = 2,
               draft: Transformer | None = None, mesh=None, *, max_draft_tokens: int | None = None,
               schedule: AutoSchedule | None = None, auto_costs=None, tree=None, drafter=None,
               accept_rule=verify.accept, tokenizer=None):
    self.method = method
    (self.G, self.drafter, self.schedule, self.tree, self._fixed_costs) = resolve_method(
        target, method, num_draft_tokens, draft, max_draft_tokens=max_draft_tokens,
        schedule=schedule, auto_costs=auto_costs, tree=tree)
    self.drafter = drafter or self.drafter
    self.accept_rule = accept_rule
    if tokenizer is None and target.cfg.tokenizer != "byte":
      raise DecodeError(f"a model with model.tokenizer={target.cfg.tokenizer!r} needs its "
                        "tokenizer: Decoder(..., tokenizer=mtp.tokenizer.load_tokenizer(workdir))")
    self.tokenizer = tokenizer or tok.ByteTokenizer()
    self.eos_ids = tuple(int(i) for i in self.tokenizer.stop_ids)
    pad = self.tokenizer.pad_id
    self.pad_id = int(pad) if pad is not None and pad < target.cfg.vocab_size else self.eos_ids[0]
    self.target_graphdef, self.target_params = nnx.split(target, nnx.Param)
    self.target_cfg = target.cfg
    self.draft_graphdef, self.draft_params = (nnx.split(draft, nnx.Param) if method == "draft"
                                              else (None, None))
    self.mesh = mesh
    self._costs: dict = {}
    self._cost_key = None    # the measured costs the last "auto" generation used
    self._call_s: dict = {}     # "auto": a generate call's fixed seconds (no round), per cost key
    self._plain: dict = {}      # "auto": the AR fallback's step (calibrate.Calibration), per cost key
    self._ar_step_s = None      # ... for the current generation (``calibrate.with_costs``)
    self._prefill_extra: dict = {}   # "auto": seconds the modules add to the prefill, per cost key
    self._extra_prefill_s = 0.0      # ... for the current generation (``calibrate.with_costs``)
    self._ar = None          # "auto"'s plain AR decoder (``_plain_ar``)
    if mesh is None:     # host (numpy) leaves would be copied to the device on every call
      self.target_params, self.draft_params = _on_device((self.target_params, self.draft_params))
    else:
      self.target_params = decode_mesh.place_params(mesh, self.target_params, target.cfg)
      if self.draft_params is not None:
        self.draft_params = decode_mesh.place_params(mesh, self.draft_params, draft.cfg)
    self.spec = programs_lib.ProgramSpec(
        target_graphdef=self.target_graphdef, draft_graphdef=self.draft_graphdef,
        drafter=self.drafter, g=self.G, tree=self.tree, schedule=self.schedule,
        accept_rule=accept_rule, mesh=mesh)
    self.programs = programs_lib.programs(self.spec)      # shared by equal specs

  def auto_record(self) -> dict | None:
    """With "auto": {"prior", "greedy_prior" (per draft position), and
    "round_costs_s": {"B=.., S=.., mode, form": [seconds per round at g =
    0..G_max]}} as the decoder holds them now (measured, then moved by
    every generation; or the fixed ``auto_costs``), "call_s": {same keys:
    a generate call's fixed seconds, ``calibrate.Calibration.call_s``},
    "plain_ar_step_s": {same keys: the AR fallback's step, what
    ``drafting_pays`` compares drafting with}}; None without "auto"."""
    if self.schedule is None:
      return None
    as_list = lambda v: None if v is None else [float(x) for x in np.atleast_1d(v)]
    costs = ({"fixed": as_list(self._fixed_costs)} if self._fixed_costs is not None else
             {", ".join(map(str, k)): as_list(v) for k, v in self._costs.items()})
    return {"prior": as_list(self.schedule.prior),
            "greedy_prior": as_list(self.schedule.greedy_prior), "round_costs_s": costs,
            "call_s": {", ".join(map(str, k)): float(v) for k, v in self._call_s.items()},
            "plain_ar_step_s": {", ".join(map(str, k)): float(v.costs[0])
                                for k, v in self._plain.items()}}

  @property
  def num_draft_tokens(self) -> int | str:
    """G, or "auto"."""
    return "auto" if self.schedule is not None else self.G

  def models(self, params=None, draft_params=None) -> tuple[Transformer, Transformer | None]:
    """(target, draft model or None) merged from parameters (default: the
    decoder's own; traced ones inside jit)."""
    return self.spec.models(self.target_params if params is None else params,
                            self.draft_params if draft_params is None else draft_params)

  # -- traced ------------------------------------------------------------------

  def round(self, params, draft_params, state: DecodeState, sp: SamplingParams,
            g: int | None = None) -> DecodeState:
    """One round for every row at draft length g (static; default G; 0 = an
    AR step; a token tree ignores g). Traced: call it inside ``jax.jit``
    (``ProgramSpec.round``)."""
    return self.spec.round(params, draft_params, state, sp, g)

  # -- host side -----------------------------------------------------------------

  def lowered(self, state: DecodeState, prefill_len: int, sp: SamplingParams):
    """(prefill, generate) as ``jax.stages.Lowered`` for these shapes (read
    their HLO, e.g. to map ops to named scopes: scripts/bench_round.py)."""
    p, dp = self.target_params, self.draft_params
    return (self.programs.prefill.lower(p, dp, state, prefill_len),
            self.programs.generate.lower(p, dp, state, sp))

  def prefill(self, state: DecodeState, prefill_len: int) -> DecodeState:
    """The jitted prefill of ``prepare``'s state (donated)."""
    return self.programs.prefill(self.target_params, self.draft_params, state, prefill_len)

  def prepare(self, prompts: Sequence[np.ndarray], max_new_tokens: int, seed: int,
              stops: StopConditions | None = None, budget: int | None = None):
    """Builds the initial state for a batch of token prompts (BOS included);
    returns (state, prefill_len). ``stops``: stop token ids beside EOS.
    ``budget``: new tokens per row, when fewer than ``max_new_tokens``, which
    still sizes the state (``warm_up``: the same shapes, so the same
    programs, as a generation of ``max_new_tokens``).

    Raises DecodeError for an empty batch, a prompt of no token (one token,
    BOS or not, is enough), a token id outside [0, vocab_size), prompt +
    max_new_tokens beyond the model's max_seq_len, bad stop conditions, or
    (with a mesh) a batch that the ``data`` axis does not divide.
    """
    stops = (stops or StopConditions()).validate(self.target_cfg.vocab_size)
    _check_prompts(prompts, max_new_tokens, self.target_cfg.max_seq_len, self.mesh,
                   self.target_cfg.vocab_size)
    headroom = 2 * self.G + 4 + (self.drafter.depth if isinstance(self.drafter, MTPDrafter) else 0)
    if self.tree is not None:           # the verify block and module calls of a tree
      headroom += self.drafter.scratch_slots
    p_len, cache_len = state_lib.cache_length(max(len(p) for p in prompts), max_new_tokens,
                                              headroom)
    target, draft = self.models()
    b = len(prompts)
    dstate = (None if self.drafter is None else
              self.drafter.init_state(draft if draft is not None else target, b, cache_len))
    stop_ids = stops_lib.stop_id_array(self.eos_ids + tuple(stops.token_ids), b)
    budget = max_new_tokens if budget is None else min(budget, max_new_tokens)
    state = state_lib.init_state(self.target_cfg, prompts, budget, seed, cache_len,
                                 self.G, dstate,
                                 state_lib.init_auto(self.schedule, b) if self.schedule else None,
                                 stop_ids=stop_ids, pad_id=self.pad_id)
    if self.mesh is not None:
      state = decode_mesh.shard_state(self.mesh, state)
    return state, p_len - 1

  def token_bytes(self, token_id: int) -> bytes:
    """The bytes one id stands for in the output (b"" for specials)."""
    return self.tokenizer.decode_bytes([token_id])

  def _result(self, state, emit_times, wall, prefill, stops: StopConditions | None,
              kept=None, max_new_tokens: int = 0) -> Generation:
    """The ``Generation``: rows cut at stop strings, finish reasons, texts;
    ``kept``: the lengths an interrupted stream handed on (rows cut there,
    unfinished rows "interrupted" against ``max_new_tokens``)."""
    gen = state_lib.to_generation(state, emit_times=emit_times, wall=wall, prefill=prefill,
                                  num_draft_tokens=self.G,
                                  tree=None if self.tree is None else self.tree.branching,
                                  kept=kept)
    gen = stops_lib.finish_rows(gen, stops, self.token_bytes, self.eos_ids)
    return stops_lib.mark_interrupted(gen, max_new_tokens)

  def generate(self, prompts, max_new_tokens: int, sampling_params: SamplingParams,
               seed: int = 0, stops: StopConditions | None = None) -> Generation:
    """Whole generation in two jitted calls, the prefill, then every round in
    one ``while_loop`` (throughput form; the prefill is timed apart).
    ``stops``: stop token ids (end a row inside the loop) and stop strings
    (rows cut after the loop; ``decode.stops``).

    Raises DecodeError for bad input (``prepare``, ``SamplingParams.validate``)
    and NonFiniteLogitsError when the target or drafter produced NaN/inf logits.
    """
    sp = sampling_params.validate()
    if not self._drafting_can_pay(sp, max_new_tokens, len(prompts)):
      return self._fallback(self._plain_ar().generate(prompts, max_new_tokens, sampling_params,
                                                      seed, stops))
    state, prefill_len = self.prepare(prompts, max_new_tokens, seed, stops)
    state = calibrate.with_costs(self, state, sp, prompts, max_new_tokens, stops=stops)
    if not self._drafting_pays(state, sp, max_new_tokens):
      del state
      return self._fallback(self._plain_ar().generate(prompts, max_new_tokens, sampling_params,
                                                      seed, stops))
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state = jax.block_until_ready(self.prefill(state, prefill_len))
    t1 = time.perf_counter()
    state = self.programs.generate(self.target_params, self.draft_params, state, sp)
    jax.block_until_ready(state.length)
    gen = self._result(state, None, time.perf_counter() - t0, t1 - t0, stops)
    self._learn_costs(gen)
    return gen

  def sample(self, prompt, num_samples: int, max_new_tokens: int,
             sampling_params: SamplingParams, seed: int = 0,
             stops: StopConditions | None = None) -> Generation:
    """``num_samples`` independent continuations of one prompt in one batch,
    the prompt prefilled once (B = 1) and its state repeated into the batch
    (``state.repeat_row``), then every round in one ``while_loop`` as in
    ``generate``. The rows have the law of ``generate([prompt] *
    num_samples, ...)``'s (each round draws all rows' randomness from one
    key); tokens may differ from it only where the prefill's floating point
    depends on the batch size. For studies of the output law (e.g.
    scripts/losslessness_study.py), where the prefill of B copies of one
    prompt would be most of the work.

    With a mesh, "auto" or num_samples = 1 this is ``generate([prompt] *
    num_samples, ...)``.
    Raises DecodeError for num_samples < 1 and as ``generate``.
    """
    if isinstance(num_samples, bool) or not (isinstance(num_samples, (int, np.integer))
                                             and num_samples >= 1):
      raise DecodeError(f"num_samples={num_samples!r} must be an integer >= 1")
    num_samples = int(num_samples)
    if self.mesh is not None or self.schedule is not None or num_samples == 1:
      return self.generate([prompt] * num_samples, max_new_tokens, sampling_params, seed, stops)
    sp = sampling_params.validate()
    like = jax.eval_shape(lambda: self.prepare([prompt] * num_samples, max_new_tokens, seed,
                                               stops)[0])
    state, prefill_len = self.prepare([prompt], max_new_tokens, seed, stops)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state = jax.block_until_ready(state_lib.repeat_row(self.prefill(state, prefill_len), like))
    t1 = time.perf_counter()
    state = self.programs.generate(self.target_params, self.draft_params, state, sp)
    jax.block_until_ready(state.length)
    return self._result(state, None, time.perf_counter() - t0, t1 - t0, stops)

  def stream(self, prompts, max_new_tokens: int, sampling_params: SamplingParams, seed: int = 0,
             on_tokens: Callable[[int, np.ndarray], None] | None = None,
             stops: StopConditions | None = None,
             on_text: Callable[[int, bytes], None] | None = None, *,
             interruptible: bool = False) -> Generation:
    """Jitted prefill + one jitted round per Python step (streaming form).

    ``on_tokens(row, new_ids)`` is called after each round with each row's
    newly emitted ids, ``on_text(row, new_bytes)`` with its new output text
    (UTF-8 bytes, possibly ending inside a character; bytes that could start
    a stop string are held back until decided). A row whose text reaches a
    stop string is cut after the token completing it and stopped before the
    next round: nothing past a stop is handed on. Emits exactly what
    ``generate`` emits for the same seed (with "auto": given the same
    ``auto_costs``; see the module docstring).

    ``interruptible``: Ctrl-C (and a KeyboardInterrupt raised by a callback)
    during the prefill and rounds ends the generation at a round boundary
    instead of raising (``decode.loops.InterruptFlag``): the result holds
    what was handed on, is marked ``interrupted``, and its unfinished rows'
    finish reason is "interrupted". Compilation and "auto"'s calibration
    come before and stay interruptible the usual way (KeyboardInterrupt).
    """
    return self._stream(prompts, max_new_tokens, sampling_params, seed, on_tokens, stops,
                        on_text, interruptible=interruptible)

  def warm_up(self, prompts, max_new_tokens: int, sampling_params: SamplingParams,
              seed: int = 0, stops: StopConditions | None = None) -> Generation:
    """Compiles what ``stream`` of these prompts, budget, sampling mode and
    stops runs, so that its timings exclude compilation, at the cost of
    ``WARMUP_TOKENS`` tokens per row: ``stream`` itself on a state sized for
    ``max_new_tokens`` (the same cache length, hence the same programs: the
    prompt bucket and cache are rounded up to ``state.PROMPT_BUCKET``) whose
    rows stop after ``WARMUP_TOKENS``. That runs the prefill and a round
    (with "auto": the first segment's choice, and the calibration, which
    compiles every draft length's round, if this batch shape has no costs
    yet; or the plain AR fallback's prefill and round where drafting would
    not pay, decided for ``max_new_tokens``), then the program that cuts
    rows at a stop string when ``stops`` has strings. Nothing is learnt from
    it (round costs, the AR step). Returns its ``Generation``."""
    return self._stream(prompts, max_new_tokens, sampling_params, seed, None, stops, None,
                        budget=WARMUP_TOKENS)

  def _stream(self, prompts, max_new_tokens, sampling_params, seed, on_tokens, stops, on_text, *,
              budget: int | None = None, interruptible: bool = False) -> Generation:
    """``stream``; with ``budget`` its warm-up (``warm_up``)."""
    sp = sampling_params.validate()
    warm = budget is not None
    if not self._drafting_can_pay(sp, max_new_tokens, len(prompts)):
      return self._fallback(self._plain_ar()._stream(
          prompts, max_new_tokens, sampling_params, seed, on_tokens, stops, on_text,
          budget=budget, interruptible=interruptible), learn=not warm)
    state, prefill_len = self.prepare(prompts, max_new_tokens, seed, stops, budget)
    strings = () if stops is None else tuple(stops.strings)
    state = calibrate.with_costs(self, state, sp, prompts, max_new_tokens, form="stream",
                                 stops=stops)
    if not self._drafting_pays(state, sp, max_new_tokens):
      del state
      return self._fallback(self._plain_ar()._stream(
          prompts, max_new_tokens, sampling_params, seed, on_tokens, stops, on_text,
          budget=budget, interruptible=interruptible), learn=not warm)
    jax.block_until_ready(state)
    step = lambda s, g: self.programs.round(self.target_params, self.draft_params, s, sp, g)
    watch = stops_lib.StreamStops(strings, self.token_bytes, len(prompts), on_tokens, on_text)
    with (loops.InterruptFlag() if interruptible else contextlib.nullcontext()) as interrupt:
      t0 = time.perf_counter()
      state = jax.block_until_ready(self.prefill(state, prefill_len))   # else: dispatch time only
      prefill = time.perf_counter() - t0
      state, emit_times, kept = loops.stream_rounds(
          step, state, max_new_tokens if budget is None else min(budget, max_new_tokens), t0=t0,
          on_new=watch.on_new if watch.needed else None, stop_rows=self._stop_rows,
          choose_fn=self.programs.choose if self.schedule is not None else None,
          interrupt=interrupt)
    try:
      watch.flush()
    except KeyboardInterrupt:     # the callback that ended the loop, raising again
      if kept is None:
        raise
    wall = time.perf_counter() - t0
    if warm:
      state = self._warm_extras(state, step, strings)
    gen = self._result(state, emit_times, wall, prefill, stops, kept, max_new_tokens)
    if not (warm or gen.interrupted):
      self._learn_costs(gen)
    return gen

  def _stop_rows(self, state, lengths: np.ndarray, mask: np.ndarray):
    """The jitted ``stop_rows`` as the stream calls it (host arrays in)."""
    return self.programs.stop_rows(state, jnp.asarray(lengths), jnp.asarray(mask))

  def _warm_extras(self, state, step, strings):
    """After a warm-up's round: the stop-string cut (a no-op mask) when
    there are stop strings, and with fixed ``auto_costs`` (no calibration
    ran to compile them) every draft length's round. Returns the state."""
    if strings:
      b = state.length.shape[0]
      state = self._stop_rows(state, np.asarray(jax.device_get(state.length)), np.zeros(b, bool))
    if self.schedule is not None and self._fixed_costs is not None:
      for g in range(self.G + 1):
        state = step(state, g)
    return jax.block_until_ready(state)

  # -- "auto" when drafting is not expected to pay -------------------------------------

  def _drafting_pays(self, state, sp: SamplingParams, max_new_tokens: int) -> bool:
    """True without "auto"; with it, ``AutoSchedule.drafting_pays`` at the
    costs ``calibrate.with_costs`` put into ``state``, the token budget, the
    batch size and the modules' prefill as measured with the costs."""
    if self.schedule is None:
      return True
    costs = np.asarray(jax.device_get(state.auto.schedule["costs"]), np.float64)
    return self.schedule.drafting_pays(costs, sp.greedy, max_new_tokens, self._extra_prefill_s,
                                       batch=int(state.tokens.shape[0]),
                                       ar_step_s=self._ar_step_s)

  def _learn_costs(self, gen: Generation) -> None:
    """``calibrate.learn_costs`` from ``gen`` for the costs it was decided with."""
    calibrate.learn_costs(self._costs, self._cost_key, gen, self._call_s.get(self._cost_key, 0.0))

  def _fallback(self, gen: Generation, learn: bool = True) -> Generation:
    """The AR fallback's result in "auto"'s shape (``_as_auto``); its
    decoding time moves the plain AR step's cost (``calibrate.learn_ar_step``;
    not "auto"'s own AR round, a different program), as a drafting
    generation's moves its g's, so a calibration that put the AR step too
    high or too low is corrected by the generations it decides (not a
    warm-up's, ``learn`` False, nor an interrupted one's)."""
    if learn and not gen.interrupted:
      calibrate.learn_ar_step(self._plain, self._cost_key, gen)
    return self._as_auto(gen)

  def _drafting_can_pay(self, sp: SamplingParams, max_new_tokens: int, batch: int) -> bool:
    """False when "auto" (its costs to be measured) cannot draft profitably
    whatever the round costs turn out to be (``AutoSchedule.drafting_can_pay``:
    at the prior, the batch's slowest row needs as many rounds as AR): then
    nothing is calibrated or compiled for drafting and the generation is the
    plain AR decoder's, the decision the measured costs would have led to.
    True otherwise (and without "auto", or with fixed ``auto_costs``,
    whose own ``drafting_pays`` decides)."""
    if self.schedule is None or self._fixed_costs is not None:
      return True
    if self.schedule.drafting_can_pay(sp.greedy, max_new_tokens, batch):
      return True
    self._cost_key, self._ar_step_s, self._extra_prefill_s = None, None, 0.0
    return False

  def _plain_ar(self) -> "Decoder":
    """The AR decoder an "auto" generation falls back to (same target
    parameters, tokenizer and mesh; built once)."""
    if self._ar is None:
      self._ar = Decoder(self.models()[0], "ar", mesh=self.mesh, tokenizer=self.tokenizer)
    return self._ar

  def _as_auto(self, gen: Generation) -> Generation:
    """An AR fallback's ``Generation`` in "auto"'s shape: G_max, every round
    an AR step (draft length 0, 0 accepted), no draft position tested."""
    b, g = len(gen.tokens), self.G
    rounds = np.asarray(gen.target_calls, np.int64)
    hist = np.zeros((b, g + 1), np.int64)
    hist[:, 0] = rounds
    zeros = np.zeros((b, g), np.int64)
    return dataclasses.replace(gen, num_draft_tokens=g, accepted_histogram=hist,
                               draft_length_histogram=hist.copy(), position_tested=zeros,
                               position_accepted=zeros.copy())


def _on_device(tree):
  """``tree`` with its numpy leaves moved to the default device (jax arrays
  are left where they are). A jitted function copies a numpy argument to the
  device on every call: for a stream round of SmolLM2 that was 540 MB of
  weights, 100 ms, per round."""
  return jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, tree)


def _check_prompts(prompts, max_new_tokens, max_len: int, mesh, vocab_size: int | None = None) -> None:
  """``Decoder.prepare``'s input checks (DecodeError naming the field)."""
  if not prompts:
    raise DecodeError("no prompts given")
  if mesh is not None and len(prompts) % mesh.shape["data"]:
    raise DecodeError(f"{len(prompts)} prompts cannot be split over the mesh's data axis of size "
                      f"{mesh.shape['data']}: give a multiple of it")
  if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
    raise DecodeError(f"--max_new_tokens={max_new_tokens!r} must be an integer >= 1")
  for i, p in enumerate(prompts):
    if len(p) < 1:
      raise DecodeError(f"prompt {i} has no token as encoded: give at least 1")
    if vocab_size is not None and len(p) and (np.min(p) < 0 or np.max(p) >= vocab_size):
      bad = int(np.asarray(p)[(np.asarray(p) < 0) | (np.asarray(p) >= vocab_size)][0])
      raise DecodeError(f"prompt {i} holds token id {bad}, outside the model's vocabulary "
                        f"[0, {vocab_size})")
    if len(p) + max_new_tokens > max_len:
      room = max_len - len(p)
      raise DecodeError(
          f"prompt {i} has {len(p)} tokens as encoded (BOS included where the tokenizer adds "
          f"one); with --max_new_tokens={max_new_tokens} it "
          f"exceeds the model's max_seq_len={max_len}"
          + (f" (at most {room} new tokens fit)" if room > 0 else
             f" (no room left to generate: with this --max_new_tokens a prompt may have at most "
             f"{max_len - max_new_tokens} tokens as encoded)"
             if max_len - max_new_tokens >= 1 else
             f" (--max_new_tokens must be at most {max_len - 1} to leave room for a prompt)"))
