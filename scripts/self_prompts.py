"""Self-written chat prompts: the target writes user turns from its own chat
template's user-turn prefix (Magpie, Xu et al. 2024); ``mtp.data.self_prompts``
samples, filters (unfinished, empty, too short / long, non-printable,
repetitive, duplicate, overlapping the held-out set) and writes them.

    .venv/bin/python -m scripts.self_prompts --workdir runs/smollm \\
        --num_prompts 2048 --temperature 1 --top_p 0.95 --max_len 128 --seed 0 \\
        --out results/self_prompts_smollm2.jsonl

--out is a JSONL prompt file (``{"category": "self_written", "prompt": ...}``
per line, ``mtp.data.chat.read_prompt_jsonl``'s format); OUT.meta.json next
to it records the workdir, step, settings and the rejection counts.
``mtp.data.self_prompts.read_self_prompts`` reads the file as chat prompts
and ``mix_prompt_sources`` mixes them with the templated ones by weight.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mtp import cli

if TYPE_CHECKING:                      # annotations only
  from mtp.data import self_prompts as sp_lib

# decode, mtp.data, mtp.loading and the rest load jax: imported inside the
# functions, so a bad flag is refused before jax loads (issue 51)


# -- sampling: the target writes user turns ---------------------------------------------------

def sample_user_turns(decoder, prefix: np.ndarray, settings: sp_lib.SampleSettings, round_index: int
                      ) -> list[str | None]:
  """One decoder call: ``settings.batch_size`` continuations of ``prefix``
  (``Decoder.sample``, seed a function of (settings.seed, round_index)), each
  cut at its end-of-turn id and decoded to text; None for a row that ended
  without one (``unfinished``)."""
  from decode.sampling import SamplingParams
  sp = SamplingParams(settings.temperature, settings.top_k, settings.top_p)
  gen = decoder.sample(prefix, settings.batch_size, settings.max_len, sp,
                       seed=settings.seed * 1_000_003 + round_index)
  out = []
  for j in range(settings.batch_size):
    ids = np.asarray(gen.tokens[j], np.int64)
    if not ids.size or int(ids[-1]) not in decoder.eos_ids:
      out.append(None)
      continue
    out.append(decoder.tokenizer.decode([int(i) for i in ids[:-1]]))
  return out


def generate_self_prompts(decoder, num_prompts: int, settings: sp_lib.SampleSettings | None = None,
                          filters: sp_lib.FilterSettings | None = None, *,
                          heldout: Sequence[str] | None = None, log=None
                          ) -> tuple[list[dict], dict[str, Any]]:
  """Samples and filters user turns until ``num_prompts`` are kept or
  ``settings.max_rounds`` decoder calls are spent.

  Args:
    decoder: a ``decode.decoder.Decoder`` over the target with its
      tokenizer (its stop ids end a turn; method "ar" or "mtp", both sample
      the target's law exactly).
    num_prompts: >= 1 prompts wanted.
    settings, filters: sampling and filter settings (validated; None: the defaults).
    heldout: as ``mtp.data.self_prompts.filter_prompts`` (None = the package's held-out set).
  Returns:
    (prompts, stats): prompts ``[{"category": "self_written", "prompt":
    str}]`` (at most ``num_prompts``, in sampling order); stats ``sampled``,
    ``kept``, ``rounds`` and ``rejected`` {reason: count} over ``mtp.data.self_prompts.REASONS``.
    The result depends only on the target, the tokenizer and the settings.
  Raises:
    DataError: bad settings, a tokenizer without a chat template.
  """
  from mtp.data import chat as chat_lib
  from mtp.data import self_prompts as sp_lib
  from mtp.data.corpora import DataError
  settings = settings if settings is not None else sp_lib.SampleSettings()
  filters = filters if filters is not None else sp_lib.FilterSettings()
  if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
    raise DataError(f"num_prompts={num_prompts!r} must be an integer >= 1")
  settings.validate()
  filters.validate()
  if heldout is None:
    heldout = [chat_lib.prompt_text(p) for p in chat_lib.heldout_chat_prompts()]
  prefix = sp_lib.user_turn_prefix(decoder.tokenizer)
  rejected = Counter({r: 0 for r in sp_lib.REASONS})
  seen: set[str] = set()
  kept: list[str] = []
  sampled = rounds = 0
  while len(kept) < num_prompts and rounds < settings.max_rounds:
    turns = sample_user_turns(decoder, prefix, settings, rounds)
    rounds += 1
    sampled += len(turns)
    rejected["unfinished"] += sum(t is None for t in turns)
    new, reasons = sp_lib.filter_prompts([t for t in turns if t is not None], filters,
                                  heldout=heldout, seen=seen)
    rejected.update(r for r in reasons if r is not None)
    kept += new
    if log is not None:
      log(f"round {rounds}: {len(kept)}/{num_prompts} kept of {sampled} sampled")
  kept = kept[:num_prompts]
  stats = {"sampled": sampled, "kept": len(kept), "rounds": rounds,
           "rejected": {r: int(rejected[r]) for r in sp_lib.REASONS}}
  return [{"category": sp_lib.CATEGORY, "prompt": t} for t in kept], stats


# -- the CLI's job -------------------------------------------------------------------------------

def make_self_prompts(workdir: str, out: str, num_prompts: int, settings: sp_lib.SampleSettings,
                      filters: sp_lib.FilterSettings | None = None, *,
                      method: str = "ar", log=None) -> dict:
  """Samples ``num_prompts`` self-written prompts from the model in
  ``workdir`` and writes them to ``out`` (JSONL) and ``out.meta.json``.
  Returns the metadata. Raises DataError (settings, no chat template, a
  prompt prefix plus ``max_len`` past the model's ``max_seq_len``),
  CheckpointError, DecodeError."""
  from decode.decoder import Decoder
  from mtp import loading, report
  from mtp import tokenizer as tok
  from mtp.data import self_prompts as sp_lib
  from mtp.data.corpora import DataError
  filters = filters if filters is not None else sp_lib.FilterSettings()
  settings.validate()
  filters.validate()
  if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
    raise DataError(f"--num_prompts={num_prompts!r} must be an integer >= 1")
  if method not in ("ar", "mtp"):
    raise DataError(f"--method={method!r} must be 'ar' or 'mtp' (the model samples itself)")
  loading.load_config(workdir)          # a missing or empty workdir: CheckpointError, first
  tokenizer = tok.load_tokenizer(workdir)
  prefix = sp_lib.user_turn_prefix(tokenizer)
  cfg, model, step = loading.load_model(workdir)
  if len(prefix) + settings.max_len > cfg.model.max_seq_len:
    raise DataError(f"--max_len={settings.max_len} plus the {len(prefix)}-token user-turn prefix "
                    f"exceeds the model's max_seq_len={cfg.model.max_seq_len}")
  if method == "mtp" and cfg.mtp.depth < 1:
    raise DataError(f"--method=mtp needs a model with MTP modules; {workdir!r} has mtp.depth=0")
  decoder = Decoder(model, method, max(cfg.mtp.depth, 1), tokenizer=tokenizer)
  t0 = time.perf_counter()
  prompts, stats = generate_self_prompts(decoder, num_prompts, settings, filters, log=log)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  sp_lib.write_prompt_jsonl(out, prompts)
  meta = {"generator": "scripts.self_prompts", "workdir": os.path.abspath(workdir),
          "step": int(step), "method": method, "num_prompts": num_prompts,
          "prefix_tokens": [int(i) for i in prefix], "sampling": dataclasses.asdict(settings),
          "filters": dataclasses.asdict(filters), **stats,
          "wall_s": time.perf_counter() - t0, **report.provenance()}
  cli.write_atomic(f"{out}.meta.json", json.dumps(meta, indent=2))
  return meta


_INT_FLAGS = (("num_prompts", 1), ("max_len", 1), ("batch_size", 1), ("seed", 0),
              ("max_rounds", 1), ("top_k", 0), ("min_chars", 1), ("max_chars", 1), ("min_words", 1))


def flag_problem(args) -> str | None:
  """The first flag given out of its range ("--top_p=0.0 must be in (0, 1]"),
  or None: checked before jax loads (``SampleSettings.validate`` /
  ``FilterSettings.validate`` check the whole settings again after)."""
  for name, lo in _INT_FLAGS:
    v = getattr(args, name)
    if v is not None and v < lo:
      return f"--{name}={v!r} must be an integer >= {lo}"
  if args.temperature is not None and not args.temperature >= 0:
    return f"--temperature={args.temperature!r} must be >= 0"
  if args.top_p is not None and not 0 < args.top_p <= 1:
    return f"--top_p={args.top_p!r} must be in (0, 1]"
  return None


def main(argv=None) -> int:
  ap = cli.OneLineParser(prog="python -m scripts.self_prompts", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", required=True, help="the target's workdir (a chat-template tokenizer)")
  ap.add_argument("--out", required=True, help="JSONL prompt file to write")
  ap.add_argument("--num_prompts", type=int, default=512, help="prompts to keep")
  # defaults None: mtp.data.self_prompts' SampleSettings / FilterSettings (loaded after the check)
  ap.add_argument("--temperature", type=float, default=None, help="sampling temperature")
  ap.add_argument("--top_p", type=float, default=None, help="top-p (1 = off)")
  ap.add_argument("--top_k", type=int, default=None, help="top-k (0 = off)")
  ap.add_argument("--max_len", type=int, default=None,
                  help="longest user turn in tokens (one without an end-of-turn by then is dropped)")
  ap.add_argument("--batch_size", type=int, default=None, help="rows sampled together")
  ap.add_argument("--max_rounds", type=int, default=None,
                  help="decoder calls at most (stops early once --num_prompts are kept)")
  ap.add_argument("--seed", type=int, default=None, help="sampling seed")
  ap.add_argument("--method", default="ar", choices=("ar", "mtp"),
                  help="decoder (both sample the target exactly)")
  ap.add_argument("--min_chars", type=int, default=None, help="shortest kept prompt (chars)")
  ap.add_argument("--max_chars", type=int, default=None, help="longest kept prompt (chars)")
  ap.add_argument("--min_words", type=int, default=None, help="fewest words of a kept prompt")
  args = ap.parse_args(argv)
  problem = flag_problem(args)
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    return 2
  cli.check_output_path("out", args.out)
  log = lambda s: print(s, file=sys.stderr, flush=True)
  from decode.errors import DecodeError
  from mtp import checkpoint as ckpt_lib
  from mtp import tokenizer as tok
  from mtp.data import self_prompts as sp_lib
  from mtp.data.corpora import DataError
  given = lambda cls: {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                       if getattr(args, f.name, None) is not None}
  try:
    settings = sp_lib.SampleSettings(**given(sp_lib.SampleSettings))
    filters = sp_lib.FilterSettings(**given(sp_lib.FilterSettings))
    meta = make_self_prompts(args.workdir, args.out, args.num_prompts, settings, filters,
                             method=args.method, log=log)
  except (DataError, DecodeError, ckpt_lib.CheckpointError, tok.TokenizerError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  rej = ", ".join(f"{k} {v}" for k, v in meta["rejected"].items() if v)
  print(f"wrote {meta['kept']} of {meta['sampled']} sampled prompts to {args.out} "
        f"({meta['rounds']} rounds, {meta['wall_s']:.0f} s; rejected: {rej or 'none'})")
  if meta["kept"] < args.num_prompts:
    print(f"warning: {meta['kept']} of --num_prompts={args.num_prompts} kept after "
          f"--max_rounds={args.max_rounds}; raise --max_rounds or loosen the sampling",
          file=sys.stderr)
  return 0 if meta["kept"] else 1


if __name__ == "__main__":
  cli.main_guard(main)
