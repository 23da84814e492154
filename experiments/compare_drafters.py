r"""MTP drafting vs independent small draft models, for one trained MTP target.

    python -m experiments.compare_drafters --workdir runs/tiny --runs_dir runs/drafters \
        --out results/compare_drafters [--draft_steps N] [--num_draft_tokens 1,2,3] \
        [--temperatures 0,1] [--repeats 10] [--max_new_tokens 128]

The target is the MTP model in ``--workdir`` (D modules, DeepSeek-V3 eq.
21-23); its drafter is those modules (``method="mtp"``). Against it, two
independent draft models (``mtp.depth = 0``, classic speculative decoding,
Leviathan et al. 2023, ``method="draft"``), trained on the target's dataset
with the target's batch, sequence length, schedule and (unless
``--draft_steps``) number of steps, in ``--runs_dir`` (a finished run is
reused untouched, an interrupted one resumes):

- param-matched: a draft whose total parameter count (its own embedding and
  head included: nothing is shared with the target) is within 10 % of the
  MTP modules' count, the shallowest such (then the closest), searched over
  1..L_target layers and widths that are multiples of the target's head_dim
  up to its d_model (``param_matched_arch``). For configs/tiny.py: 2 layers
  at d_model 128, 427,648 parameters vs 460,032 in the two MTP modules.
- cost-matched: among one-layer drafts at widths d_model/4, /2, /1
  (``--cost_candidates 1x64,2x128,...`` searches others), the one whose
  measured drafting step (``scripts.bench_lib.draft_time_s`` with random weights,
  G = D, T = 0, batch 1) is closest in time to the MTP drafter's, i.e. the
  draft whose cost ratio c is closest to the MTP drafter's
  (``calibrate_cost_arch``). A note says when none comes within 1.5x: on 2
  CPU cores at commit 7fd0593 the MTP drafter's G = 2 step for runs/tiny
  took 0.48 ms, a 1 x 128 draft's 0.32 ms, 1 x 64 and 1 x 32 0.18 ms
  (per-operation overhead, not FLOPs, sets these costs), so 1 x 128 is
  chosen.

Both choices can be forced (``--param_arch 2x128``, ``--cost_arch 1x64``);
automatic choices are stored in RUNS_DIR/arch_selection.json and reused, so
a rerun resumes the same runs. ``--draft_workdir [LABEL=]PATH`` (repeatable)
uses already-trained draft checkpoints instead (nothing is trained).

Reported per drafter: extra parameters (MTP: the D modules; draft: the
drafting model's backbone, embedding and head included), extra training
cost (a train-step probe in this process, interleaved repeats, same
approach as experiments/bench_train.py: MTP = step time with D / step time of
the same target with D = 0, minus 1; draft = its own separate run, step
time x steps / (D = 0 target step time x target steps); XLA FLOP ratios
beside them), the training wall time and median step time of the draft
runs, validation bits per byte (from each run's final_metrics.json), and
for every G and temperature at batch 1 on held-out prompts: tau, alpha per
position, the measured draft cost ratio c and its FLOP share, speedup over AR, the ideal
speedup of Leviathan et al. (Theorem 3.8) and efficiency (cells decoded
side by side with interleaved repeats: ``scripts.bench_lib.measure_point`` over
``run_cells`` / ``summarize_cell``).

Writes OUT.json, OUT.md (tables + command) and OUT.png (tau and speedup vs G
per drafter). Runtime on 2 shared CPU cores for runs/tiny: the two draft
runs (450 steps of 16 x 128 bytes at the ~0.23 s / ~0.13 s per step that
the probe measured for 2 x 128 / 1 x 128: about 2-3 and 1-2 min with
compilation and evaluation), cost calibration ~0.5 min, train probe ~1
min, decoding (10 cells, 2 temperatures) ~4 min: about 10 min in all,
about 5 min when the draft runs are reused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

from mtp import cli

if __name__ == "__main__":     # a flag out of range: one line, before the imports below load jax
  from decode.limits import MAX_DRAFT_TOKENS
  cli.refuse_bad_flags(num_draft_tokens=(list, int, 1, MAX_DRAFT_TOKENS),
                       temperatures=(list, float, 0), batch_size=(int, 1), prompt_bytes=(int, 1),
                       max_new_tokens=(int, 1), repeats=(int, 1), calib_repeats=(int, 1),
                       probe_steps=(int, 1), probe_repeats=(int, 1), draft_steps=(int, 0))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from decode.decoder import MAX_DRAFT_TOKENS, DecodeError, Decoder, SamplingParams  # noqa: E402
from experiments import common  # noqa: E402
from mtp import loading  # noqa: E402
from mtp import report  # noqa: E402
from mtp import data as data_lib  # noqa: E402
from mtp.model import build_model, count_params  # noqa: E402
from scripts.bench_lib import draft_time_s, measure_point  # noqa: E402
from scripts.draft_models import arch_name, cost_candidates, draft_config, param_count, param_matched_arch  # noqa: E402
from train.bench import train_step_costs  # noqa: E402
from train.loop import train  # noqa: E402

SELECTION_FILE = "arch_selection.json"
WALLS_FILE = "train_walls.json"


def parse_arch(ap: argparse.ArgumentParser, flag: str, text: str) -> tuple[int, int] | None:
  """"auto" -> None; "LxD" -> (L, D) with L, D >= 1; else an argparse error naming the flag."""
  if text == "auto":
    return None
  try:
    layers, width = (int(x) for x in text.lower().split("x"))
  except ValueError:
    layers = width = 0
  if layers < 1 or width < 2:
    ap.error(f"--{flag}={text!r}: give 'auto' or LAYERSxD_MODEL with LAYERS >= 1 and D_MODEL >= 2 "
             "(e.g. 2x128)")
  return layers, width


# -- the library: the cost-matched draft, the drafter grid ---------------------------------

def calibrate_cost_arch(target, target_cfg, candidates, prompt: str, max_new_tokens: int,
                        num_draft_tokens: int, repeats: int) -> tuple[tuple[int, int], list]:
  """The candidate (num_layers, d_model) whose drafting step is closest in
  time (|log ratio|) to the MTP drafter's, i.e. whose cost ratio c is
  closest to the MTP drafter's. Times: ``draft_time_s``
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


