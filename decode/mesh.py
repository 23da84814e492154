"""Sharded decoding: where the ``Decoder``'s parameters and state live on a mesh.

``Decoder(..., mesh=mesh)`` places the parameters with the training rules of
``mtp.sharding`` (tensor parallelism over ``tensor``: heads, kv heads, MLP
width and vocabulary; FSDP over ``fsdp`` when that axis is > 1) and splits
the batch rows of the decoding state over ``data``. Every row is decoded
independently, so a row's tokens do not depend on the layout: at
temperature 0 the output equals one device's (tests/test_sharding.py).
One JAX process (all devices addressable); multi-host decoding is not
supported here.

State layout (``decode.state.DecodeState``): every array has the batch B
as its leading dimension (drafter states included), so rows go over
``data``; 0-d leaves (the PRNG key, the "auto" counters) and the "auto"
schedule's round costs (``AutoState.schedule["costs"]``, not per row) are
replicated.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtp import sharding as shard_lib


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
  """A ``DecodeState`` of NamedShardings, by field: the batch dimension of
  every array over ``data``; 0-d leaves and the "auto" round costs
  replicated."""
  rows, whole = NamedSharding(mesh, P("data")), replicated(mesh)
  out = jax.tree.map(lambda x: whole if x.ndim == 0 else rows, state)
  if state.auto is not None:
    out = out.replace(auto=out.auto.replace(schedule={**out.auto.schedule, "costs": whole}))
  return out


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
