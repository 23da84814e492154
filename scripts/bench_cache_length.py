r"""Decoding cost against the KV cache's size and the tokens in it: the dense
masked attention over every cache slot against the blockwise attention that
reads only the blocks that can be visible (``model.attention_impl``, issue 24).

    python scripts/bench_cache_length.py [--quick] [--out results/bench_cache_length]

(a) Step cost: one cached backbone step (``Transformer.backbone``, T = 1 and
    a T = 4 verify block) at position ~``--position`` with S cache slots, S in
    ``--cache_slots``, on the shape of SmolLM2-135M (30 layers, d_model 576,
    GQA 9/3 heads of 64, SwiGLU 1536, vocabulary 49152; random weights, fp32,
    B = 1), ``--steps`` steps inside one ``lax.fori_loop`` per timed call (no
    host dispatch), every implementation and block size of ``--block_sizes``
    timed side by side, interleaved, ``--repeats`` times.
(b) End to end: tokens/s of ``decode.speculative.Decoder.generate`` (AR and
    MTP with G = D = 2, greedy, B = 1) on the demo model (``--config``,
    randomly initialised, max_seq_len raised to fit the longest request; the
    EOS embedding row is zeroed so that greedy decoding never stops early)
    against the generated length (``--new_tokens`` from a ~50-token prompt)
    and the prompt length (``--prompt_tokens``, 128 new tokens), both
    implementations side by side in one process, repeats interleaved. Both
    implementations must emit the same tokens (checked, reported).

Writes OUT.json / OUT.md (provenance: mtp/report.py) and the plot
``--plot`` (default docs/bench_cache_length.png). Library:
``decode/bench_cache.py`` (timing with ``mtp.timing.interleaved_times``);
this script parses flags, writes the report and draws the plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mtp import cli, report  # noqa: E402
from mtp import config as config_lib  # noqa: E402
from scripts import bench_cache as bc  # noqa: E402
from scripts.bench_cache import variant_name  # noqa: E402


_RANDOM_NOTE = "randomly initialised (EOS row zeroed so decoding runs to the budget)"
_WORKDIR_NOTE = ("its trained weights, stop ids made never-emitted so decoding runs to the budget, "
                 "prompts cut from the held-out chat prompts' text")


def _fmt_stat(st: dict, scale: float = 1.0, prec: int = 2) -> str:
  return (f"{st['median'] * scale:.{prec}f} [{st['min'] * scale:.{prec}f}, "
          f"{st['max'] * scale:.{prec}f}]")


def markdown(results: dict, meta: dict) -> str:
  sh = meta["step_shape"]
  lines = [f"KV-cache reading: dense masked attention over every slot vs blockwise attention "
           f"over the visible blocks (issue 24). {report.machine(meta)}, JAX {meta['jax_version']}, "
           f"commit {meta['commit']}, {meta['date']}. {meta['machine_note']}", "",
           "Figures are median [min, max] over interleaved repeats (ratios: of the per-repeat "
           "ratios, repeats paired in order).", ""]
  if results.get("targets"):
    lines += ["## Targets (issue 24)", "",
              "| target | impl | paired ratios, median [min, max] | ratio of the fastest repeats | goal |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['target']} ({r['case']}) | {r['impl']} | {_fmt_stat(r['value'])} | "
              f"{r['of_minimums']:.2f} | {r['goal']} |" for r in results["targets"]]
    lines.append("")
  lines += [
           f"## (a) Step cost at position ~{meta['position']} against cache slots S",
           "",
           f"Shape: {meta['step_shape_name']} ({sh['num_layers']} layers, d_model {sh['d_model']}, "
           f"{sh['num_heads']}/{sh['num_kv_heads']} heads of {sh['head_dim']}, MLP {sh['mlp_dim']}, "
           f"vocab {sh['vocab_size']}), random weights, fp32, B = 1, `Transformer.backbone` with a "
           f"KV cache, {meta['steps']} steps per timed call inside a fori_loop, "
           f"{report.plural(meta['repeats'], 'repeat')}.", "",
           "| impl | T | S | ms / step | vs smallest S | speedup vs dense |",
           "|---|---|---|---|---|---|"]
  ratios = {(r["kind"], r["impl"], r["block_size"], r["T"], r["cache_slots"]): r["ratio"]
            for r in results["step_ratios"]}
  for r in results["steps"]:
    k = (r["impl"], r["block_size"], r["T"], r["cache_slots"])
    vs = ratios.get(("vs_smallest_cache",) + k)
    sp = ratios.get(("speedup_vs_dense",) + k)
    lines.append(f"| {variant_name(r['impl'], r['block_size'])} | {r['T']} | {r['cache_slots']} | "
                 f"{_fmt_stat(r['step_s'], 1e3)} | {_fmt_stat(vs) if vs else '-'} | "
                 f"{_fmt_stat(sp) if sp else '-'} |")
  if results.get("generation"):
    lines += ["", "## (b) End-to-end tokens/s (`Decoder.generate`, greedy, B = 1)", "",
              f"Model: {meta.get('demo_shape', meta['demo_config'] + ' shape')}, "
              f"{meta.get('demo_note', _RANDOM_NOTE)}, max_seq_len {meta['demo_max_seq_len']}; "
              f"blockwise/C: block size C; MTP drafts G = {meta.get('num_draft_tokens', 2)}; "
              f"tokens/s = new "
              f"tokens / median wall time (prefill included); "
              f"{report.plural(meta['gen_repeats'], 'repeat')}.", "",
              "| method | prompt | new | impl | tokens/s | wall ms | prefill ms | tau | same tokens | "
              "speedup vs dense |", "|---|---|---|---|---|---|---|---|---|---|"]
    sp = {(r["method"], r["impl"], r["prompt_tokens"], r["new_tokens"]): r["speedup"]
          for r in results["generation_speedups"]}
    for r in results["generation"]:
      s = sp.get((r["method"], r["impl"], r["prompt_tokens"], r["new_tokens"]))
      lines.append(f"| {r['method']} | {r['prompt_tokens']} | {r['new_tokens']} | {r['impl']} | "
                   f"{r['tokens_per_s']:.0f} | {_fmt_stat(r['wall_s'], 1e3, 1)} | "
                   f"{_fmt_stat(r['prefill_s'], 1e3, 1)} | {r['tau']:.2f} | {r['tokens_equal']} | "
                   f"{_fmt_stat(s) if s else '-'} |")
  return "\n".join(lines) + "\n"


def plot(results: dict, meta: dict, path: str) -> None:
  gen = results.get("generation") or []
  fig, axes = plt.subplots(1, 3 if gen else 1, figsize=(15 if gen else 5.5, 4), dpi=100, squeeze=False)
  ax = axes[0, 0]
  for (impl, block, t) in sorted({(r["impl"], r["block_size"] or 0, r["T"]) for r in results["steps"]}):
    sel = sorted((r for r in results["steps"]
                  if (r["impl"], r["block_size"] or 0, r["T"]) == (impl, block, t)),
                 key=lambda r: r["cache_slots"])
    ax.plot([r["cache_slots"] for r in sel], [r["step_s"]["median"] * 1e3 for r in sel],
            "o-" if impl == "blockwise" else "s--",
            label=f"{variant_name(impl, block or None)} T={t}")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("cache slots S")
  ax.set_ylabel(f"ms per step at position ~{meta['position']}")
  ax.set_title(meta["step_shape_name"], fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  if gen:
    short = min(r["prompt_tokens"] for r in gen)
    for ax, (xkey, fixed_key, fixed, label) in zip(
        axes[0, 1:], [("new_tokens", "prompt_tokens", short, f"new tokens (prompt {short})"),
                      ("prompt_tokens", "new_tokens", meta["prompt_sweep_new_tokens"],
                       f"prompt tokens ({meta['prompt_sweep_new_tokens']} new)")]):
      for method in sorted({r["method"] for r in gen}):
        for impl in sorted({r["impl"] for r in gen}):
          sel = sorted((r for r in gen if r["method"] == method and r["impl"] == impl
                        and r[fixed_key] == fixed), key=lambda r: r[xkey])
          if len(sel) > 1 or (sel and xkey == "new_tokens"):
            ax.plot([r[xkey] for r in sel], [r["tokens_per_s"] for r in sel],
                    "o-" if impl.startswith("blockwise") else "s--", label=f"{method} {impl}")
      ax.set_xscale("log", base=2)
      ax.set_xlabel(label)
      ax.set_ylabel("tokens / s (end to end)")
      ax.set_title(f"{meta.get('demo_shape', meta['demo_config'])} (random init)", fontsize=9)
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path)
  plt.close(fig)


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--impls", default="dense,blockwise", help="comma list of model.attention_impl values")
  ap.add_argument("--block_sizes", default="128", help="comma list of blockwise block sizes (slots)")
  ap.add_argument("--cache_slots", default="512,2048,8192", help="(a): comma list of cache sizes S")
  ap.add_argument("--query_lengths", default="1,4", help="(a): comma list of T (1 = AR step, 4 = verify)")
  ap.add_argument("--position", type=int, default=200, help="(a): position of the first step")
  ap.add_argument("--steps", type=int, default=8, help="(a): steps per timed call")
  ap.add_argument("--repeats", type=int, default=7, help="(a): timed calls per cell, >= 1")
  ap.add_argument("--config", default="configs/tiny.py", help="(b): demo model config (random init)")
  ap.add_argument("--workdir", default="",
                  help="(b): a trained or imported BPE workdir (e.g. runs/smollm_mtp) instead of --config")
  ap.add_argument("--num_draft_tokens", type=int, default=2, help="(b): G of the mtp method")
  ap.add_argument("--methods", default="ar,mtp", help="(b): comma list of ar, mtp")
  ap.add_argument("--short_prompt", type=int, default=50, help="(b): prompt tokens of the new-token sweep")
  ap.add_argument("--new_tokens", default="128,256,512,1024,2048",
                  help="(b): comma list of generated lengths (prompt --short_prompt)")
  ap.add_argument("--prompt_tokens", default="64,256,1024,4096",
                  help="(b): comma list of prompt lengths (--prompt_new_tokens new tokens)")
  ap.add_argument("--prompt_new_tokens", type=int, default=128, help="(b): new tokens of the prompt sweep")
  ap.add_argument("--gen_repeats", type=int, default=3, help="(b): timed generations per cell")
  ap.add_argument("--demo_block_sizes", default="",
                  help="(b): comma list of blockwise block sizes (default: --block_sizes)")
  ap.add_argument("--skip_steps", action="store_true", help="skip (a)")
  ap.add_argument("--skip_generation", action="store_true", help="skip (b)")
  ap.add_argument("--out", default="results/bench_cache_length", help="output prefix")
  ap.add_argument("--plot", default="docs/bench_cache_length.png", help="plot path")
  ap.add_argument("--render", default="",
                  help="measure nothing: rewrite --out (JSON, markdown with the targets) and --plot "
                       "from the JSON of an earlier run, or a comma list of JSONs of runs that "
                       "measured parts apart (--skip_steps / --skip_generation), merged")
  ap.add_argument("--quick", action="store_true",
                  help="tiny sizes for tests: a 2-layer d_model 32 model for (a) and (b), S 64,256, "
                       "position 20, 2 steps, 1 repeat, 16/32 new tokens, prompts 16/48")
  return ap


def settings(ap: argparse.ArgumentParser, args) -> bc.CacheBench:
  """The study's settings from the flags (``ap.error`` naming a bad one)."""
  if args.quick:
    cli.apply_quick(ap, args, cache_slots="64,256", position=20, steps=2, repeats=1,
                    new_tokens="16,32", prompt_tokens="16,48", prompt_new_tokens=16, gen_repeats=1,
                    short_prompt=16)
  cli.check_range(ap, args, position=0, steps=1, repeats=1, short_prompt=1, prompt_new_tokens=1,
                  gen_repeats=1, num_draft_tokens=1)
  if args.workdir and not os.path.isdir(args.workdir):
    ap.error(f"--workdir={args.workdir!r}: no such directory")
  lists = lambda name, typ, lo=None, choices=None: cli.parse_list(
      ap, name, getattr(args, name), typ, lo, choices=choices)
  if not os.path.isfile(args.config):
    ap.error(f"--config={args.config!r}: no such file")
  try:
    cfg = config_lib.load_config_file(args.config)
  except config_lib.ConfigError as e:
    ap.error(f"--config: {e}")
  if args.quick:
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **bc.QUICK_SHAPE))
  return bc.CacheBench(
      step_shape=dict(bc.QUICK_SHAPE if args.quick else bc.SMOLLM2_135M),
      impls=lists("impls", str, choices=("dense", "blockwise")),
      block_sizes=lists("block_sizes", int, 1), cache_slots=lists("cache_slots", int, 1),
      query_lengths=lists("query_lengths", int, 1), position=args.position, steps=args.steps,
      repeats=args.repeats, demo_cfg=cfg, methods=lists("methods", str, choices=("ar", "mtp")),
      short_prompt=args.short_prompt, new_tokens=lists("new_tokens", int, 1),
      prompt_tokens=lists("prompt_tokens", int, 1), prompt_new_tokens=args.prompt_new_tokens,
      gen_repeats=args.gen_repeats,
      demo_block_sizes=lists("demo_block_sizes", int, 1) if args.demo_block_sizes else None,
      skip_steps=args.skip_steps, skip_generation=args.skip_generation,
      workdir=args.workdir or None, num_draft_tokens=args.num_draft_tokens)


