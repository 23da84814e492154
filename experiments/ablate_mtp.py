r"""MTP ablation: depth D x loss weight lambda x seed at a fixed backbone.

Full run (the default grid, 26 cells: D = 0 once per seed plus D = 1..4 x
lambda = 0.1/0.3/1.0, 2 seeds; 200 steps of 16 x 128 tokens per cell). On 2
quiet CPU cores about 45 minutes: ~33 min of train steps (0.23 s/step at
D = 0 to ~0.5 s at D = 4), ~5 min of per-cell compile/eval/checkpoint, ~4 min
of decoding; proportionally longer on a shared machine:

    python -m experiments.ablate_mtp --config configs/tiny.py --depths 0,1,2,3,4 \
        --loss_weights 0.1,0.3,1.0 --seeds 0,1 --num_steps 200 --batch_size 16 \
        --seq_len 128 --runs_dir runs/ablate --out results/ablate_mtp

Every cell trains the config's backbone (its ``model`` section) with MTP
depth D and weight lambda (DeepSeek-V3 report, eq. 21-25:
L = L_main + lambda / D * sum_k L^k) on the same tokens: num_steps x
batch_size x seq_len, in the same data order for a given seed (the seed also
initialises the parameters), the same learning-rate schedule, and a final
evaluation on the same validation batches. D = 0 has no lambda and is trained
once per seed: it is the baseline. Each cell is a workdir RUNS_DIR/D2_lam0.3_s0
(RUNS_DIR/D0_s0 for the baseline); a finished cell is reused as it is
(``train.loop.train`` returns its final metrics), an interrupted one resumes
from its checkpoint, so re-running the same command resumes a partial grid. A
cell whose saved config differs from the requested one is refused (use a new
--runs_dir).

Two results, kept apart (docs/design.md section 7):

(a) training benefit: main-head validation loss and bits per byte at equal
    steps and tokens, per (D, lambda): mean over seeds, [min, max], the
    difference to D = 0 over the same seeds, and the training cost (median
    seconds per step, ratio to D = 0 of the same seed).
(b) decoding benefit: for each D >= 1 cell, MTP speculative decoding with
    num_draft_tokens G = D and G = 1 against AR decoding of the same model,
    batch 1, on held-out prompts of the config's dataset (validation split),
    at temperatures 0 and 1: mean accepted length tau, acceptance rate alpha_k
    per position, speedup over AR (while_loop form), the measured drafting
    cost ratio c; timed with ``ar_vs_mtp`` (scripts/bench_lib.py's run_cells /
    summarize_cell), aggregated over seeds.

Writes OUT.json (meta: provenance, grid, budget, backbone and cell configs;
results: per-cell rows with their decode rows, the two tables), OUT.md and
the plots OUT_train.png (val bpb vs D per lambda, D = 0 as a band) and
OUT_decode.png (tau vs D per lambda, T = 0 and T = 1).

Cells train in this process one after the other, sharing a persistent JAX
compilation cache (--compile_cache): cells of the same D reuse the compiled
init / eval / decoding programs and cells of the same (D, lambda) the train
step. Host memory grows by ~25 MB per cell with jax.clear_caches() after each
(measured on configs/tiny.py: 590 MB after the first cell, 930 MB after 13),
so no subprocess is needed; each cell's RSS is in the JSON. ``--quick`` trains a test-sized model
(d_model 32, 2 layers) on python_stdlib for a few steps (the tests use it).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time

from mtp import cli

if __name__ == "__main__":     # a flag out of range: one line, before the imports below load jax
  cli.refuse_bad_flags(depths=(list, int, 0, 16), loss_weights=(list, float, 0, None, True),
                       seeds=(list, int, 0), temperatures=(list, float, 0), num_steps=(int, 1),
                       batch_size=(int, 1), seq_len=(int, 2), eval_batches=(int, 1),
                       decode_prompts=(int, 1), decode_tokens=(int, 1), decode_repeats=(int, 1),
                       prompt_bytes=(int, 1))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from decode.decoder import DecodeError, Decoder, SamplingParams  # noqa: E402
from experiments import common  # noqa: E402
from experiments.ablation import Ablation, decode_table, decoded_cells, quick_config, train_grid, train_table  # noqa: E402
from mtp import loading  # noqa: E402
from mtp import report  # noqa: E402
from mtp import config as config_lib  # noqa: E402
from mtp import data as data_lib  # noqa: E402
from mtp.config import ConfigError  # noqa: E402
from mtp.timing import format_spread  # noqa: E402
from scripts.bench_lib import measure_point  # noqa: E402

FULL_COMMAND = ("python -m experiments.ablate_mtp --config configs/tiny.py --depths 0,1,2,3,4 "
                "--loss_weights 0.1,0.3,1.0 --seeds 0,1 --num_steps 200 --batch_size 16 "
                "--seq_len 128 --runs_dir runs/ablate --out results/ablate_mtp")

# defaults of the flags left unset: (full run, --quick)
DEFAULTS = {
    "depths": ("0,1,2,3,4", "0,1"), "loss_weights": ("0.1,0.3,1.0", "0.3"), "seeds": ("0,1", "0,1"),
    "num_steps": (200, 6), "batch_size": (16, 4), "seq_len": (128, 32), "eval_batches": (None, 2),
    "temperatures": ("0,1", "0,1"), "decode_prompts": (8, 1), "decode_tokens": (128, 8),
    "decode_repeats": (1, 1), "prompt_bytes": (120, 64),
}


# -- the decoding benefit: AR vs MTP of one trained cell ---------------------------

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


# -- report ----------------------------------------------------------------------

def _ms(s: dict, fmt: str = ".3f", scale: float = 1.0, signed: bool = False) -> str:
  """'mean [min, max]' of a spread over seeds, '-' when empty."""
  return format_spread(s, fmt, scale, signed, center="mean")


def markdown(meta: dict, ttable: list[dict], dtable: list[dict]) -> str:
  b = meta["budget"]
  lines = [
      f"MTP ablation: backbone of {meta['config_file']} ({meta['backbone_params']} backbone params), "
      f"{b['num_steps']} steps x {b['batch_size']} x {b['seq_len']} tokens per cell "
      f"({b['tokens_per_cell']:,} tokens), dataset {meta['dataset']}; {report.machine(meta)}, JAX {meta['jax_version']}, commit {meta['commit']}, {meta['date']}. "
      f"Values: mean over seeds [min, max].", "",
      f"## (a) Training benefit (validation after {b['num_steps']} steps, "
      f"{b['eval_batches']} batches of {b['batch_size']} x {b['seq_len']})", "",
      "Delta: cell - D=0 of the same seed (negative = MTP training helps the main head). "
      "ms/step: median milliseconds per training step; time/step vs D=0: its ratio to D=0 of the same seed (machine shared: noisy).", "",
      "| D | lambda | seeds | val loss (nats) | val bpb | delta bpb vs D=0 | delta loss | ms/step | "
      "time/step vs D=0 | MTP top-1 acc k=1.. |",
      "|---|---|---|---|---|---|---|---|---|---|"]
  for r in ttable:
    acc = "/".join(f"{a:.3f}" for a in r["mtp_accuracy"]) or "-"
    lam = "-" if r["loss_weight"] is None else f"{r['loss_weight']:g}"
    seeds = ",".join(map(str, r["seeds"])) + (
        f" (diverged: {','.join(map(str, r['diverged_seeds']))})" if r["diverged_seeds"] else "")
    base = r["depth"] == 0
    lines.append(
        f"| {r['depth']} | {lam} | {seeds} | {_ms(r['val_loss'], '.4f')} | {_ms(r['val_bpb'], '.4f')} | "
        f"{'(baseline)' if base else _ms(r['delta_bpb'], '.4f', signed=True)} | "
        f"{'(baseline)' if base else _ms(r['delta_loss'], '.4f', signed=True)} | "
        f"{_ms(r['step_time_s'], '.0f', 1e3)} | {_ms(r['step_time_ratio'], '.2f')} | {acc} |")
  d = meta["decode"]
  lines += [
      "", "## (b) Decoding benefit (MTP speculative decoding vs AR of the same model)", "",
      f"Batch 1, while_loop form, {report.plural(d['runs_per_method'], 'decode')} per method and "
      f"temperature ({report.plural(d['num_prompts'], 'held-out prompt')} of ~{d['prompt_bytes']} bytes "
      f"from {meta['dataset']} validation x {report.plural(d['repeats'], 'repeat')}), {d['max_new_tokens']} new tokens each; speedup = median AR wall "
      "/ median MTP wall in the same cell; c = draft time per draft token / one AR step. "
      "Kept apart from (a): a better draft is not a better main head.", "",
      "One row per (D, lambda, G); per temperature T: tau, alpha_k (k = 1..G, mean over seeds), "
      "speedup over AR; c at the first temperature.", ""]
  temps = d["temperatures"]
  head = "| D | lambda | G | seeds | " + " | ".join(
      f"T={t:g} tau | T={t:g} alpha_k | T={t:g} speedup" for t in temps) + " | c |"
  lines += [head, "|" + "---|" * (5 + 3 * len(temps))]
  by_key: dict = {}
  for r in dtable:
    by_key.setdefault((r["depth"], r["loss_weight"], r["num_draft_tokens"]), {})[r["temperature"]] = r
  for (depth, lam, g), rows in sorted(by_key.items()):
    cols, first = [], rows.get(temps[0]) or next(iter(rows.values()))
    for t in temps:
      r = rows.get(t)
      if r is None:
        cols.append("- | - | -")
        continue
      alphas = "/".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_rate_per_position"])
      cols.append(f"{_ms(r['tau'], '.2f')} | {alphas} | {_ms(r['speedup'], '.2f')}")
    lines.append(f"| {depth} | {lam:g} | {g} | {','.join(map(str, first['seeds']))} | "
                 + " | ".join(cols) + f" | {_ms(first['draft_cost_ratio_c'], '.2f')} |")
  if not dtable:
    lines.append("| - | - | - | (no D >= 1 cell) | " + " | ".join("- | - | -" for _ in temps) + " | - |")
  lines += ["", "Full default grid (26 cells, ~45 min on 2 quiet CPU cores):", "", f"    {FULL_COMMAND}"]
  return "\n".join(lines) + "\n"


def _errbar(s: dict) -> tuple[float, list[list[float]]]:
  return s["mean"], [[s["mean"] - s["min"]], [s["max"] - s["mean"]]]


def plot_train(ttable: list[dict], path: str) -> None:
  """Left: val bpb vs D, one line per lambda (error bars: min/max over
  seeds), the D = 0 baseline as a horizontal band (min..max) with its mean.
  Right: the paired difference to D = 0 (same seeds), zero line = no benefit."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=100)
  base = [r for r in ttable if r["depth"] == 0 and r["val_bpb"]["n"]]
  if base:
    s = base[0]["val_bpb"]
    ax.axhspan(s["min"], s["max"], color="0.85", label="D=0 (min..max)")
    ax.axhline(s["mean"], color="0.4", lw=1, ls="--", label="D=0 mean")
  ax2.axhline(0.0, color="0.4", lw=1, ls="--")
  lams = sorted({r["loss_weight"] for r in ttable if r["depth"] > 0})
  for i, lam in enumerate(lams):
    rs = [r for r in ttable if r["loss_weight"] == lam and r["depth"] > 0 and r["val_bpb"]["n"]]
    xs = [r["depth"] + (i - (len(lams) - 1) / 2) * 0.06 for r in rs]
    if rs:
      ys, errs = zip(*(_errbar(r["val_bpb"]) for r in rs))
      ax.errorbar(xs, ys, yerr=np.concatenate(errs, 1), marker="o", ms=4, capsize=3,
                  color=f"C{i}", label=f"lambda={lam:g}")
    pairs = [(x, r) for x, r in zip(xs, rs) if r["delta_bpb"]["n"]]
    if pairs:
      ys, errs = zip(*(_errbar(r["delta_bpb"]) for _, r in pairs))
      ax2.errorbar([x for x, _ in pairs], ys, yerr=np.concatenate(errs, 1), marker="o", ms=4,
                   capsize=3, color=f"C{i}", label=f"lambda={lam:g}")
  depths = sorted({r["depth"] for r in ttable})
  ax.set(xlabel="MTP depth D", ylabel="main-head val bits/byte", xticks=depths)
  ax.set_title("val bpb (error bars: min/max over seeds)", fontsize=9)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)
  ax2.set(xlabel="MTP depth D", ylabel="delta bpb vs D=0, same seed", xticks=depths)
  ax2.set_title("paired difference (< 0: MTP training helps)", fontsize=9)
  if ax2.get_legend_handles_labels()[0]:
    ax2.legend(fontsize=7)
  common.save_figure(fig, path)


