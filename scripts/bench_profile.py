"""Round-cost breakdown: where the time of one decoding round goes, by the
named scope of the decoding code (scripts/bench_round.py).

A generation runs once under ``jax.profiler``; every XLA operation the CPU
runtime executed (one trace event per thunk) is attributed, through the
op_name metadata of the compiled program, to the named scope it came from
(draft/module<k>, draft/head, draft/sample, draft/buffers, verify/forward,
verify/head, verify/warp, accept, commit, rng; "loop" for the rest of the
loop body; prefill apart). The unprofiled round time comes from
``round_time_s``. ``profile_generation`` lowers ``Decoder``'s jitted
prefill and generate (``Decoder.lowered``) to read their HLO.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

import jax
import numpy as np

from decode.speculative import Decoder, SamplingParams
from mtp.timing import interleaved_times

_OP = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name="([^"]*)"')
_SCOPES = ("draft", "verify", "accept", "commit", "rng", "prefill")
_CONTAINERS = ("while", "conditional", "call")


def op_scopes(hlo_text: str) -> dict[str, str]:
  """{HLO instruction name: op_name metadata} for every instruction of a
  compiled program's text (``compiled.as_text()``)."""
  out = {}
  for line in hlo_text.splitlines():
    m = _OP.match(line)
    if m:
      out[m.group(1)] = m.group(2)
  return out


def piece_of(op_name: str) -> str:
  """The breakdown row of an op_name: the first scope of ``_SCOPES`` in its
  path, with the sub-scope for draft/ and verify/ (``draft/module1``);
  "loop" when it carries none."""
  parts = op_name.split("/")
  for i, part in enumerate(parts):
    if part in _SCOPES:
      if part in ("draft", "verify") and i + 1 < len(parts):
        return f"{part}/{parts[i + 1]}"
      return part
  return "loop"


def trace_events(trace_dir: str) -> list[dict]:
  """Complete ('X') events of the newest trace under ``trace_dir``."""
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
                 key=os.path.getmtime)
  if not files:
    raise RuntimeError(f"jax.profiler wrote no trace under {trace_dir}")
  with gzip.open(files[-1]) as f:
    return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def breakdown(events: list[dict], scopes: dict[str, str]) -> dict:
  """Aggregates thunk events by piece. Returns {"pieces": {piece: {"us": total
  microseconds, "ops": count}}, "prefill": {...}}: an operation belongs to
  the round when its op_name lies in the while_loop body, to "prefill" when
  it carries that scope; container thunks (while, conditional, call) are
  not counted themselves, only what runs inside them."""
  pieces: dict[str, dict] = collections.defaultdict(lambda: {"us": 0.0, "ops": 0})
  prefill = {"us": 0.0, "ops": 0}
  for e in events:
    name = e["name"]
    if name not in scopes or name.split(".")[0] in _CONTAINERS:
      continue
    op_name = scopes[name]
    if "prefill" in op_name.split("/"):
      prefill["us"] += e["dur"]
      prefill["ops"] += 1
    elif "/while/body/" in op_name:
      piece = piece_of(op_name.split("/while/body/", 1)[1])
      pieces[piece]["us"] += e["dur"]
      pieces[piece]["ops"] += 1
  return {"pieces": dict(pieces), "prefill": prefill}


def profile_generation(decoder: Decoder, prompts, max_new: int, sp: SamplingParams, seed: int,
                       trace_dir: str) -> tuple[dict, int]:
  """Runs one (already compiled) ``generate`` under the profiler; returns
  (breakdown, rounds) with rounds = target calls of the longest row."""
  state, prefill_len = decoder.prepare(prompts, max_new, seed)
  prefill, generate = decoder.lowered(state, prefill_len, sp)
  scopes = op_scopes(prefill.compile().as_text())
  scopes.update(op_scopes(generate.compile().as_text()))
  decoder.generate(prompts, max_new, sp, seed)        # warm (same shapes)
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0                    # device (thunk) events only
  jax.profiler.start_trace(trace_dir, profiler_options=options)
  try:
    gen = decoder.generate(prompts, max_new, sp, seed)
  finally:
    jax.profiler.stop_trace()
  return breakdown(trace_events(trace_dir), scopes), int(gen.target_calls.max())


