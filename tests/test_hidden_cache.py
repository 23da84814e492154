"""The frozen-backbone stage on cached hidden states (train.hidden_cache):
forward_from_hidden equals the full forward, cached training equals
uncached training, resume is exact, bad combinations are clear errors; the
loss's validity from segment ids and loss_mask; a BPE stage end to end."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp import data as data_lib
from mtp import model as model_lib
from mtp import tokenizer as tok
from mtp.config import ConfigError
from mtp.model import build_model
from tests import stage_rows, tiny_bpe
from tests.conftest import tiny_config
from train import hidden_cache as cache_lib
from train import losses
from train.loop import Trainer, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = 32


def _random_rows(n=10, seed=0):
  """n rows of T printable-ASCII tokens (ids the byte head may emit), random
  documents, the last row padded."""
  rng = np.random.default_rng(seed)
  docs = [rng.integers(32, 127, int(rng.integers(5, 40))) for _ in range(3 * n)]
  rows = stage_rows.pack_rows(docs, T)
  return {k: v[:n] for k, v in rows.items()}


def _batch(rows, lo=0, b=4):
  return {k: rows[k][lo:lo + b] for k in ("tokens", "positions", "segment_ids")}


# -- the model -----------------------------------------------------------------

def test_forward_from_hidden_equals_the_full_forward():
  cfg = tiny_config(mtp=dict(depth=2, recursive_steps=2))
  graphdef, state = nnx.split(build_model(cfg, 0))
  b = _batch(_random_rows())

  @jax.jit
  def both(state, b):
    m = nnx.merge(graphdef, state)
    full = m(b["tokens"], b["positions"], b["segment_ids"], recursive_steps=2)
    h0 = m.backbone(b["tokens"], b["positions"], b["segment_ids"])[0]
    cached = m.forward_from_hidden(b["tokens"], b["positions"], b["segment_ids"], h0,
                                   recursive_steps=2)
    return ((full.logits,) + full.mtp_logits + full.hidden,
            (cached.logits,) + cached.mtp_logits + cached.hidden)
  full, cached = both(state, b)
  assert np.isfinite(np.asarray(full[1])).any()
  assert len(full) == len(cached) == 1 + 4 + 3
  for x, y in zip(full, cached):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-5)


def test_compact_training_form_gives_the_full_forms_module_loss_and_gradients():
  """With V', the training step runs every head over V' only
  (forward_from_hidden(compact=True)); the module terms (restricted-teacher
  KL, CE on targets in V') and their gradients equal the full (scattered)
  form's, with a V' that leaves out many targets."""
  from mtp import draft_vocab as dv
  cfg = tiny_config(mtp=dict(depth=1, recursive_steps=2, draft_vocab_size=48,
                             distill_weight=0.5))
  model = build_model(cfg, 0)
  dv.set_draft_vocab(model, np.arange(40, 136, 2, dtype=np.int32))   # half the printable ids
  graphdef, params, rest = nnx.split(model, nnx.All(nnx.Param, nnx.PathContains("mtp")), ...)
  b = _batch(_random_rows())
  h0 = model.backbone(b["tokens"], b["positions"], b["segment_ids"])[0]

  def module_loss(params, compact):
    m = nnx.merge(graphdef, params, rest)
    out = m.forward_from_hidden(b["tokens"], b["positions"], b["segment_ids"], h0,
                                recursive_steps=2, compact=compact)
    loss, sums = losses.mtp_loss(out, b["tokens"], b["segment_ids"], 1.0, depth=1,
                                 distill_weight=0.5)
    main = sums["main"]["nll"] / jnp.maximum(sums["main"]["count"], 1.0)
    return loss - main, sums                     # the main term has no module gradient
  grad = jax.jit(jax.value_and_grad(module_loss, has_aux=True), static_argnums=1)
  (full, s_full), g_full = grad(params, False)
  (comp, s_comp), g_comp = grad(params, True)
  assert np.isfinite(float(full)) and 0.1 < float(s_full["mtp_1"]["count"]) / float(
      s_full["mtp_1"]["positions"]) < 0.9                     # V' leaves out many targets
  np.testing.assert_allclose(float(comp), float(full), rtol=1e-5)
  for k in ("mtp_1", "mtp_2", "mtp_3"):
    for key in ("nll", "count", "kl", "agree", "positions"):
      np.testing.assert_allclose(float(s_comp[k][key]), float(s_full[k][key]), rtol=1e-4, atol=1e-3)
  flat_f, flat_c = nnx.to_flat_state(g_full), dict(nnx.to_flat_state(g_comp))
  assert len(flat_f) > 5
  for path, v in flat_f:
    np.testing.assert_allclose(np.asarray(flat_c[path][...]), np.asarray(v[...]),
                               rtol=1e-4, atol=1e-6)


def test_neutral_mtp_fill_leaves_byte_losses_and_gradients_bit_identical(monkeypatch):
  """MTP inputs past the row end used to read PAD (256); now MTP_FILL_ID (0).
  Those positions are masked, so the byte model's loss and gradients do not move."""
  cfg = tiny_config(mtp=dict(depth=2, recursive_steps=1, distill_weight=0.5))
  graphdef, params = nnx.split(build_model(cfg, 0), nnx.Param)
  rows = _random_rows()
  b = {**_batch(rows), "tokens": np.where(_batch(rows)["segment_ids"] == 0, tok.PAD_ID,
                                          _batch(rows)["tokens"])}
  from train.loop import make_loss_fn

  def run():
    f = jax.jit(jax.value_and_grad(make_loss_fn(graphdef, 0.5, cfg.mtp), has_aux=True))
    (loss, _), grads = f(params, b)
    return float(loss), jax.tree.leaves(grads)
  assert model_lib.MTP_FILL_ID == 0
  new = run()
  monkeypatch.setattr(model_lib, "MTP_FILL_ID", tok.PAD_ID)
  old = run()
  assert new[0] == old[0]
  for x, y in zip(new[1], old[1]):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# -- the loss's validity -------------------------------------------------------

def test_validity_from_segment_ids_and_loss_mask():
  tokens = np.array([[5, 256, 7, 8, 9, 0]], np.int32)
  seg = np.array([[1, 1, 1, 2, 2, 0]], np.int32)
  lm = np.array([[1, 1, 0, 1, 1, 1]], np.int32)
  _, byte = losses.shifted_targets(tokens, seg, 1)                 # byte rules: PAD never a target
  assert np.asarray(byte).tolist() == [[False, True, False, True, False, False]]
  _, bpe = losses.shifted_targets(tokens, seg, 1, pad_id=None)     # 256 is a real BPE token
  assert np.asarray(bpe).tolist() == [[True, True, False, True, False, False]]
  _, masked = losses.shifted_targets(tokens, seg, 1, loss_mask=lm, pad_id=None)
  assert np.asarray(masked).tolist() == [[True, False, False, True, False, False]]
  _, two = losses.shifted_targets(tokens, seg, 2, pad_id=None)
  assert np.asarray(two).tolist() == [[True, False, False, False, False, False]]
  _, two = losses.shifted_targets(tokens, seg, 2, loss_mask=lm, pad_id=None)   # lm[2] = 0
  assert not np.asarray(two).any()
  logits = jnp.zeros((1, 6, 300))
  sums = losses.head_sums(logits, tokens, bpe, byte_level=False)
  assert "byte_nll" not in sums
  assert "main/bits_per_byte" not in losses.summarize({"main": sums})
  assert "main/bits_per_byte" in losses.summarize({"main": losses.head_sums(logits, tokens, byte)})


# -- cached vs uncached training on the same rows ---------------------------------

def _stage_cfg(**train_fields):
  return tiny_config(mtp=dict(depth=2, recursive_steps=1, distill_weight=0.5),
                     train=dict(freeze_backbone=True, hidden_cache=True, batch_size=4,
                                seq_len=T, **train_fields))


def test_cached_stage_equals_uncached_stage_on_the_same_rows(tmp_path):
  cfg = _stage_cfg()
  trainer = Trainer(cfg)
  rows = cache_lib.check_rows(_random_rows(), T, cfg.model.vocab_size)
  start = trainer.init_state()
  init = jax.tree.map(np.asarray, jax.device_get(start.params))
  cache = cache_lib.build(str(tmp_path / "cache"), rows, lambda b: trainer.hidden_states(start.params, b),
                          batch_size=4, d_model=cfg.model.d_model, dtype="float32",
                          source={"test": 1}, log=lambda s: None)
  assert cache.h0.shape == (10, T, cfg.model.d_model)
  it = cache_lib.CacheIterator(4, seed=0).attach(cache)
  batches = [next(it) for _ in range(3)]        # 2 batches per epoch: crosses an epoch
  assert (it.epoch, it.position) == (1, 1)

  def run(use_cache):
    state = trainer.init_state(jax.tree.map(jnp.asarray, init))
    for b in batches:
      state, _ = trainer.train_step(state, b if use_cache else
                                    {k: v for k, v in b.items() if k != "h0"})
    return jax.tree.map(np.asarray, jax.device_get(state.params))
  cached, direct = run(True), run(False)
  flat = lambda p: dict(nnx.to_flat_state(p))
  c, d, i = flat(cached), flat(direct), flat(init)
  moved = 0
  assert all(np.all(np.isfinite(v.get_value())) for v in c.values())
  for path in d:
    np.testing.assert_allclose(c[path].get_value(), d[path].get_value(), rtol=1e-5, atol=1e-6,
                               err_msg=str(path))
    if path[0] == "mtp":
      moved += not np.array_equal(d[path].get_value(), i[path].get_value())
    else:
      np.testing.assert_array_equal(c[path].get_value(), i[path].get_value())
  assert moved > 0


def test_cache_iterator_state_round_trip_and_refusal():
  rows = cache_lib.check_rows(_random_rows(), T, 264)
  h0 = np.arange(10 * T * 2, dtype=np.float32).reshape(10, T, 2)
  cache = cache_lib.Cache(rows, h0, {"source": {"a": 1}, "rows": cache_lib.rows_fingerprint(rows)})
  it = cache_lib.CacheIterator(4, seed=3).attach(cache)
  seen = [next(it)["h0"][:, 0, 0] for _ in range(3)]
  state = it.get_state()
  rest = [next(it)["h0"][:, 0, 0] for _ in range(4)]
  again = cache_lib.CacheIterator(4, seed=3)
  again.set_state(state)                        # before attach, as a resumed run does
  again.attach(cache)
  np.testing.assert_array_equal(np.stack([next(again)["h0"][:, 0, 0] for _ in range(4)]),
                                np.stack(rest))
  for b in seen:                                # rows of a batch are distinct, h0 follows its row
    assert len(set(b.tolist())) == 4
  other = cache_lib.Cache(rows, h0, {"source": {"a": 2}, "rows": cache.meta["rows"]})
  bad = cache_lib.CacheIterator(4, seed=3)
  bad.set_state(state)
  with pytest.raises(cache_lib.HiddenCacheError, match="another fingerprint"):
    bad.attach(other)
  with pytest.raises(cache_lib.HiddenCacheError, match="fewer than train.batch_size"):
    cache_lib.CacheIterator(16, seed=0).attach(cache)


# -- the loop: resume, rebuild, refusals ----------------------------------------

@pytest.fixture
def row_data(monkeypatch):
  rows = _random_rows(10)
  ev = stage_rows.eval_batches(_random_rows(8, seed=1), 4, 2)
  state = {"rows": rows}
  monkeypatch.setattr(data_lib, "epoch_rows", lambda cfg, *, seq_len, tokenizer=None,
                      split=None: state["rows"], raising=False)
  monkeypatch.setattr(data_lib, "make_eval_batches", lambda cfg, **kw: ev)
  return state


def _loop_cfg(**train_fields):
  return tiny_config(mtp=dict(depth=1, recursive_steps=1, distill_weight=1.0),
                     train={**dict(freeze_backbone=True, hidden_cache=True, num_steps=4,
                                   batch_size=4, seq_len=T, log_every=1, eval_every=4),
                            **train_fields},
                     checkpoint=dict(every_steps=1))


def _losses(workdir):
  out = {}
  for line in open(os.path.join(workdir, "metrics.jsonl")):
    r = json.loads(line)
    out[(r["step"], r["split"])] = r.get("loss", r.get("main/loss"))
    if r["split"] == "eval":
      out[(r["step"], "kl")] = r["mtp_1/teacher_kl"]
  return out


def test_stage_with_cache_resumes_exactly_and_rebuilds_or_refuses(row_data, tmp_path):
  cfg = _loop_cfg()
  full = str(tmp_path / "full")
  logs = []
  train(cfg, full, log=logs.append)
  assert any(l.startswith("hidden cache: built") for l in logs), logs
  meta = json.load(open(os.path.join(full, "hidden_cache", "meta.json")))
  assert meta["shape"] == [10, T, 32] and meta["dtype"] == "float32" and meta["build_s"] >= 0

  part = str(tmp_path / "part")
  train(cfg, part, stop_after=1, log=lambda s: None)
  logs = []
  train(cfg, part, stop_after=3, log=logs.append)           # reuses the cache
  assert any(l.startswith("hidden cache: reusing") for l in logs), logs
  shutil.rmtree(os.path.join(part, "hidden_cache"))          # rebuilt: same rows, same stream
  logs = []
  train(cfg, part, log=logs.append)
  assert any(l.startswith("hidden cache: built") for l in logs), logs
  want, got = _losses(full), _losses(part)
  assert set(want) == set(got)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=str(k))

  # The same workdir with rows that changed meanwhile: the checkpointed position is refused.
  other = str(tmp_path / "other")
  train(cfg, other, stop_after=2, log=lambda s: None)
  shutil.rmtree(os.path.join(other, "hidden_cache"))
  row_data["rows"] = _random_rows(10, seed=5)
  with pytest.raises(cache_lib.HiddenCacheError, match="another fingerprint"):
    train(cfg, other, log=lambda s: None)
  with pytest.raises(ConfigError, match="train.hidden_cache"):    # switched off on resume
    train(_loop_cfg(hidden_cache=False), other, log=lambda s: None)


