r"""Where MTP acceptance collapses and where batching erases the gain:
one-axis sweeps of speculative decoding around a base point.

    python -m experiments.sweep_decode --workdir runs/tiny --out results/sweep_decode \
        [--temperatures 0,0.3,0.7,1,1.3] [--top_ps 1,0.9] [--batch_sizes 1,4,16] \
        [--batch_temperatures 0,1] [--domains python_stdlib,python_docs] \
        [--num_draft_tokens D] [--repeats 10] [--max_new_tokens 128] [--prompt_bytes 256]

Base point: temperature 1, top-p 1 (off), batch 1, held-out code prompts
(``python_stdlib`` validation split, the tiny model's training domain), MTP
with G = D draft tokens. T = 1 is plain sampling from the target, the case
the stochastic acceptance rule exists for; greedy (T = 0) appears on the
temperature and batch axes. Each sweep moves one or two settings away from
the base point instead of running the full cross product:

- temperature: every T in ``--temperatures``, per domain (code and prose);
- top_p: every p in ``--top_ps`` at T = 1 (code);
- batch: every B in ``--batch_sizes`` at each T in ``--batch_temperatures``
  (code);
- domain: code vs prose (python_docs: pydoc topics, out of the training
  domain) at T = 0 and T = 1, batch 1.

Identical settings shared by two sweeps are measured once. Every point
decodes the same held-out prompts (``mtp.data.held_out_prompts``; a
different prompt per repeat and row) with AR and with MTP in the same
process and the same sampling settings, repeats interleaved
(``scripts.bench_lib.run_cells``, while_loop form by default), and
reports tau, alpha per position, the measured draft cost ratio c (and the
FLOP share c that drafting would have if time followed FLOPs), speedup
over AR at the same batch and sampling (median wall time), and the ideal
speedup of Leviathan et al. 2023 (Theorem 3.8) with the measured alpha and c
(``scripts.bench_lib.summarize_cell``). The drafting time behind c is
probed at every point (``--draft_cost_probe point``, one compile each) or once
per batch size (``batch``, what ``--quick`` uses).

Writes OUT.json, OUT.md (one table per sweep, with the command),
OUT_temperature.png (tau and speedup vs T, per domain) and OUT_batch.png
(speedup and tau vs batch size). Runtime with the defaults on runs/tiny
(d_model 128, 4 layers, D = 2; 15 distinct points): about 4-6 minutes on 2
shared CPU cores, mostly compilation and the per-point drafting probe;
``--quick`` (tests): under a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from mtp import cli

if __name__ == "__main__":     # a flag out of range: one line, before the imports below load jax
  from decode.limits import MAX_DRAFT_TOKENS
  cli.refuse_bad_flags(temperatures=(list, float, 0), top_ps=(list, float, 0, 1, True),
                       batch_sizes=(list, int, 1), batch_temperatures=(list, float, 0),
                       base_temperature=(float, 0), num_draft_tokens=(list, int, 1, MAX_DRAFT_TOKENS),
                       prompt_bytes=(int, 1), max_new_tokens=(int, 1), repeats=(int, 1))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from decode.decoder import MAX_DRAFT_TOKENS, DecodeError, Decoder, SamplingParams  # noqa: E402
from experiments import common  # noqa: E402
from mtp import loading  # noqa: E402
from mtp import report  # noqa: E402
from mtp import data as data_lib  # noqa: E402
from scripts.bench_lib import measure_point  # noqa: E402

# -- the library: one-axis sweeps around a base point -------------------------------------

SWEEPS = ("temperature", "top_p", "batch", "domain")
DOMAIN_KIND = {"python_stdlib": "code", "python_docs": "prose"}


def sweep_points(base: dict, temperatures, top_ps, batch_sizes, batch_temperatures,
                 domains) -> dict[str, list[dict]]:
  """The settings of each sweep: {sweep name: [point, ...]}, each point a
  dict with keys domain, temperature, top_p, batch_size; every point equals
  ``base`` except on its sweep's axes (temperature sweep: T x domain; top_p:
  p; batch: B x T in ``batch_temperatures``; domain: domain x T in {0, 1}).
  Pure; points repeat across sweeps where the settings coincide."""
  pt = lambda **kw: {**base, **kw}
  return {
      "temperature": [pt(domain=d, temperature=t) for d in domains for t in temperatures],
      "top_p": [pt(top_p=p) for p in top_ps],
      "batch": [pt(batch_size=b, temperature=t) for t in batch_temperatures for b in batch_sizes],
      "domain": [pt(domain=d, temperature=t) for t in (0.0, 1.0) for d in domains],
  }


def point_key(p: dict) -> tuple:
  """(domain, temperature, top_p, batch_size) of a sweep point: equal settings, equal key."""
  return (p["domain"], float(p["temperature"]), float(p["top_p"]), int(p["batch_size"]))


@dataclasses.dataclass
class SweepDecode:
  """The settings of one decode sweep.

  target: the MTP target (D >= 1); gs: draft lengths G of the MTP rows;
  plan: ``sweep_points``' {sweep: [point]}; prompts: {domain: held-out
  prompt texts}; forms; max_new_tokens per row; repeats: interleaved timed
  repeats per point; draft_cost_probe: "point" (probe the drafting time at
  every point) or "batch" (once per batch size, at its first point).
  """
  target: object
  gs: list[int]
  plan: dict[str, list[dict]]
  prompts: dict[str, list[str]]
  forms: list[str]
  max_new_tokens: int
  repeats: int
  draft_cost_probe: str = "point"


def run_sweep(s: SweepDecode, log=print) -> dict[str, list[dict]]:
  """Measures every distinct point of ``s.plan`` once (``measure_point`` with
  AR and MTP at each G; in order of batch size, then key) and returns
  {sweep: rows}, each row ``measure_point``'s with its domain and sweep
  name; a point shared by two sweeps has the same rows in both. ``log``
  gets one line per point."""
  unique = {point_key(p): p for pts in s.plan.values() for p in pts}
  # One decoder per method: its jitted functions compile once per batch shape.
  decoders = {"ar": Decoder(s.target, "ar"), **{f"mtp_G{g}": Decoder(s.target, "mtp", g) for g in s.gs}}
  measured, draft_cache, flops_cache = {}, ({} if s.draft_cost_probe == "batch" else None), {}
  for i, (key, p) in enumerate(sorted(unique.items(), key=lambda kv: (kv[0][3], kv[0]))):
    sp = SamplingParams(temperature=p["temperature"], top_p=p["top_p"])
    rows = measure_point(decoders, s.prompts[p["domain"]], p["batch_size"], s.max_new_tokens, sp,
                         s.repeats, s.forms, draft_cache, flops_cache)
    for r in rows:
      r["domain"] = p["domain"]
    measured[key] = rows
    spec = " ".join(f"{r['label']} tau {r['tau']:.2f} x{r['speedup']:.2f}" for r in rows
                    if r["method"] != "ar")
    log(f"[{i + 1}/{len(unique)}] {p['domain']} T={p['temperature']:g} top_p={p['top_p']:g} "
        f"B={p['batch_size']}: {spec}")
  return {name: [dict(r, sweep=name) for p in pts for r in measured[point_key(p)]]
          for name, pts in s.plan.items()}


# -- report ----------------------------------------------------------------------------

def markdown(sweeps: dict, meta: dict) -> str:
  lines = [f"# Decode sweeps: {meta['workdir']} (step {meta['checkpoint_step']})", "",
           f"{report.machine(meta)}, JAX {meta['jax_version']}, commit "
           f"{meta['commit']}, {meta['date']}. MTP with G = {meta['num_draft_tokens']} (D = "
           f"{meta['depth']}), {meta['max_new_tokens']} new tokens per row, held-out prompts of "
           f"~{meta['prompt_bytes']} bytes, median of {report.plural(meta['repeats'], 'interleaved repeat')}, "
           f"form {'/'.join(meta['forms'])}. Base point: T = {meta['base']['temperature']}, top-p "
           f"{meta['base']['top_p']}, batch {meta['base']['batch_size']}, {meta['base']['domain']}. "
           "Speedup: AR wall time / MTP wall time at the same batch and sampling; c: drafting "
           "time per draft token / one AR step (drafting time measured inside a fori_loop, "
           "probed "
           + ("at every point" if meta["draft_cost_probe"] == "point" else
              "once per batch size, at its first point") + "); c (FLOPs): the c drafting would "
           "have if time followed XLA-counted FLOPs; ideal: Leviathan et al. 2023 "
           "Thm 3.8 with the measured alpha (i.i.d. fit of tau) and c.", ""]
  for name, rows in sweeps.items():
    lines += [f"## {name}", "",
              "| domain | T | top-p | B | method | G | tok/s | speedup | tau | alpha_k | c | c (FLOPs) | "
              "ideal | eff. |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
      alphas = "/".join(report.fmt(a) for a in r["acceptance_rate_per_position"]) or "-"
      lines.append(
          f"| {r['domain']} | {r['temperature']:g} | {r['top_p']:g} | {r['batch_size']} | "
          f"{r['method']} | {r['num_draft_tokens'] or '-'} | {r['tokens_per_s']:.0f} | "
          f"{r['speedup']:.2f}x | {r['tau']:.2f} | {alphas} | {report.fmt(r.get('draft_cost_ratio_c'))} | "
          f"{report.fmt(r.get('draft_cost_ratio_c_flops'))} | {report.fmt(r.get('ideal_speedup'))} | "
          f"{report.fmt(r.get('efficiency'))} |")
    lines.append("")
  return "\n".join(lines)


def _spec_rows(rows):
  return [r for r in rows if r["method"] != "ar"]


def plot_temperature(rows: list[dict], path: str) -> None:
  """tau and speedup vs T, one line per (domain, G)."""
  fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=100)
  groups = sorted({(r["domain"], r["num_draft_tokens"], r["form"]) for r in _spec_rows(rows)})
  for dom, g, form in groups:
    pts = sorted((r["temperature"], r["tau"], r["speedup"]) for r in _spec_rows(rows)
                 if (r["domain"], r["num_draft_tokens"], r["form"]) == (dom, g, form))
    t, tau, sp = zip(*pts)
    label = f"{DOMAIN_KIND.get(dom, dom)} G={g}" + ("" if form == "while" else f" {form}")
    axes[0].plot(t, tau, "o-", label=label)
    axes[1].plot(t, sp, "o-", label=label)
  axes[0].set(xlabel="temperature T", ylabel="tau (tokens / target call)", title="mean accepted length")
  axes[1].axhline(1.0, color="gray", lw=0.8, ls="--")
  axes[1].set(xlabel="temperature T", ylabel="speedup over AR", title="measured speedup (batch 1)")
  axes[0].legend(fontsize=7)
  common.save_figure(fig, path)


def plot_batch(rows: list[dict], path: str) -> None:
  """Speedup (and tau) vs batch size, one line per (T, G)."""
  fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=100)
  groups = sorted({(r["temperature"], r["num_draft_tokens"], r["form"]) for r in _spec_rows(rows)})
  for t, g, form in groups:
    pts = sorted((r["batch_size"], r["speedup"], r["tau"]) for r in _spec_rows(rows)
                 if (r["temperature"], r["num_draft_tokens"], r["form"]) == (t, g, form))
    b, sp, tau = zip(*pts)
    label = f"T={t:g} G={g}" + ("" if form == "while" else f" {form}")
    axes[0].plot(b, sp, "o-", label=label)
    axes[1].plot(b, tau, "o-", label=label)
  batches = sorted({r["batch_size"] for r in rows})
  for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("batch size B")
  axes[0].axhline(1.0, color="gray", lw=0.8, ls="--")
  axes[0].set(ylabel="speedup over AR (same B)", title="measured speedup")
  axes[1].set(ylabel="tau", title="mean accepted length")
  axes[0].legend(fontsize=7)
  common.save_figure(fig, path)


# -- main --------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
  ap = cli.OneLineParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--workdir", required=True, help="trained MTP target (mtp.depth >= 1)")
  ap.add_argument("--data_dir", default="", help=cli.DATA_DIR_HELP)
  ap.add_argument("--domains", default="python_stdlib,python_docs",
                  help="held-out prompt datasets; the first is the base point's")
  ap.add_argument("--temperatures", default="0,0.3,0.7,1,1.3",
                  help="temperature axis: comma list >= 0 (0: greedy)")
  ap.add_argument("--top_ps", default="1,0.9", help="top-p values swept at T = base temperature")
  ap.add_argument("--batch_sizes", default="1,4,16", help="batch axis: comma list of B >= 1")
  ap.add_argument("--batch_temperatures", default="0,1",
                  help="temperatures of the batch axis: comma list >= 0")
  ap.add_argument("--base_temperature", type=float, default=1.0, help="base point temperature, >= 0")
  ap.add_argument("--num_draft_tokens", default=None, help="comma list of G (default: D)")
  ap.add_argument("--forms", default="while", help="while and/or stream")
  ap.add_argument("--prompt_bytes", type=int, default=256, help="bytes per prompt, >= 1")
  ap.add_argument("--max_new_tokens", type=int, default=128, help="new tokens per row, >= 1")
  ap.add_argument("--repeats", type=int, default=10,
                  help="interleaved timed repeats, >= 1; repeat r decodes its own held-out prompt(s)")
  ap.add_argument("--seed", type=int, default=0, help="held-out prompt sample seed")
  ap.add_argument("--draft_cost_probe", choices=("point", "batch"), default="point",
                  help="measure the drafting time (for c) at every sweep point, or once per "
                       "batch size at its first point (each probe compiles: --quick uses batch)")
  ap.add_argument("--out", default="results/sweep_decode", help="output prefix")
  ap.add_argument("--quick", action="store_true",
                  help="tiny sizes for tests: fills in --temperatures 0,1 --batch_sizes 1,2 --repeats 1 "
                       "--max_new_tokens 8 --prompt_bytes 48 --draft_cost_probe batch where not given")
  return ap


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  ap = parser()
  args = ap.parse_args(argv)
  if args.quick:
    cli.apply_quick(ap, args, temperatures="0,1", batch_sizes="1,2", repeats=1, max_new_tokens=8,
                    prompt_bytes=48, draft_cost_probe="batch")
  cli.check_positive(ap, args, ("prompt_bytes", "max_new_tokens", "repeats"))
  cli.check_output_path("out", args.out, "prefix")
  temps = cli.parse_list(ap, "temperatures", args.temperatures, float, 0.0)
  top_ps = cli.parse_list(ap, "top_ps", args.top_ps, float, 0.0, 1.0, lo_open=True)
  batches = cli.parse_list(ap, "batch_sizes", args.batch_sizes, int, 1)
  batch_temps = cli.parse_list(ap, "batch_temperatures", args.batch_temperatures, float, 0.0)
  forms = cli.parse_list(ap, "forms", args.forms, str, choices=("while", "stream"))
  domains = cli.parse_list(ap, "domains", args.domains, str)
  if not (math.isfinite(args.base_temperature) and args.base_temperature >= 0):
    ap.error(f"--base_temperature={args.base_temperature} is out of range: must be a finite number >= 0")

  cfg, target, step = loading.load_model(args.workdir)
  depth = cfg.mtp.depth
  if depth < 1:
    ap.error(f"--workdir={args.workdir} holds a model with mtp.depth = 0: the sweep needs MTP modules")
  gs = cli.parse_list(ap, "num_draft_tokens", args.num_draft_tokens or str(depth), int, 1,
                      MAX_DRAFT_TOKENS)
  if args.prompt_bytes + args.max_new_tokens + 64 > cfg.model.max_seq_len:
    ap.error(f"--prompt_bytes + --max_new_tokens = {args.prompt_bytes + args.max_new_tokens} leaves "
             f"no room within the model's max_seq_len={cfg.model.max_seq_len} (keep 64 spare)")

  base = {"domain": domains[0], "temperature": args.base_temperature, "top_p": 1.0,
          "batch_size": 1}
  plan = sweep_points(base, temps, top_ps, batches, batch_temps, domains)
  unique = {point_key(p): p for pts in plan.values() for p in pts}
  num_prompts = max(p["batch_size"] for p in unique.values()) * args.repeats
  prompts = {d: data_lib.held_out_prompts(d, num_prompts, args.prompt_bytes, seed=args.seed,
                                          data_dir=args.data_dir) for d in domains}
  settings = SweepDecode(target=target, gs=gs, plan=plan, prompts=prompts, forms=forms,
                         max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                         draft_cost_probe=args.draft_cost_probe)
  sweeps = run_sweep(settings, log=lambda s: print(s, flush=True))
  meta = report.provenance(
      command=common.command_line(__file__, argv),
      workdir=args.workdir, checkpoint_step=step, config=cfg.to_dict(), depth=depth,
      num_draft_tokens=gs, domains=domains, temperatures=temps, top_ps=top_ps, batch_sizes=batches,
      batch_temperatures=batch_temps, base=base, forms=forms, prompt_bytes=args.prompt_bytes,
      max_new_tokens=args.max_new_tokens, repeats=args.repeats, prompt_seed=args.seed,
      draft_cost_probe=args.draft_cost_probe,
      num_points=len(unique), quick=args.quick)
  report.write_report(args.out, meta, sweeps, markdown(sweeps, meta))
  plot_temperature(sweeps["temperature"], args.out + "_temperature.png")
  plot_batch(sweeps["batch"], args.out + "_batch.png")
  print(f"wrote {args.out}.json, {args.out}.md, {args.out}_temperature.png and {args.out}_batch.png")


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError,))
