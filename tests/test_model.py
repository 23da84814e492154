"""Model structure, packing isolation and KV-cache equivalence."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp import model as model_lib
from mtp import tokenizer as tok
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def cfg():
  return tiny_config()


@pytest.fixture(scope="module")
def model(cfg):
  return model_lib.build_model(cfg, seed=1)


@nnx.jit
def _forward_arrays(model, tokens, positions=None, segment_ids=None):
  out = model(tokens, positions, segment_ids)
  return out.logits, out.mtp_logits, out.hidden


def forward(model, tokens, positions=None, segment_ids=None) -> types.SimpleNamespace:
  """``model(tokens, positions, segment_ids)`` as one compiled program per
  shape (eagerly every operation compiles on its own): logits, mtp_logits,
  hidden."""
  logits, mtp_logits, hidden = _forward_arrays(model, tokens, positions, segment_ids)
  return types.SimpleNamespace(logits=logits, mtp_logits=mtp_logits, hidden=hidden)


def _rand_tokens(rng, b, t):
  return jnp.asarray(rng.integers(0, 256, (b, t)), jnp.int32)


def test_shapes_and_padding_mask(cfg, model):
  toks = _rand_tokens(np.random.default_rng(0), 2, 12)
  out = forward(model, toks)
  assert out.logits.shape == (2, 12, cfg.model.vocab_size) and out.logits.dtype == jnp.float32
  assert len(out.mtp_logits) == cfg.mtp.depth and len(out.hidden) == cfg.mtp.depth + 1
  # vocabulary padding, PAD, BOS and non-UTF-8 bytes have probability exactly
  # zero at every head; everything else is finite
  allowed = tok.emittable_mask(cfg.model.vocab_size)
  for logits in (out.logits, *out.mtp_logits):
    probs = jax.nn.softmax(logits, -1)
    assert float(jnp.max(probs[..., ~allowed])) == 0.0
    assert bool(jnp.all(jnp.isfinite(logits[..., allowed])))


def test_never_emitted_ids():
  allowed = tok.emittable_mask(264)
  never = set(np.nonzero(~allowed)[0])
  assert never == {tok.PAD_ID, tok.BOS_ID, 0xC0, 0xC1, *range(0xF5, 0x100), *range(259, 264)}
  assert allowed[tok.EOS_ID] and allowed[ord("a")] and allowed[0x80] and allowed[0xF4]
  # no UTF-8 text contains a never-emitted byte (every code point; the lone
  # surrogates have no UTF-8 form and are refused, issue 23)
  text = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
  used = set(tok.ByteTokenizer().encode(text, add_bos=False).tolist())
  with pytest.raises(ValueError, match="lone surrogate"):
    tok.ByteTokenizer().encode(chr(0xD800))
  assert used.isdisjoint(never) and used == set(range(256)) - set(tok.INVALID_UTF8_BYTES)
  with pytest.raises(ValueError, match="vocab_size"):
    tok.emittable_mask(100)


def test_depth_zero_is_plain_lm(cfg):
  m = model_lib.build_model(cfg.replace(mtp=dict(depth=0)), seed=1)
  out = m(_rand_tokens(np.random.default_rng(0), 1, 8))
  assert out.mtp_logits == () and len(out.hidden) == 1
  assert model_lib.count_params(m)["mtp"] == 0


def test_untied_head_has_its_own_weights(cfg):
  m = model_lib.build_model(cfg.replace(model=dict(tie_embeddings=False)), seed=1)
  assert hasattr(m, "lm_head")
  tied = model_lib.count_params(model_lib.build_model(cfg, seed=1))["total"]
  assert model_lib.count_params(m)["total"] == tied + cfg.model.d_model * cfg.model.vocab_size


def test_causality(model):
  toks = _rand_tokens(np.random.default_rng(1), 1, 10)
  out_a = forward(model, toks)
  out_b = forward(model, toks.at[0, 7].set((toks[0, 7] + 1) % 256))
  # main head and h^0 at positions < 7 never see token 7
  np.testing.assert_allclose(out_a.logits[0, :7], out_b.logits[0, :7], atol=1e-6)
  # depth k at position i reads t_{i+k}: positions < 7-k are unaffected
  for k, (la, lb) in enumerate(zip(out_a.mtp_logits, out_b.mtp_logits), start=1):
    np.testing.assert_allclose(la[0, :7 - k], lb[0, :7 - k], atol=1e-6)
    assert not np.allclose(la[0, 7 - k], lb[0, 7 - k])


def test_packed_documents_are_isolated(model):
  """A packed row gives each document the same outputs as running it alone
  (segment mask + positions restarting at 0), wherever targets are valid."""
  rng = np.random.default_rng(2)
  doc1, doc2 = _rand_tokens(rng, 1, 7), _rand_tokens(rng, 1, 9)
  packed = jnp.concatenate([doc1, doc2], 1)
  seg = jnp.asarray([[1] * 7 + [2] * 9], jnp.int32)
  pos = jnp.asarray([list(range(7)) + list(range(9))], jnp.int32)
  out = forward(model, packed, pos, seg)
  alone1, alone2 = forward(model, doc1), forward(model, doc2)
  np.testing.assert_allclose(out.logits[0, :7], alone1.logits[0], atol=1e-5)
  np.testing.assert_allclose(out.logits[0, 7:], alone2.logits[0], atol=1e-5)
  for k in range(1, model.mtp_depth + 1):
    # depth k at i needs t_{i+k} inside the document: positions < len - k
    np.testing.assert_allclose(out.mtp_logits[k - 1][0, :7 - k], alone1.mtp_logits[k - 1][0, :7 - k],
                               atol=1e-5)
    np.testing.assert_allclose(out.mtp_logits[k - 1][0, 7:16 - k],
                               alone2.mtp_logits[k - 1][0, :9 - k], atol=1e-5)


@nnx.jit
def _backbone(model, tokens, positions, cache):
  return model.backbone(tokens, positions, cache=cache)


@nnx.jit
def _tree_backbone(model, tokens, positions, cache, write_offsets, mask):
  return model.backbone(tokens, positions, cache=cache, write_offsets=write_offsets, mask=mask)


@functools.partial(nnx.jit, static_argnums=1)
def _mtp_forward_and_head(model, k, h, tokens, positions, cache):
  hk, cache = model.mtp_forward(k, h, tokens, positions, cache=cache)
  return hk, cache, model.mtp_head(k, hk)


def test_kv_cache_matches_cache_free_forward(cfg, model):
  """Backbone and every MTP module run chunk by chunk through their caches
  (per-row offsets, with stale entries left behind by a rollback) equal the
  cache-free forward (each piece jitted, as decoding runs it)."""
  rng = np.random.default_rng(3)
  b, t, s = 2, 14, 32
  toks = _rand_tokens(rng, b, t)
  full = forward(model, toks)
  full_hidden, full_mtp_logits = full.hidden, full.mtp_logits
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  caches = model_lib.init_layer_caches(cfg.model, cfg.model.num_layers, b, s)
  mtp_caches = [model_lib.init_layer_caches(cfg.model, 1, b, s)[0] for _ in range(model.mtp_depth)]
  # write garbage ahead (as a rejected speculative block would), then roll back
  junk = _rand_tokens(rng, b, 6)
  _, caches = _backbone(model, junk, pos[:, 5:11], caches)
  hs = []
  for lo, hi in [(0, 5), (5, 6), (6, 11), (11, 14)]:
    h, caches = _backbone(model, toks[:, lo:hi], pos[:, lo:hi], caches)
    hs.append(h)
  h0 = jnp.concatenate(hs, 1)
  np.testing.assert_allclose(h0, full_hidden[0], atol=2e-5)
  h_prev = h0
  for k in range(1, model.mtp_depth + 1):
    n = t - k   # positions whose input t_{i+k} exists
    outs, heads = [], []
    for lo, hi in [(0, 4), (4, n)]:
      hk, mtp_caches[k - 1], head = _mtp_forward_and_head(
          model, k, h_prev[:, lo:hi], toks[:, lo + k:hi + k], pos[:, lo:hi], mtp_caches[k - 1])
      outs.append(hk)
      heads.append(head)
    hk = jnp.concatenate(outs, 1)
    np.testing.assert_allclose(hk, full_hidden[k][:, :n], atol=2e-5)
    np.testing.assert_allclose(jnp.concatenate(heads, 1), full_mtp_logits[k - 1][:, :n], atol=1e-4)
    h_prev = hk


def test_per_row_offsets(cfg, model):
  """Rows at different lengths write at their own offsets."""
  rng = np.random.default_rng(4)
  toks = _rand_tokens(rng, 2, 10)
  full_hidden = forward(model, toks).hidden
  caches = model_lib.init_layer_caches(cfg.model, cfg.model.num_layers, 2, 16)
  # row 0 has 4 tokens cached, row 1 has 6
  pre = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
  _, caches = _backbone(model, toks[:, :6], pre, caches)
  pos = jnp.asarray([[4, 5, 6], [6, 7, 8]], jnp.int32)
  new = jnp.stack([toks[0, 4:7], toks[1, 6:9]])
  h, _ = _backbone(model, new, pos, caches)
  np.testing.assert_allclose(h[0], full_hidden[0][0, 4:7], atol=2e-5)
  np.testing.assert_allclose(h[1], full_hidden[0][1, 6:9], atol=2e-5)


def test_gqa_equals_repeated_kv_heads(cfg):
  """GQA with K kv heads equals MHA whose K/V projections repeat each head N/K times."""
  m = model_lib.build_model(cfg, seed=3)
  mha_cfg = cfg.replace(model=dict(num_kv_heads=cfg.model.num_heads))
  mha = model_lib.build_model(mha_cfg, seed=3)
  rep = cfg.model.num_heads // cfg.model.num_kv_heads
  h = cfg.model.head_dim
  src, dst = nnx.state(m, nnx.Param), nnx.state(mha, nnx.Param)
  def expand(w):   # [D, K*H] -> [D, N*H]
    d = w.shape[0]
    return jnp.repeat(w.reshape(d, -1, h), rep, axis=1).reshape(d, -1)
  flat_src = dict(nnx.to_flat_state(src))
  new = {}
  for path, var in nnx.to_flat_state(dst):
    v = flat_src[path][...]
    if path[-2] in ("k_proj", "v_proj"):
      v = expand(v)
    new[path] = v
  for path, var in nnx.to_flat_state(dst):
    var.set_value(new[path])
  nnx.update(mha, dst)
  toks = _rand_tokens(np.random.default_rng(5), 1, 9)
  np.testing.assert_allclose(forward(m, toks).logits, forward(mha, toks).logits, atol=1e-5)


def test_tree_block_with_write_offsets_and_mask(cfg, model):
  """A token tree in one call (decode/tree.py): the nodes of several branches
  share positions, are written at contiguous scratch slots (``write_offsets``)
  and see the cached prefix, their ancestors and themselves (``mask``); each
  node's output equals the cache-free forward of prefix + its branch. Rows
  have different prefix lengths."""
  rng = np.random.default_rng(6)
  b, s = 2, 32
  lens = np.array([5, 8])
  toks = _rand_tokens(rng, b, 12)
  # tree: root r (the last prefix token), children c0, c1, grandchild g under c1
  kids = _rand_tokens(rng, b, 3)                 # tokens of c0, c1, g
  parent = [-1, 0, 0, 2]                         # block index of each node's parent
  depth = np.array([0, 1, 1, 2])
  anc = np.zeros((4, 4), bool)
  for i in range(4):
    j = i
    while j >= 0:
      anc[i, j] = True
      j = parent[j]
  caches = model_lib.init_layer_caches(cfg.model, cfg.model.num_layers, b, s)
  pre = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (b, 8))
  _, caches = _backbone(model, toks[:, :8], pre, caches)   # row 0: only 0..3 valid
  root = jnp.stack([toks[0, lens[0] - 1], toks[1, lens[1] - 1]])
  block = jnp.concatenate([root[:, None], kids], 1)
  offs = jnp.asarray(lens - 1, jnp.int32)
  pos = offs[:, None] + jnp.asarray(depth, jnp.int32)[None]
  slot = jnp.arange(s)[None, None, :]
  tree_vis = np.zeros((b, 4, s), bool)
  for r in range(b):
    tree_vis[r, :, lens[r] - 1:lens[r] + 3] = anc
  mask = (slot < offs[:, None, None]) | jnp.asarray(tree_vis)
  h, _ = _tree_backbone(model, block, pos, caches, offs, mask)
  for r in range(b):
    prefix = np.asarray(toks[r, :lens[r]])
    for i in range(4):
      path = [i]
      while parent[path[-1]] > 0:
        path.append(parent[path[-1]])
      branch = [int(block[r, j]) for j in reversed(path) if j > 0]
      seq = np.concatenate([prefix, branch])
      # the cache-free forward of seq, in a buffer of 12 (causal: the tail is not seen)
      buf = jnp.asarray(np.pad(seq, (0, 12 - len(seq)))[None], jnp.int32)
      ref = forward(model, buf).hidden[0][0, len(seq) - 1]
      np.testing.assert_allclose(h[r, i], ref, atol=2e-5, err_msg=f"row {r} node {i}")
