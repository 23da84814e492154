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
The other decoders: ``scripts/baseline_decoders.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Sequence

from decode.sampling import SamplingParams
from decode.decoder import MAX_DRAFT_TOKENS, DecodeError, Decoder
from mtp import cli, loading, report
from mtp import tokenizer as tok_lib
from mtp.data import chat as chat_lib
from mtp.importers import smollm
from scripts import baseline_decoders, bench_lib


# -- the library: the held-out chat benchmark ----------------------------------------------
#
# Held-out chat benchmark of a target with MTP modules (issue 22 item 5):
# AR and MTP speculative decoding side by side on chat prompts, per category.
#
# The prompts are the held-out set ``mtp/data/heldout_chat.jsonl`` (written
# by hand, no overlap with any training prompt: ``mtp.data.chat.overlaps``),
# rendered with the target tokenizer's chat template. Per category the first
# ``per_category`` prompts are decoded at each batch size B (1 by default;
# at B > 1 a batch cycles through the category's prompts) by every decoder
# (``scripts.bench_lib.measure_point``: repeat r decodes the same rows with seed r
# in every cell, interleaved, after an untimed compile of every prompt-length
# bucket), so every speedup is a ratio of tokens/s over the same prompts in
# one process. Decoders: AR, MTP chains of each G, optionally "auto" and
# token trees (``trees``: branching strings such as "3" or "2,2"). A row is
# one (category, decoder, temperature, B):
# ``summarize_cell``'s fields (speedup over AR, tau, alpha_k, the cost ratio
# c, the ideal speedup of Leviathan et al. 2023 Theorem 3.8 and the
# efficiency) plus ``category``.
#
# Baselines (``ChatBench.baselines``, ``scripts.baseline_decoders``):
# transformers' greedy ``generate``, its prompt lookup decoding and llama.cpp
# on the weights the target was imported from (``baseline_model``), in the
# same interleaved rounds as AR and MTP at T = 0 (they are greedy only), on
# the same prompt ids (transformers' chat template is checked to give the
# same ids: ``check_prompt_ids``). Their rows carry tokens/s, the speedup
# over our AR and the agreement of their tokens with AR's.

@dataclasses.dataclass(frozen=True)
class ChatBench:
  """Settings of one held-out chat benchmark (``scripts/bench_chat.py``)."""
  workdir: str
  prompt_file: str = chat_lib.HELDOUT_CHAT_PATH
  per_category: int = 2            # prompts per category (B = 1 each)
  categories: tuple[str, ...] = ()  # () = every category of the file
  temperatures: tuple[float, ...] = (0.0, 1.0)
  num_draft_tokens: tuple[int, ...] = (1, 2, 3)
  max_new_tokens: int = 128
  with_auto: bool = False
  trees: tuple[str, ...] = ()      # token trees, e.g. ("3", "2,2")
  batch_sizes: tuple[int, ...] = (1,)   # baselines run at B = 1 only
  baselines: tuple[baseline_decoders.Spec, ...] = ()   # baseline_decoders.parse_specs
  baseline_model: str | None = None   # GGUF file or HF directory of the target's weights
  llamacpp_threads: int = 2
  repeats: int | None = None       # timed repeats per category (None: one per prompt)


def heldout_messages(path: str, per_category: int,
                     categories: Sequence[str] = ()) -> dict[str, list]:
  """{category: [chat messages, ...]}: the first ``per_category`` prompts of
  each category of a chat JSONL (``mtp.data.chat.read_prompt_jsonl``) as
  chat messages (``mtp.data.chat.prompt_messages``: system, then user).
  Raises ValueError for a category the file lacks or ``per_category`` < 1."""
  if per_category < 1:
    raise ValueError(f"per_category must be >= 1, got {per_category}")
  prompts = chat_lib.read_prompt_jsonl(path)
  by_cat: dict[str, list] = {}
  for p in prompts:
    by_cat.setdefault(p.get("category", "uncategorised"), []).append(p)
  missing = [c for c in categories if c not in by_cat]
  if missing:
    raise ValueError(f"categories {missing} not in {path} (it has {sorted(by_cat)})")
  chosen = list(categories) or sorted(by_cat)
  return {c: [chat_lib.prompt_messages(p) for p in by_cat[c][:per_category]] for c in chosen}


