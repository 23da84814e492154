r"""Part (b) of ``scripts/bench_cache_length.py`` (``decode.bench_cache``):
tokens/s of ``decode.speculative.Decoder.generate`` (greedy, B = 1) per
method, attention implementation, prompt and generated length, on models
with identical parameters: random demo models (``demo_models``) or a
trained / imported BPE workdir (``workdir_models``); ``generation_speedups``:
dense wall / blockwise wall per repeat. Timing with
``mtp.timing.interleaved_times``; statistics ``mtp.timing.spread``'s
{min, median, max}.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from flax import nnx

from decode.speculative import Decoder, SamplingParams
from mtp import config as config_lib
from mtp import tokenizer as tok
from mtp.model import build_model
from mtp.timing import interleaved_times, spread


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


