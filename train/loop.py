"""Training loop: jitted, sharded train step with the MTP objective, periodic
validation, metrics (JSONL + TensorBoard), orbax checkpoints and exact resume.

``train(cfg, workdir)`` is the whole job; ``python -m train`` only parses
flags and calls it. Re-running on the same workdir resumes from the latest
checkpoint (parameters, optimizer state, step and data iterator state), so a
killed-and-resumed run reproduces the losses of an uninterrupted one.
SIGTERM/SIGINT save a checkpoint at the next step boundary and return.
What may be resumed and the workdir's files around the loop (config.json,
metrics.jsonl, final_metrics.json) are kept by ``train.workdir``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from mtp import checkpoint as ckpt_lib
from mtp import data as data_lib
from mtp import draft_vocab as draft_vocab_lib
from mtp import loading
from mtp import sharding as shard_lib
from mtp import tokenizer as tok_lib
from mtp.config import Config, ConfigError, MTPConfig, TrainConfig, parse_id_list
from mtp.model import DraftVocab, build_model, count_params
from train import hidden_cache as cache_lib
from train import losses
from train import workdir as workdir_lib


def _as_float32(tree):
  """``tree`` with every floating leaf cast to float32 (others unchanged)."""
  return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating)
                      else x, tree)


def float32_state(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """Runs ``inner`` on float32 copies of the gradients and parameters, so its
  state (Adam's first and second moments) is float32 whatever
  ``model.param_dtype`` is (the usual mixed-precision practice: bf16 moments
  lose the small squared gradients nu accumulates). The updates come back in
  float32; ``optax.apply_updates`` adds them to each parameter and rounds
  once to its dtype. With float32 parameters this is the identity (same
  state, same updates, bitwise)."""

  def init(params):
    return inner.init(_as_float32(params))

  def update(updates, state, params=None):
    return inner.update(_as_float32(updates), state,
                        None if params is None else _as_float32(params))

  return optax.GradientTransformation(init, update)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
  """AdamW with linear warmup + cosine decay and global-norm clipping, with
  float32 optimizer state for any parameter dtype (``float32_state``).
  Weight decay applies to matrices only (not norms' scales)."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=t.learning_rate, warmup_steps=t.warmup_steps,
      decay_steps=max(t.num_steps, t.warmup_steps + 1), end_value=t.learning_rate * t.min_lr_ratio)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return float32_state(optax.chain(
      optax.clip_by_global_norm(t.grad_clip_norm),
      optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask)))


def learning_rate(t: TrainConfig, step: int) -> float:
  """The schedule's learning rate at ``step`` (for logging)."""
  if step < t.warmup_steps:
    return t.learning_rate * step / max(t.warmup_steps, 1)
  frac = min((step - t.warmup_steps) / max(t.num_steps - t.warmup_steps, 1), 1.0)
  end = t.learning_rate * t.min_lr_ratio
  return end + (t.learning_rate - end) * 0.5 * (1 + np.cos(np.pi * frac))


def make_loss_fn(graphdef, loss_weight: float, mtp_cfg: MTPConfig | None = None, *,
                 byte_level: bool = True):
  """(params, batch) -> (loss, head sums); batch holds tokens, positions,
  segment_ids [B, T] int32, optionally loss_mask [B, T] int32 (1 = may be a
  target; ``train.losses.shifted_targets``) and h0 [B, T, D] (the frozen
  backbone's cached output, ``train.hidden_cache``: the model then runs
  ``forward_from_hidden`` and skips the backbone). ``mtp_cfg`` adds
  distillation from the main head and the recursive steps past D
  (``train.losses.mtp_loss``); None = the data-only objective over the
  model's D depths. ``byte_level``: the model's tokenizer is the byte one
  (``model.tokenizer == "byte"``: PAD never a target, bits per byte)."""
  m = mtp_cfg or MTPConfig(loss_weight=loss_weight)

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    steps = m.recursive_steps if model.mtp_depth else 0
    if "h0" in batch:
      # with V' every head runs over V' only (ModelOutput.compact_ids): the same
      # module gradients as the full form, without the full-vocabulary logits
      h0, lower = model.split_hidden(batch["h0"])     # [h^(l); h^0] with mtp.feature_layers
      out = model.forward_from_hidden(batch["tokens"], batch["positions"], batch["segment_ids"],
                                      h0, recursive_steps=steps,
                                      compact=bool(model.draft_vocab_size), lower=lower)
    else:
      out = model(batch["tokens"], batch["positions"], batch["segment_ids"], recursive_steps=steps)
    lse = None
    if out.compact_ids is not None and m.distill_weight and m.distill_divergence != "kl":
      # the exact TV over the full vocabulary needs the frozen teacher's full
      # normaliser (losses.teacher_tv): one full-vocabulary head pass, no gradient
      lse = losses.full_logsumexp(model.head(out.hidden[0]), m.distill_temperature)
    return losses.mtp_loss(out, batch["tokens"], batch["segment_ids"], loss_weight,
                           depth=model.mtp_depth, distill_weight=m.distill_weight,
                           distill_temperature=m.distill_temperature,
                           distill_divergence=m.distill_divergence, tv_weight=m.tv_weight,
                           teacher_logsumexp=lse,
                           loss_mask=batch.get("loss_mask"), byte_level=byte_level)
  return loss_fn


