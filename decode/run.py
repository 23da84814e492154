"""Library side of ``python -m decode``: load checkpoints, encode prompts,
decode (streaming when there is one prompt), compare with AR, report.

``run(...)`` writes the generated text to ``out`` (stdout) and statistics,
comparisons and notices to ``err`` (stderr), and returns the report dict that
``--json`` writes: ``{"config": {...}, "results": [{"prompt_index",
"prompt", "sample", "tokens", "text", "finish_reason", "stats"}, ...],
"stats": {...},
"ar_stats": {...}, "speedup": float, "speedup_per_repeat": [...],
"wall_times_s": {"ar": [...], METHOD: [...]}}`` (the last four with
``compare``). With prompts that carry a ``category`` (a JSONL
``--prompt_file``) every result records its ``"category"`` and the report
has ``"per_category": {CATEGORY: {"rows", "num_tokens", "target_calls",
"mean_accepted_length", "acceptance_rate_per_position",
"accepted_length_histogram", "speedup" (with compare)}}``.
"""

from __future__ import annotations

import codecs
import io
import sys
import types
from collections.abc import Mapping, Sequence
from typing import TextIO

import jax
import numpy as np

from decode import calibrate, stats as stats_lib
from decode.schedule import AutoSchedule
from decode.speculative import DecodeError, Decoder, SamplingParams
from decode.stops import StopConditions
from mtp import loading
from mtp import tokenizer as tok
from mtp.timing import interleaved_times


def read_prompt_file(path: str) -> list[str]:
  """One prompt per line, every line taken literally (no escapes; a prompt
  cannot contain a newline: use ``--prompt $'...'`` for one multi-line
  prompt), so prompt i is line i+1. Line ends are ``\\n``, ``\\r\\n`` or
  ``\\r``; a final line end is optional.

  Raises DecodeError for a missing file, an empty line (naming it: an empty
  prompt is an error), non-UTF-8 bytes (naming the line) or an empty file.
  """
  try:
    raw = open(path, "rb").read()
  except OSError as e:
    raise DecodeError(f"--prompt_file={path!r}: {e.strerror}") from e
  prompts = []
  for i, line in enumerate(raw.splitlines(), 1):
    try:
      text = line.decode("utf-8")
    except UnicodeDecodeError as e:
      raise DecodeError(f"--prompt_file={path!r} line {i} is not valid UTF-8 "
                        f"(byte {e.start}: {line[e.start:e.start + 1]!r})") from e
    if not text:
      raise DecodeError(f"--prompt_file={path!r} line {i} is empty: every line is one prompt "
                        "(prompt i is line i+1); remove blank lines")
    prompts.append(text)
  if not prompts:
    raise DecodeError(f"--prompt_file={path!r} is empty: give one prompt per line")
  return prompts


def read_prompts(path: str) -> list[str] | list[dict]:
  """``--prompt_file``: a ``.jsonl`` file is read as chat prompts
  (``read_prompt_jsonl_file``), any other file as one prompt per line
  (``read_prompt_file``). Raises DecodeError."""
  return read_prompt_jsonl_file(path) if path.endswith(".jsonl") else read_prompt_file(path)


def read_prompt_jsonl_file(path: str) -> list[dict]:
  """A JSONL prompt file: one JSON object per line, ``{"prompt": str,
  "category": str (optional), "system": str (optional)}`` (blank lines
  skipped), e.g. the held-out set ``mtp/data/heldout_chat.jsonl``. With a
  model whose tokenizer has a chat template each object is a chat (an
  optional system message, the prompt as the user message, the generation
  prompt appended); without one the prompt is raw text. Results and
  statistics are then also reported per ``category``.

  Raises DecodeError, one line naming the file and the line: invalid UTF-8
  or JSON, not an object, a missing or empty ``prompt``, a value that is not
  a string, an unknown field, or no prompt at all.
  """
  from mtp.data.chat import read_prompt_jsonl
  from mtp.data.corpora import DataError
  try:
    return read_prompt_jsonl(path, what="--prompt_file")
  except DataError as e:
    raise DecodeError(str(e)) from None


