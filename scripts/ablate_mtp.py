r"""MTP ablation: depth D x loss weight lambda x seed at a fixed backbone.

Full run (the default grid, 26 cells: D = 0 once per seed plus D = 1..4 x
lambda = 0.1/0.3/1.0, 2 seeds; 200 steps of 16 x 128 tokens per cell). On 2
quiet CPU cores about 45 minutes: ~33 min of train steps (0.23 s/step at
D = 0 to ~0.5 s at D = 4), ~5 min of per-cell compile/eval/checkpoint, ~4 min
of decoding; proportionally longer on a shared machine:

    python scripts/ablate_mtp.py --config configs/tiny.py --depths 0,1,2,3,4 \
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
    cost ratio c; timed with scripts/bench_decode.py (run_cells /
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
import contextlib
import dataclasses
import gc
import json
import os
import resource
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtp import loading  # noqa: E402
from mtp import config as config_lib  # noqa: E402
from mtp import data as data_lib  # noqa: E402
from mtp.config import Config, ConfigError  # noqa: E402
from scripts import common  # noqa: E402

FULL_COMMAND = ("python scripts/ablate_mtp.py --config configs/tiny.py --depths 0,1,2,3,4 "
                "--loss_weights 0.1,0.3,1.0 --seeds 0,1 --num_steps 200 --batch_size 16 "
                "--seq_len 128 --runs_dir runs/ablate --out results/ablate_mtp")

# defaults of the flags left unset: (full run, --quick)
DEFAULTS = {
    "depths": ("0,1,2,3,4", "0,1"), "loss_weights": ("0.1,0.3,1.0", "0.3"), "seeds": ("0,1", "0,1"),
    "num_steps": (200, 6), "batch_size": (16, 4), "seq_len": (128, 32), "eval_batches": (None, 2),
    "temperatures": ("0,1", "0,1"), "decode_prompts": (8, 1), "decode_tokens": (128, 8),
    "decode_repeats": (1, 1), "prompt_bytes": (120, 64),
}


def quick_config() -> Config:
  """The test-sized config (as tests/conftest.tiny_config): d_model 32, 2
  layers, byte vocabulary, python_stdlib."""
  return config_lib.from_dict(dict(
      model=dict(vocab_size=264, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                 mlp_dim=64, max_seq_len=256),
      mtp=dict(depth=1, loss_weight=0.3),
      train=dict(num_steps=6, batch_size=4, seq_len=32, warmup_steps=2, log_every=2, eval_every=6,
                 eval_batches=2, learning_rate=1e-2),
      checkpoint=dict(every_steps=1000, keep=1)))


def cell_name(depth: int, loss_weight: float | None, seed: int) -> str:
  """Workdir name of a cell: ``D2_lam0.3_s0``; ``D0_s0`` for the baseline."""
  return f"D0_s{seed}" if depth == 0 else f"D{depth}_lam{loss_weight:g}_s{seed}"


def grid(depths: list[int], loss_weights: list[float], seeds: list[int]) -> list[dict]:
  """Cells in training order: per seed, D = 0 (once, lambda None) then every
  D >= 1 x lambda. Each cell: dict(name, depth, loss_weight, seed)."""
  cells = []
  for s in seeds:
    for d in sorted(set(depths)):
      for lam in ([None] if d == 0 else loss_weights):
        cells.append({"name": cell_name(d, lam, s), "depth": d, "loss_weight": lam, "seed": s})
  return cells


def cell_config(base: Config, depth: int, loss_weight: float | None, seed: int, *, num_steps: int,
                batch_size: int, seq_len: int, eval_batches: int, data_dir: str) -> Config:
  """``base`` with the cell's MTP section and the shared budget: its
  backbone (``model``) unchanged; train.seed, num_steps, batch_size,
  seq_len set; one evaluation at the end on ``eval_batches`` validation
  batches (the same for every cell); warmup at most num_steps / 4; about 8
  logged windows (for the step time); one checkpoint kept.

  Raises ConfigError (names the field) when the result is invalid.
  """
  r = dataclasses.replace
  t = base.train
  train = r(t, seed=seed, num_steps=num_steps, batch_size=batch_size, seq_len=seq_len,
            eval_every=num_steps, eval_batches=eval_batches,
            warmup_steps=min(t.warmup_steps, num_steps // 4),
            log_every=max(1, min(t.log_every, num_steps // 8)))
  cfg = r(base, mtp=r(base.mtp, depth=depth, loss_weight=0.0 if depth == 0 else loss_weight),
          train=train, data=r(base.data, data_dir=data_dir or base.data.data_dir),
          checkpoint=r(base.checkpoint, every_steps=min(base.checkpoint.every_steps, num_steps), keep=1))
  return config_lib.validate(cfg)


def config_differences(saved: dict, requested: dict) -> list[str]:
  """Dotted fields where two config dicts differ (``data.data_dir`` ignored:
  the same data may live elsewhere), as ``"field: saved != requested"``."""
  out = []
  for sec in sorted(set(saved) | set(requested)):
    a, b = saved.get(sec, {}), requested.get(sec, {})
    for k in sorted(set(a) | set(b)):
      if (sec, k) != ("data", "data_dir") and a.get(k) != b.get(k):
        out.append(f"{sec}.{k}: {a.get(k)!r} != {b.get(k)!r}")
  return out


def rss_mb() -> float:
  """Resident memory of this process now (MB; Linux /proc, else peak RSS)."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
  except (OSError, ValueError):
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train_cell(cfg: Config, workdir: str, log) -> dict:
  """Trains (or resumes, or reuses) one cell; returns the cell's metrics:
  step, reused, interrupted/signal, val_loss (nats/token), val_bpb,
  val_accuracy, mtp_accuracy [D] (top-1 of depth k on validation),
  step_time_s (median s/step), train_wall_s (s in this call), params, and
  ``diverged`` (message) when the training loss became NaN/inf.

  Raises ConfigError when ``workdir`` was trained with another config.
  """
  from train.loop import DivergedError, train
  path = os.path.join(workdir, "config.json")
  if os.path.exists(path):
    with open(path) as f:
      diffs = config_differences(json.load(f), cfg.to_dict())
    if diffs:
      raise ConfigError(f"cell workdir {workdir!r} was trained with another config (saved != "
                        f"requested): {'; '.join(diffs)}. Use a new --runs_dir or the same flags.")
  finished = os.path.exists(os.path.join(workdir, "final_metrics.json"))
  t0 = time.perf_counter()
  try:
    res = train(cfg, workdir, log=log)
  except DivergedError as e:
    return {"diverged": str(e), "reused": False, "train_wall_s": time.perf_counter() - t0}
  ev = res.get("eval") or {}
  return {"step": res["step"], "reused": finished, "interrupted": bool(res.get("interrupted")),
          "signal": res.get("signal"), "train_wall_s": time.perf_counter() - t0,
          "val_loss": ev.get("main/loss"), "val_bpb": ev.get("main/bits_per_byte"),
          "val_accuracy": ev.get("main/accuracy"),
          "mtp_accuracy": [ev.get(f"mtp_{k}/accuracy") for k in range(1, cfg.mtp.depth + 1)],
          "step_time_s": res.get("step_time_s"), "params": res.get("params")}