# Parameters trained with train.freeze_backbone: the MTP modules' own (nnx paths
# mtp/<k>/...); the embedding E and the head W_out they share stay frozen.
MTP_PARAMS = nnx.PathContains("mtp")


def split_trainable(cfg: Config, params):
  """(trainable, frozen) nnx States of a full parameter State: with
  ``train.freeze_backbone`` the MTP modules' parameters and the rest;
  otherwise (params, None), or (all but the draft vocabulary, the draft
  vocabulary) when the model has one (``mtp.model.DraftVocab``: ids, no
  gradient)."""
  if not cfg.train.freeze_backbone:
    if cfg.mtp.draft_vocab_size:     # issue 22 item 3: the draft vocabulary's ids are never trained
      return nnx.split_state(params, nnx.Not(DraftVocab), ...)
    return params, None
  return nnx.split_state(params, MTP_PARAMS, ...)    # (DraftVocab is not under mtp/: frozen)


def cached_backbone(cfg: Config, params):
  """The frozen parameters that decide the cached h^0 (``train.hidden_cache``):
  ``split_trainable``'s frozen part without the draft vocabulary, which no
  hidden state reads (stages with another V' share one cache)."""
  frozen = split_trainable(cfg, params)[1]
  if cfg.mtp.draft_vocab_size:
    frozen = nnx.split_state(frozen, nnx.Not(DraftVocab), ...)[0]
  return frozen


@dataclasses.dataclass
class TrainState:
  params: Any
  opt_state: Any
  step: int


def run_tokenizer(cfg: Config, workdir: str, resumed: bool):
  """The tokenizer of a run: the one saved in ``workdir`` when resuming
  (``mtp.tokenizer.save_tokenizer`` at the start), else
  ``train.init_from``'s (``load_tokenizer``: the byte tokenizer when it has
  no ``tokenizer/``), else the byte tokenizer.

  Raises ConfigError when it disagrees with ``model.tokenizer`` (kind) or
  ``model.num_tokens`` (a BPE tokenizer's vocabulary), naming both; the
  tokenizer's TokenizerError for an unreadable one."""
  m = cfg.model
  if resumed and os.path.isdir(os.path.join(workdir, tok_lib.TOKENIZER_DIR)):
    where, tk = f"--workdir={workdir!r}", tok_lib.load_tokenizer(workdir)
  elif cfg.train.init_from:
    where, tk = f"train.init_from={cfg.train.init_from!r}", tok_lib.load_tokenizer(cfg.train.init_from)
  else:
    where, tk = "the default (no train.init_from)", tok_lib.ByteTokenizer()
  kind = tk.to_dict()["kind"]
  if kind != m.tokenizer:
    raise ConfigError(f"model.tokenizer={m.tokenizer!r} but the tokenizer of {where} is {kind!r}"
                      + ("" if cfg.train.init_from else "; a BPE model trains from an imported "
                         "workdir: set train.init_from (python -m mtp.importers)"))
  if kind != "byte" and tk.vocab_size != m.num_tokens:
    raise ConfigError(f"model.num_tokens={m.num_tokens} but the tokenizer of {where} has "
                      f"{tk.vocab_size} ids")
  return tk


def _init_has_draft_vocab(cfg: Config, init_step: int | None) -> bool:
  """Whether ``train.init_from`` brings this run's draft vocabulary V' (one of
  the same size; another size is chosen again from this run's data)."""
  if init_step is None:
    return False
  saved, _ = loading.load_config(cfg.train.init_from)
  return saved.mtp.draft_vocab_size == cfg.mtp.draft_vocab_size


def select_draft_vocab(cfg: Config, counts, tokenizer, size: int) -> np.ndarray:
  """The rule of ``attach_draft_vocab``: the ``size`` most frequent ids of
  ``counts`` ([V] int, ``mtp.draft_vocab.token_counts`` of the train rows'
  targets) among those the head may emit (``tokenizer.head_mask``), the
  tokenizer's stop ids always in. Returns [size] int32, sorted; the sets of
  two sizes are nested. Raises ValueError as ``mtp.draft_vocab.select``."""
  return draft_vocab_lib.select(counts, size, always=tuple(getattr(tokenizer, "stop_ids", ())),
                                allowed=tok_lib.head_mask(cfg.model))


