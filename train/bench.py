"""Training-step benchmarks as library functions: a synthetic batch, the
compiled step's FLOPs and memory, and interleaved step timing across
configs (experiments/bench_train.py, experiments/compare_drafters.py,
scripts/device_check.py).

Timing goes through ``mtp.timing.interleaved_times``. The step is lowered
through ``Trainer._step`` (the jitted train step), the only such call site
outside train/loop.py.
"""

from __future__ import annotations

import jax
import numpy as np

from mtp import config as config_lib
from mtp import sharding as shard_lib
from mtp.timing import interleaved_times, spread, xla_flops
from train.loop import Trainer


def synthetic_batch(cfg: config_lib.Config, seed: int = 0) -> dict[str, np.ndarray]:
  """A random training batch of cfg.train.batch_size x seq_len byte tokens
  (int32 "tokens" in [0, 256), one document per row: "segment_ids" 1,
  "positions" 0..T-1). The step time does not depend on the values."""
  b, t = cfg.train.batch_size, cfg.train.seq_len
  rng = np.random.default_rng(seed)
  return {"tokens": rng.integers(0, 256, (b, t)).astype(np.int32),
          "segment_ids": np.ones((b, t), np.int32),
          "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()}


def _lower(trainer: Trainer, state, gbatch):
  return trainer._step.lower(state.params, state.opt_state, gbatch).compile()


def step_cost(trainer: Trainer, state, batch) -> dict:
  """FLOPs and memory of the compiled train step (XLA analyses):
  {"flops": float or None, "memory_bytes": arguments + outputs + temporaries
  or None}."""
  compiled = _lower(trainer, state, shard_lib.global_batch(batch, trainer.mesh))
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  mem = compiled.memory_analysis()
  mem_bytes = None
  if mem is not None:
    mem_bytes = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes)
  return {"flops": float(cost.get("flops", float("nan"))) if cost else None, "memory_bytes": mem_bytes}


def time_train_steps(runs: dict[str, dict], batch, steps: int, repeats: int) -> dict[str, np.ndarray]:
  """Seconds per ``Trainer.train_step`` of every run, interleaved repeats of
  ``steps`` steps each (already compiled: no warm-up). ``runs``: {name:
  {"trainer": Trainer, "state": TrainState}}; each state advances in place.
  Returns {name: float64 [repeats]} seconds per step."""
  def repeat(r):
    def fn():
      for _ in range(steps):
        r["state"], metrics = r["trainer"].train_step(r["state"], batch)
      jax.block_until_ready(metrics)
    return fn
  times = interleaved_times({name: repeat(r) for name, r in runs.items()}, repeats, warmup=0)
  return {name: t / steps for name, t in times.items()}


def train_step_costs(cfgs: dict[str, config_lib.Config], steps: int, repeats: int) -> dict[str, dict]:
  """Seconds per jitted train step of each config on its own synthetic batch
  (``synthetic_batch``: cfg.train.batch_size x seq_len), after compilation
  and one step, ``steps`` steps per repeat, repeats interleaved across
  configs (``interleaved_times``), plus XLA's FLOP count of the compiled
  step. Identical configs are measured once and share the result. Returns
  {name: {"step_s": median, "step_s_min", "step_s_max", "flops"}}."""
  runs, same = {}, {}
  for name, cfg in cfgs.items():
    key = cfg.to_json()
    if key in same:             # an identical config compiles to the same step: measure once
      continue
    same[key] = name
    trainer = Trainer(cfg)
    state = trainer.init_state()
    batch = shard_lib.global_batch(synthetic_batch(cfg), trainer.mesh)
    compiled = _lower(trainer, state, batch)
    params, opt, metrics = compiled(state.params, state.opt_state, batch)
    jax.block_until_ready(metrics)
    runs[name] = {"fn": compiled, "params": params, "opt": opt, "batch": batch,
                  "flops": xla_flops(compiled)}

  def repeat(r):
    def fn():
      for _ in range(steps):
        r["params"], r["opt"], metrics = r["fn"](r["params"], r["opt"], r["batch"])
      jax.block_until_ready(metrics)
    return fn
  times = interleaved_times({name: repeat(r) for name, r in runs.items()}, repeats, warmup=0)
  out = {}
  for name, r in runs.items():
    s = spread(times[name] / steps, ("median", "min", "max"))
    out[name] = {"step_s": s["median"], "step_s_min": s["min"], "step_s_max": s["max"],
                 "flops": r["flops"]}
  return {name: out[same[cfg.to_json()]] for name, cfg in cfgs.items()}


def depth_sweep(base: config_lib.Config, depths: list[int], steps: int, repeats: int,
                log=print) -> list[dict]:
  """The train step of ``base`` at every MTP depth D in ``depths`` (the
  backbone fixed) on one ``synthetic_batch``: each compiled and run once,
  then ``time_train_steps`` (interleaved repeats of ``steps`` steps).
  Returns one row per D: depth, step_s_median / _min / _max (s per step),
  tokens_per_s, time_ratio (median / the first depth's), flops,
  flop_ratio, memory_bytes (``step_cost``), time_over_flop_ratio; ``log``
  gets one line per D."""
  batch = synthetic_batch(base)
  runs = {}
  for d in depths:
    cfg = base.replace(mtp=dict(depth=d))
    trainer = Trainer(cfg)
    state = trainer.init_state()
    cost = step_cost(trainer, state, batch)
    state, metrics = trainer.train_step(state, batch)      # compile + first step
    jax.block_until_ready(metrics)
    runs[d] = {"trainer": trainer, "state": state, **cost}
  times = time_train_steps({str(d): runs[d] for d in depths}, batch, steps, repeats)
  tokens = base.train.batch_size * base.train.seq_len
  ref = depths[0]
  rows = []
  for d in depths:
    r = runs[d]
    t = spread(times[str(d)], ("median", "min", "max"), "step_s_")
    med = t["step_s_median"]
    rows.append({"depth": d, **t, "tokens_per_s": tokens / med,
                 "time_ratio": med / float(np.median(times[str(ref)])),
                 "flops": r["flops"], "flop_ratio": (r["flops"] / runs[ref]["flops"])
                 if r["flops"] and runs[ref]["flops"] else None,
                 "memory_bytes": r["memory_bytes"]})
    rows[-1]["time_over_flop_ratio"] = (rows[-1]["time_ratio"] / rows[-1]["flop_ratio"]
                                        if rows[-1]["flop_ratio"] else None)
    log(f"D={d}: {med * 1e3:.1f} ms/step  {tokens / med:.0f} tok/s  time x{rows[-1]['time_ratio']:.2f}"
        f"  flops x{rows[-1]['flop_ratio'] or float('nan'):.2f}")
  return rows