def round_time_s(decoder: Decoder, prompts, max_new: int, sp: SamplingParams, repeats: int):
  """Median seconds per round of the decoding phase ((wall - prefill) /
  rounds) and median seconds per generation, without the profiler: one
  compiling generation (seed 0), then ``repeats`` generations with seeds
  0..repeats-1, timed by the decoder itself (``wall_time_s``,
  ``prefill_time_s``)."""
  seeds, gens = iter([0, *range(repeats)]), []

  def generate():
    gens.append(decoder.generate(prompts, max_new, sp, next(seeds)))
  interleaved_times({"generate": generate}, repeats, warmup=1)
  walls = [g.wall_time_s for g in gens[1:]]
  per_round = [(g.wall_time_s - g.prefill_time_s) / int(g.target_calls.max()) for g in gens[1:]]
  return float(np.median(per_round)), float(np.median(walls))


def round_breakdown(model, prompts, temperatures, gs, trees, max_new: int, repeats: int,
                    trace_root: str, log=print, tokenizer=None) -> list[dict]:
  """For every temperature: AR, MTP with each G in ``gs`` and each tree in
  ``trees`` (branching tuples), timed (``round_time_s``) and profiled once
  (``profile_generation``, traces under ``trace_root``). ``prompts``:
  encoded token arrays, one per row; ``tokenizer``: the model's tokenizer
  (required for a BPE model: ``mtp.tokenizer.load_tokenizer(workdir)``;
  its stop ids end rows). Returns one row per (T, decoder):
  temperature, num_draft_tokens (0: AR; tree depth for trees), tree ("b1,b2"
  or None), pieces {piece: {us_per_round, ops_per_round}},
  profiled_us_per_round, round_us, round_over_ar, draft_share,
  generation_s, rounds, prefill_us."""
  results = []
  for t in temperatures:
    sp = SamplingParams(temperature=t)
    ar_us = None
    for g, tree in [(0, None)] + [(g, None) for g in gs] + [(len(t), t) for t in trees]:
      kw = {"tokenizer": tokenizer} if tokenizer is not None else {}
      dec = (Decoder(model, "ar", **kw) if g == 0 else Decoder(model, "mtp", g, **kw)
             if tree is None else Decoder(model, "mtp", tree=tree, **kw))
      label = "AR" if g == 0 else f"G={g}" if tree is None else f"tree {','.join(map(str, tree))}"
      rnd_s, wall_s = round_time_s(dec, prompts, max_new, sp, repeats)
      bd, rounds = profile_generation(dec, prompts, max_new, sp, 0,
                                      os.path.join(trace_root, f"t{t}_{label.replace(' ', '_')}"))
      pieces = {p: {"us_per_round": v["us"] / rounds, "ops_per_round": v["ops"] / rounds}
                for p, v in bd["pieces"].items()}
      total = sum(v["us_per_round"] for v in pieces.values())
      draft = sum(v["us_per_round"] for p, v in pieces.items() if p.startswith("draft/"))
      ar_us = rnd_s * 1e6 if g == 0 else ar_us
      results.append({"temperature": t, "num_draft_tokens": g,
                      "tree": None if tree is None else ",".join(map(str, tree)), "pieces": pieces,
                      "profiled_us_per_round": total, "round_us": rnd_s * 1e6,
                      "round_over_ar": rnd_s * 1e6 / ar_us, "draft_share": draft / total,
                      "generation_s": wall_s, "rounds": rounds,
                      "prefill_us": bd["prefill"]["us"]})
      log(f"T={t:g} {label}: round {rnd_s * 1e6:.0f} us "
          f"({rnd_s * 1e6 / ar_us:.2f} AR steps), drafting {draft / total:.0%} of the "
          f"profiled round")
  return results
