"""Device mesh, logical axis rules and shardings (FSDP + tensor parallelism;
docs/scaling.md).

Mesh axes ``("data", "fsdp", "tensor")`` sized from ``MeshConfig`` (-1 =
the rest): ``data`` replicates parameters, ``fsdp`` shards parameters and
Adam moments along ``embed`` (ZeRO-3), ``tensor`` splits heads, MLP width
and vocabulary (Megatron). Batches [B, ...] split over data x fsdp.
``PARAM_RULES`` names each parameter's dimensions, ``LOGICAL_TO_MESH`` maps
names to axes; optimizer leaves follow their parameter, others replicate.
An axis that does not divide its dimension is an error (``check_mesh``,
``param_shardings``), never a silent replication.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtp.config import ConfigError, MeshConfig, ModelConfig

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Parameter path (regex matched against the end of the '/'-joined nnx path)
# -> logical name per dimension. First match wins.
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed/embedding", ("vocab", "embed")),          # E [V, D]
    (r"lm_head/kernel", ("embed", "vocab")),           # W_out [D, V] (untied)
    (r"attn/q_proj/kernel", ("embed", "heads")),       # [D, N*H]
    (r"attn/[kv]_proj/kernel", ("embed", "kv_heads")),  # [D, K*H]
    (r"attn/o_proj/kernel", ("heads", "embed")),       # [N*H, D]
    (r"mlp/(gate|up)/kernel", ("embed", "mlp")),       # [D, F]
    (r"mlp/down/kernel", ("mlp", "embed")),            # [F, D]
    (r"mtp/\d+/proj/kernel", ("embed2", "embed")),     # M_k [2D, D]
    (r"mtp/0/fuse/proj/kernel", ("embed2", "embed")),  # W_f [(m+1)D, D] (mtp.feature_layers)
    (r"\w*norm/scale", ("norm",)),                     # RMSNorm scales [D]
    (r"fuse/norms/\d+/scale", ("norm",)),              # FeatureFuse's RMSNorm scales [D]
    (r"draft_vocab", ("draft_vocab",)),                # V' ids [V'] int32 (mtp.model.DraftVocab)
)

# Logical name -> mesh axis (None: replicated).
LOGICAL_TO_MESH: dict[str, str | None] = {
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "embed2": None,
    "norm": None,
    "draft_vocab": None,
}


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
  """A ``Mesh`` over ``devices`` (default all) with axes ``AXES``, devices
  ordered by (process, id) so each process owns a contiguous block (its own
  batch rows; tensor-parallel collectives inside a host)."""
  devices = jax.devices() if devices is None else list(devices)
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
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
  shards and the JAX processes, and each process owns distinct batch shards
  (i.e. the ``tensor`` axis does not span processes)."""
  shards = num_batch_shards(mesh)
  if global_batch % shards:
    raise ConfigError(f"{field}={global_batch} must be divisible by the data*fsdp mesh size {shards}")
  procs = jax.process_count()
  if global_batch % procs:
    raise ConfigError(f"{field}={global_batch} must be divisible by the process count {procs}")
  if shards % procs:
    raise ConfigError(f"the data*fsdp mesh size {shards} must be a multiple of the process count "
                      f"{procs} (mesh.tensor={mesh.shape['tensor']} must divide the "
                      f"{jax.local_device_count()} devices of each process), so that every "
                      "process reads its own batch rows")


def check_mesh(model: ModelConfig, mesh: Mesh | Mapping[str, int]):
  """Checks that ``tensor`` divides num_heads, num_kv_heads, mlp_dim and
  vocab_size and ``fsdp`` divides d_model (``mesh``: a ``Mesh`` or {axis:
  size}). Raises ConfigError naming every offending field and both numbers."""
  sizes = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)
  t, f = sizes.get("tensor", 1), sizes.get("fsdp", 1)
  bad = [f"mesh.tensor={t} does not divide model.{name}={getattr(model, name)}"
         for name in ("num_heads", "num_kv_heads", "mlp_dim", "vocab_size")
         if getattr(model, name) % t]
  if model.d_model % f:
    bad.append(f"mesh.fsdp={f} does not divide model.d_model={model.d_model}")
  if bad:
    raise ConfigError("mesh does not fit the model: " + "; ".join(bad) + " (tensor parallelism "
                      "splits heads, kv heads, MLP width and vocabulary; FSDP splits d_model)")


def _path_str(path) -> str:
  s = jax.tree_util.keystr(path, simple=True, separator="/")
  return s[:-len("/value")] if s.endswith("/value") else s   # nnx.Variable leaves


def logical_axes(path: str) -> tuple[str | None, ...] | None:
  """Logical dimension names of the parameter at ``path`` (e.g.
  ``"blocks/0/mlp/down/kernel"`` -> ``("mlp", "embed")``), or None when no
  rule in ``PARAM_RULES`` matches."""
  for pattern, names in PARAM_RULES:
    if re.search(rf"(^|/){pattern}$", path):
      return names
  return None