def main(argv=None):
  ap = parser()
  args = ap.parse_args(argv)
  if args.render:
    meta, results = bc.merge_runs(args.render.split(","), args.short_prompt)
    report.write_report(args.out, meta, results, markdown(results, meta))
    plot(results, meta, args.plot)
    print(f"wrote {args.out}.json, {args.out}.md and {args.plot} from {args.render}")
    return
  s = settings(ap, args)
  try:
    results = bc.run_cache_bench(s, log=lambda line: print(line, flush=True))
  except ValueError as e:
    ap.error(str(e))
  meta = report.provenance(
      command=report.command_line(__file__, argv), step_shape=s.step_shape,
      step_shape_name="quick test shape" if args.quick else "SmolLM2-135M",
      impls=s.impls, block_sizes=s.block_sizes, position=s.position, steps=s.steps,
      repeats=s.repeats, demo_config=args.config, short_prompt=s.short_prompt,
      demo_shape=("quick test shape" if args.quick else f"{args.workdir} (trained)" if args.workdir
                  else f"{args.config} shape"),
      demo_note=_WORKDIR_NOTE if args.workdir else _RANDOM_NOTE, num_draft_tokens=s.num_draft_tokens,
      demo_max_seq_len=s.demo_max_seq_len, demo_block_sizes=s.demo_block_sizes or s.block_sizes,
      gen_repeats=s.gen_repeats, prompt_sweep_new_tokens=s.prompt_new_tokens,
      machine_note=bc.MACHINE_NOTE)
  report.write_report(args.out, meta, results, markdown(results, meta))
  plot(results, meta, args.plot)
  print(f"wrote {args.out}.json, {args.out}.md and {args.plot}")


if __name__ == "__main__":
  cli.main_guard(main)
