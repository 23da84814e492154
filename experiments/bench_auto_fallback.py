r"""What "auto" costs when it does not draft: its plain-AR fallback against AR.

    python -m experiments.bench_auto_fallback --workdir runs/smollm_demo \
        [--prompt_file P] [--batch_sizes 1,4] [--max_new_tokens 128] [--repeats 15] \
        [--out results/bench_auto_fallback]

For each batch size B, the first B prompts of ``--prompt_file`` (default: the
held-out chat prompts) are decoded at T = 0 by two decoders of one target:
AR, and MTP with ``num_draft_tokens="auto"`` whose fixed round costs make
every draft length lose (``auto_costs`` [1, 1e3, ...]), so every call
takes the fallback path (``decode.auto.calibrate.start`` returns None, then
``Decoder.plain_ar``). Both are timed as whole calls (``generate`` as a
user calls it: the fallback's host-side decision included) in interleaved
repeats after compilation (``mtp.timing.interleaved_times``). Reports per B:
the per-repeat ratios AR seconds / fallback seconds (> 1: the fallback is
faster), their median and min-max, and the ratio of the median walls.
Writes OUT.json (with provenance) and OUT.md.
"""

from __future__ import annotations

import argparse
import os

from mtp import cli

if __name__ == "__main__":
  cli.refuse_bad_flags(max_new_tokens=(int, 1), repeats=(int, 1))

from experiments import common  # noqa: E402


def ratios(ar_s, fallback_s) -> dict:
  """{"per_repeat": [AR / fallback per round], "median", "min", "max",
  "ratio_of_medians"}: speedups of the fallback over AR from paired walls
  (seconds, same round index = timed back to back)."""
  import numpy as np
  ar, fb = np.asarray(ar_s, np.float64), np.asarray(fallback_s, np.float64)
  per = ar / fb
  return {"per_repeat": per.tolist(), "median": float(np.median(per)), "min": float(per.min()),
          "max": float(per.max()), "ratio_of_medians": float(np.median(ar) / np.median(fb))}


def time_batch(target, tokenizer, prompts, max_new_tokens: int, repeats: int) -> dict:
  """Interleaved whole-call walls of AR and of the auto fallback on
  ``prompts`` (token arrays), greedy; raises AssertionError when the
  fallback drafted or its tokens differ from AR's."""
  import numpy as np
  from decode.decoder import Decoder
  from decode.sampling import SamplingParams
  from mtp.timing import interleaved_times
  g_max = 3
  ar = Decoder(target, "ar", tokenizer=tokenizer)
  auto = Decoder(target, "mtp", "auto", max_draft_tokens=g_max, tokenizer=tokenizer,
                 auto_costs=[1.0] + [1e3] * g_max)
  sp = SamplingParams(temperature=0.0)
  out = {}

  def call(name, dec):
    def f():
      out[name] = dec.generate(prompts, max_new_tokens, sp, seed=0)
    return f

  times = interleaved_times({"ar": call("ar", ar), "fallback": call("fallback", auto)}, repeats)
  a, f = out["ar"], out["fallback"]
  drafted = int(np.asarray(f.draft_length_histogram)[:, 1:].sum())
  assert drafted == 0, f"the fallback drafted {drafted} rounds"
  assert all(np.array_equal(x, y) for x, y in zip(a.tokens, f.tokens)), "fallback != AR tokens"
  return {"batch_size": len(prompts), "new_tokens": int(sum(len(t) for t in a.tokens)),
          "ar_s": times["ar"].tolist(), "fallback_s": times["fallback"].tolist(),
          "speedup": ratios(times["ar"], times["fallback"])}


def markdown(result: dict, meta: dict) -> str:
  from mtp import report
  load = ", ".join(f"{x:.1f}" for x in meta["load_average_before"][:1] + meta["load_average"][:1])
  lines = [f"Machine: {report.machine(meta)}, {meta['date']}, commit {meta['commit']}; "
           f"1-min load average before, after: {load} (above the core count, the spread is "
           "noise from other work: rerun on a quiet machine).", "",
           "| B | new tokens | AR wall (median) | fallback wall (median) | per-repeat AR/fallback: median (min-max) | ratio of medians |",
           "|---|---|---|---|---|---|"]
  import numpy as np
  for r in result["batches"]:
    s = r["speedup"]
    lines.append(f"| {r['batch_size']} | {r['new_tokens']} | {np.median(r['ar_s']) * 1e3:.1f} ms | "
                 f"{np.median(r['fallback_s']) * 1e3:.1f} ms | {s['median']:.3f}x "
                 f"({s['min']:.3f}-{s['max']:.3f}x) | {s['ratio_of_medians']:.3f}x |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  ap = cli.OneLineParser(description=__doc__.split("\n\n")[0],
                         formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", required=True, help="a trained or imported workdir with MTP modules")
  ap.add_argument("--prompt_file", default=None,
                  help="prompts (decode's --prompt_file layout); default the held-out chat prompts")
  ap.add_argument("--batch_sizes", default="1,4", help="comma list of B, each >= 1")
  ap.add_argument("--max_new_tokens", type=int, default=128, help="budget per row, >= 1")
  ap.add_argument("--repeats", type=int, default=15, help="interleaved timed calls of each, >= 1")
  ap.add_argument("--out", default="results/bench_auto_fallback", help="output prefix (OUT.json, OUT.md)")
  args = ap.parse_args(argv)
  cli.check_range(ap, args, max_new_tokens=1, repeats=1)
  sizes = cli.parse_list(ap, "batch_sizes", args.batch_sizes, int, 1)
  cli.check_output_path("out", args.out, "prefix")

  from decode.cli import texts
  from mtp import loading, report
  from mtp import tokenizer as tok_lib
  _, target, _ = loading.load_model(args.workdir)
  tokenizer = tok_lib.load_tokenizer(args.workdir)
  path = args.prompt_file or os.path.join(os.path.dirname(loading.__file__), "data",
                                         "heldout_chat.jsonl")
  prompts = texts.read_prompts(path)[:max(sizes)]
  if len(prompts) < max(sizes):
    ap.error(f"--batch_sizes: {path} holds {len(prompts)} prompts, fewer than B = {max(sizes)}")
  chat = isinstance(prompts[0], dict)
  ids = texts.encode_prompts([p["prompt"] if chat else p for p in prompts], tokenizer, chat=chat,
                             systems=[p.get("system") for p in prompts] if chat else None)
  load_before = os.getloadavg()
  batches = []
  for b in sizes:
    r = time_batch(target, tokenizer, ids[:b], args.max_new_tokens, args.repeats)
    s = r["speedup"]
    print(f"B={b}: fallback vs AR {s['median']:.3f}x per repeat (median; {s['min']:.3f}-"
          f"{s['max']:.3f}x), ratio of medians {s['ratio_of_medians']:.3f}x", flush=True)
    batches.append(r)
  result = {"batches": batches}
  meta = report.provenance(command=common.command_line(__file__, argv), workdir=args.workdir,
                           settings=vars(args), load_average_before=load_before,
                           load_average=os.getloadavg())
  report.write_report(args.out, meta, result, markdown(result, meta))
  print(f"wrote {args.out}.json and {args.out}.md")
  return 0


if __name__ == "__main__":
  from decode.errors import DecodeError
  cli.main_guard(main, errors=(DecodeError,))