def attach_draft_vocab(cfg: Config, params, rows: dict[str, np.ndarray], tokenizer):
  """Chooses V' (``mtp.draft_vocab_size`` ids) for a run that starts without
  one: the most frequent target ids of the train split's rows (tokens /
  loss_mask [N, T] int32, ``mtp.data.epoch_rows``; only loss_mask == 1
  positions count, i.e. the answers of a chat dataset), among the ids the
  head may emit (``tokenizer.head_mask``), with the tokenizer's stop ids
  always in (a draft can end an answer). Returns (params with V' set,
  a log line giving the share of target tokens V' covers)."""
  counts = draft_vocab_lib.token_counts(rows["tokens"], rows.get("loss_mask"),
                                        vocab_size=cfg.model.vocab_size)
  ids = select_draft_vocab(cfg, counts, tokenizer, cfg.mtp.draft_vocab_size)
  covered = counts[ids].sum() / max(int(counts.sum()), 1)
  note = (f"draft vocabulary V': {len(ids):,} most frequent of {int((counts > 0).sum()):,} ids "
          f"seen in {int(counts.sum()):,} target tokens; covers {covered:.1%} of them")
  return draft_vocab_lib.with_draft_vocab(params, ids), note


class Trainer:
  """Holds the compiled steps for one config on one mesh.

  Build with ``Trainer(cfg)``; ``init_state()`` makes fresh sharded state
  (``init_state(params)`` starts from given parameters, e.g. another
  workdir's); ``train_step(state, batch)`` and ``eval_sums(params, batches)``
  run the jitted computations. Tests and scripts use it directly.

  With ``train.freeze_backbone`` only the MTP modules' parameters
  (``MTP_PARAMS``) are differentiated and have optimizer state; the backbone,
  the embedding and the head enter the step as constants and leave it
  bitwise unchanged. ``TrainState.params`` is always the full parameter
  State and ``opt_state`` covers only the trained part, so checkpoints of a
  frozen run hold the full model and a small optimizer state.
  """

  def __init__(self, cfg: Config, mesh=None):
    self.cfg = cfg
    self.mesh = mesh or shard_lib.make_mesh(cfg.mesh)
    shard_lib.check_batch(cfg.train.batch_size, self.mesh)
    shard_lib.check_mesh(cfg.model, self.mesh)
    self.tx = make_optimizer(cfg.train)
    abstract_model = nnx.eval_shape(lambda: build_model(cfg, cfg.train.seed))
    self.graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
    self.param_shardings = shard_lib.param_shardings(self.mesh, abstract_params)
    abstract_opt = jax.eval_shape(self.tx.init, split_trainable(cfg, abstract_params)[0])
    self.opt_shardings = shard_lib.state_shardings(self.mesh, abstract_opt)   # mu/nu like params
    batch_sharding = shard_lib.batch_sharding(self.mesh)
    replicated = shard_lib.replicated(self.mesh)
    loss_fn = make_loss_fn(self.graphdef, cfg.mtp.loss_weight, cfg.mtp,
                           byte_level=cfg.model.tokenizer == "byte")
    graphdef = self.graphdef
    tx = self.tx

    def step_fn(params, opt_state, batch):
      trainable, frozen = split_trainable(cfg, params)
      if frozen is None:
        f = loss_fn
      else:   # gradients of the MTP modules only; the rest is a constant of the step
        f = lambda p, b: loss_fn(nnx.merge_state(p, frozen), b)
      (loss, sums), grads = jax.value_and_grad(f, has_aux=True)(trainable, batch)
      updates, opt_state = tx.update(grads, opt_state, trainable)
      trainable = optax.apply_updates(trainable, updates)
      params = trainable if frozen is None else nnx.merge_state(trainable, frozen)
      return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "sums": sums}

    def eval_fn(params, batch):
      return loss_fn(params, batch)[1]

    def hidden_fn(params, batch):
      model = nnx.merge(graphdef, params)
      return model.backbone_hidden(batch["tokens"], batch["positions"], batch["segment_ids"])

    def init_fn():
      params = nnx.state(build_model(cfg, cfg.train.seed), nnx.Param)
      return params, tx.init(split_trainable(cfg, params)[0])

    def init_from_fn(params):
      return params, tx.init(split_trainable(cfg, params)[0])

    self._step = jax.jit(step_fn, in_shardings=(self.param_shardings, self.opt_shardings, batch_sharding),
                         out_shardings=(self.param_shardings, self.opt_shardings, replicated),
                         donate_argnums=(0, 1))
    self._eval = jax.jit(eval_fn, in_shardings=(self.param_shardings, batch_sharding),
                         out_shardings=replicated)
    self._hidden = jax.jit(hidden_fn, in_shardings=(self.param_shardings, batch_sharding),
                           out_shardings=batch_sharding)
    self._init = jax.jit(init_fn, out_shardings=(self.param_shardings, self.opt_shardings))
    self._init_from = jax.jit(init_from_fn, in_shardings=(self.param_shardings,),
                              out_shardings=(self.param_shardings, self.opt_shardings))
    self.abstract_params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_params,
        self.param_shardings)
    self.abstract_opt_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_opt,
        self.opt_shardings)

  def init_state(self, params=None) -> TrainState:
    """Step-0 state: fresh parameters from ``train.seed``, or a copy of
    ``params`` (a full parameter State of this architecture, e.g. restored
    with ``train.workdir.restore_init_params``); the optimizer state is always fresh."""
    params, opt_state = self._init() if params is None else self._init_from(params)
    return TrainState(params, opt_state, 0)

  def train_step(self, state: TrainState, local_batch: dict[str, np.ndarray]):
    batch = shard_lib.global_batch(local_batch, self.mesh)
    params, opt_state, metrics = self._step(state.params, state.opt_state, batch)
    return TrainState(params, opt_state, state.step + 1), metrics

  def eval_sums(self, params, local_batches) -> dict[str, dict[str, float]]:
    total = None
    for local in local_batches:
      sums = self._eval(params, shard_lib.global_batch(local, self.mesh))
      total = sums if total is None else jax.tree.map(jnp.add, total, sums)
    return jax.tree.map(float, jax.device_get(total))

  def model(self, params):
    return nnx.merge(self.graphdef, params)

  def hidden_states(self, params, local_batch: dict[str, np.ndarray]) -> np.ndarray:
    """The backbone's h^0 [B, T, D] (activation dtype, numpy) of a batch of
    tokens, positions, segment_ids int32 [B, T], [B, T, (m + 1) D] with the
    m ``mtp.feature_layers`` (``Transformer.backbone_hidden``; one jitted
    program per shape; ``train.hidden_cache`` builds its cache with it)."""
    h = self._hidden(params, shard_lib.global_batch(local_batch, self.mesh))
    return np.asarray(jax.device_get(h))


