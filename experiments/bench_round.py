r"""Round-cost breakdown: where the time of one decoding round goes.

    python -m experiments.bench_round --workdir runs/reference [--num_draft_tokens 1,2,3] \
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

import collections
import glob
import gzip
import itertools
import json
import os
import re
import tempfile

from mtp import cli

if __name__ == "__main__":     # a flag out of range: one line, before the imports below load jax
  from decode.limits import MAX_DRAFT_TOKENS
  cli.refuse_bad_flags(prompt_bytes=(int, 1), max_new_tokens=(int, 1), batch_size=(int, 1),
                       repeats=(int, 1), temperatures=(list, float, 0),
                       num_draft_tokens=(list, int, 1, MAX_DRAFT_TOKENS))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from decode import tree as tree_lib  # noqa: E402
from decode.decoder import MAX_DRAFT_TOKENS, DecodeError, Decoder, SamplingParams  # noqa: E402
from experiments import common  # noqa: E402
from mtp import loading, report  # noqa: E402
from mtp import data as data_lib  # noqa: E402
from mtp import tokenizer as tok  # noqa: E402
from mtp.model import build_model  # noqa: E402
from mtp.timing import interleaved_times  # noqa: E402
from scripts import bench_chat  # noqa: E402


# -- the library: round-cost breakdown by named scope --------------------------------------
#
# Round-cost breakdown: where the time of one decoding round goes, by the
# named scope of the decoding code.
#
# A generation runs once under ``jax.profiler``; every XLA operation the CPU
# runtime executed (one trace event per thunk) is attributed, through the
# op_name metadata of the compiled program, to the named scope it came from
# (draft/module<k>, draft/head, draft/sample, draft/buffers, verify/forward,
# verify/head, verify/warp, accept, commit, rng; "loop" for the rest of the
# loop body; prefill apart). The unprofiled round time comes from
# ``round_time_s``. ``profile_generation`` lowers ``Decoder``'s jitted
# prefill and generate (``Decoder.lowered``) to read their HLO.

_OP = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name="([^"]*)"')
_SCOPES = ("draft", "verify", "accept", "commit", "rng", "prefill")
_CONTAINERS = ("while", "conditional", "call")


def op_scopes(hlo_text: str) -> dict[str, str]:
  """{HLO instruction name: op_name metadata} for every instruction of a
  compiled program's text (``compiled.as_text()``)."""
  out = {}
  for line in hlo_text.splitlines():
    m = _OP.match(line)
    if m:
      out[m.group(1)] = m.group(2)
  return out


def piece_of(op_name: str) -> str:
  """The breakdown row of an op_name: the first scope of ``_SCOPES`` in its
  path, with the sub-scope for draft/ and verify/ (``draft/module1``);
  "loop" when it carries none."""
  parts = op_name.split("/")
  for i, part in enumerate(parts):
    if part in _SCOPES:
      if part in ("draft", "verify") and i + 1 < len(parts):
        return f"{part}/{parts[i + 1]}"
      return part
  return "loop"


def trace_events(trace_dir: str) -> list[dict]:
  """Complete ('X') events of the newest trace under ``trace_dir``."""
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
                 key=os.path.getmtime)
  if not files:
    raise RuntimeError(f"jax.profiler wrote no trace under {trace_dir}")
  with gzip.open(files[-1]) as f:
    return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def breakdown(events: list[dict], scopes: dict[str, str]) -> dict:
  """Aggregates thunk events by piece. Returns {"pieces": {piece: {"us": total
  microseconds, "ops": count}}, "prefill": {...}}: an operation belongs to
  the round when its op_name lies in the while_loop body, to "prefill" when
  it carries that scope; container thunks (while, conditional, call) are
  not counted themselves, only what runs inside them."""
  pieces: dict[str, dict] = collections.defaultdict(lambda: {"us": 0.0, "ops": 0})
  prefill = {"us": 0.0, "ops": 0}
  for e in events:
    name = e["name"]
    if name not in scopes or name.split(".")[0] in _CONTAINERS:
      continue
    op_name = scopes[name]
    if "prefill" in op_name.split("/"):
      prefill["us"] += e["dur"]
      prefill["ops"] += 1
    elif "/while/body/" in op_name:
      piece = piece_of(op_name.split("/while/body/", 1)[1])
      pieces[piece]["us"] += e["dur"]
      pieces[piece]["ops"] += 1
  return {"pieces": dict(pieces), "prefill": prefill}


def profile_generation(decoder: Decoder, prompts, max_new: int, sp: SamplingParams, seed: int,
                       trace_dir: str) -> tuple[dict, int]:
  """Runs one (already compiled) ``generate`` under the profiler; returns
  (breakdown, rounds) with rounds = target calls of the longest row."""
  state, prefill_len = decoder.prepare(prompts, max_new, seed)
  prefill, generate = decoder.lowered(state, prefill_len, sp)
  scopes = op_scopes(prefill.compile().as_text())
  scopes.update(op_scopes(generate.compile().as_text()))
  decoder.generate(prompts, max_new, sp, seed)        # warm (same shapes)
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0                    # device (thunk) events only
  jax.profiler.start_trace(trace_dir, profiler_options=options)
  try:
    gen = decoder.generate(prompts, max_new, sp, seed)
  finally:
    jax.profiler.stop_trace()
  return breakdown(trace_events(trace_dir), scopes), int(gen.target_calls.max())


