"""Library side of ``python -m decode``: load checkpoints, encode prompts,
decode (streaming when there is one prompt), compare with AR, report.

``run(...)`` writes the generated text to ``out`` (stdout) and statistics,
comparisons and notices to ``err`` (stderr), and returns the report dict that
``--json`` writes (with ``"meta"``: commit, date, machine and command,
``mtp.report.provenance``): ``{"config": {...}, "results": [{"prompt_index",
"prompt", "sample", "tokens", "text", "finish_reason", "stats"}, ...],
"stats": {...},
"ar_stats": {...}, "speedup": float (tokens/s ratio), "speedup_per_repeat": [...],
"wall_times_s": {"ar": [...], METHOD: [...]}, "new_tokens": {...},
"tokens_per_s": {...}, "timed": {"ar": {...}, METHOD: {...}}, "prediction": {...},
"greedy_check": {...} or None, "speedup_per_repeat_median": float, "answer_repeat": 0}``
(the last eleven with ``compare``: ``decode.cli.compare.compare_with_ar``; ``timed``
holds each method's timed repeats as medians with min and max, the numbers
the printed blocks and the speedup come from; ``ar_stats`` is AR's untimed
run, not printed; ``greedy_check`` at T = 0: every row where the two greedy
outputs differ, its first differing token and the target's top-2 logit gap
there against the numeric contract's bound, "near_tie" or a bug), and ``"interrupted": true`` when
Ctrl-C ended the decoding (or the comparison) early. With prompts that carry a ``category`` (a JSONL
``--prompt_file``) every result records its ``"category"`` and the report
has ``"per_category": {CATEGORY: {"rows", "num_tokens", "target_calls",
"mean_accepted_length", "acceptance_rate_per_position",
"accepted_length_histogram", "speedup" (with compare)}}``.

The rooms: ``decode.cli.texts`` (prompt files, encoding, streamed text),
``decode.cli.compare`` (--compare), ``decode.cli.results`` (the report's rows,
config and notices); this file checks the flags' values, loads the
decoder and runs the job.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

import jax

from decode.auto import calibrate
from decode.cli import compare as compare_lib
from decode.cli import results as results_lib
from decode.cli import stats as stats_lib
from decode.auto.schedule import AutoSchedule
from decode import limits
from decode.limits import (  # noqa: F401 (decode.cli.run's API)
    DTYPES, MAX_DRAFT_TOKENS, MAX_NEW_TOKENS, MAX_REPEATS, MAX_SAMPLES, MAX_SEED,
    check_overrides, parse_num_draft_tokens)
from decode.decoder import DecodeError, Decoder, SamplingParams, check_flags
from decode.stops import StopConditions
from decode.cli.texts import (  # noqa: F401 (decode.cli.run's API: python -m decode, tests)
    check_prompt_text, decode_texts, encode_prompts, read_prompt_file, read_prompt_jsonl_file,
    read_prompts)
from mtp import loading
from mtp import tokenizer as tok
from mtp.config import ConfigError


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


@contextlib.contextmanager
def out_of_memory_as_decode_error(num_prompts: int, num_samples: int, max_new_tokens: int):
  """Turns XLA's RESOURCE_EXHAUSTED (an allocation the device or host
  cannot make: the batch is prompts x --num_samples rows, each with a KV
  cache) into a one-line DecodeError naming the flags that size it; any
  other runtime error passes unchanged."""
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise DecodeError(
        f"out of memory decoding {num_prompts} prompt(s) x --num_samples={num_samples} rows "
        f"with --max_new_tokens={max_new_tokens} ({str(e).splitlines()[0][:160]}); lower "
        "--num_samples, the number of prompts or --max_new_tokens") from None


def check_run_args(*, max_new_tokens, num_samples, seed, repeats, max_draft_tokens=None,
                   sampling: SamplingParams | None = None) -> None:
  """Range checks of every numeric setting of ``run``, made before anything
  is loaded. Raises DecodeError, one line naming the flag and its range."""
  limits.check_counts(max_new_tokens=max_new_tokens, num_samples=num_samples, seed=seed,
                      repeats=repeats, max_draft_tokens=max_draft_tokens)
  if sampling is not None:
    sampling.validate()


def auto_schedule(workdir: str, max_draft_tokens: int) -> AutoSchedule | None:
  """``AutoSchedule(max_draft_tokens)`` whose prior acceptance per draft
  position is the stage's validation acceptance stored beside its
  checkpoint (``decode.auto.calibrate.stage_prior``: greedy and sampling values
  apart), or None (the schedule's fixed prior) without one."""
  prior = calibrate.stage_prior(workdir, max_draft_tokens)
  if not (isinstance(max_draft_tokens, int) and max_draft_tokens >= 1) or not prior \
      or not prior["sampling"]:
    return None
  return AutoSchedule(max_draft_tokens, prior=prior["sampling"], greedy_prior=prior["greedy"])


def trained_offsets(cfg, target) -> int:
  """The draft offsets a checkpoint's MTP modules were trained for: D plus
  ``mtp.recursive_steps`` (0 without modules). ``cfg``: the full Config."""
  return target.mtp_depth + (getattr(cfg.mtp, "recursive_steps", 0) if target.mtp_depth else 0)


def auto_kwargs(workdir: str, cfg, target, max_draft_tokens: int | None = None) -> dict:
  """``Decoder`` keyword arguments of ``num_draft_tokens="auto"`` for the
  checkpoint in ``workdir``: G_max (``max_draft_tokens``, default the trained
  offsets) and the schedule with the stage's prior (``auto_schedule``)."""
  g_max = max_draft_tokens if max_draft_tokens is not None else max(trained_offsets(cfg, target), 1)
  return {"max_draft_tokens": g_max, "schedule": auto_schedule(workdir, g_max)}


# the model fields --dtype and --attention_impl set (mtp.loading.overridden_config)
OVERRIDE_FLAGS = {"model.param_dtype": "--dtype", "model.dtype": "--dtype",
                  "model.attention_impl": "--attention_impl"}


def model_overrides(cfg, *, dtype: str | None, attention_impl: str | None):
  """The checkpoint's config ``cfg`` with ``--dtype`` / ``--attention_impl``
  applied through ``mtp.config``'s validation
  (``mtp.loading.overridden_config``); its ConfigError becomes one
  DecodeError line naming the flag (the field it sets) and the allowed
  values."""
  try:
    return loading.overridden_config(cfg, dtype=dtype, attention_impl=attention_impl)
  except ConfigError as e:
    msg = str(e)
    for field, flag in OVERRIDE_FLAGS.items():
      if msg.startswith(field + "="):
        msg = flag + msg[len(field):]
        break
    raise DecodeError(msg.replace("unless model.dtype is bfloat16 or float16",
                                  "unless --dtype is bfloat16")
                      .replace("unless model.dtype is", "unless --dtype (model.dtype) is")) \
        from None


def load_decoder(workdir: str, method: str, num_draft_tokens: int | str,
                 draft_workdir: str | None = None, max_draft_tokens: int | None = None,
                 tree=None, *, dtype: str | None = None,
                 attention_impl: str | None = None) -> tuple[Decoder, int, int | None]:
  """(A Decoder for the checkpoint in ``workdir`` (and ``draft_workdir``),
  the number of draft offsets its MTP modules were trained for: D plus
  ``mtp.recursive_steps``, the checkpoint step loaded (None for an
  exported model)); ``num_draft_tokens`` an integer or "auto" (then
  ``max_draft_tokens``); ``tree``: a token tree such as "3,2,1" (method
  "mtp").

  ``dtype`` ("float32" or "bfloat16"; None: the checkpoint's
  ``model.dtype``): the target (backbone, head and MTP modules) and the
  draft model decode in that dtype, their parameters cast once here
  (``mtp.loading.override_model``); the output law is then that of the
  target in ``dtype``. ``attention_impl`` (None: the checkpoint's
  ``model.attention_impl``): one of ``mtp.config.ATTENTION_IMPLS`` for
  both models. Both are checked against the checkpoint's config before any
  parameter is read. Raises CheckpointError / DecodeError."""
  check_flags(method, num_draft_tokens, tree)        # before anything is read
  check_overrides(dtype, attention_impl)
  overrides = dict(dtype=dtype, attention_impl=attention_impl)
  if dtype is not None or attention_impl is not None:    # bad values: before any parameter
    model_overrides(loading.load_config(workdir)[0], **overrides)
  if attention_impl == "cudnn" and jax.default_backend() != "gpu":
    raise DecodeError(f"--attention_impl=cudnn needs an NVIDIA GPU (cuDNN); this backend is "
                      f"{jax.default_backend()}: use auto, blockwise or dense")
  cfg, target, step = loading.load_model(workdir)
  cfg, target = loading.override_model(cfg, target, **overrides)
  try:
    tokenizer = tok.load_tokenizer(workdir)
  except tok.TokenizerError as e:
    raise DecodeError(str(e)) from None
  trained = trained_offsets(cfg, target)
  draft = None
  if method == "draft":
    if not draft_workdir:
      raise DecodeError("--method=draft needs --draft_workdir (a trained draft-model workdir)")
    draft_cfg, draft, _ = loading.load_model(draft_workdir)
    model_overrides(draft_cfg, **overrides)
    _, draft = loading.override_model(draft_cfg, draft, **overrides)
  kw = {}
  if num_draft_tokens == "auto" and method == "mtp":
    kw = auto_kwargs(workdir, cfg, target, max_draft_tokens)
  elif num_draft_tokens == "auto":
    kw = {"max_draft_tokens": max_draft_tokens}
  if tree is not None:
    kw["tree"] = tree
  return Decoder(target, method, num_draft_tokens if method != "ar" else 1, draft,
                 tokenizer=tokenizer, **kw), trained, step



def run(workdir: str, prompts: Sequence[str], *, method: str = "mtp",
        num_draft_tokens: int | str = 2, max_draft_tokens: int | None = None,
        draft_workdir: str | None = None, max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(), num_samples: int = 1, seed: int = 0,
        compare: bool = False, repeats: int = 3, out: TextIO | None = None,
        err: TextIO | None = None, tree=None, stops: StopConditions | None = None,
        chat: bool | None = False, dtype: str | None = None,
        attention_impl: str | None = None) -> dict:
  """Everything ``python -m decode`` does; returns the JSON report.

  Generated text goes to ``out`` (default stdout): with one prompt and one
  sample the prompt and its continuation, streamed; otherwise per row a line
  ``--- prompt I sample S: 'PROMPT'`` and then prompt + continuation (I is
  the index in ``prompts``, recorded as ``prompt_index``). Statistics, the
  comparison and notices go to ``err`` (default stderr).

  ``compare``: ``repeats`` interleaved pairs of ``method`` and AR runs of
  the same prompts, seed and budget (order alternating, all after
  compilation), the method's first being the reported (streamed)
  generation, so the answer's statistics are those of a timed repeat
  (``decode.cli.compare.time_runs``); a block
  per method gives the timed repeats' median (min-max) tokens/s, wall,
  TTFT and ITL, the speedup is the ratio of the two median tokens/s (at
  T = 0 median AR wall time / median ``method`` wall time), with the
  per-repeat ratios as the spread, followed by Theorem 3.8's prediction
  from the measured tau and round cost and a line naming the term that
  decides (``decode.cli.compare``), each figure of it printed in the blocks.
  The reported generation's own block then leaves out its timing, which
  the blocks hold.

  ``tree`` ("3,2,1" or a tuple; method "mtp"): draft a token tree instead
  of a chain (``Decoder(tree=...)``); the statistics then give acceptance
  per depth, the histogram of accepted path lengths and the nodes per
  round, and ``config`` records the tree.

  ``stops``: stop token ids and stop strings (``decode.stops``); each
  result records its ``finish_reason`` ("eos", "stop" or "length"); rows
  that stopped at ``max_new_tokens`` get one line on ``err`` per run
  (``decode.cli.results.length_notice``).
  ``chat``: every prompt is one user message rendered with the model's chat
  template (its end-of-turn token ends the reply); else raw text; None:
  chat iff the model's tokenizer has a chat template (JSONL prompt files).

  ``dtype`` / ``attention_impl``: decode in that dtype with that attention
  implementation instead of the checkpoint's (``load_decoder``); the
  report's ``config`` records what was used (``dtype``, ``attention_impl``
  and ``attention_impl_resolved``, ``decode.cli.results.numerics_record``) and
  the statistics block says it.

  ``prompts``: strings, or dicts ``{"prompt", "category"?, "system"?}`` (a
  JSONL prompt file, ``read_prompt_jsonl_file``): each result then records
  its ``category`` and the report gains ``per_category`` (per category:
  rows, num_tokens, target_calls, tau, alpha_k, the accepted-length
  histogram; with ``compare`` also the category's speedup, from its own
  interleaved AR / method runs of that category's prompts as one batch),
  also printed as a table (``decode.cli.stats.format_by_category``).

  Ctrl-C while decoding ends the generation at a round boundary: the text
  so far is written, the statistics (marked interrupted) are those of the
  rows as far as they got, unfinished rows have the finish reason
  "interrupted", the comparison is skipped, and the report has
  ``"interrupted": True``; Ctrl-C during ``compare`` keeps the results and
  marks the report the same way. Before the decoding (loading,
  compilation, "auto"'s calibration) KeyboardInterrupt propagates.

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
  check_prompt_text(prompts, "--chat" if chat else "--prompt")
  check_overrides(dtype, attention_impl)
  decoder, trained, step = load_decoder(workdir, method, num_draft_tokens, draft_workdir,
                                        max_draft_tokens, tree, dtype=dtype,
                                        attention_impl=attention_impl)
  note = results_lib.untrained_offsets_note(decoder, method, trained)
  if note:
    err.write(note)
  if stops is not None:
    stops.validate(decoder.target_cfg.vocab_size)
  if chat is None:
    chat = bool(decoder.tokenizer.chat_template)
  kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, num_samples=num_samples, seed=seed,
            stops=stops, chat=chat)
  runs, compare_stopped = None, False
  with out_of_memory_as_decode_error(len(prompts), num_samples, max_new_tokens):
    if compare and method != "ar":       # the answer is the method's first timed repeat
      runs = compare_lib.TimedRuns(method, answer=True)
      try:
        compare_lib.time_runs(decoder, prompts, method=method, repeats=repeats, out=out,
                              runs=runs, systems=systems, **kw)
      except KeyboardInterrupt:
        if not runs.gens[method]:        # before the answer: as without --compare
          raise
        compare_stopped = True
      gen = runs.gens[method][0]
    else:
      gen = decode_texts(decoder, prompts, out=out, systems=systems, interruptible=True, **kw)
  results = results_lib.result_rows(gen, prompts, categories, num_samples)
  summary = stats_lib.summarize(gen)
  if len(gen.tokens) > 1:
    results_lib.write_rows(out, results, chat)
  # with no timed block to follow (Ctrl-C after the answer) its block keeps its own timing
  compared = compare and method != "ar" and not gen.interrupted and not compare_stopped
  timing_note = (f"this answer is {method}'s first timed repeat (its text handed on as decoded); "
                 "see the blocks below")
  err.write(stats_lib.format_summary(f"{method}, the answer above" if compared else method,
                                     summary, timing=not compared,
                                     timing_note=timing_note)
            + f"\n  seed {seed}  {results_lib.numerics_line(decoder)}\n")
  notice = results_lib.length_notice(gen.finish_reasons, max_new_tokens)
  if notice:
    err.write(notice)
  config = results_lib.config_record(
      workdir, method, decoder, batch_size=len(gen.tokens), max_new_tokens=max_new_tokens,
      sampling=sampling, num_samples=num_samples, seed=seed, chat=chat, stops=stops,
      checkpoint_step=step)
  if runs is not None and runs.answer_auto is not None:
    config["auto"] = runs.answer_auto     # as the answer used them, before later repeats learned
  report = {"config": config, "results": results, "stats": summary}
  if gen.interrupted:
    report["interrupted"] = True
    err.write(f"interrupted: {summary['num_tokens']} tokens generated"
              + ("; --compare skipped" if compare and method != "ar" else "") + "\n")
  kw = dict(method=method, repeats=repeats, **kw)
  speedups = None
  try:
    if compare_stopped:
      raise KeyboardInterrupt
    if compared:
      report.update(compare_lib.compare_with_ar(decoder, gen, prompts, err=err, systems=systems,
                                                runs=runs, **kw))
    if compared and categories:
      speedups = compare_lib.category_speedups(decoder, gen, prompts, categories,
                                               systems=systems, **kw)
  except KeyboardInterrupt:
    report["interrupted"] = True
    err.write("interrupted: --compare stopped; the results above are complete\n")
  if categories:
    row_cats = [categories[r // num_samples] for r in range(len(gen.tokens))]
    report["per_category"] = stats_lib.summarize_by_category(gen, row_cats, speedups)
    err.write(stats_lib.format_by_category(report["per_category"]) + "\n")
  return report
