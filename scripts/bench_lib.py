r"""Decoding benchmarks as library functions: AR vs speculative cells side by
side, the bare target forward, the drafting step alone, and the draft cost
ratio c (measured and as a FLOP share).

Used by scripts/bench_decode.py, sweep_decode.py, compare_drafters.py,
bench_draft_cost.py, ablate_mtp.py, distill_mtp.py and
losslessness_study.py (through decode/bench_grid.py too). Every timing goes
through ``mtp.timing.interleaved_times`` (compile first, then interleaved
repeats, median). The drafting-step and FLOP probes use the decoder's
public pieces (``Decoder.prefill``, ``Decoder.models``, its ``drafter``);
``ArgmaxAcceptDecoder`` is a ``Decoder`` with a wrong ``accept_rule``.
``measure_point(..., baselines=)`` times decoders outside this project
(``Baseline``: transformers, llama.cpp; ``decode/bench_baselines.py``) in
the same interleaved rounds and compares their tokens with AR's.

Terms (docs/design.md section 7): a *cell* is one decoder (method, G or
tree) in one form ("while": one jitted while_loop; "stream": one jitted
round per step); tau = tokens per target call; c = drafting time per
draft token / one AR step of the decoding phase; ideal speedup = Leviathan
et al. 2023, Theorem 3.8.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from decode import sampling, theory, verify
from decode import stats as stats_lib
from decode.speculative import Decoder, SamplingParams
from decode.tree_spec import TreeSpec
from mtp.timing import interleaved_times, spread
from scripts.bench_pieces import (  # noqa: F401 (decode.bench's API: the scripts use these names)
    bare_forward_loop, bare_forward_s, draft_flop_share, draft_loop, draft_time_s, encode_prompts,
    prefilled)


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
  ``decode.bench_baselines``) timed in the same interleaved rounds as the
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


def ar_vs_mtp(model, prompts: list[str], temperatures, max_new_tokens: int, repeats: int,
              batch: int = 1) -> list[dict]:
  """AR vs MTP speculative decoding with G = 1 and G = D of one model with
  D >= 1 MTP modules, while_loop form, ``measure_point`` at every
  temperature (``repeats`` interleaved decodes per method: prompt r mod
  len(prompts), seed r). The drafting time behind c is probed once per G,
  at the first temperature (the temperature is a runtime argument of the
  same compiled step). Returns ``measure_point``'s rows, AR rows included."""
  gs = sorted({1, model.mtp_depth})
  decoders = {"ar": Decoder(model, "ar"), **{f"mtp_G{g}": Decoder(model, "mtp", g) for g in gs}}
  draft_cache, rows = {}, []
  for t in temperatures:
    rows += measure_point(decoders, prompts, batch, max_new_tokens, SamplingParams(temperature=t),
                          repeats, draft_cache=draft_cache)
  return rows


# -- a deliberately wrong decoder, for power checks (scripts/losslessness_study.py) ---------

def argmax_accept(key, target_probs, draft_tokens):
  """WRONG acceptance rule, for the power check: accept d_j while it equals
  argmax p_{j-1}; the next token is sampled from p_a (the target row at the
  first rejected position, or p_G as the bonus). Not lossless: it ignores q.

  Args: key (jax.random key), target_probs [B, G+1, V] float, draft_tokens
  [B, G] int. Returns (num_accepted [B] int32 in 0..G, next_token [B] int32).
  """
  p = jnp.asarray(target_probs, jnp.float32)
  g = p.shape[1] - 1
  best = jnp.argmax(p[:, :g], axis=-1).astype(jnp.int32)                 # [B, G]
  match = draft_tokens.astype(jnp.int32) == best
  a = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)      # [B]
  p_row = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]         # [B, V]
  return a.astype(jnp.int32), sampling.sample(key, p_row)


def _argmax_rule(key, p, q, draft_tokens, params):
  """``argmax_accept`` as a ``Decoder`` accept_rule (AR steps as the real rule)."""
  if draft_tokens is None or params.greedy:
    return verify.accept(key, p, q, draft_tokens, params)
  return argmax_accept(key, p, draft_tokens)


class ArgmaxAcceptDecoder(Decoder):
  """A speculative ``Decoder`` whose round uses ``argmax_accept`` instead of
  the rejection rule of Leviathan et al. 2023 (Algorithm 1): same drafting,
  verification and commit, wrong acceptance. For power checks only."""

  def __init__(self, target, method="mtp", num_draft_tokens=2, draft=None, mesh=None,
               tokenizer=None):
    if method == "ar":
      raise ValueError("ArgmaxAcceptDecoder needs a speculative method (mtp or draft)")
    super().__init__(target, method, num_draft_tokens, draft, mesh, accept_rule=_argmax_rule,
                     tokenizer=tokenizer)
