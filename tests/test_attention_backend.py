"""``model.attention_impl = "auto"``: the choice per backend and dtype
(``mtp.model.resolve_attention_impl``, pure, so every backend is tested
here on the CPU); the path "auto" takes off the CPU ("dense") lowers a
cached decode step with no ``while`` at all, where "blockwise" has one per
attention layer; "dense" reads a bfloat16 cache without converting it to
float32 and against ``jax.nn.dot_product_attention`` is exact to float
rounding; "auto" on the CPU is "blockwise" bit for bit and agrees with
"dense" within the float32 bound of tests/test_precision.py."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp import model as model_lib
from tests import test_precision
from tests.conftest import tiny_config

# -- the choice ----------------------------------------------------------------

# (backend, dtype) -> what "auto" runs. "cuda": an NVIDIA GPU of compute
# capability >= 8.0 (``attention_backend``); "gpu": any other GPU.
AUTO = {
    ("cpu", "float32"): "blockwise", ("cpu", "bfloat16"): "blockwise",
    ("cpu", "float16"): "blockwise",
    ("cuda", "float32"): "dense", ("cuda", "bfloat16"): "cudnn", ("cuda", "float16"): "cudnn",
    ("gpu", "float32"): "dense", ("gpu", "bfloat16"): "dense", ("gpu", "float16"): "dense",
    ("tpu", "float32"): "dense", ("tpu", "bfloat16"): "dense", ("tpu", "float16"): "dense",
}


@pytest.mark.parametrize("backend,dtype", sorted(AUTO))
def test_resolve_auto_per_backend_and_dtype(backend, dtype):
  """CPU: "blockwise"; NVIDIA GPU with a 16-bit dtype: "cudnn"; everywhere
  else "dense" (never "cudnn" where it has no kernel: float32, other
  GPUs, TPU). Dtype names and dtypes alike."""
  want = AUTO[(backend, dtype)]
  assert model_lib.resolve_attention_impl("auto", backend, dtype) == want
  assert model_lib.resolve_attention_impl("auto", backend, jnp.dtype(dtype), 64) == want


def test_resolve_cudnn_only_for_head_dims_it_takes():
  """cuDNN's flash attention takes H % 8 == 0, H <= 128: other head dims
  get "dense"."""
  for h in (8, 64, 128):
    assert model_lib.resolve_attention_impl("auto", "cuda", "bfloat16", h) == "cudnn"
  for h in (4, 12, 136, 256):
    assert model_lib.resolve_attention_impl("auto", "cuda", "bfloat16", h) == "dense"


def test_resolve_keeps_explicit_values_and_refuses_others():
  for impl in ("blockwise", "dense", "cudnn"):
    for backend in ("cpu", "cuda", "tpu", None):
      assert model_lib.resolve_attention_impl(impl, backend, "float32") == impl
  with pytest.raises(ValueError, match=r"model\.attention_impl='flash'.*'auto'.*'cudnn'"):
    model_lib.resolve_attention_impl("flash", "cpu", "float32")


def test_attention_backend_names_this_platform():
  """Off the GPU it is ``jax.default_backend()`` ("cpu" in the CPU suite)."""
  backend = model_lib.attention_backend()
  if jax.default_backend() == "gpu":
    assert backend in ("cuda", "gpu")
  else:
    assert backend == jax.default_backend()


# -- the lowered decode step ---------------------------------------------------

S = 64            # cache slots
G = 2             # drafts per round: a verify block is G + 1 tokens


def _decode_step(impl: str, t: int, dtype: str = "float32"):
  """The lowered cached decode step of a tiny MTP model (depth G): T = t
  query tokens at positions 10.. and 20.. of 2 rows against caches of S
  slots through the backbone (+ FeatureFuse), the main head, module 1 and
  its head. Returns the ``jax.stages.Lowered``."""
  cfg = tiny_config(model=dict(attention_impl=impl, dtype=dtype),
                    mtp=dict(depth=G, feature_layers="0"))
  graphdef, state = nnx.split(model_lib.build_model(cfg))
  caches = model_lib.init_layer_caches(cfg.model, cfg.model.num_layers, 2, S)
  mcache = model_lib.init_layer_caches(cfg.model, 1, 2, S)[0]

  def step(state, tokens, positions, caches, mcache):
    m = nnx.merge(graphdef, state)
    h0, x, caches = m.backbone_features(tokens, positions, cache=caches)
    hk, mcache = m.mtp_forward(1, x, tokens, positions, cache=mcache)
    return m.head(h0), m.mtp_head(1, hk), caches, mcache
  tokens = jnp.zeros((2, t), jnp.int32)
  positions = jnp.asarray([[10], [20]], jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]
  return jax.jit(step).lower(state, tokens, positions, caches, mcache)


def _whiles(lowered) -> tuple[int, int]:
  """(``stablehlo.while`` ops in the StableHLO, ``while`` instructions in
  the compiled HLO)."""
  hlo = lowered.compile().as_text()
  return lowered.as_text().count("stablehlo.while"), len(re.findall(r"\bwhile\(", hlo))


# attention layers of one decode step: the backbone's 2 and module 1's
_LAYERS = 2 + 1


@pytest.mark.parametrize("t", [1, G + 1], ids=["ar_step", "verify_block"])
def test_accelerator_path_has_no_loop_in_a_decode_step(t, monkeypatch):
  """"dense", and "auto" resolved for a GPU or TPU, lower a decode step (a
  one-token AR step and a G+1-token verify block) with no while loop at
  all, in the StableHLO and in the compiled HLO: no trip count for the
  host to decide. "blockwise" has one per attention layer (so the count
  can fail)."""
  assert _whiles(_decode_step("dense", t)) == (0, 0)
  assert _whiles(_decode_step("blockwise", t)) == (_LAYERS, _LAYERS)
  for backend in ("cuda", "gpu", "tpu"):      # float32: "dense" on every accelerator
    monkeypatch.setattr(model_lib, "attention_backend", lambda b=backend: b)
    assert _whiles(_decode_step("auto", t)) == (0, 0), backend


def test_auto_on_cpu_lowers_the_blockwise_program(monkeypatch):
  """On the CPU "auto" is "blockwise": the same program, text for text."""
  monkeypatch.setattr(model_lib, "attention_backend", lambda: "cpu")
  assert _decode_step("auto", 1).as_text() == _decode_step("blockwise", 1).as_text()


_CACHE_CONVERT = re.compile(
    rf"stablehlo\.convert .*\(tensor<2x{S}x2x8xbf16>\) -> tensor<2x{S}x2x8xf32>")


def test_dense_reads_a_bfloat16_cache_as_it_is():
  """A bfloat16 model's "dense" step converts no cache tensor [B, S, K, H]
  to float32: its two einsums per layer take the bfloat16 cache and
  accumulate in float32. "blockwise" converts every block it reads (here
  one block of all S slots, block size 128 > S), so the check can fail."""
  dense = _decode_step("dense", 1, "bfloat16").as_text()
  assert not _CACHE_CONVERT.search(dense)
  dots = [l for l in dense.splitlines() if "dot_general" in l and "2x64x2x8xbf16" in l]
  assert len(dots) == 2 * _LAYERS and all("xf32>" in l.split("->")[-1] for l in dots), dots
  assert _CACHE_CONVERT.search(_decode_step("blockwise", 1, "bfloat16").as_text())


def test_auto_matmuls_carry_the_precision():
  """"auto" (here: this backend's choice) keeps ``model.matmul_precision``
  on every matmul of the cached calls, counted as in tests/test_precision.py."""
  tp = test_precision
  for precision, expected in (("highest", "HIGHEST"), ("default", "DEFAULT")):
    cfg = tp._cfg(precision, attention_impl="auto")
    want = cfg.model.num_layers * tp._BLOCK + tp._FUSE + tp._HEAD + tp._MODULE + tp._HEAD
    assert tp._dot_precisions(tp._decode_step_text(cfg)) == {expected: want}


# -- "dense" against jax.nn.dot_product_attention ------------------------------

def _qkv(rng, b, t, n, k, h, s, dtype=jnp.float32):
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  return f(b, t, n, h), f(b, s, k, h), f(b, s, k, h)


@pytest.mark.parametrize("n,k", [(4, 2), (4, 4), (6, 1)])
def test_dense_equals_dot_product_attention(n, k):
  """``dense_attention`` (own einsums, float32 reductions) against
  ``jax.nn.dot_product_attention`` (XLA) over the same mask: positional
  (ragged rows, T = 1 and T = 3) and explicit masks, GQA, MHA and MQA.
  float32 to 2e-6; bfloat16 within one bfloat16 rounding of the output
  (|y| <= max |v|, u = 2^-8) plus the scores' rounding, checked against
  the float32 result."""
  rng = np.random.default_rng(n * 10 + k)
  s = 50
  for t in (1, 3):
    q, keys, values = _qkv(rng, 3, t, n, k, 8, s)
    pos = jnp.asarray(np.asarray([0, 17, s - t])[:, None] + np.arange(t)[None, :], jnp.int32)
    masks = [None, jnp.asarray(rng.random((3, t, s)) < 0.3).at[:, :, 0].set(True)]
    for mask in masks:
      full = (jnp.arange(s)[None, None, None, :] <= pos[:, None, :, None] if mask is None
              else mask[:, None])
      ref = jax.nn.dot_product_attention(q, keys, values, mask=full)
      out = model_lib.dense_attention(q, keys, values, pos, mask)
      np.testing.assert_allclose(out, ref, atol=2e-6, rtol=0)
      bf = [x.astype(jnp.bfloat16) for x in (q, keys, values)]
      out16 = model_lib.dense_attention(*bf, pos, mask)
      assert out16.dtype == jnp.bfloat16
      tol = 4 * 2.0 ** -8 * float(jnp.abs(values).max())
      np.testing.assert_allclose(out16.astype(jnp.float32), ref, atol=tol, rtol=0)


def test_dense_gives_zeros_where_nothing_is_visible():
  """A query whose mask row is empty gets zeros, as from "blockwise"."""
  q, keys, values = _qkv(np.random.default_rng(0), 1, 2, 4, 2, 8, 16)
  mask = jnp.zeros((1, 2, 16), bool).at[0, 0, 3].set(True)
  pos = jnp.zeros((1, 2), jnp.int32)
  out = model_lib.dense_attention(q, keys, values, pos, mask)
  assert bool(jnp.all(out[0, 1] == 0)) and bool(jnp.all(jnp.isfinite(out)))
  blockwise = model_lib.blockwise_attention(q, keys, values, pos, mask)
  np.testing.assert_array_equal(out[0, 1], blockwise[0, 1])


# -- greedy float32 decoding: "auto" against "blockwise" and "dense" ----------

@pytest.mark.cpu_only
def test_auto_on_cpu_decodes_as_blockwise_and_within_the_bound_of_dense():
  """Greedy AR through the model API (``tests.test_precision._greedy_ar``,
  cache of 64 slots): "auto" on the CPU gives the same logits as
  "blockwise" bit for bit; against "dense" the same tokens and logits
  within test_precision's float32 bound 8 u sqrt(n) ||h|| max_v ||E_v||
  (the reduction order inside attention is all that differs)."""
  tp = test_precision
  auto = tp._greedy_ar(64, "auto", 128)
  blockwise = tp._greedy_ar(64, "blockwise", 128)
  dense = tp._greedy_ar(64, "dense", 128)
  for a, b in zip(auto, blockwise):
    np.testing.assert_array_equal(a, b)
  tokens, logits, hidden, _, embedding = auto
  finite = np.isfinite(logits)
  h_norm = float(np.linalg.norm(hidden, axis=-1).max())
  e_norm = float(np.linalg.norm(embedding, axis=-1).max())
  u, n, layers = 2.0 ** -24, tp.PROMPT + tp.NEW, 2
  bound = 2 * 2 * layers * u * math.sqrt(n) * h_norm * e_norm
  np.testing.assert_array_equal(dense[0], tokens)
  np.testing.assert_array_equal(np.isfinite(dense[1]), finite)
  diff = np.abs(np.where(finite, dense[1], 0.0) - np.where(finite, logits, 0.0)).max()
  assert diff <= bound, (diff, bound)
