"""Typed, validated configuration schema (one place for every field).

Config files in ``configs/`` are ``ml_collections.ConfigDict`` objects (so the
CLI accepts Flax-style overrides such as ``--config.model.num_layers=4``);
``from_dict`` turns one into the frozen dataclasses below and ``validate``
checks every field once, before anything is built. Errors are
``ConfigError`` (a ``ValueError``) naming the dotted field and the allowed
range.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any, get_type_hints

from mtp import tokenizer as tok


class ConfigError(ValueError):
  """A config value is unknown, of the wrong type or out of range."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 264           # padded; ids >= tokenizer.VOCAB_SIZE are masked
  d_model: int = 128
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2           # GQA: num_heads % num_kv_heads == 0
  head_dim: int = 32
  mlp_dim: int = 384              # SwiGLU hidden width F
  max_seq_len: int = 1024         # longest position a KV cache / RoPE serves
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  dtype: str = "float32"          # activation dtype
  param_dtype: str = "float32"
  # Which ids the head may emit (mtp.tokenizer.head_mask). "byte": the byte
  # tokenizer's rules (padding >= 259, PAD, BOS, invalid UTF-8 bytes never
  # emitted). "bpe": the workdir's tokenizer/ (mtp.bpe); ids >= num_tokens
  # (vocabulary padding) and the ids in never_emitted get -inf.
  tokenizer: str = "byte"
  num_tokens: int = 0             # the tokenizer's real vocabulary size; 0 with tokenizer="byte"
  never_emitted: str = ""         # comma-separated ids < num_tokens never emitted (tokenizer="bpe")
  # Attention over a KV cache (decoding; training never uses a cache), see
  # mtp.model.cached_attention: "blockwise" reads only the cache blocks that
  # can be visible (online softmax, cost follows the filled length; a loop
  # whose trip count is traced, so on an accelerator each block of each
  # layer waits on the host), "dense" masks every slot (no loop, static
  # work), "cudnn" is jax.nn.dot_product_attention's cuDNN kernel over every
  # slot (NVIDIA GPU, bfloat16/float16 only). "auto" picks per backend and
  # dtype when traced (mtp.model.resolve_attention_impl): "blockwise" on the
  # CPU, where it measured fastest; "cudnn" on an NVIDIA GPU (compute
  # capability >= 8.0) for a bfloat16/float16 model; "dense" elsewhere. A
  # config without the field (from_dict: a Hugging Face config.json, a new
  # import) gets "auto"; one that names a value keeps it (checkpoints saved
  # before "auto" existed store "blockwise").
  attention_impl: str = "auto"
  # cache slots per block of "blockwise" (and of "auto" on the CPU; results/bench_cache_length.md)
  attention_block_size: int = 128
  # jax.lax.Precision of every matmul of the model's forward (mtp.model: the
  # linear layers, the attention's score and value products, the heads).
  # "highest": float32 operands are multiplied in full float32 on every
  # backend (by default NVIDIA GPUs use TF32 and TPUs bfloat16 passes, so
  # greedy float32 output can change with the KV-cache size or the attention
  # implementation, and greedy MTP stops equalling greedy AR); bfloat16 and
  # float16 operands are already 16-bit, so for such models it changes
  # nothing. "high": TF32-like on GPU, 3 bfloat16 passes on TPU. "default":
  # JAX's choice (the jax_default_matmul_precision flag; unset, the
  # backend's fastest). XLA's CPU computes float32 matmuls in float32 always.
  matmul_precision: str = "highest"


