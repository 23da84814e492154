"""A reduced draft vocabulary V' for the MTP heads (FastMTP): which ids, and
setting them. Decoding stays exact (q = 0 outside V', the residual carries
p's mass there); per position alpha <= p(V'). The ids live in the model as
``mtp.model.DraftVocab`` [V'] int32, saved with the parameters.

    counts = token_counts(rows, loss_mask, vocab_size=V)   # [V] int64
    ids = select(counts, cfg.mtp.draft_vocab_size, always=tokenizer.stop_ids)
    params = with_draft_vocab(state.params, ids)       # or set_draft_vocab(model, ids)
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp.model import Transformer


def token_counts(tokens, loss_mask=None, *, vocab_size: int) -> np.ndarray:
  """counts [V] int64 of the ids in ``tokens`` [N, T] (any int dtype, in [0,
  vocab_size)) at the positions where ``loss_mask`` [N, T] is 1 (None: all).
  Raises ValueError: shapes differ, tokens not 2-D, or a counted id outside
  [0, V)."""
  tokens = np.asarray(tokens)
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [N, T], got shape {tokens.shape}")
  if loss_mask is not None:
    loss_mask = np.asarray(loss_mask)
    if loss_mask.shape != tokens.shape:
      raise ValueError(f"loss_mask shape {loss_mask.shape} != tokens shape {tokens.shape}")
    ids = tokens[loss_mask == 1]
  else:
    ids = tokens.reshape(-1)
  ids = ids.astype(np.int64)
  if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    raise ValueError(f"token ids must lie in [0, {vocab_size}); got [{ids.min()}, {ids.max()}]")
  return np.bincount(ids, minlength=vocab_size).astype(np.int64)


def select(counts, size: int, always: Iterable[int] = (), allowed=None) -> np.ndarray:
  """V': the ``size`` most frequent ids of ``counts`` [V] (ties to the lower
  id), always including ``always`` (stop ids, so a draft can end an answer),
  choosing by frequency only ids ``allowed`` [V] bool permits (None: all).
  Returns ids [size] int32, sorted, unique. Raises ValueError: size < 1 or
  more than the candidates, more ``always`` ids than size, or an ``always``
  id outside [0, V)."""
  counts = np.asarray(counts)
  v = counts.shape[0]
  must = np.unique(np.asarray(list(always), np.int64))
  if must.size and (must.min() < 0 or must.max() >= v):
    raise ValueError(f"always ids must lie in [0, {v}); got {must.tolist()}")
  ok = np.ones(v, bool) if allowed is None else np.asarray(allowed, bool).copy()
  ok[must] = True
  if not 1 <= size <= int(ok.sum()):
    raise ValueError(f"draft vocabulary size {size} must be in [1, {int(ok.sum())}] (the number "
                     "of ids it can be chosen from)")
  if must.size > size:
    raise ValueError(f"{must.size} always-included ids do not fit a draft vocabulary of {size}")
  rest = np.nonzero(ok)[0]
  rest = rest[~np.isin(rest, must)]
  order = np.lexsort((rest, -counts[rest].astype(np.float64)))   # count descending, then id
  chosen = np.concatenate([must, rest[order[:size - must.size]]])
  return np.sort(chosen).astype(np.int32)


def check_ids(ids, size: int, vocab_size: int) -> np.ndarray:
  """``ids`` as a sorted [size] int32 array, checked: 1-D, length ``size``,
  strictly increasing (sorted, unique), in [0, vocab_size). Raises
  ValueError naming what is wrong."""
  a = np.asarray(ids)
  if a.ndim != 1 or a.shape[0] != size:
    raise ValueError(f"draft vocabulary must be [{size}] ids (mtp.draft_vocab_size), got shape "
                     f"{a.shape}")
  if not np.issubdtype(a.dtype, np.integer):
    raise ValueError(f"draft vocabulary ids must be integers, got {a.dtype}")
  if size and (a.min() < 0 or a.max() >= vocab_size):
    raise ValueError(f"draft vocabulary ids must lie in [0, {vocab_size}); got "
                     f"[{a.min()}, {a.max()}]")
  if np.any(np.diff(a) <= 0):
    raise ValueError("draft vocabulary ids must be sorted ascending and unique")
  return a.astype(np.int32)


def set_draft_vocab(model, ids) -> None:
  """Sets V' of ``model`` (a ``mtp.model.Transformer`` built with
  ``draft_vocab_size`` = len(ids)) in place. ``ids``: [V'] ints, sorted,
  unique, in [0, V). Raises ValueError when the model has no draft
  vocabulary or ``ids`` do not fit it (``check_ids``)."""
  if not getattr(model, "draft_vocab_size", 0):
    raise ValueError("the model has no draft vocabulary: build it with mtp.draft_vocab_size > 0")
  a = check_ids(ids, model.draft_vocab_size, model.cfg.vocab_size)
  old = model.draft_vocab[...]
  model.draft_vocab[...] = jax.device_put(jnp.asarray(a), getattr(old, "sharding", None))


def with_draft_vocab(params: nnx.State, ids) -> nnx.State:
  """A copy of a full parameter State (``nnx.state(model, nnx.Param)``, e.g.
  ``TrainState.params``) whose ``draft_vocab`` holds ``ids`` (placed like
  the old value, so a jitted step's shardings still match). Raises
  ValueError when ``params`` has no ``draft_vocab`` or ``ids`` do not fit."""
  flat = dict(nnx.to_flat_state(params))
  key = ("draft_vocab",)
  if key not in flat:
    raise ValueError("the parameters have no draft_vocab: build the model with "
                     "mtp.draft_vocab_size > 0")
  var = flat[key]
  old = var.get_value()
  embed = flat.get(("embed", "embedding"))
  vocab = embed.get_value().shape[0] if embed is not None else np.iinfo(np.int32).max
  a = check_ids(ids, old.shape[0], vocab)
  flat[key] = var.replace(jax.device_put(jnp.asarray(a), getattr(old, "sharding", None)))
  return nnx.from_flat_state(flat)


def with_draft_vocab_size(model, ids):
  """A model sharing ``model``'s parameters (a ``Transformer`` with MTP
  modules) with draft vocabulary ``ids`` of any size ([V'] sorted, unique,
  in [0, V)) or None (every id): to evaluate one set of modules against
  several V'. Raises ValueError as ``check_ids``, or without MTP modules."""
  n = 0 if ids is None else len(np.asarray(ids))
  new = nnx.eval_shape(lambda: Transformer(model.cfg, model.mtp_depth, rngs=nnx.Rngs(params=0),
                                           draft_vocab_size=n,
                                           feature_layers=model.feature_layers))
  graphdef, abstract = nnx.split(new, nnx.Param)
  flat = {k: v for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
          if k != ("draft_vocab",)}
  if n:
    a = check_ids(ids, n, model.cfg.vocab_size)
    flat[("draft_vocab",)] = dict(nnx.to_flat_state(abstract))[("draft_vocab",)].replace(
        jnp.asarray(a))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def draft_vocab_ids(model) -> np.ndarray | None:
  """V' of ``model`` as a numpy [V'] int32 array, or None without one."""
  if not getattr(model, "draft_vocab_size", 0):
    return None
  return np.asarray(jax.device_get(model.draft_vocab[...]))


def outside_mass(p, ids) -> np.ndarray:
  """The probability mass distributions p [..., V] put outside V' (ids [V']):
  [...] float64. Per position it bounds the acceptance rate of any draft
  supported on V': alpha = sum_v min(p, q) <= 1 - outside_mass."""
  p = np.asarray(p, np.float64)
  return 1.0 - p[..., np.asarray(ids)].sum(-1)
