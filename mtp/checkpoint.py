"""Orbax checkpoints of a training workdir: parameters, optimizer state,
step, the data iterator's state and the config (``mtp.loading`` handles
exported directories).

Layout ``WORKDIR/checkpoints/<step>/{state,data,config,checksums}``, written
atomically by orbax, the last ``keep`` kept. ``checksums`` holds each saved
array's dtype, shape and CRC-32; ``restore`` verifies every array it reads
(a mismatch names step and array; a checkpoint without checksums loads with
a notice; non-addressable shards are not checked). A save failing for an OS
reason raises ``CheckpointWriteError`` after removing its partial folder.
Readers of a workdir being trained read the newest complete step
(``Checkpointer.read_step``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as errno_lib
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
import zlib

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from orbax.checkpoint._src import asyncio_utils as _orbax_asyncio
from orbax.checkpoint._src.futures import future as _orbax_future

from mtp import config as config_lib
from mtp import quiet
from mtp.config import Config


class CheckpointError(RuntimeError):
  """Missing, corrupt or incompatible checkpoint (the message names the path)."""


class CheckpointWriteError(CheckpointError):
  """A checkpoint save failed for an OS reason (full disk, permissions); the
  message is one line naming the step, its path, the errno and the last
  complete step."""


# Files without which orbax cannot read an item; a missing one is named
# before orbax is asked (it would report e.g. a pytree structure error).
_REQUIRED_FILES = {"state": ("_METADATA", "manifest.ocdbt"), "config": ("metadata",)}
_DRAIN_TIMEOUT_S = 60.0
# The lock file of a training run (``train.workdir.WorkdirLock`` writes
# {"host", "pid", "started"} into it while the run lives); only read here.
TRAIN_LOCK_FILE = "train.lock"
# Orbax writes a step into ``<step>`` + this suffix and renames it when whole.
_TMP_SUFFIX = ".orbax-checkpoint-tmp"
# Orbax logs each failed write thread with its traceback; a failed save is
# reported once, by CheckpointWriteError or the exception itself.
_ORBAX_THREAD_FAILED = ("[process=%d][thread=%s][operation_id=%s] _SignalingThread.run() raised",)
# Tensorstore names the errno of a failed file operation in its message.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)|\[Errno (\d+)\]|OS error (\d+)")
_SPACE_ERRNOS = frozenset({errno_lib.ENOSPC, errno_lib.EDQUOT})
_PERMISSION_ERRNOS = frozenset({errno_lib.EACCES, errno_lib.EPERM, errno_lib.EROFS})
_READ_RETRIES = 3


def _run_sync_draining(coro):
  """Orbax's ``asyncio_utils._run_sync_via_new_loop``, except that tasks still
  pending when ``coro`` ends are awaited (at most ``_DRAIN_TIMEOUT_S``, then
  cancelled) before the loop closes: a failed read or write otherwise leaves
  in-flight tensorstore callbacks that print "Event loop is closed"
  tracebacks after the error was handled."""
  loop = asyncio.new_event_loop()
  try:
    asyncio.set_event_loop(loop)
    return loop.run_until_complete(coro)
  finally:
    try:
      pending = asyncio.all_tasks(loop)
      if pending:
        _, late = loop.run_until_complete(asyncio.wait(pending, timeout=_DRAIN_TIMEOUT_S))
        for task in late:
          task.cancel()
        if late:
          loop.run_until_complete(asyncio.gather(*late, return_exceptions=True))
    finally:
      asyncio.set_event_loop(None)
      loop.close()


@contextlib.contextmanager
def _pending_io_drained():
  """Orbax calls in the block (in any thread) wait for their in-flight
  tensorstore reads and writes before closing their event loop
  (``_run_sync_draining``). A no-op with an orbax that has no
  ``_run_sync_via_new_loop``."""
  name = "_run_sync_via_new_loop"
  original = getattr(_orbax_asyncio, name, None)
  if original is None:
    yield
    return
  setattr(_orbax_asyncio, name, _run_sync_draining)
  try:
    yield
  finally:
    setattr(_orbax_asyncio, name, original)


def _join_orbax_threads(timeout: float = _DRAIN_TIMEOUT_S) -> None:
  """Waits (at most ``timeout`` s in all) for orbax's background write threads,
  which go on after one item's write failed and would print tracebacks
  later. A no-op with an orbax without ``_SignalingThread``."""
  cls = getattr(_orbax_future, "_SignalingThread", None)
  if cls is None:
    return
  deadline = time.monotonic() + timeout
  for t in threading.enumerate():
    if isinstance(t, cls) and t is not threading.current_thread():
      # threading's join, not orbax's override: that one re-raises the thread's error
      threading.Thread.join(t, max(0.0, deadline - time.monotonic()))


@contextlib.contextmanager
def _orbax_writes_settled():
  """For a save: when the block ends (a failed save included), no orbax
  write is left running (``_join_orbax_threads``, ``_pending_io_drained``)
  and orbax's logged tracebacks of failed write threads were dropped
  (``_ORBAX_THREAD_FAILED``): the failure is reported once, by the caller."""
  with _pending_io_drained(), quiet.absl_messages_dropped(*_ORBAX_THREAD_FAILED):
    try:
      yield
    finally:
      _join_orbax_threads()


def os_errno(e: BaseException) -> int | None:
  """The errno of the OS failure behind ``e``: the first ``OSError`` with
  one in its chain (causes, contexts, exception groups), or the code
  tensorstore writes into its messages (``[os_error_code='28']``); None
  when there is none."""
  todo, seen = [e], set()
  while todo:
    x = todo.pop(0)
    if x is None or id(x) in seen:
      continue
    seen.add(id(x))
    if isinstance(x, OSError) and x.errno:
      return x.errno
    m = _OS_ERROR_CODE.search(str(x))
    if m:
      return int(next(g for g in m.groups() if g))
    todo += [*getattr(x, "exceptions", ()), x.__cause__, x.__context__]
  return None


def _steps(steps: list[int]) -> str:
  """``"step 6 is"`` / ``"steps 9, 6 are"``: the subject of a notice."""
  if len(steps) == 1:
    return f"step {steps[0]} is"
  return f"steps {', '.join(map(str, steps))} are"


def _resume_advice(code: int, directory: str) -> str:
  """What to do before resuming after a save failed with errno ``code``."""
  if code in _SPACE_ERRNOS:
    return "after freeing space"
  if code in _PERMISSION_ERRNOS:
    return f"once {directory} is writable"
  return "once the cause is fixed"


def pid_alive(pid: int) -> bool:
  """Whether process ``pid`` exists on this host (signal 0)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:     # exists, owned by someone else
    return True
  return True


