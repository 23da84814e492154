r"""Top-p (nucleus) sampling on a real target: how many tokens the nucleus
holds, what the warp costs on each of its two paths, and what top-p costs a
whole decoding step (``scripts/bench_top_p.py``).

``decode.sampling`` ranks only the ``TOP_CANDIDATES[0]`` best tokens
(``jax.lax.top_k``), the ``TOP_CANDIDATES[1]`` best for a batch where a
row's nucleus may reach past those, and sorts the whole vocabulary only for
a batch past both. Whether that pays depends on the
target's distributions, so they are measured here: the target's next-token
logits along its own greedy answers to held-out chat prompts (one
cache-free forward over prompt + answer), the nucleus size of every answer
position at each temperature and top-p, the share of positions whose
nucleus fits in each tier of candidates, and the warp (``warped_probs``)
timed at a verify pass's shape [B, G + 1, V] on those rows with both tiers,
with the first tier alone (then the full sort), and with a full sort
(``candidates`` >= V), interleaved. End to end: AR and MTP
(``num_draft_tokens``) generations with top-p off and on, interleaved in
the same rounds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from decode import sampling
from decode.speculative import Decoder, SamplingParams
from mtp.timing import interleaved_times, spread


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
