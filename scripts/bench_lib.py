r"""The decoding benchmarks' shared library: AR vs speculative cells side by
side, the bare target forward, the drafting step alone, the draft cost
ratio c (measured and as a FLOP share), and the whole benchmarks built from
them.

Used by scripts/bench_decode.py, bench_chat.py, bench_hf.py and
device_check.py, and by the experiments (experiments/sweep_decode.py,
compare_drafters.py, bench_draft_cost.py, ablate_mtp.py, distill_mtp.py,
losslessness_study.py, sweep_draft_vocab.py), which keep the grids only
they run beside their mains. Every timing goes through
``mtp.timing.interleaved_times`` (compile first, then interleaved
repeats, median). The drafting-step and FLOP probes use the decoder's
public pieces (``Decoder.prefill``, ``Decoder.models``, its ``drafter``).
``measure_point(..., baselines=)`` times decoders outside this project
(``Baseline``: transformers, llama.cpp; ``scripts/baseline_decoders.py``)
in the same interleaved rounds and compares their tokens with AR's.

Sections: the pieces (one target forward with a KV cache,
``bare_forward_s``; one drafting step alone, ``draft_time_s``; the drafting
step's share of the round's FLOPs, ``draft_flop_share``: the inputs of c);
cells side by side (``measure_point``); the whole benchmark of
scripts/bench_decode.py (settings as ``DecodeBench``; AR, MTP chains,
``auto``, trees and a draft model, per batch size and temperature, with
the bare target forward beside them) and its tree-vs-chain comparison.

Terms (docs/design.md section 7): a *cell* is one decoder (method, G or
tree) in one form ("while": one jitted while_loop; "stream": one jitted
round per step); tau = tokens per target call; c = drafting time per
draft token / one AR step of the decoding phase; ideal speedup = Leviathan
et al. 2023, Theorem 3.8.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from decode import sampling
from decode.cli import theory
from decode.cli import stats as stats_lib
from decode.decoder import Decoder, SamplingParams
from decode.tree_spec import TreeSpec
from mtp import tokenizer as tok
from mtp.model import init_layer_caches
from mtp.timing import interleaved_times, spread, xla_flops


# -- the pieces: the bare target forward, one drafting step, the drafting step's FLOP share --
#    (the inputs of the draft cost ratio c, Leviathan et al. 2023, Theorem 3.8)

def encode_prompts(prompts) -> list:
  """Prompt rows for a Decoder: a text is encoded with the byte tokenizer
  (BOS first; the byte models' benchmarks), a sequence of ids (already
  encoded with the model's tokenizer, e.g. a chat-template prompt of a BPE
  target: ``scripts.bench_chat``) is used as is."""
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
    return decoder.drafter.draft(model, dstate, tokens, n, key, sp, decoder.longest_draft)
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
  return d / (decoder.longest_draft * f) if f else float("nan")


# -- cells: decoders side by side ---------------------------------------------------------

@dataclasses.dataclass
class Cell:
  """One decoder in one form, and what its timed repeats produced."""
  name: str
  method: str
  g: int | str           # G, "auto", or the tree depth m
  form: str              # "while" or "stream"
  decoder: Decoder
  tree: tuple | None = None
  walls: list = dataclasses.field(default_factory=list)
  decode_walls: list = dataclasses.field(default_factory=list)   # wall - prefill
  gens: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Baseline:
  """A decoder outside this project (transformers' ``generate``, llama.cpp;
  ``scripts.baseline_decoders``) timed in the same interleaved rounds as the
  cells: ``fn(prompt, max_new)`` takes one prompt's ids (int32 [P]) and
  returns its new ids (int [n], n <= max_new, a stop id included when
  emitted), blocking until done. ``walls`` (seconds per call, measured
  around ``fn``) and ``tokens`` grow by one per repeat."""
  name: str
  fn: object
  walls: list = dataclasses.field(default_factory=list)
  tokens: list = dataclasses.field(default_factory=list)


def first_divergence(a: np.ndarray, b: np.ndarray) -> int | None:
  """The first column where the token rows of ``a`` and ``b`` ([B, n])
  differ, or None when they are identical."""
  if a.shape == b.shape and np.array_equal(a, b):
    return None
  n = min(a.shape[1], b.shape[1])
  diff = (a[:, :n] != b[:, :n]).any(0)
  return int(np.argmax(diff)) if diff.any() else n


def run_cells(cells: list[Cell], prompts, batch: int, max_new: int, sp: SamplingParams,
              repeats: int, baselines: list[Baseline] = ()) -> None:
  """Decodes ``repeats`` rounds with every cell, interleaved
  (``interleaved_times``), appending each call's wall time, decoding-phase
  wall time (wall - prefill) and ``Generation`` to the cell. Repeat r
  decodes prompts[r*batch .. r*batch+batch-1] (cycling) with seed r in every
  cell, so all cells see the same prompts and the sample grows with the
  repeats; before the rounds every prompt-length bucket the repeats will
  hit is compiled (untimed). Times are the decoder's own (``wall_time_s``,
  ``prefill_time_s``). ``baselines`` (B = 1 only) decode the same prompt
  in the same rounds (one untimed warm-up call per bucket first); their
  times are ``interleaved_times``' own.

  Raises ValueError for baselines at a batch other than 1."""
  if baselines and batch != 1:
    raise ValueError(f"baselines decode one prompt per call (B = 1), got batch {batch}")
  encoded = encode_prompts(prompts)
  rows = lambda r: [encoded[(r * batch + i) % len(encoded)] for i in range(batch)]
  call = lambda c, r: (c.decoder.generate if c.form == "while" else c.decoder.stream)(
      rows(r), max_new, sp, seed=r)
  # compile every prompt-length bucket that the repeats will hit
  bucket = lambda r: -(-max(len(x) for x in rows(r)) // 64)
  warm = {bucket(r): r for r in range(repeats)}.values()
  for c in cells:
    for r in warm:
      call(c, r)
  for b in baselines:
    for r in warm:
      b.fn(rows(r)[0], max_new)

  def timed(c: Cell):
    def one_repeat():            # the cell's r-th call decodes repeat r
      gen = call(c, len(c.gens))
      c.walls.append(gen.wall_time_s)
      c.decode_walls.append(gen.wall_time_s - gen.prefill_time_s)
      c.gens.append(gen)
    return one_repeat

  def timed_baseline(b: Baseline):
    def one_repeat():
      b.tokens.append(np.asarray(b.fn(rows(len(b.tokens))[0], max_new)).reshape(-1))
    return one_repeat
  fns = {str(i): timed(c) for i, c in enumerate(cells)}
  fns.update({f"baseline:{b.name}": timed_baseline(b) for b in baselines})
  times = interleaved_times(fns, repeats, warmup=0)
  for b in baselines:
    b.walls.extend(float(t) for t in times[f"baseline:{b.name}"])


def _median(values) -> float:
  return spread(values, ("median",))["median"]


def round_s(c: Cell) -> float:
  """Median seconds per round of the decoding phase (one target call for
  the whole batch) over the cell's repeats."""
  return _median([d / int(g.target_calls.max()) for d, g in zip(c.decode_walls, c.gens)])


