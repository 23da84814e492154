"""Draft cost and ideal speedup against the draft vocabulary V' (issue 22
item 3; scripts/sweep_draft_vocab.py).

``draft_costs`` times, at B = 1, one drafting step of the same MTP modules
with each V' (``decode.bench.draft_loop``: the modules' G forward passes,
their head over V', the warp and the pick, inside one ``fori_loop``) and one
target decode step (``decode.bench.bare_forward_loop``: backbone + full head
over one token), all in one ``mtp.timing.interleaved_times`` call, so each
round's ratio c = draft step / (G x target step) pairs calls made close
together in time. ``speedup_rows`` turns per-step acceptance rates
alpha_1..alpha_G (from ``train.vocab_sweep``, passed in as plain rows) and c
into tau and Theorem 3.8's ideal speedup (``decode.theory.chain_tau`` /
``chain_speedup``).
"""

from __future__ import annotations

import jax

from decode import theory
from decode.speculative import Decoder, SamplingParams
from mtp.timing import interleaved_times, spread
from scripts.bench_lib import bare_forward_loop, draft_loop, prefilled

SPREAD = ("n", "median", "min", "max")


def _timed(fn, args):
  """A zero-argument callable running ``fn`` on its own carry (donated)."""
  carry = [args]

  def call():
    carry[0] = fn(*carry[0])
    jax.block_until_ready(carry[0])
  return call


def draft_costs(models: dict, tokenizer, prompt, num_draft_tokens: int, *, max_new: int = 32,
                repeats: int = 3, iters: int = 10, temperatures=(0.0, 1.0)) -> dict:
  """Seconds of one drafting step per model and temperature, and c.

  Args:
    models: {label: ``mtp.model.Transformer``}, the same target and MTP
      modules with different draft vocabularies
      (``mtp.draft_vocab.with_draft_vocab_size``); the first one's prefill
      state is shared (its drafter state does not depend on V').
    tokenizer: the models' tokenizer (``Decoder(..., tokenizer=)``).
    prompt: [P] ids (or a text for a byte model): the prefilled context.
    num_draft_tokens: G of the drafting step (G > D reuses module D).
    max_new, repeats (interleaved timed rounds), iters (steps per timed
      call), temperatures (a greedy pick at 0, a sample otherwise).
  Returns:
    {"forward_s": spread of one target step [s], "G", "iters", "repeats",
    "cache_len", "rows": {label: {str(T): {"draft_s": spread [s], "c":
    spread of per-round draft_s / (G forward_s)}}}}; spreads have n,
    median, min, max (``mtp.timing.spread``).
  """
  decoders = {k: Decoder(m, "mtp", num_draft_tokens, tokenizer=tokenizer)
              for k, m in models.items()}
  state = prefilled(next(iter(decoders.values())), [prompt], max_new)
  cache_len = int(state.tokens.shape[1])
  target = next(iter(models.values()))
  fns = {"target": _timed(*bare_forward_loop(target, 1, 1, cache_len, True, iters)[:2])}
  for label, dec in decoders.items():
    for t in temperatures:
      fns[f"{label}@{t}"] = _timed(*draft_loop(dec, state, SamplingParams(temperature=t), iters))
  times = interleaved_times(fns, repeats, warmup=1)
  fwd = times["target"] / iters
  rows = {}
  for label in decoders:
    rows[label] = {}
    for t in temperatures:
      d = times[f"{label}@{t}"] / iters
      rows[label][str(float(t))] = {"draft_s": spread(d, SPREAD),
                                    "c": spread(d / (num_draft_tokens * fwd), SPREAD)}
  return {"forward_s": spread(fwd, SPREAD), "G": num_draft_tokens, "iters": iters,
          "repeats": repeats, "cache_len": cache_len, "rows": rows}


def speedup_rows(acceptance: list[dict], costs: dict, gs) -> list[dict]:
  """Per V', temperature and G in ``gs``: tau (``theory.chain_tau`` of
  alpha_1..alpha_G, the i.i.d.-along-the-data-path estimate: each step's
  rate measured on its own, independent of the steps before) and the ideal
  speedup tau / (G c + 1) (``theory.chain_speedup``) at the median c, with
  the range from c's min / max.

  acceptance: ``train.vocab_sweep.acceptance`` rows (draft_vocab, size,
  depths [{k, alpha_t0, alpha_t1, mass_outside}]); costs: ``draft_costs``
  (alpha_t0 pairs with its T = 0 cost, alpha_t1 with T = 1; a temperature
  it did not time is left out). Returns [{draft_vocab, size, temperature,
  G, alphas, tau, c, speedup, speedup_min, speedup_max}]. Raises
  ValueError for a G above the measured steps."""
  out = []
  for row in acceptance:
    for t, key in ((0.0, "alpha_t0"), (1.0, "alpha_t1")):
      if str(t) not in costs["rows"][row["draft_vocab"]]:
        continue
      c = costs["rows"][row["draft_vocab"]][str(t)]["c"]
      alphas = [d[key] for d in row["depths"]]
      for g in gs:
        if not 1 <= g <= len(alphas):
          raise ValueError(f"G = {g} needs alpha_1..alpha_{g}; measured {len(alphas)} steps")
        a = alphas[:g]
        s = [theory.chain_speedup(a, x) for x in (c["median"], c["max"], c["min"])]
        out.append({"draft_vocab": row["draft_vocab"], "size": row["size"], "temperature": t,
                    "G": g, "alphas": a, "tau": theory.chain_tau(a), "c": c["median"],
                    "speedup": s[0], "speedup_min": s[1], "speedup_max": s[2]})
  return out


def best(rows: list[dict]) -> dict:
  """{str(T): the ``speedup_rows`` row with the highest ideal speedup at T}."""
  out = {}
  for r in rows:
    k = str(r["temperature"])
    if k not in out or r["speedup"] > out[k]["speedup"]:
      out[k] = r
  return out
