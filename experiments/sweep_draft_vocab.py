r"""Acceptance alpha_k, tau, draft cost c and ideal speedup of one trained MTP
stage against the size of its draft vocabulary V' (issue 22 item 3).

    python -m experiments.sweep_draft_vocab --workdir runs/smollm_mtp \
        [--draft_vocab 2048,4096,8192,16384,full] [--eval_batches 2] [--batch_size 2] \
        [--repeats 3] [--out results/sweep_draft_vocab_smollm]

For each |V'| the modules' V' is set to that many most frequent answer ids
of the stage's train split (``train.loop.select_draft_vocab``, the rule the
stage itself used; ``full`` = no V'). Acceptance per draft step k = 1..D+R on
the validation batches: ``experiments/vocab_sweep.py``; draft cost and speedup:
this script.
"""

from __future__ import annotations

import os
import time

from mtp import cli

if __name__ == "__main__":     # a flag out of range: one line, before the imports below load jax
  cli.refuse_bad_flags(eval_batches=(int, 1), batch_size=(int, 1), repeats=(int, 1), iters=(int, 1),
                       prompt_len=(int, 1), temperatures=(list, float, 0, 1))

import jax  # noqa: E402

from decode.cli import theory  # noqa: E402
from decode.decoder import DecodeError, Decoder, SamplingParams  # noqa: E402
from experiments import common, vocab_sweep  # noqa: E402
from mtp import report  # noqa: E402
from mtp import draft_vocab as draft_vocab_lib  # noqa: E402
from mtp.timing import format_spread, interleaved_times, spread  # noqa: E402
from scripts.bench_lib import bare_forward_loop, draft_loop, prefilled  # noqa: E402