def test_shared_cache_dir_is_built_once_per_fingerprint(row_data, tmp_path):
  shared = str(tmp_path / "caches")
  cfg = _loop_cfg(hidden_cache_dir=shared, num_steps=2, eval_every=2)
  logs = []
  train(cfg, str(tmp_path / "a"), log=logs.append)
  assert any(l.startswith("hidden cache: built") for l in logs), logs
  (key,) = os.listdir(shared)
  assert not os.path.exists(tmp_path / "a" / "hidden_cache")
  logs = []                                   # another schedule, same source: reused
  train(_loop_cfg(hidden_cache_dir=shared, num_steps=3, eval_every=3), str(tmp_path / "b"),
        log=logs.append)
  assert any(l.startswith(f"hidden cache: reusing {os.path.join(shared, key)}") for l in logs), logs
  want = _losses(str(tmp_path / "a"))          # same rows, same seed: the first batch agrees
  np.testing.assert_allclose(_losses(str(tmp_path / "b"))[(1, "train")], want[(1, "train")],
                             rtol=1e-6)
  row_data["rows"] = _random_rows(10, seed=5)  # other rows: a second folder, the first kept
  logs = []
  train(cfg, str(tmp_path / "c"), log=logs.append)
  assert any(l.startswith("hidden cache: built") for l in logs), logs
  assert len(os.listdir(shared)) == 2 and key in os.listdir(shared)
  assert cache_lib.load(os.path.join(shared, key)).meta["rows"]["crc32"] != \
      cache_lib.load(os.path.join(shared, (set(os.listdir(shared)) - {key}).pop())).meta["rows"]["crc32"]


