"""Matmul precision (``model.matmul_precision``): every dot_general of the
model's programs (training forward and gradient, cached decode steps,
recursive steps, both heads, tied and untied) carries the configured
``jax.lax.Precision`` in the lowered StableHLO; greedy float32 AR decoding
gives the same tokens, and logits within a derived float32 bound, across
KV-cache sizes, attention implementations and block sizes; configs without
the field (older checkpoints, exports, imports) get "highest"; a bad value
is one ConfigError line naming the field."""

import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp import config as config_lib
from mtp import model as model_lib
from tests.conftest import tiny_config

# -- the lowered programs ------------------------------------------------------

_PRECISION = re.compile(r"precision = \[(\w+), (\w+)\]|#stablehlo<precision (\w+)>")


def _dot_precisions(text: str) -> Counter:
  """Counter of the precision of every ``stablehlo.dot_general`` in a lowered
  program's text ("NONE" for a dot without one, "ALGORITHM" for a dot with a
  ``lax.DotAlgorithm``); both operands must agree."""
  out = Counter()
  for line in text.splitlines():
    if "dot_general" not in line:
      continue
    found = _PRECISION.findall(line)
    if not found:
      out["ALGORITHM" if "algorithm" in line else "NONE"] += 1
      continue
    names = [n for group in found for n in group if n]
    assert len(set(names)) == 1, line
    out[names[0]] += 1
  return out


# Matmuls per piece of a tiny model (tests.conftest.tiny_config): a block has
# q, k, v, o and gate, up, down (7 linears) plus the attention's score and
# value products (2) = 9; an MTP module adds its projection M_k = 10; the
# FeatureFuse projection 1; each head (main, every depth) 1.
_BLOCK, _MODULE, _FUSE, _HEAD = 9, 10, 1, 1


def _cfg(precision, **model):
  return tiny_config(model=dict(matmul_precision=precision, **model),
                     mtp=dict(depth=2, feature_layers="0"))


def _forward_text(cfg, recursive_steps=0, draft_vocab_size=0):
  if draft_vocab_size:
    cfg = cfg.replace(mtp=dict(draft_vocab_size=draft_vocab_size))
  graphdef, state = nnx.split(model_lib.build_model(cfg))

  def forward(state, tokens):
    out = nnx.merge(graphdef, state)(tokens, recursive_steps=recursive_steps)
    return out.logits, out.mtp_logits
  return jax.jit(forward).lower(state, jnp.zeros((2, 16), jnp.int32)).as_text()


def _decode_step_text(cfg):
  """A draft round's model calls with caches: backbone (+ FeatureFuse) and
  the main head, module 1 and its head."""
  model = model_lib.build_model(cfg)
  graphdef, state = nnx.split(model)
  caches = model_lib.init_layer_caches(cfg.model, cfg.model.num_layers, 2, 64)
  mcache = model_lib.init_layer_caches(cfg.model, 1, 2, 64)[0]

  def step(state, tokens, positions, caches, mcache):
    m = nnx.merge(graphdef, state)
    h0, x, caches = m.backbone_features(tokens, positions, cache=caches)
    hk, mcache = m.mtp_forward(1, x, tokens, positions, cache=mcache)
    return m.head(h0), m.mtp_head(1, hk), caches, mcache
  tokens = jnp.zeros((2, 3), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (2, 3))
  return jax.jit(step).lower(state, tokens, positions, caches, mcache).as_text()


def _grad_text(cfg):
  from train.loop import make_loss_fn
  cfg = cfg.replace(mtp=dict(recursive_steps=1, distill_weight=0.5))
  graphdef, params = nnx.split(model_lib.build_model(cfg), nnx.Param)
  loss_fn = make_loss_fn(graphdef, cfg.mtp.loss_weight, cfg.mtp)
  tokens = jnp.ones((2, 16), jnp.int32)
  batch = dict(tokens=tokens, segment_ids=jnp.ones_like(tokens),
               positions=jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16)))
  return jax.jit(jax.grad(lambda p, b: loss_fn(p, b)[0])).lower(params, batch).as_text()


@pytest.mark.parametrize("precision,expected", [("highest", "HIGHEST"), ("high", "HIGH"),
                                                ("default", "DEFAULT")])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_every_forward_matmul_carries_the_precision(precision, expected, tie):
  """The training forward, with and without a reduced draft vocabulary (the
  compact head's own ``jnp.dot``): exactly the expected number of
  dot_generals, every one at the configured precision ("default" leaves it
  to JAX, which lowers as DEFAULT)."""
  cfg = _cfg(precision, tie_embeddings=tie)
  want = cfg.model.num_layers * _BLOCK + 2 * _MODULE + _FUSE + 3 * _HEAD
  for vocab in (0, 100):
    assert _dot_precisions(_forward_text(cfg, draft_vocab_size=vocab)) == {expected: want}