@dataclasses.dataclass(frozen=True)
class MTPConfig:
  depth: int = 1                  # D, number of sequential MTP modules (0 = plain LM)
  loss_weight: float = 0.3        # lambda in L = L_main + lambda/D * sum_k L^k
  # Distillation from the main head (train/losses.py): per depth k the loss is
  # (1 - w) * CE(t_{i+k+1}) + w * tau^2 * KL(p_main(.|x_<=i+k) || q_k(.|i)) at temperature tau.
  distill_weight: float = 0.0     # w in [0, 1]: 0 = data only (default), 1 = teacher only
  distill_temperature: float = 1.0  # tau > 0, applied to teacher and module logits (Hinton et al.)
  # "kl": forward KL(p_main || q_k); "tv": total variation TV = 1 - acceptance (Leviathan et al.),
  # exact over the full vocabulary also with draft_vocab_size; "mix": (1 - tv_weight) KL + tv_weight TV.
  distill_divergence: str = "kl"
  tv_weight: float = 0.5          # a in [0, 1], the TV share of distill_divergence="mix" (else unused)
  recursive_steps: int = 0        # R: also train module D on its own outputs for steps D+1..D+R
  # Reduced draft vocabulary V' (FastMTP's compressed draft vocabulary; mtp/draft_vocab.py):
  # the MTP heads score only these many ids (the model's ``draft_vocab``, saved with the
  # checkpoint), q = 0 outside them; verification stays exact. 0 = the full vocabulary.
  draft_vocab_size: int = 0
  # Lower-layer features for module 1 (an option beyond DeepSeek-V3 eq. 21, after
  # EAGLE-3's fusion of low, middle and high features; mtp.model.FeatureFuse):
  # comma-separated 0-based backbone block indices in [0, model.num_layers - 2]
  # whose outputs, RMS-normalised, are projected together with h^0 into module
  # 1's hidden input. "" = eq. 21 as written (module 1 reads h^0 only).
  feature_layers: str = ""