def test_source_fingerprint_follows_the_frozen_parameters_not_the_modules():
  # Stages attaching other modules (depth, init_from workdir) to one frozen
  # target share a cache; another frozen parameter or seq_len does not.
  tokenizer = tok.ByteTokenizer()
  params = {"embed": np.arange(6, dtype=np.float32), "block": np.ones((2, 3), np.float32)}
  def fp(p=params, depth=1, **train):
    cfg = tiny_config(mtp=dict(depth=depth, recursive_steps=1, distill_weight=1.0),
                      train={"freeze_backbone": True, "hidden_cache": True, "seq_len": T, **train})
    return cache_lib.source_fingerprint(cfg, tokenizer, p)
  a = fp(init_from="/x/d1")
  assert fp(depth=3, init_from="/x/d3") == a
  moved = {**params, "block": params["block"].copy()}
  moved["block"][1, 2] = 1.5
  assert fp(moved) != a
  assert fp(seq_len=2 * T) != a


def test_the_cache_key_leaves_out_the_draft_vocabulary():
  # h^0 reads no draft vocabulary: stages with another V' (issue 49's V' 4,096
  # and 8,192) share one cache; a backbone parameter still moves the key.
  from mtp import draft_vocab as dv
  from train.loop import cached_backbone
  cfg = tiny_config(mtp=dict(depth=1, recursive_steps=1, draft_vocab_size=48),
                    train={"freeze_backbone": True, "hidden_cache": True, "seq_len": T})
  tokenizer = tok.ByteTokenizer()
  model = build_model(cfg, 0)
  def key():
    frozen = cached_backbone(cfg, nnx.state(model, nnx.Param))
    return cache_lib.source_fingerprint(cfg, tokenizer, frozen)
  dv.set_draft_vocab(model, np.arange(40, 136, 2, dtype=np.int32))
  a = key()
  dv.set_draft_vocab(model, np.arange(50, 146, 2, dtype=np.int32))
  assert key() == a
  model.embed.embedding[...] = model.embed.embedding[...].at[0, 0].add(1.0)
  assert key() != a


