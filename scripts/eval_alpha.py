r"""Held-out acceptance of a target's MTP modules, no timing: alpha_1 at
G = 1 and tau at G = 1..3 per prompt category and temperature.

    python -m scripts.eval_alpha --workdir runs/smollm_mtp \
        [--prompt_file mtp/data/heldout_chat.jsonl] [--prompt_file FILE ...] \
        [--per_category 8] [--temperatures 0,1] [--num_draft_tokens 1,3] \
        [--max_new_tokens 128] [--batch_size 8] [--chat "TEXT" ...] [--out results/NAME.json]

Each prompt goes through the target's chat template and is decoded with
``--method mtp`` at each G (``--num_draft_tokens``), ``--batch_size`` rows
at a time (the output law is the target's, so a row's acceptance does not
depend on its batch). Per (category, T, G): rounds, emitted tokens,
tau = tokens / target calls, and alpha_1 = rounds whose first draft was
accepted / rounds (at G = 1 the accepted histogram's column 1 share).
``--chat`` adds single prompts, each its own category (``chat:<first
words>``). The JSON holds every count, so each printed ratio rebuilds.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def parse(argv):
  from mtp.cli import OneLineParser
  ap = OneLineParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", required=True, help="target with MTP modules")
  ap.add_argument("--prompt_file", action="append", default=None,
                  help="JSONL prompt file(s) (default: the held-out chat prompts)")
  ap.add_argument("--per_category", type=int, default=8, help="prompts per category, >= 1")
  ap.add_argument("--temperatures", default="0,1", help="comma list of temperatures >= 0")
  ap.add_argument("--num_draft_tokens", default="1", help="comma list of G in [1, 8]")
  ap.add_argument("--max_new_tokens", type=int, default=128, help="tokens per prompt, >= 1")
  ap.add_argument("--batch_size", type=int, default=8, help="rows decoded together, >= 1")
  ap.add_argument("--chat", action="append", default=[], help="an extra prompt (repeatable)")
  ap.add_argument("--seed", type=int, default=0, help="sampling seed")
  ap.add_argument("--out", default="", help="JSON report path")
  a = ap.parse_args(argv)
  for name in ("per_category", "max_new_tokens", "batch_size"):
    if getattr(a, name) < 1:
      ap.error(f"--{name}={getattr(a, name)} must be >= 1")
  try:
    a.temperatures = [float(x) for x in a.temperatures.split(",")]
    a.num_draft_tokens = [int(x) for x in a.num_draft_tokens.split(",")]
  except ValueError:
    ap.error("--temperatures / --num_draft_tokens: comma-separated numbers")
  if any(not t >= 0 for t in a.temperatures):
    ap.error(f"--temperatures={a.temperatures}: each must be >= 0")
  if any(not 1 <= g <= 8 for g in a.num_draft_tokens):
    ap.error(f"--num_draft_tokens={a.num_draft_tokens}: each must be in [1, 8]")
  if a.out:
    from mtp.cli import check_output_path
    check_output_path("out", a.out)
  return a


def load_prompts(files, per_category: int, chats) -> list[dict]:
  """The first ``per_category`` prompts of each category of each file, then ``chats``."""
  from mtp.data import chat as chat_lib
  out, seen = [], {}
  for path in files or [chat_lib.HELDOUT_CHAT_PATH]:
    for p in chat_lib.read_prompt_jsonl(path):
      cat = p.get("category", "prompt")
      if seen.get(cat, 0) < per_category:
        seen[cat] = seen.get(cat, 0) + 1
        out.append({**p, "category": cat})
  out += [{"category": "chat:" + " ".join(c.split()[:4]), "prompt": c} for c in chats]
  return out


def count_rows(gen, rows) -> dict:
  """Summed counts of ``rows`` of a Generation: rounds, first-draft
  acceptances, emitted tokens and target calls."""
  h = gen.accepted_histogram
  return {"rounds": int(sum(h[r].sum() for r in rows)),
          "first_accepted": int(sum(h[r, 1:].sum() for r in rows)),
          "tokens": int(sum(len(gen.tokens[r]) for r in rows)),
          "target_calls": int(sum(gen.target_calls[r] for r in rows))}


def evaluate(decoders: dict, prompts, temperatures, max_new_tokens, batch_size, seed, log=print):
  """{(category, T, G): counts} over ``prompts`` (dicts with category)."""
  import numpy as np
  from decode.sampling import SamplingParams
  from mtp.data import chat as chat_lib
  some = next(iter(decoders.values()))
  enc = [np.asarray(some.tokenizer.apply_chat_template(chat_lib.prompt_messages(p)), np.int32)
         for p in prompts]
  out: dict = {}
  for g, dec in decoders.items():
    for t in temperatures:
      for lo in range(0, len(prompts), batch_size):
        idx = list(range(lo, min(lo + batch_size, len(prompts))))
        gen = dec.generate([enc[i] for i in idx], max_new_tokens, SamplingParams(t), seed=seed + lo)
        for j, i in enumerate(idx):
          key = (prompts[i]["category"], t, g)
          c = count_rows(gen, [j])
          out[key] = {k: out.get(key, {}).get(k, 0) + v for k, v in c.items()}
      log(f"G={g} T={t:g}: {len(prompts)} prompts done")
  return out


def summary(counts: dict) -> list[dict]:
  rows = []
  for (cat, t, g), c in sorted(counts.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
    rows.append({"category": cat, "temperature": t, "G": g, **c,
                 "alpha_1": c["first_accepted"] / max(c["rounds"], 1),
                 "tau": c["tokens"] / max(c["target_calls"], 1)})
  return rows


def pooled(rows, key_fn) -> dict:
  """Per key, alpha_1 and tau pooled over rows (sums of counts)."""
  agg: dict = {}
  for r in rows:
    a = agg.setdefault(key_fn(r), {"rounds": 0, "first_accepted": 0, "tokens": 0, "target_calls": 0})
    for k in a:
      a[k] += r[k]
  return {k: {**v, "alpha_1": v["first_accepted"] / max(v["rounds"], 1),
              "tau": v["tokens"] / max(v["target_calls"], 1)} for k, v in agg.items()}


def main(argv=None) -> int:
  args = parse(argv)
  from decode.cli.run import load_decoder
  t0 = time.perf_counter()
  prompts = load_prompts(args.prompt_file, args.per_category, args.chat)
  decoders = {g: load_decoder(args.workdir, "mtp", g)[0] for g in args.num_draft_tokens}
  counts = evaluate(decoders, prompts, args.temperatures, args.max_new_tokens, args.batch_size,
                    args.seed)
  rows = summary(counts)
  by_t = pooled(rows, lambda r: f"G={r['G']} T={r['temperature']:g}")
  for r in rows:
    print(f"G={r['G']} T={r['temperature']:g} {r['category']:<24} alpha_1 {r['alpha_1']:.3f} "
          f"({r['first_accepted']}/{r['rounds']} rounds)  tau {r['tau']:.3f} "
          f"({r['tokens']}/{r['target_calls']} tokens/calls)")
  for k, v in by_t.items():
    print(f"{k} all: alpha_1 {v['alpha_1']:.3f} ({v['first_accepted']}/{v['rounds']})  "
          f"tau {v['tau']:.3f} ({v['tokens']}/{v['target_calls']})")
  if args.out:
    from mtp import report
    doc = {"meta": report.provenance(command=report.command_line(__file__, argv)),
           "workdir": os.path.abspath(args.workdir), "prompt_files": args.prompt_file,
           "per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
           "batch_size": args.batch_size, "seed": args.seed, "rows": rows, "pooled": by_t,
           "wall_s": round(time.perf_counter() - t0, 1)}
    from mtp.files import write_atomic
    write_atomic(args.out, json.dumps(doc, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  from mtp.cli import main_guard
  main_guard(main)
