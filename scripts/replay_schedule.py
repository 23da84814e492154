r"""Draft-length schedules replayed on the target's own answers
(decode/replay.py): how fixed G = 0..G_max, the CLI's "auto" and variants of
it would spend target calls and time on held-out chat prompts, in seconds
instead of a benchmark's minutes.

    python scripts/replay_schedule.py --workdir runs/smollm_demo [--per_category 2] \
        [--max_new_tokens 128] [--costs 1,1.22,1.43,1.63 [--ar_step 0.97]] \
        [--temperature 1 --top_p 1 --samples 4 --draws 8] \
        [--variants "slow:ema=0.05;probe:probe_interval=1"] [--answers OTHER_RECORDS.npz] \
        [--out results/replay_schedule]

Each prompt is answered by AR (once greedily at T = 0; ``--samples``
answers at T > 0); one cache-free forward of the target and its modules over
prompt + answer gives the acceptance of every draft position at every round
start: exact at T = 0 (the decoder emits the same answer whatever the
schedule), and at T > 0 the probability that each draft is accepted given
the sampled answer, min(p, q)(x) / p(x), which replays a lossless decoder
exactly in law (``--draws`` draws of the acceptance events per answer,
shared by every decoder). Every decoder is then replayed round by round with
the round costs ``--costs`` (seconds or units of an AR step per g =
0..G_max; default: measured on this device as "auto" calibrates them, at
the given sampling settings) and the plain AR step ``--ar_step`` (what G0
and a schedule's plain AR fallback cost per token; "auto"'s own g = 0 round
also feeds the modules; default: measured beside the costs, or costs[0]
with ``--costs``). The schedules run the decoder's own
``AutoSchedule.choose`` / ``update`` code. What it leaves out: the prefill
(equal for all) and the decoder's cost learning between generations.
Writes OUT.json and OUT.md. The replay itself takes seconds; recording or
rescoring does not: one AR generation and one cache-free forward with
a softmax over the vocabulary per answer token and draft depth (108
answers of SmolLM2 at T = 1: ~13 min on 2 busy cores; with ``--answers`` the
prompts are the records', whatever ``--per_category`` says).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from decode import run as run_lib
from decode.schedule import AutoSchedule
from decode.speculative import DecodeError, SamplingParams
from mtp import cli, loading, report
from mtp import data as data_lib
from mtp import tokenizer as tok
from scripts import replay as rp
from scripts.bench_chat_lib import heldout_prompts


def markdown(rows, labels, schedules, meta) -> str:
  g_labels = [l for l in labels if l.startswith("G")]
  t, top_k, top_p = meta["sampling"]
  greedy = t == 0
  setting = ("T = 0" if greedy else
             f"T = {t:g}, top-k {top_k}, top-p {top_p:g}; {meta['samples']} sampled AR answers per "
             f"prompt, {meta['draws']} draws of the acceptance events per answer")
  cats = rp.by_category(rows, labels, list(schedules))
  lines = [f"Schedules replayed on {'greedy' if greedy else 'sampled'} answers: {meta['model']} on "
           f"{report.machine(meta)}, commit {meta['commit']}, {meta['date']}; B = 1, {setting}, "
           f"{meta['max_new_tokens']} new tokens, round costs per g (plain AR step = 1; g = 0 is "
           f"auto's own AR round): {', '.join(f'{c:.3f}' for c in meta['relative_costs'])}.", "",
           "## Per category", "",
           "Geomean speedup over AR over the category's answers (replayed target calls x round "
           "costs, prefill left out); per schedule: over the best fixed G per answer (geomean, "
           "min) and over the category's best fixed G (the benchmark's per-cell view).", "",
           "| category | answers | " + " | ".join(labels) + " | best fixed | "
           + " | ".join(f"{s} / best per answer (min) | {s} / best in category" for s in schedules)
           + " |",
           "|---|---|" + "---|" * (len(labels) + 1 + 2 * len(schedules))]
  for cat, e in cats.items():
    name = f"**{cat}**" if cat == "all" else cat
    lines.append(f"| {name} | {e['answers']} | "
                 + " | ".join(f"{e['speedup'][l]:.3f}x" for l in labels) + f" | {e['best_fixed']} | "
                 + " | ".join(f"{e[f'{s}/best']:.3f} ({e[f'{s}/best_min']:.3f}) | "
                              f"{e[f'{s}/best_cell']:.3f}" for s in schedules) + " |")
  lines += ["", "## Per answer", "",
            "| category | # | tokens | alpha_1 | " + " | ".join(labels) + " | "
            + " | ".join(f"{s} / best" for s in schedules) + " |",
            "|---|---|---|---|" + "---|" * (len(labels) + len(schedules))]
  for r in rows:
    idx = f"{r['index']}" if greedy else f"{r['index']}.{r['sample']}"
    lines.append(f"| {r['category']} | {idx} | {r['tokens']} | {r['alpha_1']:.2f} | "
                 + " | ".join(f"{r[l]['speedup']:.2f}x" for l in labels) + " | "
                 + " | ".join(f"{r[f'{s}/best']:.3f}" for s in schedules) + " |")
  lines += ["", "Schedules: " + "; ".join(f"`{s}` = {v}" for s, v in meta["schedules"].items()),
            f"Fixed G columns: {', '.join(g_labels)}."]
  return "\n".join(lines) + "\n"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--workdir", required=True, help="target with MTP modules (a chat tokenizer)")
  ap.add_argument("--chat_prompts", default=data_lib.HELDOUT_CHAT_PATH, help="chat prompt JSONL")
  ap.add_argument("--per_category", type=int, default=2, help="prompts per category, >= 1")
  ap.add_argument("--max_new_tokens", type=int, default=128, help="token budget, >= 1")
  ap.add_argument("--max_draft_tokens", type=int, default=None,
                  help="G_max (default: the offsets the modules were trained for, as auto)")
  ap.add_argument("--costs", default=None,
                  help="round costs for g = 0..G_max, comma list (default: measured here)")
  ap.add_argument("--ar_step", type=float, default=None,
                  help="plain AR step in the units of --costs, > 0 (default: measured with the "
                       "costs; costs[0] with --costs)")
  ap.add_argument("--variants", default="",
                  help="schedule variants of the CLI's auto: \"LABEL:field=value,...;...\"")
  ap.add_argument("--temperature", type=float, default=0.0,
                  help="sampling temperature of the AR answers and the replayed decoders, >= 0")
  ap.add_argument("--top_k", type=int, default=0, help="top-k (0 = off), >= 0")
  ap.add_argument("--top_p", type=float, default=1.0, help="top-p in (0, 1]")
  ap.add_argument("--samples", type=int, default=None,
                  help="sampled AR answers per prompt at T > 0, >= 1 (default 4; 1 at T = 0)")
  ap.add_argument("--draws", type=int, default=8,
                  help="draws of the acceptance events per sampled answer, >= 1")
  ap.add_argument("--seed", type=int, default=0, help="seed of the acceptance draws")
  ap.add_argument("--records", default=None,
                  help="an .npz of recorded answers: read when it exists (no decoding), else "
                       "written after recording")
  ap.add_argument("--answers", default=None,
                  help="an .npz of recorded answers (--records of another run on the same "
                       "target): its prompts and answers, with the acceptance recomputed for "
                       "--workdir's modules (compares modules on the same answers)")
  ap.add_argument("--out", default="results/replay_schedule", help="output prefix")
  args = ap.parse_args(argv)
  cli.check_range(ap, args, per_category=1, max_new_tokens=1, draws=1)
  params = SamplingParams(args.temperature, args.top_k, args.top_p)
  try:
    params.validate()
  except DecodeError as e:
    ap.error(str(e))
  if args.samples is None:
    args.samples = 1 if params.greedy else 4
  if args.samples < 1 or (params.greedy and args.samples != 1):
    ap.error(f"--samples={args.samples}: must be 1 at --temperature 0 (the greedy answer is "
             "always the same) and >= 1 at --temperature > 0")
  sampling = (float(args.temperature), int(args.top_k), float(args.top_p))
  if args.answers and not os.path.isfile(args.answers):
    ap.error(f"--answers={args.answers!r}: no such file (give a records .npz of an earlier run)")
  if args.answers and args.records:
    ap.error("--answers and --records exclude each other (--answers rescores a records file)")
  if args.answers and rp.load_sampling(args.answers) != sampling:
    t, k, p = rp.load_sampling(args.answers)
    ap.error(f"--answers={args.answers!r} holds answers sampled at --temperature {t:g} --top_k {k} "
             f"--top_p {p:g}; pass those (given: {sampling[0]:g}, {sampling[1]}, {sampling[2]:g})")
  if args.records and os.path.isfile(args.records) and rp.load_sampling(args.records) != sampling:
    ap.error(f"--records={args.records!r} holds answers sampled at (temperature, top_k, top_p) = "
             f"{rp.load_sampling(args.records)}, not {sampling}: give another --records path")
  costs = None
  if args.costs:                         # checked before the model loads (its count after)
    try:
      costs = [float(x) for x in args.costs.split(",")]
    except ValueError:
      costs = []
    if not costs or not all(np.isfinite(c) and c > 0 for c in costs):
      ap.error(f"--costs={args.costs!r}: give positive seconds (or AR-step units) per round for "
               "g = 0..G_max, comma-separated")
  if args.ar_step is not None and not (np.isfinite(args.ar_step) and args.ar_step > 0):
    ap.error(f"--ar_step={args.ar_step!r} must be a positive number (seconds or AR-step units)")
  if args.ar_step is not None and not args.costs:
    ap.error("--ar_step needs --costs (without them both are measured here)")
  try:
    rp.parse_variants(args.variants, AutoSchedule(1))
  except ValueError as e:
    ap.error(f"--variants: {e}")
  cfg, model, step = loading.load_model(args.workdir)
  if model.mtp_depth < 1:
    ap.error(f"--workdir={args.workdir!r} has no MTP modules (mtp.depth = 0)")
  tokenizer = tok.load_tokenizer(args.workdir)
  kw = run_lib.auto_kwargs(args.workdir, cfg, model, args.max_draft_tokens)
  g_max = kw["max_draft_tokens"]
  base = kw["schedule"] or AutoSchedule(g_max)
  try:
    schedules = {"auto": base, **rp.parse_variants(args.variants, base)}
  except ValueError as e:
    ap.error(f"--variants: {e}")
  if tokenizer.chat_template is None:
    ap.error(f"--workdir={args.workdir!r}: its tokenizer has no chat template; the replay "
             "answers chat prompts (a chat model's workdir, e.g. runs/smollm_demo)")
  prompts = heldout_prompts(args.chat_prompts, tokenizer, args.per_category)
  if costs is not None:
    if len(costs) != g_max + 1:
      ap.error(f"--costs needs {g_max + 1} positive values (g = 0..{g_max}), got {args.costs!r}")
    ar_step = costs[0] if args.ar_step is None else float(args.ar_step)
  else:
    first = next(iter(prompts.values()))[0]
    measured, ar_step = rp.measured_costs(model, tokenizer, first, g_max, args.max_new_tokens,
                                          params)
    costs = [float(c) for c in measured]
    print("measured round costs (s): " + ", ".join(f"{c:.4f}" for c in costs)
          + f"; plain AR step {ar_step:.4f} s", flush=True)
  if args.answers:
    records = rp.rescore(model, rp.load_records(args.answers), g_max, params,
                         log=lambda s: print(s, flush=True))
    print(f"rescored {len(records)} answers of {args.answers} with {args.workdir}'s modules")
  elif args.records and os.path.isfile(args.records):
    records = rp.load_records(args.records)
    print(f"read {len(records)} recorded answers from {args.records}")
  else:
    records = rp.record(model, tokenizer, prompts, args.max_new_tokens, g_max,
                        log=lambda s: print(s, flush=True), params=params, samples=args.samples)
    if args.records:
      rp.save_records(args.records, records, sampling)
  rows = rp.compare(records, costs, args.max_new_tokens, schedules, draws=args.draws,
                    seed=args.seed, ar_step_s=ar_step)
  labels = [f"G{g}" for g in range(g_max + 1)] + list(schedules)
  meta = report.provenance(command=report.command_line(__file__, argv),
                           model=f"{args.workdir} (step {step})", checkpoint_step=step,
                           max_new_tokens=args.max_new_tokens, costs=costs, ar_step=ar_step,
                           relative_costs=[c / ar_step for c in costs],
                           schedules={k: repr(v) for k, v in schedules.items()},
                           chat_prompts=args.chat_prompts, per_category=args.per_category,
                           sampling=list(sampling), samples=args.samples, draws=args.draws,
                           seed=args.seed, records=args.records, answers=args.answers)
  summary = rp.by_category(rows, labels, list(schedules))
  report.write_report(args.out, meta, {"rows": rows, "by_category": summary},
                      markdown(rows, labels, schedules, meta))
  print(markdown(rows, labels, schedules, meta))
  print(f"wrote {args.out}.json and {args.out}.md")
  return 0


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError, ValueError))