# -- helpers -------------------------------------------------------------------------------

def final_metrics(workdir: str) -> dict | None:
  path = os.path.join(workdir, "final_metrics.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def val_bpb(final: dict | None) -> float | None:
  """Main-head validation bits per byte of a finished run (None if unknown)."""
  return ((final or {}).get("eval") or {}).get("main/bits_per_byte")


def _load_json(path: str) -> dict:
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  return {}


def _dump_json(path: str, obj) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  cli.write_atomic(path, json.dumps(obj, indent=2))


def select_archs(args, ap, cfg, target, counts, prompt) -> tuple[dict, dict]:
  """{"param": (L, D), "cost": (L, D)} and the selection record. Automatic
  choices are saved to RUNS_DIR/arch_selection.json and reused by later runs
  made for the same target model (and, for the cost choice, the same
  candidates), so that a rerun resumes the same draft runs."""
  path = os.path.join(args.runs_dir, SELECTION_FILE)
  target_model = dataclasses.asdict(cfg.model)
  saved = _load_json(path)
  if saved.get("target_model") != target_model or saved.get("target_depth") != cfg.mtp.depth:
    saved = {}
  forced = {"param": parse_arch(ap, "param_arch", args.param_arch),
            "cost": parse_arch(ap, "cost_arch", args.cost_arch)}
  candidates = (cost_candidates(cfg) if args.cost_candidates == "auto" else
                [parse_arch(ap, "cost_candidates", x) for x in args.cost_candidates.split(",")])
  record = {"target_model": target_model, "target_depth": cfg.mtp.depth,
            "param_arch": saved.get("param_arch"), "param_search": saved.get("param_search"),
            "cost_arch": None, "cost_candidates": [list(c) for c in candidates],
            "cost_calibration": None}
  if saved.get("cost_candidates") == record["cost_candidates"]:
    record["cost_arch"], record["cost_calibration"] = saved.get("cost_arch"), saved.get("cost_calibration")
  if record["param_arch"] is None and not forced["param"]:
    arch, record["param_search"] = param_matched_arch(cfg, counts["mtp"])
    record["param_arch"] = list(arch)
  if record["cost_arch"] is None and not forced["cost"]:
    print(f"calibrating the cost-matched draft: drafting time of {len(candidates)} candidates vs "
          "the MTP drafter ...", flush=True)
    arch, record["cost_calibration"] = calibrate_cost_arch(
        target, cfg, candidates, prompt, args.max_new_tokens, cfg.mtp.depth, args.calib_repeats)
    record["cost_arch"] = list(arch)
  _dump_json(path, record)
  archs = {"param": forced["param"] or tuple(record["param_arch"]),
           "cost": forced["cost"] or tuple(record["cost_arch"])}
  ratio = next((r["time_ratio_to_mtp"] for r in record["cost_calibration"] or []
                if (r["num_layers"], r["d_model"]) == archs["cost"]), None)
  if not forced["cost"] and ratio is not None and not 1 / 1.5 <= ratio <= 1.5:
    print(f"note: no candidate drafts at the MTP drafter's cost; the closest, "
          f"{archs['cost'][0]}x{archs['cost'][1]}, takes {ratio:.2f}x its time (widen the "
          "search with --cost_candidates)", flush=True)
  return archs, {**record, "forced": {k: bool(v) for k, v in forced.items()},
                 "used_param_arch": list(archs["param"]), "used_cost_arch": list(archs["cost"]),
                 "cost_time_ratio_to_mtp": ratio}


def train_drafts(args, cfg, archs) -> list[dict]:
  """Trains (or resumes / reuses) one draft run per distinct architecture in
  RUNS_DIR; returns [{label, role, workdir, arch, wall_s, trained_now}]."""
  steps = args.draft_steps or cfg.train.num_steps
  walls_path = os.path.join(args.runs_dir, WALLS_FILE)
  drafts = {}
  for role, (layers, width) in archs.items():
    name = arch_name(layers, width, steps)
    if name in drafts:
      drafts[name]["role"] += f"+{role}"
      continue
    dcfg = draft_config(cfg, layers, width, num_steps=steps, data_dir=args.data_dir or None)
    workdir = os.path.join(args.runs_dir, name)
    already = final_metrics(workdir) is not None
    print(f"{'reusing' if already else 'training'} {role}-matched draft {name} "
          f"({param_count(dcfg)['total']:,} params) in {workdir}", flush=True)
    t0 = time.perf_counter()
    res = train(dcfg, workdir)
    wall = time.perf_counter() - t0
    walls = _load_json(walls_path)
    if not already:
      walls[name] = walls.get(name, 0.0) + wall   # resumed runs add up their pieces
      _dump_json(walls_path, walls)
    # a SIGINT / SIGTERM makes train() checkpoint and return early: stop, do not report it as done
    cli.exit_if_interrupted(res.as_dict(), dcfg.train.num_steps, f"training of the {role}-matched draft {name}",
                            workdir)
    drafts[name] = {"label": name, "role": role, "workdir": workdir, "trained_now": not already,
                    "wall_s": walls.get(name)}
  return list(drafts.values())


def given_drafts(specs: list[str]) -> list[dict]:
  out = []
  for i, spec in enumerate(specs):
    label, _, path = spec.rpartition("=")
    label = label or f"draft{i + 1}_{os.path.basename(os.path.normpath(path))}"
    out.append({"label": label, "role": "given", "workdir": path, "trained_now": False,
                "wall_s": None})
  return out


def drafter_rows(cfg, counts: dict, workdir: str, drafts: list[dict], probe: dict) -> list[dict]:
  """The drafters table: the target's MTP modules (``counts``: its
  ``count_params``) and every draft (``drafts`` with cfg, model, step
  loaded), with extra parameters, extra training cost from the train-step
  ``probe`` (``train_step_costs`` of "target", "target_d0" and each draft
  label) and their runs' final metrics."""
  base_s, base_flops = probe["target_d0"]["step_s"], probe["target_d0"]["flops"]
  flop_ratio = lambda name: (probe[name]["flops"] / base_flops
                             if probe[name]["flops"] and base_flops else None)
  target_final = final_metrics(workdir)
  target_steps = cfg.train.num_steps
  drafters = [{
      "label": "mtp", "role": "target's MTP modules", "method": "mtp", "workdir": workdir,
      "architecture": f"{cfg.mtp.depth} MTP modules (1 block each, shared embedding/head)",
      "extra_params": counts["mtp"], "extra_params_ratio": counts["mtp"] / counts["backbone"],
      "probe_step_s": probe["target"]["step_s"], "probe_step_s_d0": base_s,
      "extra_train_cost_time": probe["target"]["step_s"] / base_s - 1,
      "extra_train_cost_flops": (flop_ratio("target") - 1) if flop_ratio("target") else None,
      "train_steps": target_steps, "run_step_time_s": (target_final or {}).get("step_time_s"),
      "train_wall_s": None, "val_bpb": val_bpb(target_final)}]
  for d in drafts:
    dc, dcounts = d["cfg"], count_params(d["model"])
    steps_ratio = dc.train.num_steps / target_steps
    final = final_metrics(d["workdir"])
    drafters.append({
        "label": d["label"], "role": d["role"], "method": "draft", "workdir": d["workdir"],
        "architecture": f"{dc.model.num_layers} layer{'s' * (dc.model.num_layers > 1)}, "
                        f"d_model {dc.model.d_model}, "
                        f"{dc.model.num_heads}/{dc.model.num_kv_heads} heads, MLP {dc.model.mlp_dim}"
                        + ("" if dc.mtp.depth == 0 else f" (its D = {dc.mtp.depth} MTP modules unused)"),
        "num_layers": dc.model.num_layers, "d_model": dc.model.d_model,
        # the drafting model: backbone incl. its own embedding and head (nothing shared)
        "extra_params": dcounts["backbone"], "extra_params_ratio": dcounts["backbone"] / counts["backbone"],
        "probe_step_s": probe[d["label"]]["step_s"],
        "extra_train_cost_time": probe[d["label"]]["step_s"] / base_s * steps_ratio,
        "extra_train_cost_flops": (flop_ratio(d["label"]) * steps_ratio) if flop_ratio(d["label"]) else None,
        "train_steps": dc.train.num_steps, "run_step_time_s": (final or {}).get("step_time_s"),
        "train_wall_s": d["wall_s"], "trained_now": d["trained_now"], "val_bpb": val_bpb(final),
        "checkpoint_step": d["step"]})
  return drafters


# -- report ----------------------------------------------------------------------------

def markdown(drafters: list[dict], rows: list[dict], meta: dict) -> str:
  t = meta["target"]
  lines = [f"# MTP drafting vs independent draft models: {meta['workdir']} (step {meta['checkpoint_step']})",
           "",
           f"{report.machine(meta)}, JAX {meta['jax_version']}, commit "
           f"{meta['commit']}, {meta['date']}. Target: {t['num_layers']} layers, d_model "
           f"{t['d_model']}, D = {t['depth']} MTP modules, backbone {t['params']['backbone']:,} "
           f"params, validation bpb {report.fmt(t['val_bpb'], '.3f')}. Drafts trained on {t['dataset']} "
           f"with the target's batch and schedule ({meta['draft_steps']} steps) unless given with "
           "--draft_workdir.", "",
           "## Drafters", "",
           "Extra training cost: MTP = (train step with D) / (same target, D = 0) - 1; draft = "
           "its separate run, step time x steps / (D = 0 target step time x target steps); "
           "both from one train-step probe in this process (interleaved repeats); FLOP ratios "
           "from XLA's cost analysis of the same compiled steps.", "",
           "| drafter | role | architecture | extra params | / target backbone | extra training "
           "cost (time) | (FLOPs) | probe ms/step | run ms/step | run wall | val bpb |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  pct = lambda x: "-" if x is None else f"{100 * x:+.0f}%"
  for d in drafters:
    lines.append(
        f"| {d['label']} | {d['role']} | {d['architecture']} | {d['extra_params']:,} | "
        f"{d['extra_params_ratio']:.2f} | {pct(d['extra_train_cost_time'])} | "
        f"{pct(d['extra_train_cost_flops'])} | {report.fmt(d['probe_step_s'] and d['probe_step_s'] * 1e3, '.1f')} | "
        f"{report.fmt(d['run_step_time_s'] and d['run_step_time_s'] * 1e3, '.1f')} | "
        f"{report.fmt(d['train_wall_s'] and d['train_wall_s'] / 60, '.1f')}{'' if d['train_wall_s'] is None else ' min'} | "
        f"{report.fmt(d['val_bpb'], '.3f')} |")
  sel = meta.get("selection")
  if sel:
    lines += ["", "## Draft selection", "",
              f"Used: param-matched {sel['used_param_arch'][0]} x {sel['used_param_arch'][1]}"
              f"{' (forced)' if sel['forced']['param'] else ''}, cost-matched "
              f"{sel['used_cost_arch'][0]} x {sel['used_cost_arch'][1]}"
              f"{' (forced)' if sel['forced']['cost'] else ''} (layers x d_model); MTP modules: "
              f"{t['params']['mtp']:,} params.", ""]
    if sel.get("param_search"):
      lines += ["Closest parameter counts: " + ", ".join(
          f"{c['num_layers']} x {c['d_model']}: {c['params']:,}" for c in sel["param_search"]) + ".", ""]
    if sel.get("cost_calibration"):
      lines += ["Cost calibration (random-weight drafts, G = D, T = 0, batch 1; drafting step time):", "",
                "| candidate | params | ms / drafting step | / MTP drafter |", "|---|---|---|---|"]
      for c in sel["cost_calibration"]:
        lines.append(f"| {c['num_layers']} x {c['d_model']} | {c['params']:,} | {c['draft_s'] * 1e3:.3f} | "
                     f"{c['time_ratio_to_mtp']:.2f} |")
      lines.append(f"| MTP (D = {t['depth']}) | {t['params']['mtp']:,} | "
                   f"{sel['cost_calibration'][0]['mtp_draft_s'] * 1e3:.3f} | 1.00 |")
  lines += ["", f"## Decoding (batch {meta['batch_size']}, {meta['max_new_tokens']} new tokens, "
            f"held-out prompts of ~{meta['prompt_bytes']} bytes, median of "
            f"{report.plural(meta['repeats'], 'interleaved repeat')}, while_loop form)", "",
            "c: drafting time per draft token / one AR step (drafting time measured inside a "
            "fori_loop, probed "
            + ("at every temperature" if meta["draft_cost_probe"] == "point" else "once, at the first "
               "temperature") + "); c (FLOPs): the c drafting would have if time followed "
            "XLA-counted FLOPs; ideal: Leviathan et al. 2023 Thm 3.8 "
            "with the measured alpha (i.i.d. fit of tau) and c; eff. = decoding-phase speedup (prefill excluded) / ideal.", "",
            "| T | drafter | G | tau | alpha_k | c | c (FLOPs) | speedup | ideal | eff. | tok/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    alphas = "/".join(report.fmt(a) for a in r["acceptance_rate_per_position"]) or "-"
    lines.append(
        f"| {r['temperature']:g} | {r['drafter']} | {r['num_draft_tokens'] or '-'} | {r['tau']:.2f} | "
        f"{alphas} | {report.fmt(r.get('draft_cost_ratio_c'))} | {report.fmt(r.get('draft_cost_ratio_c_flops'))} | "
        f"{r['speedup']:.2f}x | "
        f"{report.fmt(r.get('ideal_speedup'))} | {report.fmt(r.get('efficiency'))} | {r['tokens_per_s']:.0f} |")
  return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
  """tau and speedup vs G, one colour per drafter, solid/dashed/... and a
  marker per T; each (drafter, T) series is shifted by a small x offset so
  that coinciding points (e.g. every drafter's tau at T = 0) stay visible."""
  fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.4), dpi=100)
  drafters = list(dict.fromkeys(r["drafter"] for r in rows if r["method"] != "ar"))
  temps = sorted({r["temperature"] for r in rows})
  styles, markers = ["-", "--", ":", "-."], ["o", "s", "^", "D"]
  n_series = max(1, len(drafters) * len(temps))
  step = min(0.06, 0.5 / n_series)
  for i, name in enumerate(drafters):
    for j, t in enumerate(temps):
      pts = sorted((r["num_draft_tokens"], r["tau"], r["speedup"]) for r in rows
                   if r["drafter"] == name and r["temperature"] == t)
      if not pts:
        continue
      g, tau, sp = zip(*pts)
      shift = (i * len(temps) + j - (n_series - 1) / 2) * step
      g = [x + shift for x in g]
      kw = dict(color=f"C{i}", ls=styles[j % len(styles)], marker=markers[j % len(markers)],
                label=f"{name} T={t:g}")
      axes[0].plot(g, tau, **kw)
      axes[1].plot(g, sp, **kw)
  gs = sorted({r["num_draft_tokens"] for r in rows if r["method"] != "ar"})
  for ax in axes:
    ax.set_xticks(gs)
    ax.set_xlabel("draft tokens G")
  axes[0].set(ylabel="tau (tokens / target call)", title="mean accepted length")
  axes[1].axhline(1.0, color="gray", lw=0.8)
  axes[1].set(ylabel="speedup over AR", title="measured speedup (batch 1)")
  axes[0].legend(fontsize=6)
  common.save_figure(fig, path)


# -- main ---------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
  ap = cli.OneLineParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--workdir", required=True, help="trained MTP target (mtp.depth >= 1)")
  ap.add_argument("--runs_dir", default="runs/drafters", help="where the draft runs live")
  ap.add_argument("--draft_workdir", action="append", default=[], metavar="[LABEL=]PATH",
                  help="an already-trained draft checkpoint (repeatable); skips selection and training")
  ap.add_argument("--param_arch", default="auto", help="'auto' or LAYERSxD_MODEL of the param-matched draft")
  ap.add_argument("--cost_arch", default="auto", help="'auto' or LAYERSxD_MODEL of the cost-matched draft")
  ap.add_argument("--cost_candidates", default="auto",
                  help="'auto' (1 layer at d_model/4, /2, /1) or a comma list of LAYERSxD_MODEL "
                       "searched for the cost-matched draft")
  ap.add_argument("--draft_steps", type=int, default=0, help="draft training steps (default: the target's)")
  ap.add_argument("--data_dir", default="", help=cli.DATA_DIR_HELP)
  ap.add_argument("--num_draft_tokens", default="1,2,3", help="comma list of G >= 1")
  ap.add_argument("--temperatures", default="0,1", help="comma list of temperatures >= 0 (0: greedy)")
  ap.add_argument("--batch_size", type=int, default=1, help="rows per decode call, >= 1")
  ap.add_argument("--prompt_bytes", type=int, default=256, help="bytes per prompt, >= 1")
  ap.add_argument("--max_new_tokens", type=int, default=128, help="new tokens per row, >= 1")
  ap.add_argument("--repeats", type=int, default=10,
                  help="interleaved timed repeats, >= 1; repeat r decodes its own held-out prompt(s)")
  ap.add_argument("--calib_repeats", type=int, default=5, help="repeats of the cost calibration probe")
  ap.add_argument("--probe_steps", type=int, default=5, help="train steps per probe repeat")
  ap.add_argument("--probe_repeats", type=int, default=3, help="repeats of the train-step probe")
  ap.add_argument("--seed", type=int, default=0, help="held-out prompt sample seed")
  ap.add_argument("--draft_cost_probe", choices=("point", "once"), default="point",
                  help="measure the drafting time (for c) at every temperature, or once at the "
                       "first (each probe compiles: --quick uses once)")
  ap.add_argument("--out", default="results/compare_drafters", help="output prefix")
  ap.add_argument("--quick", action="store_true",
                  help="tiny sizes for tests: fills in --num_draft_tokens 2 --repeats 1 "
                       "--calib_repeats 1 --draft_cost_probe once --max_new_tokens 8 --prompt_bytes 48 "
                       "--probe_steps 1 --probe_repeats 1 --draft_steps 20 where not given")
  return ap


def check_flags(ap: argparse.ArgumentParser, args) -> tuple[list[int], list[float]]:
  """``--quick`` filled in, then every flag checked before anything loads
  (``ap.error`` naming the flag); returns (draft lengths G, temperatures)."""
  if args.quick:
    cli.apply_quick(ap, args, num_draft_tokens="2", repeats=1, calib_repeats=1,
                    draft_cost_probe="once", max_new_tokens=8, prompt_bytes=48, probe_steps=1,
                    probe_repeats=1, draft_steps=20)
  cli.check_positive(ap, args, ("batch_size", "prompt_bytes", "max_new_tokens", "repeats",
                            "calib_repeats", "probe_steps", "probe_repeats"))
  if args.draft_steps < 0:
    ap.error(f"--draft_steps={args.draft_steps} is out of range: must be >= 1 (0 = the target's)")
  gs = cli.parse_list(ap, "num_draft_tokens", args.num_draft_tokens, int, 1, MAX_DRAFT_TOKENS)
  temps = cli.parse_list(ap, "temperatures", args.temperatures, float, 0.0)
  for flag in ("param_arch", "cost_arch"):
    parse_arch(ap, flag, getattr(args, flag))
  if args.cost_candidates != "auto":
    for x in args.cost_candidates.split(","):
      if parse_arch(ap, "cost_candidates", x) is None:
        ap.error("--cost_candidates: give 'auto' or a comma list of LAYERSxD_MODEL")
  for spec in args.draft_workdir:
    if not os.path.isdir(spec.rpartition("=")[2]):
      ap.error(f"--draft_workdir={spec!r}: no such directory")
  return gs, temps


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  ap = parser()
  args = ap.parse_args(argv)
  gs, temps = check_flags(ap, args)
  cli.check_output_path("out", args.out, "prefix")
  cfg, target, step = loading.load_model(args.workdir)
  if cfg.mtp.depth < 1:
    ap.error(f"--workdir={args.workdir} holds a model with mtp.depth = 0: no MTP drafter to compare")
  counts = count_params(target)
  dataset = cfg.data.name
  prompts = data_lib.held_out_prompts(dataset, args.batch_size * args.repeats, args.prompt_bytes,
                                      seed=args.seed, data_dir=args.data_dir)

  selection = None
  if args.draft_workdir:
    drafts = given_drafts(args.draft_workdir)
  else:
    archs, selection = select_archs(args, ap, cfg, target, counts, prompts[0])
    drafts = train_drafts(args, cfg, archs)
  for d in drafts:
    d["cfg"], d["model"], d["step"] = loading.load_model(d["workdir"])
    if d["cfg"].model.vocab_size != cfg.model.vocab_size:
      ap.error(f"--draft_workdir {d['workdir']}: vocab_size {d['cfg'].model.vocab_size} differs from "
               f"the target's {cfg.model.vocab_size}")

  # training cost probe: target with D, the same target with D = 0, every draft as trained
  print("train-step probe ...", flush=True)
  probe_cfgs = {"target": cfg, "target_d0": cfg.replace(mtp=dict(depth=0)),
                **{d["label"]: d["cfg"] for d in drafts}}
  probe = train_step_costs(probe_cfgs, args.probe_steps, args.probe_repeats)
  target_final = final_metrics(args.workdir)
  target_steps = cfg.train.num_steps
  drafters = drafter_rows(cfg, counts, args.workdir, drafts, probe)
  # decoding: AR, MTP and every draft at every G, side by side per temperature
  rows = drafter_grid(target, {d["label"]: d["model"] for d in drafts}, gs, temps, prompts,
                      args.batch_size, args.max_new_tokens, args.repeats,
                      probe_once=args.draft_cost_probe == "once", log=lambda s: print(s, flush=True))

  meta = report.provenance(
      command=common.command_line(__file__, argv),
      workdir=args.workdir, checkpoint_step=step, config=cfg.to_dict(), runs_dir=args.runs_dir,
      target={"num_layers": cfg.model.num_layers, "d_model": cfg.model.d_model, "depth": cfg.mtp.depth,
              "params": counts, "dataset": dataset, "val_bpb": val_bpb(target_final),
              "train_steps": target_steps},
      selection=selection, draft_steps=args.draft_steps or target_steps,
      draft_configs={d["label"]: d["cfg"].to_dict() for d in drafts},
      train_probe={"steps": args.probe_steps, "repeats": args.probe_repeats, "results": probe},
      num_draft_tokens=gs, temperatures=temps, batch_size=args.batch_size,
      prompt_bytes=args.prompt_bytes, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
      prompt_seed=args.seed, draft_cost_probe=args.draft_cost_probe, quick=args.quick)
  results = {"drafters": drafters, "decode": rows}
  report.write_report(args.out, meta, results, markdown(drafters, rows, meta))
  plot(rows, args.out + ".png")
  print(f"wrote {args.out}.json, {args.out}.md and {args.out}.png")


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError,))
