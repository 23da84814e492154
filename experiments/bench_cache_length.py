r"""Decoding cost against the KV cache's size and the tokens in it: the dense
masked attention over every cache slot against the blockwise attention that
reads only the blocks that can be visible (``model.attention_impl``, issue 24).

    python -m experiments.bench_cache_length [--quick] [--out results/bench_cache_length]

(a) Step cost: one cached backbone step (``Transformer.backbone``, T = 1 and
    a T = 4 verify block) at position ~``--position`` with S cache slots, S in
    ``--cache_slots``, on the shape of SmolLM2-135M (30 layers, d_model 576,
    GQA 9/3 heads of 64, SwiGLU 1536, vocabulary 49152; random weights, fp32,
    B = 1), ``--steps`` steps inside one ``lax.fori_loop`` per timed call (no
    host dispatch), every implementation and block size of ``--block_sizes``
    timed side by side, interleaved, ``--repeats`` times.
(b) End to end: tokens/s of ``decode.decoder.Decoder.generate`` (AR and
    MTP with G = D = 2, greedy, B = 1) on the demo model (``--config``,
    randomly initialised, max_seq_len raised to fit the longest request; the
    EOS embedding row is zeroed so that greedy decoding never stops early)
    against the generated length (``--new_tokens`` from a ~50-token prompt)
    and the prompt length (``--prompt_tokens``, 128 new tokens), both
    implementations side by side in one process, repeats interleaved. Both
    implementations must emit the same tokens (checked, reported).

Writes OUT.json / OUT.md (provenance: mtp/report.py) and the plot
``--plot`` (default docs/bench_cache_length.png). Timing with
``mtp.timing.interleaved_times``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from decode.decoder import Decoder, SamplingParams  # noqa: E402
from experiments import common  # noqa: E402
from mtp import cli, report  # noqa: E402
from mtp import config as config_lib  # noqa: E402
from mtp import tokenizer as tok  # noqa: E402
from mtp.model import Transformer, build_model, init_layer_caches  # noqa: E402
from mtp.timing import interleaved_times, spread  # noqa: E402


# -- the library: decoding cost against the KV cache ---------------------------------------
#
# Decoding cost against the KV cache's size and the tokens in it: the dense
# masked attention over every cache slot against the blockwise attention that
# reads only the blocks that can be visible (``model.attention_impl``, issue 24).
#
# (a) ``step_costs``: seconds per cached backbone step (``Transformer.backbone``,
#     T query tokens, B = 1) at a fixed position for several cache sizes S,
#     ``steps`` steps inside one ``lax.fori_loop`` per timed call (no host
#     dispatch); ``step_ratios``: each S over the smallest, each variant over
#     "dense", of the per-repeat ratios.
# (b) ``generation_speed`` (below): tokens/s of ``decode.decoder.Decoder.generate``
#     (greedy, B = 1) per method, implementation, prompt and generated length,
#     on random models with identical parameters (``demo_models``: the EOS
#     embedding row zeroed so greedy decoding runs to its budget);
#     ``generation_speedups``: dense wall / blockwise wall per repeat.
# ``targets``: issue 24's targets from (a) and (b). ``run_cache_bench`` runs
# both parts for a ``CacheBench`` settings object; ``merge_runs`` merges the
# JSON reports of parts measured apart (``--render``).
#
# Every timing goes through ``mtp.timing.interleaved_times`` (one compiling
# call per variant, then interleaved repeats with a rotating start); every
# statistic is ``mtp.timing.spread``'s {min, median, max}. The generation
# times are the Decoder's own (``Generation.wall_time_s``, prefill included,
# host-side preparation excluded).

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
  """Settings of one study (experiments/bench_cache_length.py's flags).

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


# -- the library, part (b): Decoder.generate against the lengths ---------------------------
#
# Part (b): tokens/s of ``decode.decoder.Decoder.generate`` (greedy, B =
# 1) per method, attention implementation, prompt and generated length, on
# models with identical parameters: random demo models (``demo_models``) or a
# trained / imported BPE workdir (``workdir_models``); ``generation_speedups``:
# dense wall / blockwise wall per repeat. Timing with
# ``mtp.timing.interleaved_times``; statistics ``mtp.timing.spread``'s
# {min, median, max}.

_STATS = ("min", "median", "max")


def stats(xs) -> dict:
  """{"min", "median", "max"} of a list of numbers (``mtp.timing.spread``)."""
  return spread(xs, _STATS)


def impl_variants(impls: list[str], block_sizes: list[int]) -> list[tuple[str, int | None]]:
  """(attention_impl, block size or None) pairs: every block size for
  "blockwise", one entry for the others."""
  out = []
  for impl in impls:
    out += [(impl, b) for b in block_sizes] if impl == "blockwise" else [(impl, None)]
  return out


def variant_name(impl: str, block: int | None) -> str:
  """"dense", "blockwise/128"."""
  return impl if block is None else f"{impl}/{block}"


def with_impl(model_cfg: config_lib.ModelConfig, impl: str,
              block: int | None) -> config_lib.ModelConfig:
  """``model_cfg`` with ``attention_impl`` (and ``attention_block_size``) set."""
  kw = {"attention_impl": impl}
  if block is not None:
    kw["attention_block_size"] = block
  return dataclasses.replace(model_cfg, **kw)


def demo_models(cfg: config_lib.Config, variants, max_len: int, seed: int = 0) -> dict:
  """{variant name: Transformer} for (impl, block) ``variants``, identical
  random parameters (``cfg`` with ``model.max_seq_len`` >= max_len and the
  EOS embedding row zeroed: its logit is exactly 0 while the largest of the
  others is positive, so greedy decoding runs to its token budget)."""
  out = {}
  for impl, block in variants:
    m_cfg = with_impl(dataclasses.replace(cfg.model,
                                          max_seq_len=max(cfg.model.max_seq_len, max_len)),
                      impl, block)
    model = build_model(config_lib.validate(dataclasses.replace(cfg, model=m_cfg)), seed)
    model.embed.embedding[...] = model.embed.embedding[...].at[tok.EOS_ID].set(0.0)
    out[variant_name(impl, block)] = model
  return out


def workdir_models(path: str, variants, max_len: int) -> tuple[dict, object]:
  """({variant name: Transformer}, tokenizer) for (impl, block) ``variants``
  of the trained or imported model in ``path`` (a workdir or an export;
  ``mtp.loading.load_model``), every variant holding the same parameters.
  The tokenizer's stop ids are added to ``model.never_emitted`` (BPE
  tokenizers only; probability exactly 0), so greedy decoding runs to its
  budget as with ``demo_models``. Raises CheckpointError (unreadable path),
  ValueError (max_len past the model's ``max_seq_len``, a byte-level model:
  use ``demo_models``)."""
  from mtp import loading
  cfg, model, _ = loading.load_model(path)
  tokenizer = tok.load_tokenizer(path)
  if cfg.model.tokenizer != "bpe":
    raise ValueError(f"{path}: a byte-level model; measure it with --config (demo_models)")
  if max_len > cfg.model.max_seq_len:
    raise ValueError(f"the longest request needs {max_len} positions; {path} has "
                     f"model.max_seq_len={cfg.model.max_seq_len}")
  never = [x for x in cfg.model.never_emitted.split(",") if x.strip()]
  never = ",".join(dict.fromkeys(never + [str(i) for i in tokenizer.stop_ids]))
  _, params = nnx.split(model, nnx.Param)
  out = {}
  for impl, block in variants:
    m_cfg = with_impl(dataclasses.replace(cfg.model, never_emitted=never), impl, block)
    v_cfg = config_lib.validate(dataclasses.replace(cfg, model=m_cfg))
    graphdef, _ = nnx.split(nnx.eval_shape(lambda c=v_cfg: build_model(c)), nnx.Param)
    out[variant_name(impl, block)] = nnx.merge(graphdef, params)
  return out, tokenizer


def random_prompt(n: int, seed: int) -> np.ndarray:
  """BOS + n random printable ASCII bytes (int32)."""
  rng = np.random.default_rng(seed)
  return np.concatenate([[tok.BOS_ID], rng.integers(32, 127, n)]).astype(np.int32)


def text_prompt(tokenizer, n: int, seed: int) -> np.ndarray:
  """n token ids (int32) of real text for a BPE model: the held-out chat
  prompts (``mtp/data/heldout_chat.jsonl``) joined, encoded as text (no
  specials), repeated to length and read from an offset set by ``seed``."""
  import importlib.resources
  lines = importlib.resources.files("mtp.data").joinpath("heldout_chat.jsonl").read_text()
  text = "\n\n".join(json.loads(l)["prompt"] for l in lines.splitlines() if l.strip())
  ids = np.asarray(tokenizer.encode(text), np.int32)
  reps = -(-(n + len(ids)) // len(ids))
  start = seed % len(ids)
  return np.tile(ids, reps)[start:start + n]


def _generation_row(method, impl, p_len, n_new, gens, first) -> dict:
  g = gens[-1]
  walls = [x.wall_time_s for x in gens]
  emitted, calls = len(g.tokens[0]), int(g.target_calls[0])
  return {"method": method, "impl": impl, "prompt_tokens": p_len, "new_tokens": n_new,
          "emitted": emitted, "wall_s": stats(walls),
          "prefill_s": stats([x.prefill_time_s for x in gens]),
          "tokens_per_s": emitted / float(np.median(walls)), "tau": emitted / max(calls, 1),
          "tokens_equal": bool(np.array_equal(g.tokens[0], first.tokens[0])), "times_s": walls}


def generation_speed(models: dict, methods: list[str], cases: list[tuple[int, int]], repeats: int,
                     num_draft_tokens: int = 2, log=print, prompt_fn=None,
                     tokenizer=None) -> list[dict]:
  """tokens/s of ``Decoder.generate`` (greedy, B = 1) per (method, impl,
  prompt tokens, new tokens): rows {method, impl, prompt_tokens, new_tokens,
  emitted, wall_s, prefill_s (each {min, median, max} of the Decoder's own
  times), tokens_per_s (emitted tokens over the median wall time, prefill
  included), tau, tokens_equal (same tokens as the first impl), times_s}.
  Impls interleaved (``interleaved_times``) after one compiling call each.
  ``prompt_fn(n, seed)``: the prompt of n tokens (default ``random_prompt``);
  ``tokenizer``: the models' tokenizer (None: the byte tokenizer)."""
  prompt_fn = prompt_fn or random_prompt
  sp = SamplingParams(temperature=0.0)
  rows = []
  for method in methods:
    decs = {impl: Decoder(m, method, 0 if method == "ar" else num_draft_tokens, tokenizer=tokenizer)
            for impl, m in models.items()}
    for p_len, n_new in cases:
      prompt = [prompt_fn(p_len, seed=p_len)]
      gens = {impl: [] for impl in decs}
      interleaved_times({impl: (lambda impl=impl: gens[impl].append(
          decs[impl].generate(prompt, n_new, sp))) for impl in decs}, repeats, warmup=1)
      gens = {impl: g[1:] for impl, g in gens.items()}           # the timed repeats
      first = next(iter(gens.values()))[-1]
      for impl, g in gens.items():
        row = _generation_row(method, impl, p_len, n_new, g, first)
        rows.append(row)
        if log is not None:
          log(f"{method:3s} prompt {p_len:5d} new {n_new:5d} {impl:10s} "
              f"{row['tokens_per_s']:9.1f} tok/s (wall {row['wall_s']['median'] * 1e3:.1f} ms, "
              f"prefill {row['prefill_s']['median'] * 1e3:.1f} ms, tau {row['tau']:.2f}, "
              f"same tokens {row['tokens_equal']})")
  return rows


def generation_speedups(rows: list[dict], base: str = "dense") -> list[dict]:
  """Per (method, prompt, new, impl != base): base wall / impl wall
  ({min, median, max} of the per-repeat ratios, repeats paired in order)."""
  ref = {(r["method"], r["prompt_tokens"], r["new_tokens"]): r for r in rows if r["impl"] == base}
  out = []
  for r in rows:
    b = ref.get((r["method"], r["prompt_tokens"], r["new_tokens"]))
    if b is None or r["impl"] == base:
      continue
    ratio = np.asarray(b["times_s"]) / np.asarray(r["times_s"])
    out.append({"method": r["method"], "impl": r["impl"], "prompt_tokens": r["prompt_tokens"],
                "new_tokens": r["new_tokens"], "speedup": stats(ratio)})
  return out


# -- command line --------------------------------------------------------------------------

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
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  common.save_figure(fig, path)


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
                       "position 20, 2 steps, 1 repeat, 16/32 new tokens, prompts 12/16")
  return ap


def settings(ap: argparse.ArgumentParser, args) -> CacheBench:
  """The study's settings from the flags (``ap.error`` naming a bad one)."""
  if args.quick:
    cli.apply_quick(ap, args, cache_slots="64,256", position=20, steps=2, repeats=1,
                    new_tokens="16,32", prompt_tokens="12,16", prompt_new_tokens=16, gen_repeats=1,
                    short_prompt=16)
  cli.check_range(ap, args, position=0, steps=1, repeats=1, short_prompt=1, prompt_new_tokens=1,
                  gen_repeats=1, num_draft_tokens=1)
  if args.workdir and not os.path.isdir(args.workdir):
    ap.error(f"--workdir={args.workdir!r}: no such directory")
  lists = lambda name, typ, lo=None, choices=None: cli.parse_list(
      ap, name, getattr(args, name), typ, lo, choices=choices)
  cfg = common.load_config(ap, args.config)
  if args.quick:
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **QUICK_SHAPE))
  return CacheBench(
      step_shape=dict(QUICK_SHAPE if args.quick else SMOLLM2_135M),
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
    cli.check_output_path("out", args.out, "prefix")
    cli.check_output_path("plot", args.plot)
    meta, results = merge_runs(args.render.split(","), args.short_prompt)
    report.write_report(args.out, meta, results, markdown(results, meta))
    plot(results, meta, args.plot)
    print(f"wrote {args.out}.json, {args.out}.md and {args.plot} from {args.render}")
    return
  s = settings(ap, args)
  cli.check_output_path("out", args.out, "prefix")
  cli.check_output_path("plot", args.plot)
  try:
    results = run_cache_bench(s, log=lambda line: print(line, flush=True))
  except ValueError as e:
    ap.error(str(e))
  meta = report.provenance(
      command=common.command_line(__file__, argv), step_shape=s.step_shape,
      step_shape_name="quick test shape" if args.quick else "SmolLM2-135M",
      impls=s.impls, block_sizes=s.block_sizes, position=s.position, steps=s.steps,
      repeats=s.repeats, demo_config=args.config, short_prompt=s.short_prompt,
      demo_shape=("quick test shape" if args.quick else f"{args.workdir} (trained)" if args.workdir
                  else f"{args.config} shape"),
      demo_note=_WORKDIR_NOTE if args.workdir else _RANDOM_NOTE, num_draft_tokens=s.num_draft_tokens,
      demo_max_seq_len=s.demo_max_seq_len, demo_block_sizes=s.demo_block_sizes or s.block_sizes,
      gen_repeats=s.gen_repeats, prompt_sweep_new_tokens=s.prompt_new_tokens,
      machine_note=MACHINE_NOTE)
  report.write_report(args.out, meta, results, markdown(results, meta))
  plot(results, meta, args.plot)
  print(f"wrote {args.out}.json, {args.out}.md and {args.plot}")


if __name__ == "__main__":
  cli.main_guard(main)
