"""A training workdir's bookkeeping around the loop (``train.loop.train``):
what may be resumed or started from, and the files a resumed run repairs.

Files of ``WORKDIR`` (besides ``checkpoints/``, ``mtp.checkpoint``):

- ``config.json``: the config of the latest run; a resumed run with another
  config keeps the previous one as ``config.until_step<N>.json``;
- ``metrics.jsonl``: one row per (step, split); a resumed run first drops
  the rows after its checkpoint (left by a run killed after it);
- ``final_metrics.json``: written atomically after the final evaluation;
  a run whose file is complete for its latest step has nothing left to do;
- ``train.lock``: a workdir has one writer (``WorkdirLock``). ``python -m
  train`` holds an exclusive ``fcntl.flock`` on it while it runs, with the
  holder's host, process id and start time written inside; a second run
  stops at once naming the holder. The OS releases the flock when its
  process dies, so a killed run leaves only the metadata: the next run
  finds it stale and takes over with a one-line notice. Decoding and export
  only read a workdir and never take the lock.

Every check here runs before anything is written.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from mtp import checkpoint as ckpt_lib
from mtp import config as config_lib
from mtp import loading
from mtp.config import Config, ConfigError

LOCK_FILE = "train.lock"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
FINAL_METRICS_FILE = "final_metrics.json"


def param_count(cfg: Config) -> int:
  """Parameters of ``mtp.model.Transformer(cfg.model, cfg.mtp.depth)``
  computed from the config alone (no model is built; equals
  ``mtp.model.count_params(...)["total"]`` without ``mtp.feature_layers``,
  whose fusion projection it leaves out)."""
  m = cfg.model
  d, nh, kh = m.d_model, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  block = d * nh + 2 * d * kh + nh * d + 3 * d * m.mlp_dim + 2 * d   # attn, SwiGLU, 2 norms
  backbone = m.vocab_size * d + m.num_layers * block + d + (0 if m.tie_embeddings else d * m.vocab_size)
  module = 3 * d + 2 * d * d + block                                  # 3 norms, M_k, a block
  return int(backbone + cfg.mtp.depth * module)


def memory_floor_bytes(cfg: Config) -> dict[str, int]:
  """A lower bound on the train step's memory, by term (bytes): ``params``,
  the parameters in ``model.param_dtype`` (``param_count``); ``logits``, one
  float32 logits tensor [train.batch_size, train.seq_len, model.vocab_size]
  (the main head's logits are always materialised, for its loss or as the
  modules' distillation teacher). Activations, gradients, the optimizer's
  state and the other heads' logits come on top: the real step needs
  several times more."""
  t = cfg.train
  per = 2 if cfg.model.param_dtype in ("bfloat16", "float16") else 4
  return {"params": param_count(cfg) * per,
          "logits": int(t.batch_size) * int(t.seq_len) * int(cfg.model.vocab_size) * 4}


def device_memory_bytes() -> tuple[int, str]:
  """(bytes this process's share of the train step can use at most, where):
  the sum of its local devices' ``memory_stats()["bytes_limit"]`` where the
  backend reports one (GPU, TPU), else this host's physical memory (CPU
  devices share it)."""
  devs = jax.local_devices()
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devs]
  if all(limits):
    return int(sum(limits)), f"{len(devs)} {devs[0].platform} device(s)"
  return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "this host's RAM"


def process_share(cfg: Config, num_local: int, num_global: int) -> tuple[float, float]:
  """The smallest fractions (params, logits) of the train step's parameters
  and logits one process can hold, for ``num_local`` of ``num_global``
  devices: parameters are split over at most ``mesh.fsdp x mesh.tensor``
  devices (a process holds at least ``num_local`` of them, or all), the
  logits over at most every device (batch and vocabulary). Lower bounds:
  the real layout never holds less."""
  split = max(1, cfg.mesh.fsdp) * max(1, cfg.mesh.tensor)
  return min(1.0, num_local / split), num_local / max(num_global, 1)


def check_memory_floor(cfg: Config, available: tuple[int, str] | None = None,
                       devices: tuple[int, int] | None = None) -> None:
  """Refuses a train step that cannot fit before anything is allocated or
  written: raises ConfigError when this process's share
  (``process_share``; ``devices`` = (local, global) device counts, default
  JAX's) of ``memory_floor_bytes`` exceeds ``available`` (default
  ``device_memory_bytes()``), naming the model fields when the parameters
  alone do not fit, else ``train.batch_size`` and the largest batch whose
  floor fits. Passing is no promise: the floor leaves out activations,
  gradients and the optimizer state."""
  floor = memory_floor_bytes(cfg)
  p_share, l_share = process_share(cfg, *(devices or (jax.local_device_count(), jax.device_count())))
  params, logits = int(floor["params"] * p_share), int(floor["logits"] * l_share)
  have, where = available or device_memory_bytes()
  if params + logits <= have:
    return
  gib, t, m = 2 ** 30, cfg.train, cfg.model
  if params > have:
    raise ConfigError(
        f"the model cannot fit: its {param_count(cfg):,} parameters (model.d_model={m.d_model}, "
        f"model.num_layers={m.num_layers}, model.mlp_dim={m.mlp_dim}, model.vocab_size="
        f"{m.vocab_size}, mtp.depth={cfg.mtp.depth}; this process's share with mesh.fsdp="
        f"{cfg.mesh.fsdp}, mesh.tensor={cfg.mesh.tensor}) take {params / gib:.1f} GiB, more "
        f"than {where} ({have / gib:.1f} GiB), before any activation")
  per_seq = max(logits // t.batch_size, 1)
  raise ConfigError(
      f"train.batch_size={t.batch_size} cannot fit: one float32 logits tensor of the train "
      f"step (batch_size x seq_len={t.seq_len} x vocab_size={m.vocab_size} x 4 bytes, this "
      f"process's share) is {logits / gib:.1f} GiB, and with the parameters' {params / gib:.1f} "
      f"GiB more than {where} ({have / gib:.1f} GiB); allowed: train.batch_size <= "
      f"{max((have - params) // per_seq, 0)} here, and far less in practice")


def check_workdir(cfg: Config, workdir: str) -> int | None:
  """Refuses a workdir whose latest checkpoint was made by an incompatible
  config (before anything is written). Returns the step to resume from, or
  None for a fresh run. Raises ConfigError / CheckpointError (also when
  ``train.init_from`` names the workdir itself: a stage writes elsewhere,
  or ``workdir`` is a file)."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f"--workdir={workdir!r} exists and is not a directory: give a new or an "
                      "existing run folder")
  if cfg.train.init_from and os.path.abspath(cfg.train.init_from) == os.path.abspath(workdir):
    raise ConfigError(f"train.init_from={cfg.train.init_from!r} is the run's own --workdir: a "
                      "stage started from a trained workdir writes into a new one")
  if not os.path.isdir(ckpt_lib.checkpoint_dir(workdir)):
    return None
  ckpt = ckpt_lib.Checkpointer(workdir, read_only=True)
  try:
    step = ckpt.latest_step()
    if step is None:
      return None
    saved = ckpt.restore_config(step)
  finally:
    ckpt.close()
  diffs = config_lib.architecture_mismatches(saved, cfg)
  if saved.train.freeze_backbone != cfg.train.freeze_backbone:   # optimizer state differs
    diffs.append(f"train.freeze_backbone: {saved.train.freeze_backbone!r} != "
                 f"{cfg.train.freeze_backbone!r}")
  if saved.train.hidden_cache != cfg.train.hidden_cache:   # the data iterator's state differs
    diffs.append(f"train.hidden_cache: {saved.train.hidden_cache!r} != {cfg.train.hidden_cache!r}")
  if diffs:
    raise ConfigError(f"workdir {workdir!r} holds a checkpoint (step {step}) from an incompatible "
                      f"config (saved != requested): {'; '.join(diffs)}. Use a new --workdir or "
                      "the saved config.")
  return step


