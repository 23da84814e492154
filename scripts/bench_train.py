r"""Training-step benchmark across MTP depths at a fixed backbone.

    python scripts/bench_train.py --config configs/tiny.py [--depths 0,1,2,3,4] \
        [--repeats 5] [--steps 10] [--out results/bench_train]

For each depth D: median seconds per jitted train step (after compilation,
``steps`` steps per repeat, repeats interleaved across depths so machine
noise hits them alike), tokens/s, the ratio to D = 0 next to the ratio of
model FLOPs per step (XLA's cost analysis of the compiled step), and the
compiled step's memory (arguments + outputs + temporaries, from XLA's
memory analysis). Writes OUT.json and OUT.md with config, commit, JAX
version, device and date.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtp import config as config_lib  # noqa: E402
from mtp import sharding as shard_lib  # noqa: E402
from scripts import common  # noqa: E402
from train.loop import Trainer  # noqa: E402


def synthetic_batch(cfg: config_lib.Config, seed: int = 0) -> dict[str, np.ndarray]:
  b, t = cfg.train.batch_size, cfg.train.seq_len
  rng = np.random.default_rng(seed)
  return {"tokens": rng.integers(0, 256, (b, t)).astype(np.int32),
          "segment_ids": np.ones((b, t), np.int32),
          "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()}


def step_cost(trainer: Trainer, state, batch) -> dict:
  """FLOPs and memory of the compiled train step (XLA analyses)."""
  gbatch = shard_lib.global_batch(batch, trainer.mesh)
  compiled = trainer._step.lower(state.params, state.opt_state, gbatch).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  mem = compiled.memory_analysis()
  mem_bytes = None
  if mem is not None:
    mem_bytes = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes)
  return {"flops": float(cost.get("flops", float("nan"))) if cost else None, "memory_bytes": mem_bytes}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
  ap.add_argument("--config", default="configs/tiny.py", help="config file (its model is the backbone)")
  ap.add_argument("--depths", default="0,1,2,3,4", help="comma list of MTP depths D in [0, 16]")
  ap.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats, >= 1")
  ap.add_argument("--steps", type=int, default=10, help="train steps per repeat, >= 1")
  ap.add_argument("--out", default="results/bench_train", help="output prefix (OUT.json, OUT.md)")
  ap.add_argument("--quick", action="store_true",
                  help="tiny sizes for tests: a 1-layer d_model 32 model, batch 2 x 16, and "
                       "--repeats 1 --steps 2 where not given")
  args = ap.parse_args(argv)
  if args.quick:
    common.apply_quick(ap, args, repeats=1, steps=2)
  common.check_range(ap, args, repeats=1, steps=1)
  depths = common.parse_list(ap, "depths", args.depths, int, 0, 16)
  if not os.path.isfile(args.config):
    ap.error(f"--config={args.config!r}: no such file")
  base = config_lib.load_config_file(args.config)
  if args.quick:
    base = base.replace(model=dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                   head_dim=16, mlp_dim=64),
                        train=dict(batch_size=2, seq_len=16))
  batch = synthetic_batch(base)
  runs = {}
  for d in depths:
    cfg = base.replace(mtp=dict(depth=d))
    trainer = Trainer(cfg)
    state = trainer.init_state()
    cost = step_cost(trainer, state, batch)
    state, metrics = trainer.train_step(state, batch)      # compile + first step
    jax.block_until_ready(metrics)
    runs[d] = {"trainer": trainer, "state": state, "times": [], **cost}
  for _ in range(args.repeats):
    for d in depths:
      r = runs[d]
      t0 = time.perf_counter()
      for _ in range(args.steps):
        r["state"], metrics = r["trainer"].train_step(r["state"], batch)
      jax.block_until_ready(metrics)
      r["times"].append((time.perf_counter() - t0) / args.steps)
  tokens = base.train.batch_size * base.train.seq_len
  ref = depths[0]
  rows = []
  for d in depths:
    r = runs[d]
    med = float(np.median(r["times"]))
    rows.append({"depth": d, "step_s_median": med, "step_s_min": float(min(r["times"])),
                 "step_s_max": float(max(r["times"])), "tokens_per_s": tokens / med,
                 "time_ratio": med / float(np.median(runs[ref]["times"])),
                 "flops": r["flops"], "flop_ratio": (r["flops"] / runs[ref]["flops"])
                 if r["flops"] and runs[ref]["flops"] else None,
                 "memory_bytes": r["memory_bytes"]})
    rows[-1]["time_over_flop_ratio"] = (rows[-1]["time_ratio"] / rows[-1]["flop_ratio"]
                                        if rows[-1]["flop_ratio"] else None)
    print(f"D={d}: {med * 1e3:.1f} ms/step  {tokens / med:.0f} tok/s  time x{rows[-1]['time_ratio']:.2f}"
          f"  flops x{rows[-1]['flop_ratio'] or float('nan'):.2f}", flush=True)
  meta = common.provenance(command=common.command_line(__file__, argv),
                           config_file=args.config, config=base.to_dict(), repeats=args.repeats,
                           steps_per_repeat=args.steps, quick=args.quick)
  commit = meta["commit"]
  m = base.model
  model = (f"--quick test model ({m.num_layers} layer, d_model {m.d_model}; not {args.config}'s)"
           if args.quick else args.config)
  lines = [f"Train-step benchmark: {model} (batch {base.train.batch_size} x {base.train.seq_len}), "
           f"{meta['device_kind']} x{meta['device_count']} ({meta['cpu_count']} CPUs: "
           f"{meta['cpu_model']}), JAX {meta['jax_version']}, commit {commit}, {meta['date']}; "
           f"median of {common.plural(args.repeats, 'repeat')} x {common.plural(args.steps, 'step')}.", "",
           "| D | ms/step | tokens/s | time / D=0 | FLOPs / D=0 | time ratio / FLOP ratio | step memory MB |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    fr = "-" if r["flop_ratio"] is None else f"{r['flop_ratio']:.2f}"
    tf = "-" if r["time_over_flop_ratio"] is None else f"{r['time_over_flop_ratio']:.2f}"
    mem = "-" if r["memory_bytes"] is None else f"{r['memory_bytes'] / 2**20:.1f}"
    lines.append(f"| {r['depth']} | {r['step_s_median'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
                 f"{r['time_ratio']:.2f} | {fr} | {tf} | {mem} |")
  common.write_report(args.out, meta, rows, "\n".join(lines) + "\n")
  print(f"wrote {args.out}.json and {args.out}.md")


if __name__ == "__main__":
  common.main_guard(main)
