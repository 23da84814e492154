"""python -m decode --workdir DIR --prompt "def main(" [--method mtp] [--compare] ...

Parses flags and calls ``decode.cli.run.run``. Flags are listed by --help.
Generated text goes to stdout; statistics, the --compare result and notices
(one line per flag that has no effect in the chosen mode) to stderr;
``--json PATH`` writes the machine-readable report. Exit status: 0 (also
after --help, which absl alone ends with 1), 2 for bad input (unknown or
malformed flags included) or checkpoints, 3 when the model produced
NaN/inf logits, 130 after Ctrl-C: during the decoding the
text so far, its statistics and the report (``"interrupted": true``) are
still written; before it (loading, compilation, calibration), or at a
second Ctrl-C, one line says so and the report is ``{"interrupted": true,
"results": []}``. No traceback either way.
"""

import json
import os
import shlex
import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "Trained run directory (target model), or a "
                                "directory written by python -m mtp.export.")
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text (use --prompt_file for a batch).")
_CHAT = flags.DEFINE_string("chat", None, "A user message: rendered with the model's chat "
                            "template (its end-of-turn token ends the reply); only the reply "
                            "is printed. Needs a workdir with a chat template (mtp.importers). "
                            "Text that spells a special token (<|im_start|>) is encoded as "
                            "plain text; only the template emits control tokens.")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "UTF-8 file, one prompt per line, taken "
                                   "literally (batched; prompt i is line i+1; no blank lines); "
                                   "a .jsonl file: one {\"prompt\", \"category\"?, "
                                   "\"system\"?} object per line, chat prompts when the model "
                                   "has a chat template, statistics also per category.")
_METHOD = flags.DEFINE_enum("method", "mtp", ["ar", "mtp", "draft"],
                            "ar: autoregressive; mtp: drafts from the MTP modules; draft: "
                            "drafts from --draft_workdir.")
_DRAFT_WORKDIR = flags.DEFINE_string("draft_workdir", None, "Draft model run directory (--method draft).")
_G = flags.DEFINE_string("num_draft_tokens", None, "Draft length G per round (an integer in "
                         "[1, 16]), or 'auto': G in 0..--max_draft_tokens chosen every round from "
                         "measured acceptance and round costs (--method mtp; 0 = a plain AR step, "
                         "so it falls back to AR where drafting does not pay). Default: auto with "
                         "--method mtp, 2 with --method draft.")
_G_MAX = flags.DEFINE_integer("max_draft_tokens", None, "Longest draft 'auto' considers "
                              "(default: the offsets the checkpoint's MTP modules were trained for, D "
                              "plus mtp.recursive_steps).")
_TREE = flags.DEFINE_string("tree", None, "Token tree instead of a chain (--method mtp): "
                            "branching per depth, e.g. 3,2,1 (each in [1, 64], depth 1..D); "
                            "all nodes verified in one target call. Not with --num_draft_tokens.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature (>= 0; 0 = greedy).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k (>= 0; 0 = off).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Top-p in (0, 1] (1 = off).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Generated tokens per sample (>= 1).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Independent samples per prompt (>= 1).")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed in [0, 2**32 - 1] (default 0: the same "
                             "text every run at T > 0; printed and stored in the report).")
_STOP = flags.DEFINE_multi_string("stop", [], "Stop string (repeatable): a row ends when its "
                                  "text contains one; the text is cut before it")
_STOP_IDS = flags.DEFINE_list("stop_token_ids", [], "Comma-separated token ids that end a row "
                              "when emitted (kept, like EOS).")
