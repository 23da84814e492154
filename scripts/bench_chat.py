r"""Held-out chat benchmark of a target with MTP modules: AR and MTP
speculative decoding side by side at B = 1, per prompt category.

    python scripts/bench_chat.py --workdir runs/smollm_mtp [--per_category 2] \
        [--temperatures 0,1] [--num_draft_tokens 1,2,3] [--max_new_tokens 128] \
        [--categories code,math] [--auto] [--out results/bench_chat_smollm] [--quick]

Prompts: ``mtp/data/heldout_chat.jsonl`` (or ``--prompt_file``) through the
target's chat template. Library: ``decode/bench_chat.py``.
"""

from __future__ import annotations

import argparse
import os

from decode import bench_chat
from decode.speculative import DecodeError
from mtp import cli, report


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--workdir", required=True, help="target with MTP modules (D >= 1)")
  ap.add_argument("--prompt_file", default=bench_chat.chat_lib.HELDOUT_CHAT_PATH,
                  help="chat JSONL ({prompt, category, system})")
  ap.add_argument("--per_category", type=int, default=2, help="prompts per category, >= 1")
  ap.add_argument("--categories", default="", help="comma list (default: all in the file)")
  ap.add_argument("--temperatures", default="0,1", help="comma list of temperatures >= 0")
  ap.add_argument("--num_draft_tokens", default="1,2,3", help="comma list of G >= 1")
  ap.add_argument("--max_new_tokens", type=int, default=128, help="token budget per prompt, >= 1")
  ap.add_argument("--auto", action="store_true", help="also --num_draft_tokens auto")
  ap.add_argument("--out", default="results/bench_chat", help="output prefix (OUT.json, OUT.md)")
  ap.add_argument("--quick", action="store_true",
                  help="fills in --per_category 1 --temperatures 0 --num_draft_tokens 1 "
                       "--max_new_tokens 8 where not given")
  args = ap.parse_args(argv)
  if args.quick:
    cli.apply_quick(ap, args, per_category=1, temperatures="0", num_draft_tokens="1",
                    max_new_tokens=8)
  cli.check_range(ap, args, per_category=1, max_new_tokens=1)
  s = bench_chat.ChatBench(
      workdir=args.workdir, prompt_file=args.prompt_file, per_category=args.per_category,
      categories=tuple(c for c in args.categories.split(",") if c),
      temperatures=tuple(cli.parse_list(ap, "temperatures", args.temperatures, float, 0.0)),
      num_draft_tokens=tuple(cli.parse_list(ap, "num_draft_tokens", args.num_draft_tokens, int, 1)),
      max_new_tokens=args.max_new_tokens, with_auto=args.auto)
  rows = bench_chat.run_chat_bench(s, log=lambda m: print(m, flush=True))
  meta = report.provenance(command=report.command_line(__file__, argv), workdir=args.workdir,
                           settings=vars(args), load_average=os.getloadavg())
  report.write_report(args.out, meta, {"rows": rows, "overall": bench_chat.overall(rows)},
                      bench_chat.markdown(rows, meta))
  print(f"wrote {args.out}.json and {args.out}.md")
  return 0


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError, ValueError))
