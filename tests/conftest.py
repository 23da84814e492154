"""Shared fixtures: tiny configs that compile fast on 2 CPU cores.

The suite runs on CPU unless JAX_PLATFORMS is set (``make test-gpu`` sets
cuda); tests marked ``cpu_only`` (pyproject.toml's markers) are skipped on
any other backend."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _share_compiled_programs() -> None:
  """JAX's persistent compilation cache in a folder private to this test
  session, shared by its xdist workers and every subprocess it starts (they
  inherit the environment): a program compiled by one file, worker or CLI
  run is loaded from disk by the next one (after ``_free_compiled_programs``
  dropped it, or in another process) instead of compiled again. The
  controller (or the lone process without xdist) makes the folder and
  removes it at exit; MTP_TEST_JAX_CACHE names one to keep instead."""
  if "PYTEST_XDIST_WORKER" in os.environ or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return      # a worker inherits the controller's; a folder set outside is kept
  path = os.environ.get("MTP_TEST_JAX_CACHE")
  if not path:
    path = tempfile.mkdtemp(prefix="mtp-test-jax-cache-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
  os.makedirs(path, exist_ok=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = path
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"   # tiny models compile fast


_share_compiled_programs()

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp import config as config_lib
from mtp import tokenizer as tok
# a crashed xdist worker's test gets one rerun in a fresh process (its docstring)
from tests.crash_rerun import pytest_configure  # noqa: F401

# MTP_TEST_COMPILE_LOG=FILE: compile seconds per test (tests/compile_log.py)
pytest_plugins = ["tests.compile_log"]


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """After each test file, frees the compiled programs nothing references
  any more (``decode.compiled.clear_cache``, then a GC pass). Without it an
  xdist worker's process accumulated the executables of every file it ran,
  ~7 memory mappings each (test_decode alone left 22,391), until it passed
  the kernel's vm.max_map_count (65,530): a core dump of a worker that
  segfaulted in XLA:CPU's compiler held 65,328 mappings (docs/testing.md)."""
  yield
  import gc

  from decode import compiled
  compiled.clear_cache()
  gc.collect()


def pytest_collection_modifyitems(config, items):
  """Skips ``cpu_only`` tests (8 fake CPU devices, subprocesses pinned to
  JAX_PLATFORMS=cpu) when JAX's backend is not the CPU: they would test the
  CPU there, or compare it with the accelerator."""
  backend = jax.default_backend()
  if backend == "cpu":
    return
  skip = pytest.mark.skip(reason=f"cpu_only: forces the CPU, and the backend is {backend} "
                                 "(make test runs it)")
  for item in items:
    if item.get_closest_marker("cpu_only"):
      item.add_marker(skip)


def tiny_config(**sections) -> config_lib.Config:
  """A few-thousand-parameter model; override sections with dicts."""
  base = dict(
      model=dict(vocab_size=264, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=8, mlp_dim=64, max_seq_len=256),
      mtp=dict(depth=2, loss_weight=0.5),
      train=dict(num_steps=6, batch_size=4, seq_len=32, warmup_steps=2, log_every=2,
                 eval_every=4, eval_batches=2, learning_rate=1e-2),
      checkpoint=dict(every_steps=3, keep=5),
  )
  for name, fields in sections.items():
    base[name] = {**base.get(name, {}), **fields}
  return config_lib.from_dict(base)


def md_command(md_path: str) -> str:
  """The command on the first line of a script's OUT.md ("Command: `...`")."""
  first = open(md_path).readline().rstrip("\n")
  assert first.startswith("Command: `") and first.endswith("`"), first
  return first[len("Command: `"):-1]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  """A TFDS data dir private to the test session (embedded corpora build here)."""
  d = os.environ.get("MTP_TEST_DATA_DIR") or str(tmp_path_factory.mktemp("tfds"))
  return d


# -- a tiny model trained on a synthetic Markov source --------------------------

ALPHABET = np.frombuffer(b"abcdef ", np.uint8).astype(np.int32)


def random_prompts(lengths, seed: int = 0) -> list[np.ndarray]:
  """BOS + n random ALPHABET tokens per n in ``lengths`` (int32 arrays)."""
  rng = np.random.default_rng(seed)
  return [np.concatenate([[tok.BOS_ID], rng.choice(ALPHABET, n)]).astype(np.int32) for n in lengths]


def with_noisy_mtp(model, scale: float, seed: int = 0):
  """A copy of ``model`` with Gaussian noise of ``scale`` x each parameter's
  std on its MTP modules only (main head unchanged, drafts often wrong)."""
  graphdef, params = nnx.split(model, nnx.Param)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape)
           if any(getattr(e, "key", None) == "mtp" for e in path) else x
           for (path, x), k in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, noisy))


def markov_batch(rng: np.random.Generator, batch: int, seq_len: int, transition: np.ndarray):
  """[BOS] + a Markov chain over ALPHABET; transition [A, A] row-stochastic."""
  a = len(ALPHABET)
  states = np.empty((batch, seq_len - 1), np.int64)
  states[:, 0] = rng.integers(0, a, batch)
  cum = np.cumsum(transition, 1)
  for t in range(1, seq_len - 1):
    u = rng.random(batch)
    states[:, t] = (u[:, None] > cum[states[:, t - 1]]).sum(1)
  tokens = np.concatenate([np.full((batch, 1), tok.BOS_ID), ALPHABET[states]], 1).astype(np.int32)
  return {"tokens": tokens, "segment_ids": np.ones_like(tokens),
          "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), tokens.shape).copy()}


def markov_transition(seed: int = 0) -> np.ndarray:
  """A peaked but stochastic transition matrix (entropy ~1 bit per step)."""
  rng = np.random.default_rng(seed)
  a = len(ALPHABET)
  logits = rng.normal(size=(a, a)) * 2.5
  p = np.exp(logits)
  return p / p.sum(1, keepdims=True)


@pytest.fixture(scope="session")
def trained_markov():
  """(cfg, model): a D=2 tiny model trained ~200 steps on a Markov source, so
  drafts are accepted often but not always and nearly all probability mass
  sits on ALPHABET. Session-scoped: compiled and trained once (~20 s)."""
  from train.loop import Trainer
  cfg = tiny_config(train=dict(num_steps=200, batch_size=16, seq_len=32, warmup_steps=10,
                               learning_rate=1e-2))
  trainer = Trainer(cfg)
  state = trainer.init_state()
  rng = np.random.default_rng(0)
  transition = markov_transition()
  for _ in range(cfg.train.num_steps):
    state, _ = trainer.train_step(state, markov_batch(rng, 16, 32, transition))
  return cfg, trainer.model(state.params), transition


@pytest.fixture(scope="session")
def markov_workdir(trained_markov, tmp_path_factory):
  """The trained Markov model saved as a checkpoint workdir (for CLIs and scripts)."""
  from flax import nnx
  from mtp import checkpoint as ckpt_lib
  cfg, model, _ = trained_markov
  path = str(tmp_path_factory.mktemp("markov_wd"))
  ckpt = ckpt_lib.Checkpointer(path)
  ckpt.save(1, nnx.state(model, nnx.Param), {}, None, cfg)
  ckpt.close()
  return path