def test_bad_combinations_are_clear_errors(tmp_path):
  with pytest.raises(ConfigError, match="train.hidden_cache.*freeze_backbone"):
    tiny_config(train=dict(hidden_cache=True))
  with pytest.raises(ConfigError, match="train.hidden_cache_dir='c' is not allowed: must be empty "
                                        "unless train.hidden_cache=True"):
    tiny_config(train=dict(freeze_backbone=True, hidden_cache_dir="c"))
  bpe = tiny_config(model=dict(tokenizer="bpe", num_tokens=260))
  with pytest.raises(ConfigError, match="model.tokenizer='bpe'.*train.init_from"):
    train(bpe, str(tmp_path / "wd"), log=lambda s: None)
  assert not os.path.exists(tmp_path / "wd")


# -- a BPE target end to end -------------------------------------------------------

DIMS = dict(heads=4, kv=2, hd=8, layers=2, d=32, ff=64)


@pytest.fixture(scope="module")
def bpe_target(tmp_path_factory):
  """A tiny random Llama with a trained byte-level BPE, imported with D = 1
  new module (last_block init)."""
  from mtp.importers import gguf as gi
  root = tmp_path_factory.mktemp("bpe_target")
  tk = tiny_bpe.train_tiny_bpe(300)
  tensors = tiny_bpe.random_llama_tensors(vocab=320, d=32, layers=2, heads=4, kv=2, hd=8, ff=64,
                                          tied=True)
  path = str(root / "tiny.gguf")
  tiny_bpe.write_gguf(path, tensors, tokenizer_meta=tiny_bpe.gguf_tokenizer_metadata(tk), **DIMS)
  return gi.import_gguf(path, str(root / "target"), mtp_depth=1, mtp_init="last_block")