@pytest.mark.parametrize("impl", ["blockwise", "dense"])
def test_every_cached_step_matmul_carries_the_precision(impl):
  """Decoding's cached calls under both attention implementations
  (``blockwise_attention``'s einsums inside its loop, ``jax.nn.dot_product_attention``
  under its precision context)."""
  for precision, expected in (("highest", "HIGHEST"), ("default", "DEFAULT")):
    cfg = _cfg(precision, attention_impl=impl)
    want = cfg.model.num_layers * _BLOCK + _FUSE + _HEAD + _MODULE + _HEAD
    assert _dot_precisions(_decode_step_text(cfg)) == {expected: want}


def test_recursive_steps_and_gradient_carry_the_precision():
  """The recursive steps (``attend_chain``'s four einsums) and the training
  gradient (the transposed dots of the backward pass): all HIGHEST. A
  recursive step runs at least block input, q/k/v, 4 chain einsums, o and
  the MLP (12) and its head; jit drops dead matmuls, so the counts are
  lower bounds."""
  cfg = _cfg("highest")
  plain = cfg.model.num_layers * _BLOCK + 2 * _MODULE + _FUSE + 3 * _HEAD
  counts = _dot_precisions(_forward_text(cfg, recursive_steps=2))
  assert set(counts) == {"HIGHEST"} and counts["HIGHEST"] >= plain + 2 * (12 + _HEAD), counts
  counts = _dot_precisions(_grad_text(cfg))
  assert set(counts) == {"HIGHEST"} and counts["HIGHEST"] >= 2 * plain, counts


# -- greedy float32 AR across cache sizes and attention implementations ------

PROMPT, NEW = 12, 48
# (cache slots S, model.attention_impl, model.attention_block_size); the first is the reference
VARIANTS = [(64, "blockwise", 128), (256, "blockwise", 128), (1024, "blockwise", 128),
            (1024, "blockwise", 16), (64, "dense", 128), (1024, "dense", 128)]


def _greedy_ar(s: int, impl: str, block: int):
  """Greedy AR through the model API: prefill PROMPT tokens, then NEW
  one-token steps with a KV cache of ``s`` slots. Returns (tokens [B, NEW]
  int32, logits [B, NEW + 1, V] float32 of every step, normed last hidden
  states [B, NEW + 1, D], the cache-free forward's logits at the same
  positions, the embedding E [V, D])."""
  cfg = tiny_config(model=dict(max_seq_len=1024, attention_impl=impl, attention_block_size=block),
                    mtp=dict(depth=0))
  model = model_lib.build_model(cfg, seed=1)
  graphdef, state = nnx.split(model)

  @jax.jit
  def step(state, tokens, positions, cache):
    m = nnx.merge(graphdef, state)
    h, cache = m.backbone(tokens, positions, cache=cache)
    return m.head(h[:, -1:])[:, 0], m.final_norm(h[:, -1]), cache

  b = 2
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, 256, (b, PROMPT)), jnp.int32)
  cache = model_lib.init_layer_caches(cfg.model, cfg.model.num_layers, b, s)
  positions = jnp.broadcast_to(jnp.arange(PROMPT, dtype=jnp.int32), (b, PROMPT))
  logits, hn, cache = step(state, prompt, positions, cache)
  tokens, all_logits, hidden = [], [logits], [hn]
  for i in range(NEW):
    nxt = jnp.argmax(logits, -1).astype(jnp.int32)
    tokens.append(nxt)
    logits, hn, cache = step(state, nxt[:, None], jnp.full((b, 1), PROMPT + i, jnp.int32), cache)
    all_logits.append(logits)
    hidden.append(hn)
  tokens = jnp.stack(tokens, 1)
  cache_free = model(jnp.concatenate([prompt, tokens], 1)).logits[:, PROMPT - 1:]
  return (np.asarray(tokens), np.asarray(jnp.stack(all_logits, 1)),
          np.asarray(jnp.stack(hidden, 1)), np.asarray(cache_free),
          np.asarray(model.embed.embedding[...]))