class MetricWriter:
  """Appends metrics to WORKDIR/metrics.jsonl and TensorBoard event files
  (process 0 only). A resumed run appends; for a step logged twice (steps
  after the last checkpoint of a killed run), the later line wins. Each
  row is appended whole or not at all (``train.workdir.append_line``), and
  a torn last line left by an earlier run is cut off before the first one
  (``end_at_row_boundary``), so no row is glued onto a torn one."""

  def __init__(self, workdir: str, enabled: bool):
    self.enabled = enabled
    self._tb = None
    if enabled:
      path = os.path.join(workdir, workdir_lib.METRICS_FILE)
      workdir_lib.end_at_row_boundary(path)
      self._jsonl = open(path, "ab", buffering=0)
      try:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
      except ImportError:  # optional
        self._tb = None

  def write(self, step: int, split: str, metrics: dict[str, float]):
    if not self.enabled:
      return
    row = json.dumps({"step": step, "split": split, **metrics})
    workdir_lib.append_line(self._jsonl, row + "\n")
    if self._tb is not None:
      for k, v in metrics.items():
        self._tb.add_scalar(f"{split}/{k}", v, step)

  def close(self):
    if self.enabled:
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()


class DivergedError(RuntimeError):
  """The training loss became NaN or infinite."""


def _duration(seconds: float) -> str:
  """``3h02m05s``, ``2m05s`` or ``12s``."""
  s = int(round(max(seconds, 0.0)))
  h, m, s = s // 3600, s // 60 % 60, s % 60
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class _Interrupted(Exception):
  """Raised inside an evaluation when a stop signal arrived."""


class _StopFlag:
  """Turns SIGTERM/SIGINT into a flag. ``train`` checks it at step
  boundaries and between evaluation batches: a train step, an evaluation
  batch or a checkpoint save in progress finishes first."""

  def __init__(self):
    self.signum = None
    self._old = {}

  def __enter__(self):
    for s in (signal.SIGTERM, signal.SIGINT):
      try:
        self._old[s] = signal.signal(s, self._handle)
      except ValueError:  # not in the main thread
        pass
    return self

  def _handle(self, signum, frame):
    self.signum = signum

  def check(self):
    """Raises ``_Interrupted`` once a signal has arrived."""
    if self.signum is not None:
      raise _Interrupted

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


