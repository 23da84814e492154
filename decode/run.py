"""Library side of ``python -m decode``: load checkpoints, encode prompts,
decode (streaming when there is one prompt), compare with AR, report.

``run(...)`` returns the report dict that ``--json`` writes:
``{"config": {...}, "results": [{"prompt", "sample", "tokens", "text",
"stats"}, ...], "stats": {...}, "ar_stats": {...}, "speedup": float}``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

import jax
import numpy as np

from decode import stats as stats_lib
from decode.speculative import DecodeError, Decoder, SamplingParams
from mtp import checkpoint as ckpt_lib
from mtp import tokenizer as tok


def read_prompt_file(path: str) -> list[str]:
  """One prompt per line, taken literally (a prompt cannot contain a newline;
  use ``--prompt $'...'`` for one multi-line prompt). Blank lines are skipped.

  Raises DecodeError for a missing file, non-UTF-8 bytes (naming the line) or
  a file with no prompts.
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
    if text.strip():
      prompts.append(text)
  if not prompts:
    raise DecodeError(f"--prompt_file={path!r} holds no non-empty prompt line")
  return prompts


def encode_prompts(prompts: Sequence[str]) -> list[np.ndarray]:
  """[BOS] + UTF-8 bytes per prompt. Raises DecodeError for an empty prompt."""
  tk = tok.ByteTokenizer()
  out = []
  for i, p in enumerate(prompts):
    if not p:
      raise DecodeError(f"--prompt (prompt {i}) is empty: give at least one character")
    out.append(tk.encode(p, add_bos=True))
  return out


def load_decoder(workdir: str, method: str, num_draft_tokens: int,
                 draft_workdir: str | None = None) -> Decoder:
  """A Decoder for the checkpoint in ``workdir`` (and ``draft_workdir``).
  Raises CheckpointError / DecodeError."""
  _, target, _ = ckpt_lib.load_model(workdir)
  draft = None
  if method == "draft":
    if not draft_workdir:
      raise DecodeError("--method=draft needs --draft_workdir (a trained draft-model workdir)")
    _, draft, _ = ckpt_lib.load_model(draft_workdir)
  return Decoder(target, method, num_draft_tokens, draft)


def decode_texts(decoder: Decoder, prompts: Sequence[str], *, max_new_tokens: int,
                 sampling: SamplingParams, num_samples: int = 1, seed: int = 0,
                 warmup: bool = True, out: TextIO | None = None):
  """Decodes every prompt ``num_samples`` times in one batch (stream form).

  With one prompt and one sample, text is streamed to ``out`` as it is
  emitted. ``warmup`` first runs the same shapes once so timings exclude
  compilation. Returns the ``Generation``.
  """
  if not (isinstance(num_samples, int) and num_samples >= 1):
    raise DecodeError(f"--num_samples={num_samples!r} must be an integer >= 1")
  encoded = [p for p in encode_prompts(prompts) for _ in range(num_samples)]
  if warmup:
    decoder.stream(encoded, max_new_tokens, sampling, seed)
  on_tokens = None
  if out is not None and len(encoded) == 1:
    dec = tok.StreamDecoder()
    out.write(prompts[0])
    def on_tokens(row, ids):
      out.write(dec.push(ids))
      out.flush()
  gen = decoder.stream(encoded, max_new_tokens, sampling, seed, on_tokens=on_tokens)
  if on_tokens is not None:
    out.write(dec.flush() + "\n")
  return gen


def run(workdir: str, prompts: Sequence[str], *, method: str = "mtp", num_draft_tokens: int = 2,
        draft_workdir: str | None = None, max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(), num_samples: int = 1, seed: int = 0,
        compare: bool = False, out: TextIO | None = None) -> dict:
  """Everything ``python -m decode`` does (printing to ``out``, default
  stdout); returns the JSON report."""
  out = out or sys.stdout
  sampling.validate()
  decoder = load_decoder(workdir, method, num_draft_tokens, draft_workdir)
  gen = decode_texts(decoder, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                     num_samples=num_samples, seed=seed, out=out)
  tk = tok.ByteTokenizer()
  results = []
  for r, ids in enumerate(gen.tokens):
    results.append({"prompt": prompts[r // num_samples], "sample": r % num_samples,
                    "tokens": [int(t) for t in ids], "text": tk.decode(ids),
                    "stats": stats_lib.summarize(gen, [r])})
  summary = stats_lib.summarize(gen)
  if len(gen.tokens) > 1:
    for r, res in enumerate(results):
      out.write(f"--- prompt {r // num_samples} sample {res['sample']}: "
                f"{res['prompt']!r}\n{res['prompt']}{res['text']}\n")
  out.write(stats_lib.format_summary(method, summary) + "\n")
  report = {"config": {"workdir": workdir, "method": method, "num_draft_tokens": decoder.G,
                       "max_new_tokens": max_new_tokens, "temperature": sampling.temperature,
                       "top_k": sampling.top_k, "top_p": sampling.top_p,
                       "num_samples": num_samples, "seed": seed, "batch_size": len(gen.tokens),
                       "device": jax.devices()[0].device_kind},
            "results": results, "stats": summary}
  if compare and method != "ar":
    ar = Decoder(decoder.target(), "ar")
    ar_gen = decode_texts(ar, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                          num_samples=num_samples, seed=seed, out=None)
    ar_summary = stats_lib.summarize(ar_gen)
    report["ar_stats"] = ar_summary
    report["speedup"] = ar_gen.wall_time_s / gen.wall_time_s
    same = all(np.array_equal(a, b) for a, b in zip(ar_gen.tokens, gen.tokens))
    out.write(stats_lib.format_summary("ar", ar_summary) + "\n")
    out.write(f"speedup over AR (wall time, same prompts and budget, after compilation): "
              f"{report['speedup']:.2f}x"
              + ("" if sampling.temperature else
                 " (greedy outputs identical)" if same else
                 " (WARNING: greedy outputs differ; a float near-tie or a bug)") + "\n")
  return report