def decode_cell(workdir: str, prompts: list[str], temperatures: list[float], max_new_tokens: int,
                runs: int) -> list[dict]:
  """AR vs MTP speculative decoding (G = 1 and G = D) of one trained cell,
  batch 1, while_loop form, with ``bench_decode.measure_point``: ``runs``
  decodes per method and temperature (prompt r mod len(prompts), seed r),
  interleaved across methods; speedup = median AR wall / median MTP wall. The
  drafting cost c (draft time per draft token / one AR step) is measured once
  per G (at the first temperature: the temperature is a runtime argument of
  the same compiled step).

  Returns rows of summarize_cell (tau, acceptance_rate_per_position, speedup,
  draft_cost_ratio_c, ideal_speedup, ...) with temperature, batch_size,
  draft_s, ar_step_s; AR rows included (method "ar").
  """
  from decode.speculative import Decoder, SamplingParams
  from scripts.bench_decode import measure_point
  cfg, model, _ = loading.load_model(workdir)
  gs = sorted({1, cfg.mtp.depth})
  decoders = {"ar": Decoder(model, "ar"), **{f"mtp_G{g}": Decoder(model, "mtp", g) for g in gs}}
  draft_cache, rows = {}, []
  for t in temperatures:
    rows += measure_point(decoders, prompts, 1, max_new_tokens, SamplingParams(temperature=t), runs,
                          draft_cache=draft_cache)
  return rows


# -- tables (pure) -------------------------------------------------------------

