"""Sharded decoding: where the ``Decoder``'s parameters and state live on a mesh.

``Decoder(..., mesh=mesh)`` places the parameters with the training rules of
``mtp.sharding`` (tensor parallelism over ``tensor``: heads, kv heads, MLP
width and vocabulary; FSDP over ``fsdp`` when that axis is > 1) and splits
the batch rows of the decoding state over ``data``. Every row is decoded
independently, so a row's tokens do not depend on the layout: at
temperature 0 the output equals one device's (tests/test_sharding.py).
One JAX process (all devices addressable); multi-host decoding is not
supported here.

State layout (``decode.speculative.Decoder.prepare``): every array has the
batch B as its leading dimension (the MTP drafter's per-depth ``hidden``
buffers are a list of [B, S, D]), except the drafter's ``committed``
[used, B] (B second);
0-d leaves (the PRNG key, schedule counters) and the "auto" schedule's
round costs are replicated.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtp import sharding as shard_lib

_BATCH_SECOND = ("drafter/committed",)
_REPLICATED = ("schedule/costs",)            # not per row ("auto" draft length)


def replicated(mesh: Mesh) -> NamedSharding:
  """The sharding of a leaf every device holds whole."""
  return NamedSharding(mesh, P())


def place_params(mesh: Mesh, params, model_cfg):
  """``params`` (an nnx.State) moved onto ``mesh`` with the parameter
  shardings of ``mtp.sharding``.

  Raises ConfigError when the mesh axes do not divide the model dimensions
  (``mtp.sharding.check_mesh``).
  """
  shard_lib.check_mesh(model_cfg, mesh)
  return jax.device_put(params, shard_lib.param_shardings(mesh, params))


def state_shardings(mesh: Mesh, state):
  """NamedSharding per leaf of a decoding state: the batch dimension over
  ``data``, everything else replicated."""
  def one(path, x):
    if x.ndim == 0:
      return NamedSharding(mesh, P())
    p = jax.tree_util.keystr(path, simple=True, separator="/")
    if p in _REPLICATED:
      return NamedSharding(mesh, P())
    axis = 1 if p in _BATCH_SECOND else 0
    return NamedSharding(mesh, P(*([None] * axis + ["data"])))
  return jax.tree_util.tree_map_with_path(one, state)


def shard_state(mesh: Mesh, state):
  """``state`` placed with ``state_shardings`` (rows over ``data``)."""
  return jax.device_put(state, state_shardings(mesh, state))


def constrain_state(fn, mesh: Mesh):
  """Wraps a traced ``fn(...) -> state`` so its result keeps the state's
  layout (rows over ``data``): outputs then match the next call's inputs,
  so rounds neither recompile nor lose buffer donation."""
  @functools.wraps(fn)
  def wrapped(*args):
    state = fn(*args)
    return jax.lax.with_sharding_constraint(state, state_shardings(mesh, state))
  return wrapped