def parse_num_draft_tokens(text) -> int | str:
  """``--num_draft_tokens``: an integer >= 1 or "auto". Raises DecodeError."""
  if isinstance(text, int) and not isinstance(text, bool):
    value = text
  elif str(text).strip().lower() == "auto":
    return "auto"
  else:
    try:
      value = int(str(text).strip())
    except ValueError:
      value = None
  if value is None or value < 1:
    raise DecodeError(f"--num_draft_tokens={text!r} must be an integer >= 1 or 'auto'")
  return value


def parse_stops(strings: Sequence[str], token_ids: Sequence[str]) -> StopConditions | None:
  """``--stop`` strings and ``--stop_token_ids`` (decimal ids) as
  ``StopConditions`` (None when both are empty). Raises DecodeError for an
  id that is not an integer (ranges are checked against the model later)."""
  ids = []
  for t in token_ids:
    try:
      ids.append(int(str(t).strip()))
    except ValueError:
      raise DecodeError(f"--stop_token_ids: {t!r} is not an integer token id") from None
  check_prompt_text(list(strings), "--stop")
  if not strings and not ids:
    return None
  return StopConditions(token_ids=tuple(ids), strings=tuple(strings))


def flag_notices(*, method: str, given: set[str], temperature: float, compare: bool,
                 num_draft_tokens: int | str = 2) -> list[str]:
  """One line per flag that has no effect in the chosen mode (``given``: the
  flags set on the command line, without dashes). The mode-independent ones;
  ``run`` adds the one that needs the checkpoint (G > D)."""
  notes = []
  if "max_draft_tokens" in given and num_draft_tokens != "auto":
    notes.append("--max_draft_tokens has no effect without --num_draft_tokens=auto")
  if compare and method == "ar":
    notes.append("--compare has no effect with --method=ar (nothing to compare AR against)")
  if "repeats" in given and not (compare and method != "ar"):
    notes.append("--repeats has no effect without --compare (and a method other than ar)")
  if "num_draft_tokens" in given and method == "ar":
    notes.append("--num_draft_tokens has no effect with --method=ar (nothing is drafted; the "
                 "report records num_draft_tokens 0)")
  if "draft_workdir" in given and method != "draft":
    notes.append(f"--draft_workdir has no effect with --method={method} (only --method=draft "
                 "uses a draft model)")
  if temperature == 0:
    unused = [f"--{f}" for f in ("top_k", "top_p", "seed") if f in given]
    if unused:
      notes.append(f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect at "
                   "--temperature=0 (greedy: every token is the argmax)")
  return notes


MAX_NEW_TOKENS = 2 ** 31 - 1
MAX_SAMPLES = 65536
MAX_REPEATS = 1000
MAX_SEED = 2 ** 32 - 1


def check_prompt_text(prompts: Sequence[str], flag: str = "--prompt") -> None:
  """Raises DecodeError for text that is not valid Unicode: Python turns
  command-line bytes that are not UTF-8 into lone surrogates (PEP 383), so a
  byte such as 0xFF typed into --prompt arrives as U+DCFF; it is refused,
  naming the prompt, the byte and its position, instead of being fed to the
  model as other bytes."""
  for i, p in enumerate(prompts):
    for j, ch in enumerate(p):
      if 0xD800 <= ord(ch) <= 0xDFFF:
        what = (f"byte 0x{ord(ch) - 0xDC00:02X}" if 0xDC80 <= ord(ch) <= 0xDCFF
                else f"lone surrogate U+{ord(ch):04X}")
        raise DecodeError(f"{flag} (prompt {i}) is not valid UTF-8: {what} at character {j}; "
                          "give UTF-8 text")


