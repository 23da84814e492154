r"""Training-step benchmark across MTP depths at a fixed backbone.

    python -m experiments.bench_train --config configs/tiny.py [--depths 0,1,2,3,4] \
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

from experiments import common
from mtp import cli, report
from train.bench import depth_sweep


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=cli.HelpFormatter)
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
    cli.apply_quick(ap, args, repeats=1, steps=2)
  cli.check_range(ap, args, repeats=1, steps=1)
  cli.check_output_path("out", args.out, "prefix")
  depths = cli.parse_list(ap, "depths", args.depths, int, 0, 16)
  base = common.load_config(ap, args.config)
  if args.quick:
    base = base.replace(model=dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                   head_dim=16, mlp_dim=64),
                        train=dict(batch_size=2, seq_len=16))
  rows = depth_sweep(base, depths, args.steps, args.repeats, log=lambda s: print(s, flush=True))
  meta = report.provenance(command=common.command_line(__file__, argv),
                           config_file=args.config, config=base.to_dict(), repeats=args.repeats,
                           steps_per_repeat=args.steps, quick=args.quick)
  commit = meta["commit"]
  m = base.model
  model = (f"--quick test model ({m.num_layers} layer, d_model {m.d_model}; not {args.config}'s)"
           if args.quick else args.config)
  lines = [f"Train-step benchmark: {model} (batch {base.train.batch_size} x {base.train.seq_len}), "
           f"{meta['device_kind']} x{meta['device_count']} ({meta['cpu_count']} CPUs: "
           f"{meta['cpu_model']}), JAX {meta['jax_version']}, commit {commit}, {meta['date']}; "
           f"median of {report.plural(args.repeats, 'repeat')} x {report.plural(args.steps, 'step')}.", "",
           "| D | ms/step | tokens/s | time / D=0 | FLOPs / D=0 | time ratio / FLOP ratio | step memory MB |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    fr = "-" if r["flop_ratio"] is None else f"{r['flop_ratio']:.2f}"
    tf = "-" if r["time_over_flop_ratio"] is None else f"{r['time_over_flop_ratio']:.2f}"
    mem = "-" if r["memory_bytes"] is None else f"{r['memory_bytes'] / 2**20:.1f}"
    lines.append(f"| {r['depth']} | {r['step_s_median'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
                 f"{r['time_ratio']:.2f} | {fr} | {tf} | {mem} |")
  report.write_report(args.out, meta, rows, "\n".join(lines) + "\n")
  print(f"wrote {args.out}.json and {args.out}.md")


if __name__ == "__main__":
  cli.main_guard(main)
