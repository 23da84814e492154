r"""Round-cost breakdown: where the time of one decoding round goes.

    python scripts/bench_round.py --workdir runs/reference [--num_draft_tokens 1,2,3] \
        [--trees "3,2,1;2,2,1"] [--temperatures 0,1] [--batch_size 1] [--repeats 5] \
        [--out results/bench_round]

For AR and each draft length G, at each temperature, held-out prompts are
decoded in the while_loop form (``Decoder.generate``): first timed without a
profiler (median wall time per round of the decoding phase, prefill
excluded, over ``repeats`` generations: the number to trust), then once
under ``jax.profiler``. Every XLA operation the
CPU runtime executed (one trace event per thunk: a fusion, a dot, a gather,
a dynamic-update-slice, ...) is attributed, through the op_name metadata of
the compiled program, to the named scope of the decoding code it came from:

    draft/module<k>        MTP module k (embedding, norms, projection, block)
    draft/module<D>_reuse  module D reused for steps past D
    draft/head             the shared output head on the drafting position
    draft/sample           warping, softmax and sampling of a draft
    draft/buffers          gathers and writes of hidden states and tokens
    verify/forward         the target forward over the verify block
    verify/head            the target's head over the block
    verify/warp            warping and softmax of the target's logits
    accept                 the acceptance rule (or sampling, for AR)
    commit                 emission, EOS / budget cuts, statistics
    rng                    key splitting
    loop                   operations of the loop body outside every scope

and reported as microseconds and operations per round. ``--trees`` adds
token-tree columns (decode/tree.py; its commit includes the K/V move of the
accepted path, its verify/forward the tree-masked target call). The profiler adds a
small cost per operation, so the profiled total exceeds the unprofiled
round time; the shares are what the table is for. Prefill is reported
apart (once per generation). Writes ``OUT.json`` (with provenance) and
``OUT.md``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile

from decode import tree as tree_lib
from decode.speculative import MAX_DRAFT_TOKENS, DecodeError
from mtp import loading
from mtp import cli, report
from mtp import config as config_lib
from mtp import data as data_lib
from mtp import tokenizer as tok
from mtp.model import build_model
from scripts import bench_chat_lib as bench_chat
from scripts import bench_profile


PIECE_ORDER = ["draft/module1", "draft/module2", "draft/module3", "draft/module4", "draft/head",
               "draft/sample", "draft/buffers", "verify/forward", "verify/head", "verify/warp",
               "accept", "commit", "rng", "loop"]


def markdown(results, meta) -> str:
  cols = [(r["temperature"], r["num_draft_tokens"], r.get("tree")) for r in results]
  head = " | ".join(f"T={t:g} {'AR' if g == 0 else f'tree {tr}' if tr else f'G={g}'}"
                    for t, g, tr in cols)
  pieces = [p for p in PIECE_ORDER if any(p in r["pieces"] for r in results)]
  pieces += sorted({p for r in results for p in r["pieces"]} - set(pieces))
  lines = [f"Round-cost breakdown: {meta['model']} on {report.machine(meta)}, JAX {meta['jax_version']}, "
           f"commit {meta['commit']}, {meta['date']}; batch {meta['batch_size']}, "
           f"{meta['max_new_tokens']} new tokens, prompts {meta['dataset']} "
           f"({min(meta['prompt_tokens'])}-{max(meta['prompt_tokens'])} tokens); "
           f"while_loop form.", "",
           "Microseconds per round (operations per round) by piece, from one profiled generation; "
           "`loop`: operations of the loop body outside every named scope. The profiler adds a "
           "little per operation, so the profiled total exceeds the unprofiled round.", "",
           f"| piece | {head} |", "|---|" + "---|" * len(cols)]
  for p in pieces:
    cells = []
    for r in results:
      v = r["pieces"].get(p)
      cells.append("-" if v is None else f"{v['us_per_round']:.1f} ({v['ops_per_round']:.0f})")
    lines.append(f"| {p} | " + " | ".join(cells) + " |")
  lines.append("| profiled total | " + " | ".join(f"{r['profiled_us_per_round']:.1f}" for r in results) + " |")
  lines.append("| **round, unprofiled** | " + " | ".join(f"**{r['round_us']:.1f}**" for r in results) + " |")
  lines.append("| round / AR step | " + " | ".join(f"{r['round_over_ar']:.2f}" for r in results) + " |")
  lines.append("| drafting share of round | " + " | ".join(
      f"{r['draft_share']:.2f}" for r in results) + " |")
  lines.append("| prefill ms (per generation) | " + " | ".join(
      f"{r['prefill_us'] / 1e3:.1f}" for r in results) + " |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=cli.HelpFormatter)
  src = ap.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="trained checkpoint to decode with")
  src.add_argument("--config", help="config file: decode a randomly initialised model of it "
                                    "(costs only; acceptance is meaningless)")
  ap.add_argument("--dataset", default="python_stdlib",
                  help="held-out prompt dataset (byte targets; a target whose tokenizer has a chat "
                       "template reads --chat_prompts instead)")
  ap.add_argument("--chat_prompts", default=data_lib.HELDOUT_CHAT_PATH,
                  help="chat prompt JSONL for a chat target (default: the held-out set); row i "
                       "takes the i-th prompt with categories in turn")
  ap.add_argument("--data_dir", default="", help=cli.DATA_DIR_HELP)
  ap.add_argument("--prompt_bytes", type=int, default=256, help="bytes per prompt, >= 1")
  ap.add_argument("--max_new_tokens", type=int, default=128, help="new tokens per row, >= 1")
  ap.add_argument("--batch_size", type=int, default=1, help="rows per generation, >= 1")
  ap.add_argument("--temperatures", default="0,1", help="comma list of temperatures >= 0")
  ap.add_argument("--num_draft_tokens", default=None, help="comma list of G >= 1 (default 1..D)")
  ap.add_argument("--trees", default=None,
                  help="semicolon list of token trees (branching per depth, depth 1..D), e.g. "
                       "\"3,2,1;2,2,1\"")
  ap.add_argument("--repeats", type=int, default=5, help="unprofiled timed generations, >= 1")
  ap.add_argument("--out", default="results/bench_round", help="output prefix (OUT.json, OUT.md)")
  ap.add_argument("--quick", action="store_true",
                  help="tiny sizes for tests: --max_new_tokens 8 --prompt_bytes 32 --repeats 1 "
                       "--temperatures 0,1 and G = 1 where not given")
  args = ap.parse_args(argv)
  if args.quick:
    cli.apply_quick(ap, args, max_new_tokens=8, prompt_bytes=32, repeats=1)
  cli.check_range(ap, args, prompt_bytes=1, max_new_tokens=1, batch_size=1, repeats=1)
  temps = cli.parse_list(ap, "temperatures", args.temperatures, float, 0.0)
  if args.workdir:
    cfg, model, step = loading.load_model(args.workdir)
    name = f"{args.workdir} (step {step})"
  else:
    if not os.path.isfile(args.config):
      ap.error(f"--config={args.config!r}: no such file")
    cfg = config_lib.load_config_file(args.config)
    model, step, name = build_model(cfg), None, f"{args.config} (random init)"
  depth = cfg.mtp.depth
  if depth < 1:
    ap.error(f"the model has MTP depth D = 0: there is no MTP round to break down")
  gs = (cli.parse_list(ap, "num_draft_tokens", args.num_draft_tokens, int, 1, MAX_DRAFT_TOKENS)
        if args.num_draft_tokens is not None else ([1] if args.quick else list(range(1, depth + 1))))
  trees = []
  for text in ([] if args.trees is None else args.trees.split(";")):
    try:
      trees.append(tree_lib.parse_tree(text.strip(), depth).branching)
    except ValueError as e:
      ap.error(str(e).replace("--tree=", "--trees: tree "))
  tokenizer = tok.load_tokenizer(args.workdir) if args.workdir else None
  if tokenizer is not None and getattr(tokenizer, "chat_template", None):
    # a chat target: the held-out chat prompts (categories in turn) through its template
    by_cat = bench_chat.heldout_prompts(args.chat_prompts, tokenizer, args.batch_size)
    order = [p for group in itertools.zip_longest(*by_cat.values()) for p in group if p is not None]
    prompts = [order[i % len(order)] for i in range(args.batch_size)]
    source = f"{args.chat_prompts} (chat template)"
  else:
    texts = data_lib.held_out_prompts(args.dataset, args.batch_size, args.prompt_bytes,
                                      data_dir=args.data_dir)
    prompts = [tok.ByteTokenizer().encode(t, add_bos=True) for t in texts]
    source = args.dataset
  with tempfile.TemporaryDirectory() as trace_root:
    results = bench_profile.round_breakdown(model, prompts, temps, gs, trees, args.max_new_tokens,
                                            args.repeats, trace_root,
                                            log=lambda s: print(s, flush=True),
                                            tokenizer=tokenizer)
  meta = report.provenance(command=report.command_line(__file__, argv), model=name, checkpoint_step=step, config=cfg.to_dict(),
                           batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                           prompt_bytes=args.prompt_bytes, dataset=source,
                           prompt_tokens=[int(len(p)) for p in prompts],
                           repeats=args.repeats)
  report.write_report(args.out, meta, results, markdown(results, meta))
  print(f"wrote {args.out}.json and {args.out}.md")


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError,))