def test_greedy_ar_float32_is_independent_of_cache_size_and_attention():
  """Greedy tokens are equal and logits agree within a float32 bound across
  cache sizes S = 64, 256, 1024, block sizes 128 and 16 and the "dense"
  implementation, and with the cache-free forward (training's path).

  The bound. The variants run the same arithmetic except for the order of
  float32 reductions inside attention: the softmax normaliser
  sum_s exp(score_s - m) and the value sum sum_s p_s v_s over the n slots a
  query sees (n <= PROMPT + NEW = 60; slots it cannot see add exact zeros,
  so S itself does not enter), split into blocks or not, and how the scores
  are scaled. A float32 sum of n terms has a relative error of about
  u sqrt(n), u = 2^-24 (Higham and Mary 2019, probabilistic rounding-error
  analysis, constant about 1). Two such sums per attention layer, in each of
  the two variants compared, over L = 2 layers; residual adds, RMSNorm and
  the MLP carry a relative error of the residual stream through about
  unchanged. So the normed final hidden state h differs norm-wise by at
  most delta = 2 * 2 * L * u sqrt(n) = 8 u sqrt(n) relative, and by
  Cauchy-Schwarz logit v by at most

      |dz_v| <= delta ||h|| ||E_v|| = 8 u sqrt(60) ||h|| max_v ||E_v||

  (||h|| = sqrt(32) after RMSNorm, max ||E_v|| about 1.37 here: about
  2.9e-5). Measured on CPU: 2.9e-6 (cache-free vs cached), 2.0e-6 (block 16
  vs 128), 1.6e-6 (dense vs blockwise), 0 between cache sizes at one block
  size. A TF32 matmul (u = 2^-11) would be about 2^13 times worse (about
  1e-2). Token equality follows from the bound: the smallest top-1 minus
  top-2 logit gap of the reference run (0.016) must exceed twice it.
  """
  runs = {v: _greedy_ar(*v) for v in VARIANTS}
  tokens, logits, hidden, _, embedding = runs[VARIANTS[0]]
  finite = np.isfinite(logits)                    # the head mask's -inf ids, same in every run
  h_norm = float(np.linalg.norm(hidden, axis=-1).max())
  e_norm = float(np.linalg.norm(embedding, axis=-1).max())
  u, n, layers = 2.0 ** -24, PROMPT + NEW, 2
  bound = 2 * 2 * layers * u * math.sqrt(n) * h_norm * e_norm
  top2 = np.sort(np.where(finite, logits, -np.inf), -1)[..., -2:]
  assert (top2[..., 1] - top2[..., 0]).min() > 2 * bound
  for variant, (tok_v, logits_v, _, cache_free, _) in runs.items():
    np.testing.assert_array_equal(tok_v, tokens, err_msg=str(variant))
    np.testing.assert_array_equal(np.isfinite(logits_v), finite)
    for other in (logits_v, cache_free):
      diff = np.abs(np.where(finite, other, 0.0) - np.where(finite, logits, 0.0)).max()
      assert diff <= bound, (variant, diff, bound)


# -- the config field ----------------------------------------------------------

def test_matmul_precision_config():
  """Default "highest"; configs without the field (older checkpoints'
  config.json, exports, imported HF/GGUF models) get it; not an
  architecture field; a bad value is one line naming the field and the
  allowed values."""
  from mtp import export as export_lib
  from mtp import importers
  assert config_lib.ModelConfig().matmul_precision == "highest"
  assert model_lib.matmul_precision(config_lib.ModelConfig()) == jax.lax.Precision.HIGHEST
  assert model_lib.matmul_precision(tiny_config(model=dict(matmul_precision="default")).model) is None
  old = tiny_config().to_dict()
  del old["model"]["matmul_precision"]
  assert config_lib.from_dict(old).model.matmul_precision == "highest"
  hf = dict(model_type="llama", vocab_size=264, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
            max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True)
  assert export_lib.config_from_hf(hf).model.matmul_precision == "highest"
  assert export_lib.config_from_hf({**hf, "mtp": {"config": old}}).model.matmul_precision == "highest"
  kept = tiny_config(model=dict(matmul_precision="high")).to_dict()
  assert export_lib.config_from_hf({**hf, "mtp": {"config": kept}}).model.matmul_precision == "high"
  imported = importers.model_config(
      source="x.gguf", vocab_size=300, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
      head_dim=8, mlp_dim=64, max_seq_len=256, rope_theta=1e4, norm_eps=1e-6,
      tie_embeddings=True, dtype="float32", num_tokens=300)
  assert imported.model.matmul_precision == "highest"
  assert not config_lib.architecture_mismatches(
      tiny_config(), tiny_config(model=dict(matmul_precision="default")))
  for bad in ("fp32", "HIGHEST", "float32"):
    with pytest.raises(config_lib.ConfigError) as e:
      tiny_config(model=dict(matmul_precision=bad))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"model.matmul_precision={bad!r}")
    assert all(v in msg for v in config_lib.MATMUL_PRECISIONS)