def training_run(workdir: str) -> str | None:
  """"pid N" (or "pid N on host H") of the training run that may be writing
  ``workdir``, from ``train.lock`` (only read): a live process on this host or
  one on another; None when the file is missing, empty or unreadable, or
  names this process or a dead one."""
  try:
    with open(os.path.join(workdir, TRAIN_LOCK_FILE), encoding="utf-8") as f:
      text = f.read()
    info = json.loads(text) if text.strip() else {}
  except (OSError, ValueError):
    return None
  pid = info.get("pid") if isinstance(info, dict) else None
  if not isinstance(pid, int):
    return None
  host = info.get("host")
  if host != socket.gethostname():
    return f"pid {pid} on host {host}"
  return f"pid {pid}" if pid != os.getpid() and pid_alive(pid) else None


def _no_step_metadata_note():
  """Drops orbax's warning for a missing step-level ``_CHECKPOINT_METADATA``
  (``quiet.ORBAX_NO_STEP_METADATA``) during a restore (the manager's
  constructor, which lists the steps, drops it too)."""
  return quiet.absl_messages_dropped(*quiet.ORBAX_NO_STEP_METADATA)


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
    self.workdir = os.path.abspath(workdir)
    self.directory = checkpoint_dir(workdir)
    if read_only and not os.path.isdir(self.directory):
      raise CheckpointError(f"no checkpoint in workdir {workdir!r}: {self.directory} does not exist "
                            "(train one first: python -m train --config configs/tiny.py --workdir ...; "
                            "or import a pretrained model: python -m mtp.importers --gguf FILE "
                            "--workdir ...)")
    # read_only: we asked for it; listing the steps reads each one's metadata
    with quiet.absl_messages_dropped(*quiet.ORBAX_READ_ONLY, *quiet.ORBAX_NO_STEP_METADATA):
      options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                             read_only=read_only, enable_async_checkpointing=False)
      self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, params, opt_state, data_iter, cfg: Config, *, force: bool = True):
    """Writes checkpoint ``step`` (blocking) with the iterator state (one file
    per process, ``<step>/data/process_{i}-of-{n}.json``; none when
    ``data_iter`` is None). Raises CheckpointWriteError for an OS failure
    (``os_errno``) once nothing of the save runs and its partial folder is
    removed; the last complete step stays the latest."""
    state = {"params": params, "opt_state": opt_state}
    items = {"state": ocp.args.StandardSave(state),
             "config": ocp.args.JsonSave(cfg.to_dict()),
             CHECKSUMS_ITEM: ocp.args.JsonSave(array_checksums(state))}
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    args = ocp.args.Composite(**items)
    try:
      with _orbax_writes_settled():
        self._manager.save(step, args=args, force=force)
        self._manager.wait_until_finished()
    except Exception as e:
      code = os_errno(e)
      if code is None:
        raise
      self._discard_partial(step)
      raise CheckpointWriteError(self._not_written(step, code)) from e

  def _not_written(self, step: int, code: int) -> str:
    """The one-line report of a save of ``step`` that failed with errno ``code``."""
    last, advice = self.latest_step(), _resume_advice(code, self.directory)
    then = (f"the last complete checkpoint is step {last} (resume from it {advice})"
            if last is not None else f"no checkpoint was written before it (re-run {advice})")
    return (f"checkpoint step {step} was not written to {self._path(step)}: [Errno {code}] "
            f"{os.strerror(code)}; {then}")

  def _discard_partial(self, step: int) -> None:
    """Removes what a failed save of ``step`` left: orbax's
    ``<step>.orbax-checkpoint-tmp`` folder (never listed as a step; removed
    to give its space back). Process 0 only, as orbax writes it."""
    if jax.process_index() != 0 or not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      if name.startswith(f"{step}{_TMP_SUFFIX}"):
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def restore_config(self, step: int | None = None) -> Config:
    """The config stored with checkpoint ``step`` (default: latest)."""
    step = self.resolve_step(step)
    self._check_files(step, "config")
    try:
      with _pending_io_drained(), _no_step_metadata_note():
        raw = self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises many types for damaged files
      raise CheckpointError(f"cannot read the config of checkpoint {self._path(step)} "
                            f"({_first_line(e)}); {self._advice()}") from e
    try:
      return config_lib.from_dict(raw["config"])
    except config_lib.ConfigError as e:
      raise CheckpointError(f"checkpoint {self._path(step)} holds an invalid config: {e}") from e

  def restore(self, step: int | None, abstract_params, abstract_opt_state=None, data_iter=None):
    """(params, opt_state) of checkpoint ``step``, restored straight into the
    ``abstract_*`` pytrees of ``ShapeDtypeStruct`` (with shardings: any mesh
    or one device; each process reads its shards); ``abstract_opt_state=None``
    reads parameters only (opt_state None). Sets ``data_iter`` to the saved
    position (None: skipped). Raises CheckpointError (missing, unreadable)."""
    step = self.resolve_step(step)
    self._check_files(step, "state")
    try:
      if abstract_opt_state is None:
        with _pending_io_drained(), _no_step_metadata_note():
          restored = self._manager.restore(step, args=ocp.args.Composite(
              state=ocp.args.PyTreeRestore(
                  item={"params": abstract_params},
                  restore_args=ocp.checkpoint_utils.construct_restore_args(
                      {"params": abstract_params}),
                  partial_restore=True)))
        restored["state"]["opt_state"] = None
      else:
        items = {"state": ocp.args.StandardRestore({"params": abstract_params,
                                                    "opt_state": abstract_opt_state})}
        if data_iter is not None:
          items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        with _pending_io_drained(), _no_step_metadata_note():
          restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:
      raise CheckpointError(f"checkpoint {self._path(step)} is unreadable or does not match the "
                            f"model ({type(e).__name__}: {_first_line(e)}); "
                            f"{self._advice()}") from e
    state = restored["state"]
    self._verify(step, state if abstract_opt_state is not None else {"params": state["params"]})
    check_finite(state["params"], self._path(step))
    return state["params"], state["opt_state"]

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

  def read_step(self, step: int | None, read):
    """``read(s)`` for checkpoint ``s`` = ``step``, or (None) for the newest
    complete step, retried (at most ``_READ_RETRIES`` times, with a notice)
    when a live run's rotation removes it or it is incomplete. A pinned
    ``step``'s errors propagate."""
    if step is not None:
      return read(self.resolve_step(step))
    failed = []
    s = self.newest_complete_step()
    while True:
      try:
        return read(s)
      except CheckpointError:
        why = self._in_flux(s)
        if why is None or len(failed) >= _READ_RETRIES:
          raise
        failed.append(s)
        self._reload()
        nxt = self.newest_complete_step(skip=failed)
        print(f"note: checkpoint step {s} {why}; using step {nxt}", file=sys.stderr, flush=True)
        s = nxt

  def newest_complete_step(self, skip=()) -> int:
    """The newest listed step not in ``skip``; while a training run may be
    writing (``training_run``), newer incomplete steps are passed over with a
    notice. Raises CheckpointError when there is none."""
    steps = [s for s in sorted(self.all_steps(), reverse=True) if s not in skip]
    if not steps:
      raise CheckpointError(f"no checkpoint found in {self.directory}")
    writer = training_run(self.workdir)
    if writer is None:
      return steps[0]
    passed = []
    for s in steps:
      if self.is_complete(s):
        if passed:
          print(f"note: checkpoint {_steps(passed)} being written or removed by a training "
                f"run ({writer}); using step {s}", file=sys.stderr, flush=True)
        return s
      passed.append(s)
    raise CheckpointError(f"no complete checkpoint in {self.directory}: {_steps(passed)} being "
                          f"written or removed by a training run ({writer}); retry once its save "
                          "has finished")

  def is_complete(self, step: int) -> bool:
    """Whether the directory of ``step`` exists with every file orbax needs
    to read its state and config (``_REQUIRED_FILES``)."""
    return os.path.isdir(self._path(step)) and not any(
        self._missing(step, item) for item in ("state", "config"))

  def _in_flux(self, step: int) -> str | None:
    """Why a failed read of ``step`` is worth retrying on another step, or
    None: its directory is gone (removed while it was read), or it is
    incomplete while a training run is live."""
    if not os.path.isdir(self._path(step)):
      return "was removed while it was read (a training run's checkpoint rotation, or by hand)"
    writer = training_run(self.workdir)
    if writer is not None and not self.is_complete(step):
      return f"is being written or removed by a training run ({writer})"
    return None

  def _reload(self) -> None:
    """Lists the steps on disk again (a training run adds and removes them)."""
    with _no_step_metadata_note():
      self._manager.reload()

  def _advice(self) -> str:
    """What to do about a step that cannot be read: delete its directory,
    unless a training run is live (``training_run``): the step may be one it
    is writing or rotating away, and deleting it would break that run."""
    writer = training_run(self.workdir)
    if writer is None:
      return "delete that step directory to fall back to an earlier one"
    return (f"a training run ({writer}) is writing this workdir and may be writing or removing "
            "this step: do not delete it; retry, or choose an earlier step")

  def _path(self, step):
    return os.path.join(self.directory, str(step))

  def _missing(self, step: int, item: str) -> list[str]:
    """The files of ``item`` that orbax needs (``_REQUIRED_FILES``) and
    checkpoint ``step`` lacks, as ``item/file``."""
    folder = os.path.join(self._path(step), item)
    return [os.path.join(item, f) for f in _REQUIRED_FILES.get(item, ())
            if not os.path.isfile(os.path.join(folder, f))]

  def _check_files(self, step: int, item: str) -> None:
    """Raises CheckpointError naming the files of ``item`` that orbax needs
    and checkpoint ``step`` lacks (``_missing``)."""
    missing = self._missing(step, item)
    if missing:
      raise CheckpointError(f"checkpoint {self._path(step)} is incomplete: {', '.join(missing)} "
                            f"{'is' if len(missing) == 1 else 'are'} missing (deleted or never "
                            f"written); {self._advice()}")

  def _verify(self, step: int, restored) -> None:
    """Checks ``restored`` ({"params": ..., ["opt_state": ...]}) against the
    checksums saved with ``step`` (``verify_checksums``); a checkpoint
    without them gets a one-line notice on stderr."""
    path = os.path.join(self._path(step), CHECKSUMS_ITEM, "metadata")
    try:
      with open(path, encoding="utf-8") as f:
        recorded = json.load(f)
    except FileNotFoundError:
      print(f"note: checkpoint {self._path(step)} has no array checksums (written before they "
            "were recorded); its arrays are not verified", file=sys.stderr, flush=True)
      return
    except (OSError, ValueError) as e:
      raise CheckpointError(f"checkpoint {self._path(step)}: its array checksums {path} are "
                            f"unreadable ({_first_line(e)}); {self._advice()}") from e
    verify_checksums(restored, recorded, self._path(step))


