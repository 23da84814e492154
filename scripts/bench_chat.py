r"""Held-out chat benchmark of a target with MTP modules: AR and MTP
speculative decoding side by side, per prompt category and batch size.

    python scripts/bench_chat.py --workdir runs/smollm_mtp [--per_category 2] \
        [--temperatures 0,1] [--num_draft_tokens 1,2,3] [--max_new_tokens 128] \
        [--categories code,math] [--auto] [--trees 3,2-2] [--batch_sizes 1,4] [--repeats N] \
        [--out results/bench_chat_smollm] \
        [--baselines transformers,prompt_lookup:3,prompt_lookup,llamacpp [--baseline_model GGUF]] \
        [--quick]

Prompts: ``mtp/data/heldout_chat.jsonl`` (or ``--prompt_file``) through the
target's chat template. ``--baselines``: other decoders on the target's
weights in the same interleaved rounds at T = 0 (transformers' greedy
``generate``, its prompt lookup decoding with K tokens, llama.cpp; one line
says so when llama-cpp-python is missing), one table side by side.
Libraries: ``decode/bench_chat.py``, ``decode/bench_baselines.py``.
"""

from __future__ import annotations

import argparse
import os

from decode.speculative import MAX_DRAFT_TOKENS, DecodeError
from mtp import cli, report
from mtp.importers import smollm
from scripts import baseline_decoders
from scripts import bench_chat_lib as bench_chat


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
  ap.add_argument("--trees", default="",
                  help="comma list of token trees, branching per depth joined by '-' "
                       "(e.g. 3,2-2: the trees (3,) and (2, 2))")
  ap.add_argument("--batch_sizes", default="1", help="comma list of batch sizes >= 1 "
                  "(baselines run at B = 1 only)")
  ap.add_argument("--repeats", type=int, default=None,
                  help="timed repeats per category, >= 1 (default: one per prompt; cycling)")
  ap.add_argument("--baselines", default="",
                  help="comma list: transformers, prompt_lookup[:K] (K = 10 if not given), "
                       "llamacpp[:THREADS]")
  ap.add_argument("--baseline_model", default=None,
                  help="GGUF file or HF directory of the target's weights (default: SmolLM2's GGUF)")
  ap.add_argument("--llamacpp_threads", type=int, default=2, help="llama.cpp threads, >= 1")
  ap.add_argument("--out", default="results/bench_chat", help="output prefix (OUT.json, OUT.md)")
  ap.add_argument("--quick", action="store_true",
                  help="fills in --per_category 1 --temperatures 0 --num_draft_tokens 1 "
                       "--max_new_tokens 8 where not given")
  args = ap.parse_args(argv)
  if args.quick:
    cli.apply_quick(ap, args, per_category=1, temperatures="0", num_draft_tokens="1",
                    max_new_tokens=8)
  cli.check_range(ap, args, per_category=1, max_new_tokens=1, llamacpp_threads=1)
  if args.repeats is not None:
    cli.check_range(ap, args, repeats=1)
  try:
    specs = baseline_decoders.parse_specs(args.baselines)
  except ValueError as e:
    ap.error(str(e))
  if specs and args.baseline_model is None:
    args.baseline_model = smollm.gguf_path()
    if args.baseline_model is None:
      ap.error(f"--baselines without --baseline_model needs {smollm.PACKAGE} (make smollm)")
  s = bench_chat.ChatBench(
      workdir=args.workdir, prompt_file=args.prompt_file, per_category=args.per_category,
      categories=tuple(cli.list_items(ap, "categories", args.categories)) if args.categories else (),
      temperatures=tuple(cli.parse_list(ap, "temperatures", args.temperatures, float, 0.0)),
      num_draft_tokens=tuple(cli.parse_list(ap, "num_draft_tokens", args.num_draft_tokens, int, 1,
                                            MAX_DRAFT_TOKENS)),
      max_new_tokens=args.max_new_tokens, with_auto=args.auto, repeats=args.repeats,
      trees=tuple(t.replace("-", ",") for t in cli.list_items(ap, "trees", args.trees))
      if args.trees else (),
      batch_sizes=tuple(cli.parse_list(ap, "batch_sizes", args.batch_sizes, int, 1)),
      baselines=specs, baseline_model=args.baseline_model, llamacpp_threads=args.llamacpp_threads)
  load_before = os.getloadavg()
  result = bench_chat.run_chat_bench(s, log=lambda m: print(m, flush=True))
  meta = report.provenance(command=report.command_line(__file__, argv), workdir=args.workdir,
                           settings=vars(args), load_average_before=load_before,
                           load_average=os.getloadavg())
  report.write_report(args.out, meta, result, bench_chat.markdown(result["rows"], meta))
  print(f"wrote {args.out}.json and {args.out}.md")
  return 0


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError, ValueError))