def heldout_prompts(path: str, tokenizer, per_category: int,
                    categories: Sequence[str] = ()) -> dict[str, list]:
  """{category: [int32 ids [T], ...]}: ``heldout_messages`` rendered with
  ``tokenizer``'s chat template (generation prompt appended). Raises
  ValueError for a category the file lacks or ``per_category`` < 1."""
  return {c: [tokenizer.apply_chat_template(m) for m in ms]
          for c, ms in heldout_messages(path, per_category, categories).items()}


def decoders(model, tokenizer, gs: Sequence[int], with_auto: bool = False,
             trees: Sequence[str] = (), workdir: str | None = None,
             cfg=None) -> dict[str, Decoder]:
  """{label: Decoder}: AR, MTP with each G, "auto" (``with_auto``) and each
  token tree (labels ``mtp_tree3``, ``mtp_tree2-2``; while_loop form), stop
  ids from the tokenizer. "auto" is built as ``python -m decode`` builds it
  from ``workdir`` (``decode.cli.run.load_decoder``: G_max = the offsets the
  modules were trained for, the stage's validation acceptance as prior;
  ``cfg`` the checkpoint's full Config); without ``workdir`` the schedule's
  defaults."""
  out = {"ar": Decoder(model, "ar", tokenizer=tokenizer)}
  for g in gs:
    out[f"mtp_G{g}"] = Decoder(model, "mtp", g, tokenizer=tokenizer)
  if with_auto:
    from decode.cli.run import auto_kwargs
    kw = auto_kwargs(workdir, cfg, model) if workdir is not None else {}
    out["mtp_auto"] = Decoder(model, "mtp", "auto", tokenizer=tokenizer, **kw)
  for t in trees:
    out["mtp_tree" + t.replace(",", "-")] = Decoder(model, "mtp", tree=t, tokenizer=tokenizer)
  return out


def run_chat_bench(s: ChatBench, log: Callable[[str], None] = print) -> dict:
  """Every (category, decoder, temperature) row of ``s`` (module docstring).

  Returns {"rows": [...] ("auto" rows carry the decoder's ``auto_record``
  after the cell: its prior and round costs), "overall": ``overall(rows)``, "baselines": None
  or ``baseline_decoders.build``'s info plus "prompt_ids" (``check_prompt_ids``
  when a transformers baseline runs)}. Raises ValueError for baselines
  without ``baseline_model``."""
  cfg, model, step = loading.load_model(s.workdir)
  tokenizer = tok_lib.load_tokenizer(s.workdir)
  messages = heldout_messages(s.prompt_file, s.per_category, s.categories)
  prompts = {c: [tokenizer.apply_chat_template(m) for m in ms] for c, ms in messages.items()}
  decs = decoders(model, tokenizer, s.num_draft_tokens, s.with_auto, s.trees, s.workdir, cfg)
  base_fns, info = {}, None
  if s.baselines:
    if not s.baseline_model:
      raise ValueError("baselines need baseline_model (the GGUF file or HF directory)")
    base_fns, info = baseline_decoders.build(s.baselines, s.baseline_model, cfg.model, tokenizer,
                                           s.llamacpp_threads, log)
    if any(spec.kind != "llamacpp" for spec in s.baselines):
      info["prompt_ids"] = baseline_decoders.check_prompt_ids(s.baseline_model, messages, prompts)
      log(f"transformers' chat template: {info['prompt_ids']['identical']} of "
          f"{info['prompt_ids']['prompts']} prompts give our ids")
  draft_cache, rows = {}, []
  # no XLA FLOP-count probe (draft_cost_ratio_c_flops): one more compile of a
  # 30-layer program per decoder, for a figure the byte models' benchmarks give
  flops_cache = {(label, 1): None for label in decs}
  flops_cache.update({(label, b): None for label in decs for b in s.batch_sizes})
  for b in s.batch_sizes:
    for t in s.temperatures:
      sp = SamplingParams(temperature=t)
      extra = base_fns if t == 0 and b == 1 else {}   # the baselines: greedy, B = 1
      for cat, ps in prompts.items():
        log(f"B={b} T={t:g} {cat}: {len(ps)} prompt(s) x {len(decs) + len(extra)} decoders")
        for row in bench_lib.measure_point(decs, ps, b, s.max_new_tokens, sp, s.repeats or len(ps),
                                       draft_cache=draft_cache, flops_cache=flops_cache,
                                       baselines=extra):
          row["category"] = cat
          if decs.get(row["label"]) is not None and decs[row["label"]].schedule is not None:
            row["auto"] = decs[row["label"]].auto_record()     # prior and round costs now
          rows.append(row)
  return {"rows": rows, "overall": overall(rows), "baselines": info}


