"""Attention over the KV cache: the blockwise path
(``mtp.model.blockwise_attention``, reading only the blocks that can be
visible) and "auto" (``cached_attention``'s choice for this backend) equal
the dense masked path (``mtp.model.dense_attention``) within float
tolerance, for random lengths, ragged batches, tree masks, block edges and
the last slot; the model's cached pieces agree under "dense", "blockwise"
and "auto"; the config field is validated. ("cudnn" needs an NVIDIA GPU:
only its config rule is tested here.)"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from decode import tree as tree_lib
from decode.tree_spec import TreeSpec
from mtp import config as config_lib
from mtp import model as model_lib
from tests.conftest import tiny_config

ATOL = 2e-5


def _qkv(rng, b, t, n, k, h, s):
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return f(b, t, n, h), f(b, s, k, h), f(b, s, k, h)


_blockwise = jax.jit(model_lib.blockwise_attention, static_argnames="block_size")
_cached = jax.jit(model_lib.cached_attention, static_argnames=("impl", "block_size"))


def _dense(q, keys, values, positions, mask=None):
  """The reference: the dense masked path, jitted (one executable per shape, not per op)."""
  return _cached(q, keys, values, positions, mask, impl="dense")


def _impl(impl):
  """The attention under test: ``blockwise_attention`` itself, or
  ``cached_attention`` with ``impl`` ("auto": this backend's choice)."""
  if impl == "blockwise":
    return _blockwise
  return lambda *a, block_size: _cached(*a, impl=impl, block_size=block_size)


IMPLS = ["blockwise", "auto"]


def _contiguous(starts, t):
  return jnp.asarray(np.asarray(starts)[:, None] + np.arange(t)[None, :], jnp.int32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block", [1, 7, 16, 64, 1000])
def test_blockwise_equals_dense_random_ragged_lengths(block, impl):
  """Rows at different positions (a ragged batch), random query lengths,
  an S the block size does not divide, and S > the block size or not."""
  rng = np.random.default_rng(block)
  for trial in range(4):
    b, t, s = 3, int(rng.integers(1, 6)), int(rng.integers(40, 120))
    q, keys, values = _qkv(rng, b, t, 4, 2, 8, s)
    starts = rng.integers(0, s - t + 1, b)
    pos = _contiguous(starts, t)
    np.testing.assert_allclose(_impl(impl)(q, keys, values, pos, block_size=block),
                               _dense(q, keys, values, pos), atol=ATOL, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block", [16, 32])
def test_blockwise_equals_dense_at_block_edges_and_last_slot(block, impl):
  """Queries at the last slot of a block, the first slot of the next, a
  verify block that straddles an edge, position 0 and S - 1."""
  rng = np.random.default_rng(0)
  s, t = 96, 4
  q, keys, values = _qkv(rng, 6, t, 4, 2, 8, s)
  starts = [block - 1, block, block - 2, 0, s - t, 2 * block - 1]
  pos = _contiguous(starts, t)
  np.testing.assert_allclose(_impl(impl)(q, keys, values, pos, block_size=block),
                             _dense(q, keys, values, pos), atol=ATOL, rtol=0)
  q1, k1, v1 = _qkv(rng, 4, 1, 4, 2, 8, s)
  pos1 = jnp.asarray([[block - 1], [block], [s - 1], [0]], jnp.int32)
  np.testing.assert_allclose(_impl(impl)(q1, k1, v1, pos1, block_size=block),
                             _dense(q1, k1, v1, pos1), atol=ATOL, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_blockwise_mha_and_mqa(impl):
  """GQA grouping at K = N (multi-head) and K = 1 (multi-query)."""
  rng = np.random.default_rng(1)
  for n, k in ((4, 4), (6, 1)):
    q, keys, values = _qkv(rng, 2, 3, n, k, 8, 50)
    pos = _contiguous([5, 40], 3)
    np.testing.assert_allclose(_impl(impl)(q, keys, values, pos, block_size=16),
                               _dense(q, keys, values, pos), atol=ATOL, rtol=0)


def test_blockwise_never_reads_blocks_past_the_furthest_position():
  """NaN in every block past the batch's furthest visible slot changes
  nothing: those blocks are not read (the dense path multiplies them by
  zero weights and returns NaN)."""
  rng = np.random.default_rng(2)
  s, block = 128, 16
  q, keys, values = _qkv(rng, 2, 2, 4, 2, 8, s)
  pos = _contiguous([10, 37], 2)                          # furthest slot 38: blocks 0..2
  ref = _dense(q, keys, values, pos)
  bad_k, bad_v = keys.at[:, 48:].set(jnp.nan), values.at[:, 48:].set(jnp.nan)
  out = _blockwise(q, bad_k, bad_v, pos, block_size=block)
  assert bool(jnp.all(jnp.isfinite(out)))
  np.testing.assert_allclose(out, ref, atol=ATOL, rtol=0)
  assert not bool(jnp.all(jnp.isfinite(_dense(q, bad_k, bad_v, pos))))
  mask = jnp.arange(s)[None, None, :] <= pos[:, :, None]  # the same rule as an explicit mask
  out = _blockwise(q, bad_k, bad_v, pos, mask, block_size=block)
  np.testing.assert_allclose(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_blockwise_equals_dense_random_masks(impl):
  """Explicit masks [B, T, S] with scattered visible slots (every query sees
  one at least), including one that sees only slot S - 1."""
  rng = np.random.default_rng(3)
  s = 77
  q, keys, values = _qkv(rng, 3, 5, 4, 2, 8, s)
  mask = rng.random((3, 5, s)) < 0.15
  mask[:, :, 0] = True
  mask[1, 2] = False
  mask[1, 2, s - 1] = True
  mask = jnp.asarray(mask)
  pos = jnp.zeros((3, 5), jnp.int32)                      # ignored when a mask is given
  for block in (8, 32, 77, 128):
    np.testing.assert_allclose(_impl(impl)(q, keys, values, pos, mask, block_size=block),
                               _dense(q, keys, values, pos, mask), atol=ATOL, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("branching", [(3, 2), (2, 2, 2)])
def test_blockwise_equals_dense_tree_masks(branching, impl):
  """The token-tree masks of decode/tree.py: the verify block's
  (``verify_mask``) and module k's (``module_mask``), ragged rows."""
  spec = TreeSpec(branching)
  rng = np.random.default_rng(len(branching))
  s, block = 160, 32
  n = jnp.asarray([3, 31, 33, 130], jnp.int32)            # rows around block edges
  vm = tree_lib.verify_mask(spec, n, s)
  t = vm.shape[1]
  q, keys, values = _qkv(rng, 4, t, 4, 2, 8, s)
  pos = jnp.asarray(np.asarray(n)[:, None] - 1 + np.concatenate([[0], spec.depths])[None, :],
                    jnp.int32)
  np.testing.assert_allclose(_impl(impl)(q, keys, values, pos, vm, block_size=block),
                             _dense(q, keys, values, pos, vm), atol=ATOL, rtol=0)
  window = len(branching) + 1
  for k in range(2, len(branching) + 1):
    c = n - k
    mm = tree_lib.module_mask(spec, k, window, c, n, s)
    qk, kk, vk = _qkv(rng, 4, mm.shape[1], 4, 2, 8, s)
    pk = jnp.zeros(mm.shape[:2], jnp.int32)
    np.testing.assert_allclose(_impl(impl)(qk, kk, vk, pk, mm, block_size=block),
                               _dense(qk, kk, vk, pk, mm), atol=ATOL, rtol=0)


def _models(block=16, **model):
  """The tiny test model built from one seed under each implementation that
  runs here: dense, blockwise and auto."""
  out = {}
  for impl in ("dense", "blockwise", "auto"):
    cfg = tiny_config(model=dict(attention_impl=impl, attention_block_size=block, **model))
    out[impl] = model_lib.build_model(cfg, seed=4)
  return out


@nnx.jit
def _cached_pieces(m, x, x_next, pos, caches, mcache):
  """``backbone`` then MTP module 1 through their caches, in one program (as decoding runs them)."""
  h, caches = m.backbone(x, pos, cache=caches)
  hk, mcache = m.mtp_forward(1, h, x_next, pos, cache=mcache)
  return h, caches, hk, mcache


@nnx.jit
def _logits(m, x):
  return m(x).logits


def test_model_cached_pieces_agree_across_impls():
  """Prefill then AR steps and a verify block, ragged rows, through
  ``backbone`` and ``mtp_forward`` with caches: dense, blockwise and auto
  give the same hidden states and caches; the cache-free forward
  (training) is identical."""
  models = _models(block=16)
  cfg = models["dense"].cfg
  rng = np.random.default_rng(5)
  b, s = 3, 80
  toks = jnp.asarray(rng.integers(3, 256, (b, s)), jnp.int32)
  outs = {}
  for impl, m in models.items():
    caches = model_lib.init_layer_caches(cfg, cfg.num_layers, b, s)
    mcache = model_lib.init_layer_caches(cfg, 1, b, s)[0]
    p = 33
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    h, caches, hk, mcache = _cached_pieces(m, toks[:, :p], toks[:, 1:p + 1], pos, caches, mcache)
    hs = [h, hk]
    starts = jnp.asarray([p, p - 1, p - 17], jnp.int32)   # rows at different lengths
    for step, t in enumerate((1, 4, 1, 3)):
      pos = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
      h, caches, hk, mcache = _cached_pieces(m, jnp.take_along_axis(toks, pos, 1),
                                             jnp.take_along_axis(toks, pos + 1, 1), pos, caches,
                                             mcache)
      hs += [h, hk]
      starts = starts + t
    outs[impl] = (hs, caches, mcache, _logits(m, toks[:, :40]))
  hd, cd, md, ld = outs["dense"]
  for impl in ("blockwise", "auto"):
    hb, cb, mb, lb = outs[impl]
    for x, y in zip(hd, hb):
      np.testing.assert_allclose(x, y, atol=1e-4, rtol=0, err_msg=impl)
    for x, y in zip(jax.tree.leaves((cd, md)), jax.tree.leaves((cb, mb))):
      np.testing.assert_allclose(x, y, atol=1e-4, rtol=0, err_msg=impl)
    np.testing.assert_array_equal(ld, lb)


def test_attention_impl_config_validation():
  """Default "auto" (also for a config.json written before the field had
  it: a missing field gets the default, a named one keeps its value);
  "cudnn" only for 16-bit models ("auto" for any dtype); one error line
  naming the field and the allowed values."""
  assert config_lib.ModelConfig().attention_impl == "auto"
  assert config_lib.ATTENTION_IMPLS == ("auto", "blockwise", "dense", "cudnn")
  for impl in ("auto", "blockwise", "dense"):
    for dtype in ("float32", "bfloat16"):
      cfg = tiny_config(model=dict(attention_impl=impl, dtype=dtype))
      assert cfg.model.attention_impl == impl
  old = tiny_config().to_dict()
  del old["model"]["attention_impl"]
  assert config_lib.from_dict(old).model.attention_impl == "auto"
  old["model"]["attention_impl"] = "blockwise"
  assert config_lib.from_dict(old).model.attention_impl == "blockwise"
  with pytest.raises(config_lib.ConfigError) as e:
    tiny_config(model=dict(attention_impl="flash"))
  assert "\n" not in str(e.value)
  with pytest.raises(config_lib.ConfigError,
                     match=r"model\.attention_impl='flash'.*auto.*blockwise.*dense.*cudnn"):
    tiny_config(model=dict(attention_impl="flash"))
  with pytest.raises(config_lib.ConfigError, match=r"model\.attention_impl='cudnn'.*bfloat16"):
    tiny_config(model=dict(attention_impl="cudnn"))
  assert tiny_config(model=dict(attention_impl="cudnn", dtype="bfloat16")).model.attention_impl == "cudnn"
  with pytest.raises(config_lib.ConfigError, match=r"model\.attention_block_size"):
    tiny_config(model=dict(attention_block_size=0))
  # not architecture: a checkpoint restores under any choice
  a, b = tiny_config(), tiny_config(model=dict(attention_impl="dense", attention_block_size=64))
  assert config_lib.architecture_mismatches(a, b) == []
  with pytest.raises(ValueError, match="attention_impl"):
    model_lib.cached_attention(*_qkv(np.random.default_rng(0), 1, 1, 2, 1, 4, 8),
                               jnp.zeros((1, 1), jnp.int32), impl="flash")