@dataclasses.dataclass(frozen=True)
class DataConfig:
  name: str = "python_stdlib"     # python_stdlib | python_docs | text_files | a local TFDS dataset
                                  # | a mixture "a+b" (mtp.data.sources: read one after another)
  files: str = ""                 # text_files: comma-separated glob patterns ('**' recursive)
  text_feature: str = "text"      # feature holding the text for other TFDS datasets
  data_dir: str = ""              # TFDS data dir; "" = $MTP_DATA_DIR or ~/.cache/mtp/tensorflow_datasets
  train_split: str = "train"
  eval_split: str = "validation"
  num_workers: int = 0            # grain worker processes (0 = in-process)
  # How rows are filled (mtp.data.pipeline): "concat" (concat-then-split: full
  # rows, a document continues in the next row without its start) or
  # "first_fit" (token datasets only: whole examples packed first-fit into
  # rows padded at the end; an example longer than a row keeps its last
  # seq_len tokens), so every chat answer is trained with its prompt.
  packing: str = "concat"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  num_steps: int = 1000
  batch_size: int = 16            # global batch, in sequences
  seq_len: int = 128
  seed: int = 0
  learning_rate: float = 3e-3
  warmup_steps: int = 100
  min_lr_ratio: float = 0.1       # cosine decays to learning_rate * min_lr_ratio
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  grad_clip_norm: float = 1.0
  log_every: int = 10
  eval_every: int = 250
  eval_batches: int = 8
  init_from: str = ""             # workdir whose latest checkpoint's params start a fresh run
  freeze_backbone: bool = False   # train only the MTP modules (embedding, blocks, head frozen)
  # With freeze_backbone: run the frozen backbone once over the train split's
  # rows (mtp.data.epoch_rows), store h^0 in WORKDIR/hidden_cache/ and train
  # the modules from it (train.hidden_cache; Transformer.forward_from_hidden).
  hidden_cache: bool = False
  # "" = WORKDIR/hidden_cache; else a folder of caches shared between runs,
  # one subfolder per (source, rows) fingerprint (hidden_cache.cache_folder):
  # a sweep over the schedule or learning rate builds the cache once.
  hidden_cache_dir: str = ""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = 250
  keep: int = 3


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = -1                  # -1 = all remaining devices
  fsdp: int = 1
  tensor: int = 1


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  mtp: MTPConfig = dataclasses.field(default_factory=MTPConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  def replace(self, **sections) -> "Config":
    """``cfg.replace(mtp=dict(depth=2))``: a new validated config."""
    d = self.to_dict()
    for name, fields in sections.items():
      if name not in d:
        raise ConfigError(f"unknown config section '{name}'")
      d[name] = {**d[name], **fields}
    return from_dict(d)


# Fields that describe the model's parameters: a checkpoint can only be
# restored into a config that agrees on all of these.
ARCHITECTURE_FIELDS = (
    tuple(f"model.{f.name}" for f in dataclasses.fields(ModelConfig)
          if f.name not in ("dtype", "max_seq_len", "attention_impl", "attention_block_size",
                            "matmul_precision"))
    + ("mtp.depth", "mtp.draft_vocab_size", "mtp.feature_layers"))

_DTYPES = ("float32", "bfloat16", "float16")
TOKENIZER_KINDS = ("byte", "bpe")   # model.tokenizer


def parse_id_list(text: str, field: str = "ids") -> tuple[int, ...]:
  """``"1,5,7"`` -> (1, 5, 7), sorted and unique; "" -> (). Raises
  ConfigError naming ``field`` for anything but comma-separated ints."""
  if not text.strip():
    return ()
  try:
    return tuple(sorted({int(x) for x in text.split(",")}))
  except ValueError:
    raise ConfigError(f"{field}={text!r} must be comma-separated integer ids") from None
ATTENTION_IMPLS = ("auto", "blockwise", "dense", "cudnn")   # model.attention_impl
MATMUL_PRECISIONS = ("highest", "high", "default")  # model.matmul_precision
DIVERGENCES = ("kl", "tv", "mix")   # mtp.distill_divergence
PACKINGS = ("concat", "first_fit")   # data.packing


def _coerce(path: str, value: Any, typ: type) -> Any:
  if typ is bool:
    if isinstance(value, bool):
      return value
    raise ConfigError(f"{path} must be a bool, got {value!r}")
  if typ is int:
    if isinstance(value, bool) or not isinstance(value, int):
      if isinstance(value, float) and value.is_integer():
        return int(value)
      raise ConfigError(f"{path} must be an int, got {value!r}")
    return value
  if typ is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"{path} must be a number, got {value!r}")
    if not math.isfinite(value):
      raise ConfigError(f"{path} must be a finite number, got {value!r}")
    return float(value)
  if typ is str:
    if not isinstance(value, str):
      raise ConfigError(f"{path} must be a string, got {value!r}")
    return value
  raise TypeError(typ)


def _build(cls, path: str, values: Mapping[str, Any]):
  hints = get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - names)
  if unknown:
    where = f"'{path}'" if path else "the config"
    raise ConfigError(f"unknown config key(s) {', '.join(path + '.' + u if path else u for u in unknown)}"
                      f" in {where}; allowed: {', '.join(sorted(names))}")
  kwargs = {}
  for name in names:
    if name not in values:
      continue
    sub = f"{path}.{name}" if path else name
    typ = hints[name]
    if dataclasses.is_dataclass(typ):
      v = values[name]
      if hasattr(v, "to_dict"):
        v = v.to_dict()
      if not isinstance(v, Mapping):
        raise ConfigError(f"{sub} must be a section (mapping), got {v!r}")
      kwargs[name] = _build(typ, sub, v)
    else:
      kwargs[name] = _coerce(sub, values[name], typ)
  return cls(**kwargs)


def _check(cond: bool, field: str, allowed: str, value: Any):
  if not cond:
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    raise ConfigError(f"{field}={value!r} is {'out of range' if numeric else 'not allowed'}: "
                      f"must be {allowed}")


