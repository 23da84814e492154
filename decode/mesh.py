"""Sharded decoding: ``Decoder(..., mesh=mesh)`` places the parameters with
``mtp.sharding``'s rules (``place_params``) and the state's batch rows over
``data`` (``state_shardings``); 0-d leaves and "auto"'s round costs are
replicated. Rows decode independently, so T = 0 output equals one device's
(tests/test_sharding.py). One JAX process; no multi-host decoding."""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtp import sharding as shard_lib


def replicated(mesh: Mesh) -> NamedSharding:
  """The sharding of a leaf every device holds whole."""
  return NamedSharding(mesh, P())


def place_params(mesh: Mesh, params, model_cfg):
  """``params`` (an nnx.State) placed on ``mesh`` with ``mtp.sharding``'s
  parameter shardings. Raises ConfigError when the mesh axes do not divide
  the model dimensions (``mtp.sharding.check_mesh``)."""
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
