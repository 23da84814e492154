"""A training workdir's bookkeeping around the loop (``train.loop.train``):
what may be resumed or started from, and the files a resumed run repairs.
Every check runs before anything is written.

- ``config.json``: the latest run's config (a resumed run with another one
  keeps the old as ``config.until_step<N>.json``); the checkpoint's own
  config is the reference;
- ``metrics.jsonl``: one whole row per (step, split); a resumed run drops
  rows after its checkpoint and incomplete lines, with a notice;
- ``final_metrics.json``: written atomically after the final evaluation;
- ``train.lock``: the one writer's flock (``WorkdirLock``); decoding and
  export never take it.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from mtp import checkpoint as ckpt_lib
from mtp import config as config_lib
from mtp import loading
from mtp.config import Config, ConfigError

LOCK_FILE = ckpt_lib.TRAIN_LOCK_FILE      # read by mtp.checkpoint.training_run (decode skips a step being written)
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
  """A lower bound on the train step's memory by term (bytes): ``params`` in
  ``model.param_dtype`` and ``logits``, one float32 [batch_size, seq_len,
  vocab_size] tensor (always materialised); activations, gradients and the
  optimizer state come on top."""
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
  """The smallest fractions (params, logits) one process of ``num_local`` of
  ``num_global`` devices can hold: parameters split over at most fsdp x
  tensor devices, logits over every device. Lower bounds."""
  split = max(1, cfg.mesh.fsdp) * max(1, cfg.mesh.tensor)
  return min(1.0, num_local / split), num_local / max(num_global, 1)


def check_memory_floor(cfg: Config, available: tuple[int, str] | None = None,
                       devices: tuple[int, int] | None = None) -> None:
  """Raises ConfigError, before anything is allocated or written, when this
  process's share of ``memory_floor_bytes`` exceeds ``available`` (default
  ``device_memory_bytes()``), naming the model fields when the parameters
  alone do not fit, else ``train.batch_size`` and the largest batch that
  fits. Passing is no promise."""
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
  """The step to resume from (``resume_point``'s), or None for a fresh run."""
  return resume_point(cfg, workdir)[0]


def resume_point(cfg: Config, workdir: str) -> tuple[int | None, Config | None]:
  """Refuses a workdir whose latest checkpoint was made by an incompatible
  config (before anything is written). Returns (the step to resume from,
  the config that checkpoint was saved with), or (None, None) for a fresh
  run. Raises ConfigError / CheckpointError (also when ``train.init_from``
  names the workdir itself: a stage writes elsewhere, or ``workdir`` is a
  file)."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f"--workdir={workdir!r} exists and is not a directory: give a new or an "
                      "existing run folder")
  if cfg.train.init_from and os.path.abspath(cfg.train.init_from) == os.path.abspath(workdir):
    raise ConfigError(f"train.init_from={cfg.train.init_from!r} is the run's own --workdir: a "
                      "stage started from a trained workdir writes into a new one")
  if not os.path.isdir(ckpt_lib.checkpoint_dir(workdir)):
    return None, None
  ckpt = ckpt_lib.Checkpointer(workdir, read_only=True)
  try:
    step = ckpt.latest_step()
    if step is None:
      return None, None
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
  return step, saved


def check_init_from(cfg: Config) -> int | None:
  """The latest checkpoint step of ``train.init_from`` (any directory
  ``mtp.loading`` reads), or None when empty; checked before anything is
  written. Raises CheckpointError: no checkpoint, or another architecture
  (the mismatches listed)."""
  src = cfg.train.init_from
  if not src:
    return None
  try:
    saved, step = loading.load_config(src)
  except ckpt_lib.CheckpointError as e:
    raise ckpt_lib.CheckpointError(f"train.init_from={src!r}: {e}") from e
  diffs = config_lib.architecture_mismatches(saved, cfg)
  if cfg.mtp.draft_vocab_size:
    # a draft vocabulary V' new in this stage, or of another size, is chosen from
    # its data (train.loop.attach_draft_vocab): the modules' weights do not depend
    # on V' (a draft head is rows of the shared head); dropping V' is not allowed
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
  if (("draft_vocab",) in flat
      and saved.mtp.draft_vocab_size != flat[("draft_vocab",)].get_value().shape[0]):
    # V' is new in this run or of another size: restore everything else (a saved
    # V' read at its own size, then dropped), keep the placeholder
    # (train.loop.attach_draft_vocab fills it from the data)
    placeholder = flat.pop(("draft_vocab",))
    a = placeholder.get_value()
    if saved.mtp.draft_vocab_size:
      flat[("draft_vocab",)] = placeholder.replace(jax.ShapeDtypeStruct(
          (saved.mtp.draft_vocab_size,), a.dtype, sharding=getattr(a, "sharding", None)))
    params = loading.load_params(src, step, nnx.from_flat_state(flat))
    flat = {p: v for p, v in nnx.to_flat_state(params) if p != ("draft_vocab",)}
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


def metric_row(line: str) -> dict | None:
  """The row a line of metrics.jsonl holds (a JSON object with an int
  ``step`` and a str ``split``), or None when it holds none: a line cut
  short by a failed write (a full disk, a crash), or garbage."""
  try:
    row = json.loads(line)
  except ValueError:
    return None
  if not isinstance(row, dict):
    return None
  return row if isinstance(row.get("step"), int) and isinstance(row.get("split"), str) else None


def read_metric_lines(path: str) -> tuple[list[tuple[str, dict]], list[int]]:
  """(the (line, row) pairs of ``path``'s complete rows, in order; the
  1-based numbers of its lines that hold no row, ``metric_row``). Blank
  lines are neither; a missing file has none. Bytes that are not UTF-8 (a
  torn or zero-filled tail) make their line unreadable, not the file."""
  if not os.path.exists(path):
    return [], []
  rows, bad = [], []
  with open(path, encoding="utf-8", errors="replace") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      row = metric_row(line)
      if row is None:
        bad.append(number)
      else:
        rows.append((line.rstrip("\n") + "\n", row))
  return rows, bad


def bad_lines_notice(path: str, bad: list[int], action: str) -> str:
  """The one-line notice for lines of metrics file ``path`` that hold no
  row (``action``: what is done with them, e.g. "dropped"); the first five
  line numbers are named, then how many more."""
  which = f"line {bad[0]}" if len(bad) == 1 else f"lines {', '.join(map(str, bad[:5]))}"
  if len(bad) > 5:
    which += f" and {len(bad) - 5} more"
  what = "not a complete metrics row" if len(bad) == 1 else "not complete metrics rows"
  return f"note: {path}: {action} {which}, {what} (a write cut short, e.g. by a full disk)"


def metric_rows(path: str) -> list[dict]:
  """The rows of a metrics.jsonl file (empty when it does not exist); lines
  that hold no row are skipped with a notice on stderr."""
  rows, bad = read_metric_lines(path)
  if bad:
    print(bad_lines_notice(path, bad, "skipped"), file=sys.stderr, flush=True)
  return [row for _, row in rows]


def truncate_metrics(path: str, step: int):
  """Drops metric rows after ``step`` (left by a run killed after its last
  checkpoint), so a resumed run's rows are not duplicated, and lines that
  hold no row (a torn last line), with a notice on stderr naming them: the
  resumed run goes on as if they had never been written. The file is
  rewritten atomically, every line ending in a newline."""
  if not os.path.exists(path):
    return
  rows, bad = read_metric_lines(path)
  if bad:
    print(bad_lines_notice(path, bad, "dropped"), file=sys.stderr, flush=True)
  write_atomic(path, "".join(line for line, row in rows if row["step"] <= step))


def write_atomic(path: str, text: str) -> None:
  """Writes ``text`` to ``path`` through a temporary file and a rename: a
  failed write (a full disk) leaves the old file whole, and no temporary
  file behind (``mtp.cli.write_atomic``)."""
  from mtp.files import write_atomic as write
  write(path, text)


def append_line(f, line: str) -> None:
  """Appends ``line`` (newline included) to ``f``, an unbuffered binary file
  opened for appending (``open(path, "ab", buffering=0)``), whole or not at
  all: a write that fails partway (a full disk) is cut back off before the
  error propagates, so the file still ends at a row boundary and a later
  append does not glue onto a torn row."""
  start = os.fstat(f.fileno()).st_size
  data = memoryview(line.encode("utf-8"))
  try:
    while data:
      data = data[f.write(data):]
  except BaseException:
    try:
      os.ftruncate(f.fileno(), start)
    except OSError:
      pass          # the resumed run drops the torn line (truncate_metrics)
    raise


def _last_line_start(f, size: int) -> int:
  """The offset just past the last newline of the first ``size`` bytes of
  binary file ``f`` (0 when there is none), read backwards in chunks."""
  end = size
  while end > 0:
    begin = max(0, end - 65536)
    f.seek(begin)
    i = f.read(end - begin).rfind(b"\n")
    if i >= 0:
      return begin + i + 1
    end = begin
  return 0


def end_at_row_boundary(path: str) -> None:
  """Makes metrics file ``path`` end with a newline before rows are
  appended: a last line without one is completed when it holds a whole row,
  else cut off (a write cut short) with a notice on stderr naming it."""
  if not os.path.exists(path):
    return
  with open(path, "r+b") as f:
    size = f.seek(0, os.SEEK_END)
    if size == 0:
      return
    f.seek(size - 1)
    if f.read(1) == b"\n":
      return
    start = _last_line_start(f, size)
    f.seek(start)
    tail = f.read(size - start).decode("utf-8", errors="replace")
    if metric_row(tail) is not None:
      f.seek(size)
      f.write(b"\n")
      return
    f.seek(0)
    number = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b"")) + 1
    f.truncate(start)
  print(bad_lines_notice(path, [number], "dropped"), file=sys.stderr, flush=True)


def resume_metrics(workdir: str, step: int, eval_due: Callable[[int], bool]):
  """Repairs ``metrics.jsonl`` for a run resumed at ``step``
  (``truncate_metrics``) and returns (last_train, last_eval, eval_step,
  eval_pending): the last train metrics ({} if none), the evaluation logged
  at ``step`` ({} if none) and ``step`` or None, and whether that evaluation
  is still due."""
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


def read_config_file(workdir: str) -> dict | None:
  """``workdir``'s config.json as a dict, or None when there is none. Raises
  ConfigError (one line naming the file) when it is unreadable, not JSON or
  not an object."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      recorded = json.load(f)
  except (OSError, ValueError) as e:
    problem = f"is not valid JSON ({e})" if isinstance(e, ValueError) else f"is unreadable ({e})"
  else:
    if isinstance(recorded, dict):
      return recorded
    problem = f"holds a JSON {type(recorded).__name__}, not an object"
  raise ConfigError(f"{path} {problem}: fix it, or delete it (each checkpoint keeps the config "
                    "it was saved with, and the resumed run writes config.json again)")


def _plain(values) -> dict:
  """A config (a Config, or a dict as read from JSON) as the dict its JSON
  holds, with every field of the current schema where it is valid (a file
  written before a field existed compares equal), else as it is."""
  if isinstance(values, Config):
    return json.loads(values.to_json())
  try:
    return json.loads(config_lib.from_dict(values).to_json())
  except (ConfigError, TypeError, ValueError):
    return json.loads(json.dumps(values))


def previous_config(recorded: dict | None, trained: Config | None,
                    step: int) -> tuple[dict | None, str]:
  """(the config a run resumed at ``step`` continues from, a note or ""):
  ``trained`` (the checkpoint's own config) when known, else ``recorded``
  (config.json); when both differ the note names the fields (checkpoint ->
  file)."""
  if trained is None:
    return (None if recorded is None else _plain(recorded)), ""
  saved = _plain(trained)
  edits = [] if recorded is None else config_changes(saved, _plain(recorded))
  if not edits:
    return saved, ""
  return saved, (f"; {CONFIG_FILE} differs from the config checkpoint {step} was saved with "
                 f"(checkpoint -> file: {'; '.join(edits)}): it was edited, or written by a run "
                 "that saved no checkpoint; the checkpoint's config is taken as the previous one")


def record_config(workdir: str, cfg: Config, resume_step: int | None,
                  trained: Config | None = None) -> str:
  """Writes ``cfg`` as ``config.json`` (atomically); a resumed run whose
  previous config (``previous_config``) differs keeps it as
  ``config.until_step<N>.json``. Returns the notes for the resume line, else
  "". Raises ConfigError before writing anything."""
  note = ""
  if resume_step is not None:
    previous, note = previous_config(read_config_file(workdir), trained, resume_step)
    changes = [] if previous is None else config_changes(previous, _plain(cfg))
    if changes:
      kept = f"config.until_step{resume_step}.json"
      write_atomic(os.path.join(workdir, kept), json.dumps(previous, indent=2, sort_keys=True))
      note += (f"; config changed since the last run ({'; '.join(changes)}); the previous "
               f"one is kept as {kept}")
  write_atomic(os.path.join(workdir, CONFIG_FILE), cfg.to_json())
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
  """Writes ``final_metrics.json`` atomically (``write_atomic``)."""
  write_atomic(os.path.join(workdir, FINAL_METRICS_FILE), json.dumps(result, indent=2))


class WorkdirBusyError(RuntimeError):
  """Another training run holds the workdir's lock (the message names it)."""


_HELD: dict[str, list] = {}   # lock file (real path) -> [its open file, holders] in this process


class WorkdirLock:
  """The one-writer lock of a training workdir, ``WORKDIR/train.lock``:
  ``acquire()`` takes an exclusive non-blocking ``fcntl.flock`` and writes
  {"host", "pid", "started"} (UTC ISO 8601); ``release()`` empties the file
  (never deleted) and drops the flock. A file naming a dead process is stale
  and taken over with one ``log`` line. Shared within a process: a second
  lock of the same workdir acquires at once; the last release drops the
  flock. A context manager. Raises WorkdirBusyError from ``acquire`` when
  another process holds the flock or the file names another live process on
  this host."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = os.path.join(workdir, LOCK_FILE)
    self._file = None
    self._key = None

  @property
  def held(self) -> bool:
    return self._file is not None

  def _holder(self, info: dict) -> str:
    return (f"host {info.get('host', '?')}, process id {info.get('pid', '?')}, started "
            f"{info.get('started', '?')}")

  def acquire(self, log: Callable[[str], None] | None = None) -> None:
    if self._file is not None:
      return
    key = os.path.realpath(self.path)
    shared = _HELD.get(key)
    if shared is not None:            # this process holds it already
      shared[1] += 1
      self._file, self._key = shared[0], key
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
            and ckpt_lib.pid_alive(pid)):
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
    self._file, self._key = f, key
    _HELD[key] = [f, 1]

  def release(self) -> None:
    f, self._file = self._file, None
    if f is None:
      return
    shared = _HELD.get(self._key)
    if shared is not None and shared[0] is f:
      shared[1] -= 1
      if shared[1] > 0:
        return
      del _HELD[self._key]
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