def _from_process_0(flag: bool) -> bool:
  """Process 0's ``flag`` on every process (multi-host: one decision)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils
  return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


@dataclasses.dataclass(frozen=True)
class TrainResult:
  """What ``train`` returns; ``as_dict()`` is the layout of
  ``final_metrics.json``."""
  step: int                        # the global step the run stopped at
  train: dict[str, float] = dataclasses.field(default_factory=dict)   # last train-metrics row
  eval: dict[str, float] = dataclasses.field(default_factory=dict)    # validation at ``step``
  step_time_s: float | None = None  # median s/step after the first (compiling) log window
  params: dict[str, int] = dataclasses.field(default_factory=dict)    # total, backbone, mtp
  interrupted: bool = False        # a signal or the deadline stopped it with work left
  signal: int | None = None        # that signal's number, else None
  deadline_reached: bool = False   # the deadline (not a signal) stopped it

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> TrainResult:
    """From ``as_dict()``'s layout (a final_metrics.json, also one written
    before a field existed: missing fields take their defaults; unknown keys
    are ignored)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


def train(cfg: Config, workdir: str, *, log: Callable[[str], None] | None = None,
          stop_after: int | None = None, deadline: float | None = None) -> TrainResult:
  """Trains ``cfg`` in ``workdir`` to ``train.num_steps``, resuming from its
  latest checkpoint; a finished run is returned unchanged. Per step: a
  metrics row every ``log_every``, an evaluation every ``eval_every`` and
  at the end, a checkpoint every ``checkpoint.every_steps`` and at the end;
  ``final_metrics.json`` only after the final evaluation. SIGTERM/SIGINT,
  ``stop_after`` (a global step) and ``deadline`` (a ``time.monotonic()``
  value, checked at log steps; all processes or none) stop with a
  checkpoint and ``interrupted`` set; re-running does exactly what is left.
  ``log`` prints lines (default ``tqdm.write``). Process 0 holds
  ``WORKDIR/train.lock`` while it runs. docs/training.md has the details.

  Raises: ConfigError (also when parameters and logits alone exceed memory),
  DataError, CheckpointError (all before anything is written);
  WorkdirBusyError (another run holds the lock); DivergedError (NaN/inf loss).
  """
  lock = workdir_lib.WorkdirLock(workdir)
  try:
    return _train(cfg, workdir, lock, log=log, stop_after=stop_after, deadline=deadline)
  finally:
    lock.release()


def _eval_due(t: TrainConfig, step: int) -> bool:
  """Whether step ``step`` ends with an evaluation (every ``train.eval_every``
  steps and at or past ``train.num_steps``)."""
  return step >= t.num_steps or step % t.eval_every == 0


def _open_data(cfg: Config, workdir: str, tokenizer, resume_step: int | None):
  """The run's data, opened before anything is written (a bad dataset stops
  the run there). Returns ``(dataset, eval_batches, rows_fn, train_rows)``:
  ``dataset`` the grain train dataset (None for ``train.hidden_cache``, whose
  rows come from ``rows_fn()``), ``train_rows`` the checked rows when a new
  hidden cache will be built from them (else None).

  Raises:
    ConfigError: ``train.hidden_cache`` on more than one process.
  """
  t = cfg.train
  data_kw = {} if cfg.model.tokenizer == "byte" else {"tokenizer": tokenizer}   # None = bytes
  rows_fn = lambda: data_lib.epoch_rows(cfg.data, seq_len=t.seq_len, split=cfg.data.train_split,
                                        **data_kw)
  train_rows = None
  if t.hidden_cache:
    if jax.process_count() != 1:
      raise ConfigError(f"train.hidden_cache=True runs on one process (got "
                        f"{jax.process_count()}); set it False for multi-host runs")
    # a shared cache's folder is keyed by the rows (read on resume too)
    if t.hidden_cache_dir or (resume_step is None
                              and cache_lib.load(cache_lib.cache_dir(workdir)) is None):
      train_rows = cache_lib.check_rows(rows_fn(), t.seq_len, cfg.model.vocab_size)
    dataset = None
  else:
    dataset = data_lib.make_train_dataset(
        cfg.data, seq_len=t.seq_len, batch_size=t.batch_size, seed=t.seed,
        process_index=jax.process_index(), process_count=jax.process_count(), **data_kw)
  eval_batches = data_lib.make_eval_batches(
      cfg.data, seq_len=t.seq_len, batch_size=t.batch_size, num_batches=t.eval_batches,
      process_index=jax.process_index(), process_count=jax.process_count(), **data_kw)
  return dataset, eval_batches, rows_fn, train_rows


