"""KV-cached decoding, AR or speculative with an MTP or draft-model drafter:
``Decoder.stream`` (one jitted round per Python step: streaming, per-token
timing, early stop) and ``Decoder.generate`` (every round in one
``lax.while_loop``). Both run the same round, so they emit identical tokens
for a seed ("auto": given the same ``auto_costs``). Here: the method rules
(``resolve_method``) and the ``Decoder``; the other modules are listed in
docs/design.md section 2. Non-finite logits stop the row in the round that
produced them; the host then raises ``NonFiniteLogitsError``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from decode import acceptance, kv_cache, loops, stops as stops_lib
from decode.auto import calibrate
from decode import mesh as decode_mesh
from decode import compiled
from decode import state as state_lib
from decode import tree as tree_lib
from decode.drafters import Drafter, DraftModelDrafter, MTPDrafter
from decode.errors import DecodeError, NonFiniteLogitsError  # noqa: F401 (the API's errors)
from decode.limits import MAX_DRAFT_TOKENS, METHODS, check_flags  # noqa: F401 (the API)
from decode.sampling import SamplingParams
from decode.auto.schedule import AutoSchedule
from decode.state import DecodeState, Generation
from decode.stops import StopConditions
from decode.tree_spec import TreeSpec
from mtp import tokenizer as tok
from mtp.model import Transformer

WARMUP_TOKENS = 1            # tokens per row of ``Decoder.warm_up``


def _mtp_depth_check(target: Transformer, flag: str = "--method=mtp") -> None:
  if target.mtp_depth < 1:
    raise DecodeError(f"{flag} needs a checkpoint trained with mtp.depth >= 1; this one has "
                      "D = 0 (use --method=ar or --method=draft)")


@dataclasses.dataclass(frozen=True)
class Method:
  """A decoder's validated settings (``resolve_method``)."""
  num_draft_tokens: int                 # the chain's G (fixed) or G_max ("auto"); 0 for AR
                                        #   and for a tree
  drafter: Drafter | None = None        # decode.drafters / decode.tree; None for AR
  schedule: AutoSchedule | None = None  # "auto"'s schedule, else None
  tree: TreeSpec | None = None          # a token tree, else None
  fixed_costs: np.ndarray | None = None   # "auto"'s given round costs [G_max+1] float64 s
  tree_depth: int = 0                   # m, the depth of ``tree``; 0 for a chain

  @property
  def longest_draft(self) -> int:
    """The most draft tokens a round verifies along one path: G, G_max or
    the tree depth m (what sizes the cache headroom and the programs)."""
    return self.tree_depth if self.tree is not None else self.num_draft_tokens


def resolve_method(target: Transformer, method: str, num_draft_tokens, draft, *,
                   max_draft_tokens=None, schedule=None, auto_costs=None, tree=None) -> Method:
  """Validates a ``Decoder``'s method settings against the target (MTP
  depth D) and draft model; returns the ``Method``. method: "ar", "mtp" or
  "draft" (``draft`` sharing the vocabulary); num_draft_tokens: G in [1,
  MAX_DRAFT_TOKENS], or "auto" ("mtp" only; g in 0..G_max, G_max =
  ``max_draft_tokens`` or D; ``schedule``, ``auto_costs`` seconds per round
  for g = 0..G_max); tree: "mtp" branching per depth ((3, 2, 1) or "3,2,1",
  depth m in [1, D]), None for a chain. Raises DecodeError, one line naming
  the flag and the allowed range.
  """
  check_flags(method, num_draft_tokens, tree)
  if tree is not None:                  # token trees: decode/tree.py
    _mtp_depth_check(target, "--tree")
    if num_draft_tokens == "auto":
      raise DecodeError("--tree and --num_draft_tokens=auto exclude each other: a tree has a "
                        "fixed shape (its depth takes the place of the draft length)")
    try:
      spec = tree_lib.parse_tree(tree, target.mtp_depth)
    except ValueError as e:
      raise DecodeError(str(e)) from None
    return Method(0, tree_lib.TreeMTPDrafter(spec, target.mtp_depth), tree=spec,
                  tree_depth=spec.depth)
  if method == "ar":
    return Method(0)
  if num_draft_tokens == "auto":
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
    return Method(g_max, MTPDrafter(target.mtp_depth, g_max, variable=True), schedule,
                  fixed_costs=costs)
  if not (isinstance(num_draft_tokens, int) and not isinstance(num_draft_tokens, bool)
          and 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS):
    raise DecodeError(f"--num_draft_tokens={num_draft_tokens!r} must be an integer in "
                      f"[1, {MAX_DRAFT_TOKENS}] or 'auto'")
  if method == "mtp":
    _mtp_depth_check(target)
    return Method(num_draft_tokens, MTPDrafter(target.mtp_depth, num_draft_tokens))
  if draft is None:
    raise DecodeError("--method=draft needs a draft model (--draft_workdir)")
  if draft.cfg.vocab_size != target.cfg.vocab_size:
    raise DecodeError(f"--draft_workdir model has vocab_size {draft.cfg.vocab_size}, the target "
                      f"has {target.cfg.vocab_size}: draft and target must share the vocabulary")
  return Method(num_draft_tokens, DraftModelDrafter())


