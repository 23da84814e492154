r"""Top-p on a real target: nucleus sizes along its greedy answers, the warp
with ``jax.lax.top_k`` candidates vs a full vocabulary sort, and what top-p
costs a decoding step, side by side in one process.

    python -m experiments.bench_top_p --workdir runs/smollm_demo [--per_category 1] \
        [--answer_tokens 64] [--temperatures 0.7,1] [--top_ps 0.8,0.9,0.95] \
        [--warp_shapes 1x2,1x4,32x2] [--warp_repeats 20] \
        [--decode_top_ps 1,0.9] [--num_draft_tokens 1] [--decode_repeats 6] \
        [--max_new_tokens 64] [--out results/bench_top_p_smollm] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from decode import sampling
from decode.decoder import DecodeError, Decoder, SamplingParams
from experiments import common
from mtp import cli, loading, report
from mtp import tokenizer as tok_lib
from mtp.timing import interleaved_times, spread
from scripts import bench_chat


# -- the library: top-p on a real target ---------------------------------------------------
#
# Top-p (nucleus) sampling on a real target: how many tokens the nucleus
# holds, what the warp costs on each of its two paths, and what top-p costs a
# whole decoding step.
#
# ``decode.sampling`` ranks only the ``TOP_CANDIDATES[0]`` best tokens
# (``jax.lax.top_k``), the ``TOP_CANDIDATES[1]`` best for a batch where a
# row's nucleus may reach past those, and sorts the whole vocabulary only for
# a batch past both. Whether that pays depends on the
# target's distributions, so they are measured here: the target's next-token
# logits along its own greedy answers to held-out chat prompts (one
# cache-free forward over prompt + answer), the nucleus size of every answer
# position at each temperature and top-p, the share of positions whose
# nucleus fits in each tier of candidates, and the warp (``warped_probs``)
# timed at a verify pass's shape [B, G + 1, V] on those rows with both tiers,
# with the first tier alone (then the full sort), and with a full sort
# (``candidates`` >= V), interleaved. End to end: AR and MTP
# (``num_draft_tokens``) generations with top-p off and on, interleaved in
# the same rounds.

def answer_logits(model, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> np.ndarray:
  """float32 [N, V]: the target's next-token logits at every position of its
  greedy answers (the prompt's last position first), over all prompts."""
  dec = Decoder(model, "ar", tokenizer=tokenizer)
  rows = []
  for p in prompts:
    gen = dec.generate([list(p)], max_new_tokens, SamplingParams(temperature=0.0))
    ids = np.concatenate([np.asarray(p, np.int32), gen.tokens[0].astype(np.int32)])
    out = model(jnp.asarray(ids[None]))
    rows.append(np.asarray(out.logits[0, len(p) - 1:len(ids) - 1], np.float32))
  return np.concatenate(rows)


def nucleus_sizes(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
  """int64 [N]: tokens kept by top-p at ``temperature`` in each row (float64,
  the smallest prefix by decreasing probability whose mass reaches top_p)."""
  z = np.asarray(logits, np.float64) / temperature
  z -= z.max(-1, keepdims=True)
  p = np.exp(z)
  p /= p.sum(-1, keepdims=True)
  p = -np.sort(-p, axis=-1)
  before = np.cumsum(p, axis=-1) - p
  return (before < top_p).sum(-1)


def nucleus_stats(logits: np.ndarray, temperatures: Sequence[float], top_ps: Sequence[float],
                  candidates: Sequence[int] = sampling.TOP_CANDIDATES) -> list[dict]:
  """One row per (temperature, top_p): nucleus size spread and the share of
  positions whose nucleus fits in ``candidates[0]`` tokens
  (``fits_candidates``) and in ``candidates[1]`` (``fits_second_tier``)."""
  out = []
  for t in temperatures:
    for tp in top_ps:
      n = nucleus_sizes(logits, t, tp)
      out.append({"temperature": t, "top_p": tp, "positions": int(n.size),
                  "fits_candidates": float(np.mean(n <= candidates[0])),
                  "fits_second_tier": float(np.mean(n <= candidates[-1])),
                  **spread(n, ("median", "p90", "max"), "nucleus_")})
  return out


@functools.partial(jax.jit, static_argnames=("candidates",))
def _warp(logits, temperature, top_p, candidates):
  x = jnp.asarray(logits, jnp.float32)
  z = x - jnp.max(x, axis=-1, keepdims=True)
  z = z / temperature
  if candidates:                      # 0: top-p off, the softmax alone
    z = sampling._top_k_top_p(z, jnp.int32(0), top_p, candidates)
  return jax.nn.softmax(z, axis=-1)


def warp_times(logits: np.ndarray, shape: tuple[int, int], temperature: float, top_p: float,
               repeats: int, seed: int = 0) -> dict:
  """Seconds per warp of a [B, G + 1, V] block of real rows (drawn at random
  from ``logits``, a fresh block per round): with both tiers of candidates
  (``sampling.TOP_CANDIDATES``), with the first tier alone (its fallback is
  the full sort), with the full sort, and the softmax alone (top-p off),
  interleaved. Returns {path: spread of seconds} and the shares of blocks
  whose every row fit in the first tier and in the second."""
  rng = np.random.default_rng(seed)
  b, g1 = shape
  vocab = logits.shape[-1]
  blocks = [jnp.asarray(logits[rng.integers(0, len(logits), b * g1)].reshape(b, g1, vocab))
            for _ in range(repeats + 1)]
  sizes = [nucleus_sizes(np.asarray(x).reshape(-1, vocab), temperature, top_p) for x in blocks[1:]]
  t, p = jnp.float32(temperature), jnp.float32(top_p)
  calls = {"candidates": 0, "first_tier_only": 0, "full_sort": 0, "softmax_only": 0}

  def timed(path, cands, tp):
    def fn():
      x = blocks[calls[path]]
      calls[path] += 1
      jax.block_until_ready(_warp(x, t, tp, cands))
    return fn

  n1, n2 = sampling.TOP_CANDIDATES
  times = interleaved_times({"candidates": timed("candidates", sampling.TOP_CANDIDATES, p),
                             "first_tier_only": timed("first_tier_only", n1, p),
                             "full_sort": timed("full_sort", vocab, p),
                             "softmax_only": timed("softmax_only", 0, p)},
                            repeats)
  return {"shape": [b, g1, vocab], "temperature": temperature, "top_p": top_p,
          "blocks_fitting": float(np.mean([np.all(s <= n1) for s in sizes])),
          "blocks_fitting_second_tier": float(np.mean([np.all(s <= n2) for s in sizes])),
          **{f"{k}_s": spread(v, ("median", "min", "max")) for k, v in times.items()}}


def decode_times(model, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: float, top_ps: Sequence[float], num_draft_tokens: int,
                 repeats: int, log: Callable[[str], None] = print) -> list[dict]:
  """Tokens/s of AR and MTP G = ``num_draft_tokens`` at ``temperature``
  with each top-p, B = 1, while_loop form, every (decoder, top_p) cell
  timed in the same interleaved rounds after one untimed call per prompt
  (every prompt's shapes compiled; repeat r decodes prompt r mod
  len(prompts), seed r; ``num_draft_tokens`` 0: AR alone). One row per cell: tokens/s spread, and its ratio
  to the same decoder at the first of ``top_ps`` (1: top-p off), under the
  key "vs_top_p_off"."""
  decs = {"ar": Decoder(model, "ar", tokenizer=tokenizer)}
  if num_draft_tokens > 0:
    decs[f"mtp_G{num_draft_tokens}"] = Decoder(model, "mtp", num_draft_tokens, tokenizer=tokenizer)
  cells, counts, tokens = {}, {}, {}
  for label, dec in decs.items():
    for tp in top_ps:
      key = f"{label}@top_p={tp:g}"
      sp = SamplingParams(temperature=temperature, top_p=tp)
      counts[key], tokens[key] = 0, []

      def fn(key=key, dec=dec, sp=sp):
        r = counts[key]
        counts[key] += 1
        gen = dec.generate([list(prompts[r % len(prompts)])], max_new_tokens, sp, seed=r)
        tokens[key].append(len(gen.tokens[0]))
      cells[key] = fn
  warmup = len(prompts)            # every prompt's shapes compiled before the clock starts
  log(f"timing {len(cells)} cells x {repeats} rounds after {warmup} warm-up calls each")
  times = interleaved_times(cells, repeats, warmup=warmup)
  rows = []
  for key, secs in times.items():
    label, tp = key.split("@top_p=")
    n = np.asarray(tokens[key][warmup:], np.float64)   # the warm-up calls' tokens left out
    rate = n / secs
    base = times[f"{label}@top_p={top_ps[0]:g}"]
    base_rate = np.asarray(tokens[f"{label}@top_p={top_ps[0]:g}"][warmup:], np.float64) / base
    rows.append({"label": label, "temperature": temperature, "top_p": float(tp),
                 "tokens_per_s": spread(rate, ("median", "min", "max")),
                 "vs_top_p_off": spread(rate / base_rate, ("median", "min", "max"))})
  return rows


def markdown(result: dict, meta: dict) -> str:
  """The report's three tables (nucleus sizes, warp paths, decoding)."""
  from mtp.timing import format_spread
  n1, n2 = sampling.TOP_CANDIDATES
  lines = [f"# Top-p on {meta.get('workdir')}", "",
           f"`{meta.get('command')}`; commit {meta.get('commit')}, {meta.get('date')}, "
           f"{meta.get('cpu_model', '')} ({meta.get('cpu_count')} cores)", "",
           "## Nucleus size along the target's greedy answers", "",
           f"| T | top-p | positions | median | p90 | max | fits in {n1} | fits in {n2} |",
           "|---|---|---|---|---|---|---|---|"]
  for r in result["nucleus"]:
    lines.append(f"| {r['temperature']:g} | {r['top_p']:g} | {r['positions']} | "
                 f"{r['nucleus_median']:.0f} | {r['nucleus_p90']:.0f} | {r['nucleus_max']:.0f} | "
                 f"{r['fits_candidates']:.3f} | {r.get('fits_second_tier', float('nan')):.3f} |")
  lines += [] if not result["warp"] else ["", "## The warp on real rows, ms per call [min, max] (interleaved)", "",
            f"| [B, G+1, V] | T | top-p | blocks fitting {n1} / {n2} | {n1} then {n2} | {n1} alone "
            "| full sort | softmax only | full sort / candidates |",
            "|---|---|---|---|---|---|---|---|---|"]
  for r in result["warp"]:
    c, f, o = r["candidates_s"], r["full_sort_s"], r["softmax_only_s"]
    one = r.get("first_tier_only_s")
    lines.append(f"| {r['shape']} | {r['temperature']:g} | {r['top_p']:g} | {r['blocks_fitting']:.2f} / "
                 f"{r.get('blocks_fitting_second_tier', float('nan')):.2f} | "
                 f"{format_spread(c, '.2f', 1e3)} | {format_spread(one, '.2f', 1e3) if one else '-'} | "
                 f"{format_spread(f, '.2f', 1e3)} | "
                 f"{format_spread(o, '.2f', 1e3)} | {f['median'] / c['median']:.1f}x |")
  if result.get("decode"):
    first = result["decode"][0]["top_p"]
    lines += ["", "## Decoding, B = 1, while_loop form (interleaved)", "",
              f"| decoder | T | top-p | tokens/s [min, max] | vs top-p {first:g} [min, max] |",
              "|---|---|---|---|---|"]
    for r in result["decode"]:
      lines.append(f"| {r['label']} | {r['temperature']:g} | {r['top_p']:g} | "
                   f"{format_spread(r['tokens_per_s'], '.1f')} | {format_spread(r['vs_top_p_off'], '.3f')} |")
  return "\n".join(lines) + "\n"


# -- command line --------------------------------------------------------------------------

def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--workdir", required=True, help="target (with MTP modules for the MTP rows)")
  ap.add_argument("--prompt_file", default=bench_chat.chat_lib.HELDOUT_CHAT_PATH,
                  help="chat JSONL ({prompt, category, system})")
  ap.add_argument("--per_category", type=int, default=1, help="prompts per category, >= 1")
  ap.add_argument("--answer_tokens", type=int, default=64,
                  help="greedy answer tokens per prompt whose logits are measured, >= 1")
  ap.add_argument("--temperatures", default="0.7,1", help="comma list of temperatures > 0")
  ap.add_argument("--top_ps", default="0.8,0.9,0.95", help="comma list of top-p in (0, 1]")
  ap.add_argument("--warp_shapes", default="1x2,1x4,32x2",
                  help="comma list of BxROWS warp blocks (a verify pass: B x (G + 1))")
  ap.add_argument("--warp_repeats", type=int, default=20, help="interleaved warp rounds, >= 0 (0: no warp rows)")
  ap.add_argument("--decode_temperature", type=float, default=1.0, help="temperature > 0")
  ap.add_argument("--decode_top_ps", default="1,0.9",
                  help="comma list of top-p for the decoding rows; the first is the baseline")
  ap.add_argument("--num_draft_tokens", type=int, default=1, help="G of the MTP rows (0: AR only)")
  ap.add_argument("--decode_repeats", type=int, default=6,
                  help="interleaved decoding rounds, >= 0 (0: no decoding rows)")
  ap.add_argument("--max_new_tokens", type=int, default=64, help="decoding budget, >= 1")
  ap.add_argument("--out", default="results/bench_top_p", help="output prefix (OUT.json, OUT.md)")
  ap.add_argument("--quick", action="store_true",
                  help="fills in --answer_tokens 8 --warp_shapes 1x2 --warp_repeats 2 "
                       "--decode_repeats 1 --max_new_tokens 8 --temperatures 1 --top_ps 0.9 "
                       "where not given")
  args = ap.parse_args(argv)
  if args.quick:
    cli.apply_quick(ap, args, answer_tokens=8, warp_shapes="1x2", warp_repeats=2,
                    decode_repeats=1, max_new_tokens=8, temperatures="1", top_ps="0.9")
  cli.check_range(ap, args, per_category=1, answer_tokens=1, warp_repeats=0, decode_repeats=0,
                  max_new_tokens=1, num_draft_tokens=0)
  cli.check_output_path("out", args.out, "prefix")
  temps = cli.parse_list(ap, "temperatures", args.temperatures, float, 0.0, lo_open=True)
  top_ps = cli.parse_list(ap, "top_ps", args.top_ps, float, 0.0, 1.0, lo_open=True)
  decode_top_ps = cli.parse_list(ap, "decode_top_ps", args.decode_top_ps, float, 0.0, 1.0,
                                 lo_open=True)
  if not (math.isfinite(args.decode_temperature) and args.decode_temperature > 0):
    ap.error(f"--decode_temperature={args.decode_temperature}: must be a finite number > 0")
  try:
    shapes = [tuple(int(v) for v in s.lower().split("x"))
              for s in cli.list_items(ap, "warp_shapes", args.warp_shapes)]
  except ValueError:
    shapes = []
  if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
    ap.error(f"--warp_shapes={args.warp_shapes!r} must be a comma list of BxROWS, both >= 1")

  load_before = os.getloadavg()
  _, model, _ = loading.load_model(args.workdir)
  tokenizer = tok_lib.load_tokenizer(args.workdir)
  prompts = [p for ps in bench_chat.heldout_prompts(args.prompt_file, tokenizer,
                                                    args.per_category).values() for p in ps]
  print(f"{len(prompts)} held-out prompts; greedy answers of {args.answer_tokens} tokens", flush=True)
  logits = answer_logits(model, tokenizer, prompts, args.answer_tokens)
  result = {"nucleus": nucleus_stats(logits, temps, top_ps), "warp": [], "decode": []}
  for r in result["nucleus"]:
    print(f"T={r['temperature']:g} top_p={r['top_p']:g}: nucleus median {r['nucleus_median']:.0f}, "
          f"max {r['nucleus_max']:.0f}; fits {r['fits_candidates']:.3f} / "
          f"{r['fits_second_tier']:.3f}", flush=True)
  for shape in (shapes if args.warp_repeats else []):
    for t in temps:
      for tp in top_ps:
        w = warp_times(logits, shape, t, tp, args.warp_repeats)
        print(f"warp {w['shape']} T={t:g} top_p={tp:g}: candidates "
              f"{w['candidates_s']['median'] * 1e3:.2f} ms, first tier alone "
              f"{w['first_tier_only_s']['median'] * 1e3:.2f} ms, full sort "
              f"{w['full_sort_s']['median'] * 1e3:.2f} ms", flush=True)
        result["warp"].append(w)
  if args.decode_repeats:
    result["decode"] = decode_times(
        model, tokenizer, prompts, args.max_new_tokens, args.decode_temperature, decode_top_ps,
        args.num_draft_tokens, args.decode_repeats, log=lambda m: print(m, flush=True))
  meta = report.provenance(command=common.command_line(__file__, argv), workdir=args.workdir,
                           settings=vars(args), load_average_before=load_before,
                           load_average=os.getloadavg(), logits_rows=int(logits.shape[0]))
  report.write_report(args.out, meta, result, markdown(result, meta))
  print(f"wrote {args.out}.json and {args.out}.md")
  return 0


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError, ValueError))
