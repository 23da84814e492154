r"""Decoding cost against the KV cache's size and the tokens in it (the library
of ``scripts/bench_cache_length.py``): the dense masked attention over every
cache slot against the blockwise attention that reads only the blocks that
can be visible (``model.attention_impl``, issue 24).

(a) ``step_costs``: seconds per cached backbone step (``Transformer.backbone``,
    T query tokens, B = 1) at a fixed position for several cache sizes S,
    ``steps`` steps inside one ``lax.fori_loop`` per timed call (no host
    dispatch); ``step_ratios``: each S over the smallest, each variant over
    "dense", of the per-repeat ratios.
(b) ``generation_speed`` (``decode.bench_generation``): tokens/s of ``decode.speculative.Decoder.generate``
    (greedy, B = 1) per method, implementation, prompt and generated length,
    on random models with identical parameters (``demo_models``: the EOS
    embedding row zeroed so greedy decoding runs to its budget);
    ``generation_speedups``: dense wall / blockwise wall per repeat.
``targets``: issue 24's targets from (a) and (b). ``run_cache_bench`` runs
both parts for a ``CacheBench`` settings object; ``merge_runs`` merges the
JSON reports of parts measured apart (``--render``).

Every timing goes through ``mtp.timing.interleaved_times`` (one compiling
call per variant, then interleaved repeats with a rotating start); every
statistic is ``mtp.timing.spread``'s {min, median, max}. The generation
times are the Decoder's own (``Generation.wall_time_s``, prefill included,
host-side preparation excluded).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scripts.bench_generation import (  # noqa: F401 (part (b); names the script and tests use)
    demo_models, generation_speed, generation_speedups, impl_variants, random_prompt, stats,
    text_prompt, variant_name, with_impl, workdir_models)
from mtp import config as config_lib
from mtp.model import Transformer, init_layer_caches
from mtp.timing import interleaved_times

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json): Llama, tied embeddings
SMOLLM2_135M = dict(vocab_size=49152, d_model=576, num_layers=30, num_heads=9, num_kv_heads=3,
                    head_dim=64, mlp_dim=1536, max_seq_len=8192, rope_theta=100000.0,
                    norm_eps=1e-5, tie_embeddings=True)
QUICK_SHAPE = dict(vocab_size=264, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, mlp_dim=64, max_seq_len=1024)
MACHINE_NOTE = ("Machine shared with other jobs (2 CPU cores under load from other engineers' "
                "processes): absolute times are noisy; compare within a table.")


# -- (a) one cached step against the cache size -----------------------------------------------

def step_fn(graphdef, steps: int, t: int):
  """jitted f(params, cache, tokens [1, T], pos [1, T]) -> (cache, tokens):
  ``steps`` cached backbone calls inside one fori_loop (cache donated);
  positions advance by T per step (no hoisting of RoPE or masks), the next
  tokens depend on the output (no dead code)."""
  def body(_, carry):
    params, cache, toks, pos = carry
    m = nnx.merge(graphdef, params)
    h, cache = m.backbone(toks, pos, cache=cache)
    toks = (jnp.sum(h, -1) > 0).astype(jnp.int32) + toks          # data dependence
    return params, cache, toks % 7, pos + t

  def run(params, cache, toks, pos):
    _, cache, toks, _ = jax.lax.fori_loop(0, steps, body, (params, cache, toks, pos))
    return cache, toks
  return jax.jit(run, donate_argnums=(1,))


def _cell_name(impl, block, s) -> str:
  return f"{variant_name(impl, block)}@{s}"


def step_costs(model_cfg: config_lib.ModelConfig, variants, cache_slots: list[int], ts: list[int],
               position: int, steps: int, repeats: int, seed: int = 0, log=print) -> list[dict]:
  """Seconds per cached backbone step (B = 1) at positions ``position`` ..
  ``position + steps*T``, for every (variant, S, T): rows {impl, block_size,
  cache_slots, T, position, steps, step_s: {min, median, max}, times_s (per
  repeat)}. One set of random parameters for every variant; for each T the
  (variant, S) calls are interleaved (``interleaved_times``), so load from
  other processes hits them alike. ``log``: one line per row (None: quiet).

  Raises ValueError when the steps run past the smallest cache.
  """
  base = dataclasses.replace(model_cfg, max_seq_len=max(model_cfg.max_seq_len, max(cache_slots)))
  model = Transformer(base, 0, rngs=nnx.Rngs(params=seed))
  _, params = nnx.split(model, nnx.Param)
  del model
  rows = []
  for t in ts:
    if position + steps * t >= min(cache_slots):
      raise ValueError(f"position {position} + {steps} steps of T={t} do not fit "
                       f"S={min(cache_slots)}")
    toks = jnp.zeros((1, t), jnp.int32)
    pos = jnp.arange(position, position + t, dtype=jnp.int32)[None]
    caches = {s: init_layer_caches(base, base.num_layers, 1, s) for s in cache_slots}
    cells, fns = {}, {}
    for impl, block in variants:
      abstract = nnx.eval_shape(lambda c=with_impl(base, impl, block):
                                Transformer(c, 0, rngs=nnx.Rngs(0)))
      fn = step_fn(nnx.split(abstract, nnx.Param)[0], steps, t)
      for s in cache_slots:
        def call(fn=fn, s=s):
          caches[s], out = fn(params, caches[s], toks, pos)
          jax.block_until_ready(out)
        name = _cell_name(impl, block, s)
        cells[name], fns[name] = {"impl": impl, "block_size": block, "cache_slots": s, "T": t}, call
    times = interleaved_times(fns, repeats, warmup=1)
    for name, row in cells.items():
      per_step = [float(x) / steps for x in times[name]]
      row.update(position=position, steps=steps, step_s=stats(per_step), times_s=per_step)
      rows.append(row)
      if log is not None:
        log(f"T={t} S={row['cache_slots']:5d} {variant_name(row['impl'], row['block_size']):14s} "
            f"{row['step_s']['median'] * 1e3:8.2f} ms/step (min {row['step_s']['min'] * 1e3:.2f})")
    del caches
  return rows


def step_ratios(rows: list[dict]) -> list[dict]:
  """Per (variant, T): the step cost at each S over the smallest S (median of
  the per-repeat ratios, and min/max), and per (S, T) each variant over
  "dense" (same statistics). Rows {kind, impl, block_size, T, cache_slots,
  ratio: {min, median, max}}."""
  out = []
  groups = {}
  for r in rows:
    groups.setdefault((r["impl"], r["block_size"], r["T"]), []).append(r)
  for (impl, block, t), sel in groups.items():
    base = min(sel, key=lambda r: r["cache_slots"])
    for r in sel:
      ratio = np.asarray(r["times_s"]) / np.asarray(base["times_s"])
      out.append({"kind": "vs_smallest_cache", "impl": impl, "block_size": block, "T": t,
                  "cache_slots": r["cache_slots"], "base_cache_slots": base["cache_slots"],
                  "ratio": stats(ratio)})
  dense = {(r["cache_slots"], r["T"]): r for r in rows if r["impl"] == "dense"}
  for r in rows:
    d = dense.get((r["cache_slots"], r["T"]))
    if d is not None and r["impl"] != "dense":
      ratio = np.asarray(d["times_s"]) / np.asarray(r["times_s"])
      out.append({"kind": "speedup_vs_dense", "impl": r["impl"], "block_size": r["block_size"],
                  "T": r["T"], "cache_slots": r["cache_slots"], "ratio": stats(ratio)})
  return out


def _paired(num: list, den: list) -> tuple[dict, float]:
  """(stats of the per-repeat num/den, ratio of the minimums)."""
  return stats(np.asarray(num) / np.asarray(den)), min(num) / min(den)


def targets(results: dict, short_prompt: int) -> list[dict]:
  """The issue's targets, per blockwise variant: step(S_max) / step(S_min)
  at each T (<= 1.15), end-to-end speedup vs dense at (short prompt, 1024
  new) per method (>= 1.3) and at (256, 128) (no regression). Rows {target,
  impl, case, value: {min, median, max} of the paired per-repeat ratios,
  of_minimums: the ratio of the fastest repeats (the least disturbed by
  other processes on a shared machine), goal}."""
  out = []
  steps = results.get("steps") or []
  if steps:
    lo, hi = min(r["cache_slots"] for r in steps), max(r["cache_slots"] for r in steps)
    cell = {(r["impl"], r["block_size"], r["T"], r["cache_slots"]): r for r in steps}
    for (impl, block, t, s), r in cell.items():
      if impl == "dense" or s != hi or (impl, block, t, lo) not in cell:
        continue
      value, of_min = _paired(r["times_s"], cell[(impl, block, t, lo)]["times_s"])
      out.append({"target": f"step S={hi} / S={lo}", "impl": variant_name(impl, block),
                  "case": f"T={t}", "goal": "<= 1.15", "value": value, "of_minimums": of_min})
  gen = results.get("generation") or []
  ref = {(r["method"], r["prompt_tokens"], r["new_tokens"]): r for r in gen if r["impl"] == "dense"}
  for r in gen:
    key = (r["method"], r["prompt_tokens"], r["new_tokens"])
    if r["impl"] == "dense" or key not in ref:
      continue
    if key[1:] == (short_prompt, 1024):
      what, goal = f"{short_prompt}-token prompt, 1024 new: speedup vs dense", ">= 1.3"
    elif key[1:] == (256, 128):
      what, goal = "256-token prompt, 128 new: speedup vs dense", ">= 1 (no regression beyond noise)"
    else:
      continue
    value, of_min = _paired(ref[key]["times_s"], r["times_s"])
    out.append({"target": what, "impl": r["impl"], "case": r["method"], "goal": goal,
                "value": value, "of_minimums": of_min})
  return out


# -- the whole study ----------------------------------------------------------------------------

@dataclasses.dataclass
class CacheBench:
  """Settings of one study (scripts/bench_cache_length.py's flags).

  (a): step_shape (ModelConfig fields), impls, block_sizes, cache_slots,
  query_lengths (T), position, steps, repeats; skip_steps. (b): demo_cfg
  (the demo model's Config, random init), methods, short_prompt,
  new_tokens, prompt_tokens, prompt_new_tokens, gen_repeats,
  demo_block_sizes (None: block_sizes); skip_generation."""
  step_shape: dict
  impls: list[str]
  block_sizes: list[int]
  cache_slots: list[int]
  query_lengths: list[int]
  position: int
  steps: int
  repeats: int
  demo_cfg: config_lib.Config
  methods: list[str]
  short_prompt: int
  new_tokens: list[int]
  prompt_tokens: list[int]
  prompt_new_tokens: int
  gen_repeats: int
  demo_block_sizes: list[int] | None = None
  skip_steps: bool = False
  skip_generation: bool = False
  workdir: str | None = None    # (b) on this trained/imported BPE model instead of demo_cfg
  num_draft_tokens: int = 2

  @property
  def cases(self) -> list[tuple[int, int]]:
    """(prompt tokens, new tokens) of (b): the new-token sweep at the short
    prompt, then the prompt sweep (duplicates dropped)."""
    return list(dict.fromkeys([(self.short_prompt, n) for n in self.new_tokens]
                              + [(p, self.prompt_new_tokens) for p in self.prompt_tokens]))

  @property
  def demo_max_seq_len(self) -> int:
    """The demo models' max_seq_len: the longest request + 64 (or the config's)."""
    longest = max(self.short_prompt + max(self.new_tokens),
                  max(self.prompt_tokens) + self.prompt_new_tokens)
    return max(self.demo_cfg.model.max_seq_len, longest + 64)


def run_cache_bench(s: CacheBench, log=print) -> dict:
  """Both parts (those not skipped) and the targets: {"steps",
  "step_ratios", "generation", "generation_speedups", "targets"} (empty
  lists for a skipped part). Raises ValueError for (a)'s steps past the
  smallest cache."""
  results = {"steps": [], "step_ratios": [], "generation": [], "generation_speedups": [],
             "targets": []}
  if not s.skip_steps:
    step_cfg = config_lib.validate(config_lib.Config(
        model=config_lib.ModelConfig(**s.step_shape), mtp=config_lib.MTPConfig(depth=0))).model
    results["steps"] = step_costs(step_cfg, impl_variants(s.impls, s.block_sizes), s.cache_slots,
                                  s.query_lengths, s.position, s.steps, s.repeats, log=log)
    results["step_ratios"] = step_ratios(results["steps"])
  if not s.skip_generation:
    blocks = s.demo_block_sizes or s.block_sizes
    max_len = max(p + n for p, n in s.cases) + 64
    if s.workdir:
      models, tokenizer = workdir_models(s.workdir, impl_variants(s.impls, blocks), max_len)
      prompt_fn = lambda n, seed: text_prompt(tokenizer, n, seed)
    else:
      models, tokenizer = demo_models(s.demo_cfg, impl_variants(s.impls, blocks), max_len), None
      prompt_fn = None
    results["generation"] = generation_speed(models, s.methods, s.cases, s.gen_repeats, log=log,
                                             num_draft_tokens=s.num_draft_tokens,
                                             prompt_fn=prompt_fn, tokenizer=tokenizer)
    results["generation_speedups"] = generation_speedups(results["generation"])
  results["targets"] = targets(results, s.short_prompt)
  return results


# meta fields that describe part (b): taken from the run that measured it
_GENERATION_META = ("demo_config", "demo_shape", "demo_max_seq_len", "demo_block_sizes",
                    "gen_repeats", "prompt_sweep_new_tokens", "short_prompt", "demo_note",
                    "num_draft_tokens")


def merge_runs(paths: list[str], default_short_prompt: int) -> tuple[dict, dict]:
  """(meta, results) of the JSON reports at ``paths`` (parts of one study
  run apart: ``--skip_steps`` / ``--skip_generation``), merged: commands
  joined with " && ", part (b)'s meta from the run that measured it, a
  non-empty result list over an empty one; targets recomputed."""
  meta, results = {}, {}
  for path in paths:
    with open(path) as f:
      saved = json.load(f)
    for k, v in saved["meta"].items():
      if k == "command" and meta.get("command"):
        meta[k] = f"{meta[k]} && {v}"
      elif k not in meta or k in _GENERATION_META:
        if k not in meta or saved["results"].get("generation"):
          meta[k] = v
    for k, v in saved["results"].items():
      if v or k not in results:
        results[k] = v
  results["targets"] = targets(results, meta.get("short_prompt", default_short_prompt))
  return meta, results
