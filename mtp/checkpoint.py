"""Orbax checkpoints of a workdir: parameters, optimizer state, step, the
data iterator's state and the config that produced them.

Orbax only: this module reads and writes training workdirs and knows
nothing of other model formats (``mtp.loading`` tells a workdir from an
exported directory and loads either).

Layout: ``WORKDIR/checkpoints/<step>/{state,data,config}``, written
atomically by ``orbax.checkpoint.CheckpointManager`` (a checkpoint killed
mid-write is never listed), keeping the last ``keep``. Each checkpoint
carries its own config, so decoding needs nothing but the workdir, and a
resumed run is checked against it before anything is written.
"""

from __future__ import annotations

import os

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from mtp import config as config_lib
from mtp import quiet
from mtp.config import Config


class CheckpointError(RuntimeError):
  """Missing, corrupt or incompatible checkpoint (the message names the path)."""


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


class Checkpointer:
  """Saves and restores training state under ``WORKDIR/checkpoints``.

  Args:
    workdir: run directory.
    keep: number of most recent checkpoints kept.
    read_only: open without creating anything (decoding).
  """

  def __init__(self, workdir: str, keep: int = 3, *, read_only: bool = False):
    self.directory = checkpoint_dir(workdir)
    if read_only and not os.path.isdir(self.directory):
      raise CheckpointError(f"no checkpoint in workdir {workdir!r}: {self.directory} does not exist "
                            "(train first: python -m train --config configs/tiny.py --workdir ...)")
    with quiet.absl_messages_dropped(*quiet.ORBAX_READ_ONLY):   # we asked for read_only
      options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                             read_only=read_only, enable_async_checkpointing=False)
      self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, params, opt_state, data_iter, cfg: Config, *, force: bool = True):
    """Writes checkpoint ``step`` (blocking) with the grain iterator's state
    (one file per JAX process, ``<step>/data/process_{i}-of-{n}.json``;
    skipped when ``data_iter`` is None, e.g. for synthetic data)."""
    items = {"state": ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
             "config": ocp.args.JsonSave(cfg.to_dict())}
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    args = ocp.args.Composite(**items)
    self._manager.save(step, args=args, force=force)
    self._manager.wait_until_finished()

  def restore_config(self, step: int | None = None) -> Config:
    """The config stored with checkpoint ``step`` (default: latest)."""
    step = self.resolve_step(step)
    try:
      raw = self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises many types for damaged files
      raise CheckpointError(f"cannot read the config of checkpoint {self._path(step)} "
                            f"({_first_line(e)}); delete that step directory to fall back to "
                            "an earlier one") from e
    try:
      return config_lib.from_dict(raw["config"])
    except config_lib.ConfigError as e:
      raise CheckpointError(f"checkpoint {self._path(step)} holds an invalid config: {e}") from e

  def restore(self, step: int | None, abstract_params, abstract_opt_state=None, data_iter=None):
    """Restores (params, opt_state) of checkpoint ``step``, and sets
    ``data_iter`` (a grain iterator) to the saved position.

    ``abstract_*`` are pytrees of ``jax.ShapeDtypeStruct`` (with shardings
    where wanted: arrays are restored directly into them, so a checkpoint
    saved on one mesh restores onto any other mesh or a single device;
    every process reads only the shards it holds). With
    ``abstract_opt_state=None`` only the parameters are read (inference) and
    opt_state comes back as None. ``data_iter=None`` skips the data state
    (synthetic data).

    Raises CheckpointError for a missing or unreadable checkpoint.
    """
    step = self.resolve_step(step)
    try:
      if abstract_opt_state is None:
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item={"params": abstract_params},
                restore_args=ocp.checkpoint_utils.construct_restore_args({"params": abstract_params}),
                partial_restore=True)))
        check_finite(restored["state"]["params"], self._path(step))
        return restored["state"]["params"], None
      items = {"state": ocp.args.StandardRestore({"params": abstract_params,
                                                  "opt_state": abstract_opt_state})}
      if data_iter is not None:
        items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
      restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:
      raise CheckpointError(f"checkpoint {self._path(step)} is unreadable or does not match the "
                            f"model ({type(e).__name__}: {_first_line(e)}); delete that step "
                            "directory to fall back to an earlier one") from e
    check_finite(restored["state"]["params"], self._path(step))
    return restored["state"]["params"], restored["state"]["opt_state"]

  def close(self):
    self._manager.close()

  def resolve_step(self, step: int | None) -> int:
    """``step``, or the latest step when None. Raises CheckpointError when
    there is no checkpoint or no checkpoint ``step``."""
    if step is None:
      step = self.latest_step()
    if step is None:
      raise CheckpointError(f"no checkpoint found in {self.directory}")
    if step not in self.all_steps():
      raise CheckpointError(f"checkpoint step {step} not found in {self.directory}; "
                            f"available: {self.all_steps()}")
    return step

  def _path(self, step):
    return os.path.join(self.directory, str(step))


def check_finite(params, where: str) -> None:
  """Raises CheckpointError naming the first parameter (dotted path) of
  ``params`` (a pytree of arrays, sharded or not) that holds NaN or +-inf,
  with the count of such entries; ``where`` names the checkpoint. One
  reduction per parameter, read back together."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  bad = jax.device_get([jnp.sum(~jnp.isfinite(x)) for _, x in leaves])
  for (path, x), count in zip(leaves, bad):
    if count:
      name = jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")
      raise CheckpointError(f"checkpoint {where}: parameter {name} {tuple(x.shape)} holds "
                            f"{int(count)} non-finite value(s) (NaN or inf); the run diverged or "
                            "the file was damaged or badly converted, so it cannot be decoded or "
                            "resumed (use an earlier step)")


def _first_line(e: Exception, limit: int = 200) -> str:
  """The first line of an exception message, shortened (orbax and
  tensorstore errors embed long specs)."""
  lines = str(e).strip().splitlines()
  text = lines[0] if lines else type(e).__name__
  return text if len(text) <= limit else text[:limit] + "..."
