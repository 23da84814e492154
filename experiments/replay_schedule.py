r"""Draft-length schedules replayed on the target's own answers: how fixed
G = 0..G_max, the CLI's "auto" and variants of it would spend target calls
and time on held-out chat prompts, in seconds instead of a benchmark's
minutes.

    python -m experiments.replay_schedule --workdir runs/smollm_demo [--per_category 2] \
        [--max_new_tokens 128] [--costs 1,1.22,1.43,1.63 [--ar_step 0.97]] \
        [--temperature 1 --top_p 1 --samples 4 --draws 8] \
        [--variants "slow:ema=0.05;probe:probe_interval=1"] [--answers OTHER_RECORDS.npz] \
        [--out results/replay_schedule]

Each prompt is answered by AR (once greedily at T = 0; ``--samples``
answers at T > 0); one cache-free forward of the target and its modules over
prompt + answer gives the acceptance of every draft position at every round
start: exact at T = 0 (the decoder emits the same answer whatever the
schedule), and at T > 0 the probability that each draft is accepted given
the sampled answer, min(p, q)(x) / p(x), which replays a lossless decoder
exactly in law (``--draws`` draws of the acceptance events per answer,
shared by every decoder). Every decoder is then replayed round by round with
the round costs ``--costs`` (seconds or units of an AR step per g =
0..G_max; default: measured on this device as "auto" calibrates them, at
the given sampling settings) and the plain AR step ``--ar_step`` (what G0
and a schedule's plain AR fallback cost per token; "auto"'s own g = 0 round
also feeds the modules; default: measured beside the costs, or costs[0]
with ``--costs``). The schedules run the decoder's own
``AutoSchedule.choose`` / ``update`` code. What it leaves out: the prefill
(equal for all) and the decoder's cost learning between generations.
Writes OUT.json and OUT.md. The replay itself takes seconds; recording or
rescoring does not: one AR generation and one cache-free forward with
a softmax over the vocabulary per answer token and draft depth (108
answers of SmolLM2 at T = 1: ~13 min on 2 busy cores; with ``--answers`` the
prompts are the records', whatever ``--per_category`` says).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
from collections.abc import Sequence

from mtp import cli

if __name__ == "__main__":     # a flag out of range: one line, before the imports below load jax
  cli.refuse_bad_flags(per_category=(int, 1), max_new_tokens=(int, 1), draws=(int, 1),
                       temperature=(float, 0), top_k=(int, 0), top_p=(float, 0, 1, True))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from decode import kv_cache  # noqa: E402
from decode.cli import run as run_lib  # noqa: E402
from decode.auto.schedule import AutoSchedule  # noqa: E402
from decode.decoder import DecodeError, SamplingParams  # noqa: E402
from experiments import common  # noqa: E402
from mtp import loading, report  # noqa: E402
from mtp import data as data_lib  # noqa: E402
from mtp import model as model_lib  # noqa: E402
from mtp import tokenizer as tok  # noqa: E402
from scripts.bench_chat import heldout_prompts  # noqa: E402


# -- the library: replaying schedules on recorded answers ----------------------------------
#
# Replaying draft-length schedules on recorded answers: how many target
# calls and how much decoding time a schedule (``decode.auto.schedule``'s "auto",
# or a fixed G) would spend on a given answer, without decoding it again.
# Exact at T = 0; exact in law at T > 0 (below).
#
# At T = 0 a speculative decoder emits the target's greedy answer x whatever
# its schedule, and whether a draft is accepted depends only on where the
# round starts: the round that starts with x_0..x_{n-1} committed drafts from
# the MTP chain at position n-2 (docs/design.md section 6), and with every
# earlier draft accepted its drafts are exactly the teacher-forced ones. So
# one cache-free forward of the target and its modules over prompt + answer
# (``Transformer.__call__`` with ``recursive_steps``: module D reused past D,
# as the drafter does) gives, for every round start n, the acceptance of
# draft j given drafts 1..j-1 accepted:
#
#     A[n, j-1] = (argmax draft_j logits at chain start n-2) == x_{n+j-1}
#
# and a round of draft length g starting at n accepts a = the number of
# leading True in A[n, :g]. ``replay`` walks an answer round by round as
# ``decode.loops`` does (segments of ``rounds_per_choice`` rounds chosen by
# ``AutoSchedule.choose`` from the past, ``AutoSchedule.update`` after every
# round, the budget and the answer's end cutting the last round) and charges
# each round its measured cost per g. The same schedule code runs as in the
# decoder (B = 1), so a change to the schedule can be compared with fixed G
# on real answers in seconds instead of a 15-minute benchmark.
#
# Exact at T = 0 up to floating-point ties between the cache-free forward
# and the cached rounds (a test compares replayed target calls with real
# decoding). The costs are fixed per g (the decoder's own cost learning is
# not replayed) and prefill is left out (the same for every schedule).
#
# T > 0 (``acceptance_probs``). A lossless decoder's output has the law of AR
# sampling whatever its schedule, so an answer x sampled by AR is a draw of
# every schedule's output too, and what remains random given x is only which
# drafts were accepted. For the round starting at n (Leviathan et al. 2023,
# Algorithm 1, with the drafts of ``decode.drafters``), draft j is accepted
# and equals x_{n+j-1} with probability min(p_j, q_j)(x_{n+j-1}) (drafted
# from q_j, kept with probability min(1, p_j/q_j)), and the round emits
# x_{n+j-1} with probability p_j(x_{n+j-1}), so
#
#     P(draft j accepted | drafts 1..j-1 accepted, x) = min(p_j, q_j)(x_{n+j-1}) / p_j(x_{n+j-1})
#
# where p_j is the warped target distribution at position n+j-2 and q_j the
# warped draft distribution of depth j at chain start n-2, both conditioned on
# x (what an accepted prefix is): teacher-forced values of the same
# cache-free forward. Given x these are independent over j and over round
# starts, and the later tokens depend on the round only through x, so
# drawing U [L, G] ~ uniform once and accepting draft j of the round at k iff
# U[k, j-1] < rho[k, j-1] replays the decoder exactly in law; the same U for
# every schedule (common random numbers) makes their differences less noisy.
# Unlike a benchmark at T > 0, every schedule is judged on the same answers,
# so the sampled answer length, which dominates a 2-prompt benchmark cell,
# cancels.

def _teacher_forced(model, prompt, answer, max_draft_tokens: int, who: str):
  """Checks the arguments and runs the cache-free forward over prompt +
  answer: (logits [S, V], mtp_logits D (+R) arrays [S, V], tokens int32
  [1, P+L], P, L), S >= P+L: the buffer is padded to a multiple of
  ``kv_cache.PROMPT_BUCKET`` with ``MTP_FILL_ID``, what the model itself
  feeds past the end, so positions < P+L are unchanged and answers of any
  length share a few compiled programs."""
  d = model.mtp_depth
  if d < 1:
    raise ValueError(f"{who} needs a model with MTP modules (mtp.depth >= 1)")
  if max_draft_tokens < 1:
    raise ValueError(f"max_draft_tokens={max_draft_tokens} must be >= 1")
  prompt, answer = np.asarray(prompt, np.int32), np.asarray(answer, np.int32)
  if prompt.size < 2 or answer.size == 0:
    raise ValueError(f"{who} needs a prompt of >= 2 tokens and a non-empty answer")
  tokens = np.concatenate([prompt, answer])[None]
  n = tokens.shape[1]
  bucket, _ = kv_cache.cache_length(n, 0, 0)       # n rounded up to the prompt bucket
  padded = np.full((1, max(n, min(model.cfg.max_seq_len, bucket))), model_lib.MTP_FILL_ID,
                   np.int32)
  padded[:, :n] = tokens
  logits, mtp_logits = _cache_free_logits(model, jnp.asarray(padded),
                                          max(0, max_draft_tokens - d))
  return logits[0], [m[0] for m in mtp_logits], tokens, prompt.size, answer.size


@functools.partial(nnx.jit, static_argnums=2)
def _cache_free_logits(model, tokens, recursive_steps: int):
  """(logits, mtp_logits) of ``model(tokens, recursive_steps=...)``, jitted."""
  out = model(tokens, recursive_steps=recursive_steps)
  return out.logits, out.mtp_logits


@jax.jit
def _warped_probs(logits, params):
  """``decode.sampling.warped_probs`` [S, V] of every row, jitted."""
  from decode.sampling import warped_probs
  return warped_probs(logits, params)


def greedy_acceptance(model, prompt, answer, max_draft_tokens: int) -> np.ndarray:
  """Per-round-start acceptance of a greedy answer (module docstring).

  Args:
    model: a ``mtp.model.Transformer`` with D >= 1 MTP modules.
    prompt: int [P] the prompt ids (chat template applied); answer: int [L]
      the target's greedy answer (as ``Decoder.generate`` emits it, a final
      stop id included).
    max_draft_tokens: G_max >= 1; drafts past D reuse module D.
  Returns:
    bool [L, G_max]: row k is the round that starts with the prompt and
    answer[:k] committed (n = P + k; the prefill ran over the prompt but its
    last token, which the first round verifies); entry j-1 says whether
    draft j equals answer[k+j-1] given drafts 1..j-1 were accepted (False
    past the answer's end).
  Raises ValueError for D = 0, G_max < 1, a prompt shorter than 2 tokens or
  an empty answer.
  """
  _, mtp_logits, tokens, p, n_ans = _teacher_forced(model, prompt, answer, max_draft_tokens,
                                                    "greedy_acceptance")
  k = np.arange(n_ans)                     # round start n = P + k: chain at n-2
  acc = np.zeros((n_ans, max_draft_tokens), bool)
  for j in range(1, max_draft_tokens + 1):
    draft = np.asarray(mtp_logits[j - 1]).argmax(-1)                 # at i: guess for t_{i+j+1}
    target = p + k + j - 1                                           # draft j's position n+j-1
    ok = target < p + n_ans
    acc[ok, j - 1] = draft[p + k[ok] - 2] == tokens[0, target[ok]]
  return acc


def acceptance_probs(model, prompt, answer, max_draft_tokens: int, params) -> np.ndarray:
  """Per-round-start acceptance probabilities of a sampled answer (module
  docstring, T > 0): rho[k, j-1] = min(p_j, q_j)(x) / p_j(x) at x =
  answer[k+j-1], the probability that draft j of the round starting with
  answer[:k] committed is accepted, given drafts 1..j-1 were and given the
  answer (Leviathan et al. 2023, Algorithm 1).

  Args:
    model, prompt, max_draft_tokens: as ``greedy_acceptance``.
    answer: int [L], an answer sampled from the target under ``params`` (by
      AR or any lossless decoder), a final stop id included.
    params: the ``SamplingParams`` it was sampled with (the same warp,
      temperature then top-k then top-p, is applied to target and drafts, as
      in decoding; greedy params give ``greedy_acceptance`` as 0.0 / 1.0).
  Returns:
    float32 [L, G_max] in [0, 1] (0 past the answer's end, and where the
    cache-free p_j(x) is 0: a token at a top-p boundary that float rounding
    moved out of the nucleus).
  Raises ValueError as ``greedy_acceptance``.
  """
  if params.greedy:
    return greedy_acceptance(model, prompt, answer, max_draft_tokens).astype(np.float32)
  logits, mtp_logits, tokens, p, n_ans = _teacher_forced(model, prompt, answer,
                                                         max_draft_tokens, "acceptance_probs")
  k = np.arange(n_ans)
  rho = np.zeros((n_ans, max_draft_tokens), np.float32)
  target_probs = np.asarray(_warped_probs(logits, params))          # the warp is per row
  for j in range(1, max_draft_tokens + 1):
    target = p + k + j - 1
    ok = target < p + n_ans
    x = tokens[0, target[ok]]
    qx = np.asarray(_warped_probs(mtp_logits[j - 1], params))[p + k[ok] - 2, x]   # at i: draft for t_{i+j+1}
    px = target_probs[target[ok] - 1, x]                            # at i: target for t_{i+1}
    rho[ok, j - 1] = np.where(px > 0, np.minimum(px, qx) / np.where(px > 0, px, 1.0), 0.0)
  return np.clip(rho, 0.0, 1.0)


def draw_acceptance(rho: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """One draw of the acceptance events: bool [L, G], U < rho with U uniform
  [L, G] (bool ``rho`` from ``greedy_acceptance`` is returned as it is)."""
  if rho.dtype == bool:
    return rho
  return rng.random(rho.shape) < rho


@dataclasses.dataclass(frozen=True)
class Replay:
  """One answer decoded by one schedule: rounds (target calls), the
  decoding time in seconds (sum of per-g round costs), the draft length of
  every round, and the tokens emitted."""
  rounds: int
  time_s: float
  draft_lengths: tuple[int, ...]
  tokens: int


@functools.lru_cache(maxsize=64)
def _jitted(schedule):
  """(choose, update) of a schedule jitted once per schedule (a frozen,
  hashable dataclass), not once per replayed answer."""
  return jax.jit(schedule.choose), jax.jit(schedule.update, static_argnums=1)


def _accepted(acc: np.ndarray, k: int, g: int) -> int:
  a = 0
  while a < g and acc[k, a]:
    a += 1
  return a


def replay(acc: np.ndarray, costs: Sequence[float], max_new: int, schedule=None,
           g: int | None = None, greedy: bool = True, extra_prefill_s: float = 0.0,
           ar_step_s: float | None = None) -> Replay:
  """Decodes one recorded answer with a fixed draft length ``g`` (0 = AR)
  or with ``schedule`` (an ``AutoSchedule``; its G_max must not exceed
  ``acc``'s columns), B = 1, as ``decode.loops`` does (plain AR when the
  schedule's ``drafting_pays`` says no, as ``Decoder.generate``).

  Args:
    acc: bool [L, G] from ``greedy_acceptance`` (L answer tokens).
    costs: seconds per round for g = 0..G (at least up to the largest g used);
      costs[0] is "auto"'s own AR round inside a drafting generation (it
      also feeds the modules).
    ar_step_s: seconds per step of the plain AR decoder
      (``calibrate.plain_ar_calibration``): what ``g = 0`` costs per round
      and what a schedule's fallback costs when ``drafting_pays`` says no,
      and the step ``drafting_pays`` compares with. Default costs[0].
    max_new: the token budget the answer was generated with (>= L).
    greedy: which prior of the schedule to start from (T = 0: True).
    extra_prefill_s: what the modules' prefill adds (seconds), charged in
      ``drafting_pays``'s decision with the budget ``max_new`` and B = 1, as
      ``Decoder.generate`` decides (not added to the replayed time, which
      counts rounds only).
  Returns a ``Replay``. Raises ValueError when neither or both of
  ``schedule`` and ``g`` are given.
  """
  if (schedule is None) == (g is None):
    raise ValueError("give exactly one of schedule (auto) and g (a fixed draft length)")
  n_ans = acc.shape[0]
  budget = min(max_new, n_ans)
  emitted, rounds, time_s, lengths = 0, 0, 0.0, []
  if schedule is not None:
    sched = schedule.init_state(1, jnp.asarray(costs[:schedule.max_draft_tokens + 1]))
    prior = jnp.broadcast_to(schedule.prior_alpha(greedy), (1, schedule.max_draft_tokens))
    sched = {**sched, "alpha": prior, "prior": prior}         # as decode.auto.calibrate.with_costs
    choose, update = _jitted(schedule)
    active = jnp.asarray([True])
  left, cur = 0, g
  plain = float(costs[0]) if ar_step_s is None else float(ar_step_s)
  if schedule is not None and not schedule.drafting_pays(costs[:schedule.max_draft_tokens + 1],
                                                         greedy, max_new, extra_prefill_s, batch=1,
                                                         ar_step_s=plain):
    schedule, cur = None, 0              # the decoder runs plain AR (Decoder.plain_ar)
  step_cost = [plain] + [float(c) for c in costs[1:]] if schedule is None else costs
  while emitted < budget and rounds < max_new:
    if schedule is not None and left == 0:
      gg, n_rounds, sched = choose(sched, active)
      cur, left = int(gg), min(int(n_rounds), max_new - rounds)
    a = _accepted(acc, emitted, cur)
    emitted += min(a + 1, budget - emitted)
    rounds += 1
    time_s += float(step_cost[cur])
    lengths.append(cur)
    if schedule is not None:
      sched = update(sched, cur, jnp.asarray([a], jnp.int32), active)
      left -= 1
  return Replay(rounds, time_s, tuple(lengths), emitted)


def _acceptance(model, prompt, answer, max_draft_tokens: int, params) -> np.ndarray:
  """What a record stores: bool ``greedy_acceptance`` at T = 0, else
  ``acceptance_probs``."""
  if params.greedy:
    return greedy_acceptance(model, prompt, answer, max_draft_tokens)
  return acceptance_probs(model, prompt, answer, max_draft_tokens, params)


def record(model, tokenizer, prompts: dict, max_new: int, max_draft_tokens: int,
           log=None, params=None, samples: int = 1) -> list[dict]:
  """AR answers and their acceptance for chat prompts.

  Args:
    model, tokenizer: the target with its modules and its tokenizer.
    prompts: {category: [int32 ids [P], ...]} (chat template applied).
    max_new: token budget per answer; max_draft_tokens: G_max >= 1.
    log: optional callable getting one line per answer.
    params: ``SamplingParams`` (default greedy). Greedy: one answer per
      prompt and bool acceptance (``greedy_acceptance``); sampling:
      ``samples`` answers per prompt (the rows of one batch) and acceptance
      probabilities (``acceptance_probs``).
  Returns:
    [{"category", "index", "sample", "prompt" int32 [P], "answer" int32
    [L], "acc" bool or float32 [L, G_max]}] in category order.
  """
  from decode.decoder import Decoder, SamplingParams
  params = SamplingParams(0.0) if params is None else params
  if samples < 1 or (params.greedy and samples != 1):
    raise ValueError(f"samples={samples}: give 1 at T = 0 (the answer is the same), >= 1 else")
  ar = Decoder(model, "ar", tokenizer=tokenizer)
  out = []
  total = samples * sum(len(ps) for ps in prompts.values())
  for cat, ps in prompts.items():
    for i, p in enumerate(ps):
      gen = ar.generate([p] * samples, max_new, params, seed=0)      # rows sample independently
      for s in range(samples):
        ans = np.asarray(gen.tokens[s], np.int32)
        acc = _acceptance(model, p, ans, max_draft_tokens, params)
        out.append({"category": cat, "index": i, "sample": s, "prompt": np.asarray(p, np.int32),
                    "answer": ans, "acc": acc})
        if log is not None:
          log(f"[{len(out)}/{total}] {cat} {i}.{s}: {len(ans)} tokens, alpha_1 along the answer "
              f"{acc[:, 0].mean():.2f}")
  return out


def rescore(model, records: list[dict], max_draft_tokens: int, params=None,
            log=None) -> list[dict]:
  """``records`` (``record``'s list, e.g. read back by ``load_records``)
  with their acceptance recomputed for ``model``'s modules: the same
  prompts and answers, so other modules on the same target are compared on
  the same answers (valid since the answers are the target's: greedy, or
  sampled under ``params``, which must be the records' settings)."""
  from decode.decoder import SamplingParams
  params = SamplingParams(0.0) if params is None else params
  out = []
  for rec in records:
    out.append({**rec, "acc": _acceptance(model, rec["prompt"], rec["answer"], max_draft_tokens,
                                          params)})
    if log is not None:
      log(f"[{len(out)}/{len(records)}] {rec['category']} {rec['index']}.{rec.get('sample', 0)}: "
          f"alpha_1 along the answer {out[-1]['acc'][:, 0].mean():.2f}")
  return out


def compare(records: list[dict], costs: Sequence[float], max_new: int,
            schedules: dict, draws: int = 1, seed: int = 0,
            ar_step_s: float | None = None) -> list[dict]:
  """Every record replayed with fixed G = 0..G_max (``len(costs) - 1``) and
  with each schedule of ``schedules`` ({label: AutoSchedule}).

  Records with bool acceptance (T = 0) are replayed once, with the
  schedules' greedy prior; records with probabilities (T > 0) ``draws``
  times (``draw_acceptance``, one draw shared by every decoder; seeded by
  ``seed`` and the record's position) with the sampling prior, and rounds
  and times are the means over the draws. ``ar_step_s``: the plain AR
  decoder's step (``replay``; default costs[0]), the cost of G0's rounds
  and of a schedule's fallback.

  Returns one row per record: category, index, sample, tokens, alpha_1
  (mean acceptance of draft 1 along the answer) and per decoder label
  ("G0".."G<max>", then the schedules' labels) its rounds, time (in the
  units of ``costs``), speedup over G0 (AR) and draft-length histogram (over
  all draws); ``best_fixed`` (the label of the fastest fixed G) and, per
  schedule, ``<label>/best`` = its speedup over the fastest fixed G.
  Raises ValueError when records hold fewer draft positions than ``costs``
  asks for, or ``draws`` < 1.
  """
  if draws < 1:
    raise ValueError(f"draws={draws} must be >= 1")
  g_max = len(costs) - 1
  rows = []
  for n, rec in enumerate(records):
    if rec["acc"].shape[1] < g_max:
      raise ValueError(f"records hold {rec['acc'].shape[1]} draft positions; costs ask for {g_max}")
    rho = rec["acc"][:, :g_max]
    greedy = rho.dtype == bool
    rng = np.random.default_rng([seed, n])
    labels = [f"G{g}" for g in range(g_max + 1)] + list(schedules)
    time = dict.fromkeys(labels, 0.0)
    rounds = dict.fromkeys(labels, 0)
    hist = {k: np.zeros(g_max + 1, np.int64) for k in labels}
    n_draws = 1 if greedy else draws
    for _ in range(n_draws):
      acc = draw_acceptance(rho, rng)
      runs = {f"G{g}": replay(acc, costs, max_new, g=g, ar_step_s=ar_step_s)
              for g in range(g_max + 1)}
      for label, s in schedules.items():
        runs[label] = replay(acc, costs, max_new, schedule=s, greedy=greedy, ar_step_s=ar_step_s)
      for label, r in runs.items():
        time[label] += r.time_s / n_draws
        rounds[label] += r.rounds
        hist[label] += np.bincount(r.draft_lengths, minlength=g_max + 1)
    ar = time["G0"]
    best = min((f"G{g}" for g in range(g_max + 1)), key=lambda k: time[k])
    row = {"category": rec["category"], "index": rec["index"], "sample": int(rec.get("sample", 0)),
           "tokens": int(len(rec["answer"])), "alpha_1": float(rho[:, 0].mean()),
           "best_fixed": best}
    for label in labels:
      row[label] = {"rounds": rounds[label] / n_draws, "time": time[label],
                    "speedup": ar / time[label], "draft_lengths": hist[label].tolist()}
    for label in schedules:
      row[f"{label}/best"] = time[best] / time[label]
    rows.append(row)
  return rows


def by_category(rows: list[dict], labels: Sequence[str], schedules: Sequence[str]) -> dict:
  """Per category (and "all"): geomean speedup of each decoder over the
  category's answers, and per schedule the geomean and minimum of
  ``<label>/best`` plus its speedup over the best fixed G of the category
  as a whole (ratio of geomean speedups: the benchmark's per-cell view)."""
  geo = lambda xs: float(np.exp(np.mean(np.log(xs))))
  groups = {}
  for r in rows:
    groups.setdefault(r["category"], []).append(r)
  groups["all"] = rows
  out = {}
  for cat, rs in groups.items():
    sp = {l: geo([r[l]["speedup"] for r in rs]) for l in labels}
    fixed = max((l for l in labels if l.startswith("G")), key=sp.get)
    entry = {"answers": len(rs), "speedup": sp, "best_fixed": fixed}
    for s in schedules:
      entry[f"{s}/best"] = geo([r[f"{s}/best"] for r in rs])
      entry[f"{s}/best_min"] = min(r[f"{s}/best"] for r in rs)
      entry[f"{s}/best_cell"] = sp[s] / sp[fixed]
    out[cat] = entry
  return out


def measured_costs(model, tokenizer, prompt, max_draft_tokens: int, max_new: int,
                   params=None) -> tuple[np.ndarray, float]:
  """(costs [G_max+1] seconds per round of "auto" at g = 0..G_max, the plain
  AR fallback's seconds per step) under ``params`` (default T = 0) on this
  device, as "auto" calibrates them (``decode.auto.calibrate.decoder_round_costs``
  and ``plain_ar_calibration``, while_loop form, B = 1, after the prefill
  of ``prompt``). ``replay`` charges the second to G0 and to a schedule's
  fallback: "auto"'s own g = 0 round also feeds the modules."""
  from decode.auto import calibrate
  from decode.decoder import Decoder, SamplingParams
  dec = Decoder(model, "mtp", "auto", tokenizer=tokenizer, max_draft_tokens=max_draft_tokens)
  sp = (SamplingParams(0.0) if params is None else params).validate()
  state, prefill_len = dec.prepare([prompt], max_new, 0)
  costs = calibrate.decoder_round_costs(dec, dec.prefill(state, prefill_len), sp, "while").costs
  ar = dec.plain_ar()
  state, prefill_len = ar.prepare([prompt], max_new, 0)
  plain = calibrate.plain_ar_calibration(ar, ar.prefill(state, prefill_len), sp, "while")
  return costs, float(plain.costs[0])


def parse_variants(text: str, base) -> dict:
  """"slow:ema=0.05;probe:probe_interval=1,rounds_per_choice=8" -> {label:
  ``dataclasses.replace(base, ...)``} (ints and floats parsed; an empty text
  gives {}). Raises ValueError naming a bad entry or field."""
  out = {}
  fields = {f.name for f in dataclasses.fields(base)}
  for part in filter(None, (x.strip() for x in text.split(";"))):
    label, sep, body = part.partition(":")
    if not sep or not label.strip():
      raise ValueError(f"variant {part!r}: write LABEL:field=value[,field=value]")
    kw = {}
    for item in filter(None, (x.strip() for x in body.split(","))):
      name, eq, value = item.partition("=")
      if not eq or name not in fields:
        raise ValueError(f"variant {part!r}: {item!r} is not field=value with a field of "
                         f"AutoSchedule ({', '.join(sorted(fields))})")
      kw[name] = float(value) if any(c in value for c in ".e") else int(value)
    out[label.strip()] = dataclasses.replace(base, **kw)
  return out


def save_records(path: str, records: list[dict], sampling=(0.0, 0, 1.0)) -> None:
  """Writes ``record``'s list to ``path`` (.npz: one prompt / answer /
  acceptance array per record, categories, indices and samples as arrays,
  and ``sampling`` = (temperature, top_k, top_p) the answers were drawn with)."""
  arrays = {"sampling": np.asarray(sampling, np.float64),"category": np.asarray([r["category"] for r in records]),
            "index": np.asarray([r["index"] for r in records], np.int32),
            "sample": np.asarray([r.get("sample", 0) for r in records], np.int32)}
  for i, r in enumerate(records):
    for field in ("prompt", "answer", "acc"):
      arrays[f"{field}_{i}"] = r[field]
  buf = io.BytesIO()
  np.savez_compressed(buf, **arrays)
  cli.write_atomic(path, buf.getvalue())


def load_sampling(path: str) -> tuple[float, int, float]:
  """(temperature, top_k, top_p) of the records in ``path`` ((0, 0, 1) for
  files written before it was stored: greedy records)."""
  with np.load(path) as z:
    if "sampling" not in z:
      return (0.0, 0, 1.0)
    t, k, p = z["sampling"].tolist()
    return (float(t), int(k), float(p))


def load_records(path: str) -> list[dict]:
  """``save_records``' list back from ``path``."""
  with np.load(path) as z:
    samples = z["sample"] if "sample" in z else np.zeros(len(z["index"]), np.int32)
    return [{"category": str(c), "index": int(k), "sample": int(s), "prompt": z[f"prompt_{i}"],
             "answer": z[f"answer_{i}"], "acc": z[f"acc_{i}"]}
            for i, (c, k, s) in enumerate(zip(z["category"], z["index"], samples))]


# -- command line --------------------------------------------------------------------------

def markdown(rows, labels, schedules, meta) -> str:
  g_labels = [l for l in labels if l.startswith("G")]
  t, top_k, top_p = meta["sampling"]
  greedy = t == 0
  setting = ("T = 0" if greedy else
             f"T = {t:g}, top-k {top_k}, top-p {top_p:g}; {meta['samples']} sampled AR answers per "
             f"prompt, {meta['draws']} draws of the acceptance events per answer")
  cats = by_category(rows, labels, list(schedules))
  lines = [f"Schedules replayed on {'greedy' if greedy else 'sampled'} answers: {meta['model']} on "
           f"{report.machine(meta)}, commit {meta['commit']}, {meta['date']}; B = 1, {setting}, "
           f"{meta['max_new_tokens']} new tokens, round costs per g (plain AR step = 1; g = 0 is "
           f"auto's own AR round): {', '.join(f'{c:.3f}' for c in meta['relative_costs'])}.", "",
           "## Per category", "",
           "Geomean speedup over AR over the category's answers (replayed target calls x round "
           "costs, prefill left out); per schedule: over the best fixed G per answer (geomean, "
           "min) and over the category's best fixed G (the benchmark's per-cell view).", "",
           "| category | answers | " + " | ".join(labels) + " | best fixed | "
           + " | ".join(f"{s} / best per answer (min) | {s} / best in category" for s in schedules)
           + " |",
           "|---|---|" + "---|" * (len(labels) + 1 + 2 * len(schedules))]
  for cat, e in cats.items():
    name = f"**{cat}**" if cat == "all" else cat
    lines.append(f"| {name} | {e['answers']} | "
                 + " | ".join(f"{e['speedup'][l]:.3f}x" for l in labels) + f" | {e['best_fixed']} | "
                 + " | ".join(f"{e[f'{s}/best']:.3f} ({e[f'{s}/best_min']:.3f}) | "
                              f"{e[f'{s}/best_cell']:.3f}" for s in schedules) + " |")
  lines += ["", "## Per answer", "",
            "| category | # | tokens | alpha_1 | " + " | ".join(labels) + " | "
            + " | ".join(f"{s} / best" for s in schedules) + " |",
            "|---|---|---|---|" + "---|" * (len(labels) + len(schedules))]
  for r in rows:
    idx = f"{r['index']}" if greedy else f"{r['index']}.{r['sample']}"
    lines.append(f"| {r['category']} | {idx} | {r['tokens']} | {r['alpha_1']:.2f} | "
                 + " | ".join(f"{r[l]['speedup']:.2f}x" for l in labels) + " | "
                 + " | ".join(f"{r[f'{s}/best']:.3f}" for s in schedules) + " |")
  lines += ["", "Schedules: " + "; ".join(f"`{s}` = {v}" for s, v in meta["schedules"].items()),
            f"Fixed G columns: {', '.join(g_labels)}."]
  return "\n".join(lines) + "\n"


def main(argv=None):
  ap = cli.OneLineParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--workdir", required=True, help="target with MTP modules (a chat tokenizer)")
  ap.add_argument("--chat_prompts", default=data_lib.HELDOUT_CHAT_PATH, help="chat prompt JSONL")
  ap.add_argument("--per_category", type=int, default=2, help="prompts per category, >= 1")
  ap.add_argument("--max_new_tokens", type=int, default=128, help="token budget, >= 1")
  ap.add_argument("--max_draft_tokens", type=int, default=None,
                  help="G_max (default: the offsets the modules were trained for, as auto)")
  ap.add_argument("--costs", default=None,
                  help="round costs for g = 0..G_max, comma list (default: measured here)")
  ap.add_argument("--ar_step", type=float, default=None,
                  help="plain AR step in the units of --costs, > 0 (default: measured with the "
                       "costs; costs[0] with --costs)")
  ap.add_argument("--variants", default="",
                  help="schedule variants of the CLI's auto: \"LABEL:field=value,...;...\"")
  ap.add_argument("--temperature", type=float, default=0.0,
                  help="sampling temperature of the AR answers and the replayed decoders, >= 0")
  ap.add_argument("--top_k", type=int, default=0, help="top-k (0 = off), >= 0")
  ap.add_argument("--top_p", type=float, default=1.0, help="top-p in (0, 1]")
  ap.add_argument("--samples", type=int, default=None,
                  help="sampled AR answers per prompt at T > 0, >= 1 (default 4; 1 at T = 0)")
  ap.add_argument("--draws", type=int, default=8,
                  help="draws of the acceptance events per sampled answer, >= 1")
  ap.add_argument("--seed", type=int, default=0, help="seed of the acceptance draws")
  ap.add_argument("--records", default=None,
                  help="an .npz of recorded answers: read when it exists (no decoding), else "
                       "written after recording")
  ap.add_argument("--answers", default=None,
                  help="an .npz of recorded answers (--records of another run on the same "
                       "target): its prompts and answers, with the acceptance recomputed for "
                       "--workdir's modules (compares modules on the same answers)")
  ap.add_argument("--out", default="results/replay_schedule", help="output prefix")
  args = ap.parse_args(argv)
  cli.check_range(ap, args, per_category=1, max_new_tokens=1, draws=1)
  cli.check_output_path("out", args.out, "prefix")
  params = SamplingParams(args.temperature, args.top_k, args.top_p)
  try:
    params.validate()
  except DecodeError as e:
    ap.error(str(e))
  if args.samples is None:
    args.samples = 1 if params.greedy else 4
  if args.samples < 1 or (params.greedy and args.samples != 1):
    ap.error(f"--samples={args.samples}: must be 1 at --temperature 0 (the greedy answer is "
             "always the same) and >= 1 at --temperature > 0")
  sampling = (float(args.temperature), int(args.top_k), float(args.top_p))
  if args.answers and not os.path.isfile(args.answers):
    ap.error(f"--answers={args.answers!r}: no such file (give a records .npz of an earlier run)")
  if args.answers and args.records:
    ap.error("--answers and --records exclude each other (--answers rescores a records file)")
  if args.answers and load_sampling(args.answers) != sampling:
    t, k, p = load_sampling(args.answers)
    ap.error(f"--answers={args.answers!r} holds answers sampled at --temperature {t:g} --top_k {k} "
             f"--top_p {p:g}; pass those (given: {sampling[0]:g}, {sampling[1]}, {sampling[2]:g})")
  if args.records and os.path.isfile(args.records) and load_sampling(args.records) != sampling:
    ap.error(f"--records={args.records!r} holds answers sampled at (temperature, top_k, top_p) = "
             f"{load_sampling(args.records)}, not {sampling}: give another --records path")
  costs = None
  if args.costs:                         # checked before the model loads (its count after)
    try:
      costs = [float(x) for x in args.costs.split(",")]
    except ValueError:
      costs = []
    if not costs or not all(np.isfinite(c) and c > 0 for c in costs):
      ap.error(f"--costs={args.costs!r}: give positive seconds (or AR-step units) per round for "
               "g = 0..G_max, comma-separated")
  if args.ar_step is not None and not (np.isfinite(args.ar_step) and args.ar_step > 0):
    ap.error(f"--ar_step={args.ar_step!r} must be a positive number (seconds or AR-step units)")
  if args.ar_step is not None and not args.costs:
    ap.error("--ar_step needs --costs (without them both are measured here)")
  try:
    parse_variants(args.variants, AutoSchedule(1))
  except ValueError as e:
    ap.error(f"--variants: {e}")
  cfg, model, step = loading.load_model(args.workdir)
  if model.mtp_depth < 1:
    ap.error(f"--workdir={args.workdir!r} has no MTP modules (mtp.depth = 0)")
  tokenizer = tok.load_tokenizer(args.workdir)
  kw = run_lib.auto_kwargs(args.workdir, cfg, model, args.max_draft_tokens)
  g_max = kw["max_draft_tokens"]
  base = kw["schedule"] or AutoSchedule(g_max)
  try:
    schedules = {"auto": base, **parse_variants(args.variants, base)}
  except ValueError as e:
    ap.error(f"--variants: {e}")
  if tokenizer.chat_template is None:
    ap.error(f"--workdir={args.workdir!r}: its tokenizer has no chat template; the replay "
             "answers chat prompts (a chat model's workdir, e.g. runs/smollm_demo)")
  prompts = heldout_prompts(args.chat_prompts, tokenizer, args.per_category)
  if costs is not None:
    if len(costs) != g_max + 1:
      ap.error(f"--costs needs {g_max + 1} positive values (g = 0..{g_max}), got {args.costs!r}")
    ar_step = costs[0] if args.ar_step is None else float(args.ar_step)
  else:
    first = next(iter(prompts.values()))[0]
    measured, ar_step = measured_costs(model, tokenizer, first, g_max, args.max_new_tokens,
                                          params)
    costs = [float(c) for c in measured]
    print("measured round costs (s): " + ", ".join(f"{c:.4f}" for c in costs)
          + f"; plain AR step {ar_step:.4f} s", flush=True)
  if args.answers:
    records = rescore(model, load_records(args.answers), g_max, params,
                         log=lambda s: print(s, flush=True))
    print(f"rescored {len(records)} answers of {args.answers} with {args.workdir}'s modules")
  elif args.records and os.path.isfile(args.records):
    records = load_records(args.records)
    print(f"read {len(records)} recorded answers from {args.records}")
  else:
    records = record(model, tokenizer, prompts, args.max_new_tokens, g_max,
                        log=lambda s: print(s, flush=True), params=params, samples=args.samples)
    if args.records:
      save_records(args.records, records, sampling)
  rows = compare(records, costs, args.max_new_tokens, schedules, draws=args.draws,
                    seed=args.seed, ar_step_s=ar_step)
  labels = [f"G{g}" for g in range(g_max + 1)] + list(schedules)
  meta = report.provenance(command=common.command_line(__file__, argv),
                           model=f"{args.workdir} (step {step})", checkpoint_step=step,
                           max_new_tokens=args.max_new_tokens, costs=costs, ar_step=ar_step,
                           relative_costs=[c / ar_step for c in costs],
                           schedules={k: repr(v) for k, v in schedules.items()},
                           chat_prompts=args.chat_prompts, per_category=args.per_category,
                           sampling=list(sampling), samples=args.samples, draws=args.draws,
                           seed=args.seed, records=args.records, answers=args.answers)
  summary = by_category(rows, labels, list(schedules))
  report.write_report(args.out, meta, {"rows": rows, "by_category": summary},
                      markdown(rows, labels, schedules, meta))
  print(markdown(rows, labels, schedules, meta))
  print(f"wrote {args.out}.json and {args.out}.md")
  return 0


if __name__ == "__main__":
  cli.main_guard(main, errors=(DecodeError, ValueError))