def round_time_s(decoder: Decoder, prompts, max_new: int, sp: SamplingParams, repeats: int):
  """Median seconds per round of the decoding phase ((wall - prefill) /
  rounds) and median seconds per generation, without the profiler: one
  compiling generation (seed 0), then ``repeats`` generations with seeds
  0..repeats-1, timed by the decoder itself (``wall_time_s``,
  ``prefill_time_s``)."""
  seeds, gens = iter([0, *range(repeats)]), []

  def generate():
    gens.append(decoder.generate(prompts, max_new, sp, next(seeds)))
  interleaved_times({"generate": generate}, repeats, warmup=1)
  walls = [g.wall_time_s for g in gens[1:]]
  per_round = [(g.wall_time_s - g.prefill_time_s) / int(g.target_calls.max()) for g in gens[1:]]
  return float(np.median(per_round)), float(np.median(walls))


def round_breakdown(model, prompts, temperatures, gs, trees, max_new: int, repeats: int,
                    trace_root: str, log=print, tokenizer=None) -> list[dict]:
  """For every temperature: AR, MTP with each G in ``gs`` and each tree in
  ``trees`` (branching tuples), timed (``round_time_s``) and profiled once
  (``profile_generation``, traces under ``trace_root``). ``prompts``:
  encoded token arrays, one per row; ``tokenizer``: the model's tokenizer
  (required for a BPE model: ``mtp.tokenizer.load_tokenizer(workdir)``;
  its stop ids end rows). Returns one row per (T, decoder):
  temperature, num_draft_tokens (0: AR; tree depth for trees), tree ("b1,b2"
  or None), pieces {piece: {us_per_round, ops_per_round}},
  profiled_us_per_round, round_us, round_over_ar, draft_share,
  generation_s, rounds, prefill_us."""
  results = []
  for t in temperatures:
    sp = SamplingParams(temperature=t)
    ar_us = None
    for g, tree in [(0, None)] + [(g, None) for g in gs] + [(len(t), t) for t in trees]:
      kw = {"tokenizer": tokenizer} if tokenizer is not None else {}
      dec = (Decoder(model, "ar", **kw) if g == 0 else Decoder(model, "mtp", g, **kw)
             if tree is None else Decoder(model, "mtp", tree=tree, **kw))
      label = "AR" if g == 0 else f"G={g}" if tree is None else f"tree {','.join(map(str, tree))}"
      rnd_s, wall_s = round_time_s(dec, prompts, max_new, sp, repeats)
      bd, rounds = profile_generation(dec, prompts, max_new, sp, 0,
                                      os.path.join(trace_root, f"t{t}_{label.replace(' ', '_')}"))
      pieces = {p: {"us_per_round": v["us"] / rounds, "ops_per_round": v["ops"] / rounds}
                for p, v in bd["pieces"].items()}
      total = sum(v["us_per_round"] for v in pieces.values())
      draft = sum(v["us_per_round"] for p, v in pieces.items() if p.startswith("draft/"))
      ar_us = rnd_s * 1e6 if g == 0 else ar_us
      results.append({"temperature": t, "num_draft_tokens": g,
                      "tree": None if tree is None else ",".join(map(str, tree)), "pieces": pieces,
                      "profiled_us_per_round": total, "round_us": rnd_s * 1e6,
                      "round_over_ar": rnd_s * 1e6 / ar_us, "draft_share": draft / total,
                      "generation_s": wall_s, "rounds": rounds,
                      "prefill_us": bd["prefill"]["us"]})
      log(f"T={t:g} {label}: round {rnd_s * 1e6:.0f} us "
          f"({rnd_s * 1e6 / ar_us:.2f} AR steps), drafting {draft / total:.0%} of the "
          f"profiled round")
  return results


# -- command line --------------------------------------------------------------------------

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
  ap = cli.OneLineParser(description=__doc__, formatter_class=cli.HelpFormatter)
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
  cli.check_output_path("out", args.out, "prefix")
  temps = cli.parse_list(ap, "temperatures", args.temperatures, float, 0.0)
  if args.workdir:
    cfg, model, step = loading.load_model(args.workdir)
    name = f"{args.workdir} (step {step})"
  else:
    cfg = common.load_config(ap, args.config)
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
    results = round_breakdown(model, prompts, temps, gs, trees, args.max_new_tokens,
                                            args.repeats, trace_root,
                                            log=lambda s: print(s, flush=True),
                                            tokenizer=tokenizer)
  meta = report.provenance(command=common.command_line(__file__, argv), model=name, checkpoint_step=step, config=cfg.to_dict(),
                           batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                           prompt_bytes=args.prompt_bytes, dataset=source,
                           prompt_tokens=[int(len(p)) for p in prompts],
                           repeats=args.repeats)
  report.write_report(args.out, meta, results, markdown(results, meta))
  print(f"wrote {args.out}.json and {args.out}.md")


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError,))
