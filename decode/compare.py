"""``python -m decode --compare``: the same prompts, seed and budget decoded
by AR and by the chosen method in interleaved repeats (``mtp.timing.
interleaved_times``, the order alternating, all after compilation), the
speedup as the method's tokens/s over AR's (new tokens per call over the
median wall time of each: at T > 0 the two emit different samples, which end
at EOS at other lengths, so walls alone are not comparable; at T = 0 the
outputs are the same and the ratio is that of the walls), and per prompt
category its own speedup (JSONL prompt files).
"""

from __future__ import annotations

import io
import types
from collections.abc import Sequence
from typing import TextIO

import numpy as np

from decode import stats as stats_lib
from decode.sampling import SamplingParams
from decode.speculative import Decoder
from decode.stops import StopConditions
from decode.texts import decode_texts
from mtp.timing import interleaved_times


def compare_with_ar(decoder: Decoder, gen, prompts: Sequence[str], *, method: str, repeats: int,
                    max_new_tokens: int, sampling: SamplingParams, num_samples: int, seed: int,
                    err: TextIO, stops: StopConditions | None = None, chat: bool = False,
                    systems: Sequence[str | None] | None = None,
                    ar: Decoder | None = None) -> dict:
  """``repeats`` interleaved AR / ``decoder`` runs of ``prompts`` (see
  ``decode.run.run``; ``gen``: the reported generation, whose tokens greedy
  AR must reproduce); writes both summaries and the speedup line to ``err``
  and returns the report keys ar_stats, speedup (tokens/s ratio),
  speedup_per_repeat, repeats, wall_times_s (seconds per call), new_tokens
  (per call, all rows) and tokens_per_s (per decoder). ``ar``: the AR decoder to time
  (default a new one; passing one reuses its compilations)."""
  ar = ar or Decoder(decoder.models()[0], "ar", tokenizer=decoder.tokenizer)
  kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, num_samples=num_samples, seed=seed,
            stops=stops, chat=chat, systems=systems)
  ar_gen = decode_texts(ar, prompts, warmup=True, **kw)       # compiles AR; not timed below
  times = {"ar": [], method: []}
  new_tokens = {"ar": [], method: []}

  def timed(name, dec):       # records the decoder's own wall time and new tokens of each call
    def call():
      g = decode_texts(dec, prompts, warmup=False, **kw)
      times[name].append(g.wall_time_s)
      new_tokens[name].append(int(sum(len(t) for t in g.tokens)))
    return call
  # interleaved, the order alternating (ar, method / method, ar) so that drift hits both alike
  interleaved_times({"ar": timed("ar", ar), method: timed(method, decoder)}, repeats, warmup=0)
  rate = {k: float(np.mean(new_tokens[k]) / np.median(times[k])) for k in times}
  ratios = [(nm / wm) / (na / wa) for na, wa, nm, wm in
            zip(new_tokens["ar"], times["ar"], new_tokens[method], times[method])]
  speedup = rate[method] / rate["ar"]
  ar_summary = stats_lib.summarize(ar_gen)
  same = all(np.array_equal(a, b) for a, b in zip(ar_gen.tokens, gen.tokens))
  err.write(stats_lib.format_summary("ar", ar_summary) + f"\n  seed {seed}\n")
  err.write(f"speedup over AR: {speedup:.2f}x (tokens/s, {rate[method]:.1f} vs {rate['ar']:.1f}: "
            f"new tokens over the median wall time of "
            f"{repeats} interleaved repeat{'s' if repeats != 1 else ''}, per repeat "
            f"{min(ratios):.2f}x-{max(ratios):.2f}x; same prompts and budget, after compilation"
            + ("; one repeat is noisy, see scripts/bench_decode.py" if repeats == 1 else "") + ")"
            + (f" (T > 0: {method} and AR sample different texts, {method} "
               f"{np.mean(new_tokens[method]):.0f} and AR {np.mean(new_tokens['ar']):.0f} new "
               "tokens over all prompts; many prompts or scripts/bench_decode.py average that out)"
               if sampling.temperature else
               " (greedy outputs identical)" if same else
               " (WARNING: greedy outputs differ; a float near-tie or a bug)") + "\n")
  return {"ar_stats": ar_summary, "speedup": speedup, "speedup_per_repeat": ratios,
          "repeats": repeats, "wall_times_s": times, "new_tokens": new_tokens,
          "tokens_per_s": rate}


def category_speedups(decoder: Decoder, gen, prompts: Sequence[str],
                      categories: Sequence[str | None], *, method: str, repeats: int,
                      max_new_tokens: int, sampling: SamplingParams, num_samples: int, seed: int,
                      stops: StopConditions | None = None, chat: bool = False,
                      systems: Sequence[str | None] | None = None) -> dict:
  """Per category (``categories[i]`` of prompt i) the speedup of
  ``compare_with_ar`` over that category's prompts as one batch (its rows of
  ``gen``, ``num_samples`` per prompt, are the reference tokens), with one
  AR decoder shared by all categories; its printed lines are dropped.
  Returns {category: speedup}."""
  speedups = {}
  ar = Decoder(decoder.models()[0], "ar", tokenizer=decoder.tokenizer)
  for cat, idx in stats_lib.group_rows(categories).items():
    sub = types.SimpleNamespace(tokens=[gen.tokens[i * num_samples + s] for i in idx
                                        for s in range(num_samples)])
    res = compare_with_ar(decoder, sub, [prompts[i] for i in idx], method=method,
                          repeats=repeats, max_new_tokens=max_new_tokens, sampling=sampling,
                          num_samples=num_samples, seed=seed, err=io.StringIO(), stops=stops,
                          chat=chat, systems=None if systems is None else
                          [systems[i] for i in idx], ar=ar)
    speedups[cat] = res["speedup"]
  return speedups