def overall(rows: list[dict]) -> list[dict]:
  """Per (label, temperature, batch size): the geometric mean of the
  per-category speedups (end to end and decoding phase) and the mean tau and
  alpha_k, each category weighted equally."""
  import numpy as np
  out = []
  keys = sorted({(r["label"], r["temperature"], r.get("batch_size", 1)) for r in rows},
                key=lambda k: (k[2], k[1], k[0]))
  for label, t, b in keys:
    rs = [r for r in rows if r["label"] == label and r["temperature"] == t
          and r.get("batch_size", 1) == b]
    alphas = [r["acceptance_rate_per_position"] for r in rs]
    k = min(len(a) for a in alphas)
    geomean = lambda xs: None if None in xs else float(np.exp(np.mean(np.log(xs))))
    taus = [r["tau"] for r in rs]
    out.append({"label": label, "temperature": t, "batch_size": b, "categories": len(rs),
                "speedup_geomean": geomean([r["speedup"] for r in rs]),
                "speedup_decode_geomean": geomean([r["speedup_decode"] for r in rs]),
                "tokens_per_s_geomean": geomean([r["tokens_per_s"] for r in rs]),
                "tau_mean": None if None in taus else float(np.mean(taus)),
                "alpha_mean": [float(np.mean([a[i] for a in alphas if a[i] is not None] or [np.nan]))
                               for i in range(k)]})
  return out


def _tokens_per_s(r: dict) -> dict:
  """A row's tokens/s as a spread (median from the median wall, min from the
  slowest call, max from the fastest)."""
  scale = r["tokens_per_s"] * r["wall_s_median"]
  return {"median": r["tokens_per_s"], "min": scale / r["wall_s_max"],
          "max": scale / r["wall_s_min"]}


