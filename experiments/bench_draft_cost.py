r"""Drafting cost ratio c against target depth: how the MTP drafter's cost
per draft token compares with one target step as the target gets deeper.

    python -m experiments.bench_draft_cost --config configs/tiny.py --layers 2,4,8,16 \
        --num_draft_tokens 1,2 [--out results/bench_draft_cost]

An MTP module is one transformer block (plus a projection and the shared
head) run over a window of G+k positions (docs/design.md section 6), so its
FLOP share of a target step shrinks like 1/L with the target's L layers
(DeepSeek-V3: 1 module next to 61 layers). Acceptance does not matter for c,
so the targets are randomly initialised copies of ``--config`` with
``model.num_layers`` = L and ``mtp.depth`` = max(G). For each L and G it
reports the measured c (drafting step and one target forward, both inside a
``lax.fori_loop``: no host dispatch, as in the while_loop decoding form), the
FLOP share c (XLA cost analysis), their ratio (per-op overhead on top of
FLOPs), and the ideal speedup they imply at a few acceptance rates
(Leviathan et al. 2023, Theorem 3.8).
"""

from __future__ import annotations

import dataclasses

from mtp import cli

if __name__ == "__main__":     # a flag out of range: one line, before the imports below load jax
  from decode.limits import MAX_DRAFT_TOKENS
  cli.refuse_bad_flags(layers=(list, int, 1), num_draft_tokens=(list, int, 1, MAX_DRAFT_TOKENS),
                       repeats=(int, 1), max_new_tokens=(int, 1))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from decode.cli import theory  # noqa: E402
from decode.decoder import MAX_DRAFT_TOKENS, DecodeError, Decoder, SamplingParams  # noqa: E402
from experiments import common  # noqa: E402
from mtp import report  # noqa: E402
from mtp import config as config_lib  # noqa: E402
from mtp.model import build_model  # noqa: E402
from scripts.bench_lib import bare_forward_s, draft_flop_share, draft_time_s  # noqa: E402


# -- the library: c against target depth ------------------------------------------------

DRAFT_COST_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    return 0\n"
ALPHAS = (0.6, 0.8, 0.9)     # acceptance rates of draft_cost_vs_depth's ideal speedups


