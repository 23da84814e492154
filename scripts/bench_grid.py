"""Whole decoding benchmarks built from ``decode.bench``: the grid of
scripts/bench_decode.py (settings as ``DecodeBench``; AR, MTP chains,
``auto``, trees and a draft model, per batch size and temperature, with
the bare target forward beside them), its tree-vs-chain comparison, and
the drafting-cost scan of scripts/bench_draft_cost.py (c against target
depth on random-weight targets).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from flax import nnx

from decode import stats as stats_lib
from decode import theory
from decode.tree_spec import TreeSpec
from decode.speculative import Decoder, SamplingParams
from mtp import config as config_lib
from mtp import tokenizer as tok
from mtp.model import build_model
from scripts.bench_lib import bare_forward_s, draft_flop_share, draft_time_s, measure_point
from scripts.draft_models import draft_config, param_count


@dataclasses.dataclass
class DecodeBench:
  """The settings of one decode benchmark (scripts/bench_decode.py).

  target: the target model (its MTP modules draft when D >= 1); draft: a
  separate draft model or None; gs: draft lengths G (ints and/or "auto";
  empty: AR alone); trees: token trees (branching tuples); prompts:
  held-out prompt texts; batch_sizes, temperatures, forms ("while" /
  "stream"); max_new_tokens per row; repeats: interleaved timed repeats;
  cache_len: KV cache length of the bare-forward probe; auto_kwargs: the
  "auto" decoder's keyword arguments (``decode.run.auto_kwargs``: G_max =
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


DRAFT_COST_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    return 0\n"
ALPHAS = (0.6, 0.8, 0.9)     # acceptance rates of draft_cost_vs_depth's ideal speedups


