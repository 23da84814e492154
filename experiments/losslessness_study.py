r"""Losslessness study: speculative decoding samples from the same distribution
as autoregressive (AR) sampling from the target, tested statistically, with a
deliberately wrong acceptance rule as a power check.

    python -m experiments.losslessness_study --workdir runs/tiny [--dataset python_stdlib] \
        [--num_prompts 4 | --prompt_indices 3,6] [--prompt_bytes 48] [--plan_only] [--temperatures 0.7,1.0,1.3] [--top_ps 1.0,0.9] \
        [--num_draft_tokens 2] [--num_samples 4000] [--num_tokens 4] [--batch_size 1000] \
        [--out results/losslessness_study]

For every prompt (held out from ``--dataset`` via ``mtp.data.held_out_prompts``,
or ``--prompt`` texts; ``--quick`` uses short prompts over the alphabet of the
tests' Markov source; for a BPE model such as the imported SmolLM2, the
held-out chat prompts or ``--prompt`` texts as user turns through its chat
template) and every sampling setting (temperature x top-p), it
draws ``--num_samples`` continuations of ``--num_tokens`` tokens with
``Decoder(target, "ar")`` and as many with ``Decoder(target, "mtp", G)``,
``--batch_size`` rows at a time by ``Decoder.sample`` (the prompt prefilled
once, its state repeated into the batch; rows are sampled independently),
each batch with its own seed, and AR and MTP never share a seed.

Tests (per prompt, setting and statistic): a two-sample chi-square test of
homogeneity (``scipy.stats.chi2_contingency`` without continuity correction,
a 2 x K table AR vs speculative) on

- ``first_token``: the first generated token;
- ``first_n_tokens``: the tuple of the first n generated tokens (n = 2 and n =
  ``--num_tokens``), one tuple per sample, so samples stay independent (a row
  cut short by EOS is padded with -1: ending is a category too).

Pooling rule (so the chi-square approximation holds): with expected cell
counts E_ij = row_i total x column_j total / N, every category whose smaller
expected count min_i E_ij is below 5 goes into one "other" column; if "other"
itself has an expected count below 5 it is merged into the largest category.
The rule looks only at the column totals (pooled over both samples), so under
H0 it does not depend on which sample a count came from. Fewer than 2
categories left = degenerate (no test; e.g. a one-token top-p nucleus).

Combined view: under H0 the p-values are (close to) uniform, so with many
tests some are small by chance. The report gives the fraction below 0.01 and
0.05, a KS test of uniformity (approximate: the statistics of one prompt and
setting share samples, and chi-square p-values of counts are only
asymptotically uniform), and Holm-corrected and Bonferroni-corrected p-values
over the family of all correct-rule tests (Holm 1979; rejections at 0.01 and
0.001 are counted).

Power check: ``ArgmaxAcceptDecoder``, a speculative decoder whose ``_round``
accepts a draft when it equals the target's argmax and otherwise samples the
next token from p at the first rejected position (the bonus from p_G when all
are accepted). It over-weights the argmax (P(argmax) = q(m) + (1 - q(m)) p(m)
for the first token), so at temperature 1 (top-p 1) the same tests must reject
it. The total-variation distance between the empirical first-token
distributions (AR vs each rule) is reported next to the tests.

Writes OUT.json, OUT.md and OUT_pvalues.png (p-value histogram and a QQ plot
against the uniform law, correct vs wrong rule).

Planned power: before sampling, the script prints for every prompt the
power of its first-token test against the wrong rule, from the exact laws
of one forward pass (``planned_power``; ``--plan_only`` stops there, in
seconds). The wrong rule moves the first token's law only by q(m) (1 -
p(m)), q(m) being module 1's probability of the target's argmax m, so on a
prompt whose first draft is poor no feasible sample size sees it there;
size ``--num_samples`` (or pick prompts with ``--prompt_indices``) from it.

Cost: one generate call per ``--batch_size`` samples, (prompts x settings x
2 + prompts) x num_samples / batch_size calls in all; each costs its rounds
only, since ``Decoder.sample`` prefills a prompt once. For configs/tiny.py
a call takes 3-5 s on 2 idle CPU cores; for SmolLM2 at B = 250 and 3 tokens
~10 s (vs ~35 s with the prompt prefilled in every row). ``--quick`` takes
about 20-30 s, mostly compiling the three decoders.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

from mtp import cli

if __name__ == "__main__":     # a flag out of range: one line, before the imports below load jax
  cli.refuse_bad_flags(temperatures=(list, float, 0, 100, True), prompt_indices=(list, int, 0, 999),
                       top_ps=(list, float, 0, 1, True), num_samples=(int, 20, 10**7),
                       num_tokens=(int, 1, 64), batch_size=(int, 1, 10**5), num_prompts=(int, 1, 1000),
                       num_draft_tokens=(int, 0, 64), prompt_bytes=(int, 1, 10**5))

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from scipy import stats as sps  # noqa: E402

from decode import sampling, acceptance as verify  # noqa: E402
from decode.decoder import DecodeError, Decoder, SamplingParams  # noqa: E402
from experiments import common  # noqa: E402
from mtp import checkpoint as ckpt_lib  # noqa: E402
from mtp import loading  # noqa: E402
from mtp import data as data_lib  # noqa: E402
from mtp import report  # noqa: E402
from mtp import tokenizer as tok  # noqa: E402

QUICK_PROMPTS = ("ace", "ef ")    # over the alphabet "abcdef " of tests/conftest.py's Markov source
MIN_EXPECTED = 5.0
POWER_SETTING = (1.0, 1.0)        # (temperature, top_p) of the wrong-rule check
SEED_STRIDE = 100_003             # seeds of different methods / settings never collide


# -- a deliberately wrong decoder, for the power check ---------------------------------

def argmax_accept(key, target_probs, draft_tokens):
  """WRONG acceptance rule, for the power check: accept d_j while it equals
  argmax p_{j-1}; the next token is sampled from p_a (the target row at the
  first rejected position, or p_G as the bonus). Not lossless: it ignores q.

  Args: key (jax.random key), target_probs [B, G+1, V] float, draft_tokens
  [B, G] int. Returns (num_accepted [B] int32 in 0..G, next_token [B] int32).
  """
  p = jnp.asarray(target_probs, jnp.float32)
  g = p.shape[1] - 1
  best = jnp.argmax(p[:, :g], axis=-1).astype(jnp.int32)                 # [B, G]
  match = draft_tokens.astype(jnp.int32) == best
  a = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)      # [B]
  p_row = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]         # [B, V]
  return a.astype(jnp.int32), sampling.sample(key, p_row)


def _argmax_rule(params, g):
  """``argmax_accept`` as a ``Decoder`` accept_rule (AR steps and greedy
  rounds as the real rule, ``chain_rule``)."""
  if not g or params.greedy:
    return verify.chain_rule(params, g)
  return lambda key, p, q, draft_tokens: argmax_accept(key, p, draft_tokens)


class ArgmaxAcceptDecoder(Decoder):
  """A speculative ``Decoder`` whose round uses ``argmax_accept`` instead of
  the rejection rule of Leviathan et al. 2023 (Algorithm 1): same drafting,
  verification and commit, wrong acceptance. For power checks only."""

  def __init__(self, target, method="mtp", num_draft_tokens=2, draft=None, mesh=None,
               tokenizer=None):
    if method == "ar":
      raise ValueError("ArgmaxAcceptDecoder needs a speculative method (mtp or draft)")
    super().__init__(target, method, num_draft_tokens, draft, mesh, accept_rule=_argmax_rule,
                     tokenizer=tokenizer)


# -- sampling ------------------------------------------------------------------------

def sample_continuations(decoder: Decoder, prompts: list[np.ndarray], num_samples: int,
                         num_tokens: int, sp: SamplingParams, seed: int, batch_size: int):
  """``num_samples`` independent continuations of every prompt.

  Each prompt's samples come in batches of ``batch_size`` rows (the last one
  smaller), drawn by ``Decoder.sample``: the prompt is prefilled once and its
  state repeated into the batch, so a batch costs its rounds, not B
  prefills. Batch i (counted over all prompts) has seed ``seed + i``; rows
  of a batch sample independently.

  Args: prompts: token arrays (BOS included). Returns (samples, histogram):
  samples, a list (one per prompt) of [num_samples, num_tokens] int64 arrays
  padded with -1 after an EOS; histogram [G+1] int64, accepted-draft counts
  summed over all rows ([1] for AR).
  """
  out = [np.full((num_samples, num_tokens), -1, np.int64) for _ in prompts]
  hist = np.zeros(decoder.longest_draft + 1, np.int64)
  b = 0
  for i, prompt in enumerate(prompts):
    for start in range(0, num_samples, batch_size):
      rows = min(batch_size, num_samples - start)
      gen = decoder.sample(prompt, rows, num_tokens, sp, seed=seed + b)
      b += 1
      for r, toks in enumerate(gen.tokens):
        toks = toks[:num_tokens]
        out[i][start + r, :len(toks)] = toks
      hist += gen.accepted_histogram.sum(0)
  return out, hist


# -- statistics ------------------------------------------------------------------------

def categories(samples: np.ndarray, n: int) -> np.ndarray:
  """The category of each sample for the first-n-tokens statistic: samples
  [N, T] int -> [N, n] int (one row = one category, compared row-wise)."""
  return np.asarray(samples)[:, :n]


def contingency(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """2 x K count table of two samples of categories (rows of [N, n] int
  arrays; a 1-D array is one token per sample). Returns (table [2, K] int64,
  keys [K, n] int64: the category of each column, sorted)."""
  a = np.asarray(a).reshape(len(a), -1)
  b = np.asarray(b).reshape(len(b), -1)
  keys, inv = np.unique(np.concatenate([a, b]), axis=0, return_inverse=True)
  inv = inv.reshape(-1)
  table = np.stack([np.bincount(inv[:len(a)], minlength=len(keys)),
                    np.bincount(inv[len(a):], minlength=len(keys))]).astype(np.int64)
  return table, keys


def pool_small_categories(table: np.ndarray, min_expected: float = MIN_EXPECTED) -> np.ndarray:
  """The pooling rule of the module docstring: columns whose smaller expected
  count is below ``min_expected`` merge into an "other" column (last), which
  merges into the largest column if it is itself below ``min_expected``.
  table [2, K] int -> [2, K'] int (K' <= K; empty columns dropped)."""
  table = np.asarray(table, np.int64)
  table = table[:, table.sum(0) > 0]
  n = table.sum()
  expected_min = table.sum(1).min() * table.sum(0) / max(n, 1)          # [K]
  small = expected_min < min_expected
  kept, other = table[:, ~small], table[:, small].sum(1, keepdims=True)
  if not small.any():
    return kept
  if kept.shape[1] and table.sum(1).min() * other.sum() / n < min_expected:
    kept = kept.copy()
    kept[:, np.argmax(kept.sum(0))] += other[:, 0]
    return kept
  return np.concatenate([kept, other], axis=1)


def two_sample_chi2(a, b, min_expected: float = MIN_EXPECTED) -> dict:
  """Chi-square test that two samples of categories (see ``contingency``)
  come from one distribution: ``scipy.stats.chi2_contingency`` without
  continuity correction on the pooled 2 x K table.

  Returns dict: chi2, dof, pvalue (None when degenerate: fewer than 2 pooled
  categories), n_a, n_b, num_categories (before pooling), num_columns (after),
  tv (empirical total-variation distance, 0.5 sum |f_a - f_b| over the
  unpooled categories)."""
  table, _ = contingency(a, b)
  freqs = table / table.sum(1, keepdims=True)
  res = {"n_a": int(table[0].sum()), "n_b": int(table[1].sum()), "num_categories": table.shape[1],
         "tv": float(0.5 * np.abs(freqs[0] - freqs[1]).sum())}
  pooled = pool_small_categories(table, min_expected)
  res["num_columns"] = pooled.shape[1]
  if pooled.shape[1] < 2:
    return {**res, "chi2": 0.0, "dof": 0, "pvalue": None}
  chi2, p, dof, _ = sps.chi2_contingency(pooled, correction=False)
  return {**res, "chi2": float(chi2), "dof": int(dof), "pvalue": float(p)}


def holm(pvalues) -> np.ndarray:
  """Holm (1979) step-down adjusted p-values [m] (reject H_i at level a iff
  adjusted_i <= a; controls the family-wise error rate)."""
  p = np.asarray(pvalues, np.float64)
  m = len(p)
  if m == 0:
    return p
  order = np.argsort(p)
  adj = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
  out = np.empty(m)
  out[order] = adj
  return out


def bonferroni(pvalues) -> np.ndarray:
  """min(1, m p) for each of m p-values."""
  p = np.asarray(pvalues, np.float64)
  return np.minimum(1.0, p * len(p))


def combine(tests: list[dict]) -> dict:
  """Adds holm_pvalue / bonferroni_pvalue to each non-degenerate test (in
  place) and returns the family summary: num_tests, num_degenerate,
  frac_below_0.01 / 0.05, ks_uniform_pvalue, min_pvalue, Holm and Bonferroni
  rejections at 0.01 and 0.001."""
  live = [t for t in tests if t["pvalue"] is not None]
  p = np.array([t["pvalue"] for t in live])
  for t, h, bf in zip(live, holm(p), bonferroni(p)):
    t["holm_pvalue"], t["bonferroni_pvalue"] = float(h), float(bf)
  out = {"num_tests": len(live), "num_degenerate": len(tests) - len(live)}
  if not len(p):
    return out
  h, bf = holm(p), bonferroni(p)
  out.update({
      "frac_below_0.01": float(np.mean(p < 0.01)), "frac_below_0.05": float(np.mean(p < 0.05)),
      "ks_uniform_pvalue": float(sps.kstest(p, "uniform").pvalue) if len(p) > 1 else None,
      "min_pvalue": float(p.min()), "max_pvalue": float(p.max()),
      "holm_rejections_0.01": int((h <= 0.01).sum()), "holm_rejections_0.001": int((h <= 0.001).sum()),
      "bonferroni_rejections_0.01": int((bf <= 0.01).sum()),
      "bonferroni_rejections_0.001": int((bf <= 0.001).sum())})
  return out


def tau_from_histogram(hist) -> float | None:
  """Mean accepted length sum (a+1) h[a] / sum h[a] (None for an empty histogram)."""
  h = np.asarray(hist, np.float64)
  return float((h * (np.arange(len(h)) + 1)).sum() / h.sum()) if h.sum() else None


# -- planned power -------------------------------------------------------------------

def wrong_rule_first_token_law(p: np.ndarray, q: np.ndarray) -> np.ndarray:
  """The first token's law under ``ArgmaxAcceptDecoder``: the first draft
  (drawn from q) is kept iff it is the target's argmax m, else the token is
  drawn from p, so P(m) = q(m) + (1 - q(m)) p(m) and P(x) = (1 - q(m)) p(x)
  elsewhere. p, q: [V] float64 laws (target, module 1) -> [V] float64."""
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  m = int(np.argmax(p))
  law = (1.0 - q[m]) * p
  law[m] += q[m]
  return law


def chi2_power(a: np.ndarray, b: np.ndarray, n: int, alpha: float,
               min_expected: float = MIN_EXPECTED) -> dict:
  """Approximate power of ``two_sample_chi2`` at level ``alpha`` with n
  samples from each of two laws a, b ([K] float64): categories whose
  expected count n (a + b) / 2 is below ``min_expected`` are pooled as the
  test pools them, and the statistic is noncentral chi-square with K' - 1
  degrees of freedom and noncentrality n sum (a - b)^2 / (a + b) (the
  two-sample form for equal sizes; e.g. Lehmann & Romano, Testing
  Statistical Hypotheses, 14.3). Returns {noncentrality, dof, power, tv}."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  small = n * (a + b) / 2 < min_expected
  pa, pb = list(a[~small]), list(b[~small])
  if small.any():
    if n * (a[small].sum() + b[small].sum()) / 2 >= min_expected or not pa:
      pa.append(a[small].sum())
      pb.append(b[small].sum())
    else:
      j = int(np.argmax(np.add(pa, pb)))
      pa[j] += a[small].sum()
      pb[j] += b[small].sum()
  pa, pb = np.asarray(pa), np.asarray(pb)
  tv = float(0.5 * np.abs(a - b).sum())
  dof = len(pa) - 1
  if dof < 1:
    return {"noncentrality": 0.0, "dof": 0, "power": 0.0, "tv": tv}
  lam = float(n * ((pa - pb) ** 2 / np.maximum(pa + pb, 1e-300)).sum())
  power = float(sps.ncx2.sf(sps.chi2.isf(alpha, dof), dof, lam)) if lam > 0 else alpha
  return {"noncentrality": lam, "dof": dof, "power": power, "tv": tv}