def _start_state(cfg: Config, trainer: Trainer, ckpt, data_iter, resume_step: int | None,
                 init_step: int | None, init_params, log) -> tuple[TrainState, str]:
  """The state the loop starts from: restored from ``ckpt`` at
  ``resume_step`` (``data_iter`` restored with it; ``ckpt`` closed when that
  fails), copied from ``init_params`` (``train.init_from``), or fresh.
  Returns it and the resume line ("" when not resuming)."""
  if resume_step is not None:
    try:
      params, opt_state = ckpt.restore(resume_step, trainer.abstract_params,
                                       trainer.abstract_opt_state, data_iter)
    except BaseException:
      ckpt.close()
      raise
    return TrainState(params, opt_state, resume_step), f"resumed from {ckpt.directory}/{resume_step}"
  if init_step is not None:
    state = trainer.init_state(init_params)
    log(f"initialised parameters from {cfg.train.init_from} (step {init_step})")
    return state, ""
  return trainer.init_state(), ""


def _attach_hidden_cache(cfg: Config, workdir: str, trainer: Trainer, state: TrainState,
                         tokenizer, data_iter, rows_fn, train_rows, log) -> None:
  """Builds or loads the frozen backbone's h^0 cache (``train.hidden_cache``)
  and attaches it to ``data_iter`` (a ``CacheIterator``)."""
  t = cfg.train
  source = cache_lib.source_fingerprint(cfg, tokenizer, cached_backbone(cfg, state.params))
  get_rows = (lambda: train_rows) if train_rows is not None else (
      lambda: cache_lib.check_rows(rows_fn(), t.seq_len, cfg.model.vocab_size))
  folder = cache_lib.cache_folder(workdir, t.hidden_cache_dir, source,
                                  get_rows() if t.hidden_cache_dir else None)
  cache = cache_lib.prepare(
      folder, source, get_rows, lambda b: trainer.hidden_states(state.params, b),
      batch_size=t.batch_size, dtype=cfg.model.dtype,
      d_model=cfg.model.d_model * (1 + len(parse_id_list(cfg.mtp.feature_layers))),
      vocab_size=cfg.model.vocab_size, log=log)
  data_iter.attach(cache)


def _eval_line(cfg: Config, step: int, metrics: dict[str, float]) -> str:
  """The log line of an evaluation at ``step``: main loss, bits per byte
  (nats per token without a byte count), accuracy, and every depth's
  accuracy, teacher agreement and teacher KL."""
  depth_acc = " ".join(f"acc{k}={metrics[f'mtp_{k}/accuracy']:.3f}"
                       f" agree{k}={metrics[f'mtp_{k}/teacher_agreement']:.3f}"
                       f" kl{k}={metrics[f'mtp_{k}/teacher_kl']:.3f}"
                       for k in range(1, cfg.mtp.depth + cfg.mtp.recursive_steps + 1))
  rate = (f"bpb {metrics['main/bits_per_byte']:.4f}" if "main/bits_per_byte" in metrics
          else f"nats/token {metrics['main/loss']:.4f}")
  return (f"step {step}: eval loss {metrics['main/loss']:.4f} "
          f"{rate} acc {metrics['main/accuracy']:.3f} {depth_acc}")


@dataclasses.dataclass
class _Records:
  """What the loop reports: the last train metrics row, the last evaluation
  and its step, and the timed log windows' seconds per step."""
  last_train: dict = dataclasses.field(default_factory=dict)
  last_eval: dict = dataclasses.field(default_factory=dict)
  eval_step: int | None = None
  step_times: list = dataclasses.field(default_factory=list)


class _LogClock:
  """Step timing by log window (seconds, ``time.perf_counter``). The first
  window includes compilation and is not timed; every later one adds its
  seconds per step to ``step_times``. Evaluation and checkpoint time stays
  out of the windows."""

  def __init__(self, step_times: list):
    self.step_times = step_times
    self.start = time.perf_counter()
    self.warm_start = self.warm_steps = None
    self.window_start, self.window_steps, self.done_steps = self.start, 0, 0

  def tick(self):
    self.window_steps += 1
    self.done_steps += 1

  def close_window(self) -> tuple[float, float]:
    """Ends the current window; returns (now, its elapsed seconds)."""
    now = time.perf_counter()
    elapsed = now - self.window_start
    if self.warm_start is not None:   # the first window includes compilation
      self.step_times.append(elapsed / self.window_steps)
    else:
      self.warm_start, self.warm_steps = now, self.done_steps
    return now, elapsed

  def progress(self, now: float, elapsed: float, step: int, num_steps: int,
               row: dict[str, float]) -> str:
    """The no-progress-bar line: step, loss, tokens/s, elapsed, remaining."""
    timed = self.done_steps - self.warm_steps
    per_step = (now - self.warm_start) / timed if timed else elapsed / self.window_steps
    return (f"step {step}/{num_steps}: loss {row['loss']:.4f}, "
            f"{row['tokens_per_s']:,.0f} tokens/s{'' if timed else ' (compiling)'}, "
            f"elapsed {_duration(now - self.start)}, "
            f"remaining ~{_duration(per_step * (num_steps - step))}")

  def next_window(self):
    self.window_start, self.window_steps = time.perf_counter(), 0

  def resume_if_idle(self):
    if self.window_steps == 0:   # eval/checkpoint time stays out of the step time
      self.window_start = time.perf_counter()


