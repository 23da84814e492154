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

from decode.errors import DecodeError
from decode.limits import MAX_DRAFT_TOKENS
from mtp import cli   # jax loads after the flags are checked (main)


def auto_costs_note(row: dict, results: list[dict]) -> str:
  """"; round costs auto held after the cell (AR steps) a / b / c, fixed G
  rounds measured x / y / z": the costs of ``row``'s "auto" record for its
  batch size, sampling mode and form (``Decoder.auto_record``), each
  divided by its g = 0 cost, beside the ms per round of the fixed-G rows of
  the same setting divided by AR's ("" when either is missing)."""
  rec = (row.get("auto") or {}).get("round_costs_s") or {}
  greedy = row["temperature"] == 0
  key = lambda k: k.split(", ")      # "B, S, greedy, filtering, form" (Decoder.auto_record)
  costs = next((v for k, v in rec.items() if len(key(k)) == 5 and key(k)[0] == str(row["batch_size"])
                and key(k)[2] == str(greedy) and key(k)[4] == row["form"]), rec.get("fixed"))
  same = [r for r in results if r["temperature"] == row["temperature"] and not r.get("tree")
          and r["batch_size"] == row["batch_size"] and r["form"] == row["form"]
          and r["method"] in ("ar", "mtp")]
  ar = next((r["round_s"] for r in same if r["method"] == "ar"), None)
  fixed = {r["num_draft_tokens"]: r["round_s"] for r in same if isinstance(r["num_draft_tokens"], int)}
  if not costs or not ar:
    return ""
  held = " / ".join(f"{c / costs[0]:.2f}" for c in costs)
  meas = " / ".join(["1.00"] + [f"{fixed[g] / ar:.2f}" if g in fixed else "-"
                                for g in range(1, len(costs))])
  return f"; round costs `auto` held after the cell (AR steps) {held}, fixed-G rounds measured {meas}"


def markdown(results, meta) -> str:
  from mtp import report
  from scripts import bench_lib
  lines = [f"Decode benchmark: {meta['workdir']} on {report.machine(meta)}, "
           f"JAX {meta['jax_version']}, commit {meta['commit']}, {meta['date']}; "
           f"{meta['max_new_tokens']} new tokens per prompt, prompts of ~{meta['prompt_bytes']} bytes "
           f"from {meta['dataset']} validation; median of {report.plural(meta['repeats'], 'repeat')}.", "",
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
  f = report.fmt
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
              f"{r['draft_length_histogram']}{auto_costs_note(r, results)}" for r in auto]
  comp = bench_lib.tree_comparison(results, meta["bare_forward_in_loop_s_by_batch"])
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


def parser() -> argparse.ArgumentParser:
  ap = cli.OneLineParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--workdir", required=True, help="target checkpoint (its MTP modules draft when D >= 1)")
  ap.add_argument("--draft_workdir", default=None, help="separate draft-model checkpoint (optional)")
  ap.add_argument("--ar_only", action="store_true",
                  help="time AR alone (needed when --workdir has D = 0 and no --draft_workdir is given)")
  ap.add_argument("--dataset", default="python_stdlib", help="held-out prompt dataset")
  ap.add_argument("--data_dir", default="", help=cli.DATA_DIR_HELP)
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
  return ap


def parse_args(argv=None):
  """(parser, args, batch_sizes, temperatures, forms, G values given or None), the
  flags checked (``ap.error``: one line, exit status 2); loads nothing."""
  ap = parser()
  args = ap.parse_args(argv)
  if args.quick:
    cli.apply_quick(ap, args, batch_sizes="1", temperatures="0,1", repeats=1, max_new_tokens=8,
                    prompt_bytes=64)
  cli.check_range(ap, args, prompt_bytes=1, max_new_tokens=1, repeats=1, num_prompts=0)
  cli.check_output_path("out", args.out, "prefix")
  batch_sizes = cli.parse_list(ap, "batch_sizes", args.batch_sizes, int, 1)
  temps = cli.parse_list(ap, "temperatures", args.temperatures, float, 0.0)
  forms = cli.parse_list(ap, "forms", args.forms, str, choices=("while", "stream"))
  gs_given = None
  if args.num_draft_tokens is not None:
    items = cli.list_items(ap, "num_draft_tokens", args.num_draft_tokens)
    auto_given = "auto" in items
    rest = ",".join(x for x in items if x != "auto")
    gs_given = (cli.parse_list(ap, "num_draft_tokens", rest, int, 1, MAX_DRAFT_TOKENS) if rest else []) + (
        ["auto"] if auto_given else [])
    if not gs_given:
      ap.error(f"--num_draft_tokens={args.num_draft_tokens!r}: give G >= 1 values and/or 'auto'")
  return ap, args, batch_sizes, temps, forms, gs_given


def main(argv=None):
  ap, args, batch_sizes, temps, forms, gs_given = parse_args(argv)
  import numpy as np
  from decode.cli import run as run_lib
  from mtp import data as data_lib
  from mtp import loading, report
  from scripts import bench_lib
  cfg, target, step = loading.load_model(args.workdir)
  draft = loading.load_model(args.draft_workdir)[1] if args.draft_workdir else None
  try:
    gs, trees = bench_lib.bench_cells(args.workdir, cfg.mtp.depth, draft is not None,
                                       gs_given=gs_given, trees_text=args.trees,
                                       ar_only=args.ar_only, quick=args.quick)
  except ValueError as e:
    ap.error(str(e))
  prompts_all = data_lib.held_out_prompts(args.dataset, args.num_prompts or max(batch_sizes) * args.repeats,
                                 args.prompt_bytes, data_dir=args.data_dir)
  settings = bench_lib.DecodeBench(
      target=target, draft=draft, gs=gs, trees=trees, prompts=prompts_all, batch_sizes=batch_sizes,
      temperatures=temps, forms=forms, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
      cache_len=64 * int(np.ceil((args.prompt_bytes + args.max_new_tokens + 64) / 64)),
      auto_kwargs=(run_lib.auto_kwargs(args.workdir, cfg, target)
                   if "auto" in gs and cfg.mtp.depth else {}))
  results, bare, bare_loop = bench_lib.run_decode_bench(settings, log=lambda s: print(s, flush=True))
  meta = report.provenance(
      command=report.command_line(__file__, argv),
      workdir=args.workdir, checkpoint_step=step, config=cfg.to_dict(),
      draft_workdir=args.draft_workdir, dataset=args.dataset, prompt_bytes=args.prompt_bytes,
      max_new_tokens=args.max_new_tokens, repeats=args.repeats, trees=[list(t) for t in trees],
      bare_forward_s=bare[str(batch_sizes[0])], bare_forward_s_by_batch=bare,
      bare_forward_in_loop_s=bare_loop[str(batch_sizes[0])], bare_forward_in_loop_s_by_batch=bare_loop)
  report.write_report(args.out, meta, results, markdown(results, meta))
  print(f"wrote {args.out}.json and {args.out}.md")


if __name__ == "__main__":
  parse_args()   # bad flags refused before main_guard and main load jax
  cli.main_guard(main, errors=(DecodeError,))
