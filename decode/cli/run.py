"""Library side of ``python -m decode``: ``run(DecodeRequest) ->
DecodeReport`` loads checkpoints, encodes prompts, decodes, compares with
AR; text to ``out`` (stdout), statistics and notices to ``err`` (stderr);
``DecodeReport.to_json()`` is what ``--json`` writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

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
    TextOut, check_prompt_text, encode_prompts, encode_rows, read_prompt_file,
    read_prompt_jsonl_file, read_prompts)
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
  """(Decoder for the checkpoint in ``workdir`` (and ``draft_workdir``),
  trained draft offsets D + ``mtp.recursive_steps``, checkpoint step loaded
  or None for an exported model). ``num_draft_tokens``: an integer or
  "auto"; ``tree`` such as "3,2,1". ``dtype`` ("float32" / "bfloat16";
  None: the checkpoint's) casts both models' parameters once, the output
  law then that of the target in ``dtype``; ``attention_impl`` one of
  ``mtp.config.ATTENTION_IMPLS``. Both are checked before any parameter is
  read. Raises CheckpointError / DecodeError."""
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



@dataclasses.dataclass(frozen=True)
class DecodeRequest:
  """Everything one ``python -m decode`` job decodes (its flags, parsed);
  ``run`` checks every value before anything is loaded."""
  workdir: str                          # the target's workdir (checkpoint or export)
  prompts: Sequence[str | Mapping[str, Any]]  # strings, or JSONL dicts {"prompt",
                                        #   "category"?, "system"?} (read_prompt_jsonl_file)
  method: str = "mtp"                   # "ar", "mtp" or "draft" (decode.decoder.METHODS)
  num_draft_tokens: int | str = 2       # G in [1, MAX_DRAFT_TOKENS], or "auto" (mtp only)
  max_draft_tokens: int | None = None   # G_max of "auto" (default: the trained offsets)
  draft_workdir: str | None = None      # the draft model's workdir (method "draft")
  max_new_tokens: int = 128             # new tokens per row, at most
  sampling: SamplingParams = SamplingParams()   # temperature (0 = greedy), top_k, top_p
  num_samples: int = 1                  # rows per prompt (rows = prompts x num_samples)
  seed: int = 0                         # PRNG seed of the sampling
  compare: bool = False                 # time `repeats` interleaved AR / method runs
  repeats: int = 3                      # timed repeats per decoder with compare
  tree: str | tuple[int, ...] | None = None   # token tree, branching per depth ("3,2,1")
  stops: StopConditions | None = None   # stop ids and strings beside the model's EOS
  chat: bool | None = False             # one chat message per prompt; None: iff the
                                        #   tokenizer has a chat template (JSONL prompts)
  dtype: str | None = None              # "float32" / "bfloat16" (None: the checkpoint's)
  attention_impl: str | None = None     # mtp.config.ATTENTION_IMPLS (None: the checkpoint's)


@dataclasses.dataclass
class DecodeReport:
  """What ``run`` returns; ``to_json()`` is the ``--json`` report."""
  config: dict                  # decode.cli.results.config_record (+ "auto" with compare)
  results: list[dict]           # per row: prompt_index, prompt, sample, tokens, text,
                                #   finish_reason, stats (+ category)
  stats: dict                   # decode.cli.stats.summarize over every row
  interrupted: bool = False     # Ctrl-C ended the decoding (or the comparison) early
  decoding_interrupted: bool = False  # ...the decoding itself (the key's place in the JSON)
  comparison: dict | None = None      # with compare: decode.cli.compare.compare_with_ar's
                                #   keys (ar_stats, speedup, speedup_per_repeat, ..., timed,
                                #   prediction, greedy_check, answer_repeat)
  per_category: dict | None = None    # {category: rows, num_tokens, target_calls, tau,
                                #   alpha_k, histogram (+ speedup)} for JSONL categories

  def to_json(self) -> dict:
    """The JSON report as a dict, keys in the order they are written: config,
    results, stats, [interrupted], [the comparison's keys], [per_category]."""
    out = {"config": self.config, "results": self.results, "stats": self.stats}
    if self.decoding_interrupted:
      out["interrupted"] = True
    out.update(self.comparison or {})
    if self.interrupted:
      out["interrupted"] = True
    if self.per_category is not None:
      out["per_category"] = self.per_category
    return out


def run(request: DecodeRequest, *, out: TextIO | None = None,
        err: TextIO | None = None) -> DecodeReport:
  """Everything ``python -m decode`` does for ``request``: the answer decoded
  once by ``Decoder.stream`` after ``warm_up``; text to ``out`` (one prompt
  and sample: streamed; else per row ``--- prompt I sample S: 'PROMPT'``
  then prompt + continuation), statistics and notices to ``err``.
  ``compare``: ``repeats`` interleaved method / AR runs, the method's first
  being the answer (``decode.cli.compare``); JSONL categories add a
  per-category table. Ctrl-C while decoding ends it at a round boundary
  (the comparison skipped), during the comparison keeps the results; the
  report is then ``interrupted``. Raises DecodeError / CheckpointError for
  bad arguments or checkpoints, checked before anything is loaded.
  """
  req = request
  method, max_new_tokens, sampling, num_samples = (req.method, req.max_new_tokens, req.sampling,
                                                   req.num_samples)
  seed, compare, repeats, stops, chat = req.seed, req.compare, req.repeats, req.stops, req.chat
  out = out or sys.stdout
  err = err or sys.stderr
  items = [dict(p) if isinstance(p, Mapping) else {"prompt": p} for p in req.prompts]
  prompts = [it["prompt"] for it in items]
  systems = [it.get("system") for it in items]
  systems = systems if any(systems) else None
  categories = ([it.get("category") for it in items] if any("category" in it for it in items)
                else None)
  check_run_args(max_new_tokens=max_new_tokens, num_samples=num_samples, seed=seed,
                 repeats=repeats, max_draft_tokens=req.max_draft_tokens, sampling=sampling)
  check_prompt_text(prompts, "--chat" if chat else "--prompt")
  check_overrides(req.dtype, req.attention_impl)
  decoder, trained, step = load_decoder(req.workdir, method, req.num_draft_tokens,
                                        req.draft_workdir, req.max_draft_tokens, req.tree,
                                        dtype=req.dtype, attention_impl=req.attention_impl)
  note = results_lib.untrained_offsets_note(decoder, method, trained)
  if note:
    err.write(note)
  if stops is not None:
    stops.validate(decoder.target_cfg.vocab_size)
  if chat is None:
    chat = bool(decoder.tokenizer.chat_template)
  kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, num_samples=num_samples, seed=seed,
            stops=stops, chat=chat)
  rows = encode_rows(prompts, decoder.tokenizer, num_samples=num_samples, chat=chat,
                     systems=systems)
  runs, compare_stopped = None, False
  with out_of_memory_as_decode_error(len(prompts), num_samples, max_new_tokens):
    # the answer, once, after a warm-up that compiles it (and calibrates "auto")
    decoder.warm_up(rows, max_new_tokens, sampling, seed, stops=stops)
    text = TextOut(out, None if chat else prompts[0]) if len(rows) == 1 else None
    gen = decoder.stream(rows, max_new_tokens, sampling, seed, stops=stops,
                         on_text=None if text is None else text.on_text, interruptible=True)
    if text is not None:
      text.close()
    if compare and method != "ar" and not gen.interrupted:  # the answer: the first timed repeat
      runs = compare_lib.TimedRuns(method, {"ar": [], method: [gen]}, answer=True,
                                   answer_auto=decoder.auto_record())
      try:
        compare_lib.time_runs(decoder, prompts, method=method, repeats=repeats, runs=runs,
                              systems=systems, **kw)
      except KeyboardInterrupt:
        compare_stopped = True
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
      req.workdir, method, decoder, batch_size=len(gen.tokens), max_new_tokens=max_new_tokens,
      sampling=sampling, num_samples=num_samples, seed=seed, chat=chat, stops=stops,
      checkpoint_step=step)
  if runs is not None and runs.answer_auto is not None:
    config["auto"] = runs.answer_auto     # as the answer used them, before later repeats learned
  report = DecodeReport(config, results, summary, interrupted=bool(gen.interrupted),
                        decoding_interrupted=bool(gen.interrupted))
  if gen.interrupted:
    err.write(f"interrupted: {summary['num_tokens']} tokens generated"
              + ("; --compare skipped" if compare and method != "ar" else "") + "\n")
  kw = dict(method=method, repeats=repeats, **kw)
  speedups = None
  try:
    if compare_stopped:
      raise KeyboardInterrupt
    if compared:
      report.comparison = compare_lib.compare_with_ar(decoder, gen, prompts, err=err,
                                                      systems=systems, runs=runs, **kw)
    if compared and categories:
      speedups = compare_lib.category_speedups(decoder, gen, prompts, categories,
                                               systems=systems, **kw)
  except KeyboardInterrupt:
    report.interrupted = True
    err.write("interrupted: --compare stopped; the results above are complete\n")
  if categories:
    row_cats = [categories[r // num_samples] for r in range(len(gen.tokens))]
    report.per_category = stats_lib.summarize_by_category(gen, row_cats, speedups)
    err.write(stats_lib.format_by_category(report.per_category) + "\n")
  return report