STAGE_FLAGS = ["--config.train.freeze_backbone=true", "--config.train.hidden_cache=true",
               "--config.train.num_steps=3", "--config.train.batch_size=4",
               f"--config.train.seq_len={T}", "--config.train.log_every=1",
               "--config.train.eval_every=3", "--config.train.eval_batches=1",
               "--config.train.warmup_steps=1", "--config.mtp.distill_weight=1.0",
               "--config.mtp.recursive_steps=1", "--config.checkpoint.every_steps=3"]


def _stage_config_file(tmp_path, target):
  """A config file holding the imported target's config (its model section)."""
  from mtp import loading
  cfg, _ = loading.load_config(target)
  (tmp_path / "target.json").write_text(cfg.to_json())
  path = tmp_path / "stage.py"
  path.write_text("import json\nimport ml_collections\n\n\ndef get_config():\n"
                  f"  return ml_collections.ConfigDict(json.load(open({str(tmp_path / 'target.json')!r})))\n")
  return str(path)


@pytest.mark.cpu_only
@pytest.mark.slow
def test_bpe_stage_through_python_m_train(bpe_target, tmp_path):
  """``python -m train`` with train.init_from the imported BPE target and
  hidden_cache=true (epoch_rows / tokenizer-aware eval batches stand in from
  tests/stage_rows.py until the data pipeline offers them)."""
  stage = str(tmp_path / "stage")
  argv = ["--config", _stage_config_file(tmp_path, bpe_target), "--workdir", stage,
          f"--config.train.init_from={bpe_target}", "--config.mtp.draft_vocab_size=64"] + STAGE_FLAGS
  shim = ("import runpy, sys; import mtp.data as d; from tests import stage_rows; "
          "stage_rows.install_row_data(d); sys.argv = ['train'] + sys.argv[1:]; "
          "runpy.run_module('train', run_name='__main__')")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
  p = subprocess.run([sys.executable, "-c", shim] + argv, cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "nats/token" in p.stdout and "bits/byte" not in p.stdout, p.stdout
  assert "hidden cache: built" in p.stderr
  loaded = tok.load_tokenizer(stage)
  assert loaded.to_dict() == tok.load_tokenizer(bpe_target).to_dict()
  rows = [json.loads(l) for l in open(os.path.join(stage, "metrics.jsonl"))]
  ev = [r for r in rows if r["split"] == "eval"][-1]
  assert ev["step"] == 3 and "main/bits_per_byte" not in ev and np.isfinite(ev["mtp_1/teacher_kl"])
  meta = json.load(open(os.path.join(stage, "hidden_cache", "meta.json")))
  assert "init_from" not in meta["source"] and meta["shape"][2] == 32
  # V' attached in this stage (the target has none): chosen from the rows, stop ids in,
  # saved with the checkpoint and unchanged by training
  assert "draft vocabulary V': 64 most frequent" in p.stderr, p.stderr[-3000:]
  from mtp import draft_vocab, loading
  cfg, model, _ = loading.load_model(stage)
  ids = draft_vocab.draft_vocab_ids(model)
  assert cfg.mtp.draft_vocab_size == 64 and len(ids) == 64 and np.all(np.diff(ids) > 0)
  assert set(loaded.stop_ids) <= set(ids.tolist()) and ids.tolist() != list(range(64))