def plot_decode(dtable: list[dict], path: str) -> None:
  """tau vs D per lambda, one panel per temperature; solid G = D, dashed
  G = 1; error bars min/max over seeds."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  temps = sorted({r["temperature"] for r in dtable}) or [0.0]
  fig, axes = plt.subplots(1, len(temps), figsize=(4 * len(temps) + 1, 3.4), dpi=100, squeeze=False)
  lams = sorted({r["loss_weight"] for r in dtable})
  colors = {lam: f"C{i}" for i, lam in enumerate(lams)}
  for ax, t in zip(axes[0], temps):
    for i, lam in enumerate(lams):
      for kind, ls in (("G=D", "-"), ("G=1", "--")):
        rs = sorted((r for r in dtable if r["temperature"] == t and r["loss_weight"] == lam and
                     r["num_draft_tokens"] == (r["depth"] if kind == "G=D" else 1)),
                    key=lambda r: r["depth"])
        if not rs:
          continue
        xs = [r["depth"] + (i - (len(lams) - 1) / 2) * 0.06 for r in rs]
        ys, errs = zip(*(_errbar(r["tau"]) for r in rs))
        ax.errorbar(xs, ys, yerr=np.concatenate(errs, 1), color=colors[lam], ls=ls, marker="o", ms=3,
                    capsize=2, label=f"lambda={lam:g} {kind}")
    ax.set_title(f"T = {t:g}", fontsize=9)
    ax.set_xticks(sorted({r["depth"] for r in dtable}) or [1])
    ax.set_xlabel("MTP depth D")
    ax.set_ylabel("tau (tokens / target call)")
    if ax.get_legend_handles_labels()[0]:
      ax.set_ylim(bottom=1.0)          # tau >= 1 (the bonus / correction token)
      ax.legend(fontsize=6)
  fig.suptitle("Decoding: mean accepted length (error bars: min/max over seeds)", fontsize=9)
  common.save_figure(fig, path)


# -- main ------------------------------------------------------------------------

def _parse_list(ap, flag: str, text: str, typ, lo, hi=None) -> list:
  """Comma list of ``typ`` in [lo, hi] (hi None: no upper bound), no duplicates
  (``cli.parse_list``); argparse error naming the flag otherwise."""
  return cli.parse_list(ap, flag, text, typ, lo, hi, duplicates="error")


def parser() -> argparse.ArgumentParser:
  ap = cli.OneLineParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--config", default="configs/tiny.py",
                  help="config file; its model section is the backbone")
  ap.add_argument("--depths", help="MTP depths D, comma list in [0, 16] (default 0,1,2,3,4)")
  ap.add_argument("--loss_weights",
                  help="lambda values for D >= 1, comma list > 0 (default 0.1,0.3,1.0)")
  ap.add_argument("--seeds", help="training seeds (data order and init), comma list >= 0 (default 0,1)")
  ap.add_argument("--num_steps", type=int, help="training steps per cell (default 200)")
  ap.add_argument("--batch_size", type=int, help="sequences per step (default 16)")
  ap.add_argument("--seq_len", type=int, help="tokens per sequence (default 128)")
  ap.add_argument("--eval_batches", type=int, help="validation batches (default: the config's)")
  ap.add_argument("--data_dir", default="",
                  help="TFDS data dir (default: the config's data.data_dir, else $MTP_DATA_DIR, "
                       "else ~/.cache/mtp/tensorflow_datasets)")
  ap.add_argument("--runs_dir", default="runs/ablate", help="one workdir per cell under it")
  ap.add_argument("--temperatures", help="decoding temperatures, comma list >= 0 (default 0,1)")
  ap.add_argument("--decode_prompts", type=int, help="held-out prompts (default 8)")
  ap.add_argument("--decode_tokens", type=int, help="new tokens per decode (default 128)")
  ap.add_argument("--decode_repeats", type=int, help="decodes per prompt (default 1)")
  ap.add_argument("--prompt_bytes", type=int, help="bytes per prompt (default 120)")
  ap.add_argument("--compile_cache", default="auto",
                  help="JAX persistent compilation cache dir shared by the cells ('auto': "
                       "RUNS_DIR/jax_cache; 'none': off)")
  ap.add_argument("--out", default="results/ablate_mtp", help="output prefix")
  ap.add_argument("--quick", action="store_true",
                  help="test-sized model (d_model 32, 2 layers) on python_stdlib, a few steps")
  return ap


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  ap = parser()
  args = common.parse_with_defaults(ap, argv, DEFAULTS)
  depths = _parse_list(ap, "depths", args.depths, int, 0, 16)
  lams = _parse_list(ap, "loss_weights", args.loss_weights, float, 0.0)
  if any(lam <= 0 for lam in lams):
    ap.error(f"--loss_weights={args.loss_weights!r}: every value must be > 0 "
             "(D = 0 is the no-MTP baseline)")
  seeds = _parse_list(ap, "seeds", args.seeds, int, 0)
  temps = _parse_list(ap, "temperatures", args.temperatures, float, 0.0)
  for flag, lo in (("num_steps", 1), ("batch_size", 1), ("seq_len", 2), ("decode_prompts", 1),
                   ("decode_tokens", 1), ("decode_repeats", 1), ("prompt_bytes", 1)):
    if getattr(args, flag) < lo:
      ap.error(f"--{flag}={getattr(args, flag)}: must be an integer >= {lo}")
  if args.eval_batches is not None and args.eval_batches < 1:
    ap.error(f"--eval_batches={args.eval_batches}: must be an integer >= 1")
  try:
    base = quick_config() if args.quick else config_lib.load_config_file(args.config)
  except ConfigError as e:
    ap.error(f"--config: {e}")
  eval_batches = args.eval_batches or base.train.eval_batches
  budget = dict(num_steps=args.num_steps, batch_size=args.batch_size, seq_len=args.seq_len,
                eval_batches=eval_batches, data_dir=args.data_dir)
  try:
    ab = Ablation(base, depths, lams, seeds, budget, args.runs_dir, temperatures=temps,
                  decode_tokens=args.decode_tokens, decode_runs=args.decode_prompts * args.decode_repeats)
  except ConfigError as e:
    ap.error(f"--depths/--num_steps/--batch_size/--seq_len give an invalid cell config: {e}")
  data_dir = args.data_dir or base.data.data_dir
  try:   # fail on the data before training anything
    ab.prompts = (data_lib.held_out_prompts(base.data.name, args.decode_prompts, args.prompt_bytes,
                                            data_dir=data_dir) if any(d >= 1 for d in depths) else [])
  except data_lib.DataError as e:
    ap.error(f"--prompt_bytes/--data_dir: {e}")
  # refuse a runs_dir trained with other settings before training anything
  for name, diffs in ab.saved_config_differences()[:1]:
    ap.error(f"--runs_dir={args.runs_dir!r}: cell {name} was trained with other settings "
             f"(saved != requested): {'; '.join(diffs)}; use a new --runs_dir or the same flags")
  cache_dir = (None if args.compile_cache == "none" else
               os.path.join(args.runs_dir, "jax_cache") if args.compile_cache == "auto" else
               args.compile_cache)
  with cli.compile_cache(cache_dir):
    return _run(args, argv, ab, cache_dir)


def _clear():
  jax.clear_caches()
  gc.collect()


def _run(args, argv, ab: Ablation, cache_dir: str | None):
  """The grid: train every cell, decode the D >= 1 cells, write the reports."""
  log = lambda s: print(s, flush=True)
  cells, cfgs, base, n, t_start = ab.cells, ab.cfgs, ab.base, len(ab.cells), time.perf_counter()
  log(f"MTP ablation: {n} cells ({len(ab.seeds)} seeds x (D=0 + {len([d for d in set(ab.depths) if d])} "
      f"depths x {len(ab.loss_weights)} lambdas)), {args.num_steps} steps x {args.batch_size} x "
      f"{args.seq_len} tokens each, runs under {args.runs_dir}")
  rc = train_grid(ab, log=log, after_cell=_clear)
  if rc is not None:
    return rc
  t_train = time.perf_counter() - t_start

  dec_cells = decoded_cells(ab)
  for k, c in enumerate(dec_cells, 1):
    t0 = time.perf_counter()
    c["decode"] = ar_vs_mtp(loading.load_model(c["workdir"])[1], ab.prompts, ab.temperatures,
                            ab.decode_tokens, ab.decode_runs)
    _clear()
    c["decode_wall_s"] = time.perf_counter() - t0
    taus = ", ".join(f"T={r['temperature']:g} G={r['num_draft_tokens']}: tau {r['tau']:.2f} "
                     f"x{r['speedup']:.2f}" for r in c["decode"] if r["method"] == "mtp")
    log(f"[decode {k}/{len(dec_cells)}] {c['name']} in {c['decode_wall_s']:.1f} s: {taus}")
  t_decode = time.perf_counter() - t_start - t_train

  ttable, dtable = train_table(cells), decode_table(cells)
  cmd = common.command_line(__file__, argv)
  meta = report.provenance(
      command=cmd, full_command=FULL_COMMAND, quick=args.quick,
      config_file="--quick test model" if args.quick else args.config, dataset=base.data.name,
      grid={"depths": ab.depths, "loss_weights": ab.loss_weights, "seeds": ab.seeds, "num_cells": n,
            "cells": [c["name"] for c in cells]},
      budget={**ab.budget, "tokens_per_cell": args.num_steps * args.batch_size * args.seq_len,
              "warmup_steps": cfgs[cells[0]["name"]].train.warmup_steps,
              "learning_rate": base.train.learning_rate},
      backbone=dataclasses.asdict(base.model),
      backbone_params=next((c["params"]["backbone"] for c in cells if c.get("params")), None),
      cell_config=cfgs[cells[0]["name"]].to_dict(),
      decode={"temperatures": ab.temperatures, "num_prompts": args.decode_prompts,
              "repeats": args.decode_repeats, "runs_per_method": ab.decode_runs, "max_new_tokens": args.decode_tokens,
              "prompt_bytes": args.prompt_bytes, "batch_size": 1, "form": "while"},
      runs_dir=args.runs_dir, compile_cache=cache_dir, wall_s={"train": t_train, "decode": t_decode})
  results = {"cells": cells, "train_table": ttable, "decode_table": dtable}
  report.write_report(args.out, meta, results, markdown(meta, ttable, dtable))
  plot_train(ttable, args.out + "_train.png")
  plot_decode(dtable, args.out + "_decode.png")
  print(f"done in {time.perf_counter() - t_start:.0f} s (train {t_train:.0f} s, decode {t_decode:.0f} s); "
        f"wrote {args.out}.json, {args.out}.md, {args.out}_train.png, {args.out}_decode.png", flush=True)
  return 0


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError,))
