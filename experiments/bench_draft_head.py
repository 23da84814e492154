r"""The MTP draft head over a reduced draft vocabulary V', side by side with
the full-vocabulary head (issue 22 item 3; FastMTP's compressed draft
vocabulary).

    python -m experiments.bench_draft_head [--d_model 576] [--vocab 49152] \
        [--draft_vocab 2048,4096,8192,16384] [--tokens 1,2,3,4] [--repeats 200] \
        [--out results/bench_draft_head]

Defaults are SmolLM2-135M's head (d 576, V 49,152, tied). For each query
length T (B = 1) and each |V'| (and the full vocabulary) it times, with
``mtp.timing.interleaved_times`` (median), three variants:

    logits      ``Transformer.mtp_head``: with V' the V' rows gathered, one
                [1, T, D] x [D, V'] matmul, scattered into [1, T, V] with -inf
    argmax      the MTP drafter's head and greedy draft at the last position
                (``decode.drafters.head_pick``: with V' compact, ids[argmax])
    sample      the same with a T = 1 draft sample (warp + Gumbel-max; with V'
                over V' only, q scattered back to [1, V])

each as one jitted call (the stream form: the V' rows are gathered every
call) and per iteration of a ``fori_loop`` (the while_loop form: the
parameters are loop constants and XLA hoists the gather out of the loop).

Only the head's shapes matter, so the model has one layer and one module.
Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from decode import drafters, sampling
from experiments import common
from mtp import cli, report
from mtp import config as config_lib
from mtp import draft_vocab
from mtp.model import build_model
from mtp.timing import interleaved_times


def _model(d: int, v: int, vd: int):
  cfg = config_lib.from_dict(dict(
      model=dict(vocab_size=v, d_model=d, num_layers=1, num_heads=max(d // 64, 1),
                 num_kv_heads=max(d // 64, 1), head_dim=64, mlp_dim=4 * d, tokenizer="bpe",
                 num_tokens=v),
      mtp=dict(depth=1, draft_vocab_size=vd)))
  model = build_model(cfg)
  if vd:
    rng = np.random.default_rng(0)
    draft_vocab.set_draft_vocab(model, np.sort(rng.choice(v, vd, replace=False)))
  return model


LOOP = 16      # iterations of the in-loop form


def measure(d: int, v: int, vds, tokens, repeats: int) -> list[dict]:
  """Microseconds per draft head of each variant (module docstring) for
  every T in ``tokens`` and |V'| in ``vds`` (0 = the full head first): a
  list of result dicts with ``call_us`` (one jitted call: the stream form,
  the V' rows gathered every call) and ``loop_us`` (one iteration of a
  ``fori_loop`` of LOOP over parameters closed over: the while_loop form,
  where XLA hoists the loop-invariant gather out of the loop)."""
  results = []
  for vd in [0, *vds]:
    model = _model(d, v, vd)
    graphdef, params = nnx.split(model, nnx.Param)
    for then, sp in (("logits", None), ("argmax", sampling.SamplingParams(0.0)),
                     ("sample", sampling.SamplingParams(1.0))):

      def one(params, h, u, then=then, sp=sp):
        m = nnx.merge(graphdef, params)
        if then == "logits":
          return m.mtp_head(1, h)[:, -1]
        return drafters.head_pick(m, 1, h[:, -1:], u, sp)[0]   # the drafter's path

      def loop(params, h, u, one=one):
        def body(i, acc):
          return acc + one(params, h + i.astype(h.dtype), u).astype(jnp.float32).sum()
        return jax.lax.fori_loop(0, LOOP, body, jnp.zeros((), jnp.float32))

      call_fn, loop_fn = jax.jit(one), jax.jit(loop)
      for t in tokens:
        h = jax.random.normal(jax.random.key(t), (1, t, d), jnp.float32)
        u = jax.random.uniform(jax.random.key(1), (1, vd or v), jnp.float32)
        times = interleaved_times(
            {"call": lambda: jax.block_until_ready(call_fn(params, h, u)),
             "loop": lambda: jax.block_until_ready(loop_fn(params, h, u))}, repeats, warmup=2)
        results.append({"draft_vocab": vd or v, "T": t, "variant": then,
                        "call_us": float(np.median(times["call"]) * 1e6),
                        "loop_us": float(np.median(times["loop"]) * 1e6 / LOOP)})
  return results


def markdown(results, meta, v: int) -> str:
  full = {(r["T"], r["variant"]): r for r in results if r["draft_vocab"] == v}
  lines = [f"# Draft head over a reduced vocabulary V' (d {meta['d_model']}, V {v}, B = 1)", "",
           f"{report.machine(meta)}; median over {meta['repeats']} interleaved repeats. "
           "call: one jitted call (stream form; V' rows gathered per call); loop: per "
           f"iteration of a fori_loop of {LOOP} (while_loop form; XLA hoists the gather). "
           "logits: the head only (V': scattered to [1, V]); argmax / sample: the "
           "drafter's head + pick (decode.drafters.head_pick; V': compact). x = full / this.",
           "", "| V' | T | variant | call us | x | loop us | x |", "|---|---|---|---|---|---|---|"]
  for r in results:
    base = full[(r["T"], r["variant"])]
    lines.append(f"| {r['draft_vocab']} | {r['T']} | {r['variant']} | {r['call_us']:.0f} | "
                 f"{base['call_us'] / r['call_us']:.1f} | {r['loop_us']:.0f} | "
                 f"{base['loop_us'] / r['loop_us']:.1f} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--d_model", type=int, default=576)
  ap.add_argument("--vocab", type=int, default=49152)
  ap.add_argument("--draft_vocab", default="2048,4096,8192,16384")
  ap.add_argument("--tokens", default="1,2,3,4", help="query lengths T")
  ap.add_argument("--repeats", type=int, default=200)
  ap.add_argument("--out", default="results/bench_draft_head")
  args = ap.parse_args(argv)
  vds = cli.parse_list(ap, "draft_vocab", args.draft_vocab, int, 1, args.vocab)
  tokens = cli.parse_list(ap, "tokens", args.tokens, int, 1, 64)
  cli.check_positive(ap, args, ["d_model", "vocab", "repeats"])
  cli.check_output_path("out", args.out, "prefix")
  results = measure(args.d_model, args.vocab, vds, tokens, args.repeats)
  meta = report.provenance(command=common.command_line(__file__, argv), d_model=args.d_model,
                           vocab=args.vocab, repeats=args.repeats)
  md = markdown(results, meta, args.vocab)
  report.write_report(args.out, meta, results, md)
  print(md)


if __name__ == "__main__":
  cli.main_guard(main)