def check_init_from(cfg: Config) -> int | None:
  """Checks ``train.init_from`` (a trained workdir, or any directory
  ``mtp.loading`` reads, whose parameters start this run) before anything is
  written. Returns its latest checkpoint step, or None when ``init_from`` is
  empty.

  Raises:
    CheckpointError: it has no checkpoint, or one from another architecture
      (``config.architecture_mismatches``, listed in the message).
  """
  src = cfg.train.init_from
  if not src:
    return None
  try:
    saved, step = loading.load_config(src)
  except ckpt_lib.CheckpointError as e:
    raise ckpt_lib.CheckpointError(f"train.init_from={src!r}: {e}") from e
  diffs = config_lib.architecture_mismatches(saved, cfg)
  if saved.mtp.draft_vocab_size == 0 and cfg.mtp.draft_vocab_size:
    # attaching a draft vocabulary V' in this stage (chosen from its data:
    # train.loop.attach_draft_vocab) is allowed; changing an existing one is not
    diffs = [d for d in diffs if not d.startswith("mtp.draft_vocab_size")]
  if not saved.mtp.feature_layers and cfg.mtp.feature_layers:
    # attaching lower-layer features to module 1 (mtp.model.FeatureFuse, which
    # starts as the identity on h^0) is allowed; changing existing ones is not
    diffs = [d for d in diffs if not d.startswith("mtp.feature_layers")]
  if diffs:
    raise ckpt_lib.CheckpointError(
        f"train.init_from={src!r}: its checkpoint (step {step}) has another architecture than "
        f"this config (saved != requested): {'; '.join(diffs)}")
  return step