def mean_tokens(c: Cell) -> float:
  """Tokens a repeat of the cell emitted, averaged over its repeats."""
  return sum(sum(len(t) for t in g.tokens) for g in c.gens) / len(c.gens)


def summarize_cell(c: Cell, ar_rate: float, ar_decode_rate: float, ar_step_s: float,
                   draft_s: float | None) -> dict:
  """Row of the table. ``ar_rate`` / ``ar_decode_rate``: the AR cell's
  tokens/s end to end / in the decoding phase (mean tokens over the median
  wall, same form); the speedups are ratios of these rates, which equal
  ratios of wall times when both emit the same tokens (T = 0) and stay
  right when sampled outputs end (EOS) at other lengths. ``ar_step_s``: one
  AR step of the decoding phase (one target call) in the while_loop form,
  the "target step" of the cost ratio c."""
  hist = sum(g.accepted_histogram.sum(0) for g in c.gens)
  calls = int(sum(g.target_calls.sum() for g in c.gens))
  auto = c.g == "auto"
  tokens = mean_tokens(c)
  wall = _median(c.walls)
  decode = _median(c.decode_walls)
  tau = float((hist * (np.arange(len(hist)) + 1)).sum() / calls)
  row = {"name": c.name, "method": c.method, "num_draft_tokens": c.g, "form": c.form,
         **spread(c.walls, ("median", "min", "max"), "wall_s_"),
         "decode_s_median": decode,
         "prefill_s_median": _median([g.prefill_time_s for g in c.gens]),
         "tokens_per_s": tokens / wall, "decode_tokens_per_s": tokens / decode,
         "speedup": tokens / wall / ar_rate, "speedup_decode": tokens / decode / ar_decode_rate,
         "tau": tau,
         "acceptance_rate_per_position": stats_lib.acceptance_rates(hist),
         "accepted_length_histogram": [int(x) for x in hist]}
  if auto:      # G varies by round: alpha_k from the rounds that tested d_k
    tested = sum(g.position_tested.sum(0) for g in c.gens)
    passed = sum(g.position_accepted.sum(0) for g in c.gens)
    row["acceptance_rate_per_position"] = [float(p / t) if t else None for p, t in zip(passed, tested)]
    row["draft_length_histogram"] = [int(x) for x in sum(g.draft_length_histogram.sum(0)
                                                         for g in c.gens)]
  row["round_s"] = round_s(c)
  if c.tree is not None:
    row.update({"tree": ",".join(map(str, c.tree)), "nodes_per_round": TreeSpec(c.tree).num_nodes,
                "draft_cost_ratio_c": draft_s / (c.g * ar_step_s)})
  elif c.g and not auto:
    cost = draft_s / (c.g * ar_step_s)
    alpha = theory.alpha_from_tau(tau, c.g)
    ideal = theory.ideal_speedup(alpha, c.g, cost)
    row.update({"draft_cost_ratio_c": cost, "alpha_iid": alpha, "ideal_speedup": ideal,
                "efficiency": row["speedup_decode"] / ideal})
  if c.form == "stream":
    s = [stats_lib.summarize(g) for g in c.gens]
    for k in ("ttft_s", "itl_p50_s", "itl_p90_s"):
      vals = [x[k] for x in s if x[k] is not None]
      row[k] = _median(vals) if vals else None
  return row