def planned_power(target, encoded: list, num_samples: int, alpha: float) -> list[dict]:
  """Before any sampling: the power of each prompt's first-token test against
  the wrong rule at ``POWER_SETTING`` (T = 1, top-p 1), from the exact laws
  of one forward pass: p, the target's next-token law after the prompt; q,
  module 1's law for that token (its output at the prompt's second-to-last
  position, which reads the last prompt token: the first draft of the first
  round); the wrong rule's law by ``wrong_rule_first_token_law``; power by
  ``chi2_power`` at ``alpha`` (the power check's Holm 0.001 over its tests
  is at least as strict as 0.001 / tests). The multi-token statistics have
  no such closed form and are not planned. Returns one dict per prompt:
  p_argmax, q_argmax, tv, noncentrality, dof, power."""
  import jax
  rows = []
  for enc in encoded:
    out = target(jnp.asarray(np.asarray(enc, np.int32)[None]))
    p = np.asarray(jax.nn.softmax(out.logits[0, -1].astype(jnp.float32)), np.float64)
    q = np.asarray(jax.nn.softmax(out.mtp_logits[0][0, -2].astype(jnp.float32)), np.float64)
    p, q = p / p.sum(), q / q.sum()
    m = int(np.argmax(p))
    rows.append({"p_argmax": float(p[m]), "q_argmax": float(q[m]),
                 **chi2_power(p, wrong_rule_first_token_law(p, q), num_samples, alpha)})
  return rows