def restore_init_params(abstract_params, src: str, step: int):
  """The parameters of checkpoint ``step`` of ``src`` (``train.init_from``),
  restored straight into ``abstract_params``' shardings (a Trainer's
  ``abstract_params``); optimizer state, step and data position are not
  read. Parameters new in this run (a draft vocabulary, module 1's
  ``FeatureFuse``: see ``check_init_from``) start at their own initial
  values. Raises CheckpointError."""
  if loading.kind(src) == loading.EXPORTED:
    step = None                        # one set of weights (check_init_from read its step)
  saved, _ = loading.load_config(src, step)
  flat = dict(nnx.to_flat_state(abstract_params))
  fuse = {p: v for p, v in flat.items() if p[:3] == ("mtp", 0, "fuse")}
  if fuse and not saved.mtp.feature_layers:
    # FeatureFuse is new in this run: restore everything else, start it at its
    # own initial values (the identity on h^0; no random numbers)
    rest = restore_init_params(nnx.from_flat_state({p: v for p, v in flat.items()
                                                    if p not in fuse}), src, step)
    flat = dict(nnx.to_flat_state(rest))
    fresh = _fresh_fuse(fuse)
    for p, v in fuse.items():
      a = v.get_value()
      flat[p] = v.replace(jax.device_put(fresh[p], getattr(a, "sharding", None)))
    return nnx.from_flat_state(flat)
  if ("draft_vocab",) in flat and not saved.mtp.draft_vocab_size:
    # V' is new in this run: restore everything else, keep the placeholder
    # (train.loop.attach_draft_vocab fills it from the data)
    placeholder = flat.pop(("draft_vocab",))
    params = loading.load_params(src, step, nnx.from_flat_state(flat))
    flat = dict(nnx.to_flat_state(params))
    a = placeholder.get_value()
    flat[("draft_vocab",)] = placeholder.replace(
        jax.device_put(np.arange(a.shape[0], dtype=a.dtype), getattr(a, "sharding", None)))
    return nnx.from_flat_state(flat)
  return loading.load_params(src, step, abstract_params)