def summarize_baseline(b: Baseline, ar: Cell) -> dict:
  """Row of a baseline beside the AR cell ``ar`` (same prompts, same
  rounds, B = 1): wall_s_{median,min,max}, tokens_per_s (mean new tokens /
  median wall), speedup (its tokens/s over AR's: baselines stop at their own
  EOS, so the rates are compared, not the walls), and the tokens
  against AR's: identical_to_ar (every repeat), agreement_tokens (the
  shortest common prefix over the repeats), new_tokens / ar_tokens (per
  repeat). tau, alpha_k and the decoding-phase figures do not apply (None,
  [])."""
  ar_rows = [np.asarray(g.tokens[0]).reshape(1, -1) for g in ar.gens]
  ours = [t.reshape(1, -1) for t in b.tokens]
  agree = []
  for a, t in zip(ar_rows, ours):
    d = first_divergence(a, t)
    agree.append(a.shape[1] if d is None else d)
  wall = _median(b.walls)
  tokens = float(np.mean([t.shape[1] for t in ours]))
  return {"name": b.name, "method": "baseline", "num_draft_tokens": None, "form": "external",
          **spread(b.walls, ("median", "min", "max"), "wall_s_"),
          "decode_s_median": None, "prefill_s_median": None,
          "tokens_per_s": tokens / wall, "decode_tokens_per_s": None,
          "speedup": tokens / wall / (mean_tokens(ar) / _median(ar.walls)),
          "speedup_decode": None, "tau": None,
          "acceptance_rate_per_position": [], "accepted_length_histogram": [],
          "identical_to_ar": all(a.shape == t.shape and np.array_equal(a, t)
                                 for a, t in zip(ar_rows, ours)),
          "agreement_tokens": int(min(agree)),
          "new_tokens": [int(t.shape[1]) for t in ours],
          "ar_tokens": [int(a.shape[1]) for a in ar_rows]}


