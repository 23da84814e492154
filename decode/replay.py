"""Replaying draft-length schedules on recorded greedy answers: how many
target calls and how much decoding time a schedule (``decode.schedule``'s
"auto", or a fixed G) would spend on a given answer, without decoding it
again (scripts/replay_schedule.py).

At T = 0 a speculative decoder emits the target's greedy answer x whatever
its schedule, and whether a draft is accepted depends only on where the
round starts: the round that starts with x_0..x_{n-1} committed drafts from
the MTP chain at position n-2 (docs/design.md section 6), and with every
earlier draft accepted its drafts are exactly the teacher-forced ones. So
one cache-free forward of the target and its modules over prompt + answer
(``Transformer.__call__`` with ``recursive_steps``: module D reused past D,
as the drafter does) gives, for every round start n, the acceptance of
draft j given drafts 1..j-1 accepted:

    A[n, j-1] = (argmax draft_j logits at chain start n-2) == x_{n+j-1}

and a round of draft length g starting at n accepts a = the number of
leading True in A[n, :g]. ``replay`` walks an answer round by round as
``decode.loops`` does (segments of ``rounds_per_choice`` rounds chosen by
``AutoSchedule.choose`` from the past, ``AutoSchedule.update`` after every
round, the budget and the answer's end cutting the last round) and charges
each round its measured cost per g. The same schedule code runs as in the
decoder (B = 1), so a change to the schedule can be compared with fixed G
on real answers in seconds instead of a 15-minute benchmark.

Exact at T = 0 up to floating-point ties between the cache-free forward
and the cached rounds (a test compares replayed target calls with real
decoding). The costs are fixed per g (the decoder's own cost learning is
not replayed) and prefill is left out (the same for every schedule).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


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
  d = model.mtp_depth
  if d < 1:
    raise ValueError("greedy_acceptance needs a model with MTP modules (mtp.depth >= 1)")
  if max_draft_tokens < 1:
    raise ValueError(f"max_draft_tokens={max_draft_tokens} must be >= 1")
  prompt, answer = np.asarray(prompt, np.int32), np.asarray(answer, np.int32)
  if prompt.size < 2 or answer.size == 0:
    raise ValueError("greedy_acceptance needs a prompt of >= 2 tokens and a non-empty answer")
  tokens = np.concatenate([prompt, answer])[None]
  out = model(jnp.asarray(tokens), recursive_steps=max(0, max_draft_tokens - d))
  p, n_ans = prompt.size, answer.size
  k = np.arange(n_ans)                     # round start n = P + k: chain at n-2
  acc = np.zeros((n_ans, max_draft_tokens), bool)
  for j in range(1, max_draft_tokens + 1):
    draft = np.asarray(jnp.argmax(out.mtp_logits[j - 1][0], -1))     # at i: guess for t_{i+j+1}
    target = p + k + j - 1                                           # draft j's position n+j-1
    ok = target < p + n_ans
    acc[ok, j - 1] = draft[p + k[ok] - 2] == tokens[0, target[ok]]
  return acc


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
           g: int | None = None, greedy: bool = True) -> Replay:
  """Decodes one recorded answer with a fixed draft length ``g`` (0 = AR)
  or with ``schedule`` (an ``AutoSchedule``; its G_max must not exceed
  ``acc``'s columns), B = 1, as ``decode.loops`` does.

  Args:
    acc: bool [L, G] from ``greedy_acceptance`` (L answer tokens).
    costs: seconds per round for g = 0..G (at least up to the largest g used).
    max_new: the token budget the answer was generated with (>= L).
    greedy: which prior of the schedule to start from (T = 0: True).
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
    sched = {**sched, "alpha": prior, "prior": prior}         # as decode.calibrate.with_costs
    choose, update = _jitted(schedule)
    active = jnp.asarray([True])
  left, cur = 0, g
  while emitted < budget and rounds < max_new:
    if schedule is not None and left == 0:
      gg, n_rounds, sched = choose(sched, active)
      cur, left = int(gg), min(int(n_rounds), max_new - rounds)
    a = _accepted(acc, emitted, cur)
    emitted += min(a + 1, budget - emitted)
    rounds += 1
    time_s += float(costs[cur])
    lengths.append(cur)
    if schedule is not None:
      sched = update(sched, cur, jnp.asarray([a], jnp.int32), active)
      left -= 1
  return Replay(rounds, time_s, tuple(lengths), emitted)


def record(model, tokenizer, prompts: dict, max_new: int, max_draft_tokens: int,
           log=None) -> list[dict]:
  """Greedy answers and their acceptance for chat prompts.

  Args:
    model, tokenizer: the target with its modules and its tokenizer.
    prompts: {category: [int32 ids [P], ...]} (chat template applied).
    max_new: token budget per answer; max_draft_tokens: G_max >= 1.
    log: optional callable getting one line per prompt.
  Returns:
    [{"category", "index", "prompt" int32 [P], "answer" int32 [L], "acc"
    bool [L, G_max]}] in category order.
  """
  from decode.speculative import Decoder, SamplingParams
  ar = Decoder(model, "ar", tokenizer=tokenizer)
  out = []
  for cat, ps in prompts.items():
    for i, p in enumerate(ps):
      ans = np.asarray(ar.generate([p], max_new, SamplingParams(0.0), seed=0).tokens[0], np.int32)
      acc = greedy_acceptance(model, p, ans, max_draft_tokens)
      out.append({"category": cat, "index": i, "prompt": np.asarray(p, np.int32), "answer": ans,
                  "acc": acc})
      if log is not None:
        log(f"{cat} {i}: {len(ans)} tokens, alpha_1 along the answer {acc[:, 0].mean():.2f}")
  return out


def compare(records: list[dict], costs: Sequence[float], max_new: int,
            schedules: dict) -> list[dict]:
  """Every record replayed with fixed G = 0..G_max (``len(costs) - 1``) and
  with each schedule of ``schedules`` ({label: AutoSchedule}).

  Returns one row per record: category, index, tokens, and per decoder
  label ("G0".."G<max>", then the schedules' labels) its rounds, time (in
  the units of ``costs``) and speedup over G0 (AR); ``best_fixed`` (the
  label of the fastest fixed G) and, per schedule, ``<label>/best`` = its
  speedup over the fastest fixed G.
  """
  g_max = len(costs) - 1
  rows = []
  for rec in records:
    if rec["acc"].shape[1] < g_max:
      raise ValueError(f"records hold {rec['acc'].shape[1]} draft positions; costs ask for {g_max}")
    acc = rec["acc"][:, :g_max]
    runs = {f"G{g}": replay(acc, costs, max_new, g=g) for g in range(g_max + 1)}
    for label, s in schedules.items():
      runs[label] = replay(acc, costs, max_new, schedule=s)
    ar = runs["G0"].time_s
    best = min((f"G{g}" for g in range(g_max + 1)), key=lambda k: runs[k].time_s)
    row = {"category": rec["category"], "index": rec["index"], "tokens": int(len(rec["answer"])),
           "alpha_1": float(rec["acc"][:, 0].mean()), "best_fixed": best}
    for label, r in runs.items():
      row[label] = {"rounds": r.rounds, "time": r.time_s, "speedup": ar / r.time_s,
                    "draft_lengths": np.bincount(r.draft_lengths, minlength=g_max + 1).tolist()}
    for label in schedules:
      row[f"{label}/best"] = runs[best].time_s / runs[label].time_s
    rows.append(row)
  return rows


def measured_costs(model, tokenizer, prompt, max_draft_tokens: int, max_new: int) -> np.ndarray:
  """[G_max+1] seconds per round at g = 0..G_max at T = 0 on this device,
  as "auto" calibrates them (``decode.calibrate.decoder_round_costs``,
  while_loop form, B = 1, after the prefill of ``prompt``)."""
  from decode import calibrate
  from decode.speculative import Decoder, SamplingParams
  dec = Decoder(model, "mtp", "auto", tokenizer=tokenizer, max_draft_tokens=max_draft_tokens)
  sp = SamplingParams(0.0).validate()
  state, prefill_len = dec.prepare([prompt], max_new, 0)
  return calibrate.decoder_round_costs(dec, dec.prefill(state, prefill_len), sp, "while")


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


def save_records(path: str, records: list[dict]) -> None:
  """Writes ``record``'s list to ``path`` (.npz: one prompt / answer /
  acceptance array per record, categories and indices as arrays)."""
  arrays = {"category": np.asarray([r["category"] for r in records]),
            "index": np.asarray([r["index"] for r in records], np.int32)}
  for i, r in enumerate(records):
    for field in ("prompt", "answer", "acc"):
      arrays[f"{field}_{i}"] = r[field]
  np.savez_compressed(path, **arrays)


def load_records(path: str) -> list[dict]:
  """``save_records``' list back from ``path``."""
  with np.load(path) as z:
    return [{"category": str(c), "index": int(k), "prompt": z[f"prompt_{i}"],
             "answer": z[f"answer_{i}"], "acc": z[f"acc_{i}"]}
            for i, (c, k) in enumerate(zip(z["category"], z["index"]))]