def _tokenizer_ids(cfg, tokenizer):
  """(tokenizer, stop ids ending a row, the id that pads the token buffer:
  the tokenizer's PAD inside the vocabulary, else its first stop id).
  Raises DecodeError for a BPE model without its tokenizer."""
  if tokenizer is None and cfg.tokenizer != "byte":
    raise DecodeError(f"a model with model.tokenizer={cfg.tokenizer!r} needs its "
                      "tokenizer: Decoder(..., tokenizer=mtp.tokenizer.load_tokenizer(workdir))")
  tokenizer = tokenizer or tok.ByteTokenizer()
  eos_ids = tuple(int(i) for i in tokenizer.stop_ids)
  pad = tokenizer.pad_id
  return tokenizer, eos_ids, int(pad) if pad is not None and pad < cfg.vocab_size else eos_ids[0]


class Decoder:
  """Batched KV-cached decoder for one target ``Transformer`` and one method
  (method .. tree: ``resolve_method``). mesh: a ``jax.sharding.Mesh``
  (parameters sharded as in training, rows over ``data``) or None; drafter:
  replaces the method's own; accept_rule(params, g) -> the chain's rule;
  tokenizer: required for a BPE model (default bytes), its stop ids end a
  row. Raises DecodeError (``resolve_method``; BPE without its tokenizer),
  ConfigError (mesh axes that do not divide the model).
  """

  def __init__(self, target: Transformer, method: str = "mtp", num_draft_tokens: int | str = 2,
               draft: Transformer | None = None, mesh=None, *, max_draft_tokens: int | None = None,
               schedule: AutoSchedule | None = None, auto_costs=None, tree=None, drafter=None,
               accept_rule=acceptance.chain_rule, tokenizer=None):
    m = resolve_method(target, method, num_draft_tokens, draft, max_draft_tokens=max_draft_tokens,
                       schedule=schedule, auto_costs=auto_costs, tree=tree)
    self.method, self.schedule, self.tree = method, m.schedule, m.tree
    # the longest draft of a round: G; G_max with "auto"; the depth m with a tree
    self.longest_draft = m.longest_draft
    self.drafter = drafter or m.drafter
    self.accept_rule = accept_rule
    self.tokenizer, self.eos_ids, self.pad_id = _tokenizer_ids(target.cfg, tokenizer)
    self.target_graphdef, self.target_params = nnx.split(target, nnx.Param)
    self.target_cfg = target.cfg
    self.draft_graphdef, self.draft_params = (nnx.split(draft, nnx.Param) if method == "draft"
                                              else (None, None))
    self.mesh = mesh
    # "auto"'s costs (decode.auto.calibrate); None for AR, a fixed G or a tree
    self.calibration = (calibrate.AutoCalibration(m.fixed_costs) if m.schedule is not None
                        else None)
    self._ar = None          # the plain AR decoder "auto" falls back to (``plain_ar``)
    self._models = None      # (params, draft params, (target, draft) merged from them)
    self.target_params, self.draft_params = compiled.place_params(
        mesh, self.target_params, self.draft_params, target.cfg,
        None if draft is None else draft.cfg)
    self.spec = compiled.ProgramSpec(
        target_graphdef=self.target_graphdef, draft_graphdef=self.draft_graphdef,
        drafter=self.drafter, longest_draft=self.longest_draft, tree=self.tree,
        schedule=self.schedule, accept_rule=accept_rule, mesh=mesh)
    self.programs = compiled.programs(self.spec)      # shared by equal specs

  def auto_record(self) -> dict | None:
    """"auto"'s prior and costs as held now (``AutoCalibration.record``);
    None without "auto"."""
    return None if self.schedule is None else self.calibration.record(self.schedule)

  @property
  def num_draft_tokens(self) -> int | str:
    """G, or "auto"."""
    return "auto" if self.schedule is not None else self.longest_draft

  def models(self, params=None, draft_params=None) -> tuple[Transformer, Transformer | None]:
    """(target, draft model or None) merged from parameters (default: the
    decoder's own; traced ones inside jit)."""
    if params is None and draft_params is None:     # merged once per parameters: a merge walks every module
      p, dp = self.target_params, self.draft_params
      if self._models is None or self._models[0] is not p or self._models[1] is not dp:
        self._models = (p, dp, self.spec.models(p, dp))
      return self._models[2]
    return self.spec.models(self.target_params if params is None else params,
                            self.draft_params if draft_params is None else draft_params)

  def plain_ar(self) -> "Decoder":
    """The AR decoder an "auto" generation falls back to (same target
    parameters, tokenizer and mesh; built once)."""
    if self._ar is None:
      self._ar = Decoder(self.models()[0], "ar", mesh=self.mesh, tokenizer=self.tokenizer)
    return self._ar

  def round(self, params, draft_params, state: DecodeState, sp: SamplingParams,
            g: int | None = None) -> DecodeState:
    """One round for every row at draft length g (static; default G; 0 = an
    AR step; a token tree ignores g). Traced: call it inside ``jax.jit``."""
    return self.spec.round(params, draft_params, sp, state, g)

  def lowered(self, state: DecodeState, prefill_len: int, sp: SamplingParams):
    """(prefill, generate) as ``jax.stages.Lowered`` for these shapes (to
    read their HLO)."""
    p, dp = self.target_params, self.draft_params
    return (self.programs.prefill.lower(p, dp, state, prefill_len),
            self.programs.generate.lower(p, dp, sp, compiled.ALL_ROUNDS, state))

  def prefill(self, state: DecodeState, prefill_len: int) -> DecodeState:
    """The jitted prefill of ``prepare``'s state (donated)."""
    return self.programs.prefill(self.target_params, self.draft_params, state, prefill_len)

  def prepare(self, prompts: Sequence[np.ndarray], max_new_tokens: int, seed: int,
              stops: StopConditions | None = None, budget: int | None = None):
    """(initial state, prefill_len) for a batch of token prompts (BOS
    included); ``stops``: stop ids beside EOS; ``budget``: new tokens per
    row below ``max_new_tokens`` (which still sizes the state). Raises
    DecodeError for bad prompts or stops."""
    stops = (stops or StopConditions()).validate(self.target_cfg.vocab_size)
    self.check_prompts(prompts, max_new_tokens)
    p_len, cache_len = self._lengths(prompts, max_new_tokens)
    target, draft = self.models()
    b = len(prompts)
    dstate = (None if self.drafter is None else
              self.drafter.init_state(draft if draft is not None else target, b, cache_len))
    stop_ids = stops_lib.stop_id_array(self.eos_ids + tuple(stops.token_ids), b)
    budget = max_new_tokens if budget is None else min(budget, max_new_tokens)
    state = state_lib.init_state(self.target_cfg, prompts, budget, seed, cache_len,
                                 self.longest_draft, dstate,
                                 state_lib.init_auto(self.schedule, b) if self.schedule else None,
                                 stop_ids=stop_ids, pad_id=self.pad_id)
    if self.mesh is not None:
      state = decode_mesh.shard_state(self.mesh, state)
    return state, p_len - 1

  def check_prompts(self, prompts, max_new_tokens: int) -> None:
    """``state.check_prompts`` for this target (ids in the vocabulary, prompt
    + ``max_new_tokens`` within max_seq_len, rows fit the mesh). Raises
    DecodeError."""
    state_lib.check_prompts(prompts, max_new_tokens, self.target_cfg.max_seq_len, self.mesh,
                            self.target_cfg.vocab_size)

  def _lengths(self, prompts, max_new_tokens: int) -> tuple[int, int]:
    """(padded prompt length, cache length) of ``prepare``'s state
    (``decode.kv_cache.cache_length`` with this decoder's headroom)."""
    headroom = kv_cache.headroom(
        self.longest_draft, self.drafter.depth if isinstance(self.drafter, MTPDrafter) else 0,
        self.drafter.scratch_slots if self.tree is not None else 0)
    return kv_cache.cache_length(max(len(p) for p in prompts), max_new_tokens, headroom)

  def cache_length(self, prompts, max_new_tokens: int) -> int:
    """Positions per row of the KV cache ``prepare`` allocates for
    ``prompts`` and ``max_new_tokens`` (its state's ``tokens.shape[1]``)."""
    return self._lengths(prompts, max_new_tokens)[1]

  def token_bytes(self, token_id: int) -> bytes:
    """The bytes one id stands for in the output (b"" for specials)."""
    return self.tokenizer.decode_bytes([token_id])

  def generate(self, prompts, max_new_tokens: int, sampling_params: SamplingParams,
               seed: int = 0, stops: StopConditions | None = None) -> Generation:
    """The prefill, then every round in one jitted ``while_loop`` (the
    throughput form); stop ids end a row in the loop, stop strings cut it
    after. Raises DecodeError for bad input (``prepare``, ``SamplingParams``),
    NonFiniteLogitsError when the target or drafter gave NaN/inf logits."""
    sp = sampling_params.validate()
    started = self._start(prompts, max_new_tokens, sp, seed, stops, "while")
    if started is None:
      return self.calibration.fallback(self.plain_ar().generate(
          prompts, max_new_tokens, sampling_params, seed, stops), self.longest_draft)
    state, wall, prefill = loops.timed_generate(self.prefill, self.rounds_program(sp), *started)
    gen = self._result(state, None, wall, prefill, stops)
    if self.calibration is not None:
      self.calibration.learn(gen)
    return gen

  def sample(self, prompt, num_samples: int, max_new_tokens: int,
             sampling_params: SamplingParams, seed: int = 0,
             stops: StopConditions | None = None) -> Generation:
    """``num_samples`` continuations of one prompt, prefilled once and
    repeated into the batch: the law of ``generate([prompt] * num_samples,
    ...)``. Raises DecodeError for num_samples < 1 and as ``generate``."""
    if isinstance(num_samples, bool) or not (isinstance(num_samples, (int, np.integer))
                                             and num_samples >= 1):
      raise DecodeError(f"num_samples={num_samples!r} must be an integer >= 1")
    num_samples = int(num_samples)
    if self.mesh is not None or self.schedule is not None or num_samples == 1:
      return self.generate([prompt] * num_samples, max_new_tokens, sampling_params, seed, stops)
    sp = sampling_params.validate()
    like = jax.eval_shape(lambda: self.prepare([prompt] * num_samples, max_new_tokens, seed,
                                               stops)[0])
    state, wall, prefill = loops.timed_generate(
        self.prefill, self.rounds_program(sp),
        *self.prepare([prompt], max_new_tokens, seed, stops), like)
    return self._result(state, None, wall, prefill, stops)

  def stream(self, prompts, max_new_tokens: int, sampling_params: SamplingParams, seed: int = 0,
             on_tokens: Callable[[int, np.ndarray], None] | None = None,
             stops: StopConditions | None = None,
             on_text: Callable[[int, bytes], None] | None = None, *,
             interruptible: bool = False, budget: int | None = None) -> Generation:
    """The jitted prefill, then one jitted round per Python step: what
    ``generate`` emits for the seed. Per round ``on_tokens(row, new_ids)``
    and ``on_text(row, new_bytes)`` (bytes that may start a stop string held
    back). ``interruptible``: Ctrl-C ends it at a round boundary (result
    ``interrupted``). ``budget``: at most that many new tokens per row on a
    state sized for ``max_new_tokens`` (``warm_up``). Raises as ``generate``."""
    sp = sampling_params.validate()
    warm = budget is not None
    started = self._start(prompts, max_new_tokens, sp, seed, stops, "stream", budget)
    if started is None:
      return self.calibration.fallback(self.plain_ar().stream(
          prompts, max_new_tokens, sampling_params, seed, on_tokens, stops, on_text,
          interruptible=interruptible, budget=budget), self.longest_draft, learn=not warm)
    state, prefill_len = started
    strings = () if stops is None else tuple(stops.strings)
    step = self.rounds_program(sp, round_limit=1)
    watch = stops_lib.StreamStops(strings, self.token_bytes, len(prompts), on_tokens, on_text)
    jax.block_until_ready(state)
    state, emit_times, kept, wall, prefill = loops.stream_rounds(
        step, state, max_new_tokens if budget is None else min(budget, max_new_tokens),
        prefill_fn=self.prefill, prefill_len=prefill_len, watch=watch,
        stop_rows=self.programs.stop_rows_host, interruptible=interruptible)
    if warm:
      state = loops.warm_extras(state, self.programs.stop_rows_host, bool(strings))
    gen = self._result(state, emit_times, wall, prefill, stops, kept, max_new_tokens)
    if self.calibration is not None and not (warm or gen.interrupted):
      self.calibration.learn(gen)
    return gen

  def warm_up(self, prompts, max_new_tokens: int, sampling_params: SamplingParams,
              seed: int = 0, stops: StopConditions | None = None) -> Generation:
    """Compiles what ``stream`` of these shapes, sampling mode and stops
    runs: ``stream`` with a budget of ``WARMUP_TOKENS`` per row on a state
    sized for ``max_new_tokens``, the stop-string cut, "auto"'s calibration
    (or its AR fallback's programs). Learns nothing; returns its ``Generation``."""
    return self.stream(prompts, max_new_tokens, sampling_params, seed, stops=stops,
                       budget=WARMUP_TOKENS)

  def _start(self, prompts, max_new_tokens, sp, seed, stops, form, budget=None):
    """(state, prefill_len) from ``prepare``; "auto" alone goes through
    ``calibrate.start`` (costs, or None for its plain AR fallback): a fixed
    G or AR never calibrates."""
    if self.schedule is None:
      return self.prepare(prompts, max_new_tokens, seed, stops, budget)
    return calibrate.start(self, prompts, max_new_tokens, sp, seed, stops, form, budget)

  def rounds_program(self, sp, round_limit: int = compiled.ALL_ROUNDS):
    """The jitted while_loop of rounds (at most ``round_limit`` per call) as
    a function of the state."""
    return functools.partial(self.programs.generate, self.target_params, self.draft_params, sp,
                             round_limit)

  def _result(self, state, emit_times, wall, prefill, stops: StopConditions | None,
              kept=None, max_new_tokens: int = 0) -> Generation:
    """``state.finish``'s ``Generation`` for this decoder's G, tree and tokenizer."""
    return state_lib.finish(state, emit_times, wall, prefill, stops, self.longest_draft, self.tree,
                            self.token_bytes, self.eos_ids, kept, max_new_tokens)