def measure_point(decoders: dict, prompts: list[str], batch: int, max_new_tokens: int,
                  sp: SamplingParams, repeats: int, forms=("while",),
                  draft_cache: dict | None = None, flops_cache: dict | None = None,
                  baselines: dict | None = None) -> list[dict]:
  """Decodes one setting with every decoder, side by side, and summarizes.

  Args:
    decoders: {label: Decoder}; exactly one must have method "ar" (the
      baseline of the speedups). Labels name the rows.
    prompts: held-out prompt texts; repeat r decodes rows r*batch..r*batch+batch-1
      (cycling), identical in every cell (``run_cells``).
    batch: rows per generate call (B).
    max_new_tokens: token budget per row.
    sp: sampling settings, the same for every cell (AR included).
    repeats: interleaved timed repeats per cell (after a compile warm-up).
    forms: "while" (one jitted while_loop) and/or "stream" (jitted round per step).
    draft_cache: optional {(label, batch): draft_s}; a hit skips the drafting
      probe (``draft_time_s`` compiles afresh on every call), a miss is
      measured at ``sp`` and stored. None: measure at every call.
    flops_cache: optional {(label, batch): FLOP share c}, the same for
      ``draft_flop_share`` (XLA FLOP counts do not depend on the sampling
      values, so one entry per decoder and batch suffices).
    baselines: optional {label: fn(prompt ids [P], max_new) -> new ids [n]},
      decoders outside this project (``Baseline``; B = 1 only), timed in
      the same interleaved rounds; each gives a ``summarize_baseline`` row
      against the AR cell of the first form (speedup over AR, tokens
      compared with AR's).
  Returns:
    one row per (label, form): ``summarize_cell``'s fields (wall_s_median,
    tokens_per_s, speedup over AR in the same form, tau,
    acceptance_rate_per_position, draft_cost_ratio_c, ideal_speedup,
    efficiency, ...) plus label, temperature, top_p, batch_size, draft_s (s
    per drafting step of G tokens) and ar_step_s (s per AR step, the "target
    step" of c) and draft_cost_ratio_c_flops (the c that drafting would have
    if time followed XLA-counted FLOPs).
  Raises:
    ValueError: no AR decoder, or more than one; baselines at batch != 1.
  """
  ar_labels = [k for k, d in decoders.items() if d.method == "ar"]
  if len(ar_labels) != 1:
    raise ValueError(f"measure_point needs exactly one AR decoder, got {len(ar_labels)}")
  pairs = [(label, Cell(f"{label}_{form}", dec.method, dec.num_draft_tokens, form, dec,
                        None if dec.tree is None else dec.tree.branching))
           for label, dec in decoders.items() for form in forms]
  cells = [c for _, c in pairs]
  externals = [Baseline(label, fn) for label, fn in (baselines or {}).items()]
  run_cells(cells, prompts, batch, max_new_tokens, sp, repeats, externals)
  ar_cells = {c.form: c for c in cells if c.method == "ar"}
  ar_rate = {form: mean_tokens(c) / _median(c.walls) for form, c in ar_cells.items()}
  ar_decode = {form: mean_tokens(c) / _median(c.decode_walls) for form, c in ar_cells.items()}
  ar_step = round_s(ar_cells.get("while", next(iter(ar_cells.values()))))
  probe = prompts[:batch] if len(prompts) >= batch else [prompts[i % len(prompts)] for i in range(batch)]
  draft_s = {}
  for label, dec in decoders.items():
    if dec.method == "ar" or dec.num_draft_tokens == "auto":   # auto: G varies, no single c
      continue
    if draft_cache is not None and (label, batch) in draft_cache:
      draft_s[label] = draft_cache[label, batch]
    else:
      draft_s[label] = draft_time_s(dec, probe, max_new_tokens, sp, repeats)
      if draft_cache is not None:
        draft_cache[label, batch] = draft_s[label]
  flops_cache = {} if flops_cache is None else flops_cache
  for label, dec in decoders.items():
    if dec.method != "ar" and dec.num_draft_tokens != "auto" and (label, batch) not in flops_cache:
      flops_cache[label, batch] = draft_flop_share(dec, probe, max_new_tokens, sp)
  rows = []
  for label, c in pairs:
    row = summarize_cell(c, ar_rate[c.form], ar_decode[c.form], ar_step, draft_s.get(label))
    row.update({"label": label, "temperature": sp.temperature, "top_p": sp.top_p,
                "batch_size": batch, "draft_s": draft_s.get(label), "ar_step_s": ar_step,
                "draft_cost_ratio_c_flops": flops_cache.get((label, batch))})
    if c.decoder.num_draft_tokens == "auto":      # prior and round costs as the decoder holds them
      row["auto"] = c.decoder.auto_record()
    rows.append(row)
  for b in externals:
    row = summarize_baseline(b, ar_cells[forms[0]])
    row.update({"label": b.name, "temperature": sp.temperature, "top_p": sp.top_p,
                "batch_size": batch, "draft_s": None, "ar_step_s": ar_step,
                "draft_cost_ratio_c_flops": None})
    rows.append(row)
  return rows