def validate(cfg: Config) -> Config:
  """Checks every field's range; returns ``cfg`` unchanged or raises ConfigError."""
  _validate_model(cfg.model)
  _validate_mtp(cfg)
  _validate_data(cfg.data)
  _validate_train(cfg)
  _check(cfg.checkpoint.every_steps >= 1, "checkpoint.every_steps", ">= 1", cfg.checkpoint.every_steps)
  _check(cfg.checkpoint.keep >= 1, "checkpoint.keep", ">= 1", cfg.checkpoint.keep)
  for name in ("data", "fsdp", "tensor"):
    v = getattr(cfg.mesh, name)
    _check(v == -1 or v >= 1, f"mesh.{name}", "-1 (all remaining devices) or >= 1", v)
  _check([cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor].count(-1) <= 1, "mesh",
         "at most one axis set to -1", (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor))
  return cfg


# model.num_layers: every block is a Python object built one by one (100,000
# ran for minutes before failing); the deepest published transformers have
# under 200. Sizes that cannot fit are refused by the train step's memory
# floor (train.workdir.check_memory_floor), which knows the machine.
MAX_LAYERS = 1024


def _validate_model(m: ModelConfig) -> None:
  """``validate``'s checks of the ``model`` section (raises ConfigError)."""
  for name in ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
               "max_seq_len"):
    _check(getattr(m, name) >= 1, f"model.{name}", ">= 1", getattr(m, name))
  _check(m.num_layers <= MAX_LAYERS, "model.num_layers", f"in [1, {MAX_LAYERS}]", m.num_layers)
  _check(m.tokenizer in TOKENIZER_KINDS, "model.tokenizer", f"one of {TOKENIZER_KINDS}", m.tokenizer)
  if m.tokenizer == "byte":
    _check(m.vocab_size >= tok.VOCAB_SIZE, "model.vocab_size",
           f">= {tok.VOCAB_SIZE} (byte tokenizer)", m.vocab_size)
    _check(m.num_tokens == 0, "model.num_tokens", "0 with model.tokenizer='byte'", m.num_tokens)
    _check(not m.never_emitted, "model.never_emitted", "empty with model.tokenizer='byte' (the "
           "byte tokenizer's never-emitted ids are fixed)", m.never_emitted)
  else:
    _check(1 <= m.num_tokens <= m.vocab_size, "model.num_tokens",
           f"in [1, model.vocab_size={m.vocab_size}] with model.tokenizer={m.tokenizer!r}",
           m.num_tokens)
    ids = parse_id_list(m.never_emitted, "model.never_emitted")
    _check(all(0 <= i < m.num_tokens for i in ids), "model.never_emitted",
           f"ids in [0, model.num_tokens={m.num_tokens})", m.never_emitted)
  _check(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads",
         f"a divisor of model.num_heads={m.num_heads}", m.num_kv_heads)
  _check(m.head_dim % 2 == 0, "model.head_dim", "even (RoPE rotates pairs)", m.head_dim)
  _check(m.rope_theta > 0, "model.rope_theta", "> 0", m.rope_theta)
  _check(0 < m.norm_eps < 1, "model.norm_eps", "in (0, 1)", m.norm_eps)
  _check(m.dtype in _DTYPES, "model.dtype", f"one of {_DTYPES}", m.dtype)
  _check(m.param_dtype in _DTYPES, "model.param_dtype", f"one of {_DTYPES}", m.param_dtype)
  _check(m.attention_impl in ATTENTION_IMPLS, "model.attention_impl",
         f"one of {ATTENTION_IMPLS} (auto: chosen per backend and dtype; blockwise: only the "
         "cache blocks that can be visible; dense: every cache slot, masked; cudnn: "
         "jax.nn.dot_product_attention's cuDNN kernel, GPU only)", m.attention_impl)
  _check(m.attention_impl != "cudnn" or m.dtype in ("bfloat16", "float16"), "model.attention_impl",
         "'auto', 'blockwise' or 'dense' unless model.dtype is bfloat16 or float16 (cuDNN "
         f"attention has no {m.dtype} kernel)", m.attention_impl)
  _check(m.attention_block_size >= 1, "model.attention_block_size", ">= 1", m.attention_block_size)
  _check(m.matmul_precision in MATMUL_PRECISIONS, "model.matmul_precision",
         f"one of {MATMUL_PRECISIONS} (highest: float32 matmuls in full float32 on every "
         "backend; default: JAX's, TF32 on NVIDIA GPUs)", m.matmul_precision)


