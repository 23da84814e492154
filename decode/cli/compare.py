"""``python -m decode --compare``: AR and the chosen method on the same
prompts, seed and budget in interleaved repeats after compilation; each
method's repeats as medians (min-max) of tokens/s, TTFT and ITL; speedup =
ratio of the two blocks' median tokens/s (new tokens per call over the
median wall). Beside it Theorem 3.8's prediction tau / (G c + 1) from the
printed figures (r = G c + 1 = the blocks' seconds per round ratio, c = (r
- 1) / G) and a verdict line; per prompt category its own speedup. At T =
0 a differing row reports the first differing index and the target's top-2
logit gap against the numeric contract's bound (docs/speculative_sampling.md):
below it a near-tie, at or above it a bug.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import types
from collections.abc import Sequence
from typing import TextIO

import numpy as np

from decode.cli import stats as stats_lib
from decode.cli import theory
from decode.sampling import SamplingParams
from decode.decoder import Decoder
from decode.stops import StopConditions
from decode.cli.texts import encode_prompts, encode_rows
from mtp.timing import interleaved_times

# a prediction this far outside the per-repeat range (printed with two
# decimals) counts as disagreeing with the measurement
AGREEMENT_SLACK = 0.01


# -- the numeric contract: where greedy outputs differ ---------------------------

# unit roundoff u (half the spacing of the numbers near 1) of each float format
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


# bfloat16 / float16: D in units of the largest logit's ulp (2 u |z|)
ULPS_16BIT = 8


def logit_error_bound(dtype: str, *, scale: float, layers: int, length: int,
                      max_logit: float) -> float:
  """The bound D on |z^A_v - z^B_v| between two computations of the
  target's logit z_v at one position in ``dtype`` (docs/speculative_sampling.md,
  "Numeric contract"). float32: D = 4 L u sqrt(n) scale, u = 2^-24, L =
  ``layers``, n = ``length`` (positions attended over), ``scale`` = ||h||
  max_v ||W_v||. bfloat16 / float16: D = ``ULPS_16BIT`` ulps of the largest
  logit ``max_logit``, 2 u |z|_max each (u = 2^-8 for bfloat16). Raises
  ValueError for another dtype."""
  if dtype not in UNIT_ROUNDOFF:
    raise ValueError(f"dtype={dtype!r}: no numeric contract; one of {sorted(UNIT_ROUNDOFF)}")
  u = UNIT_ROUNDOFF[dtype]
  if dtype == "float32":
    return 4 * layers * u * math.sqrt(max(length, 1)) * scale
  return ULPS_16BIT * 2 * u * abs(max_logit)


def near_tie(logits, *, dtype: str, scale: float, layers: int, length: int) -> dict:
  """Whether a greedy disagreement at one position is allowed by the numeric
  contract: two computations with different argmaxes leave every other a
  top-1 minus top-2 gap <= 2 D, so a gap below ``bound`` = 2 D
  (``logit_error_bound``) is a near-tie, at or above it a bug. ``logits``:
  the target's logits [V] there (non-finite ids left out). Returns {"dtype",
  "gap", "bound", "near_tie", "top2_ids" [top-1, top-2], "logit_scale",
  "max_logit", "line" (the printed verdict)}."""
  z = np.asarray(logits, np.float64).reshape(-1)
  finite = np.isfinite(z)
  z = np.where(finite, z, -np.inf)
  order = np.argsort(-z, kind="stable")
  top1, top2 = int(order[0]), int(order[1])
  gap = float(z[top1] - z[top2])
  max_logit = float(np.abs(z[finite]).max()) if finite.any() else 0.0
  bound = 2.0 * logit_error_bound(dtype, scale=scale, layers=layers, length=length,
                                  max_logit=max_logit)
  near = bool(gap < bound)
  line = (f"near-tie: top-2 gap {gap:.3g} < bound {bound:.3g} ({dtype})" if near else
          f"greedy outputs differ at a top-2 gap {gap:.3g} >= bound {bound:.3g} ({dtype}): "
          "a bug")
  return {"dtype": dtype, "gap": gap, "bound": bound, "near_tie": near,
          "top2_ids": [top1, top2], "logit_scale": float(scale), "max_logit": max_logit,
          "line": line}


def first_difference(a, b) -> int | None:
  """The first token index where sequences ``a`` and ``b`` differ (the
  shorter one's length when it is a prefix of the longer); None when equal."""
  a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
  n = min(len(a), len(b))
  diff = np.flatnonzero(a[:n] != b[:n])
  if diff.size:
    return int(diff[0])
  return None if len(a) == len(b) else n


def target_logits_at(target, ids) -> tuple[np.ndarray, float]:
  """The target's logits [V] (float32) for the token after ``ids`` (the
  common prefix: prompt and the tokens both outputs share) from one
  cache-free forward in the target's own dtype, and that position's logit
  scale ||h|| max_v ||W_v|| (``logit_error_bound``). The forward runs over
  ``ids`` padded to ``kv_cache.bucket`` (causal: the padding is not seen),
  one compiled program per bucket."""
  import jax.numpy as jnp
  from decode import kv_cache
  n = len(ids)
  length = max(n, min(kv_cache.bucket(n), target.cfg.max_seq_len))
  tokens = np.zeros((1, length), np.int32)
  tokens[0, :n] = np.asarray(ids, np.int32)
  logits, h_norm = _last_logits_program()(target, jnp.asarray(tokens), jnp.int32(n - 1))
  w = (target.embed.embedding[...] if target.cfg.tie_embeddings
       else target.lm_head.kernel[...].T)
  w_norm = float(jnp.linalg.norm(w.astype(jnp.float32), axis=-1).max())
  return np.asarray(logits, np.float32), float(h_norm) * w_norm


@functools.cache
def _last_logits_program():
  """``(target, tokens [1, T] int32, last int32) -> (logits [V], ||final_norm(h)||
  float32)`` at position ``last`` of a cache-free forward, under ``nnx.jit``."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  def last_logits(target, tokens, last):
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    h0, _ = target.backbone(tokens, positions)
    h = jax.lax.dynamic_slice_in_dim(h0, last, 1, axis=1)
    return target.head(h)[0, 0], jnp.linalg.norm(target.final_norm(h).astype(jnp.float32))
  return nnx.jit(last_logits)


def greedy_check(target, prompt_ids: Sequence, method_tokens: Sequence, ar_tokens: Sequence,
                 *, num_samples: int = 1) -> dict:
  """Greedy (T = 0) outputs of a method and of AR, row by row (row r is
  prompt r // ``num_samples``, ``prompt_ids`` its token ids). Returns
  {"identical": bool, "mismatches": [per differing row {"row", "index"
  (first differing token), "method_token", "ar_token" (None past a row's
  end), and ``near_tie``'s keys for the target's logits after the common
  prefix (``target_logits_at``, in the target's dtype)}], "bug": any
  mismatch at a gap >= the bound}."""
  cfg = target.cfg
  mismatches = []
  for r, (m, a) in enumerate(zip(method_tokens, ar_tokens)):
    i = first_difference(m, a)
    if i is None:
      continue
    prefix = np.concatenate([np.asarray(prompt_ids[r // num_samples], np.int32).reshape(-1),
                             np.asarray(a[:i], np.int32).reshape(-1)])
    logits, scale = target_logits_at(target, prefix)
    verdict = near_tie(logits, dtype=cfg.dtype, scale=scale, layers=cfg.num_layers,
                       length=len(prefix))
    pick = lambda t: int(t[i]) if i < len(t) else None
    mismatches.append({"row": r, "index": i, "method_token": pick(m), "ar_token": pick(a),
                       **verdict})
  return {"identical": not mismatches, "mismatches": mismatches,
          "bug": any(not x["near_tie"] for x in mismatches)}


def greedy_check_lines(check: dict, method: str) -> list[str]:
  """One line per differing row: where (row, token index, the two tokens)
  and the verdict (``near_tie``'s line)."""
  return [f"greedy outputs of {method} and AR differ at row {x['row']}, token {x['index']} "
          f"({method} {x['method_token']}, ar {x['ar_token']}): {x['line']}"
          for x in check["mismatches"]]


def _span(values) -> dict:
  """{"median", "min", "max"} of a list of numbers (None values left out;
  all None when nothing is left)."""
  v = [float(x) for x in values if x is not None]
  if not v:
    return {"median": None, "min": None, "max": None}
  return {"median": float(np.median(v)), "min": min(v), "max": max(v)}


def _rounds(gen) -> int:
  """Batched rounds of a generation's decoding phase: the most target
  calls of any row (a round advances every active row at once)."""
  return int(np.max(gen.target_calls)) if len(gen.target_calls) else 0


def pooled_acceptance(gens: Sequence) -> dict:
  """tau, alpha_k and the mean drafted length G over all rounds of ``gens``
  (one method's timed repeats; ``decode.cli.stats``'s definitions):
  {"mean_accepted_length", "acceptance_rate_per_position",
  "mean_draft_tokens" (drafted tokens per target call), "tokens",
  "target_calls", "drafted_tokens", "tau" = tokens / target_calls (the
  printed tau), "emitted_per_round" (tau's old name)}."""
  hist = sum(np.asarray(g.accepted_histogram, np.int64).sum(0) for g in gens)
  calls = int(sum(int(np.sum(g.target_calls)) for g in gens))
  tokens = int(sum(len(t) for g in gens for t in g.tokens))
  verified = float((hist * (np.arange(len(hist)) + 1)).sum())
  first = gens[0]
  if first.position_tested is not None:          # "auto": rounds had different G
    tested = sum(np.asarray(g.position_tested).sum(0) for g in gens)
    passed = sum(np.asarray(g.position_accepted).sum(0) for g in gens)
    alphas = [float(p / t) if t else None for p, t in zip(passed, tested)]
  else:
    alphas = stats_lib.acceptance_rates(hist)
  if first.draft_length_histogram is not None:
    lengths = sum(np.asarray(g.draft_length_histogram, np.int64).sum(0) for g in gens)
    mean_g = float((lengths * np.arange(len(lengths))).sum() / max(lengths.sum(), 1))
  elif first.tree is not None:
    from decode.tree_spec import TreeSpec
    mean_g = float(TreeSpec(first.tree).num_nodes)
  else:
    mean_g = float(first.num_draft_tokens)
  return {"mean_accepted_length": verified / calls if calls else None,
          "acceptance_rate_per_position": alphas, "mean_draft_tokens": mean_g,
          "emitted_per_round": tokens / calls if calls else None,
          "tau": tokens / calls if calls else None, "tokens": tokens, "target_calls": calls,
          "drafted_tokens": round(mean_g * calls)}


def timed_summary(gens: Sequence) -> dict:
  """One method's timed repeats (``Generation`` each, in order) as the
  ``--compare`` block and the report's ``timed`` entry: repeats, new_tokens
  (per call), tokens_per_s / ttft_s / itl_p50_s / itl_p90_s / wall_time_s /
  round_s / decode_tokens_per_s / prefill_share as {"median", "min", "max"},
  rounds, rounds_span, rounds_mean and ``pooled_acceptance``'s keys.
  tokens_per_s's median = new tokens per call / median wall; round_s =
  (wall - prefill) / batched rounds, seconds."""
  walls = [float(g.wall_time_s) for g in gens]
  news = [int(sum(len(t) for t in g.tokens)) for g in gens]
  rates = [n / w for n, w in zip(news, walls) if w > 0]
  s = [stats_lib.summarize(g) for g in gens]
  tps = _span(rates)
  if tps["median"] is not None:
    tps["median"] = float(np.mean(news) / np.median(walls))
  decode_s = [g.wall_time_s - g.prefill_time_s for g in gens]
  return {"repeats": len(gens), "new_tokens": float(np.mean(news)), "tokens_per_s": tps,
          "ttft_s": _span(x["ttft_s"] for x in s), "itl_p50_s": _span(x["itl_p50_s"] for x in s),
          "itl_p90_s": _span(x["itl_p90_s"] for x in s), "wall_time_s": _span(walls),
          "round_s": _span(d / _rounds(g) if _rounds(g) and d > 0 else None
                           for d, g in zip(decode_s, gens)),
          "decode_tokens_per_s": _span(x["decode_tokens_per_s"] for x in s),
          "prefill_share": _span(g.prefill_time_s / g.wall_time_s if g.wall_time_s > 0 else None
                                 for g in gens),
          "rounds": float(np.median([_rounds(g) for g in gens])),
          "rounds_span": _span(_rounds(g) for g in gens),
          "rounds_mean": float(np.mean([_rounds(g) for g in gens])), **pooled_acceptance(gens)}


# c = (round / AR step - 1) / G is printed only where the timed rounds drafted
# at least this many tokens per target call on average: below it a round's
# timing noise (a few % of an AR step) divided by G swamps c (seen: c = 8.10
# from 2 drafted tokens in 126 rounds)
MIN_DRAFTED_PER_ROUND = 0.25


def predict_speedup(*, tau: float, alphas: Sequence[float | None] | None,
                    mean_draft_tokens: float, round_s: float, ar_step_s: float,
                    form: str = "chain", drafted_tokens: int | None = None,
                    rounds: int | None = None) -> dict:
  """Theorem 3.8's speedup tau / r, r = round_s / ar_step_s = G c + 1 (both
  in seconds), from tau (tokens per target call) and G (drafted tokens per
  target call); c = (r - 1) / G, None where G < ``MIN_DRAFTED_PER_ROUND``.
  ``alphas`` is unused. ``form``: "chain", "auto" or "tree". Returns
  {"form", "tau", "draft_tokens" (G), "round_ar_steps" (r), "round_s",
  "ar_step_s", "cost_ratio" (c or None), "drafted_tokens", "rounds",
  "predicted_speedup"} (1 when G = 0)."""
  del alphas                      # tau is measured: chain_tau(alphas) would count cut rounds whole
  r = float(round_s) / float(ar_step_s)
  out = {"form": form, "tau": float(tau), "draft_tokens": float(mean_draft_tokens),
         "round_ar_steps": r, "round_s": float(round_s), "ar_step_s": float(ar_step_s),
         "drafted_tokens": drafted_tokens, "rounds": rounds}
  if mean_draft_tokens <= 0:
    return {**out, "draft_tokens": 0.0, "cost_ratio": None, "predicted_speedup": 1.0}
  c = (theory.cost_ratio_from_round(r, mean_draft_tokens)
       if mean_draft_tokens >= MIN_DRAFTED_PER_ROUND else None)
  predicted = (theory.speedup_from_tau(tau, mean_draft_tokens, c) if c is not None
               else float(tau) / r)
  return {**out, "cost_ratio": c, "predicted_speedup": float(predicted)}


def _c_text(p: dict) -> str:
  """c as printed: "c 0.455", or "c n/a (drafted N tokens in R rounds: ...)"."""
  if p["cost_ratio"] is not None:
    return f"c {p['cost_ratio']:.3f}"
  drafted = ("" if p.get("drafted_tokens") is None else
             f"drafted {p['drafted_tokens']} tokens in {p['rounds']} target calls: ")
  return (f"c n/a ({drafted}under {MIN_DRAFTED_PER_ROUND} per call, too few drafts to "
          "measure c)")


def _g_text(g: float) -> str:
  return f"{g:.0f}" if float(g).is_integer() else f"{g:.2f}"


def prediction_line(p: dict) -> str:
  """The printed prediction: Theorem 3.8's formula with every input in it,
  each one a figure of the blocks above: tau and G from the method's block,
  r = round / AR step from the two blocks' median seconds per round,
  c = (r - 1) / G."""
  if p["draft_tokens"] == 0:
    return ("predicted by Theorem 3.8: 1.00x (G = 0: the timed rounds were plain AR "
            "steps)")
  what = {"chain": "G", "auto": "mean G", "tree": "N nodes"}.get(p["form"], "G")
  g_text = _g_text(p["draft_tokens"])
  rounds = (f"r = round {p['round_s'] * 1e3:.3f} ms / AR step {p['ar_step_s'] * 1e3:.3f} ms "
            f"= {p['round_ar_steps']:.3f}, the blocks' medians")
  if p["cost_ratio"] is None:
    return (f"predicted by Theorem 3.8 (decode.cli.theory.speedup_from_tau): "
            f"{p['predicted_speedup']:.2f}x = tau {p['tau']:.3f} / r, {rounds} "
            f"(= {what} {g_text} x c + 1); {_c_text(p)}")
  return (f"predicted by Theorem 3.8 (decode.cli.theory.speedup_from_tau): "
          f"{p['predicted_speedup']:.2f}x = tau {p['tau']:.3f} / ({what} {g_text} x "
          f"c {p['cost_ratio']:.3f} + 1), c = (r - 1) / {what}, {rounds}")


def verdict_line(p: dict, measured: float, lo: float, hi: float, *,
                 decode_speedup: float | None = None,
                 prefill_share: tuple[float, float] | None = None,
                 emitted_per_round: float | None = None, method: str = "mtp",
                 auto_repeats: tuple[int, int, float, float] | None = None) -> str:
  """One line naming the term that decides the result: whether tau exceeds r
  = G c + 1 (drafting pays iff tau > r; ``p``: ``predict_speedup``'s dict),
  the prediction beside the measured speedup and its range [lo, hi], and
  outside that range the term it leaves out: rounds emitting fewer tokens
  than tau (``decode_speedup``, ``emitted_per_round``) or the prefill and
  per-call work (``prefill_share``: (method, AR)). ``auto_repeats``: (repeats
  that drafted, repeats, lowest and highest per-repeat prediction); when
  "auto" drafted in some repeats only, the line says so (the pooled tau and r
  mix drafting and AR repeats). Pure."""
  pred = p["predicted_speedup"]
  measured_text = f"measured {measured:.2f}x ({lo:.2f}-{hi:.2f}x)"
  if p["draft_tokens"] == 0:
    head = (f"{method} ran plain AR steps (auto: drafting does not pay at the measured costs, "
            "this batch and budget)")
  else:
    tau, r, c = p["tau"], p["round_ar_steps"], p["cost_ratio"]
    per = (f"(c = {c:.3f} per {'drafted node' if p['form'] == 'tree' else 'draft token'})"
           if c is not None else f"({_c_text(p)})")
    head = (f"tau {tau:.3f} over a round of {r:.3f} AR steps {per}: drafting pays here"
            if round(tau, 3) > round(r, 3) else      # as printed, so the line reads true
            f"tau {tau:.3f} but a round costs {r:.3f} AR steps {per}: drafting does not pay "
            "here")
  line = f"{head}; predicted {pred:.2f}x, {measured_text}"
  if auto_repeats is not None and 0 < auto_repeats[0] < auto_repeats[1]:
    drafted, n, p_lo, p_hi = auto_repeats
    line += (f" (auto drafted in {drafted} of {n} repeats: the pooled tau and round mix "
             f"them; per-repeat predictions {p_lo:.2f}-{p_hi:.2f}x)")
  if lo - AGREEMENT_SLACK <= pred <= hi + AGREEMENT_SLACK:
    return line
  line += "; outside the measured range:"
  gap_rounds = (abs(math.log(pred / decode_speedup))
                if decode_speedup and decode_speedup > 0 and pred > 0 else None)
  gap_prefill = (abs(math.log(decode_speedup / measured))
                 if decode_speedup and decode_speedup > 0 and measured > 0 else None)
  if gap_rounds is None:
    return line + " the prediction counts the decoding phase only"
  alone = f"decoding phase alone {decode_speedup:.2f}x"
  if gap_prefill is not None and gap_prefill > gap_rounds:
    share = (f"{method} {prefill_share[0]:.0%} of its wall, AR {prefill_share[1]:.0%}; "
             if prefill_share else "")
    return (line + " the prefill and per-call work decide it, which the prediction leaves out "
            f"({share}{alone})")
  if pred > decode_speedup:
    if emitted_per_round is not None and emitted_per_round < p["tau"] - 0.005:
      return (line + f" rounds emit fewer tokens than tau ({emitted_per_round:.2f} per "
              f"row and batched round vs tau {p['tau']:.2f}: a batch waits for its slowest "
              f"row; {alone})")
    return (line + f" the decoding phase ran slower than its rounds predict ({alone}: a batch "
            "waits for its slowest row, the repeats differ, or a busy machine)")
  return (line + f" the decoding phase ran faster than its rounds predict ({alone}: the "
          "repeats differ, a busy machine, or auto drafting in some repeats and not in others)")


def format_timed(name: str, t: dict) -> str:
  """The ``--compare`` block of one method's timed repeats (``timed_summary``):
  median (min-max) of tokens/s, wall, TTFT, ITL p50/p90, the decoding
  phase's seconds per round and batched rounds per call, and for a method
  that drafts tau = tokens / target calls over all repeats (both printed),
  alpha_k and G, the drafted tokens per target call."""
  def span(s, scale=1.0, fmt=".1f", unit=""):
    if s["median"] is None:
      return "n/a"
    f = lambda x: format(x * scale, fmt)
    if t["repeats"] == 1:                      # one value: no spread to show
      return f"{f(s['median'])}{unit}"
    return f"{f(s['median'])}{unit} ({f(s['min'])}-{f(s['max'])})"
  ms = lambda s: span(s, 1e3, ".2f", " ms")
  n = t["repeats"]
  lines = [f"[{name}] timed: median (min-max) over {n} interleaved repeats" if n != 1 else
           f"[{name}] timed: one repeat (no spread; --repeats 3 or more gives medians)",
           f"  throughput {span(t['tokens_per_s'], unit=' tok/s')}  wall {ms(t['wall_time_s'])}  "
           f"new tokens {t['new_tokens']:.0f} per call",
           f"  TTFT {ms(t['ttft_s'])}  ITL p50 {ms(t['itl_p50_s'])}  p90 {ms(t['itl_p90_s'])}"]
  lo, hi = (t["rounds_span"]["min"], t["rounds_span"]["max"]) if "rounds_span" in t else (0, 0)
  rounds = (f"{t['rounds_mean']:.1f} rounds per call (mean; {lo:.0f}-{hi:.0f})"
            if "rounds_mean" in t and n != 1 else f"{t['rounds']:.0f} rounds per call")
  lines.append(f"  decoding phase: {span(t['round_s'], 1e3, '.3f', ' ms')} per round, {rounds}")
  if t.get("form", "ar") != "ar" or t["mean_draft_tokens"]:
    alphas = ", ".join("n/a" if a is None else f"{a:.3f}"
                       for a in t["acceptance_rate_per_position"])
    tau = t.get("tau", t["emitted_per_round"])
    tau_text = ("n/a" if tau is None else
                f"{tau:.3f} = {t['tokens']} tokens / {t['target_calls']} target calls")
    what = "nodes" if t.get("form") == "tree" else "G"
    lines.append(f"  tau {tau_text} over the {n} repeat{'s' if n != 1 else ''} (each call "
                 f"emits its accepted drafts + 1), alpha {alphas}, {what} "
                 f"{t['mean_draft_tokens']:.2f} drafted per call")
  return "\n".join(lines)


def _round_s(gen) -> float | None:
  """Seconds per batched round of a generation's decoding phase."""
  d, r = gen.wall_time_s - gen.prefill_time_s, _rounds(gen)
  return d / r if r and d > 0 else None


def prediction_of(method_gens: Sequence, ar_gens: Sequence, form: str) -> list[float]:
  """``predict_speedup`` per timed repeat, from that repeat's own tau,
  drafted length and round cost over the AR step timed beside it (with
  "auto" one repeat may draft and the next run AR; a burst of load hits
  one repeat): the predicted speedups, in repeat order (repeats without
  decoding-phase times left out)."""
  preds = []
  for gm, ga in zip(method_gens, ar_gens):
    acc, rm, ra = pooled_acceptance([gm]), _round_s(gm), _round_s(ga)
    if rm and ra and acc["tau"] is not None:
      preds.append(predict_speedup(
          tau=acc["tau"], alphas=None, mean_draft_tokens=acc["mean_draft_tokens"],
          round_s=rm, ar_step_s=ra, form=form)["predicted_speedup"])
  return preds


def block_prediction(m: dict, a: dict, form: str) -> dict | None:
  """``predict_speedup`` from the two printed blocks (``timed_summary``'s
  dicts of the method ``m`` and AR ``a``): tau, G and the drafted totals of
  ``m``, r = m's median seconds per round / a's. None without
  decoding-phase times."""
  if not (m["round_s"]["median"] and a["round_s"]["median"]) or m["tau"] is None:
    return None
  return predict_speedup(tau=m["tau"], alphas=None, mean_draft_tokens=m["mean_draft_tokens"],
                         round_s=m["round_s"]["median"], ar_step_s=a["round_s"]["median"],
                         form=form, drafted_tokens=m["drafted_tokens"],
                         rounds=m["target_calls"])


@dataclasses.dataclass
class TimedRuns:
  """What ``time_runs`` decoded, filled in as it goes (so a Ctrl-C keeps
  what was done). gens: {"ar": [...], method: [...]}, the timed
  ``Generation`` of each repeat in order; ar_untimed: AR's run after its
  compilation, not timed (the greedy reference); answer: the method's
  first timed repeat is the reported answer (``run``), streamed before
  ``time_runs`` and handed in as ``gens[method][0]``."""
  method: str
  gens: dict = dataclasses.field(default_factory=dict)
  ar_untimed: object = None
  answer: bool = False
  answer_auto: dict | None = None   # "auto"'s record right after the answer (Decoder.auto_record)

  def __post_init__(self):
    self.gens = self.gens or {"ar": [], self.method: []}


def time_runs(decoder: Decoder, prompts: Sequence[str], *, method: str, repeats: int,
              max_new_tokens: int, sampling: SamplingParams, num_samples: int, seed: int,
              stops: StopConditions | None = None, chat: bool = False,
              systems: Sequence[str | None] | None = None, ar: Decoder | None = None,
              warm: bool = False, runs: TimedRuns | None = None) -> TimedRuns:
  """``repeats`` interleaved ``decoder`` / AR streams of ``prompts`` (the
  method first in even rounds, AR first in odd), AR's first timed call
  preceded by its untimed run. With ``runs.answer`` the method's first
  repeat is the answer already made. ``warm``: ``decoder.warm_up`` for this
  batch first. Fills and returns ``runs``."""
  runs = runs or TimedRuns(method)
  ar = ar or Decoder(decoder.models()[0], "ar", tokenizer=decoder.tokenizer)
  rows = encode_rows(prompts, decoder.tokenizer, num_samples=num_samples, chat=chat,
                     systems=systems)
  args = (rows, max_new_tokens, sampling, seed)
  if warm and not runs.answer:   # compilation ("auto": calibration) out of the timed calls
    decoder.warm_up(*args, stops=stops)

  def call_method():
    runs.gens[method].append(decoder.stream(*args, stops=stops))

  def compile_ar():          # AR's untimed run; its wall time is not one of the repeats
    ar.warm_up(*args, stops=stops)
    runs.ar_untimed = ar.stream(*args, stops=stops)

  def call_ar():
    if runs.ar_untimed is None:
      compile_ar()
    runs.gens["ar"].append(ar.stream(*args, stops=stops))
  if not runs.answer:      # all compilation before the timed rounds
    compile_ar()
    interleaved_times({method: call_method, "ar": call_ar}, repeats, warmup=0)
  else:                    # round 0: the answer (made), then AR's compiling run and repeat
    call_ar()
    if repeats > 1:        # rounds 1..: AR first in odd rounds, as interleaved_times rotates
      interleaved_times({"ar": call_ar, method: call_method}, repeats - 1, warmup=0)
  return runs


def speedup_line(method: str, rate: dict, ratios: Sequence[float], repeats: int,
                 sampling: SamplingParams, new_tokens: dict, same: bool) -> str:
  """The printed speedup: the ratio of the blocks' median tokens/s, the
  per-repeat ratios' range and, where it prints otherwise, their median."""
  speedup = rate[method] / rate["ar"]
  med = float(np.median(ratios))
  median_text = (f", median {med:.2f}x (the repeats disagree: a single repeat's ratio is "
                 "noisy)" if f"{med:.2f}" != f"{speedup:.2f}" else "")
  s = "s" if repeats != 1 else ""
  return (f"speedup over AR: {speedup:.2f}x = {rate[method]:.1f} / {rate['ar']:.1f} tok/s, "
          f"the median throughputs above ({repeats} interleaved repeat{s}, per repeat "
          f"{min(ratios):.2f}x-{max(ratios):.2f}x{median_text}; same prompts and budget, after "
          "compilation"
          + ("; one repeat is noisy, see scripts/bench_decode.py" if repeats == 1 else "") + ")"
          + (f" (T > 0: {method} and AR sample different texts, {method} "
             f"{np.mean(new_tokens[method]):.0f} and AR {np.mean(new_tokens['ar']):.0f} new "
             "tokens over all prompts; many prompts or scripts/bench_decode.py average that out)"
             if sampling.temperature else
             " (greedy outputs identical)" if same else
             " (WARNING: greedy outputs differ; where and why below)"))


def compare_with_ar(decoder: Decoder, gen, prompts: Sequence[str], *, method: str, repeats: int,
                    max_new_tokens: int, sampling: SamplingParams, num_samples: int, seed: int,
                    err: TextIO, stops: StopConditions | None = None, chat: bool = False,
                    systems: Sequence[str | None] | None = None,
                    ar: Decoder | None = None, warm: bool = False,
                    check_greedy: bool = True, runs: TimedRuns | None = None) -> dict:
  """``time_runs`` of AR and ``decoder`` on ``prompts`` (``runs``: those
  already made; ``gen``: the reported generation); writes the two timed
  blocks, the speedup line, the Theorem 3.8 prediction and the verdict to
  ``err``. ``ar``: the AR decoder (default a new one); ``warm``: warm up
  ``decoder`` for this batch first. Returns the report keys ar_stats,
  speedup (tokens/s ratio), speedup_per_repeat, speedup_per_repeat_median,
  repeats, wall_times_s, new_tokens, tokens_per_s, timed ({"ar": ...,
  METHOD: ...}), answer_repeat (0 or None), prediction (``predict_speedup``'s
  dict plus the measured speedups and "line"; None without timings) and
  greedy_check (``greedy_check``'s dict at T = 0, else None)."""
  kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, num_samples=num_samples, seed=seed,
            stops=stops, chat=chat, systems=systems)
  if runs is None:
    runs = time_runs(decoder, prompts, method=method, repeats=repeats, ar=ar, warm=warm, **kw)
  gens, ar_gen = runs.gens, runs.ar_untimed
  times = {k: [float(g.wall_time_s) for g in v] for k, v in gens.items()}
  new_tokens = {k: [int(sum(len(t) for t in g.tokens)) for g in v] for k, v in gens.items()}
  form = ("tree" if decoder.tree is not None else
          "auto" if decoder.schedule is not None else "chain")
  blocks = {k: {**timed_summary(v), "form": form if k == method else "ar"}
            for k, v in gens.items()}
  rate = {k: blocks[k]["tokens_per_s"]["median"] for k in blocks}
  ratios = [(nm / wm) / (na / wa) for na, wa, nm, wm in
            zip(new_tokens["ar"], times["ar"], new_tokens[method], times[method])]
  speedup = rate[method] / rate["ar"]
  ar_summary = stats_lib.summarize(ar_gen)
  same = all(np.array_equal(a, b) for a, b in zip(ar_gen.tokens, gen.tokens))
  check = None
  if not sampling.temperature and check_greedy:
    check = greedy_check(decoder.models()[0], encode_prompts(prompts, decoder.tokenizer, chat,
                                                             systems),
                         gen.tokens, ar_gen.tokens, num_samples=num_samples)
  s = "s" if repeats != 1 else ""
  answer = (f"; the answer above is {method}'s first" if runs.answer else "")
  err.write(f"--compare: AR and {method} timed in {repeats} interleaved "
            f"repeat{s} each, after compilation and one untimed AR run{answer}; "
            "the blocks and the speedup below are those repeats\n")
  err.write(format_timed("ar", blocks["ar"]) + "\n" + format_timed(method, blocks[method]) + "\n")
  err.write(speedup_line(method, rate, ratios, repeats, sampling, new_tokens, same) + "\n")
  if check is not None:
    for line in greedy_check_lines(check, method):
      err.write(("WARNING: " if "a bug" in line else "") + line + "\n")
  pred = block_prediction(blocks[method], blocks["ar"], form)
  if pred is not None:
    m, a = blocks[method], blocks["ar"]
    decode_ratios = [stats_lib.summarize(gm)["decode_tokens_per_s"] /
                     stats_lib.summarize(ga)["decode_tokens_per_s"]
                     for gm, ga in zip(gens[method], gens["ar"])
                     if stats_lib.summarize(gm)["decode_tokens_per_s"]
                     and stats_lib.summarize(ga)["decode_tokens_per_s"]]
    share = ((m["prefill_share"]["median"], a["prefill_share"]["median"])
             if m["prefill_share"]["median"] is not None
             and a["prefill_share"]["median"] is not None else None)
    row_rounds = sum(_rounds(g) * len(g.tokens) for g in gens[method])
    emitted = m["tokens"] / row_rounds if row_rounds else None
    per_repeat = prediction_of(gens[method], gens["ar"], form)
    drafted = sum(int(pooled_acceptance([g])["mean_draft_tokens"] > 0) for g in gens[method])
    auto_repeats = ((drafted, len(gens[method]), min(per_repeat), max(per_repeat))
                    if form == "auto" and per_repeat else None)
    line = verdict_line(pred, speedup, min(ratios), max(ratios),
                        decode_speedup=float(np.median(decode_ratios)) if decode_ratios else None,
                        prefill_share=share, emitted_per_round=emitted, method=method,
                        auto_repeats=auto_repeats)
    err.write(prediction_line(pred) + "\n" + line + "\n")
    pred = {**pred, "predicted_per_repeat": per_repeat, "drafted_repeats": drafted,
            "measured_speedup": speedup, "measured_min": min(ratios),
            "measured_max": max(ratios), "measured_median": float(np.median(ratios)),
            "line": line}
  else:
    err.write("predicted by Theorem 3.8: n/a (no decoding-phase time to take costs from)\n")
  return {"ar_stats": ar_summary, "speedup": speedup, "speedup_per_repeat": ratios,
          "speedup_per_repeat_median": float(np.median(ratios)),
          "repeats": repeats, "wall_times_s": times, "new_tokens": new_tokens,
          "tokens_per_s": rate, "timed": blocks, "answer_repeat": 0 if runs.answer else None,
          "prediction": pred, "greedy_check": check}


def category_speedups(decoder: Decoder, gen, prompts: Sequence[str],
                      categories: Sequence[str | None], *, method: str, repeats: int,
                      max_new_tokens: int, sampling: SamplingParams, num_samples: int, seed: int,
                      stops: StopConditions | None = None, chat: bool = False,
                      systems: Sequence[str | None] | None = None) -> dict:
  """Per category (``categories[i]`` of prompt i) the speedup of
  ``compare_with_ar`` over that category's prompts as one batch (one AR
  decoder shared, the method warmed up per batch; printed lines dropped).
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
                          [systems[i] for i in idx], ar=ar, warm=True, check_greedy=False)
    speedups[cat] = res["speedup"]
  return speedups