def check_run_args(*, max_new_tokens, num_samples, seed, repeats, max_draft_tokens=None,
                   sampling: SamplingParams | None = None) -> None:
  """Range checks of every numeric setting of ``run``, made before anything
  is loaded. Raises DecodeError, one line naming the flag and its range."""
  def integer(name, value, lo, hi):
    if not (isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi):
      raise DecodeError(f"--{name}={value!r} must be an integer in [{lo}, {hi}]")
  integer("max_new_tokens", max_new_tokens, 1, MAX_NEW_TOKENS)
  integer("num_samples", num_samples, 1, MAX_SAMPLES)
  integer("seed", seed, 0, MAX_SEED)
  integer("repeats", repeats, 1, MAX_REPEATS)
  if max_draft_tokens is not None:
    integer("max_draft_tokens", max_draft_tokens, 1, 16)
  if sampling is not None:
    sampling.validate()


def encode_prompts(prompts: Sequence[str], tokenizer=None, chat: bool = False,
                   systems: Sequence[str | None] | None = None) -> list[np.ndarray]:
  """Token ids per prompt with ``tokenizer`` (default the byte tokenizer):
  raw text (BOS first where the tokenizer adds one: always for the byte
  tokenizer), or with ``chat`` one user message rendered with the
  tokenizer's chat template (generation prompt appended). Text is always
  encoded as text: a prompt that spells a special token (``<|im_start|>``)
  never becomes the control token; only the template emits those.

  ``systems``: per prompt an optional system message (placed before the
  user message; needs ``chat``).

  Raises DecodeError for an empty prompt, text that is not valid UTF-8
  (``check_prompt_text``), ``chat`` with a tokenizer that has no template,
  or a system message without ``chat``.
  """
  check_prompt_text(prompts, "--chat" if chat else "--prompt")
  tk = tokenizer or tok.ByteTokenizer()
  if chat and not tk.chat_template:
    raise DecodeError("--chat needs a tokenizer with a chat template (a workdir imported with "
                      "python -m mtp.importers); this model's tokenizer has none: use --prompt")
  out = []
  for i, p in enumerate(prompts):
    if not p:
      raise DecodeError(f"--prompt (prompt {i}) is empty: give at least one character")
    system = systems[i] if systems is not None else None
    if system and not chat:
      raise DecodeError(f"prompt {i} has a system message, which needs the chat template; this "
                        "model's tokenizer has none")
    if chat:
      msgs = ([{"role": "system", "content": system}] if system else []) + [
          {"role": "user", "content": p}]
      ids = tk.apply_chat_template(msgs, add_generation_prompt=True)
    elif tk.kind == "byte":
      ids = tk.encode(p, add_bos=True)
    else:
      ids = tk.encode(p)
    out.append(np.asarray(ids, np.int32))
  return out


def auto_schedule(workdir: str, max_draft_tokens: int) -> AutoSchedule | None:
  """``AutoSchedule(max_draft_tokens)`` whose prior acceptance per draft
  position is the stage's validation acceptance stored beside its
  checkpoint (``decode.calibrate.stage_prior``: greedy and sampling values
  apart), or None (the schedule's fixed prior) without one."""
  prior = calibrate.stage_prior(workdir, max_draft_tokens)
  if not (isinstance(max_draft_tokens, int) and max_draft_tokens >= 1) or not prior \
      or not prior["sampling"]:
    return None
  return AutoSchedule(max_draft_tokens, prior=prior["sampling"], greedy_prior=prior["greedy"])


def load_decoder(workdir: str, method: str, num_draft_tokens: int | str,
                 draft_workdir: str | None = None, max_draft_tokens: int | None = None,
                 tree=None) -> tuple[Decoder, int]:
  """(A Decoder for the checkpoint in ``workdir`` (and ``draft_workdir``),
  the number of draft offsets its MTP modules were trained for: D plus
  ``mtp.recursive_steps``); ``num_draft_tokens`` an integer or "auto" (then
  ``max_draft_tokens``); ``tree``: a token tree such as "3,2,1" (method
  "mtp"). Raises CheckpointError / DecodeError."""
  if tree is not None and method != "mtp":
    raise DecodeError(f"--tree needs --method=mtp (the MTP modules draft the tree); got "
                      f"--method={method}")
  cfg, target, _ = loading.load_model(workdir)
  try:
    tokenizer = tok.load_tokenizer(workdir)
  except tok.TokenizerError as e:
    raise DecodeError(str(e)) from None
  trained = target.mtp_depth + (getattr(cfg.mtp, "recursive_steps", 0) if target.mtp_depth else 0)
  draft = None
  if method == "draft":
    if not draft_workdir:
      raise DecodeError("--method=draft needs --draft_workdir (a trained draft-model workdir)")
    _, draft, _ = loading.load_model(draft_workdir)
  kw = {}
  if num_draft_tokens == "auto" and method == "mtp":
    kw = {"max_draft_tokens": max_draft_tokens, "schedule": auto_schedule(
        workdir, target.mtp_depth if max_draft_tokens is None else max_draft_tokens)}
  elif num_draft_tokens == "auto":
    kw = {"max_draft_tokens": max_draft_tokens}
  if tree is not None:
    kw["tree"] = tree
  return Decoder(target, method, num_draft_tokens if method != "ar" else 1, draft,
                 tokenizer=tokenizer, **kw), trained


