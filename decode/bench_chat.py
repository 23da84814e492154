"""Held-out chat benchmark of a target with MTP modules (issue 22 item 5):
AR and MTP speculative decoding side by side on chat prompts, per category.

The prompts are the held-out set ``mtp/data/heldout_chat.jsonl`` (written
by hand, no overlap with any training prompt: ``mtp.data.chat.overlaps``),
rendered with the target tokenizer's chat template. Per category the first
``per_category`` prompts are decoded at B = 1 by every decoder
(``decode.bench.measure_point``: repeat r decodes prompt r with seed r in
every cell, interleaved, after an untimed compile of every prompt-length
bucket), so every speedup is a ratio of medians over the same prompts in
one process. A row is one (category or "all", decoder, temperature):
``summarize_cell``'s fields (speedup over AR, tau, alpha_k, the cost ratio
c, the ideal speedup of Leviathan et al. 2023 Theorem 3.8 and the
efficiency) plus ``category``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from decode import bench
from decode.sampling import SamplingParams
from decode.speculative import Decoder
from mtp import loading
from mtp import tokenizer as tok_lib
from mtp.data import chat as chat_lib


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


def heldout_prompts(path: str, tokenizer, per_category: int,
                    categories: Sequence[str] = ()) -> dict[str, list]:
  """{category: [int32 ids [T], ...]}: the first ``per_category`` prompts of
  each category of a chat JSONL (``mtp.data.chat.read_prompt_jsonl``),
  rendered with ``tokenizer``'s chat template (generation prompt appended).
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
  return {c: [tokenizer.apply_chat_template(chat_lib.prompt_messages(p))
              for p in by_cat[c][:per_category]] for c in chosen}


def decoders(model, tokenizer, gs: Sequence[int], with_auto: bool = False) -> dict[str, Decoder]:
  """{label: Decoder}: AR and MTP with each G (while_loop form), stop ids
  from the tokenizer."""
  out = {"ar": Decoder(model, "ar", tokenizer=tokenizer)}
  for g in gs:
    out[f"mtp_G{g}"] = Decoder(model, "mtp", g, tokenizer=tokenizer)
  if with_auto:
    out["mtp_auto"] = Decoder(model, "mtp", "auto", tokenizer=tokenizer)
  return out


def run_chat_bench(s: ChatBench, log: Callable[[str], None] = print) -> list[dict]:
  """Every (category, decoder, temperature) row of ``s`` (module docstring);
  ``overall`` summarises them across categories."""
  cfg, model, step = loading.load_model(s.workdir)
  tokenizer = tok_lib.load_tokenizer(s.workdir)
  prompts = heldout_prompts(s.prompt_file, tokenizer, s.per_category, s.categories)
  decs = decoders(model, tokenizer, s.num_draft_tokens, s.with_auto)
  draft_cache, rows = {}, []
  # no XLA FLOP-count probe (draft_cost_ratio_c_flops): one more compile of a
  # 30-layer program per decoder, for a figure the byte models' benchmarks give
  flops_cache = {(label, 1): None for label in decs}
  for t in s.temperatures:
    sp = SamplingParams(temperature=t)
    for cat, ps in prompts.items():
      log(f"T={t:g} {cat}: {len(ps)} prompt(s) x {len(decs)} decoders")
      for row in bench.measure_point(decs, ps, 1, s.max_new_tokens, sp, len(ps),
                                     draft_cache=draft_cache, flops_cache=flops_cache):
        row["category"] = cat
        rows.append(row)
  return rows


def overall(rows: list[dict]) -> list[dict]:
  """Per (label, temperature): the geometric mean of the per-category
  speedups (end to end and decoding phase) and the mean tau and alpha_k,
  each category weighted equally."""
  import numpy as np
  out = []
  keys = sorted({(r["label"], r["temperature"]) for r in rows}, key=lambda k: (k[1], k[0]))
  for label, t in keys:
    rs = [r for r in rows if r["label"] == label and r["temperature"] == t]
    alphas = [r["acceptance_rate_per_position"] for r in rs]
    k = min(len(a) for a in alphas)
    out.append({"label": label, "temperature": t, "categories": len(rs),
                "speedup_geomean": float(np.exp(np.mean(np.log([r["speedup"] for r in rs])))),
                "speedup_decode_geomean": float(np.exp(np.mean(np.log(
                    [r["speedup_decode"] for r in rs])))),
                "tau_mean": float(np.mean([r["tau"] for r in rs])),
                "alpha_mean": [float(np.mean([a[i] for a in alphas if a[i] is not None] or [np.nan]))
                               for i in range(k)]})
  return out


def markdown(rows: list[dict], meta: dict) -> str:
  """Tables: the overall summary, then every (temperature, category, decoder) row."""
  from mtp.report import fmt
  lines = ["## Overall (categories weighted equally)", "",
           "| T | decoder | speedup (geomean) | decoding phase | tau | alpha_k |",
           "|---|---|---|---|---|---|"]
  for o in overall(rows):
    lines.append(f"| {o['temperature']:g} | {o['label']} | {fmt(o['speedup_geomean'])}x | "
                 f"{fmt(o['speedup_decode_geomean'])}x | {fmt(o['tau_mean'])} | "
                 + " / ".join(fmt(a) for a in o["alpha_mean"]) + " |")
  lines += ["", "## Per category (B = 1, while_loop form, medians over the category's prompts)", "",
            "| T | category | decoder | tokens/s | speedup | decoding phase | tau | alpha_k | c | ideal | efficiency |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in sorted(rows, key=lambda r: (r["temperature"], r["category"], r["label"])):
    alpha = " / ".join(fmt(a) for a in r["acceptance_rate_per_position"])
    lines.append(f"| {r['temperature']:g} | {r['category']} | {r['label']} | {fmt(r['tokens_per_s'], '.1f')} | "
                 f"{fmt(r['speedup'])}x | {fmt(r['speedup_decode'])}x | {fmt(r['tau'])} | {alpha} | "
                 f"{fmt(r.get('draft_cost_ratio_c'))} | {fmt(r.get('ideal_speedup'))} | "
                 f"{fmt(r.get('efficiency'))} |")
  return "\n".join(lines) + "\n"