def side_by_side(rows: list[dict]) -> str:
  """Markdown: per category (and all, geomean), every decoder's tokens/s
  median [min, max] over the repeats and its speedup over our AR, at T = 0
  (where the baselines run); "" without baseline rows."""
  from mtp.report import fmt
  from mtp.timing import format_spread
  t0 = [r for r in rows if r["temperature"] == 0 and r.get("batch_size", 1) == 1]
  if not any(r["method"] == "baseline" for r in t0):
    return ""
  labels = sorted({r["label"] for r in t0 if r["method"] != "baseline"}, key=lambda x: (x != "ar", x))
  labels += [r["label"] for r in t0 if r["method"] == "baseline" and r["category"] == t0[0]["category"]]
  cats = list(dict.fromkeys(r["category"] for r in t0))
  by = {(r["category"], r["label"]): r for r in t0}
  lines = ["## Side by side with other decoders (T = 0, B = 1)", "",
           "tokens/s median [min, max] over the repeats (new tokens / wall time, prefill "
           "included); in brackets: our AR's median wall / its median wall.", "",
           "| category | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
  for c in cats:
    cells = []
    for label in labels:
      r = by.get((c, label))
      cells.append("-" if r is None else f"{format_spread(_tokens_per_s(r), '.1f')} "
                   f"({fmt(r['speedup'])}x)")
    lines.append(f"| {c} | " + " | ".join(cells) + " |")
  ov = {o["label"]: o for o in overall(t0)}
  lines.append("| all (geomean) | " + " | ".join(
      f"{fmt(ov[label]['tokens_per_s_geomean'], '.1f')} ({fmt(ov[label]['speedup_geomean'])}x)"
      for label in labels) + " |")
  lines += ["", "Tokens against our AR greedy output (per category: new tokens of each "
            "repeat; agreement = common prefix, the shortest over the repeats):", "",
            "| category | decoder | new tokens | AR tokens | identical | agreement |",
            "|---|---|---|---|---|---|"]
  for r in t0:
    if r["method"] == "baseline":
      lines.append(f"| {r['category']} | {r['label']} | {'/'.join(map(str, r['new_tokens']))} | "
                   f"{'/'.join(map(str, r['ar_tokens']))} | {r['identical_to_ar']} | "
                   f"{r['agreement_tokens']} |")
  return "\n".join(lines) + "\n\n"


def markdown(rows: list[dict], meta: dict) -> str:
  """Tables: the baselines side by side (``side_by_side``, when any ran),
  the overall summary, then every (temperature, category, decoder) row."""
  from mtp.report import fmt
  x = lambda v: "-" if v is None else f"{fmt(v)}x"
  lines = [side_by_side(rows) + "## Overall (categories weighted equally)", "",
           "| B | T | decoder | speedup (geomean) | decoding phase | tau | alpha_k |",
           "|---|---|---|---|---|---|---|"]
  for o in overall(rows):
    lines.append(f"| {o['batch_size']} | {o['temperature']:g} | {o['label']} | "
                 f"{fmt(o['speedup_geomean'])}x | "
                 f"{x(o['speedup_decode_geomean'])} | {fmt(o['tau_mean'])} | "
                 + " / ".join(fmt(a) for a in o["alpha_mean"]) + " |")
  lines += ["", "## Per category (while_loop form, medians over the category's prompts)", "",
            "| B | T | category | decoder | tokens/s | speedup | decoding phase | tau | alpha_k | c | ideal | efficiency |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in sorted(rows, key=lambda r: (r.get("batch_size", 1), r["temperature"], r["category"],
                                       r["label"])):
    alpha = " / ".join(fmt(a) for a in r["acceptance_rate_per_position"])
    lines.append(f"| {r.get('batch_size', 1)} | {r['temperature']:g} | {r['category']} | "
                 f"{r['label']} | {fmt(r['tokens_per_s'], '.1f')} | "
                 f"{fmt(r['speedup'])}x | {x(r['speedup_decode'])} | {fmt(r['tau'])} | {alpha} | "
                 f"{fmt(r.get('draft_cost_ratio_c'))} | {fmt(r.get('ideal_speedup'))} | "
                 f"{fmt(r.get('efficiency'))} |")
  return "\n".join(lines) + "\n"


# -- command line --------------------------------------------------------------------------

def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--workdir", required=True, help="target with MTP modules (D >= 1)")
  ap.add_argument("--prompt_file", default=chat_lib.HELDOUT_CHAT_PATH,
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
  cli.check_output_path("out", args.out, "prefix")
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
  s = ChatBench(
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
  result = run_chat_bench(s, log=lambda m: print(m, flush=True))
  meta = report.provenance(command=report.command_line(__file__, argv), workdir=args.workdir,
                           settings=vars(args), load_average_before=load_before,
                           load_average=os.getloadavg())
  report.write_report(args.out, meta, result, markdown(result["rows"], meta))
  print(f"wrote {args.out}.json and {args.out}.md")
  return 0


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError, ValueError))