def _fresh_fuse(fuse) -> dict:
  """{path: initial value} of module 1's ``FeatureFuse`` parameters (``fuse``:
  {flat path: abstract Param}) from its own deterministic init (the identity
  on h^0)."""
  from mtp.model import FeatureFuse
  kernel = fuse[("mtp", 0, "fuse", "proj", "kernel")].get_value()
  d = kernel.shape[1]
  dtype = np.dtype(kernel.dtype).name if kernel.dtype != jax.numpy.bfloat16 else "bfloat16"
  module = FeatureFuse(config_lib.ModelConfig(d_model=d, dtype=dtype, param_dtype=dtype),
                       kernel.shape[0] // d - 1)
  values = {("mtp", 0, "fuse") + tuple(p): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
  return {p: values[p] for p in fuse}


def metric_rows(path: str) -> list[dict]:
  """The rows of a metrics.jsonl file (empty when it does not exist)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def truncate_metrics(path: str, step: int):
  """Drops metric rows after ``step`` (left by a run killed after its last
  checkpoint), so a resumed run's rows are not duplicated."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
  with open(path + ".tmp", "w") as f:
    f.writelines(rows)
  os.replace(path + ".tmp", path)


def resume_metrics(workdir: str, step: int, eval_due: Callable[[int], bool]):
  """Repairs ``metrics.jsonl`` for a run resumed at checkpoint ``step``
  (``truncate_metrics``) and reads back what the result reports.

  Returns (last_train, last_eval, eval_step, eval_pending): the last logged
  train metrics ({} if none); the evaluation logged at ``step`` ({} if
  none, e.g. a run stopped after its final evaluation, before
  final_metrics.json, has one) and ``step`` or None; whether that
  evaluation is still due (``eval_due(step)`` and none was logged).
  """
  path = os.path.join(workdir, METRICS_FILE)
  truncate_metrics(path, step)
  rows = metric_rows(path)
  last_train, last_eval, eval_step, eval_pending = {}, {}, None, False
  train_rows = [r for r in rows if r["split"] == "train"]
  if train_rows:   # the result reports the last logged train metrics, as uninterrupted
    last_train = {k: v for k, v in train_rows[-1].items() if k not in ("step", "split")}
  logged = [r for r in rows if r["split"] == "eval" and r["step"] == step]
  if logged:
    last_eval = {k: v for k, v in logged[-1].items() if k not in ("step", "split")}
    eval_step = step
  else:
    eval_pending = eval_due(step)
  return last_train, last_eval, eval_step, eval_pending


def config_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
  """Dotted fields where two config dicts differ, as ``"field: old -> new"``
  (sorted; a field missing on one side shows as ``<unset>``)."""
  out = []
  for k in sorted(set(old) | set(new)):
    a, b = old.get(k, "<unset>"), new.get(k, "<unset>")
    if isinstance(a, dict) and isinstance(b, dict):
      out += config_changes(a, b, f"{prefix}{k}.")
    elif a != b:
      out.append(f"{prefix}{k}: {a!r} -> {b!r}")
  return out


def record_config(workdir: str, cfg: Config, resume_step: int | None) -> str:
  """Writes ``cfg`` as ``config.json``. A run resumed at ``resume_step``
  whose previous config.json differs keeps that one as
  ``config.until_step<N>.json``; returns the note for the resume line
  (``"; config changed since the last run (...)..."``), else ""."""
  config_path = os.path.join(workdir, CONFIG_FILE)
  note = ""
  if resume_step is not None and os.path.exists(config_path):
    with open(config_path) as f:
      previous = f.read()
    if previous != cfg.to_json():
      kept = f"config.until_step{resume_step}.json"
      changes = config_changes(json.loads(previous), cfg.to_dict())
      os.replace(config_path, os.path.join(workdir, kept))
      note = (f"; config changed since the last run ({'; '.join(changes)}); the previous "
              f"one is kept as {kept}")
  with open(config_path, "w") as f:
    f.write(cfg.to_json())
  return note


def finished_result(workdir: str, step: int) -> dict | None:
  """``workdir``'s final_metrics.json if it is complete for ``step`` (written
  after the final evaluation at that step), else None (missing, unreadable,
  another step, no evaluation, or left by an interrupted run)."""
  try:
    with open(os.path.join(workdir, FINAL_METRICS_FILE)) as f:
      res = json.load(f)
  except (OSError, ValueError):
    return None
  if isinstance(res, dict) and res.get("step") == step and res.get("eval") and not res.get("interrupted"):
    return res
  return None


def write_final_metrics(workdir: str, result: dict[str, Any]) -> None:
  """Writes ``final_metrics.json`` atomically (temporary file + rename)."""
  path = os.path.join(workdir, FINAL_METRICS_FILE)
  with open(path + ".tmp", "w") as f:
    json.dump(result, f, indent=2)
  os.replace(path + ".tmp", path)


class WorkdirBusyError(RuntimeError):
  """Another training run holds the workdir's lock (the message names it)."""


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:     # exists, owned by someone else
    return True
  return True


class WorkdirLock:
  """The one-writer lock of a training workdir: ``WORKDIR/train.lock``.

  ``acquire()`` takes an exclusive, non-blocking ``fcntl.flock`` on the file
  and writes ``{"host", "pid", "started"}`` (UTC, ISO 8601) into it;
  ``release()`` empties the file and drops the flock (the file stays: it is
  never deleted, so two runs cannot end up locking two different files).

  Raises WorkdirBusyError from ``acquire`` when another process holds the
  flock, or when the file names a live process on this host other than this
  one (a file system that does not honour flock). A file naming a process
  that is gone (killed, crashed: the OS dropped its flock) is stale: the
  lock is taken over and ``log`` gets one notice line. Usable as a context
  manager.
  """

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = os.path.join(workdir, LOCK_FILE)
    self._file = None

  @property
  def held(self) -> bool:
    return self._file is not None

  def _holder(self, info: dict) -> str:
    return (f"host {info.get('host', '?')}, process id {info.get('pid', '?')}, started "
            f"{info.get('started', '?')}")

  def acquire(self, log: Callable[[str], None] | None = None) -> None:
    if self._file is not None:
      return
    f = open(self.path, "a+", encoding="utf-8")
    try:
      try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        raise WorkdirBusyError(
            f"workdir {self.workdir!r} is in use by another training run "
            f"({self._holder(_read_lock(f))}; {self.path}): a workdir has one writer; wait for "
            "that run to end or stop it, or use another --workdir") from None
      previous = _read_lock(f)
      host = socket.gethostname()
      if previous:
        pid = previous.get("pid")
        if (previous.get("host") == host and isinstance(pid, int) and pid != os.getpid()
            and _alive(pid)):
          raise WorkdirBusyError(
              f"workdir {self.workdir!r}: {self.path} names a live process "
              f"({self._holder(previous)}) although its lock is free (a file system without "
              "flock?); if that process is not a training run on this workdir, delete the file")
        if log is not None:
          log(f"note: taking over the lock of a training run that is gone "
              f"({self._holder(previous)}): it was killed or crashed")
      f.seek(0)
      f.truncate()
      json.dump({"host": host, "pid": os.getpid(),
                 "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
                     timespec="seconds")}, f)
      f.write("\n")
      f.flush()
      os.fsync(f.fileno())
    except BaseException:
      f.close()
      raise
    self._file = f

  def release(self) -> None:
    f, self._file = self._file, None
    if f is None:
      return
    try:
      f.seek(0)
      f.truncate()
      f.flush()
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)
      f.close()

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()


def _read_lock(f) -> dict:
  """The metadata in an open lock file ({} when empty or unreadable)."""
  try:
    f.seek(0)
    text = f.read()
    info = json.loads(text) if text.strip() else {}
    return info if isinstance(info, dict) else {}
  except (OSError, ValueError):
    return {}