_COMPARE = flags.DEFINE_bool("compare", False, "Also time AR and the method on the same "
                             "prompts in --repeats interleaved runs: per method the median "
                             "(min-max) tokens/s, TTFT and ITL, the speedup as the ratio of the "
                             "medians, and what Theorem 3.8 predicts from the measured tau and "
                             "round cost.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "--compare: interleaved AR / method runs (>= 1).")
_DTYPE = flags.DEFINE_string("dtype", None, "float32 or bfloat16: the dtype the target, its MTP "
                             "modules and the draft model decode in, their weights cast once at "
                             "load (default: the checkpoint's model.dtype). The output law is "
                             "the target's in that dtype.")
_ATTENTION = flags.DEFINE_string("attention_impl", None, "Attention over the KV cache: auto, "
                                 "blockwise, dense or cudnn (mtp.config's model.attention_impl; "
                                 "default: the checkpoint's value, 'blockwise' in checkpoints "
                                 "saved before 'auto' existed).")
_JSON = flags.DEFINE_string("json", None, "Write the report (tokens, text, stats) to this path.")
flags.mark_flag_as_required("workdir")
EXIT_INTERRUPTED = 130     # 128 + SIGINT, as a shell reports a process Ctrl-C ended
DRAFT_MODEL_DEFAULT_G = 2  # --num_draft_tokens of --method draft when not given
def default_num_draft_tokens(method: str, tree: str | None) -> int | str:
  """--num_draft_tokens when the flag is not given: "auto" for --method mtp
  (never slower than AR by design: it drafts only where the measured costs
  and acceptance say it pays), ``DRAFT_MODEL_DEFAULT_G`` for --method draft
  (auto needs the MTP modules) and with --tree (a tree fixes its own depth;
  the value is unused, as with --method ar)."""
  return "auto" if method == "mtp" and tree is None else DRAFT_MODEL_DEFAULT_G


def check_flags_early() -> None:
  """The flag ranges, before jax or a model loads (``decode.limits``).
  Raises DecodeError, one line naming the flag and its range."""
  from decode import limits
  num_draft_tokens = limits.parse_num_draft_tokens(
      _G.value if _G.value is not None else default_num_draft_tokens(_METHOD.value, _TREE.value))
  limits.check_counts(max_new_tokens=_MAX_NEW.value, num_samples=_NUM_SAMPLES.value,
                      seed=_SEED.value, repeats=_REPEATS.value, max_draft_tokens=_G_MAX.value)
  limits.check_sampling(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
  limits.check_overrides(_DTYPE.value, _ATTENTION.value)
  from decode.stops import StopConditions
  StopConditions(strings=tuple(_STOP.value)).validate(vocab_size=1)   # ids: against the model, later
  check_flag_pairs(num_draft_tokens)


def check_flag_pairs(num_draft_tokens) -> None:
  """The rules between flags that need no model, before jax loads: one
  source of prompts, --tree without --num_draft_tokens, the method's
  rules (``limits.check_flags``) and a writable --json file path. Raises
  DecodeError, one line naming the flags."""
  from decode import limits
  from decode.errors import DecodeError
  from mtp.cli import output_path_problem
  if sum(f.value is not None for f in (_PROMPT, _PROMPT_FILE, _CHAT)) != 1:
    raise DecodeError("give exactly one of --prompt, --prompt_file or --chat")
  for f in (_PROMPT, _CHAT):
    if f.value == "":
      raise DecodeError(f"--{f.name} (prompt 0) is empty: give at least one character")
  if _TREE.value is not None and flags.FLAGS["num_draft_tokens"].present:
    raise DecodeError("--tree and --num_draft_tokens exclude each other: a tree's depth (its "
                      "number of levels) takes the place of the draft length")
  limits.check_flags(_METHOD.value, num_draft_tokens, _TREE.value)
  if _TREE.value is not None:
    from decode.tree_spec import parse_tree          # numpy only; the depth is checked later
    try:
      parse_tree(_TREE.value)
    except ValueError as e:
      raise DecodeError(str(e)) from None
  if _METHOD.value == "draft" and not _DRAFT_WORKDIR.value:
    raise DecodeError("--method=draft needs --draft_workdir (a trained draft-model workdir)")
  if _JSON.value:
    folder = os.path.dirname(os.path.abspath(_JSON.value))
    if not os.path.isdir(folder):
      raise DecodeError(f"--json={_JSON.value!r}: directory {folder!r} does not exist")
    if os.path.isdir(_JSON.value):
      raise DecodeError(f"--json={_JSON.value!r} is a directory: give a file path for the report")
    if problem := output_path_problem(_JSON.value):
      raise DecodeError(f"--json={_JSON.value!r}: {problem}")


def main(argv):
  """Parses the flags into a ``DecodeRequest`` and runs it
  (``decode.cli.run.run``); writes --json. Returns the exit status: 0, 2
  (bad input or checkpoint: one line), 3 (NaN/inf logits) or
  ``EXIT_INTERRUPTED`` (Ctrl-C ended the decoding; the report says so). A
  KeyboardInterrupt before the decoding propagates (``reporting_interrupts``)."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)   # orbax logs every restore at INFO
  from decode.cli.run import (DecodeRequest, flag_notices, parse_num_draft_tokens, parse_stops,
                              read_prompts, run)
  from decode.decoder import DecodeError, NonFiniteLogitsError, SamplingParams
  from mtp.checkpoint import CheckpointError
  try:
    num_draft_tokens = parse_num_draft_tokens(
        _G.value if _G.value is not None else default_num_draft_tokens(_METHOD.value, _TREE.value))
    stops = parse_stops(_STOP.value, _STOP_IDS.value)
    check_flag_pairs(num_draft_tokens)       # again: main() is also called without the parser
    prompts = ([_PROMPT.value] if _PROMPT.value is not None else [_CHAT.value]
               if _CHAT.value is not None else read_prompts(_PROMPT_FILE.value))
    jsonl = bool(prompts) and isinstance(prompts[0], dict)
    given = {name for name in flags.FLAGS if flags.FLAGS[name].present}
    for note in flag_notices(method=_METHOD.value, given=given, temperature=_TEMPERATURE.value,
                             compare=_COMPARE.value, num_draft_tokens=num_draft_tokens):
      print(f"note: {note}", file=sys.stderr)
    report = run(DecodeRequest(
        _WORKDIR.value, prompts, method=_METHOD.value, num_draft_tokens=num_draft_tokens,
        max_draft_tokens=_G_MAX.value, draft_workdir=_DRAFT_WORKDIR.value,
        max_new_tokens=_MAX_NEW.value,
        sampling=SamplingParams(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value),
        num_samples=_NUM_SAMPLES.value, seed=_SEED.value, compare=_COMPARE.value,
        repeats=_REPEATS.value, tree=_TREE.value, stops=stops,
        chat=None if jsonl else _CHAT.value is not None, dtype=_DTYPE.value,
        attention_impl=_ATTENTION.value))
  except (DecodeError, CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except NonFiniteLogitsError as e:
    print(f"error: {e}", file=sys.stderr)
    return 3
  _write_json(report.to_json())
  return EXIT_INTERRUPTED if report.interrupted else 0


def reporting_interrupts(main):
  """``main(argv)`` as ``app.run`` calls it, with a Ctrl-C before the
  decoding (or a second one during it) reported: one line, the --json
  report ``{"interrupted": true, "results": []}``, status
  ``EXIT_INTERRUPTED``. That status ends the process at once (streams
  flushed, ``os._exit``: interpreter teardown while XLA compiles can
  segfault); any other is returned."""
  def guarded(argv):
    try:
      code = main(argv)
    except KeyboardInterrupt:
      print("interrupted: no result to report", file=sys.stderr)
      try:
        _write_json({"interrupted": True, "results": []})
      except OSError as e:        # a --json path not yet checked
        print(f"error: --json={_JSON.value!r}: {e.strerror}", file=sys.stderr)
      code = EXIT_INTERRUPTED
    if code == EXIT_INTERRUPTED:
      for stream in (sys.stdout, sys.stderr):
        try:
          stream.flush()
        except (OSError, ValueError):
          pass
      os._exit(EXIT_INTERRUPTED)
    return code
  return guarded


def _write_json(report: dict) -> None:
  """``--json``: ``report`` with its provenance (``"meta"``), if the flag is set."""
  if not _JSON.value:
    return
  from mtp import report as report_lib
  report["meta"] = report_lib.provenance(
      command="python -m decode " + shlex.join(sys.argv[1:]))   # shell-quoted, retypable
  from mtp.files import write_atomic
  write_atomic(_JSON.value, json.dumps(report, indent=2))


if __name__ == "__main__":
  from mtp.cli import flags_parser, main_guard
  main_guard(lambda _: app.run(reporting_interrupts(main),
                               flags_parser=flags_parser(check_flags_early)))
