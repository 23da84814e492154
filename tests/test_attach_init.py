"""--mtp_init last_block: new MTP modules on an imported backbone start as a
copy of its last block reading the hidden state through M = [s * I; 0]."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp.importers import ModelImportError, model_config, mtp_init_provenance, params_from_hf_tensors
from mtp.importers import __main__ as cli
from tests import tiny_bpe

D, L = 32, 2


def _cfg(depth=2):
  return model_config(source="test", vocab_size=320, d_model=D, num_layers=L, num_heads=4,
                      num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=64, rope_theta=1e4,
                      norm_eps=1e-5, tie_embeddings=True, dtype="float32", num_tokens=300,
                      mtp_depth=depth)


def _model(init, scale=1.0):
  tensors = tiny_bpe.random_llama_tensors(vocab=320, d=D, layers=L, heads=4, kv=2, hd=8, ff=64,
                                          tied=True)
  return params_from_hf_tensors(_cfg(), tensors, "test", seed=0, mtp_init=init,
                                mtp_init_scale=scale)


def _rms_normed(h):
  return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5)


def _module_vs_last_block(model, scale=1.0):
  """(module 1's output, the last block applied to s * h0 / rms(h0), its
  output with other next tokens) on one random row."""
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 300, (1, 12)), jnp.int32)
  other = jnp.asarray(rng.integers(0, 300, (1, 12)), jnp.int32)
  pos = jnp.arange(12)[None]
  h0 = model.backbone(tokens, pos)[0]
  h1 = model.mtp_forward(1, h0, tokens, pos)[0]
  h1_other = model.mtp_forward(1, h0, other, pos)[0]
  ref = model.blocks[L - 1](scale * _rms_normed(h0), pos)[0]
  return np.asarray(h1), np.asarray(ref), np.asarray(h1_other)


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_last_block_init_is_the_last_block_on_the_normed_hidden_state(scale):
  model = _model("last_block", scale)
  h1, ref, h1_other = _module_vs_last_block(model, scale)
  np.testing.assert_allclose(h1, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(h1, h1_other)          # the embedding branch starts closed
  for k in range(2):
    m = model.mtp[k]
    np.testing.assert_array_equal(np.asarray(m.proj.kernel[...]),
                                  np.concatenate([scale * np.eye(D), np.zeros((D, D))]))
    np.testing.assert_array_equal(np.asarray(m.out_norm.scale[...]),
                                  np.asarray(model.final_norm.scale[...]))
    np.testing.assert_array_equal(np.asarray(m.embed_norm.scale[...]), np.ones(D))
    np.testing.assert_array_equal(np.asarray(m.hidden_norm.scale[...]), np.ones(D))
    np.testing.assert_array_equal(np.asarray(m.block.mlp.down.kernel[...]),
                                  np.asarray(model.blocks[L - 1].mlp.down.kernel[...]))
  # module 1's logits: the main head on one more last-block layer
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, 300, (1, 8)), jnp.int32)
  pos = jnp.arange(8)[None]
  h0 = model.backbone(tokens, pos)[0]
  np.testing.assert_allclose(
      np.asarray(model.mtp_head(1, model.mtp_forward(1, h0, tokens, pos)[0])),
      np.asarray(model.head(model.blocks[L - 1](scale * _rms_normed(h0), pos)[0])),
      rtol=1e-5, atol=1e-5)


def test_random_init_is_not_the_last_block():
  h1, ref, h1_other = _module_vs_last_block(_model("random"))
  assert not np.allclose(h1, ref, atol=1e-2)
  assert not np.allclose(h1, h1_other, atol=1e-4)


def test_bad_choice_and_provenance(tmp_path, capsys):
  with pytest.raises(ModelImportError, match="--mtp_init="):
    _model("copy")
  with pytest.raises(ModelImportError, match="--mtp_init_scale="):
    _model("last_block", 0.0)
  assert mtp_init_provenance(0, "last_block", 1.0) == {"mtp_init": None}
  assert mtp_init_provenance(1, "random", 1.0) == {"mtp_init": "random", "mtp_init_scale": None}
  tk = tiny_bpe.train_tiny_bpe(300)
  tensors = tiny_bpe.random_llama_tensors(vocab=320, d=D, layers=L, heads=4, kv=2, hd=8, ff=64,
                                          tied=True)
  path = str(tmp_path / "m.gguf")
  tiny_bpe.write_gguf(path, tensors, tokenizer_meta=tiny_bpe.gguf_tokenizer_metadata(tk),
                      heads=4, kv=2, hd=8, layers=L, d=D, ff=64)
  wd = str(tmp_path / "wd")
  assert cli.main(["--gguf", path, "--workdir", wd, "--mtp_depth", "1",
                   "--mtp_init", "last_block", "--mtp_init_scale", "0.5"]) == 0
  prov = json.load(open(os.path.join(wd, "import.json")))
  assert prov["mtp_init"] == "last_block" and prov["mtp_init_scale"] == 0.5
  from mtp import loading
  _, model, _ = loading.load_model(wd)
  kernel = np.asarray(nnx.state(model, nnx.Param)["mtp"][0]["proj"]["kernel"].get_value())
  np.testing.assert_array_equal(kernel[:D], 0.5 * np.eye(D))
