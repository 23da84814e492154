"""Held-out chat benchmark of a target with MTP modules (issue 22 item 5):
AR and MTP speculative decoding side by side on chat prompts, per category.

The prompts are the held-out set ``mtp/data/heldout_chat.jsonl`` (written
by hand, no overlap with any training prompt: ``mtp.data.chat.overlaps``),
rendered with the target tokenizer's chat template. Per category the first
``per_category`` prompts are decoded at each batch size B (1 by default;
at B > 1 a batch cycles through the category's prompts) by every decoder
(``decode.bench.measure_point``: repeat r decodes the same rows with seed r
in every cell, interleaved, after an untimed compile of every prompt-length
bucket), so every speedup is a ratio of tokens/s over the same prompts in
one process. Decoders: AR, MTP chains of each G, optionally "auto" and
token trees (``trees``: branching strings such as "3" or "2,2"). A row is
one (category, decoder, temperature, B):
``summarize_cell``'s fields (speedup over AR, tau, alpha_k, the cost ratio
c, the ideal speedup of Leviathan et al. 2023 Theorem 3.8 and the
efficiency) plus ``category``.

Baselines (``ChatBench.baselines``, ``decode.bench_baselines``):
transformers' greedy ``generate``, its prompt lookup decoding and llama.cpp
on the weights the target was imported from (``baseline_model``), in the
same interleaved rounds as AR and MTP at T = 0 (they are greedy only), on
the same prompt ids (transformers' chat template is checked to give the
same ids: ``check_prompt_ids``). Their rows carry tokens/s, the speedup
over our AR and the agreement of their tokens with AR's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from decode.sampling import SamplingParams
from decode.speculative import Decoder
from mtp import loading
from mtp import tokenizer as tok_lib
from mtp.data import chat as chat_lib
from scripts import baseline_decoders
from scripts import bench_lib


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
  from ``workdir`` (``decode.run.load_decoder``: G_max = the offsets the
  modules were trained for, the stage's validation acceptance as prior;
  ``cfg`` the checkpoint's full Config); without ``workdir`` the schedule's
  defaults."""
  out = {"ar": Decoder(model, "ar", tokenizer=tokenizer)}
  for g in gs:
    out[f"mtp_G{g}"] = Decoder(model, "mtp", g, tokenizer=tokenizer)
  if with_auto:
    from decode.run import auto_kwargs
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