def draft_cost_vs_depth(cfg: config_lib.Config, layers: int, gs: list[int], repeats: int, max_new: int,
                        log=print) -> list[dict]:
  """Rows {layers, num_draft_tokens, c, c_flops, overhead, draft_s, forward_s, ideal_speedup}
  for a random target copy of ``cfg`` with ``layers`` layers and MTP depth
  max(gs) (scripts/bench_draft_cost.py): c = ``draft_time_s`` / (G x one
  in-loop ``bare_forward_s`` over 1 token), batch 1, T = 0, prompt
  ``DRAFT_COST_PROMPT``; c_flops = ``draft_flop_share``; ideal_speedup
  {alpha: Theorem 3.8} at ``ALPHAS``. ``log`` gets one line per G."""
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers),
                            mtp=dataclasses.replace(cfg.mtp, depth=max(gs)))
  target = build_model(config_lib.validate(cfg))
  cache_len = 64 * -(-(len(DRAFT_COST_PROMPT) + 1 + max_new + 64) // 64)
  fwd = bare_forward_s(target, 1, 1, cache_len, repeats, in_loop=True)
  sp = SamplingParams(temperature=0.0)
  rows = []
  for g in gs:
    dec = Decoder(target, "mtp", g)
    draft_s = draft_time_s(dec, [DRAFT_COST_PROMPT], max_new, sp, repeats)
    c = draft_s / (g * fwd)
    c_flops = draft_flop_share(dec, [DRAFT_COST_PROMPT], max_new, sp)
    rows.append({"layers": layers, "num_draft_tokens": g, "c": c, "c_flops": c_flops,
                 "overhead": c / c_flops, "draft_s": draft_s, "forward_s": fwd,
                 "ideal_speedup": {str(a): theory.ideal_speedup(a, g, c) for a in ALPHAS}})
    log(f"L={layers:3d} G={g}: c {c:.3f}  c(FLOPs) {c_flops:.3f}  forward {fwd * 1e3:.3f} ms  "
        f"draft {draft_s * 1e3:.3f} ms")
  return rows


# -- sweep_decode: one-axis sweeps around a base point --------------------------------------

SWEEPS = ("temperature", "top_p", "batch", "domain")
DOMAIN_KIND = {"python_stdlib": "code", "python_docs": "prose"}


def sweep_points(base: dict, temperatures, top_ps, batch_sizes, batch_temperatures,
                 domains) -> dict[str, list[dict]]:
  """The settings of each sweep: {sweep name: [point, ...]}, each point a
  dict with keys domain, temperature, top_p, batch_size; every point equals
  ``base`` except on its sweep's axes (temperature sweep: T x domain; top_p:
  p; batch: B x T in ``batch_temperatures``; domain: domain x T in {0, 1}).
  Pure; points repeat across sweeps where the settings coincide."""
  pt = lambda **kw: {**base, **kw}
  return {
      "temperature": [pt(domain=d, temperature=t) for d in domains for t in temperatures],
      "top_p": [pt(top_p=p) for p in top_ps],
      "batch": [pt(batch_size=b, temperature=t) for t in batch_temperatures for b in batch_sizes],
      "domain": [pt(domain=d, temperature=t) for t in (0.0, 1.0) for d in domains],
  }


def point_key(p: dict) -> tuple:
  """(domain, temperature, top_p, batch_size) of a sweep point: equal settings, equal key."""
  return (p["domain"], float(p["temperature"]), float(p["top_p"]), int(p["batch_size"]))


@dataclasses.dataclass
class SweepDecode:
  """The settings of one decode sweep (scripts/sweep_decode.py).

  target: the MTP target (D >= 1); gs: draft lengths G of the MTP rows;
  plan: ``sweep_points``' {sweep: [point]}; prompts: {domain: held-out
  prompt texts}; forms; max_new_tokens per row; repeats: interleaved timed
  repeats per point; draft_cost_probe: "point" (probe the drafting time at
  every point) or "batch" (once per batch size, at its first point).
  """
  target: object
  gs: list[int]
  plan: dict[str, list[dict]]
  prompts: dict[str, list[str]]
  forms: list[str]
  max_new_tokens: int
  repeats: int
  draft_cost_probe: str = "point"


def run_sweep(s: SweepDecode, log=print) -> dict[str, list[dict]]:
  """Measures every distinct point of ``s.plan`` once (``measure_point`` with
  AR and MTP at each G; in order of batch size, then key) and returns
  {sweep: rows}, each row ``measure_point``'s with its domain and sweep
  name; a point shared by two sweeps has the same rows in both. ``log``
  gets one line per point."""
  unique = {point_key(p): p for pts in s.plan.values() for p in pts}
  # One decoder per method: its jitted functions compile once per batch shape.
  decoders = {"ar": Decoder(s.target, "ar"), **{f"mtp_G{g}": Decoder(s.target, "mtp", g) for g in s.gs}}
  measured, draft_cache, flops_cache = {}, ({} if s.draft_cost_probe == "batch" else None), {}
  for i, (key, p) in enumerate(sorted(unique.items(), key=lambda kv: (kv[0][3], kv[0]))):
    sp = SamplingParams(temperature=p["temperature"], top_p=p["top_p"])
    rows = measure_point(decoders, s.prompts[p["domain"]], p["batch_size"], s.max_new_tokens, sp,
                         s.repeats, s.forms, draft_cache, flops_cache)
    for r in rows:
      r["domain"] = p["domain"]
    measured[key] = rows
    spec = " ".join(f"{r['label']} tau {r['tau']:.2f} x{r['speedup']:.2f}" for r in rows
                    if r["method"] != "ar")
    log(f"[{i + 1}/{len(unique)}] {p['domain']} T={p['temperature']:g} top_p={p['top_p']:g} "
        f"B={p['batch_size']}: {spec}")
  return {name: [dict(r, sweep=name) for p in pts for r in measured[point_key(p)]]
          for name, pts in s.plan.items()}


# -- compare_drafters: the cost-matched draft -------------------------------------------------

def calibrate_cost_arch(target, target_cfg, candidates, prompt: str, max_new_tokens: int,
                        num_draft_tokens: int, repeats: int) -> tuple[tuple[int, int], list]:
  """The candidate (num_layers, d_model) whose drafting step is closest in
  time (|log ratio|) to the MTP drafter's, i.e. whose cost ratio c is
  closest to the MTP drafter's. Times: ``decode.bench.draft_time_s``
  (median s per drafting step of G tokens, batch 1, T = 0) with
  random-weight drafts (the time does not depend on the weights). Returns
  (best, [{num_layers, d_model, params, draft_s, mtp_draft_s, time_ratio_to_mtp}])."""
  sp = SamplingParams(temperature=0.0)
  g = num_draft_tokens
  mtp_s = draft_time_s(Decoder(target, "mtp", g), [prompt], max_new_tokens, sp, repeats)
  rows = []
  for layers, width in candidates:
    dcfg = draft_config(target_cfg, layers, width)
    s = draft_time_s(Decoder(target, "draft", g, build_model(dcfg)), [prompt], max_new_tokens, sp,
                     repeats)
    rows.append({"num_layers": layers, "d_model": width, "params": param_count(dcfg)["total"],
                 "draft_s": s, "mtp_draft_s": mtp_s, "time_ratio_to_mtp": s / mtp_s})
  best = min(rows, key=lambda r: abs(math.log(r["time_ratio_to_mtp"])))
  return (best["num_layers"], best["d_model"]), rows


def drafter_grid(target, drafts: dict, gs: list[int], temperatures: list[float], prompts: list[str],
                 batch: int, max_new_tokens: int, repeats: int, probe_once: bool = False,
                 log=print) -> list[dict]:
  """AR, the target's MTP modules and every independent draft model
  (``drafts``: {label: model}) at every G, side by side per temperature
  (``measure_point``, while_loop form; the drafting time behind c probed at
  every temperature, or once at the first with ``probe_once``). Returns
  ``measure_point``'s rows with "drafter" ("ar", "mtp" or the draft's
  label); ``log`` gets one line per speculative row."""
  decoders = {"ar": Decoder(target, "ar")}
  drafter_of = {"ar": "ar"}
  for g in gs:
    decoders[f"mtp_G{g}"] = Decoder(target, "mtp", g)
    drafter_of[f"mtp_G{g}"] = "mtp"
  for label, model in drafts.items():
    for g in gs:
      decoders[f"{label}_G{g}"] = Decoder(target, "draft", g, model)
      drafter_of[f"{label}_G{g}"] = label
  rows, draft_cache, flops_cache = [], ({} if probe_once else None), {}
  for t in temperatures:
    point = measure_point(decoders, prompts, batch, max_new_tokens, SamplingParams(temperature=t),
                          repeats, ("while",), draft_cache, flops_cache)
    for r in point:
      r["drafter"] = drafter_of[r["label"]]
      if r["method"] != "ar":
        log(f"T={t:g} {r['label']:28s} tau {r['tau']:.2f}  c {r['draft_cost_ratio_c']:.2f}  "
            f"speedup {r['speedup']:.2f}x")
    rows += point
  return rows


# -- distill_mtp: one architecture, many parameter sets -----------------------------------

class ParamSwapBench:
  """Decoders for AR and MTP (G in ``gs``) compiled once for one
  architecture (scripts/distill_mtp.py: a base and its distilled stages);
  ``use(model)`` swaps in another model's parameters (same shapes: a stage
  of the same base), so every model is measured by the same compiled
  programs.

  Args:
    model: a model of the architecture (its parameters are used until ``use``).
    gs: draft lengths G >= 1.
  """

  def __init__(self, model, gs: list[int]):
    self.gs = list(gs)
    self.decoders = {"ar": Decoder(model, "ar"), **{f"mtp_G{g}": Decoder(model, "mtp", g) for g in gs}}
    self.draft_cache, self.flops_cache = {}, {}

  def use(self, model) -> "ParamSwapBench":
    params = nnx.state(model, nnx.Param)
    for dec in self.decoders.values():
      dec.target_params = params
    return self

  def acceptance(self, prompts: list[str], temperatures: list[float], max_new_tokens: int,
                 seed: int = 0) -> list[dict]:
    """MTP speculative decoding of all ``prompts`` as one batch per (G, T).

    Returns rows {num_draft_tokens, temperature, tau (emitted tokens per
    target call), alpha (acceptance rate per position k = 1..G, None where
    no round reached k), histogram (rounds per accepted count),
    target_calls, tokens}."""
    enc = [tok.ByteTokenizer().encode(p, add_bos=True) for p in prompts]
    rows = []
    for g in self.gs:
      for t in temperatures:
        gen = self.decoders[f"mtp_G{g}"].generate(enc, max_new_tokens, SamplingParams(temperature=t),
                                                  seed=seed)
        hist = gen.accepted_histogram.sum(0)
        calls = int(gen.target_calls.sum())
        rows.append({"num_draft_tokens": g, "temperature": t,
                     "tau": float((hist * (np.arange(len(hist)) + 1)).sum() / max(calls, 1)),
                     "alpha": stats_lib.acceptance_rates(hist),
                     "histogram": [int(x) for x in hist], "target_calls": calls,
                     "tokens": int(sum(len(x) for x in gen.tokens))})
    return rows

  def speed(self, prompts: list[str], gs: list[int], temperatures: list[float],
            max_new_tokens: int, repeats: int) -> list[dict]:
    """Speedup of MTP (G in ``gs``) over AR of the same model, batch 1,
    while_loop form (``decode.bench.measure_point``; the drafting cost c is
    measured once per G and shared: same architecture); rows with label,
    method, num_draft_tokens, temperature, speedup, tau, wall_s_median,
    tokens_per_s, draft_cost_ratio_c."""
    decoders = {k: d for k, d in self.decoders.items()
                if k == "ar" or int(k.split("G")[1]) in gs}
    rows = []
    for t in temperatures:
      for r in measure_point(decoders, prompts, 1, max_new_tokens, SamplingParams(temperature=t),
                             max(repeats, 1) * len(prompts), draft_cache=self.draft_cache,
                             flops_cache=self.flops_cache):
        rows.append({k: r.get(k) for k in ("label", "method", "num_draft_tokens", "temperature",
                                           "speedup", "tau", "wall_s_median", "tokens_per_s",
                                           "draft_cost_ratio_c")})
    return rows
