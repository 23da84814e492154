"""The MTP ablation grid (experiments/ablate_mtp.py): depth D x loss weight
lambda x seed at a fixed backbone, its cells' configs and training, and the
two result tables kept apart (docs/design.md section 7): (a) training
benefit (validation loss and bits per byte vs D = 0 over the same seeds)
and (b) decoding benefit (tau, alpha_k, speedup of each cell's MTP
modules, aggregated over seeds from ``experiments.ablate_mtp.ar_vs_mtp`` rows).

DeepSeek-V3 report, eq. 21-25: L = L_main + lambda / D * sum_k L^k.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time

import numpy as np

from mtp import config as config_lib
from mtp.config import Config, ConfigError
from mtp.timing import spread
from train import workdir as workdir_lib
from train.loop import DivergedError, train

# the spread of a metric over seeds, as the tables report it
SEED_STATS = ("mean", "min", "max", "std", "n")


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
  saved = workdir_lib.read_config_file(workdir)
  if saved is not None:
    diffs = config_differences(saved, cfg.to_dict())
    if diffs:
      raise ConfigError(f"cell workdir {workdir!r} was trained with another config (saved != "
                        f"requested): {'; '.join(diffs)}. Use a new --runs_dir or the same flags.")
  finished = os.path.exists(os.path.join(workdir, "final_metrics.json"))
  t0 = time.perf_counter()
  try:
    res = train(cfg, workdir, log=log)
  except DivergedError as e:
    return {"diverged": str(e), "reused": False, "train_wall_s": time.perf_counter() - t0}
  ev = res.eval
  return {"step": res.step, "reused": finished, "interrupted": res.interrupted,
          "signal": res.signal, "train_wall_s": time.perf_counter() - t0,
          "val_loss": ev.get("main/loss"), "val_bpb": ev.get("main/bits_per_byte"),
          "val_accuracy": ev.get("main/accuracy"),
          "mtp_accuracy": [ev.get(f"mtp_{k}/accuracy") for k in range(1, cfg.mtp.depth + 1)],
          "step_time_s": res.step_time_s, "params": res.params}


# -- tables (pure) -------------------------------------------------------------

def _spread(values: list[float]) -> dict:
  """mean, min, max, std (population), n of a list of floats (None when empty)."""
  return spread(values, SEED_STATS)


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


# -- the grid as one settings object, and its training ---------------------------------------

@dataclasses.dataclass
class Ablation:
  """The settings of one ablation run (experiments/ablate_mtp.py).

  base: the config whose backbone every cell trains; depths, loss_weights,
  seeds: the grid axes; budget: ``cell_config``'s shared keywords
  (num_steps, batch_size, seq_len, eval_batches, data_dir); runs_dir: one
  workdir per cell under it; prompts, temperatures, decode_tokens,
  decode_runs: the decoding half (held-out prompt texts, temperatures, new
  tokens per decode, decodes per method and temperature). ``cells`` (in
  training order, ``grid``) and ``cfgs`` ({cell name: Config}) are derived;
  constructing raises ConfigError when a cell's config is invalid.
  """
  base: Config
  depths: list[int]
  loss_weights: list[float]
  seeds: list[int]
  budget: dict
  runs_dir: str
  prompts: list[str] = dataclasses.field(default_factory=list)
  temperatures: list[float] = dataclasses.field(default_factory=list)
  decode_tokens: int = 128
  decode_runs: int = 1
  cells: list[dict] = dataclasses.field(init=False)
  cfgs: dict = dataclasses.field(init=False)

  def __post_init__(self):
    self.cells = grid(self.depths, self.loss_weights, self.seeds)
    self.cfgs = {c["name"]: cell_config(self.base, c["depth"], c["loss_weight"], c["seed"], **self.budget)
                 for c in self.cells}

  def saved_config_differences(self) -> list[tuple[str, list[str]]]:
    """[(cell name, ``config_differences``)] for every cell whose workdir
    under ``runs_dir`` already holds a config that differs from the requested one."""
    out = []
    for c in self.cells:
      saved = workdir_lib.read_config_file(os.path.join(self.runs_dir, c["name"]))
      if saved is not None:
        diffs = config_differences(saved, self.cfgs[c["name"]].to_dict())
        if diffs:
          out.append((c["name"], diffs))
    return out


def train_grid(ab: Ablation, log=print, after_cell=None) -> int | None:
  """Trains (or resumes, or reuses) every cell of ``ab`` in order, updating
  each cell dict in place with ``train_cell``'s metrics, its workdir and
  rss_mb. ``after_cell()`` runs after each cell (e.g. ``jax.clear_caches``)
  before the RSS is read. Returns 128 + signal when a cell was interrupted
  (SIGINT / SIGTERM: the cell checkpointed; re-running resumes), else None.
  ``log`` gets the progress lines."""
  n, t_start = len(ab.cells), time.perf_counter()
  for k, c in enumerate(ab.cells, 1):
    workdir = os.path.join(ab.runs_dir, c["name"])
    log(f"[cell {k}/{n}] {c['name']}: training (elapsed {time.perf_counter() - t_start:.0f} s)")
    c.update(train_cell(ab.cfgs[c["name"]], workdir, log=lambda s: log(f"  {s}")))
    c["workdir"] = workdir
    if c.get("signal"):
      log(f"interrupted (signal {c['signal']}) in cell {c['name']} at step {c['step']}; re-run the "
          "same command to resume (finished cells are reused)")
      return 128 + c["signal"]
    if after_cell is not None:
      after_cell()
    c["rss_mb"] = rss_mb()
    status = (f"DIVERGED: {c['diverged']}" if c.get("diverged") else
              f"{'reused (already finished)' if c['reused'] else 'trained'} in {c['train_wall_s']:.1f} s, "
              f"val bpb {c['val_bpb']:.4f}, {(c['step_time_s'] or float('nan')) * 1e3:.0f} ms/step")
    log(f"[cell {k}/{n}] {c['name']}: {status}; RSS {c['rss_mb']:.0f} MB")
  return None


def decoded_cells(ab: Ablation) -> list[dict]:
  """The cells whose MTP modules get decoded: D >= 1, trained, not diverged."""
  return [c for c in ab.cells if c["depth"] >= 1 and _ok(c)]
