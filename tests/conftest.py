"""Shared fixtures: tiny configs that compile fast on 2 CPU cores."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

from mtp import config as config_lib


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


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  """A TFDS data dir private to the test session (embedded corpora build here)."""
  d = os.environ.get("MTP_TEST_DATA_DIR") or str(tmp_path_factory.mktemp("tfds"))
  return d