# -- the library: draft cost and ideal speedup against V' ----------------------------------
#
# Draft cost and ideal speedup against the draft vocabulary V' (issue 22
# item 3).
#
# ``draft_costs`` times, at B = 1, one drafting step of the same MTP modules
# with each V' (``scripts.bench_lib.draft_loop``: the modules' G forward passes,
# their head over V', the warp and the pick, inside one ``fori_loop``) and one
# target decode step (``scripts.bench_lib.bare_forward_loop``: backbone + full head
# over one token), all in one ``mtp.timing.interleaved_times`` call, so each
# round's ratio c = draft step / (G x target step) pairs calls made close
# together in time. ``speedup_rows`` turns per-step acceptance rates
# alpha_1..alpha_G (from ``experiments.vocab_sweep``, passed in as plain rows) and c
# into tau and Theorem 3.8's ideal speedup (``decode.cli.theory.chain_tau`` /
# ``chain_speedup``).

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

  acceptance: ``experiments.vocab_sweep.acceptance`` rows (draft_vocab, size,
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


# -- command line --------------------------------------------------------------------------

def _sizes(ap, text: str) -> list:
  """--draft_vocab: ints >= 1 and ``full`` (None), in the given order."""
  parts = cli.list_items(ap, "draft_vocab", text)
  ints = [x for x in parts if x != vocab_sweep.FULL]
  vals = cli.parse_list(ap, "draft_vocab", ",".join(ints), int, 1) if ints else []
  return vals + [None] * (vocab_sweep.FULL in parts)


def markdown(acc, costs, rows, meta) -> str:
  s = meta["settings"]
  ks = [d["k"] for d in acc[0]["depths"]]
  lines = [f"# Draft vocabulary sweep: {s['workdir']} (step {meta['step']})", "",
           f"{report.machine(meta)}; load average {meta['load_average'][0]:.1f}; wall "
           f"{meta['wall_s']:.0f} s. Acceptance on {meta['positions']} validation positions "
           f"({s['eval_batches']} x {s['batch_size']} rows of {meta['seq_len']}), along the "
           "data path (teacher forcing). alpha T=0: module argmax = target argmax; alpha T=1: "
           "E[sum min(p, q)]; outside: target mass outside V'.", "",
           "| V' | covers | " + " | ".join(f"k={k} a(T=0) / a(T=1) / outside" for k in ks) + " |",
           "|---|---|" + "---|" * len(ks)]
  for r in acc:
    lines.append(f"| {r['draft_vocab']} | {r['covers']:.3f} | " + " | ".join(
        f"{d['alpha_t0']:.3f} / {d['alpha_t1']:.3f} / {d['mass_outside']:.3f}"
        for d in r["depths"]) + " |")
  ts = list(next(iter(costs["rows"].values())))
  lines += ["", f"Draft cost at B = 1, G = {costs['G']}: c = one drafting step / (G x one target "
            f"step), target step {format_spread(costs['forward_s'], '.1f', 1e3)} ms; median "
            f"[min, max] over {costs['repeats']} interleaved repeats of {costs['iters']} steps.",
            "", "| V' | " + " | ".join(f"draft ms T={float(t):g} | c T={float(t):g}" for t in ts)
            + " |", "|---|" + "---|---|" * len(ts)]
  for label, r in costs["rows"].items():
    lines.append(f"| {label} | " + " | ".join(
        f"{format_spread(r[t]['draft_s'], '.1f', 1e3)} | {format_spread(r[t]['c'], '.3f')}"
        for t in ts) + " |")
  lines += ["", "tau = 1 + sum_j prod_{i<=j} alpha_i (i.i.d.-along-the-data-path estimate) and "
            "ideal speedup tau / (G c + 1) (Theorem 3.8 with per-step alphas; range from c's "
            "min / max).", "", "| V' | T | G | tau | speedup |", "|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['draft_vocab']} | {r['temperature']:g} | {r['G']} | {r['tau']:.3f} | "
                 f"{r['speedup']:.3f} [{r['speedup_min']:.3f}, {r['speedup_max']:.3f}] |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  ap = cli.OneLineParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--workdir", default="runs/smollm_mtp", help="trained stage with MTP modules")
  ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  ap.add_argument("--draft_vocab", default="2048,4096,8192,16384,full",
                  help="comma list of |V'| >= 1 and 'full' (no V')")
  ap.add_argument("--eval_batches", type=int, default=2, help="validation batches, >= 1")
  ap.add_argument("--batch_size", type=int, default=2, help="rows per validation batch, >= 1")
  ap.add_argument("--data_dir", default=None, help="replaces the stage's data.data_dir")
  ap.add_argument("--data_name", default=None, help="replaces the stage's data.name")
  ap.add_argument("--recursive_steps", type=int, default=None,
                  help="steps of module D past D (default: the stage's mtp.recursive_steps)")
  ap.add_argument("--temperatures", default="0,1", help="draft costs at T = 0 and / or 1")
  ap.add_argument("--repeats", type=int, default=3, help="interleaved timed rounds, >= 1")
  ap.add_argument("--iters", type=int, default=10, help="drafting steps per timed call, >= 1")
  ap.add_argument("--prompt_len", type=int, default=64, help="prefilled tokens for the timing")
  ap.add_argument("--out", default="results/sweep_draft_vocab", help="output prefix")
  args = ap.parse_args(argv)
  sizes = _sizes(ap, args.draft_vocab)
  temps = cli.parse_list(ap, "temperatures", args.temperatures, float, choices=(0.0, 1.0))
  cli.check_positive(ap, args, ["eval_batches", "batch_size", "repeats", "iters", "prompt_len"])
  cli.check_output_path("out", args.out, "prefix")
  t0, log = time.perf_counter(), lambda m: print(m, flush=True)
  stage = vocab_sweep.load_stage(args.workdir, args.step, batch_size=args.batch_size,
                                 num_batches=args.eval_batches, data_dir=args.data_dir,
                                 data_name=args.data_name)
  vocabs = vocab_sweep.vocab_sets(stage, sizes)
  acc = vocab_sweep.acceptance(stage, vocabs, args.recursive_steps, log=log)
  g = len(acc[0]["depths"])
  models = {k: draft_vocab_lib.with_draft_vocab_size(stage.model, ids) for k, ids in vocabs.items()}
  prompt = [int(x) for x in stage.batches[0]["tokens"][0, :args.prompt_len]]
  costs = draft_costs(models, stage.tokenizer, prompt, g, repeats=args.repeats,
                                  iters=args.iters, temperatures=temps)
  rows = speedup_rows(acc, costs, range(1, g + 1))
  meta = report.provenance(command=common.command_line(__file__, argv), settings=vars(args),
                           step=stage.step, seq_len=stage.cfg.train.seq_len,
                           positions=acc[0]["depths"][0]["positions"],
                           load_average=os.getloadavg(), wall_s=time.perf_counter() - t0)
  results = {"acceptance": acc, "costs": costs, "speedups": rows, "best": best(rows)}
  md = markdown(acc, costs, rows, meta)
  report.write_report(args.out, meta, results, md)
  print(md + f"wrote {args.out}.json and {args.out}.md")
  return 0


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError, ValueError))