def _validate_mtp(cfg: Config) -> None:
  """``validate``'s checks of the ``mtp`` section and of the stages that need
  MTP modules (``train.freeze_backbone``, ``train.hidden_cache``)."""
  m, t = cfg.model, cfg.train
  _check(0 <= cfg.mtp.depth <= 16, "mtp.depth", "an int in [0, 16]", cfg.mtp.depth)
  _check(cfg.mtp.loss_weight >= 0, "mtp.loss_weight", ">= 0", cfg.mtp.loss_weight)
  _check(0 <= cfg.mtp.distill_weight <= 1, "mtp.distill_weight",
         "in [0, 1] (0 = data cross-entropy only, 1 = main-head teacher only)",
         cfg.mtp.distill_weight)
  _check(cfg.mtp.distill_weight == 0 or cfg.mtp.depth >= 1, "mtp.distill_weight",
         "0 when mtp.depth = 0 (there are no MTP modules to distill)", cfg.mtp.distill_weight)
  _check(0 < cfg.mtp.distill_temperature <= 100, "mtp.distill_temperature", "in (0, 100]",
         cfg.mtp.distill_temperature)
  _check(cfg.mtp.distill_divergence in DIVERGENCES, "mtp.distill_divergence",
         "one of ('kl', 'tv') or 'mix' (kl: forward KL; tv: total variation = 1 - "
         "acceptance; mix: (1 - mtp.tv_weight) KL + mtp.tv_weight TV)", cfg.mtp.distill_divergence)
  _check(0 <= cfg.mtp.tv_weight <= 1, "mtp.tv_weight",
         "in [0, 1] (the TV share of mtp.distill_divergence='mix')", cfg.mtp.tv_weight)
  _check(0 <= cfg.mtp.recursive_steps <= 16, "mtp.recursive_steps", "an int in [0, 16]",
         cfg.mtp.recursive_steps)
  _check(cfg.mtp.recursive_steps == 0 or cfg.mtp.depth >= 1, "mtp.recursive_steps",
         "0 when mtp.depth = 0 (there is no module D to reuse)", cfg.mtp.recursive_steps)
  _check(cfg.mtp.draft_vocab_size == 0 or 1 <= cfg.mtp.draft_vocab_size <= m.vocab_size,
         "mtp.draft_vocab_size", f"0 (the full vocabulary) or an int in [1, model.vocab_size="
         f"{m.vocab_size}]", cfg.mtp.draft_vocab_size)
  _check(cfg.mtp.draft_vocab_size == 0 or cfg.mtp.depth >= 1, "mtp.draft_vocab_size",
         "0 when mtp.depth = 0 (there are no MTP heads to reduce)", cfg.mtp.draft_vocab_size)
  layers = parse_id_list(cfg.mtp.feature_layers, "mtp.feature_layers")
  _check(all(0 <= i <= m.num_layers - 2 for i in layers), "mtp.feature_layers",
         f"comma-separated block indices in [0, model.num_layers - 2 = {m.num_layers - 2}] "
         "(the last block's output h^0 is always read)", cfg.mtp.feature_layers)
  _check(not layers or cfg.mtp.depth >= 1, "mtp.feature_layers",
         "empty when mtp.depth = 0 (there is no module 1 to feed)", cfg.mtp.feature_layers)
  _check(not t.freeze_backbone or cfg.mtp.depth >= 1, "train.freeze_backbone",
         "False when mtp.depth = 0 (nothing would be trained)", t.freeze_backbone)
  _check(not t.hidden_cache or t.freeze_backbone, "train.hidden_cache",
         "False unless train.freeze_backbone=True (cached backbone states are only valid for "
         "a frozen backbone)", t.hidden_cache)
  _check(not t.hidden_cache_dir or t.hidden_cache, "train.hidden_cache_dir",
         "empty unless train.hidden_cache=True (it says where cached backbone states live)",
         t.hidden_cache_dir)