def _spread(values: list[float]) -> dict:
  """mean, min, max, std (population), n of a list of floats (None when empty)."""
  if not values:
    return {"mean": None, "min": None, "max": None, "std": None, "n": 0}
  v = np.asarray(values, np.float64)
  return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max()),
          "std": float(v.std()), "n": int(v.size)}


def _ok(c: dict) -> bool:
  return c.get("val_bpb") is not None and not c.get("diverged")


def train_table(cells: list[dict]) -> list[dict]:
  """Training-benefit rows, one per (D, lambda), D = 0 first (lambda None).

  Each row: depth, loss_weight, seeds (used), val_loss / val_bpb (spread over
  seeds: mean, min, max, std, n), delta_loss / delta_bpb vs D = 0 over the
  seeds both have (per seed: cell - baseline; negative = MTP helps), step_time_s
  (spread), step_time_ratio (per seed: step time / D = 0 step time of that
  seed), mtp_accuracy (mean over seeds, per depth k), diverged (seeds).
  """
  base = {c["seed"]: c for c in cells if c["depth"] == 0 and _ok(c)}
  keys = sorted({(c["depth"], c["loss_weight"]) for c in cells}, key=lambda k: (k[0], k[1] or 0.0))
  rows = []
  for d, lam in keys:
    group = [c for c in cells if (c["depth"], c["loss_weight"]) == (d, lam)]
    ok = sorted((c for c in group if _ok(c)), key=lambda c: c["seed"])
    paired = [c for c in ok if c["seed"] in base]
    ratios = [c["step_time_s"] / base[c["seed"]]["step_time_s"] for c in paired
              if c.get("step_time_s") and base[c["seed"]].get("step_time_s")]
    accs = [c["mtp_accuracy"] for c in ok if c.get("mtp_accuracy")]
    rows.append({
        "depth": d, "loss_weight": lam, "seeds": [c["seed"] for c in ok],
        "val_loss": _spread([c["val_loss"] for c in ok]),
        "val_bpb": _spread([c["val_bpb"] for c in ok]),
        "delta_seeds": [c["seed"] for c in paired],
        "delta_loss": _spread([c["val_loss"] - base[c["seed"]]["val_loss"] for c in paired]),
        "delta_bpb": _spread([c["val_bpb"] - base[c["seed"]]["val_bpb"] for c in paired]),
        "step_time_s": _spread([c["step_time_s"] for c in ok if c.get("step_time_s")]),
        "step_time_ratio": _spread(ratios),
        "mtp_accuracy": [float(np.mean(x)) for x in zip(*accs)] if accs else [],
        "diverged_seeds": [c["seed"] for c in group if c.get("diverged")]})
  return rows


def decode_table(cells: list[dict]) -> list[dict]:
  """Decoding-benefit rows, one per (D, lambda, G, temperature) over the
  seeds' MTP rows: tau, speedup, draft_cost_ratio_c, ideal_speedup (spreads
  over seeds), acceptance_rate_per_position (mean over seeds per position k;
  None where no seed reached k), seeds."""
  groups: dict = {}
  for c in cells:
    for r in c.get("decode") or []:
      if r["method"] == "mtp":
        key = (c["depth"], c["loss_weight"], r["num_draft_tokens"], r["temperature"])
        groups.setdefault(key, []).append((c["seed"], r))
  rows = []
  for (d, lam, g, t), items in sorted(groups.items()):
    alphas = []
    for k in range(g):
      vals = [r["acceptance_rate_per_position"][k] for _, r in items
              if r["acceptance_rate_per_position"][k] is not None]
      alphas.append(float(np.mean(vals)) if vals else None)
    rows.append({"depth": d, "loss_weight": lam, "num_draft_tokens": g, "temperature": t,
                 "seeds": [s for s, _ in items],
                 **{k: _spread([r[k] for _, r in items if r.get(k) is not None])
                    for k in ("tau", "speedup", "draft_cost_ratio_c", "ideal_speedup")},
                 "acceptance_rate_per_position": alphas})
  return rows


# -- report ----------------------------------------------------------------------

def _ms(s: dict, fmt: str = ".3f", scale: float = 1.0, signed: bool = False) -> str:
  """'mean [min, max]' of a spread, '-' when empty."""
  if not s or s["mean"] is None:
    return "-"
  f = lambda x: format(x * scale, ("+" if signed else "") + fmt)
  return f(s["mean"]) if s["n"] == 1 else f"{f(s['mean'])} [{f(s['min'])}, {f(s['max'])}]"