def _train_row(t: TrainConfig, step: int, host, window_steps: int, elapsed: float) -> dict:
  """The train metrics row of a log window ending at ``step`` from the
  step's host metrics.

  Raises:
    DivergedError: the loss is NaN or infinite.
  """
  row = {"loss": float(host["loss"]), "grad_norm": float(host["grad_norm"]),
         "learning_rate": float(learning_rate(t, step - 1)),
         "tokens_per_s": window_steps * t.batch_size * t.seq_len / elapsed,
         **losses.summarize(host["sums"])}
  if not np.isfinite(row["loss"]):
    raise DivergedError(f"training loss is {row['loss']} at step {step}; no "
                        "checkpoint written for it (lower train.learning_rate or raise "
                        "train.warmup_steps; the run resumes from the last checkpoint)")
  return row


def _evaluate(cfg: Config, trainer: Trainer, state: TrainState, eval_batches, writer,
              rec: _Records, stop: _StopFlag, log) -> None:
  """Evaluates ``state`` into ``rec`` and the metrics; on a signal between
  batches, abandons (nothing written)."""
  def batches():
    for b in eval_batches:
      stop.check()
      yield b
  try:
    metrics = losses.summarize(trainer.eval_sums(state.params, batches()))
  except _Interrupted:
    log(f"signal {stop.signum}: evaluation at step {state.step} abandoned (it runs when the "
        "same command is re-run)")
    return
  writer.write(state.step, "eval", metrics)
  rec.last_eval, rec.eval_step = metrics, state.step
  log(_eval_line(cfg, state.step, metrics))


def _loop(cfg: Config, workdir: str, trainer: Trainer, state: TrainState, data_iter, ckpt,
          writer, eval_batches, rec: _Records, counts, *, eval_pending: bool, target: int,
          is_main: bool, log, deadline: float | None = None) -> TrainResult:
  """Steps from ``state`` to ``target`` (or a signal), with the log rows,
  evaluations and checkpoints ``train`` describes; returns ``train``'s
  result (written as final_metrics.json when complete)."""
  t = cfg.train

  def save():
    ckpt.save(state.step, state.params, state.opt_state, data_iter, cfg)

  with _StopFlag() as stop, tqdm(total=t.num_steps, initial=state.step,
                                  disable=None if is_main else True, dynamic_ncols=True,
                                  file=sys.stderr) as bar:
    evaluate = lambda: _evaluate(cfg, trainer, state, eval_batches, writer, rec, stop, log)
    if eval_pending:
      evaluate()
    clock = _LogClock(rec.step_times)
    out_of_time = False
    while state.step < target and stop.signum is None and not out_of_time:
      state, metrics = trainer.train_step(state, next(data_iter))
      clock.tick()
      if state.step % t.log_every == 0 or state.step == target:
        host = jax.device_get(metrics)   # the only host sync in the loop
        if deadline is not None and state.step < target:
          out_of_time = _from_process_0(time.monotonic() >= deadline)
        now, elapsed = clock.close_window()
        rec.last_train = _train_row(t, state.step, host, clock.window_steps, elapsed)
        writer.write(state.step, "train", rec.last_train)
        bar.set_postfix(loss=f"{rec.last_train['loss']:.3f}")
        if bar.disable:   # no bar (stderr is not a terminal): one line per log window
          log(clock.progress(now, elapsed, state.step, t.num_steps, rec.last_train))
        clock.next_window()
      bar.update(1)
      if _eval_due(t, state.step):
        evaluate()
      if state.step % cfg.checkpoint.every_steps == 0:
        save()
      clock.resume_if_idle()
    if ckpt.latest_step() != state.step:
      save()
    complete = state.step >= t.num_steps and rec.eval_step == state.step
    interrupted = (stop.signum is not None or out_of_time) and not complete
    if interrupted:
      why = f"signal {stop.signum}" if stop.signum is not None else "deadline reached"
      log(f"{why}: checkpoint saved at step {state.step}; exiting (re-run the "
          "same command to finish the run)")
    result = TrainResult(
        step=state.step, train=rec.last_train,
        eval=rec.last_eval if rec.eval_step == state.step else {},
        step_time_s=float(np.median(rec.step_times)) if rec.step_times else None,
        params=counts, interrupted=interrupted,
        signal=stop.signum if interrupted else None,
        deadline_reached=interrupted and out_of_time)
    if is_main and complete:
      workdir_lib.write_final_metrics(workdir, result.as_dict())
  return result