CHECKSUMS_ITEM = "checksums"
CHECKSUM_FORMAT = 1


def _array_name(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")


def array_checksums(tree) -> dict:
  """``{"format": 1, "algorithm": "crc32", "arrays": {name: {"dtype",
  "shape", "crc32"}}}`` for every array leaf of ``tree`` (names are dotted
  key paths, e.g. ``params.blocks.0.attn.k_proj.kernel``; the CRC-32 is of
  the array's bytes in C order). Leaves not fully addressable by this
  process are left out."""
  arrays = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      continue
    a = np.ascontiguousarray(jax.device_get(x))
    arrays[_array_name(path)] = {"dtype": a.dtype.name, "shape": list(a.shape),
                                 "crc32": zlib.crc32(a.tobytes()) & 0xFFFFFFFF}
  return {"format": CHECKSUM_FORMAT, "algorithm": "crc32", "arrays": arrays}


def verify_checksums(tree, recorded: dict, where: str) -> None:
  """Raises CheckpointError naming checkpoint ``where`` and the first array of
  ``tree`` whose bytes differ from ``recorded`` (``array_checksums`` of the
  saved tree). Arrays restored with another dtype or shape than saved (a
  cast on restore) and arrays without a record are not compared."""
  saved = recorded.get("arrays", {}) if isinstance(recorded, dict) else {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = _array_name(path)
    want = saved.get(name)
    if want is None or (isinstance(x, jax.Array) and not x.is_fully_addressable):
      continue
    a = np.ascontiguousarray(jax.device_get(x))
    if a.dtype.name != want.get("dtype") or list(a.shape) != list(want.get("shape", ())):
      continue
    if zlib.crc32(a.tobytes()) & 0xFFFFFFFF != want.get("crc32"):
      raise CheckpointError(f"checkpoint {where}: array {name} {tuple(a.shape)} {a.dtype.name} "
                            "does not match the checksum recorded when it was saved (the files "
                            "were altered or damaged after the save); it cannot be decoded or "
                            "resumed (use an earlier step)")


@jax.jit
def _nonfinite_counts(arrays):
  """Per array of ``arrays`` (a list, all on one device), its number of NaN
  / +-inf entries: int32 [len(arrays)], on that device."""
  return jnp.stack([jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) for x in arrays])


def _local_nonfinite_counts(leaves) -> np.ndarray:
  """int64 [len(leaves)]: per leaf, the non-finite entries this process holds
  (a global array's local shards, replica 0 only; a local array whole),
  counted per local device with no cross-process op (one collective per
  leaf can deadlock two processes: docs/testing.md, "A hung worker")."""
  counts = np.zeros(len(leaves), np.int64)
  per_device = {}      # device -> [(leaf index, shard data)]
  for i, x in enumerate(leaves):
    if isinstance(x, jax.Array):
      for s in x.addressable_shards:
        if s.replica_id == 0:
          per_device.setdefault(s.device, []).append((i, s.data))
    else:
      counts[i] = np.sum(~np.isfinite(np.asarray(x)))
  groups = list(per_device.values())
  results = jax.device_get([_nonfinite_counts([a for _, a in items]) for items in groups])
  for items, got in zip(groups, results):
    for (i, _), c in zip(items, got):
      counts[i] += int(c)
  return counts


def _is_global(x) -> bool:
  """Whether ``x`` is a jax.Array with shards on other processes' devices."""
  return isinstance(x, jax.Array) and not x.is_fully_addressable


def check_finite(params, where: str) -> None:
  """Raises CheckpointError naming checkpoint ``where``, the first parameter
  (dotted path) of ``params`` holding NaN or +-inf and its count. With global
  arrays every process must call it: one allgather of the local counts
  gives all processes the same totals, so all raise together."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  arrays = [x for _, x in leaves]
  bad = _local_nonfinite_counts(arrays)
  is_global = np.array([_is_global(x) for x in arrays], bool)
  if is_global.any():        # the same on every process: each calls the collective, or none does
    from jax.experimental import multihost_utils
    sent = np.minimum(bad, 2**31 - 1).astype(np.int32)     # int32 on the wire (x64 off)
    got = np.asarray(multihost_utils.process_allgather(sent)).reshape(jax.process_count(), -1)
    bad = np.where(is_global, got.astype(np.int64).sum(0), got.max(0))
  for (path, x), count in zip(leaves, bad):
    if count:
      name = jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")
      raise CheckpointError(f"checkpoint {where}: parameter {name} {tuple(x.shape)} holds "
                            f"{int(count)} non-finite value(s) (NaN or inf); the run diverged or "
                            "the file was damaged or badly converted, so it cannot be decoded or "
                            "resumed (use an earlier step)")


def _first_line(e: Exception, limit: int = 300) -> str:
  """The first line of an exception message, shortened (orbax and
  tensorstore errors embed long specs)."""
  if "TensorStore details" in str(e):    # orbax's wrapper embeds a spec; the cause names the array
    seen = set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
      seen.add(id(e))
      e = e.__cause__ or e.__context__
  lines = str(e).strip().splitlines()
  text = lines[0] if lines else type(e).__name__
  return text if len(text) <= limit else text[:limit] + "..."