# -- report --------------------------------------------------------------------------

def _p(x):
  return "-" if x is None else (f"{x:.3g}" if x >= 1e-300 else "<1e-300")


def power_check_passed(wrong: dict) -> bool:
  """Whether the wrong rule was detected (Holm 0.001) in every one of its
  tests (``combine`` summary of the wrong rule's tests; False with none)."""
  return bool(wrong.get("num_tests")) and wrong.get("holm_rejections_0.001", 0) == wrong["num_tests"]


def verdict(correct: dict, wrong: dict) -> str:
  """The study's conclusion from the ``combine`` summaries of the correct and
  the wrong rule's tests: a rejection of the correct rule at Holm 0.01 is
  reported as such; without one, the result is "no evidence against
  losslessness" only when the power check passed (``power_check_passed``),
  and inconclusive when it failed or when no test had enough samples."""
  if not correct.get("num_tests"):
    return ("Inconclusive: no test had enough samples (all "
            f"{correct.get('num_degenerate', 0)} degenerate; raise --num_samples)")
  if correct.get("holm_rejections_0.01", 0):
    return f"{correct['holm_rejections_0.01']} correct-rule tests REJECT at Holm 0.01"
  if not power_check_passed(wrong):
    return ("Inconclusive: no Holm rejection at 0.01, but the power check failed (the wrong rule "
            f"was detected in {wrong.get('holm_rejections_0.001', 0)} of {wrong.get('num_tests', 0)} "
            "tests at Holm 0.001), so these tests may be too weak to see a fault; raise --num_samples")
  return ("No evidence against losslessness (no Holm rejection at 0.01; the power check passed: "
          "the wrong rule was detected in every test)")