# -- the whole benchmark of scripts/bench_decode.py and its tree-vs-chain comparison -------

@dataclasses.dataclass
class DecodeBench:
  """The settings of one decode benchmark (scripts/bench_decode.py).

  target: the target model (its MTP modules draft when D >= 1); draft: a
  separate draft model or None; gs: draft lengths G (ints and/or "auto";
  empty: AR alone); trees: token trees (branching tuples); prompts:
  held-out prompt texts; batch_sizes, temperatures, forms ("while" /
  "stream"); max_new_tokens per row; repeats: interleaved timed repeats;
  cache_len: KV cache length of the bare-forward probe; auto_kwargs: the
  "auto" decoder's keyword arguments (``decode.cli.run.auto_kwargs``: G_max =
  the trained offsets and the stage's prior, as ``python -m decode`` builds
  it; empty: ``Decoder``'s defaults).
  """
  target: object
  draft: object | None
  gs: list
  trees: list[tuple]
  prompts: list[str]
  batch_sizes: list[int]
  temperatures: list[float]
  forms: list[str]
  max_new_tokens: int
  repeats: int
  cache_len: int
  auto_kwargs: dict = dataclasses.field(default_factory=dict)


def bench_cells(workdir: str, depth: int, has_draft: bool, *, gs_given: list | None,
                trees_text: str | None, ar_only: bool, quick: bool) -> tuple[list, list[tuple]]:
  """The draft lengths and trees of scripts/bench_decode.py from its flags:
  (gs, trees). ``gs_given``: ``--num_draft_tokens`` parsed (ints and/or
  "auto"), None when not given (default: G = 1..D+2 and "auto" with MTP
  modules, 1..D+2 with a draft model alone; ``quick``: only the first);
  ``trees_text``: ``--trees`` (semicolon list) or None; ``ar_only``: no
  drafter rows at all; ``workdir`` names the target in the messages.

  Raises ValueError (the CLI's message): no drafter (D = 0 and no draft
  model) without ``ar_only``, trees or "auto" with D = 0, a bad or empty
  tree list.
  """
  from decode import tree as tree_lib
  if not depth and not has_draft and not ar_only:
    raise ValueError(f"--workdir={workdir} holds a model with MTP depth D = 0 and no "
                     "--draft_workdir was given: there is no drafter to compare with AR (give "
                     "--draft_workdir DIR, or --ar_only to time AR alone)")
  trees = []
  for text in ([] if ar_only or trees_text is None else trees_text.split(";")):
    if not depth:
      raise ValueError(f"--trees needs a checkpoint with MTP depth D >= 1 (--workdir={workdir} "
                       "has D = 0)")
    try:
      trees.append(tree_lib.parse_tree(text.strip(), depth).branching)
    except ValueError as e:
      raise ValueError(str(e).replace("--tree=", "--trees: tree ")) from e
  if trees_text is not None and not trees and not ar_only:
    raise ValueError(f"--trees={trees_text!r}: give at least one tree, e.g. \"3,2,1;2,2,1\"")
  if ar_only:
    gs = []
  elif gs_given is not None:
    gs = list(gs_given)
  elif depth or has_draft:
    gs = list(range(1, depth + 3)) + (["auto"] if depth else [])
  else:
    gs = []
  if quick and gs_given is None:
    gs = gs[:1]
  if "auto" in gs and not depth:
    raise ValueError("--num_draft_tokens=auto drafts with the MTP modules: --workdir has D = 0")
  return gs, trees