# data.num_workers: 1,000,000 forked hundreds of grain workers and exhausted
# the host's memory before failing; no host this runs on has more cores.
MAX_DATA_WORKERS = 64


def _validate_data(d: DataConfig) -> None:
  """``validate``'s checks of the ``data`` section (raises ConfigError)."""
  _check(bool(d.name), "data.name", "a non-empty dataset name", d.name)
  _check(all(p.strip() for p in d.name.split("+")), "data.name",
         "a dataset name or a mixture of non-empty names joined by '+'", d.name)
  if d.name == "text_files":
    patterns = d.files.split(",")
    _check(all(p.strip() for p in patterns), "data.files",
           "a comma-separated list of non-empty glob patterns (data.name='text_files'), "
           "e.g. 'src/**/*.py,docs/*.md'", d.files)
  else:
    _check(not d.files, "data.files", "empty unless data.name='text_files' "
           f"(data.name={d.name!r} does not read files)", d.files)
  _check(0 <= d.num_workers <= MAX_DATA_WORKERS, "data.num_workers",
         f"in [0, {MAX_DATA_WORKERS}] (grain worker processes; each holds its own copy of the "
         "pipeline, and more than the CPU cores only adds memory)", d.num_workers)
  _check(d.packing in PACKINGS, "data.packing", f"one of {PACKINGS}", d.packing)