def spec_for(mesh: Mesh, path: str, shape: tuple[int, ...], names) -> P:
  """PartitionSpec for an array of ``shape`` with logical ``names``.

  Raises ConfigError when a mesh axis does not divide the dimension it
  shards, ValueError when the rule's rank does not match the array's.
  """
  if len(names) != len(shape):
    raise ValueError(f"sharding rule {names} for {path!r} has rank {len(names)}, "
                     f"the array has shape {shape}")
  axes = []
  for dim, name in zip(shape, names):
    axis = LOGICAL_TO_MESH.get(name) if name is not None else None
    if axis is not None and mesh.shape[axis] > 1:
      if dim % mesh.shape[axis]:
        raise ConfigError(f"mesh.{axis}={mesh.shape[axis]} does not divide dimension {dim} "
                          f"('{name}') of {path} {shape}")
      axes.append(axis)
    else:
      axes.append(None)
  return P(*axes)


def param_shardings(mesh: Mesh, abstract_params):
  """``NamedSharding`` per leaf of a parameter pytree (arrays or
  ``ShapeDtypeStruct``s) from ``PARAM_RULES`` and ``LOGICAL_TO_MESH``. Raises
  ValueError for a parameter no rule covers, ConfigError for an axis that
  does not divide its dimension."""
  def one(path, x):
    p = _path_str(path)
    names = logical_axes(p)
    if names is None:
      raise ValueError(f"no sharding rule for parameter {p!r} {tuple(x.shape)}: add one to "
                       "mtp.sharding.PARAM_RULES")
    return NamedSharding(mesh, spec_for(mesh, p, tuple(x.shape), names))
  return jax.tree_util.tree_map_with_path(one, abstract_params)


def state_shardings(mesh: Mesh, abstract_tree):
  """Shardings for any pytree holding copies of the parameters, e.g. the
  optimizer state from ``jax.eval_shape(tx.init, params)``: a leaf whose
  path ends like a parameter's and whose rank matches (Adam mu/nu) is
  sharded like that parameter; every other leaf (counts, scalars) is
  replicated."""
  def one(path, x):
    p = _path_str(path)
    names = logical_axes(p)
    if names is None or len(names) != len(x.shape):
      return replicated(mesh)
    return NamedSharding(mesh, spec_for(mesh, p, tuple(x.shape), names))
  return jax.tree_util.tree_map_with_path(one, abstract_tree)


def bytes_per_device(abstract_tree, shardings) -> int:
  """Bytes of ``abstract_tree`` (arrays or ShapeDtypeStructs) held by one
  device under ``shardings`` (even shardings: every device holds the same)."""
  total = 0
  for x, s in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings)):
    total += math.prod(s.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
  return int(total)


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles per-process numpy rows into global arrays sharded over the batch axes.

  local: this process's rows, each [B / process_count, ...]. Returns global
  arrays [B, ...] whose rows are the processes' rows in process order.
  """
  sharding = batch_sharding(mesh)
  n = jax.process_count()
  return {k: jax.make_array_from_process_local_data(sharding, v, (v.shape[0] * n,) + v.shape[1:])
          for k, v in local.items()}


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None, *, force: bool = False) -> bool:
  """Starts ``jax.distributed`` for a multi-process run; call before anything
  else touches JAX. Given arguments are used (JAX detects the rest); without
  any it initialises only when ``force`` or the environment names a
  multi-process job (``JAX_COORDINATOR_ADDRESS`` with ``JAX_NUM_PROCESSES`` /
  ``JAX_PROCESS_ID``, Slurm or Open MPI with several tasks). Returns whether
  it initialised. CPU collectives use gloo. Raises ConfigError for an
  impossible process_id / num_processes."""
  env = os.environ
  if num_processes is None and env.get("JAX_NUM_PROCESSES"):
    num_processes = int(env["JAX_NUM_PROCESSES"])
  if process_id is None and env.get("JAX_PROCESS_ID"):
    process_id = int(env["JAX_PROCESS_ID"])
  given = any(v is not None for v in (coordinator_address, num_processes, process_id))
  launched = (bool(env.get("JAX_COORDINATOR_ADDRESS"))
              or (bool(env.get("SLURM_JOB_ID")) and int(env.get("SLURM_NTASKS", "1")) > 1)
              or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1)
  if not (given or launched or force):
    return False
  if num_processes is not None and num_processes < 1:
    raise ConfigError(f"--num_processes={num_processes} must be >= 1")
  if process_id is not None and not (
      0 <= process_id < (num_processes if num_processes is not None else process_id + 1)):
    raise ConfigError(f"--process_id={process_id} must be in [0, --num_processes={num_processes})")
  if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") is None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU needs one
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)
  return True