def _train(cfg: Config, workdir: str, lock, *, log, stop_after, deadline) -> TrainResult:
  """``train``'s body; takes ``lock`` (process 0) before anything is read
  from an existing workdir, or before a new one is created."""
  workdir_lib.check_memory_floor(cfg)   # before the lock: a refused run touches nothing
  is_main = jax.process_index() == 0
  log = log or (lambda s: tqdm.write(s, file=sys.stderr))
  if not is_main:   # multi-host: one process prints and writes files
    log = lambda s: None
  if is_main and os.path.isdir(workdir):   # one writer: a second run stops here
    lock.acquire(log)
  resume_step, trained = workdir_lib.resume_point(cfg, workdir)
  init_step = workdir_lib.check_init_from(cfg) if resume_step is None else None
  t = cfg.train
  if resume_step is not None and resume_step >= t.num_steps:
    done = workdir_lib.finished_result(workdir, resume_step)
    if done is not None:
      log(f"{workdir} already finished at step {resume_step} (train.num_steps={t.num_steps}); "
          "nothing to do (raise train.num_steps to continue)")
      return TrainResult.from_dict(done)
  if resume_step is not None:
    workdir_lib.read_config_file(workdir)   # a damaged config.json stops here, nothing written
  tokenizer = run_tokenizer(cfg, workdir, resume_step is not None)
  dataset, eval_batches, rows_fn, train_rows = _open_data(cfg, workdir, tokenizer, resume_step)
  trainer = Trainer(cfg)
  init_params = None
  if init_step is not None:   # read (and verified) before anything is written
    init_params = workdir_lib.restore_init_params(trainer.abstract_params, t.init_from, init_step)

  os.makedirs(workdir, exist_ok=True)
  if is_main:
    lock.acquire(log)     # a new workdir: validated first, so a bad run writes nothing
  if is_main and cfg.model.tokenizer != "byte" and resume_step is None:
    tok_lib.save_tokenizer(tokenizer, workdir)   # decoding this workdir finds it
  ckpt = ckpt_lib.Checkpointer(workdir, keep=cfg.checkpoint.keep)
  data_iter = cache_lib.CacheIterator(t.batch_size, t.seed) if dataset is None else iter(dataset)
  state, resumed = _start_state(cfg, trainer, ckpt, data_iter, resume_step, init_step,
                                init_params, log)
  if resume_step is None and cfg.mtp.draft_vocab_size and not _init_has_draft_vocab(cfg, init_step):
    rows = train_rows if train_rows is not None else rows_fn()
    params, note = attach_draft_vocab(cfg, state.params, rows, tokenizer)
    state = TrainState(params, state.opt_state, state.step)
    log(note)
  if t.hidden_cache:
    try:
      _attach_hidden_cache(cfg, workdir, trainer, state, tokenizer, data_iter, rows_fn,
                           train_rows, log)
    except BaseException:
      ckpt.close()
      raise
  rec = _Records()
  eval_pending = False   # the checkpointed step's evaluation was abandoned by a signal
  if is_main:
    if resume_step is not None:
      rec.last_train, rec.last_eval, rec.eval_step, eval_pending = workdir_lib.resume_metrics(
          workdir, resume_step, lambda step: _eval_due(t, step))
    resumed += workdir_lib.record_config(workdir, cfg, resume_step, trained)
  if resume_step is not None:
    log(resumed)
    eval_pending = _from_process_0(eval_pending)
  counts = count_params(trainer.model(state.params))
  writer = MetricWriter(workdir, is_main)
  if resume_step is None:
    log(f"params: total {counts['total']:,} (backbone {counts['backbone']:,}, "
        f"MTP modules {counts['mtp']:,}); devices {jax.device_count()} mesh {dict(trainer.mesh.shape)}")
  target = t.num_steps if stop_after is None else min(t.num_steps, stop_after)
  try:
    return _loop(cfg, workdir, trainer, state, data_iter, ckpt, writer, eval_batches, rec, counts,
                 eval_pending=eval_pending, target=target, is_main=is_main, log=log,
                 deadline=deadline)
  finally:
    ckpt.close()
    writer.close()