def _validate_train(cfg: Config) -> None:
  """``validate``'s checks of the ``train`` section (raises ConfigError)."""
  m, t = cfg.model, cfg.train
  for name in ("num_steps", "batch_size", "seq_len", "log_every", "eval_every", "eval_batches"):
    _check(getattr(t, name) >= 1, f"train.{name}", ">= 1", getattr(t, name))
  _check(t.seq_len <= m.max_seq_len, "train.seq_len", f"<= model.max_seq_len={m.max_seq_len}",
         t.seq_len)
  horizon = cfg.mtp.depth + cfg.mtp.recursive_steps + 1
  _check(t.seq_len > horizon, "train.seq_len",
         f"> mtp.depth + mtp.recursive_steps + 1 = {horizon}", t.seq_len)
  _check(t.learning_rate > 0, "train.learning_rate", "> 0", t.learning_rate)
  _check(t.warmup_steps >= 0, "train.warmup_steps", ">= 0", t.warmup_steps)
  _check(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", "in [0, 1]", t.min_lr_ratio)
  _check(t.weight_decay >= 0, "train.weight_decay", ">= 0", t.weight_decay)
  _check(0 <= t.b1 < 1, "train.b1", "in [0, 1)", t.b1)
  _check(0 <= t.b2 < 1, "train.b2", "in [0, 1)", t.b2)
  _check(t.grad_clip_norm > 0, "train.grad_clip_norm", "> 0", t.grad_clip_norm)
  _check(t.seed >= 0, "train.seed", ">= 0", t.seed)


def check_override_keys(argv: list[str], flag: str = "config") -> None:
  """Checks ``--config.a.b=value`` command-line overrides against the schema
  before ml_collections parses them (it would fail with a bare KeyError).

  Raises ConfigError naming the unknown key and the allowed ones.
  """
  prefix = f"--{flag}."
  for arg in argv:
    if not arg.startswith(prefix):
      continue
    path = arg[len(prefix):].split("=", 1)[0]
    cls, done = Config, []
    for part in path.split("."):
      names = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
      if part not in names:
        where = ".".join(done) or "the config"
        allowed = ", ".join(sorted(names)) if names else "(none: it is not a section)"
        raise ConfigError(f"unknown config key '{'.'.join(done + [part])}' in {where}; "
                          f"allowed: {allowed}")
      done.append(part)
      cls = get_type_hints(cls)[part]


def from_dict(values: Mapping[str, Any] | Any) -> Config:
  """Builds and validates a Config from a (possibly nested) mapping or a
  ``ml_collections.ConfigDict``. Missing fields take their defaults.

  Raises:
    ConfigError: unknown key, wrong type or out-of-range value (the message
      names the dotted field).
  """
  if hasattr(values, "to_dict"):
    values = values.to_dict()
  return validate(_build(Config, "", values))


def config_file_arg(argv: list[str], flag: str = "config") -> str | None:
  """The value of ``--FLAG PATH`` / ``--FLAG=PATH`` (or one dash, as absl
  accepts) in ``argv``, the last one given; None when absent."""
  value = None
  for i, arg in enumerate(argv):
    if arg == "--":
      break
    for dash in ("--", "-"):
      if arg == f"{dash}{flag}" and i + 1 < len(argv):
        value = argv[i + 1]
      elif arg.startswith(f"{dash}{flag}="):
        value = arg.split("=", 1)[1]
  return value


def read_config_file(path: str) -> Any:
  """Runs config file ``path`` (a Python file with ``get_config()``, as
  ``configs/tiny.py``; ``FILE:ARG`` calls ``get_config("ARG")``, as
  ml_collections config flags do) and returns what ``get_config`` returned,
  unvalidated.

  Raises:
    ConfigError: one line naming the path, for a missing file, a file that
      does not import (syntax error, exception), no ``get_config``, or a
      ``get_config`` that raises or returns None.
  """
  import importlib.util
  import os
  file, *args = path.split(":", 1)
  if not os.path.isfile(file):
    raise ConfigError(f"config file {file!r} does not exist"
                      + ("" if os.path.isabs(file) else f" (relative to {os.getcwd()})"))
  def failed(what, e):
    where = f" (line {e.lineno})" if isinstance(e, SyntaxError) and e.lineno else ""
    msg = (e.msg if isinstance(e, SyntaxError) else str(e)).strip().splitlines()
    return ConfigError(f"config file {file!r} {what}: {type(e).__name__}{where}"
                       + (f": {msg[0]}" if msg else ""))
  try:
    spec = importlib.util.spec_from_file_location("_mtp_config_file", file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
  except Exception as e:  # noqa: BLE001 - any failure of user code is a bad config file
    raise failed("cannot be loaded", e) from e
  if not callable(getattr(mod, "get_config", None)):
    raise ConfigError(f"config file {file!r} has no get_config() function")
  try:
    value = mod.get_config(*args)
  except Exception as e:  # noqa: BLE001
    raise failed("failed in get_config()", e) from e
  if value is None:
    raise ConfigError(f"config file {file!r}: get_config() returned None (missing return?)")
  return value


def load_config_file(path: str) -> Config:
  """Builds and validates the Config of a config file (``read_config_file``)
  without absl flags.

  Raises:
    ConfigError: missing or unloadable file (``read_config_file``), or an
      invalid value.
  """
  return from_dict(read_config_file(path))


def to_config_dict(cfg: Config):
  """The ``ml_collections.ConfigDict`` form of ``cfg`` (for config files)."""
  import ml_collections
  return ml_collections.ConfigDict(cfg.to_dict())


def architecture_mismatches(a: Config, b: Config) -> list[str]:
  """Fields in ``ARCHITECTURE_FIELDS`` where ``a`` and ``b`` differ, as
  ``"field: a_value != b_value"`` strings (empty when compatible)."""
  out = []
  da, db = a.to_dict(), b.to_dict()
  for field in ARCHITECTURE_FIELDS:
    sec, name = field.split(".")
    if da[sec][name] != db[sec][name]:
      out.append(f"{field}: {da[sec][name]!r} != {db[sec][name]!r}")
  return out
