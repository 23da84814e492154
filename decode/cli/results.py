"""The report of ``python -m decode`` (``decode.cli.run.run``): the note about
draft offsets the MTP modules were never trained for, the result rows, the
per-row text printed for a batch, and the report's ``config`` record.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

import jax

from decode.cli import stats as stats_lib
from decode.sampling import SamplingParams
from decode.decoder import Decoder
from decode.stops import StopConditions


def untrained_offsets_note(decoder: Decoder, method: str, trained: int) -> str | None:
  """The notice line (ending in a newline) when a chain's draft length G
  exceeds the ``trained`` offsets of the checkpoint's MTP modules (D plus
  ``mtp.recursive_steps``): drafts past them reuse module D, never trained
  for that offset. None otherwise (other methods, trees, G <= trained)."""
  if not (method == "mtp" and decoder.tree is None and decoder.longest_draft > trained):
    return None
  depth = decoder.models()[0].mtp_depth
  first = trained + 1
  extra = (f"drafts {first}..{decoder.longest_draft} reuse" if decoder.longest_draft > first else
           f"draft {decoder.longest_draft} reuses")
  flag = ("--max_draft_tokens" if decoder.num_draft_tokens == "auto" else "--num_draft_tokens")
  trained_for = (f"the checkpoint's MTP depth D={depth}" if trained == depth else
                 f"the {trained} offsets the checkpoint's modules were trained for (D={depth}, "
                 f"mtp.recursive_steps={trained - depth})")
  return (f"note: {flag}={decoder.longest_draft} > {trained_for}: "
          f"{extra} module {depth}, which was never trained for that offset (acceptance "
          "decays there)\n")


def length_notice(finish_reasons: Sequence[str] | None, max_new_tokens: int) -> str | None:
  """The notice line (with newline) when rows ended at their token budget
  (finish reason "length"): for one row "the answer stopped at ...", for a
  batch how many; None when none did. Not a "note:" line (those are about
  settings, and tests and scripts count them)."""
  reasons = list(finish_reasons or [])
  cut = sum(r == "length" for r in reasons)
  if not cut:
    return None
  if len(reasons) == 1:
    return (f"the answer stopped at --max_new_tokens={max_new_tokens} (finish reason "
            "\"length\"): raise it for a longer answer\n")
  return (f"{cut} of {len(reasons)} rows stopped at --max_new_tokens={max_new_tokens} (finish "
          "reason \"length\"): raise it for longer answers\n")


def result_rows(gen, prompts: Sequence[str], categories: Sequence[str | None] | None,
                num_samples: int) -> list[dict]:
  """One report row per generated row r (prompt r // num_samples, sample
  r % num_samples): prompt_index, prompt, category (with ``categories``),
  sample, tokens (ints), text (UTF-8, errors replaced), finish_reason and
  the row's own stats (``decode.cli.stats.summarize``)."""
  results = []
  for r, ids in enumerate(gen.tokens):
    results.append({"prompt_index": r // num_samples, "prompt": prompts[r // num_samples],
                    **({"category": categories[r // num_samples]} if categories else {}),
                    "sample": r % num_samples, "tokens": [int(t) for t in ids],
                    "text": gen.texts[r].decode("utf-8", errors="replace"),
                    "finish_reason": gen.finish_reasons[r], "stats": stats_lib.summarize(gen, [r])})
  return results


def write_rows(out: TextIO, results: Sequence[dict], chat: bool) -> None:
  """Per result a line ``--- prompt I sample S: 'PROMPT'``, then the prompt
  (raw prompts only) and the generated text."""
  for res in results:
    out.write(f"--- prompt {res['prompt_index']} sample {res['sample']}: "
              f"{res['prompt']!r}\n{'' if chat else res['prompt']}{res['text']}\n")
  out.flush()


def config_record(workdir: str, method: str, decoder: Decoder, *, batch_size: int,
                  max_new_tokens: int, sampling: SamplingParams, num_samples: int, seed: int,
                  chat: bool, stops: StopConditions | None,
                  checkpoint_step: int | None = None) -> dict:
  """The report's ``config``: workdir, checkpoint_step (None for an export),
  method, num_draft_tokens (G_max with "auto"), tree, max_new_tokens,
  temperature, top_k, top_p, num_samples, seed, batch_size, chat, stop,
  stop_token_ids, the device kind, ``numerics_record``'s keys, and with
  "auto" ``auto`` (``Decoder.auto_record``: prior and round costs)."""
  return {"workdir": workdir, "checkpoint_step": checkpoint_step, "method": method,
          "num_draft_tokens": decoder.num_draft_tokens,
          **({"max_draft_tokens": decoder.longest_draft} if decoder.num_draft_tokens == "auto"
             else {}),
          "tree": None if decoder.tree is None else list(decoder.tree.branching),
          "max_new_tokens": max_new_tokens, "temperature": sampling.temperature,
          "top_k": sampling.top_k, "top_p": sampling.top_p,
          "num_samples": num_samples, "seed": seed, "batch_size": batch_size,
          "chat": chat, "stop": [] if stops is None else list(stops.strings),
          "stop_token_ids": [] if stops is None else [int(i) for i in stops.token_ids],
          "device": jax.devices()[0].device_kind, **numerics_record(decoder),
          **({"auto": decoder.auto_record()} if decoder.schedule is not None else {})}


def numerics_record(decoder: Decoder) -> dict:
  """The arithmetic the target decodes in: ``dtype`` (after ``--dtype``),
  ``param_dtype``, ``matmul_precision``, ``attention_impl`` (configured) and
  ``attention_impl_resolved`` (``mtp.model.resolve_attention_impl``)."""
  from mtp import model as model_lib
  cfg = decoder.target_cfg
  return {"dtype": cfg.dtype, "param_dtype": cfg.param_dtype,
          "matmul_precision": cfg.matmul_precision, "attention_impl": cfg.attention_impl,
          "attention_impl_resolved": model_lib.resolve_attention_impl(
              cfg.attention_impl, model_lib.attention_backend(), cfg.dtype, cfg.head_dim)}


def numerics_line(decoder: Decoder) -> str:
  """``dtype D, attention A`` (``A (R)`` when "auto" resolves to R) for the
  statistics block."""
  r = numerics_record(decoder)
  impl = r["attention_impl"]
  if impl != r["attention_impl_resolved"]:
    impl += f" ({r['attention_impl_resolved']})"
  return f"dtype {r['dtype']}, attention {impl}"
