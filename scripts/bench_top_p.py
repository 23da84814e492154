r"""Top-p on a real target: nucleus sizes along its greedy answers, the warp
with ``jax.lax.top_k`` candidates vs a full vocabulary sort, and what top-p
costs a decoding step, side by side in one process.

    python scripts/bench_top_p.py --workdir runs/smollm_demo [--per_category 1] \
        [--answer_tokens 64] [--temperatures 0.7,1] [--top_ps 0.8,0.9,0.95] \
        [--warp_shapes 1x2,1x4,32x2] [--warp_repeats 20] \
        [--decode_top_ps 1,0.9] [--num_draft_tokens 1] [--decode_repeats 6] \
        [--max_new_tokens 64] [--out results/bench_top_p_smollm] [--quick]

Library: ``decode/bench_top_p.py``.
"""

from __future__ import annotations

import argparse
import math
import os

from decode.speculative import DecodeError
from mtp import cli, loading, report
from mtp import tokenizer as tok_lib
from scripts import bench_chat_lib as bench_chat
from scripts import bench_top_p_lib as bench_top_p


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--workdir", required=True, help="target (with MTP modules for the MTP rows)")
  ap.add_argument("--prompt_file", default=bench_chat.chat_lib.HELDOUT_CHAT_PATH,
                  help="chat JSONL ({prompt, category, system})")
  ap.add_argument("--per_category", type=int, default=1, help="prompts per category, >= 1")
  ap.add_argument("--answer_tokens", type=int, default=64,
                  help="greedy answer tokens per prompt whose logits are measured, >= 1")
  ap.add_argument("--temperatures", default="0.7,1", help="comma list of temperatures > 0")
  ap.add_argument("--top_ps", default="0.8,0.9,0.95", help="comma list of top-p in (0, 1]")
  ap.add_argument("--warp_shapes", default="1x2,1x4,32x2",
                  help="comma list of BxROWS warp blocks (a verify pass: B x (G + 1))")
  ap.add_argument("--warp_repeats", type=int, default=20, help="interleaved warp rounds, >= 0 (0: no warp rows)")
  ap.add_argument("--decode_temperature", type=float, default=1.0, help="temperature > 0")
  ap.add_argument("--decode_top_ps", default="1,0.9",
                  help="comma list of top-p for the decoding rows; the first is the baseline")
  ap.add_argument("--num_draft_tokens", type=int, default=1, help="G of the MTP rows (0: AR only)")
  ap.add_argument("--decode_repeats", type=int, default=6,
                  help="interleaved decoding rounds, >= 0 (0: no decoding rows)")
  ap.add_argument("--max_new_tokens", type=int, default=64, help="decoding budget, >= 1")
  ap.add_argument("--out", default="results/bench_top_p", help="output prefix (OUT.json, OUT.md)")
  ap.add_argument("--quick", action="store_true",
                  help="fills in --answer_tokens 8 --warp_shapes 1x2 --warp_repeats 2 "
                       "--decode_repeats 1 --max_new_tokens 8 --temperatures 1 --top_ps 0.9 "
                       "where not given")
  args = ap.parse_args(argv)
  if args.quick:
    cli.apply_quick(ap, args, answer_tokens=8, warp_shapes="1x2", warp_repeats=2,
                    decode_repeats=1, max_new_tokens=8, temperatures="1", top_ps="0.9")
  cli.check_range(ap, args, per_category=1, answer_tokens=1, warp_repeats=0, decode_repeats=0,
                  max_new_tokens=1, num_draft_tokens=0)
  temps = cli.parse_list(ap, "temperatures", args.temperatures, float, 0.0, lo_open=True)
  top_ps = cli.parse_list(ap, "top_ps", args.top_ps, float, 0.0, 1.0, lo_open=True)
  decode_top_ps = cli.parse_list(ap, "decode_top_ps", args.decode_top_ps, float, 0.0, 1.0,
                                 lo_open=True)
  if not (math.isfinite(args.decode_temperature) and args.decode_temperature > 0):
    ap.error(f"--decode_temperature={args.decode_temperature}: must be a finite number > 0")
  try:
    shapes = [tuple(int(v) for v in s.lower().split("x"))
              for s in cli.list_items(ap, "warp_shapes", args.warp_shapes)]
  except ValueError:
    shapes = []
  if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
    ap.error(f"--warp_shapes={args.warp_shapes!r} must be a comma list of BxROWS, both >= 1")

  load_before = os.getloadavg()
  _, model, _ = loading.load_model(args.workdir)
  tokenizer = tok_lib.load_tokenizer(args.workdir)
  prompts = [p for ps in bench_chat.heldout_prompts(args.prompt_file, tokenizer,
                                                    args.per_category).values() for p in ps]
  print(f"{len(prompts)} held-out prompts; greedy answers of {args.answer_tokens} tokens", flush=True)
  logits = bench_top_p.answer_logits(model, tokenizer, prompts, args.answer_tokens)
  result = {"nucleus": bench_top_p.nucleus_stats(logits, temps, top_ps), "warp": [], "decode": []}
  for r in result["nucleus"]:
    print(f"T={r['temperature']:g} top_p={r['top_p']:g}: nucleus median {r['nucleus_median']:.0f}, "
          f"max {r['nucleus_max']:.0f}; fits {r['fits_candidates']:.3f} / "
          f"{r['fits_second_tier']:.3f}", flush=True)
  for shape in (shapes if args.warp_repeats else []):
    for t in temps:
      for tp in top_ps:
        w = bench_top_p.warp_times(logits, shape, t, tp, args.warp_repeats)
        print(f"warp {w['shape']} T={t:g} top_p={tp:g}: candidates "
              f"{w['candidates_s']['median'] * 1e3:.2f} ms, first tier alone "
              f"{w['first_tier_only_s']['median'] * 1e3:.2f} ms, full sort "
              f"{w['full_sort_s']['median'] * 1e3:.2f} ms", flush=True)
        result["warp"].append(w)
  if args.decode_repeats:
    result["decode"] = bench_top_p.decode_times(
        model, tokenizer, prompts, args.max_new_tokens, args.decode_temperature, decode_top_ps,
        args.num_draft_tokens, args.decode_repeats, log=lambda m: print(m, flush=True))
  meta = report.provenance(command=report.command_line(__file__, argv), workdir=args.workdir,
                           settings=vars(args), load_average_before=load_before,
                           load_average=os.getloadavg(), logits_rows=int(logits.shape[0]))
  report.write_report(args.out, meta, result, bench_top_p.markdown(result, meta))
  print(f"wrote {args.out}.json and {args.out}.md")
  return 0


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError, ValueError))
