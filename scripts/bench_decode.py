r"""Decode benchmark: AR vs MTP (and draft-model) speculative decoding, side by
side in one process, on held-out prompts.

    python scripts/bench_decode.py --workdir runs/tiny [--draft_workdir DIR] \
        [--dataset python_stdlib] [--batch_sizes 1,4] [--temperatures 0,1] \
        [--num_draft_tokens 1,2,3,4] [--trees "3,2,1;2,2,1"] [--repeats 5] \
        [--out results/bench_decode]

For every (temperature, batch size) it runs, after compiling each cell once,
``repeats`` rounds that interleave all cells (so machine noise hits them
alike) with identical prompts, budgets and sampling settings. Per cell:
median / min / max wall time, tokens/s, two speedups over AR in the same
form (same batch, same temperature): end to end (prefill included, the
definition of docs/design.md section 7) and of the decoding phase (prefill
excluded: what speculative decoding accelerates, and what Theorem 3.8
models), tau, alpha per position, the measured draft cost ratio c (drafting
time per draft token, measured inside a fori_loop, over one AR step of the
decoding phase) next to the FLOP share c (FLOPs) it would have if time
followed XLA-counted FLOPs, the ideal speedup of Leviathan et al. 2023
(Theorem 3.8) with the measured alpha and c, efficiency = decoding-phase
speedup / ideal, the prefill time, TTFT and ITL (stream form). Also the
bare cost of one jitted target forward over 1 and over G+1 tokens. Writes
``OUT.json`` (with config, commit, JAX version, device, CPU count and date)
and ``OUT.md``.

``--trees`` adds token-tree rows (``Decoder(tree=...)``, decode/tree.py)
next to the chains, in the same interleaved repeats: tau is tokens per
target call, alpha_k the acceptance at depth k, c the drafting time per
tree level over one AR step (the chain formula's ideal speedup does not
apply to trees and is left out), and a second table sets each tree beside
the chain of its depth (G = m, when measured): tau ratio, ms per round, the
round's extra cost per extra node ((round_tree - round_chain) / (N - m)),
split into the bare target forward's share (forward over 1+N vs 1+m
tokens) and the rest (drafting the extra nodes, tree masks, acceptance and
the K/V move of the accepted path).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from decode import stats as stats_lib  # noqa: E402
from decode import tree as tree_lib  # noqa: E402
from scripts import common  # noqa: E402
from decode.speculative import Decoder, SamplingParams  # noqa: E402
from mtp import loading  # noqa: E402
from mtp import data as data_lib  # noqa: E402
from mtp import tokenizer as tok  # noqa: E402
from mtp.model import init_layer_caches  # noqa: E402


def _median_per_iter(fn, args, iters: int, repeats: int):
  """Median seconds per iteration of ``fn(*args) -> args`` (donated carry),
  after one compiling call; each timed call runs ``iters`` iterations."""
  args = fn(*args)
  jax.block_until_ready(args)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    args = fn(*args)
    jax.block_until_ready(args)
    times.append((time.perf_counter() - t0) / iters)
  return float(np.median(times))


def bare_forward_s(model, batch: int, length: int, cache_len: int, repeats: int,
                   in_loop: bool = False, iters: int = 20) -> float:
  """Median seconds of one target forward (backbone + head) over ``length``
  new tokens with a KV cache (donated), batch ``batch``. ``in_loop=False``:
  one jitted call per forward (includes the host dispatch, ~0.1-0.2 ms on
  CPU); ``in_loop=True``: ``iters`` forwards inside one ``lax.fori_loop``
  (device time only, comparable with the while_loop decoding form).
  Positions advance by one per iteration, as they do in decoding."""
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
  return _median_per_iter(fn, (params, cache, toks, pos), iters, max(repeats, 5) * (1 if in_loop else 10))


def draft_time_s(decoder: Decoder, prompts, max_new: int, sp: SamplingParams, repeats: int,
                 iters: int = 20) -> float:
  """Median seconds of one drafting step alone (G draft tokens, the drafter's
  forward passes, warps and samples), measured as ``iters`` steps inside one
  ``lax.fori_loop`` so that, like the while_loop decoding form, no host
  dispatch is counted. The cost ratio c is this over G AR steps."""
  encoded = [tok.ByteTokenizer().encode(p, add_bos=True) for p in prompts]
  state, prefill_len = decoder.prepare(encoded, max_new, 0)
  state = decoder._prefill_fn(decoder.target_params, decoder.draft_params, state, prefill_len)
  warp = sp.as_arrays()

  def body(_, carry):
    params, dparams, dstate, tokens, n, key = carry
    target, draft = decoder._models(params, dparams)
    model = target if decoder.method == "mtp" else draft
    key, sub = jax.random.split(key)
    dstate, tokens, _, _ = decoder.drafter.draft(model, dstate, tokens, n, sub, warp)
    return params, dparams, dstate, tokens, n, key
  fn = jax.jit(lambda *c: jax.lax.fori_loop(0, iters, body, c), donate_argnums=(2, 3))
  args = (decoder.target_params, decoder.draft_params, state["drafter"], state["tokens"],
          state["length"], state["key"])
  return _median_per_iter(fn, args, iters, max(repeats, 5))


def _flops(fn, *args) -> float:
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("flops", 0.0)) if cost else 0.0


def draft_flop_share(decoder: Decoder, prompts, max_new: int, sp: SamplingParams) -> float:
  """XLA-counted FLOPs of one drafting step / (G x FLOPs of one target
  forward over 1 token with the same cache): the cost ratio c that drafting
  would have if time followed FLOPs."""
  encoded = [tok.ByteTokenizer().encode(p, add_bos=True) for p in prompts]
  state, _ = decoder.prepare(encoded, max_new, 0)
  warp = sp.as_arrays()

  def draft_step(params, dparams, dstate, tokens, n, key):
    target, draft = decoder._models(params, dparams)
    model = target if decoder.method == "mtp" else draft
    return decoder.drafter.draft(model, dstate, tokens, n, key, warp)

  def forward(params, cache, tokens, n):
    target, _ = decoder._models(params, None)
    h, cache = target.backbone(tokens[:, :1], n[:, None], cache=cache)
    return target.head(h), cache
  d = _flops(draft_step, decoder.target_params, decoder.draft_params, state["drafter"], state["tokens"],
             state["length"], state["key"])
  f = _flops(forward, decoder.target_params, state["cache"], state["tokens"], state["length"])
  return d / (decoder.G * f) if f else float("nan")


@dataclasses.dataclass
class Cell:
  name: str
  method: str
  g: int
  form: str              # "while" or "stream"
  decoder: Decoder
  tree: tuple | None = None
  walls: list = dataclasses.field(default_factory=list)
  decode_walls: list = dataclasses.field(default_factory=list)   # wall - prefill
  gens: list = dataclasses.field(default_factory=list)


def run_cells(cells, prompts, batch, max_new, sp, repeats):
  """Repeat r decodes prompts[r*batch .. r*batch+batch-1] (cycling) with seed r
  in every cell, so all cells see the same prompts and the sample grows
  with the repeats."""
  encoded = [tok.ByteTokenizer().encode(p, add_bos=True) for p in prompts]
  rows = lambda r: [encoded[(r * batch + i) % len(encoded)] for i in range(batch)]
  call = lambda c, r: (c.decoder.generate if c.form == "while" else c.decoder.stream)(
      rows(r), max_new, sp, seed=r)
  # compile every prompt-length bucket that the repeats will hit
  bucket = lambda r: -(-max(len(x) for x in rows(r)) // 64)
  warm = {bucket(r): r for r in range(repeats)}.values()
  for c in cells:
    for r in warm:
      call(c, r)
  for r in range(repeats):              # interleave
    for c in cells:
      gen = call(c, r)
      c.walls.append(gen.wall_time_s)
      c.decode_walls.append(gen.wall_time_s - gen.prefill_time_s)
      c.gens.append(gen)


def summarize_cell(c: Cell, ar_wall: float, ar_decode_wall: float, ar_step_s: float,
                   draft_s: float | None) -> dict:
  """Row of the table. ``ar_wall`` / ``ar_decode_wall``: the AR cell's
  median seconds end to end / of the decoding phase (same form);
  ``ar_step_s``: one AR step of the decoding phase (one target call) in the
  while_loop form, the "target step" of the cost ratio c."""
  hist = sum(g.accepted_histogram.sum(0) for g in c.gens)
  calls = int(sum(g.target_calls.sum() for g in c.gens))
  auto = c.g == "auto"
  tokens = sum(sum(len(t) for t in g.tokens) for g in c.gens) / len(c.gens)
  wall = float(np.median(c.walls))
  decode = float(np.median(c.decode_walls))
  tau = float((hist * (np.arange(len(hist)) + 1)).sum() / calls)
  row = {"name": c.name, "method": c.method, "num_draft_tokens": c.g, "form": c.form,
         "wall_s_median": wall, "wall_s_min": float(min(c.walls)), "wall_s_max": float(max(c.walls)),
         "decode_s_median": decode,
         "prefill_s_median": float(np.median([g.prefill_time_s for g in c.gens])),
         "tokens_per_s": tokens / wall, "decode_tokens_per_s": tokens / decode,
         "speedup": ar_wall / wall, "speedup_decode": ar_decode_wall / decode, "tau": tau,
         "acceptance_rate_per_position": stats_lib.acceptance_rates(hist),
         "accepted_length_histogram": [int(x) for x in hist]}
  if auto:      # G varies by round: alpha_k from the rounds that tested d_k
    tested = sum(g.position_tested.sum(0) for g in c.gens)
    passed = sum(g.position_accepted.sum(0) for g in c.gens)
    row["acceptance_rate_per_position"] = [float(p / t) if t else None for p, t in zip(passed, tested)]
    row["draft_length_histogram"] = [int(x) for x in sum(g.draft_length_histogram.sum(0)
                                                         for g in c.gens)]
  # time per round of the decoding phase (one target call for the whole batch)
  row["round_s"] = float(np.median([d / int(g.target_calls.max())
                                    for d, g in zip(c.decode_walls, c.gens)]))
  if c.tree is not None:
    row.update({"tree": ",".join(map(str, c.tree)), "nodes_per_round": stats_lib.tree_num_nodes(c.tree),
                "draft_cost_ratio_c": draft_s / (c.g * ar_step_s)})
  elif c.g and not auto:
    cost = draft_s / (c.g * ar_step_s)
    alpha = stats_lib.alpha_from_tau(tau, c.g)
    ideal = stats_lib.ideal_speedup(alpha, c.g, cost)
    row.update({"draft_cost_ratio_c": cost, "alpha_iid": alpha, "ideal_speedup": ideal,
                "efficiency": row["speedup_decode"] / ideal})
  if c.form == "stream":
    s = [stats_lib.summarize(g) for g in c.gens]
    for k in ("ttft_s", "itl_p50_s", "itl_p90_s"):
      vals = [x[k] for x in s if x[k] is not None]
      row[k] = float(np.median(vals)) if vals else None
  return row


def measure_point(decoders: dict, prompts: list[str], batch: int, max_new_tokens: int,
                  sp: SamplingParams, repeats: int, forms=("while",),
                  draft_cache: dict | None = None, flops_cache: dict | None = None) -> list[dict]:
  """Decodes one setting with every decoder, side by side, and summarizes.

  Args:
    decoders: {label: Decoder}; exactly one must have method "ar" (the
      baseline of the speedups). Labels name the rows.
    prompts: held-out prompt texts; repeat r decodes rows r*batch..r*batch+batch-1
      (cycling), identical in every cell (``bench_decode.run_cells``).
    batch: rows per generate call (B).
    max_new_tokens: token budget per row.
    sp: sampling settings, the same for every cell (AR included).
    repeats: interleaved timed repeats per cell (after a compile warm-up).
    forms: "while" (one jitted while_loop) and/or "stream" (jitted round per step).
    draft_cache: optional {(label, batch): draft_s}; a hit skips the drafting
      probe (``bench_decode.draft_time_s`` compiles afresh on every call), a
      miss is measured at ``sp`` and stored. None: measure at every call.
    flops_cache: optional {(label, batch): FLOP share c}, the same for
      ``bench_decode.draft_flop_share`` (XLA FLOP counts do not depend on the
      sampling values, so one entry per decoder and batch suffices).
  Returns:
    one row per (label, form): ``bench_decode.summarize_cell``'s fields
    (wall_s_median, tokens_per_s, speedup over AR in the same form, tau,
    acceptance_rate_per_position, draft_cost_ratio_c, ideal_speedup,
    efficiency, ...) plus label, temperature, top_p, batch_size, draft_s (s
    per drafting step of G tokens) and ar_step_s (s per AR step, the "target
    step" of c) and draft_cost_ratio_c_flops (the c that drafting would have
    if time followed XLA-counted FLOPs), as bench_decode.main combines them.
  Raises:
    ValueError: no AR decoder, or more than one.
  """
  ar_labels = [k for k, d in decoders.items() if d.method == "ar"]
  if len(ar_labels) != 1:
    raise ValueError(f"measure_point needs exactly one AR decoder, got {len(ar_labels)}")
  pairs = [(label, Cell(f"{label}_{form}", dec.method, dec.num_draft_tokens, form, dec,
                        None if dec.tree is None else dec.tree.branching))
           for label, dec in decoders.items() for form in forms]
  cells = [c for _, c in pairs]
  run_cells(cells, prompts, batch, max_new_tokens, sp, repeats)
  ar_cells = {c.form: c for c in cells if c.method == "ar"}
  ar_wall = {form: float(np.median(c.walls)) for form, c in ar_cells.items()}
  ar_decode = {form: float(np.median(c.decode_walls)) for form, c in ar_cells.items()}
  ar_any = ar_cells.get("while", next(iter(ar_cells.values())))
  ar_step = float(np.median([d / int(g.target_calls.max())
                             for d, g in zip(ar_any.decode_walls, ar_any.gens)]))
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
    row = summarize_cell(c, ar_wall[c.form], ar_decode[c.form], ar_step, draft_s.get(label))
    row.update({"label": label, "temperature": sp.temperature, "top_p": sp.top_p,
                "batch_size": batch, "draft_s": draft_s.get(label), "ar_step_s": ar_step,
                "draft_cost_ratio_c_flops": flops_cache.get((label, batch))})
    rows.append(row)
  return rows


def markdown(results, meta) -> str:
  lines = [f"Decode benchmark: {meta['workdir']} on {common.machine(meta)}, "
           f"JAX {meta['jax_version']}, commit {meta['commit']}, {meta['date']}; "
           f"{meta['max_new_tokens']} new tokens per prompt, prompts of ~{meta['prompt_bytes']} bytes "
           f"from {meta['dataset']} validation; median of {common.plural(meta['repeats'], 'repeat')}.", "",
           "Bare target forward (backbone + head with KV cache) per batch size, over 1 and over G+1 "
           "tokens: one jitted call per forward (host dispatch included) / inside a fori_loop "
           "(device time; compare with the while_loop form). AR step = AR while_loop time per token "
           "of the decoding phase (prefill excluded).", "",
           "| B | " + " | ".join(f"{k} tok call / loop ms" for k in meta["bare_forward_s"]) +
           " | AR step ms | AR step / loop forward |",
           "|---|" + "---|" * (len(meta["bare_forward_s"]) + 2)]
  for bsz, per_call in meta["bare_forward_s_by_batch"].items():
    loop = meta["bare_forward_in_loop_s_by_batch"][bsz]
    ar = [r["ar_step_s"] for r in results if str(r["batch_size"]) == bsz and r["method"] == "ar"]
    ar_s = min(ar) if ar else None
    lines.append(f"| {bsz} | " + " | ".join(f"{per_call[k] * 1e3:.3f} / {loop[k] * 1e3:.3f}" for k in per_call)
                 + (f" | {ar_s * 1e3:.3f} | {ar_s / loop['1']:.2f} |" if ar_s else " | - | - |"))
  lines += ["",
           "speedup: end to end, AR wall / method wall (prefill included); decode: the decoding "
           "phase alone (prefill excluded), the speedup Theorem 3.8 models (ideal) and that eff. "
           "divides; ms/round: decoding phase per target call; prefill: target (and drafter) over "
           "the prompt bucket.", "",
           "| T | B | method | G | form | tok/s | speedup | decode | tau | alpha_k | c | c (FLOPs) | ideal "
           "| eff. | ms/round | prefill ms | TTFT ms | ITL p50/p90 ms |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  f = lambda x, s=".2f": "-" if x is None else format(x, s)
  for r in results:
    alphas = "/".join(f(a) for a in r["acceptance_rate_per_position"]) or "-"
    itl = "-" if r.get("itl_p50_s") is None else f"{r['itl_p50_s'] * 1e3:.2f}/{r['itl_p90_s'] * 1e3:.2f}"
    lines.append(
        f"| {r['temperature']} | {r['batch_size']} | {r['method']} | "
        f"{('tree ' + r['tree']) if r.get('tree') else (r['num_draft_tokens'] or '-')} | "
        f"{r['form']} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['speedup_decode']:.2f}x | "
        f"{r['tau']:.2f} | {alphas} | "
        f"{f(r.get('draft_cost_ratio_c'))} | {f(r.get('draft_cost_ratio_c_flops'))} | {f(r.get('ideal_speedup'))} | {f(r.get('efficiency'))} | "
        f"{r['round_s'] * 1e3:.2f} | {r['prefill_s_median'] * 1e3:.1f} | "
        f"{f(r.get('ttft_s') and r['ttft_s'] * 1e3, '.1f')} | {itl} |")
  auto = [r for r in results if r.get("draft_length_histogram")]
  if auto:
    lines += ["", "Draft lengths chosen by `auto` (rounds per G = 0..G_max, 0 = AR step; summed over "
              "repeats and rows):", ""]
    lines += [f"- T = {r['temperature']}, B = {r['batch_size']}, {r['form']}: "
              f"{r['draft_length_histogram']}" for r in auto]
  comp = tree_comparison(results, meta)
  if comp:
    lines += ["", "Trees beside the chain of their depth (G = m), same temperature, batch and form: "
              "tau ratio; ms per round; extra ms per extra node = (round_tree - round_chain) / "
              "(N - m), of which the bare target forward accounts for (forward over 1+N tokens - "
              "over 1+m tokens) / (N - m) (inside a fori_loop); speedup ratio tree / chain.", "",
              "| T | B | form | tree | N | tau tree / chain | ratio | ms/round tree / chain | "
              "extra ms per node | of which target forward | speedup tree / chain |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in comp:
      lines.append(
          f"| {c['temperature']} | {c['batch_size']} | {c['form']} | {c['tree']} | {c['nodes']} | "
          f"{c['tau_tree']:.2f} / {c['tau_chain']:.2f} | {c['tau_ratio']:.2f} | "
          f"{c['round_ms_tree']:.2f} / {c['round_ms_chain']:.2f} | {c['extra_ms_per_node']:.3f} | "
          f"{f(c['forward_ms_per_node'], '.3f')} | {c['speedup_tree']:.2f}x / {c['speedup_chain']:.2f}x |")
  return "\n".join(lines) + "\n"


def tree_comparison(results, meta) -> list[dict]:
  """Each tree row beside the chain row of its depth (same temperature,
  batch and form), as the second table of ``markdown`` describes."""
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
    loop = meta["bare_forward_in_loop_s_by_batch"].get(str(r["batch_size"]), {})
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


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
  ap.add_argument("--workdir", required=True, help="target checkpoint (its MTP modules draft when D >= 1)")
  ap.add_argument("--draft_workdir", default=None, help="separate draft-model checkpoint (optional)")
  ap.add_argument("--ar_only", action="store_true",
                  help="time AR alone (needed when --workdir has D = 0 and no --draft_workdir is given)")
  ap.add_argument("--dataset", default="python_stdlib", help="held-out prompt dataset")
  ap.add_argument("--data_dir", default="", help=common.DATA_DIR_HELP)
  ap.add_argument("--prompt_bytes", type=int, default=256, help="bytes per prompt, >= 1")
  ap.add_argument("--num_prompts", type=int, default=0,
                  help="held-out prompts, cycled over repeats (default: max batch x repeats)")
  ap.add_argument("--max_new_tokens", type=int, default=128, help="new tokens per prompt, >= 1")
  ap.add_argument("--batch_sizes", default="1,4,16", help="comma list of batch sizes B >= 1")
  ap.add_argument("--temperatures", default="0,1", help="comma list of temperatures >= 0 (0: greedy)")
  ap.add_argument("--num_draft_tokens", default=None,
                  help="comma list of G >= 1 and/or 'auto' (draft length chosen every round; "
                       "default: 1..D+2 and auto; --quick: 1)")
  ap.add_argument("--trees", default=None,
                  help="semicolon list of token trees, each a comma list of branching per depth "
                       "(depth 1..D), e.g. \"3,2,1;2,2,1\": tree rows beside the chains")
  ap.add_argument("--forms", default="while,stream", help="comma list of 'while' and/or 'stream'")
  ap.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats, >= 1")
  ap.add_argument("--out", default="results/bench_decode", help="output prefix (OUT.json, OUT.md)")
  ap.add_argument("--quick", action="store_true",
                  help="tiny sizes for tests: fills in --batch_sizes 1 --temperatures 0,1 --repeats 1 "
                       "--max_new_tokens 8 --prompt_bytes 64 and G = 1 where not given")
  args = ap.parse_args(argv)
  if args.quick:
    common.apply_quick(ap, args, batch_sizes="1", temperatures="0,1", repeats=1, max_new_tokens=8,
                       prompt_bytes=64)
  common.check_range(ap, args, prompt_bytes=1, max_new_tokens=1, repeats=1, num_prompts=0)
  batch_sizes = common.parse_list(ap, "batch_sizes", args.batch_sizes, int, 1)
  temps = common.parse_list(ap, "temperatures", args.temperatures, float, 0.0)
  forms = common.parse_list(ap, "forms", args.forms, str, choices=("while", "stream"))
  gs_given = None
  if args.num_draft_tokens is not None:
    items = [x.strip() for x in args.num_draft_tokens.split(",") if x.strip()]
    auto_given = "auto" in items
    rest = ",".join(x for x in items if x != "auto")
    gs_given = (common.parse_list(ap, "num_draft_tokens", rest, int, 1) if rest else []) + (
        ["auto"] if auto_given else [])
    if not gs_given:
      ap.error(f"--num_draft_tokens={args.num_draft_tokens!r}: give G >= 1 values and/or 'auto'")
  cfg, target, step = loading.load_model(args.workdir)
  draft = loading.load_model(args.draft_workdir)[1] if args.draft_workdir else None
  depth = cfg.mtp.depth
  if not depth and draft is None and not args.ar_only:
    ap.error(f"--workdir={args.workdir} holds a model with MTP depth D = 0 and no --draft_workdir "
             "was given: there is no drafter to compare with AR (give --draft_workdir DIR, or "
             "--ar_only to time AR alone)")
  trees = []
  for text in ([] if args.ar_only or args.trees is None else args.trees.split(";")):
    if not depth:
      ap.error(f"--trees needs a checkpoint with MTP depth D >= 1 (--workdir={args.workdir} has D = 0)")
    try:
      trees.append(tree_lib.parse_tree(text.strip(), depth).branching)
    except ValueError as e:
      ap.error(str(e).replace("--tree=", "--trees: tree "))
  if args.trees is not None and not trees and not args.ar_only:
    ap.error(f"--trees={args.trees!r}: give at least one tree, e.g. \"3,2,1;2,2,1\"")
  gs = [] if args.ar_only else (gs_given if gs_given is not None
                                else list(range(1, depth + 3)) + (["auto"] if depth else [])
                                if depth or draft is not None else [])
  if args.quick and gs_given is None:
    gs = gs[:1]
  if "auto" in gs and not depth:
    ap.error("--num_draft_tokens=auto drafts with the MTP modules: --workdir has D = 0")
  prompts_all = data_lib.held_out_prompts(args.dataset, args.num_prompts or max(batch_sizes) * args.repeats,
                                 args.prompt_bytes, data_dir=args.data_dir)
  cache_len = 64 * int(np.ceil((args.prompt_bytes + args.max_new_tokens + 64) / 64))
  results, bare, bare_loop = [], {}, {}
  for b in batch_sizes:
    lengths = sorted({1} | {g + 1 for g in gs if g != "auto"} | {len(t) + 1 for t in trees}
                     | {1 + stats_lib.tree_num_nodes(t) for t in trees})
    bare[str(b)] = {str(k): bare_forward_s(target, b, k, cache_len, args.repeats) for k in lengths}
    bare_loop[str(b)] = {str(k): bare_forward_s(target, b, k, cache_len, args.repeats, in_loop=True)
                         for k in lengths}
    decoders = {"ar": Decoder(target, "ar")}
    decoders.update({("mtp_auto" if g == "auto" else f"mtp_G{g}"): Decoder(target, "mtp", g)
                     for g in gs if depth})
    decoders.update({f"mtp_tree{'-'.join(map(str, t))}": Decoder(target, "mtp", tree=t)
                     for t in trees})
    if draft is not None:
      decoders.update({f"draft_G{g}": Decoder(target, "draft", g, draft) for g in gs if g != "auto"})
    flops_cache = {}
    for t in temps:
      sp = SamplingParams(temperature=t)
      rows = measure_point(decoders, prompts_all, b, args.max_new_tokens, sp, args.repeats, forms,
                           flops_cache=flops_cache)
      for row in rows:
        results.append(row)
        print(f"T={t} B={b} {row['name']:16s} {row['tokens_per_s']:8.1f} tok/s  speedup "
              f"{row['speedup']:.2f}x (decoding phase {row['speedup_decode']:.2f}x)  "
              f"tau {row['tau']:.2f}", flush=True)
  meta = common.provenance(
      command=common.command_line(__file__, argv),
      workdir=args.workdir, checkpoint_step=step, config=cfg.to_dict(),
      draft_workdir=args.draft_workdir, dataset=args.dataset, prompt_bytes=args.prompt_bytes,
      max_new_tokens=args.max_new_tokens, repeats=args.repeats, trees=[list(t) for t in trees],
      bare_forward_s=bare[str(batch_sizes[0])], bare_forward_s_by_batch=bare,
      bare_forward_in_loop_s=bare_loop[str(batch_sizes[0])], bare_forward_in_loop_s_by_batch=bare_loop)
  common.write_report(args.out, meta, results, markdown(results, meta))
  print(f"wrote {args.out}.json and {args.out}.md")


if __name__ == "__main__":
  common.main_guard(main)
