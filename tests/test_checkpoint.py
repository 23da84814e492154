"""Checkpoints that cannot be read or were altered (issue 23, parts 1 and 2):
array checksums recorded at save and verified at every restore (decoding,
resuming, ``train.init_from``), one clear error line for a damaged or
incomplete checkpoint and no ``Event loop is closed`` tracebacks."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from mtp import checkpoint as ckpt_lib
from mtp import loading
from tests.conftest import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP = 3
ALTERED = "params.blocks.0.attn.k_proj.kernel"


def _cfg(data_dir="", **sections):
  return tiny_config(data=dict(data_dir=data_dir), **sections)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, data_dir):
  """(workdir, cfg, params, opt_state, data_iter): fresh tiny state saved at
  STEP with its data position, as ``train`` saves it."""
  from mtp import data as data_lib
  from train.loop import Trainer
  cfg = _cfg(data_dir)
  state = Trainer(cfg).init_state()
  t = cfg.train
  data_iter = iter(data_lib.make_train_dataset(cfg.data, seq_len=t.seq_len,
                                               batch_size=t.batch_size, seed=t.seed))
  path = str(tmp_path_factory.mktemp("saved"))
  ckpt = ckpt_lib.Checkpointer(path)
  ckpt.save(STEP, state.params, state.opt_state, data_iter, cfg)
  ckpt.close()
  return path, cfg, state.params, state.opt_state, data_iter


def _state_dir(workdir):
  return os.path.join(workdir, "checkpoints", str(STEP), "state")


@pytest.fixture(scope="module")
def altered(saved, tmp_path_factory):
  """A copy of ``saved`` whose stored k_proj kernel of block 0 differs from
  what was saved (20 entries -4.9e32, finite; as a byte flip in an
  uncompressed chunk does): the state files of another save are put in
  place of the original ones, so orbax reads it without complaint."""
  workdir, cfg, params, opt_state, data_iter = saved
  root = tmp_path_factory.mktemp("altered")
  other = str(root / "other")
  bad = jax.tree.map(lambda x: x, params)
  kernel = bad["blocks"][0]["attn"]["k_proj"]["kernel"]
  value = np.array(kernel.get_value())
  value.reshape(-1)[100:120] = -4.9e32
  kernel.set_value(value)
  ckpt = ckpt_lib.Checkpointer(other)
  ckpt.save(STEP, bad, opt_state, data_iter, cfg)
  ckpt.close()
  out = str(root / "wd")
  shutil.copytree(workdir, out)
  shutil.rmtree(_state_dir(out))
  shutil.copytree(_state_dir(other), _state_dir(out))
  return out


def _copy(src, dst):
  shutil.copytree(src, dst)
  return str(dst)


def _truncated(workdir, dst):
  """A copy with every data file of the state truncated to half its size
  (the issue truncates the largest one to 1,000,000 bytes; the tiny model's
  files are smaller)."""
  out = _copy(workdir, dst)
  d = os.path.join(_state_dir(out), "ocdbt.process_0", "d")
  for f in os.listdir(d):
    os.truncate(os.path.join(d, f), os.path.getsize(os.path.join(d, f)) // 2)
  return out


def test_checksums_cover_every_saved_array(saved):
  workdir, _, params, opt_state, _ = saved
  path = os.path.join(workdir, "checkpoints", str(STEP), ckpt_lib.CHECKSUMS_ITEM, "metadata")
  recorded = json.load(open(path))
  assert recorded["algorithm"] == "crc32" and recorded["format"] == 1
  names = [jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value")
           for p, _ in jax.tree_util.tree_flatten_with_path(
               {"params": params, "opt_state": opt_state})[0]]
  assert sorted(recorded["arrays"]) == sorted(names) and ALTERED in names
  entry = recorded["arrays"][ALTERED]
  assert entry["dtype"] == "float32" and entry["shape"] == [32, 16]
  assert any(n.startswith("opt_state.") for n in recorded["arrays"])


def test_intact_checkpoint_loads_silently(saved, capsys):
  workdir, _, params, _, _ = saved
  _, model, step = loading.load_model(workdir)
  assert step == STEP and "note:" not in capsys.readouterr().err
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # device arrays, not numpy: a jitted stream round copied numpy weights to the
  # device on every call (SmolLM2: 540 MB, 3x slower rounds)
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_altered_checkpoint_is_refused_for_decode_resume_and_init_from(
    altered, saved, tmp_path, data_dir):
  from train.loop import Trainer, train
  want = rf"checkpoints/{STEP}: array {ALTERED.replace('.', '[.]')} \(32, 16\) float32 does not match"
  with pytest.raises(ckpt_lib.CheckpointError, match=want):
    loading.load_model(altered)                                          # decoding
  trainer = Trainer(saved[1])
  ckpt = ckpt_lib.Checkpointer(altered, read_only=True)
  try:
    with pytest.raises(ckpt_lib.CheckpointError, match=want):           # resuming
      ckpt.restore(STEP, trainer.abstract_params, trainer.abstract_opt_state)
  finally:
    ckpt.close()
  resumed = _copy(altered, tmp_path / "resume")
  with pytest.raises(ckpt_lib.CheckpointError, match=want):
    train(_cfg(data_dir, train=dict(num_steps=6)), resumed)
  with pytest.raises(ckpt_lib.CheckpointError, match=want):             # train.init_from
    train(_cfg(data_dir, train=dict(init_from=altered)), str(tmp_path / "stage"))
  assert not os.path.exists(tmp_path / "stage" / "checkpoints")


def test_checkpoint_without_checksums_loads_with_one_notice(saved, tmp_path, capsys):
  old = _copy(saved[0], tmp_path / "old")
  shutil.rmtree(os.path.join(old, "checkpoints", str(STEP), ckpt_lib.CHECKSUMS_ITEM))
  _, _, step = loading.load_model(old)
  err = capsys.readouterr().err.strip().splitlines()
  assert step == STEP and len(err) == 1 and err[0].startswith("note: checkpoint ")
  assert "no array checksums" in err[0]


def test_missing_metadata_names_the_file(saved, tmp_path):
  broken = _copy(saved[0], tmp_path / "nometa")
  os.remove(os.path.join(_state_dir(broken), "_METADATA"))
  with pytest.raises(ckpt_lib.CheckpointError, match=r"incomplete: state/_METADATA is missing"):
    loading.load_model(broken)


def _decode_cli(workdir):
  return subprocess.run(
      [sys.executable, "-m", "decode", "--workdir", workdir, "--prompt", "def main(",
       "--max_new_tokens", "5"], cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"},
      capture_output=True, text=True, timeout=300)


def _one_error_line(r, *needles):
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2, r.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
  assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr
  for n in needles:
    assert n in lines[0], lines[0]


@pytest.mark.cpu_only
def test_damaged_checkpoints_through_the_cli(saved, altered, tmp_path):
  """python -m decode on a truncated, an altered and an incomplete
  checkpoint: exit status 2 and exactly one stderr line each."""
  _one_error_line(_decode_cli(_truncated(saved[0], tmp_path / "trunc")), "is unreadable",
                  f"checkpoints/{STEP}")
  _one_error_line(_decode_cli(altered), f"checkpoints/{STEP}: array {ALTERED}", "checksum")
  broken = _copy(saved[0], tmp_path / "nometa")
  os.remove(os.path.join(_state_dir(broken), "_METADATA"))
  _one_error_line(_decode_cli(broken), "state/_METADATA is missing")
  # the step's own _CHECKPOINT_METADATA (save timestamps) gone: decodes, and
  # orbax's "Metadata file does not exist" warning is not shown
  nostep = _copy(saved[0], tmp_path / "nostepmeta")
  os.remove(os.path.join(os.path.dirname(_state_dir(nostep)), "_CHECKPOINT_METADATA"))
  r = _decode_cli(nostep)
  assert r.returncode == 0 and "Metadata file does not exist" not in r.stderr, r.stderr[-2000:]
  assert "[mtp] tokens" in r.stderr + r.stdout


@pytest.mark.cpu_only
def test_no_event_loop_tracebacks_after_the_error_is_caught(saved, tmp_path):
  """Through the library: nothing is printed after CheckpointError was
  caught, also seconds later (the reads still in flight finished first)."""
  bad = _truncated(saved[0], tmp_path / "trunc")
  code = ("import sys, time\n"
          "from mtp import checkpoint, loading\n"
          "try:\n"
          "  loading.load_model(sys.argv[1])\n"
          "except checkpoint.CheckpointError:\n"
          "  print('caught', flush=True)\n"
          "time.sleep(3)\n")
  r = subprocess.run([sys.executable, "-c", code, bad], cwd=REPO, capture_output=True, text=True,
                     env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}, timeout=300)
  assert r.returncode == 0 and r.stdout == "caught\n", r.stderr[-3000:]
  assert "Event loop is closed" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