def decoders_for(s: DecodeBench) -> dict[str, Decoder]:
  """{label: Decoder}: "ar", "mtp_G<g>" / "mtp_auto" (D >= 1), "mtp_tree<b1-b2-..>",
  "draft_G<g>" (with a draft model; no auto)."""
  depth = s.target.mtp_depth
  decoders = {"ar": Decoder(s.target, "ar")}
  decoders.update({("mtp_auto" if g == "auto" else f"mtp_G{g}"):
                   Decoder(s.target, "mtp", g, **(s.auto_kwargs if g == "auto" else {}))
                   for g in s.gs if depth})
  decoders.update({f"mtp_tree{'-'.join(map(str, t))}": Decoder(s.target, "mtp", tree=t)
                   for t in s.trees})
  if s.draft is not None:
    decoders.update({f"draft_G{g}": Decoder(s.target, "draft", g, s.draft) for g in s.gs if g != "auto"})
  return decoders


def run_decode_bench(s: DecodeBench, log=print) -> tuple[list[dict], dict, dict]:
  """Per batch size: the bare target forward over 1, G+1, tree-depth+1 and
  1+N tokens (per call and in a loop), then ``measure_point`` at every
  temperature (FLOP shares cached per batch). Returns (rows,
  {B: {tokens: s per call}}, {B: {tokens: s per forward in a loop}}), keys
  as strings; ``log`` gets one line per row."""
  results, bare, bare_loop = [], {}, {}
  for b in s.batch_sizes:
    lengths = sorted({1} | {g + 1 for g in s.gs if g != "auto"} | {len(t) + 1 for t in s.trees}
                     | {1 + TreeSpec(t).num_nodes for t in s.trees})
    bare[str(b)] = {str(k): bare_forward_s(s.target, b, k, s.cache_len, s.repeats) for k in lengths}
    bare_loop[str(b)] = {str(k): bare_forward_s(s.target, b, k, s.cache_len, s.repeats, in_loop=True)
                         for k in lengths}
    decoders = decoders_for(s)
    flops_cache = {}
    for t in s.temperatures:
      rows = measure_point(decoders, s.prompts, b, s.max_new_tokens, SamplingParams(temperature=t),
                           s.repeats, s.forms, flops_cache=flops_cache)
      for row in rows:
        results.append(row)
        log(f"T={t} B={b} {row['name']:16s} {row['tokens_per_s']:8.1f} tok/s  speedup "
            f"{row['speedup']:.2f}x (decoding phase {row['speedup_decode']:.2f}x)  "
            f"tau {row['tau']:.2f}")
  return results, bare, bare_loop


def tree_comparison(results: list[dict], bare_in_loop_by_batch: dict) -> list[dict]:
  """Each tree row beside the chain row of its depth m (same temperature,
  batch and form): tau ratio, ms per round, the round's extra ms per extra
  node ((round_tree - round_chain) / (N - m)) and the bare target forward's
  share of it ((forward over 1+N - over 1+m tokens) / (N - m), from
  ``bare_in_loop_by_batch`` = {B: {tokens: s}}), speedups."""
  out = []
  for r in results:
    if not r.get("tree"):
      continue
    m = r["num_draft_tokens"]
    chain = next((c for c in results if c["method"] == "mtp" and not c.get("tree")
                  and c["num_draft_tokens"] == m and c["temperature"] == r["temperature"]
                  and c["batch_size"] == r["batch_size"] and c["form"] == r["form"]), None)
    if chain is None:
      continue
    extra = r["nodes_per_round"] - m
    loop = bare_in_loop_by_batch.get(str(r["batch_size"]), {})
    fwd = ((loop[str(1 + r["nodes_per_round"])] - loop[str(1 + m)]) * 1e3 / extra
           if extra > 0 and str(1 + r["nodes_per_round"]) in loop and str(1 + m) in loop else None)
    out.append({"temperature": r["temperature"], "batch_size": r["batch_size"], "form": r["form"],
                "tree": r["tree"], "nodes": r["nodes_per_round"], "tau_tree": r["tau"],
                "tau_chain": chain["tau"], "tau_ratio": r["tau"] / chain["tau"],
                "round_ms_tree": r["round_s"] * 1e3, "round_ms_chain": chain["round_s"] * 1e3,
                "extra_ms_per_node": ((r["round_s"] - chain["round_s"]) * 1e3 / extra
                                      if extra > 0 else 0.0),
                "forward_ms_per_node": fwd, "speedup_tree": r["speedup_decode"],
                "speedup_chain": chain["speedup_decode"]})
  return out
