"""Device mesh and shardings.

The mesh has three named axes, ``("data", "fsdp", "tensor")``, sized from
``MeshConfig`` (-1 = all remaining devices). Batches are split over
``data`` x ``fsdp``. Parameters are currently replicated; FSDP and tensor
parallel rules are a later step and plug in at ``param_shardings``.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtp.config import ConfigError, MeshConfig

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
  """Resolves -1 and checks that the mesh covers exactly ``num_devices``.

  Raises ConfigError naming the mesh fields and the device count.
  """
  sizes = [cfg.data, cfg.fsdp, cfg.tensor]
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ConfigError(f"mesh (data={cfg.data}, fsdp={cfg.fsdp}, tensor={cfg.tensor}): the fixed "
                        f"axes' product {known} does not divide the {num_devices} devices")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ConfigError(f"mesh data*fsdp*tensor = {sizes[0]}*{sizes[1]}*{sizes[2]} = "
                      f"{math.prod(sizes)} must equal the number of devices ({num_devices})")
  return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
  """A ``Mesh`` over ``devices`` (default: all) with axes ``AXES``."""
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(cfg, len(devices))
  return Mesh(np.asarray(devices).reshape(shape), AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of [B, ...] batches: rows split over data x fsdp."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def num_batch_shards(mesh: Mesh) -> int:
  return mesh.shape["data"] * mesh.shape["fsdp"]


def check_batch(global_batch: int, mesh: Mesh, field: str = "train.batch_size"):
  """Raises ConfigError unless ``global_batch`` splits evenly over the batch
  shards and the JAX processes."""
  shards = num_batch_shards(mesh)
  if global_batch % shards:
    raise ConfigError(f"{field}={global_batch} must be divisible by the data*fsdp mesh size {shards}")
  if global_batch % jax.process_count():
    raise ConfigError(f"{field}={global_batch} must be divisible by the process count "
                      f"{jax.process_count()}")


def param_shardings(mesh: Mesh, abstract_params):
  """Shardings for a parameter pytree (replicated for now)."""
  return jax.tree.map(lambda _: replicated(mesh), abstract_params)


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles per-process numpy rows into global arrays sharded over the batch axes."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}