def decode_texts(decoder: Decoder, prompts: Sequence[str], *, max_new_tokens: int,
                 sampling: SamplingParams, num_samples: int = 1, seed: int = 0,
                 warmup: bool = True, out: TextIO | None = None,
                 stops: StopConditions | None = None, chat: bool = False,
                 systems: Sequence[str | None] | None = None):
  """Decodes every prompt ``num_samples`` times in one batch (stream form).

  With one prompt and one sample, text is streamed to ``out`` as it is
  emitted (never past a stop string), after the prompt (raw prompts) or
  alone (``chat``: the reply to one user message). ``warmup`` first runs
  the same shapes once so timings exclude compilation. Returns the
  ``Generation``.
  """
  if not (isinstance(num_samples, int) and num_samples >= 1):
    raise DecodeError(f"--num_samples={num_samples!r} must be an integer >= 1")
  encoded = [p for p in encode_prompts(prompts, decoder.tokenizer, chat, systems)
             for _ in range(num_samples)]
  if warmup:
    decoder.stream(encoded, max_new_tokens, sampling, seed, stops=stops)
  on_text = None
  if out is not None and len(encoded) == 1:
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    if not chat:
      out.write(prompts[0])
    def on_text(row, data):
      out.write(utf8.decode(data))
      out.flush()
  gen = decoder.stream(encoded, max_new_tokens, sampling, seed, stops=stops, on_text=on_text)
  if on_text is not None:
    out.write(utf8.decode(b"", final=True) + "\n")
  return gen