def markdown(results: dict, meta: dict) -> str:
  c, w = results["combined"]["correct"], results["combined"]["wrong"]
  conclusion = results.get("verdict") or verdict(c, w)
  power = ("detected in every test" if power_check_passed(w)
           else "NOT detected in every test (too few samples?)")
  lines = [
      f"# Losslessness study: {meta['workdir']} (commit {meta['commit']}, {meta['date']})", "",
      f"{len(results['prompts'])} prompts x {len(results['settings'])} settings (temperature, top-p); "
      f"{meta['num_samples']} AR and {meta['num_samples']} speculative samples of "
      f"{meta['num_tokens']} tokens per prompt and setting; MTP G = {meta['num_draft_tokens']}. "
      "Two-sample chi-square tests of homogeneity (AR vs speculative); categories with an "
      f"expected count below {MIN_EXPECTED:g} are pooled into 'other' (merged into the largest "
      "category if still below).", ""] + ([
      f"**Partial report: {results['settings_done']} of {results['settings_total']} settings "
      "finished** (the study was still running, or was stopped; the tests below are those of "
      "the finished settings).", ""] if results.get("complete") is False else []) + [
      "## Verdict", "",
      f"- Correct rule (Leviathan et al. 2023, Algorithm 1): {c['num_tests']} tests "
      f"({c['num_degenerate']} degenerate, skipped); fraction of p < 0.01: "
      f"{c.get('frac_below_0.01', 0):.3f}, p < 0.05: {c.get('frac_below_0.05', 0):.3f} (uniform: "
      f"0.01 and 0.05); KS test of uniformity p = {_p(c.get('ks_uniform_pvalue'))}; min p = "
      f"{_p(c.get('min_pvalue'))}; Holm rejections at 0.01 / 0.001: "
      f"{c.get('holm_rejections_0.01', 0)} / {c.get('holm_rejections_0.001', 0)}; Bonferroni: "
      f"{c.get('bonferroni_rejections_0.01', 0)} / {c.get('bonferroni_rejections_0.001', 0)}.",
      f"- Wrong rule (accept iff draft = target argmax, T = {POWER_SETTING[0]:g}, top-p "
      f"{POWER_SETTING[1]:g}): {w['num_tests']} tests, max p = {_p(w.get('max_pvalue'))}, Holm "
      f"rejections at 0.001: {w.get('holm_rejections_0.001', 0)} of {w['num_tests']}.",
      f"- {conclusion}; with the same tests the wrong rule is {power} (the power check).", "",
      "Note: the statistics of one prompt and setting share samples and chi-square p-values of "
      "counts are only asymptotically uniform, so the KS test is a rough check; the Holm "
      "correction is valid under any dependence.", "",
      "## Tests", "",
      "| prompt | T | top-p | rule | statistic | n AR / spec | K (pooled) | chi2 | dof | p | Holm p | TV |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for t in results["tests"]:
    lines.append(
        f"| {t['prompt_index']} | {t['temperature']:g} | {t['top_p']:g} | {t['rule']} | "
        f"{t['statistic']} | {t['n_a']} / {t['n_b']} | {t['num_categories']} ({t['num_columns']}) | "
        f"{t['chi2']:.1f} | {t['dof']} | {_p(t['pvalue'])} | {_p(t.get('holm_pvalue'))} | "
        f"{t['tv']:.3f} |")
  if results.get("planned_power"):
    lines += ["", "## Planned power (first token, wrong rule, before sampling)", "",
              "From the exact laws after each prompt (target p, module 1's q, the wrong rule's "
              "P(argmax) = q(m) + (1 - q(m)) p(m)): the power of the first-token chi-square test "
              "at level 0.001 / (wrong-rule tests) with these sample sizes (noncentral chi-square "
              "approximation). Low power here means the first-token test cannot see this fault at "
              "this size, whatever the decoder does.", "",
              "| prompt | p(argmax) | q(argmax) | TV | noncentrality | dof | power |",
              "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(results["planned_power"]):
      lines.append(f"| {i} | {r['p_argmax']:.3f} | {r['q_argmax']:.3f} | {r['tv']:.4f} | "
                   f"{r['noncentrality']:.1f} | {r['dof']} | {r['power']:.2f} |")
  lines += ["", "## Acceptance", "",
            "| T | top-p | rule | G | tau | accepted-length histogram |", "|---|---|---|---|---|---|"]
  for a in results["acceptance"]:
    tau = "-" if a["tau"] is None else f"{a['tau']:.2f}"
    lines.append(f"| {a['temperature']:g} | {a['top_p']:g} | {a['rule']} | {a['num_draft_tokens']} | "
                 f"{tau} | {a['accepted_length_histogram']} |")
  lines += ["", "## Prompts", ""]
  held = meta.get("prompt_indices") or []
  lines += [f"{i}. `{p!r}`" + (f" (held-out prompt {held[i]}, with its system message if any)"
                               if i < len(held) else "") for i, p in enumerate(results["prompts"])]
  return "\n".join(lines) + "\n"


def plot_pvalues(path: str, correct: list[float], wrong: list[float]) -> None:
  """Left: histogram of the correct rule's p-values against the uniform
  density; right: QQ plot of -log10 p against uniform quantiles, both rules."""
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
  ax1.hist(correct, bins=10, range=(0, 1), color="tab:blue", edgecolor="k", lw=0.5)
  ax1.axhline(len(correct) / 10, color="k", ls="--", lw=1, label="uniform (H0)")
  ax1.set_xlabel("p-value (correct rule)")
  ax1.set_ylabel("tests")
  ax1.legend(fontsize=8)
  floor = 1e-30
  for vals, color, marker, label in [(correct, "tab:blue", "o", "correct rule"),
                                     (wrong, "tab:red", "x", "wrong rule (argmax accept)")]:
    if not vals:
      continue
    obs = -np.log10(np.clip(np.sort(vals), floor, 1))
    exp = -np.log10((np.arange(len(vals)) + 1) / (len(vals) + 1))
    ax2.scatter(exp, obs, s=14, color=color, marker=marker, label=label)
  lim = -math.log10(1 / (max(len(correct), len(wrong), 1) + 1)) + 0.3
  ax2.plot([0, lim], [0, lim], color="k", lw=0.8, ls="--")
  ax2.axhline(3, color="gray", lw=0.6, ls=":")
  ax2.set_xlabel("-log10 expected p (uniform)")
  ax2.set_ylabel(f"-log10 observed p (clipped at {floor:g})")
  # outside the axes: the points run along the diagonal and, for the wrong rule, up the left side
  ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
  common.save_figure(fig, path, dpi=100)


# -- main ------------------------------------------------------------------------------

@dataclasses.dataclass
class Study:
  """What to sample: the target (MTP depth D >= 1), the encoded prompts
  (BOS included), the draft length G, the (temperature, top_p) settings,
  samples per prompt / setting / method, tokens per sample, rows per
  generate call and the seed."""
  target: object
  encoded: list
  num_draft_tokens: int
  settings: list[tuple[float, float]]
  num_samples: int
  num_tokens: int
  batch_size: int
  seed: int
  tokenizer: object = None


def stat_name(n: int) -> str:
  """"first_token", "first_2_tokens", ...: the name of the first-n-tokens statistic."""
  return "first_token" if n == 1 else f"first_{n}_tokens"


def run_study(s: Study, on_setting=None) -> tuple[list[dict], list[dict], list[int]]:
  """AR vs MTP samples at every setting (and the wrong rule at
  ``POWER_SETTING``), compared with ``two_sample_chi2`` per prompt on the
  first 1, 2 and num_tokens tokens. Returns (tests, acceptance rows, the
  token counts n compared). ``on_setting(tests, acceptance, ns, done,
  total)``, if given, is called after each setting with what is finished
  so far (the CLI writes a partial report there: a long study that is
  killed keeps its finished settings)."""
  t0 = time.perf_counter()
  target, encoded, g, settings = s.target, s.encoded, s.num_draft_tokens, s.settings
  kw = {"tokenizer": s.tokenizer}
  decoders = {"ar": Decoder(target, "ar", **kw), "mtp": Decoder(target, "mtp", g, **kw),
              "wrong_argmax": ArgmaxAcceptDecoder(target, "mtp", g, **kw)}
  draw = lambda name, k, sp, s_idx: sample_continuations(
      decoders[name], encoded, s.num_samples, s.num_tokens, sp,
      s.seed + SEED_STRIDE * (3 * s_idx + k), s.batch_size)
  ns = sorted({1, min(2, s.num_tokens), s.num_tokens})
  tests, acceptance = [], []

  def compare(rule, s_idx, temp, top_p, spec, ar):
    for i in range(len(encoded)):
      for n in ns:
        res = two_sample_chi2(categories(ar[i], n), categories(spec[i], n))
        tests.append({"prompt_index": i, "temperature": temp, "top_p": top_p, "rule": rule,
                      "num_draft_tokens": g, "statistic": stat_name(n), "n": n, **res})

  all_settings = settings + ([POWER_SETTING] if POWER_SETTING not in settings else [])
  for s_idx, (temp, top_p) in enumerate(all_settings):
    sp = SamplingParams(temperature=temp, top_p=top_p)
    ar, _ = draw("ar", 0, sp, s_idx)
    runs = ([("mtp", 1)] if (temp, top_p) in settings else []) + \
           ([("wrong_argmax", 2)] if (temp, top_p) == POWER_SETTING else [])
    for rule, k in runs:
      spec, hist = draw(rule, k, sp, s_idx)
      compare(rule, s_idx, temp, top_p, spec, ar)
      acceptance.append({"temperature": temp, "top_p": top_p, "rule": rule, "num_draft_tokens": g,
                         "tau": tau_from_histogram(hist), "accepted_length_histogram": hist.tolist()})
    print(f"T={temp:g} top-p={top_p:g}: done ({time.perf_counter() - t0:.1f} s)", flush=True)
    if on_setting is not None:
      on_setting(tests, acceptance, ns, s_idx + 1, len(all_settings))
  return tests, acceptance, ns


def study_results(texts: list[str], settings: list[tuple], tests: list[dict],
                  acceptance: list[dict], ns: list[int], seconds: float) -> dict:
  """The report's results of ``run_study``'s output: prompts, settings, the
  statistics, tests combined per rule (correct "mtp" / "wrong_argmax"),
  first-token TV distances, every test, acceptance, seconds and the verdict."""
  correct = [t for t in tests if t["rule"] == "mtp"]
  wrong = [t for t in tests if t["rule"] == "wrong_argmax"]
  results = {
      "prompts": texts, "settings": [{"temperature": t, "top_p": p} for t, p in settings],
      "power_setting": {"temperature": POWER_SETTING[0], "top_p": POWER_SETTING[1]},
      "statistics": [stat_name(n) for n in ns], "min_expected": MIN_EXPECTED,
      "combined": {"correct": combine(correct), "wrong": combine(wrong)},
      "first_token_tv": [{"prompt_index": t["prompt_index"], "temperature": t["temperature"],
                          "top_p": t["top_p"], "rule": t["rule"], "tv": t["tv"]}
                         for t in tests if t["statistic"] == "first_token"],
      "tests": tests, "acceptance": acceptance, "seconds": seconds,
  }
  results["verdict"] = verdict(results["combined"]["correct"], results["combined"]["wrong"])
  return results


def study_prompts(args, cfg):
  """(texts, encoded prompts with BOS, tokenizer or None). A byte-level
  model: ``--prompt`` texts or held-out ``--dataset`` prompts, byte-encoded.
  A BPE model (an imported target): ``--prompt`` texts or the first
  ``--num_prompts`` held-out chat prompts (``mtp/data/heldout_chat.jsonl``;
  ``--prompt_indices`` picks others, keeping their system message), each
  as one user turn through the model's chat template. Raises DecodeError
  for an index past the held-out chat prompts."""
  idx = args.prompt_indices
  count = max(idx) + 1 if idx else args.num_prompts
  pick = (lambda xs: [xs[i] for i in idx]) if idx else (lambda xs: xs)
  if cfg.model.tokenizer == "byte":
    texts = args.prompt or pick(data_lib.held_out_prompts(args.dataset, count, args.prompt_bytes,
                                                          seed=args.seed, data_dir=args.data_dir))
    return texts, [tok.ByteTokenizer().encode(t, add_bos=True) for t in texts], None
  from mtp.data import chat
  tokenizer = tok.load_tokenizer(args.workdir)
  heldout = chat.heldout_chat_prompts()
  if idx and count > len(heldout):
    raise DecodeError(f"--prompt_indices: {max(idx)} is past the {len(heldout)} held-out chat "
                      f"prompts (indices 0..{len(heldout) - 1})")
  prompts = ([{"prompt": t} for t in args.prompt] if args.prompt else pick(heldout[:count]))
  encoded = [np.asarray(tokenizer.apply_chat_template(chat.prompt_messages(p)), np.int32)
             for p in prompts]
  return [p["prompt"] for p in prompts], encoded, tokenizer


def parser() -> argparse.ArgumentParser:
  ap = cli.OneLineParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--workdir", required=True, help="trained checkpoint with MTP depth >= 1")
  ap.add_argument("--dataset", default="python_stdlib", help="held-out prompt dataset")
  ap.add_argument("--data_dir", default="", help=cli.DATA_DIR_HELP)
  ap.add_argument("--num_prompts", type=int, default=4, help="held-out prompts, in [1, 1000]")
  ap.add_argument("--prompt_bytes", type=int, default=48, help="bytes per held-out prompt, >= 1")
  ap.add_argument("--prompt_indices", default=None,
                  help="comma list of held-out prompt indices (each >= 0 and within the held-out "
                  "set: 57 chat prompts for a BPE model) instead of the first --num_prompts; chat "
                  "prompts keep their system message; reports label prompts by position in this list")
  ap.add_argument("--prompt", action="append", default=None,
                  help="prompt text (repeatable); replaces the held-out prompts")
  ap.add_argument("--temperatures", default=None,
                  help="comma list, each in (0, 100] (default 0.7,1.0,1.3; --quick 0.7,1.0)")
  ap.add_argument("--top_ps", default=None,
                  help="comma list, each in (0, 1] (default 1.0,0.9)")
  ap.add_argument("--num_draft_tokens", type=int, default=0, help="MTP draft length G (default: D)")
  ap.add_argument("--num_samples", type=int, default=4000, help="samples per prompt, setting and method")
  ap.add_argument("--num_tokens", type=int, default=4, help="generated tokens per sample")
  ap.add_argument("--batch_size", type=int, default=1000, help="rows per generate call")
  ap.add_argument("--seed", type=int, default=0, help="sampling and prompt seed")
  ap.add_argument("--out", default="results/losslessness_study", help="output prefix")
  ap.add_argument("--plan_only", action="store_true",
                  help="print each prompt's planned first-token power against the wrong rule "
                  "(exact laws, one forward pass; seconds) and exit without sampling")
  ap.add_argument("--quick", action="store_true",
                  help=f"for the tests' Markov model: prompts {QUICK_PROMPTS}, temperatures 0.7,1.0, "
                  "500 samples of 2 tokens, one batch per prompt and setting")
  return ap


def main(argv=None):
  ap = parser()
  args = ap.parse_args(argv)
  if args.quick:        # only what the user did not give
    args.prompt = args.prompt or list(QUICK_PROMPTS)
    cli.apply_quick(ap, args, temperatures="0.7,1.0", num_samples=500, num_tokens=2)
    cli.apply_quick(ap, args, batch_size=args.num_samples)
  cli.check_output_path("out", args.out, "prefix")
  args.temperatures = cli.parse_list(ap, "temperatures", args.temperatures or "0.7,1.0,1.3", float,
                                     0.0, 100.0, lo_open=True)
  if args.prompt_indices is not None:
    if args.prompt:
      ap.error("--prompt_indices and --prompt are exclusive: give one")
    args.prompt_indices = cli.parse_list(ap, "prompt_indices", args.prompt_indices, int, 0, 999)
  args.top_ps = cli.parse_list(ap, "top_ps", args.top_ps or "1.0,0.9", float, 0.0, 1.0, lo_open=True)
  for flag, val, lo, hi in [("--num_samples", args.num_samples, 20, 10**7),
                            ("--num_tokens", args.num_tokens, 1, 64),
                            ("--batch_size", args.batch_size, 1, 10**5),
                            ("--num_prompts", args.num_prompts, 1, 1000),
                            ("--num_draft_tokens", args.num_draft_tokens, 0, 64),
                            ("--prompt_bytes", args.prompt_bytes, 1, 10**5)]:
    if not lo <= val <= hi:
      ap.error(f"{flag}={val} must be in {lo}..{hi}")
  try:
    cfg, _ = loading.load_config(args.workdir)      # cheap: checks before the weights load
  except ckpt_lib.CheckpointError as e:
    ap.error(f"--workdir {args.workdir}: {e}")
  if args.prompt_indices and cfg.model.tokenizer != "byte":
    from mtp.data import chat
    count = len(chat.heldout_chat_prompts())
    if max(args.prompt_indices) >= count:
      ap.error(f"--prompt_indices: {max(args.prompt_indices)} is past the {count} held-out chat "
               f"prompts (indices 0..{count - 1})")
  try:
    cfg, target, step = loading.load_model(args.workdir)
  except ckpt_lib.CheckpointError as e:
    ap.error(f"--workdir {args.workdir}: {e}")
  depth = cfg.mtp.depth
  if depth < 1:
    ap.error(f"--workdir {args.workdir} has MTP depth D = 0: the study needs D >= 1")
  g = args.num_draft_tokens or depth
  texts, encoded, tokenizer = study_prompts(args, cfg)
  too_long = [i for i, e in enumerate(encoded)
              if len(e) < 2 or len(e) + args.num_tokens > cfg.model.max_seq_len]
  if too_long:
    ap.error(f"prompts {too_long} are empty or, with --num_tokens={args.num_tokens}, longer than "
             f"the model's max_seq_len={cfg.model.max_seq_len} (lower --prompt_bytes)")
  settings = [(t, p) for t in args.temperatures for p in args.top_ps]
  num_wrong_tests = len(encoded) * len({1, min(2, args.num_tokens), args.num_tokens})
  plan = planned_power(target, encoded, args.num_samples, 0.001 / num_wrong_tests)
  labels = args.prompt_indices or list(range(len(encoded)))      # held-out indices when given
  for i, r in zip(labels, plan):
    print(f"planned power, prompt {i} first token vs the wrong rule: {r['power']:.2f} at "
          f"{args.num_samples} samples (p(argmax) {r['p_argmax']:.3f}, q(argmax) "
          f"{r['q_argmax']:.3f}, TV {r['tv']:.4f}, noncentrality {r['noncentrality']:.1f}, "
          f"dof {r['dof']})", flush=True)
  if args.plan_only:
    return {"planned_power": plan}

  meta = report.provenance(
      command=common.command_line(__file__, argv),
      workdir=args.workdir, checkpoint_step=step, config=cfg.to_dict(),
      prompt_source=("--prompt" if args.prompt else "held_out_prompts" if tokenizer is None
                     else "heldout_chat.jsonl"), dataset=args.dataset,
      prompt_bytes=args.prompt_bytes, num_prompts=len(texts), prompt_indices=args.prompt_indices, temperatures=args.temperatures,
      top_ps=args.top_ps, num_draft_tokens=g, num_samples=args.num_samples,
      num_tokens=args.num_tokens, batch_size=args.batch_size, seed=args.seed, quick=args.quick)
  t0 = time.perf_counter()

  def write(tests, acceptance, ns, done, total):
    """The report of the settings finished so far (``complete`` once all are)."""
    res = study_results(texts, settings, tests, acceptance, ns, time.perf_counter() - t0)
    res.update(planned_power=plan, settings_done=done, settings_total=total, complete=done == total)
    report.write_report(args.out, {**meta, **report.provenance()}, res, markdown(res, meta))
    return res

  progress = {}
  tests, acceptance, ns = run_study(
      Study(target, encoded, g, settings, args.num_samples, args.num_tokens, args.batch_size,
            args.seed, tokenizer),
      on_setting=lambda *a: progress.update(results=write(*a)))
  results = progress["results"]
  correct = [t for t in tests if t["rule"] == "mtp"]
  wrong = [t for t in tests if t["rule"] == "wrong_argmax"]
  plot_pvalues(args.out + "_pvalues.png", [t["pvalue"] for t in correct if t["pvalue"] is not None],
               [t["pvalue"] for t in wrong if t["pvalue"] is not None])
  c, w = results["combined"]["correct"], results["combined"]["wrong"]
  print(f"correct rule: {c['num_tests']} tests, min p {_p(c.get('min_pvalue'))}, Holm rejections "
        f"at 0.01: {c.get('holm_rejections_0.01', 0)}; wrong rule: max p {_p(w.get('max_pvalue'))}, "
        f"detected (Holm 0.001) in {w.get('holm_rejections_0.001', 0)} of {w['num_tests']} tests: "
        f"power check {'passed' if power_check_passed(w) else 'FAILED'}")
  print(f"verdict: {results['verdict']}")
  print(f"wrote {args.out}.json, {args.out}.md, {args.out}_pvalues.png")
  return results


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError,))