def draft_cost_vs_depth(cfg: config_lib.Config, layers: int, gs: list[int], repeats: int, max_new: int,
                        log=print) -> list[dict]:
  """Rows {layers, num_draft_tokens, c, c_flops, overhead, draft_s, forward_s, ideal_speedup}
  for a random target copy of ``cfg`` with ``layers`` layers and MTP depth
  max(gs): c = ``draft_time_s`` / (G x one in-loop ``bare_forward_s`` over
  1 token), batch 1, T = 0, prompt
  ``DRAFT_COST_PROMPT``; c_flops = ``draft_flop_share``; ideal_speedup
  {alpha: Theorem 3.8} at ``ALPHAS``. ``log`` gets one line per G."""
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers),
                            mtp=dataclasses.replace(cfg.mtp, depth=max(gs)))
  target = build_model(config_lib.validate(cfg))
  cache_len = 64 * -(-(len(DRAFT_COST_PROMPT) + 1 + max_new + 64) // 64)
  fwd = bare_forward_s(target, 1, 1, cache_len, repeats, in_loop=True)
  sp = SamplingParams(temperature=0.0)
  rows = []
  for g in gs:
    dec = Decoder(target, "mtp", g)
    draft_s = draft_time_s(dec, [DRAFT_COST_PROMPT], max_new, sp, repeats)
    c = draft_s / (g * fwd)
    c_flops = draft_flop_share(dec, [DRAFT_COST_PROMPT], max_new, sp)
    rows.append({"layers": layers, "num_draft_tokens": g, "c": c, "c_flops": c_flops,
                 "overhead": c / c_flops, "draft_s": draft_s, "forward_s": fwd,
                 "ideal_speedup": {str(a): theory.ideal_speedup(a, g, c) for a in ALPHAS}})
    log(f"L={layers:3d} G={g}: c {c:.3f}  c(FLOPs) {c_flops:.3f}  forward {fwd * 1e3:.3f} ms  "
        f"draft {draft_s * 1e3:.3f} ms")
  return rows


# -- report and main -------------------------------------------------------------------

def markdown(rows: list[dict], meta: dict) -> str:
  lines = [f"Drafting cost ratio c vs target depth: random-init copies of {meta['config_file']} "
           f"(d_model {meta['d_model']}), batch 1, T=0; {report.machine(meta)}, "
           f"JAX {meta['jax_version']}, commit {meta['commit']}, {meta['date']}; median of "
           f"{report.plural(meta['repeats'], 'repeat')} of 20 in-loop steps.", "",
           "| L | G | target forward ms | drafting ms | c | c (FLOPs) | c / c (FLOPs) | "
           + " | ".join(f"ideal speedup alpha={a}" for a in ALPHAS) + " |",
           "|---|---|---|---|---|---|---|" + "---|" * len(ALPHAS)]
  for r in rows:
    lines.append(f"| {r['layers']} | {r['num_draft_tokens']} | {r['forward_s'] * 1e3:.3f} | "
                 f"{r['draft_s'] * 1e3:.3f} | {r['c']:.3f} | {r['c_flops']:.3f} | {r['overhead']:.2f} | "
                 + " | ".join(f"{r['ideal_speedup'][str(a)]:.2f}" for a in ALPHAS) + " |")
  return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
  fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=100)
  for g in sorted({r["num_draft_tokens"] for r in rows}):
    sel = [r for r in rows if r["num_draft_tokens"] == g]
    ls = [r["layers"] for r in sel]
    ax.plot(ls, [r["c"] for r in sel], "o-", label=f"G={g} measured")
    ax.plot(ls, [r["c_flops"] for r in sel], "s--", label=f"G={g} FLOP share")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("target layers L")
  ax.set_ylabel("cost ratio c per draft token")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  common.save_figure(fig, path)


def main(argv=None):
  ap = cli.OneLineParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--config", default="configs/tiny.py", help="config file (d_model, heads, MLP)")
  ap.add_argument("--layers", default="2,4,8,16", help="comma list of target depths L >= 1")
  ap.add_argument("--num_draft_tokens", default="1,2", help="comma list of G >= 1")
  ap.add_argument("--repeats", type=int, default=5, help="timed repeats, >= 1")
  ap.add_argument("--max_new_tokens", type=int, default=128, help="KV cache room in new tokens, >= 1")
  ap.add_argument("--out", default="results/bench_draft_cost", help="output prefix")
  ap.add_argument("--quick", action="store_true",
                  help="tiny sizes for tests: d_model 32, the first 2 --layers and first G, and "
                       "--repeats 1 --max_new_tokens 8 where not given")
  args = ap.parse_args(argv)
  if args.quick:
    cli.apply_quick(ap, args, repeats=1, max_new_tokens=8)
  cli.check_range(ap, args, repeats=1, max_new_tokens=1)
  cli.check_output_path("out", args.out, "prefix")
  layers = cli.parse_list(ap, "layers", args.layers, int, 1)
  gs = cli.parse_list(ap, "num_draft_tokens", args.num_draft_tokens, int, 1, MAX_DRAFT_TOKENS)
  cfg = common.load_config(ap, args.config)
  if args.quick:
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=256))
    layers, gs = layers[:2], gs[:1]
  rows = [r for n in layers for r in draft_cost_vs_depth(cfg, n, gs, args.repeats, args.max_new_tokens,
                                                         log=lambda s: print(s, flush=True))]
  meta = report.provenance(config_file=args.config, d_model=cfg.model.d_model, layers=layers,
                           num_draft_tokens=gs, repeats=args.repeats,
                           command=common.command_line(__file__, argv))
  report.write_report(args.out, meta, rows, markdown(rows, meta))
  plot(rows, args.out + ".png")
  print(f"wrote {args.out}.json, {args.out}.md and {args.out}.png")


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError,))