def markdown(meta: dict, ttable: list[dict], dtable: list[dict]) -> str:
  b = meta["budget"]
  lines = [
      f"MTP ablation: backbone of {meta['config_file']} ({meta['backbone_params']} backbone params), "
      f"{b['num_steps']} steps x {b['batch_size']} x {b['seq_len']} tokens per cell "
      f"({b['tokens_per_cell']:,} tokens), dataset {meta['dataset']}; {common.machine(meta)}, JAX {meta['jax_version']}, commit {meta['commit']}, {meta['date']}. "
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
      f"Batch 1, while_loop form, {common.plural(d['runs_per_method'], 'decode')} per method and "
      f"temperature ({common.plural(d['num_prompts'], 'held-out prompt')} of ~{d['prompt_bytes']} bytes "
      f"from {meta['dataset']} validation x {common.plural(d['repeats'], 'repeat')}), {d['max_new_tokens']} new tokens each; speedup = median AR wall "
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
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


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
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


# -- main ------------------------------------------------------------------------

def _parse_list(ap, flag: str, text: str, typ, lo, hi=None) -> list:
  """Comma list of ``typ`` in [lo, hi] (hi None: no upper bound), no duplicates
  (``common.parse_list``); argparse error naming the flag otherwise."""
  return common.parse_list(ap, flag, text, typ, lo, hi, duplicates="error")


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
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
  args = ap.parse_args(argv)
  for k, (full, quick) in DEFAULTS.items():
    if getattr(args, k) is None:
      setattr(args, k, quick if args.quick else full)
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
  cells = grid(depths, lams, seeds)
  budget = dict(num_steps=args.num_steps, batch_size=args.batch_size, seq_len=args.seq_len,
                eval_batches=eval_batches, data_dir=args.data_dir)
  try:
    cfgs = {c["name"]: cell_config(base, c["depth"], c["loss_weight"], c["seed"], **budget)
            for c in cells}
  except ConfigError as e:
    ap.error(f"--depths/--num_steps/--batch_size/--seq_len give an invalid cell config: {e}")
  data_dir = args.data_dir or base.data.data_dir
  try:   # fail on the data before training anything
    prompts = (data_lib.held_out_prompts(base.data.name, args.decode_prompts, args.prompt_bytes,
                                         data_dir=data_dir) if any(d >= 1 for d in depths) else [])
  except data_lib.DataError as e:
    ap.error(f"--prompt_bytes/--data_dir: {e}")

  for c in cells:      # refuse a runs_dir trained with other settings before training anything
    path = os.path.join(args.runs_dir, c["name"], "config.json")
    if os.path.exists(path):
      with open(path) as f:
        diffs = config_differences(json.load(f), cfgs[c["name"]].to_dict())
      if diffs:
        ap.error(f"--runs_dir={args.runs_dir!r}: cell {c['name']} was trained with other settings "
                 f"(saved != requested): {'; '.join(diffs)}; use a new --runs_dir or the same flags")
  cache_dir = (None if args.compile_cache == "none" else
               os.path.join(args.runs_dir, "jax_cache") if args.compile_cache == "auto" else
               args.compile_cache)
  with compile_cache(cache_dir):
    return _run(args, argv, base, cells, cfgs, budget, prompts, depths, lams, seeds, temps, cache_dir)


@contextlib.contextmanager
def compile_cache(path: str | None):
  """JAX's persistent compilation cache in ``path`` for the block (None: no
  change); the previous setting is restored after. Cells of the same D and
  lambda compile the same train step, and cells of the same D the same
  decoding programs, so later cells load them from disk."""
  if path is None:
    yield
    return
  from jax.experimental.compilation_cache import compilation_cache as cc
  prev = jax.config.jax_compilation_cache_dir
  os.makedirs(path, exist_ok=True)
  cc.set_cache_dir(path)
  cc.reset_cache()            # takes effect even if this process compiled before
  try:
    yield
  finally:
    cc.set_cache_dir(prev)
    cc.reset_cache()


def _run(args, argv, base, cells, cfgs, budget, prompts, depths, lams, seeds, temps, cache_dir):
  """The grid: train every cell, decode the D >= 1 cells, write the reports."""
  n, t_start = len(cells), time.perf_counter()
  print(f"MTP ablation: {n} cells ({len(seeds)} seeds x (D=0 + {len([d for d in set(depths) if d])} "
        f"depths x {len(lams)} lambdas)), {args.num_steps} steps x {args.batch_size} x {args.seq_len} "
        f"tokens each, runs under {args.runs_dir}", flush=True)
  for k, c in enumerate(cells, 1):
    workdir = os.path.join(args.runs_dir, c["name"])
    print(f"[cell {k}/{n}] {c['name']}: training (elapsed {time.perf_counter() - t_start:.0f} s)",
          flush=True)
    c.update(train_cell(cfgs[c["name"]], workdir, log=lambda s: print(f"  {s}", flush=True)))
    c["workdir"] = workdir
    if c.get("signal"):
      print(f"interrupted (signal {c['signal']}) in cell {c['name']} at step {c['step']}; re-run the "
            "same command to resume (finished cells are reused)", flush=True)
      return 128 + c["signal"]
    jax.clear_caches()
    gc.collect()
    c["rss_mb"] = rss_mb()
    status = (f"DIVERGED: {c['diverged']}" if c.get("diverged") else
              f"{'reused (already finished)' if c['reused'] else 'trained'} in {c['train_wall_s']:.1f} s, "
              f"val bpb {c['val_bpb']:.4f}, {(c['step_time_s'] or float('nan')) * 1e3:.0f} ms/step")
    print(f"[cell {k}/{n}] {c['name']}: {status}; RSS {c['rss_mb']:.0f} MB", flush=True)
  t_train = time.perf_counter() - t_start

  dec_cells = [c for c in cells if c["depth"] >= 1 and _ok(c)]
  runs = args.decode_prompts * args.decode_repeats
  for k, c in enumerate(dec_cells, 1):
    t0 = time.perf_counter()
    c["decode"] = decode_cell(c["workdir"], prompts, temps, args.decode_tokens, runs)
    jax.clear_caches()
    gc.collect()
    c["decode_wall_s"] = time.perf_counter() - t0
    taus = ", ".join(f"T={r['temperature']:g} G={r['num_draft_tokens']}: tau {r['tau']:.2f} "
                     f"x{r['speedup']:.2f}" for r in c["decode"] if r["method"] == "mtp")
    print(f"[decode {k}/{len(dec_cells)}] {c['name']} in {c['decode_wall_s']:.1f} s: {taus}", flush=True)
  t_decode = time.perf_counter() - t_start - t_train

  ttable, dtable = train_table(cells), decode_table(cells)
  cmd = common.command_line(__file__, argv)
  meta = common.provenance(
      command=cmd, full_command=FULL_COMMAND, quick=args.quick,
      config_file="--quick test model" if args.quick else args.config, dataset=base.data.name,
      grid={"depths": depths, "loss_weights": lams, "seeds": seeds, "num_cells": n,
            "cells": [c["name"] for c in cells]},
      budget={**budget, "tokens_per_cell": args.num_steps * args.batch_size * args.seq_len,
              "warmup_steps": cfgs[cells[0]["name"]].train.warmup_steps,
              "learning_rate": base.train.learning_rate},
      backbone=dataclasses.asdict(base.model),
      backbone_params=next((c["params"]["backbone"] for c in cells if c.get("params")), None),
      cell_config=cfgs[cells[0]["name"]].to_dict(),
      decode={"temperatures": temps, "num_prompts": args.decode_prompts, "repeats": args.decode_repeats,
              "runs_per_method": runs, "max_new_tokens": args.decode_tokens,
              "prompt_bytes": args.prompt_bytes, "batch_size": 1, "form": "while"},
      runs_dir=args.runs_dir, compile_cache=cache_dir, wall_s={"train": t_train, "decode": t_decode})
  results = {"cells": cells, "train_table": ttable, "decode_table": dtable}
  common.write_report(args.out, meta, results, markdown(meta, ttable, dtable))
  plot_train(ttable, args.out + "_train.png")
  plot_decode(dtable, args.out + "_decode.png")
  print(f"done in {time.perf_counter() - t_start:.0f} s (train {t_train:.0f} s, decode {t_decode:.0f} s); "
        f"wrote {args.out}.json, {args.out}.md, {args.out}_train.png, {args.out}_decode.png", flush=True)
  return 0


if __name__ == "__main__":
  common.main_guard(main)
