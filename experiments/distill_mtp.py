r"""MTP modules distilled from the main head (issue 12): acceptance before and
after a second training stage on a trained model, against a data-only
stage of the same budget.

    python -m experiments.distill_mtp --workdir runs/tiny --runs_dir runs/distill_tiny \
        --out results/distill_mtp_tiny
    python -m experiments.distill_mtp --workdir runs/reference --runs_dir runs/distill_reference \
        --batch_size 8 --out results/distill_mtp_reference

From the trained base workdir (never written to) the script

1. (variants with self-distilled data) samples ``--sd_docs`` documents from
   the base model with ``scripts.self_distill`` (MTP speculative sampling at
   ``--sd_temperature``, prompts cut from training documents) into a TFDS
   dataset under ``RUNS_DIR/tfds`` (reused when present with the same recipe);
2. trains one stage per (variant, seed) in ``RUNS_DIR/<variant>_s<seed>``:
   ``train.init_from=BASE``, ``train.freeze_backbone=True`` (only the MTP
   modules learn: the main model, hence AR output, is bitwise unchanged),
   ``--num_steps`` steps of ``--batch_size`` x ``--seq_len`` tokens, AdamW at
   ``--learning_rate`` with warmup and cosine decay; the seed sets the data
   order. ``--seq_len`` defaults to the decoding context (prompt + new
   tokens) when that is longer than the base's: the modules must match the
   main head at the positions where they will draft (on the demo model,
   distilling at 128 tokens and decoding up to ~250 left alpha_1 at T = 0
   at 0.85, distilling at 256 raised it to 0.90). Variants (``--variants``):

   - ``data``: data cross-entropy only (distill_weight 0): the control, what
     more steps of today's objective give;
   - ``kl``: teacher only (distill_weight ``--distill_weight``, default 1;
     ``--distill_divergence``, default forward KL), on the corpus;
   - ``kl_sd``: the same on self-distilled data;
   - ``kl_sd_rec``: the same plus ``--recursive_steps`` R steps of module D
     trained on its own outputs (what drafting G > D reuses);
   - ``kl_rec``: teacher only on the corpus plus the recursive steps.

   A finished stage is reused, an interrupted one resumes.
3. measures, on ``--prompts`` held-out prompts (validation split of the
   base's dataset) x ``--max_new_tokens`` tokens at each temperature, the
   per-position acceptance alpha_k and tau (tokens per target call) of MTP
   speculative decoding with G = D and G = D + R, for the base and every
   stage (all prompts decoded as one batch; acceptance does not depend on
   the batch). Speedup over AR of the same model (batch 1, while_loop form,
   ``scripts.bench_lib.measure_point``) on the first ``--speed_prompts`` prompts.
4. reports per variant the mean over seeds [min, max] of alpha_k, tau and
   speedup, the ratio of tau to the base and to the ``data`` control, the
   validation KL to the main head and argmax agreement per depth, the cost
   of each stage (steps, tokens, seconds) and of the self-distilled data
   (seconds, tokens), and whether the issue's targets are met: alpha_1 >=
   0.9 at T = 0 and >= 0.88 at T = 1, tau at G = D and T = 1 at least 1.3 x
   that of the data-only modules (the base's, and the ``data`` control's).

Writes OUT.json (meta: provenance, base config, budget, commands; results:
stages, acceptance rows, speed rows, tables) and OUT.md starting with the
command. ``--quick`` runs test-sized budgets (the tests use it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from mtp import cli

if __name__ == "__main__":     # a flag out of range: one line, before the imports below load jax
  cli.refuse_bad_flags(seeds=(list, int, 0), temperatures=(list, float, 0), num_steps=(int, 1),
                       batch_size=(int, 1), seq_len=(int, 0), warmup_steps=(int, 0),
                       eval_batches=(int, 1), recursive_steps=(int, 1), sd_docs=(int, 1),
                       sd_prompt_bytes=(int, 1), sd_max_new_tokens=(int, 1), sd_batch_size=(int, 1),
                       prompts=(int, 1), prompt_bytes=(int, 1), max_new_tokens=(int, 1),
                       speed_prompts=(int, 0), speed_repeats=(int, 1),
                       distill_weight=(float, 0, 1, True))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from decode.cli import stats as stats_lib  # noqa: E402
from decode.decoder import DecodeError, Decoder, SamplingParams  # noqa: E402
from experiments import common  # noqa: E402
from mtp import loading  # noqa: E402
from mtp import report  # noqa: E402
from mtp import config as config_lib  # noqa: E402
from mtp import data as data_lib  # noqa: E402
from mtp import tokenizer as tok  # noqa: E402
from mtp.config import Config, ConfigError  # noqa: E402
from mtp.timing import format_spread, spread  # noqa: E402
from scripts.bench_lib import measure_point  # noqa: E402

VARIANTS = {            # name: (distill weight: None = --distill_weight, data, recursive steps on)
    "data": (0.0, "corpus", False),
    "kl": (None, "corpus", False),
    "kl_rec": (None, "corpus", True),
    "kl_sd": (None, "self", False),
    "kl_sd_rec": (None, "self", True),
}
TARGETS = {"alpha1_t0": 0.9, "alpha1_t1": 0.88, "tau_ratio_t1": 1.3}

# defaults of the flags left unset: (full run, --quick)
DEFAULTS = {
    "variants": ("data,kl,kl_sd,kl_sd_rec", "kl_sd_rec"), "seeds": ("0,1", "0"),
    "num_steps": (400, 4), "batch_size": (8, 4), "seq_len": (0, 32), "learning_rate": (2e-3, 1e-3),
    "warmup_steps": (30, 1), "eval_batches": (8, 1), "recursive_steps": (1, 1),
    "sd_docs": (1024, 4), "sd_prompt_bytes": (128, 32), "sd_max_new_tokens": (384, 8),
    "sd_batch_size": (32, 2), "temperatures": ("0,1", "0,1"), "prompts": (32, 2),
    "prompt_bytes": (120, 48), "max_new_tokens": (128, 8), "speed_prompts": (4, 1),
    "speed_repeats": (1, 1),
}


def stage_name(variant: str, seed: int) -> str:
  return f"{variant}_s{seed}"


def stage_config(base: Config, base_workdir: str, variant: str, seed: int, *, num_steps: int,
                 batch_size: int, seq_len: int, learning_rate: float, warmup_steps: int,
                 eval_batches: int, distill_weight: float, distill_temperature: float,
                 distill_divergence: str, recursive_steps: int, data_dir: str, sd_name: str,
                 sd_data_dir: str) -> Config:
  """The stage's config: ``base`` (architecture, optimizer betas, weight
  decay, clipping) with init_from, freeze_backbone, the variant's objective
  and data, the budget, one evaluation and one checkpoint at the end.

  Raises ConfigError (names the field) for invalid values, KeyError for an
  unknown variant.
  """
  weight, data, rec = VARIANTS[variant]
  r = dataclasses.replace
  train = r(base.train, init_from=os.path.abspath(base_workdir), freeze_backbone=True, seed=seed,
            num_steps=num_steps, batch_size=batch_size, seq_len=seq_len or base.train.seq_len,
            learning_rate=learning_rate, warmup_steps=warmup_steps, eval_every=num_steps,
            eval_batches=eval_batches, log_every=max(1, min(base.train.log_every, num_steps // 8)))
  mtp = r(base.mtp, distill_weight=distill_weight if weight is None else weight,
          distill_temperature=distill_temperature, distill_divergence=distill_divergence,
          recursive_steps=recursive_steps if rec else 0)
  if data == "self":
    data_cfg = r(base.data, name=sd_name, data_dir=sd_data_dir)
  else:
    data_cfg = r(base.data, data_dir=data_dir or base.data.data_dir)
  cfg = r(base, train=train, mtp=mtp, data=data_cfg,
          checkpoint=r(base.checkpoint, every_steps=num_steps, keep=1))
  return config_lib.validate(cfg)


def self_distilled_data(base_workdir: str, name: str, data_dir: str, out_dir: str, recipe,
                        log) -> dict:
  """Makes (or reuses) the self-distilled dataset ``name`` in ``out_dir``
  from the base's corpus in ``data_dir``; returns its metadata
  (``scripts.self_distill.make_dataset``). A dataset already there made with
  another recipe or base is an error (ConfigError)."""
  from scripts import self_distill
  meta_path = os.path.join(out_dir, name, data_lib.SELF_DISTILLED_VERSION, "metadata.json")
  if os.path.exists(meta_path):
    with open(meta_path) as f:
      meta = json.load(f)
    if meta.get("recipe") != dataclasses.asdict(recipe) or \
        meta.get("workdir") != os.path.abspath(base_workdir):
      raise ConfigError(f"self-distilled dataset {meta_path} was made from {meta.get('workdir')} "
                        f"with recipe {meta.get('recipe')}, not {dataclasses.asdict(recipe)}; "
                        "use a new --runs_dir")
    return {**meta, "reused": True, "path": os.path.dirname(meta_path), "data_dir": out_dir}
  return {**self_distill.make_dataset(base_workdir, name, recipe, data_dir=data_dir, out_dir=out_dir,
                                     log=log), "reused": False}


class Evaluator:
  """Validation metrics (``train.losses.summarize``: per depth loss,
  accuracy, teacher_kl, teacher_agreement; main bits per byte) of any
  parameters of one architecture on fixed batches, compiled once.
  ``cfg`` sets the objective (its recursive steps give the depths past D)."""

  def __init__(self, cfg: Config, eval_batches):
    from train.loop import Trainer
    self.trainer, self.batches = Trainer(cfg), eval_batches

  def __call__(self, params) -> dict:
    from train import losses
    params = jax.device_put(params, self.trainer.param_shardings)
    return losses.summarize(self.trainer.eval_sums(params, self.batches))


# -- one architecture, many parameter sets -----------------------------------------

class ParamSwapBench:
  """Decoders for AR and MTP (G in ``gs``) compiled once for one
  architecture (a base and its distilled stages); ``use(model)`` swaps in
  another model's parameters (same shapes: a stage of the same base), so
  every model is measured by the same compiled programs.

  Args:
    model: a model of the architecture (its parameters are used until ``use``).
    gs: draft lengths G >= 1.
  """

  def __init__(self, model, gs: list[int]):
    self.gs = list(gs)
    self.decoders = {"ar": Decoder(model, "ar"), **{f"mtp_G{g}": Decoder(model, "mtp", g) for g in gs}}
    self.draft_cache, self.flops_cache = {}, {}

  def use(self, model) -> "ParamSwapBench":
    params = nnx.state(model, nnx.Param)
    for dec in self.decoders.values():
      dec.target_params = params
    return self

  def acceptance(self, prompts: list[str], temperatures: list[float], max_new_tokens: int,
                 seed: int = 0) -> list[dict]:
    """MTP speculative decoding of all ``prompts`` as one batch per (G, T).

    Returns rows {num_draft_tokens, temperature, tau (emitted tokens per
    target call), alpha (acceptance rate per position k = 1..G, None where
    no round reached k), histogram (rounds per accepted count),
    target_calls, tokens}."""
    enc = [tok.ByteTokenizer().encode(p, add_bos=True) for p in prompts]
    rows = []
    for g in self.gs:
      for t in temperatures:
        gen = self.decoders[f"mtp_G{g}"].generate(enc, max_new_tokens, SamplingParams(temperature=t),
                                                  seed=seed)
        hist = gen.accepted_histogram.sum(0)
        calls = int(gen.target_calls.sum())
        rows.append({"num_draft_tokens": g, "temperature": t,
                     "tau": float((hist * (np.arange(len(hist)) + 1)).sum() / max(calls, 1)),
                     "alpha": stats_lib.acceptance_rates(hist),
                     "histogram": [int(x) for x in hist], "target_calls": calls,
                     "tokens": int(sum(len(x) for x in gen.tokens))})
    return rows

  def speed(self, prompts: list[str], gs: list[int], temperatures: list[float],
            max_new_tokens: int, repeats: int) -> list[dict]:
    """Speedup of MTP (G in ``gs``) over AR of the same model, batch 1,
    while_loop form (``measure_point``; the drafting cost c is
    measured once per G and shared: same architecture); rows with label,
    method, num_draft_tokens, temperature, speedup, tau, wall_s_median,
    tokens_per_s, draft_cost_ratio_c."""
    decoders = {k: d for k, d in self.decoders.items()
                if k == "ar" or int(k.split("G")[1]) in gs}
    rows = []
    for t in temperatures:
      for r in measure_point(decoders, prompts, 1, max_new_tokens, SamplingParams(temperature=t),
                             max(repeats, 1) * len(prompts), draft_cache=self.draft_cache,
                             flops_cache=self.flops_cache):
        rows.append({k: r.get(k) for k in ("label", "method", "num_draft_tokens", "temperature",
                                           "speedup", "tau", "wall_s_median", "tokens_per_s",
                                           "draft_cost_ratio_c")})
    return rows


# -- tables (pure) ---------------------------------------------------------------

def _spread(values: list[float]) -> dict:
  """mean, min, max, n of the values that are not None (``mtp.timing.spread``)."""
  return spread([x for x in values if x is not None], ("mean", "min", "max", "n"))


def acceptance_table(base_rows: list[dict], stages: list[dict]) -> list[dict]:
  """One row per (model, G, T): model "base" or a variant; tau and alpha_k
  (spread over seeds), tau_vs_base (per seed tau / base tau), tau_vs_data
  (per seed tau / the data control's tau of the same seed, when trained),
  speedup (spread, where measured)."""
  groups: dict = {}
  for r in base_rows:
    groups.setdefault(("base", r["num_draft_tokens"], r["temperature"]), []).append((None, r))
  for s in stages:
    for r in s.get("acceptance") or []:
      groups.setdefault((s["variant"], r["num_draft_tokens"], r["temperature"]), []).append(
          (s["seed"], r))
  base = {(r["num_draft_tokens"], r["temperature"]): r for r in base_rows}
  data = {(s["seed"], r["num_draft_tokens"], r["temperature"]): r
          for s in stages if s["variant"] == "data" for r in s.get("acceptance") or []}
  speeds = {}
  for s in stages:
    for r in s.get("speed") or []:
      if r["method"] == "mtp":
        speeds.setdefault((s["variant"], r["num_draft_tokens"], r["temperature"]), []).append(r["speedup"])
  rows = []
  for (model, g, t), items in groups.items():
    b = base.get((g, t))
    rows.append({
        "model": model, "num_draft_tokens": g, "temperature": t,
        "seeds": [s for s, _ in items if s is not None],
        "tau": _spread([r["tau"] for _, r in items]),
        "alpha": [_spread([r["alpha"][k] for _, r in items]) for k in range(g)],
        "tau_vs_base": _spread([r["tau"] / b["tau"] for _, r in items]) if b else _spread([]),
        "tau_vs_data": _spread([r["tau"] / data[(s, g, t)]["tau"] for s, r in items
                                if (s, g, t) in data]),
        "speedup": _spread(speeds.get((model, g, t), []))})
  return rows


def targets(table: list[dict], depth: int) -> dict:
  """The issue's targets for every distilled variant (not base / data):
  alpha_1 at T = 0 and T = 1 (G = D rows, mean over seeds) and tau at
  G = D, T = 1 over the base's and over the data control's."""
  out = {}
  by = {(r["model"], r["num_draft_tokens"], r["temperature"]): r for r in table}
  for model in sorted({r["model"] for r in table} - {"base", "data"}):
    t0, t1 = by.get((model, depth, 0.0)), by.get((model, depth, 1.0))
    a0 = t0["alpha"][0]["mean"] if t0 else None
    a1 = t1["alpha"][0]["mean"] if t1 else None
    rb = t1["tau_vs_base"]["mean"] if t1 else None
    rd = t1["tau_vs_data"]["mean"] if t1 else None
    out[model] = {
        "alpha1_t0": a0, "alpha1_t0_met": a0 is not None and a0 >= TARGETS["alpha1_t0"],
        "alpha1_t1": a1, "alpha1_t1_met": a1 is not None and a1 >= TARGETS["alpha1_t1"],
        "tau_ratio_vs_base_t1": rb,
        "tau_ratio_vs_base_t1_met": rb is not None and rb >= TARGETS["tau_ratio_t1"],
        "tau_ratio_vs_data_t1": rd,
        "tau_ratio_vs_data_t1_met": rd is not None and rd >= TARGETS["tau_ratio_t1"]}
  return out


def _ms(s: dict, fmt: str = ".3f") -> str:
  """'mean [min, max]' of a spread over seeds, '-' when empty."""
  return format_spread(s, fmt, center="mean")


def markdown(meta: dict, results: dict) -> str:
  b, d = meta["budget"], meta["depth"]
  lines = [f"# MTP distillation from the main head: {meta['base_workdir']} (D = {d}, "
           f"{meta['base_params']} params, step {meta['base_step']})", "",
           f"{report.machine(meta)}, JAX {meta['jax_version']}, commit {meta['commit']}, {meta['date']}. "
           f"Stages: frozen backbone, {b['num_steps']} steps x {b['batch_size']} x {b['seq_len']} tokens, "
           f"AdamW lr {b['learning_rate']:g} (warmup {b['warmup_steps']}, cosine), distill weight "
           f"{b['distill_weight']:g} ({b['distill_divergence']}), temperature "
           f"{b['distill_temperature']:g}, recursive steps "
           f"{b['recursive_steps']} (the _rec variants); seeds {meta['seeds']} (data order). "
           f"Decoding: {meta['decode']['prompts']} held-out prompts of ~{meta['decode']['prompt_bytes']} "
           f"bytes from {meta['dataset']} validation x {meta['decode']['max_new_tokens']} new tokens, "
           "one batch; values are mean over seeds [min, max].", ""]
  sd = results.get("self_distilled")
  if sd:
    lines += [f"Self-distilled data: {sd['num_docs']} documents, {sd['tokens_generated']:,} sampled "
              f"tokens (T = {sd['recipe']['temperature']:g}, prompts of {sd['recipe']['prompt_bytes']} "
              f"bytes from training documents, {sd['recipe']['method']} decoding, tau {sd['tau']:.2f}) "
              f"in {sd['wall_s']:.0f} s{' (reused)' if sd.get('reused') else ''}.", ""]
  lines += ["## Acceptance (alpha_k, tau) and speedup over AR", "",
            "tau/base, tau/data: per seed, the stage's tau over the base's and over the data-only "
            "control stage of the same seed. Speedup: batch 1, while_loop form, "
            f"{meta['decode']['speed_prompts']} prompts (machine shared: noisy; acceptance is the "
            "primary figure).", "",
            "| model | G | T | tau | alpha_1..G | tau/base | tau/data | speedup |",
            "|---|---|---|---|---|---|---|---|"]
  order = ["base"] + [v for v in meta["variants"]]
  rows = sorted(results["acceptance_table"], key=lambda r: (r["temperature"], r["num_draft_tokens"],
                                                           order.index(r["model"])))
  for r in rows:
    alphas = "/".join("-" if a["mean"] is None else f"{a['mean']:.3f}" for a in r["alpha"])
    lines.append(f"| {r['model']} | {r['num_draft_tokens']} | {r['temperature']:g} | {_ms(r['tau'])} | "
                 f"{alphas} | {_ms(r['tau_vs_base'], '.3f')} | {_ms(r['tau_vs_data'], '.3f')} | "
                 f"{_ms(r['speedup'], '.2f')} |")
  lines += ["", "## Validation: KL to the main head (nats, T = 1) and argmax agreement per depth", "",
            f"The same {meta['budget']['eval_batches']} validation batches of the base's dataset for "
            "every model. Depths past D are module D reused (recursive steps): the base and the "
            "variants without recursive steps show what the untrained reuse gives.", "",
            "| model | seed | " + " | ".join(f"KL k={k} | agree k={k}" for k in range(1, meta["max_depth"] + 1))
            + " | main bpb |", "|---|---|" + "---|---|" * meta["max_depth"] + "---|"]
  evals = [("base", "-", results["base_eval"])] + [(s["variant"], s["seed"], s.get("eval_base_data") or {})
                                                    for s in results["stages"]]
  for name, seed, ev in evals:
    cols = []
    for k in range(1, meta["max_depth"] + 1):
      kl, ag = ev.get(f"mtp_{k}/teacher_kl"), ev.get(f"mtp_{k}/teacher_agreement")
      cols.append(f"{'-' if kl is None else format(kl, '.3f')} | {'-' if ag is None else format(ag, '.3f')}")
    bpb = ev.get("main/bits_per_byte")
    lines.append(f"| {name} | {seed} | " + " | ".join(cols) + f" | {'-' if bpb is None else format(bpb, '.4f')} |")
  lines += ["", "## Cost of each stage", "",
            "| stage | steps | tokens | wall s | s/step | reused |", "|---|---|---|---|---|---|"]
  for s in results["stages"]:
    st = s.get("step_time_s")
    lines.append(f"| {s['name']} | {s.get('step')} | {s['tokens']:,} | {s['train_wall_s']:.0f} | "
                 f"{'-' if st is None else format(st, '.3f')} | {s.get('reused')} |")
  lines += ["", "## Targets (issue 12)", "",
            f"alpha_1 >= {TARGETS['alpha1_t0']} at T = 0 and >= {TARGETS['alpha1_t1']} at T = 1 "
            f"(G = D); tau at G = D, T = 1 >= {TARGETS['tau_ratio_t1']} x the data-only modules'.", "",
            "| variant | alpha_1 T=0 | alpha_1 T=1 | tau/base T=1 | tau/data T=1 |", "|---|---|---|---|---|"]
  f = lambda v, ok: "-" if v is None else f"{v:.3f} {'(met)' if ok else '(not met)'}"
  for v, t in results["targets"].items():
    lines.append(f"| {v} | {f(t['alpha1_t0'], t['alpha1_t0_met'])} | {f(t['alpha1_t1'], t['alpha1_t1_met'])} | "
                 f"{f(t['tau_ratio_vs_base_t1'], t['tau_ratio_vs_base_t1_met'])} | "
                 f"{f(t['tau_ratio_vs_data_t1'], t['tau_ratio_vs_data_t1_met'])} |")
  failed = [s for s in results["stages"] if s.get("diverged")]
  if failed:
    lines += ["", "Failed stages: " + "; ".join(f"{s['name']}: {s['diverged']}" for s in failed)]
  return "\n".join(lines) + "\n"


# -- main ------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
  ap = cli.OneLineParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--workdir", required=True, help="trained base workdir (read only)")
  ap.add_argument("--runs_dir", default="runs/distill", help="stage workdirs and the self-distilled data")
  ap.add_argument("--data_dir", default="", help=cli.DATA_DIR_HELP)
  ap.add_argument("--variants", help=f"comma list of {', '.join(VARIANTS)} (default data,kl,kl_sd,kl_sd_rec)")
  ap.add_argument("--seeds", help="stage seeds (data order), comma list >= 0 (default 0,1)")
  ap.add_argument("--num_steps", type=int, help="steps per stage (default 400)")
  ap.add_argument("--batch_size", type=int, help="sequences per step (default 8)")
  ap.add_argument("--seq_len", type=int, help="tokens per sequence (default: the longer of the base's "
                  "and the decoding context prompt_bytes + max_new_tokens + 1, rounded up to 64)")
  ap.add_argument("--learning_rate", type=float, help="peak AdamW learning rate (default 2e-3)")
  ap.add_argument("--warmup_steps", type=int, help="warmup steps (default 30)")
  ap.add_argument("--eval_batches", type=int, help="validation batches (default 8)")
  ap.add_argument("--distill_weight", type=float, default=1.0, help="w of the kl variants, in (0, 1]")
  ap.add_argument("--distill_temperature", type=float, default=1.0, help="teacher temperature, > 0")
  ap.add_argument("--distill_divergence", default="kl", choices=config_lib.DIVERGENCES,
                  help="divergence of the kl variants: forward KL or total variation")
  ap.add_argument("--recursive_steps", type=int, help="R of the _rec variants, >= 1 (default 1)")
  ap.add_argument("--sd_docs", type=int, help="self-distilled documents (default 1024)")
  ap.add_argument("--sd_prompt_bytes", type=int, help="prompt bytes per document (default 128)")
  ap.add_argument("--sd_max_new_tokens", type=int, help="sampled tokens per document (default 384)")
  ap.add_argument("--sd_temperature", type=float, default=1.0, help="sampling temperature of the data")
  ap.add_argument("--sd_batch_size", type=int, help="rows sampled together (default 32)")
  ap.add_argument("--temperatures", help="decoding temperatures, comma list >= 0 (default 0,1)")
  ap.add_argument("--prompts", type=int, help="held-out prompts for acceptance (default 32)")
  ap.add_argument("--prompt_bytes", type=int, help="bytes per prompt (default 120)")
  ap.add_argument("--max_new_tokens", type=int, help="new tokens per prompt (default 128)")
  ap.add_argument("--speed_prompts", type=int, help="prompts timed for speedup, 0 = none (default 4)")
  ap.add_argument("--speed_repeats", type=int, help="timed repeats per prompt (default 1)")
  ap.add_argument("--out", default="results/distill_mtp", help="output prefix")
  ap.add_argument("--quick", action="store_true", help="test-sized budgets")
  return ap


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  ap = parser()
  args = common.parse_with_defaults(ap, argv, DEFAULTS)
  variants = cli.parse_list(ap, "variants", args.variants, str, choices=tuple(VARIANTS))
  seeds = cli.parse_list(ap, "seeds", args.seeds, int, 0)
  temps = cli.parse_list(ap, "temperatures", args.temperatures, float, 0.0)
  cli.check_range(ap, args, num_steps=1, batch_size=1, seq_len=0, warmup_steps=0, eval_batches=1,
                  recursive_steps=1, sd_docs=1, sd_prompt_bytes=1, sd_max_new_tokens=1,
                  sd_batch_size=1, prompts=1, prompt_bytes=1, max_new_tokens=1, speed_prompts=0,
                  speed_repeats=1, distill_weight=(0.0, 1.0))
  if args.distill_weight <= 0:
    ap.error(f"--distill_weight={args.distill_weight}: must be in (0, 1] (the data variant is w = 0)")
  base_cfg, _ = loading.load_config(args.workdir)
  if base_cfg.mtp.depth < 1:
    ap.error(f"--workdir={args.workdir}: the base has mtp.depth = 0, no MTP modules to distill")
  depth = base_cfg.mtp.depth
  if not args.seq_len:      # distil at the context lengths the evaluation decodes at
    args.seq_len = max(base_cfg.train.seq_len, 64 * -(-(args.prompt_bytes + args.max_new_tokens + 1) // 64))
  sd_name = "selfdistill_" + "".join(c if c.isalnum() else "_" for c in
                                     os.path.basename(os.path.abspath(args.workdir)).lower())
  sd_data_dir = os.path.abspath(os.path.join(args.runs_dir, "tfds"))
  budget = dict(num_steps=args.num_steps, batch_size=args.batch_size, seq_len=args.seq_len,
                learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
                eval_batches=args.eval_batches, distill_weight=args.distill_weight,
                distill_temperature=args.distill_temperature,
                distill_divergence=args.distill_divergence, recursive_steps=args.recursive_steps)
  try:
    cfgs = {(v, s): stage_config(base_cfg, args.workdir, v, s, data_dir=args.data_dir, sd_name=sd_name,
                                 sd_data_dir=sd_data_dir, **budget) for v in variants for s in seeds}
  except ConfigError as e:
    ap.error(f"the stage budget gives an invalid config: {e}")
  data_dir = args.data_dir or base_cfg.data.data_dir
  prompts = data_lib.held_out_prompts(base_cfg.data.name, args.prompts, args.prompt_bytes,
                                      data_dir=data_dir)
  return _run(args, argv, Plan(base_cfg, depth, variants, seeds, temps, cfgs, budget, prompts,
                               sd_name, sd_data_dir, data_dir))


def train_stage(cfg: Config, variant: str, seed: int, name: str, workdir: str, log,
                t_start: float) -> dict:
  """Trains (or resumes, or reuses) one stage in ``workdir``; returns its
  record {name, variant, seed, workdir, reused, tokens, step, train_wall_s
  (what the stage cost when it ran: stage_cost.json), eval, step_time_s},
  or with "diverged" (message) when the loss became non-finite. Exits
  (128 + signal) when the training was interrupted."""
  from train.loop import DivergedError, train
  finished = os.path.exists(os.path.join(workdir, "final_metrics.json"))
  log(f"[stage {name}] training {cfg.train.num_steps} steps (elapsed "
      f"{time.perf_counter() - t_start:.0f} s)")
  t0 = time.perf_counter()
  st = {"name": name, "variant": variant, "seed": seed, "workdir": workdir, "reused": finished,
        "tokens": cfg.train.num_steps * cfg.train.batch_size * cfg.train.seq_len}
  try:
    res = train(cfg, workdir, log=lambda x: log(f"  {x}"))
  except DivergedError as e:
    st.update(diverged=str(e), train_wall_s=time.perf_counter() - t0)
    return st
  cli.exit_if_interrupted(res.as_dict(), cfg.train.num_steps, f"stage {name}", workdir)
  st.update(step=res.step, train_wall_s=time.perf_counter() - t0, eval=res.eval,
            step_time_s=res.step_time_s)
  cost_path = os.path.join(workdir, "stage_cost.json")
  if finished and os.path.exists(cost_path):     # what the stage cost when it ran
    with open(cost_path) as f:
      st["train_wall_s"] = json.load(f)["train_wall_s"]
  elif not res.interrupted:
    cli.write_atomic(cost_path, json.dumps({"train_wall_s": st["train_wall_s"], "step": res.step}))
  return st


@dataclasses.dataclass
class Plan:
  """What one distillation run does, from the flags: the base's config and
  MTP depth, the variants x seeds of stages and their configs ({(variant,
  seed): Config}), the shared budget, the decoding temperatures and
  held-out prompts, the self-distilled dataset (name, dir) and the corpus
  data dir."""
  base_cfg: Config
  depth: int
  variants: list[str]
  seeds: list[int]
  temperatures: list[float]
  cfgs: dict
  budget: dict
  prompts: list[str]
  sd_name: str
  sd_data_dir: str
  data_dir: str


def _run(args, argv, plan: Plan):
  """The stages: self-distilled data if needed, the base's metrics, then
  every (variant, seed) stage trained, evaluated and decoded; the report."""
  base_cfg, depth, variants, seeds, temps, cfgs, budget, prompts = (
      plan.base_cfg, plan.depth, plan.variants, plan.seeds, plan.temperatures, plan.cfgs,
      plan.budget, plan.prompts)
  sd_name, sd_data_dir, data_dir = plan.sd_name, plan.sd_data_dir, plan.data_dir
  from scripts import self_distill
  log = lambda s: print(s, flush=True)
  t_start = time.perf_counter()
  sd_meta = None
  if any(VARIANTS[v][1] == "self" for v in variants):
    recipe = self_distill.Recipe(num_docs=args.sd_docs, prompt_bytes=args.sd_prompt_bytes,
                                 max_new_tokens=args.sd_max_new_tokens, temperature=args.sd_temperature,
                                 batch_size=args.sd_batch_size, seed=0)
    log(f"self-distilled data {sd_name} in {sd_data_dir}")
    sd_meta = self_distilled_data(args.workdir, sd_name, data_dir, sd_data_dir, recipe,
                                  log=lambda s: log(f"  {s}"))

  _, base_model, base_step = loading.load_model(args.workdir)
  base_params = nnx.state(base_model, nnx.Param)
  eval_cfg = cfgs[(variants[0], seeds[0])]
  eval_cfg = dataclasses.replace(eval_cfg, data=dataclasses.replace(base_cfg.data, data_dir=data_dir),
                                 mtp=dataclasses.replace(eval_cfg.mtp, recursive_steps=args.recursive_steps))
  eval_batches = data_lib.make_eval_batches(eval_cfg.data, seq_len=eval_cfg.train.seq_len,
                                            batch_size=eval_cfg.train.batch_size,
                                            num_batches=args.eval_batches)
  evaluator = Evaluator(eval_cfg, eval_batches)
  base_eval = evaluator(base_params)
  gs = sorted({depth, depth + args.recursive_steps})
  log(f"base {args.workdir} (step {base_step}): measuring acceptance at G={gs}, T={temps}")
  bench = ParamSwapBench(base_model, gs)
  base_acc = bench.acceptance(prompts, temps, args.max_new_tokens)
  base_speed = (bench.speed(prompts[:args.speed_prompts], [depth], temps, args.max_new_tokens,
                            args.speed_repeats) if args.speed_prompts else [])
  for r in base_acc:
    log(f"  base G={r['num_draft_tokens']} T={r['temperature']:g}: tau {r['tau']:.3f} alpha "
        + "/".join("-" if a is None else f"{a:.3f}" for a in r["alpha"]))

  stages = []
  for v in variants:
    for s in seeds:
      cfg, name = cfgs[(v, s)], stage_name(v, s)
      workdir = os.path.join(args.runs_dir, name)
      st = train_stage(cfg, v, s, name, workdir, log, t_start)
      if "diverged" in st:
        stages.append(st)
        continue
      model = loading.load_model(workdir)[1]
      st["eval_base_data"] = evaluator(nnx.state(model, nnx.Param))   # the base's validation batches
      bench.use(model)
      st["acceptance"] = bench.acceptance(prompts, temps, args.max_new_tokens)
      st["speed"] = (bench.speed(prompts[:args.speed_prompts], [depth], temps, args.max_new_tokens,
                                 args.speed_repeats) if args.speed_prompts else [])
      for r in st["acceptance"]:
        log(f"  {name} G={r['num_draft_tokens']} T={r['temperature']:g}: tau {r['tau']:.3f} alpha "
            + "/".join("-" if a is None else f"{a:.3f}" for a in r["alpha"]))
      stages.append(st)
  table = acceptance_table(base_acc, stages)
  base_stage_speed = {"variant": "base", "seed": None, "speed": base_speed}
  for r in table:           # the base's speedup (not a stage)
    if r["model"] == "base":
      r["speedup"] = _spread([x["speedup"] for x in base_stage_speed["speed"]
                              if x["method"] == "mtp" and x["num_draft_tokens"] == r["num_draft_tokens"]
                              and x["temperature"] == r["temperature"]])
  results = {"self_distilled": sd_meta, "base_eval": base_eval, "base_acceptance": base_acc,
             "base_speed": base_speed, "stages": stages, "acceptance_table": table,
             "targets": targets(table, depth)}
  cmd = common.command_line(__file__, argv)
  meta = report.provenance(
      command=cmd, quick=args.quick, base_workdir=args.workdir, base_step=base_step,
      base_config=base_cfg.to_dict(), base_params=sum(x.size for x in jax.tree.leaves(base_params)),
      depth=depth, max_depth=depth + args.recursive_steps, dataset=base_cfg.data.name,
      variants=variants, seeds=seeds, budget={**budget, "seq_len": cfgs[(variants[0], seeds[0])].train.seq_len},
      stage_config=cfgs[(variants[-1], seeds[0])].to_dict(),
      decode={"temperatures": temps, "num_draft_tokens": gs, "prompts": args.prompts,
              "prompt_bytes": args.prompt_bytes, "max_new_tokens": args.max_new_tokens,
              "speed_prompts": args.speed_prompts, "speed_repeats": args.speed_repeats},
      wall_s=time.perf_counter() - t_start)
  report.write_report(args.out, meta, results, markdown(meta, results))
  log(f"done in {time.perf_counter() - t_start:.0f} s; wrote {args.out}.json and {args.out}.md")
  return 0


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError,))