def run(workdir: str, prompts: Sequence[str], *, method: str = "mtp",
        num_draft_tokens: int | str = 2, max_draft_tokens: int | None = None,
        draft_workdir: str | None = None, max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(), num_samples: int = 1, seed: int = 0,
        compare: bool = False, repeats: int = 3, out: TextIO | None = None,
        err: TextIO | None = None, tree=None, stops: StopConditions | None = None,
        chat: bool | None = False) -> dict:
  """Everything ``python -m decode`` does; returns the JSON report.

  Generated text goes to ``out`` (default stdout): with one prompt and one
  sample the prompt and its continuation, streamed; otherwise per row a line
  ``--- prompt I sample S: 'PROMPT'`` and then prompt + continuation (I is
  the index in ``prompts``, recorded as ``prompt_index``). Statistics, the
  comparison and notices go to ``err`` (default stderr).

  ``compare``: after the reported (streamed) generation, ``repeats``
  interleaved pairs of AR and ``method`` runs of the same prompts, seed and
  budget (order alternating, all after compilation, not streamed); the
  speedup is median AR wall time / median ``method`` wall time, with the
  per-repeat ratios as the spread.

  ``tree`` ("3,2,1" or a tuple; method "mtp"): draft a token tree instead
  of a chain (``Decoder(tree=...)``); the statistics then give acceptance
  per depth, the histogram of accepted path lengths and the nodes per
  round, and ``config`` records the tree.

  ``stops``: stop token ids and stop strings (``decode.stops``); each
  result records its ``finish_reason`` ("eos", "stop" or "length").
  ``chat``: every prompt is one user message rendered with the model's chat
  template (its end-of-turn token ends the reply); else raw text; None:
  chat iff the model's tokenizer has a chat template (JSONL prompt files).

  ``prompts``: strings, or dicts ``{"prompt", "category"?, "system"?}`` (a
  JSONL prompt file, ``read_prompt_jsonl_file``): each result then records
  its ``category`` and the report gains ``per_category`` (per category:
  rows, num_tokens, target_calls, tau, alpha_k, the accepted-length
  histogram; with ``compare`` also the category's speedup, from its own
  interleaved AR / method runs of that category's prompts as one batch),
  also printed as a table (``decode.stats.format_by_category``).

  Raises DecodeError / CheckpointError for bad arguments or checkpoints
  (every numeric setting and the prompt text are checked before anything
  is loaded).
  """
  out = out or sys.stdout
  err = err or sys.stderr
  items = [dict(p) if isinstance(p, Mapping) else {"prompt": p} for p in prompts]
  prompts = [it["prompt"] for it in items]
  systems = [it.get("system") for it in items]
  systems = systems if any(systems) else None
  categories = ([it.get("category") for it in items] if any("category" in it for it in items)
                else None)
  check_run_args(max_new_tokens=max_new_tokens, num_samples=num_samples, seed=seed,
                 repeats=repeats, max_draft_tokens=max_draft_tokens, sampling=sampling)
  check_prompt_text(prompts)
  decoder, trained = load_decoder(workdir, method, num_draft_tokens, draft_workdir,
                                  max_draft_tokens, tree)
  depth = decoder.models()[0].mtp_depth
  if method == "mtp" and decoder.tree is None and decoder.G > trained:
    first = trained + 1
    extra = (f"drafts {first}..{decoder.G} reuse" if decoder.G > first else
             f"draft {decoder.G} reuses")
    flag = ("--max_draft_tokens" if decoder.num_draft_tokens == "auto" else "--num_draft_tokens")
    trained_for = (f"the checkpoint's MTP depth D={depth}" if trained == depth else
                   f"the {trained} offsets the checkpoint's modules were trained for (D={depth}, "
                   f"mtp.recursive_steps={trained - depth})")
    err.write(f"note: {flag}={decoder.G} > {trained_for}: "
              f"{extra} module {depth}, which was never trained for that offset (acceptance "
              "decays there)\n")
  if stops is not None:
    stops.validate(decoder.target_cfg.vocab_size)
  if chat is None:
    chat = bool(decoder.tokenizer.chat_template)
  gen = decode_texts(decoder, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                     num_samples=num_samples, seed=seed, out=out, stops=stops, chat=chat,
                     systems=systems)
  results = []
  for r, ids in enumerate(gen.tokens):
    results.append({"prompt_index": r // num_samples, "prompt": prompts[r // num_samples],
                    **({"category": categories[r // num_samples]} if categories else {}),
                    "sample": r % num_samples, "tokens": [int(t) for t in ids],
                    "text": gen.texts[r].decode("utf-8", errors="replace"),
                    "finish_reason": gen.finish_reasons[r], "stats": stats_lib.summarize(gen, [r])})
  summary = stats_lib.summarize(gen)
  if len(gen.tokens) > 1:
    for res in results:
      out.write(f"--- prompt {res['prompt_index']} sample {res['sample']}: "
                f"{res['prompt']!r}\n{'' if chat else res['prompt']}{res['text']}\n")
    out.flush()
  err.write(stats_lib.format_summary(method, summary) + f"\n  seed {seed}\n")
  report = {"config": {"workdir": workdir, "method": method,
                       "num_draft_tokens": decoder.num_draft_tokens,
                       **({"max_draft_tokens": decoder.G} if decoder.num_draft_tokens == "auto"
                          else {}),
                       "tree": None if decoder.tree is None else list(decoder.tree.branching),
                       "max_new_tokens": max_new_tokens, "temperature": sampling.temperature,
                       "top_k": sampling.top_k, "top_p": sampling.top_p,
                       "num_samples": num_samples, "seed": seed, "batch_size": len(gen.tokens),
                       "chat": chat, "stop": [] if stops is None else list(stops.strings),
                       "stop_token_ids": [] if stops is None else [int(i) for i in stops.token_ids],
                       "device": jax.devices()[0].device_kind},
            "results": results, "stats": summary}
  if compare and method != "ar":
    report.update(_compare_with_ar(decoder, gen, prompts, method=method, repeats=repeats,
                                   max_new_tokens=max_new_tokens, sampling=sampling,
                                   num_samples=num_samples, seed=seed, err=err, stops=stops,
                                   chat=chat, systems=systems))
  if categories:
    row_cats = [categories[r // num_samples] for r in range(len(gen.tokens))]
    speedups = None
    if compare and method != "ar":
      speedups = {}
      ar = Decoder(decoder.models()[0], "ar", tokenizer=decoder.tokenizer)
      for cat, idx in stats_lib.group_rows(categories).items():
        sub = types.SimpleNamespace(tokens=[gen.tokens[i * num_samples + s] for i in idx
                                            for s in range(num_samples)])
        res = _compare_with_ar(decoder, sub, [prompts[i] for i in idx], method=method,
                               repeats=repeats, max_new_tokens=max_new_tokens, sampling=sampling,
                               num_samples=num_samples, seed=seed, err=io.StringIO(), stops=stops,
                               chat=chat, systems=None if systems is None else
                               [systems[i] for i in idx], ar=ar)
        speedups[cat] = res["speedup"]
    report["per_category"] = stats_lib.summarize_by_category(gen, row_cats, speedups)
    err.write(stats_lib.format_by_category(report["per_category"]) + "\n")
  return report


def _compare_with_ar(decoder: Decoder, gen, prompts: Sequence[str], *, method: str, repeats: int,
                     max_new_tokens: int, sampling: SamplingParams, num_samples: int, seed: int,
                     err: TextIO, stops: StopConditions | None = None, chat: bool = False,
                     systems: Sequence[str | None] | None = None,
                     ar: Decoder | None = None) -> dict:
  """``repeats`` interleaved AR / ``decoder`` runs (see ``run``); returns the
  report keys ar_stats, speedup, speedup_per_repeat, repeats, wall_times_s.
  ``ar``: the AR decoder to time (default a new one; passing one reuses its
  compilations)."""
  ar = ar or Decoder(decoder.models()[0], "ar", tokenizer=decoder.tokenizer)
  kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, num_samples=num_samples, seed=seed,
            stops=stops, chat=chat, systems=systems)
  ar_gen = decode_texts(ar, prompts, warmup=True, **kw)       # compiles AR; not timed below
  times = {"ar": [], method: []}

  def timed(name, dec):       # records the decoder's own wall time of each call
    return lambda: times[name].append(decode_texts(dec, prompts, warmup=False, **kw).wall_time_s)
  # interleaved, the order alternating (ar, method / method, ar) so that drift hits both alike
  interleaved_times({"ar": timed("ar", ar), method: timed(method, decoder)}, repeats, warmup=0)
  ratios = [a / b for a, b in zip(times["ar"], times[method])]
  speedup = float(np.median(times["ar"]) / np.median(times[method]))
  ar_summary = stats_lib.summarize(ar_gen)
  same = all(np.array_equal(a, b) for a, b in zip(ar_gen.tokens, gen.tokens))
  err.write(stats_lib.format_summary("ar", ar_summary) + f"\n  seed {seed}\n")
  err.write(f"speedup over AR: {speedup:.2f}x (median wall time of "
            f"{repeats} interleaved repeat{'s' if repeats != 1 else ''}, per repeat "
            f"{min(ratios):.2f}x-{max(ratios):.2f}x; same prompts and budget, after compilation"
            + ("; one repeat is noisy, see scripts/bench_decode.py" if repeats == 1 else "") + ")"
            + ("" if sampling.temperature else
               " (greedy outputs identical)" if same else
               " (WARNING: greedy outputs differ; a float near-tie or a bug)") + "\n")
  return {"ar_stats": ar_summary, "speedup": speedup, "speedup_per_repeat": ratios,
          "repeats": repeats, "wall_times_s": times}
