"""The typed state of a batched generation (``DecodeState``: the donated
pytree every jitted decoding function takes and returns, batch B leading
except the key and "auto"'s scalars and costs) and its host result
(``Generation``). Indices: docs/design.md sections 5-6."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from decode.errors import DecodeError, emitted_rows, raise_on_error
from decode.stops import finish_rows, mark_interrupted, stop_id_array
from mtp import tokenizer as tok
from mtp.model import init_layer_caches

@struct.dataclass
class AutoState:
  """State of "auto" (``decode.auto.schedule``). schedule:
  ``AutoSchedule.init_state``; g, left: int32 scalars (the segment's draft
  length, 0 = AR; its rounds left); draft_length_histogram:
  [B, G_max+1] int32, rounds per g (active rows); position_tested /
  position_accepted: [B, G_max] int32, rounds in which draft position k was
  tested (>= k drafted, d_1..d_{k-1} accepted) / accepted."""
  schedule: dict
  g: jax.Array
  left: jax.Array
  draft_length_histogram: jax.Array
  position_tested: jax.Array
  position_accepted: jax.Array


@struct.dataclass
class DecodeState:
  """State of one batched generation (B rows, S cache slots).

  tokens: [B, S] int32, committed x_0..x_{n-1} (BOS first), drafts past them.
  length: [B] int32, n (the target's cache holds positions 0..n-2).
  prompt_len, max_new: [B] int32, prompt length with BOS; the token budget.
  done: [B] bool (EOS, stop, budget, error). key: PRNG key (rbg).
  cache: the target's KV cache, a list over layers of {"k", "v"} [B, S, K, H].
  target_calls: [B] int32, verification calls while the row was active.
  accepted_histogram: [B, G+1] int32, rounds per number of accepted drafts.
  error, error_pos: [B] int32, ``decode.errors`` code and non-finite position.
  stop_ids: [B, K] int32, ids that end the row (EOS, stop ids; -1 pads).
  rounds: int32 scalar, rounds run since the prefill (``round.commit`` counts).
  drafter: the drafter's state (None for AR); auto: ``AutoState`` or None."""
  tokens: jax.Array
  length: jax.Array
  prompt_len: jax.Array
  max_new: jax.Array
  done: jax.Array
  key: jax.Array
  cache: list
  target_calls: jax.Array
  accepted_histogram: jax.Array
  error: jax.Array
  error_pos: jax.Array
  stop_ids: jax.Array
  rounds: jax.Array
  drafter: Any = None
  auto: AutoState | None = None


@dataclasses.dataclass
class Generation:
  """Result of one batched generation (host numpy; int64 histograms).

  tokens: per row, generated ids (int32, EOS included if emitted).
  prompt_lengths: per row, with BOS. target_calls: [B] verification calls.
  accepted_histogram: [B, G+1], rounds per accepted count a (trees: path length).
  emit_times: per row, seconds from the request to each token (stream only).
  wall_time_s, prefill_time_s: seconds of the call (no compilation) and prefill.
  num_draft_tokens: G (G_max with "auto", m with a tree).
  draft_length_histogram: [B, G_max+1]; position_tested / position_accepted:
    [B, G_max] ("auto" only, as ``AutoState``; else None).
  tree: the branching per depth, or None. finish_reasons: per row
    (``decode.stops.FINISH_REASONS``). texts: per row, UTF-8 bytes cut before
    a stop string. interrupted: an interruptible stream was stopped by Ctrl-C."""
  tokens: list[np.ndarray]
  prompt_lengths: np.ndarray
  accepted_histogram: np.ndarray
  target_calls: np.ndarray
  emit_times: list[list[float]] | None
  wall_time_s: float
  num_draft_tokens: int
  prefill_time_s: float = 0.0
  draft_length_histogram: np.ndarray | None = None
  position_tested: np.ndarray | None = None
  position_accepted: np.ndarray | None = None
  tree: tuple[int, ...] | None = None
  finish_reasons: list[str] | None = None
  texts: list[bytes] | None = None
  interrupted: bool = False


def check_prompts(prompts, max_new_tokens, max_len: int, mesh,
                  vocab_size: int | None = None) -> None:
  """``Decoder.prepare``'s input checks: a non-empty batch divisible by
  ``mesh``'s ``data`` axis, max_new_tokens an integer >= 1, prompts of >= 1
  id in [0, vocab_size), prompt + max_new_tokens <= max_len. Raises DecodeError."""
  if not prompts:
    raise DecodeError("no prompts given")
  if mesh is not None and len(prompts) % mesh.shape["data"]:
    raise DecodeError(f"{len(prompts)} prompts cannot be split over the mesh's data axis of size "
                      f"{mesh.shape['data']}: give a multiple of it")
  if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
    raise DecodeError(f"--max_new_tokens={max_new_tokens!r} must be an integer >= 1")
  for i, p in enumerate(prompts):
    if len(p) < 1:
      raise DecodeError(f"prompt {i} has no token as encoded: give at least 1")
    if vocab_size is not None and len(p) and (np.min(p) < 0 or np.max(p) >= vocab_size):
      bad = int(np.asarray(p)[(np.asarray(p) < 0) | (np.asarray(p) >= vocab_size)][0])
      raise DecodeError(f"prompt {i} holds token id {bad}, outside the model's vocabulary "
                        f"[0, {vocab_size})")
    if len(p) + max_new_tokens > max_len:
      room = max_len - len(p)
      raise DecodeError(
          f"prompt {i} has {len(p)} tokens as encoded (BOS included where the tokenizer adds "
          f"one); with --max_new_tokens={max_new_tokens} it "
          f"exceeds the model's max_seq_len={max_len}"
          + (f" (at most {room} new tokens fit)" if room > 0 else
             f" (no room left to generate: with this --max_new_tokens a prompt may have at most "
             f"{max_len - max_new_tokens} tokens as encoded)"
             if max_len - max_new_tokens >= 1 else
             f" (--max_new_tokens must be at most {max_len - 1} to leave room for a prompt)"))


def init_state(model_cfg, prompts, max_new_tokens: int, seed: int, cache_len: int,
               num_draft_tokens: int, drafter_state=None, auto: AutoState | None = None,
               stop_ids=None, pad_id: int = tok.PAD_ID) -> DecodeState:
  """The state before prefill: prompts (BOS included) left-aligned in a
  ``pad_id`` buffer of ``cache_len`` slots, an empty target cache, zeroed
  statistics for G ``num_draft_tokens``; stop_ids [B, K] (default: EOS)."""
  b = len(prompts)
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  tokens = np.full((b, cache_len), pad_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return DecodeState(
      tokens=jnp.asarray(tokens), length=jnp.asarray(lengths), prompt_len=jnp.asarray(lengths),
      max_new=jnp.full((b,), max_new_tokens, jnp.int32), done=jnp.zeros((b,), bool),
      key=jax.random.key(seed, impl="rbg"),
      cache=init_layer_caches(model_cfg, model_cfg.num_layers, b, cache_len),
      target_calls=jnp.zeros((b,), jnp.int32),
      accepted_histogram=jnp.zeros((b, num_draft_tokens + 1), jnp.int32),
      error=jnp.zeros((b,), jnp.int32), error_pos=jnp.zeros((b,), jnp.int32),
      stop_ids=jnp.asarray(stop_id_array([tok.EOS_ID], b) if stop_ids is None else stop_ids,
                           jnp.int32),
      rounds=jnp.int32(0), drafter=drafter_state, auto=auto)


def repeat_row(one: DecodeState, like) -> DecodeState:
  """``one`` (a B = 1 state) broadcast to the shapes of ``like`` (a B-row
  state or its ``jax.eval_shape``): batched leaves [1, ...] -> [B, ...], shared
  ones kept. Raises ValueError for leaves that differ otherwise."""
  def rep(a, b):
    if a.dtype != b.dtype or (a.shape != b.shape and (a.ndim != b.ndim or a.shape[0] != 1
                                                       or a.shape[1:] != b.shape[1:])):
      raise ValueError(f"repeat_row: a leaf of {a.shape} {a.dtype} does not repeat into "
                       f"{b.shape} {b.dtype}")
    return a if a.shape == b.shape else jnp.broadcast_to(a, b.shape)
  return jax.tree.map(rep, one, like)


def init_auto(schedule, batch: int) -> AutoState:
  """``AutoState`` for ``batch`` rows of ``schedule`` (an ``AutoSchedule``);
  round costs 1 s each until measured (``decode.auto.calibrate``)."""
  g = schedule.max_draft_tokens
  return AutoState(schedule=schedule.init_state(batch, np.ones(g + 1, np.float32)),
                   g=jnp.int32(0), left=jnp.int32(0),   # 2 buffers (donated)
                   draft_length_histogram=jnp.zeros((batch, g + 1), jnp.int32),
                   position_tested=jnp.zeros((batch, g), jnp.int32),
                   position_accepted=jnp.zeros((batch, g), jnp.int32))


def to_generation(state: DecodeState, *, emit_times, wall: float, prefill: float,
                  num_draft_tokens: int, tree, kept=None) -> Generation:
  """Host copy of a finished state as a ``Generation``; rows cut at ``kept``
  [B] (an interrupted stream) and marked ``interrupted``. Raises
  NonFiniteLogitsError when a row stopped on NaN/inf logits."""
  host = jax.device_get(dict(tokens=state.tokens, length=state.length,
                             prompt_len=state.prompt_len, target_calls=state.target_calls,
                             accepted_histogram=state.accepted_histogram, error=state.error,
                             error_pos=state.error_pos))
  if kept is not None:
    host["length"] = np.minimum(host["length"], np.asarray(kept, host["length"].dtype))
  raise_on_error(host["tokens"], host["prompt_len"], host["length"], host["error"],
                 host["error_pos"])
  extra = {}
  if state.auto is not None:
    a = jax.device_get(state.auto)
    extra = dict(draft_length_histogram=a.draft_length_histogram.astype(np.int64),
                 position_tested=a.position_tested.astype(np.int64),
                 position_accepted=a.position_accepted.astype(np.int64))
  return Generation(emitted_rows(host["tokens"], host["prompt_len"], host["length"]),
                    host["prompt_len"], host["accepted_histogram"].astype(np.int64),
                    host["target_calls"].astype(np.int64), emit_times, wall, num_draft_tokens,
                    prefill, tree=tree, interrupted=kept is not None, **extra)


def finish(state: DecodeState, emit_times, wall: float, prefill: float, stops, g: int, tree,
           token_bytes, eos_ids, kept=None, max_new_tokens: int = 0) -> Generation:
  """``to_generation`` (G ``g``, ``tree`` a ``TreeSpec`` or None) with rows
  cut at stop strings, finish reasons and texts (``stops.finish_rows``);
  ``kept``: what an interrupted stream handed on."""
  gen = to_generation(state, emit_times=emit_times, wall=wall, prefill=prefill,
                      num_draft_tokens=g, tree=None if tree is None else tree.branching,
                      kept=kept)
  gen = finish_rows(gen, stops, token_bytes, eos_ids)
  return mark_interrupted(gen, max_new_tokens)
