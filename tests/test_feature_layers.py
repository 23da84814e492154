"""Lower-layer features for module 1 (``mtp.feature_layers``, EAGLE-3-style
fusion; ``mtp.model.FeatureFuse``): the pass-through start, the cached stage's
split equal to the full forward, a stage that attaches the fusion to a
trained module (init_from), the decoder's caches exact and greedy output
equal to AR with a trained-looking (perturbed) fusion, the modules file."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from decode import round as round_lib
from decode.decoder import Decoder, SamplingParams
from mtp import checkpoint as ckpt_lib
from mtp import data as data_lib
from mtp.config import ConfigError, parse_id_list
from mtp.model import Transformer, build_model
from tests import stage_rows
from tests.conftest import ALPHABET, random_prompts, tiny_config, with_noisy_mtp
from train.loop import train

GREEDY = SamplingParams(temperature=0.0)


def with_fusion(model, layers=(0,), scale=0.3, seed=0):
  """``model``'s parameters in a model with ``feature_layers=layers``, its
  FeatureFuse moved away from the identity (random lower-layer weights of
  ``scale`` / sqrt(D) and scales != 1), so the fused input differs from h^0."""
  new = nnx.eval_shape(lambda: Transformer(model.cfg, model.mtp_depth, rngs=nnx.Rngs(params=0),
                                           draft_vocab_size=model.draft_vocab_size,
                                           feature_layers=layers))
  graphdef, abstract = nnx.split(new, nnx.Param)
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  d = model.cfg.d_model
  rng = np.random.default_rng(seed)
  out = {}
  for path, v in nnx.to_flat_state(abstract):
    if path in flat and "fuse" not in path:
      out[path] = flat[path]
    elif path[-1] == "kernel":
      k = np.concatenate([rng.normal(0, scale / np.sqrt(d), (len(layers) * d, d)),
                          np.eye(d) + rng.normal(0, scale / np.sqrt(d), (d, d))], 0)
      out[path] = v.replace(jnp.asarray(k, v.dtype))
    else:
      out[path] = v.replace(jnp.asarray(rng.uniform(0.5, 1.5, v.shape), v.dtype))
  return nnx.merge(graphdef, nnx.from_flat_state(out))


def test_config_checks_name_the_field():
  assert parse_id_list(tiny_config(model=dict(num_layers=4), mtp=dict(feature_layers="2,0")).mtp
                       .feature_layers) == (0, 2)
  with pytest.raises(ConfigError, match=r"mtp.feature_layers.*\[0, model.num_layers - 2 = 0\]"):
    tiny_config(mtp=dict(feature_layers="1"))          # block 1 is the last: h^0 itself
  with pytest.raises(ConfigError, match="mtp.feature_layers.*mtp.depth = 0"):
    tiny_config(mtp=dict(depth=0, feature_layers="0"))
  with pytest.raises(ConfigError, match="mtp.feature_layers"):
    tiny_config(mtp=dict(feature_layers="low"))


def test_fusion_starts_as_the_plain_module_and_the_cached_split_equals_the_full_forward():
  cfg = tiny_config(model=dict(num_layers=3), mtp=dict(depth=2, recursive_steps=1))
  plain = build_model(cfg, 0)
  fused = build_model(cfg.replace(mtp=dict(feature_layers="0,1")), 0)
  tokens = jnp.asarray(random_prompts([31, 31])[0][None].repeat(2, 0))
  a, b = plain(tokens, recursive_steps=1), fused(tokens, recursive_steps=1)
  for x, y in zip((a.logits,) + a.mtp_logits + a.hidden, (b.logits,) + b.mtp_logits + b.hidden):
    np.testing.assert_array_equal(x, y)       # f = h^0 at the start, other params unchanged
  moved = with_fusion(fused, layers=(0, 1))
  full = moved(tokens, recursive_steps=1)
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  hidden = moved.backbone_hidden(tokens, pos)
  assert hidden.shape == tokens.shape + (3 * cfg.model.d_model,)
  h0, lower = moved.split_hidden(hidden)
  cached = moved.forward_from_hidden(tokens, pos, None, h0, recursive_steps=1, lower=lower)
  for x, y in zip((full.logits,) + full.mtp_logits, (cached.logits,) + cached.mtp_logits):
    np.testing.assert_allclose(x, y, atol=1e-5)
  assert not np.allclose(full.mtp_logits[0], a.mtp_logits[0], atol=1e-3)   # the fusion matters
  np.testing.assert_array_equal(full.logits, a.logits)                     # the main head does not
  with pytest.raises(ValueError, match="lower layers missing"):
    moved.forward_from_hidden(tokens, pos, None, h0)


@pytest.fixture(scope="module")
def fused_target(trained_markov):
  return with_fusion(with_noisy_mtp(trained_markov[1], 0.5), layers=(0,))


@pytest.mark.parametrize("g", [2, 3])
def test_drafts_equal_the_cache_free_forward(fused_target, g):
  """After prefill and rounds with random accepted lengths, module k's q
  equals a cache-free forward's (the drafter stores the fused input of every
  verified position, not h^0); G = 3 > D = 2 also reuses module D."""
  dec = Decoder(fused_target, "mtp", g)
  warp = SamplingParams(temperature=1.0)
  prompts = random_prompts([2, 7, 12], seed=g)
  state, prefill_len = dec.prepare(prompts, 40, seed=0)
  state = dec.prefill(state, prefill_len)
  propose = jax.jit(lambda params, s: round_lib.propose(dec.drafter, *dec.models(params), s,
                                                        warp, dec.longest_draft))
  commit = jax.jit(functools.partial(round_lib.commit, dec.drafter))
  full = jax.jit(lambda params, x: dec.models(params)[0](x).mtp_logits)
  rng = np.random.default_rng(1)
  for _ in range(6):
    state, (d_tok, d_q, _, h_draft, _) = propose(dec.target_params, state)
    n = np.asarray(state.length)
    mtp_logits = full(dec.target_params, state.tokens)
    for b in range(len(prompts)):
      for k in range(1, min(g, fused_target.mtp_depth) + 1):
        np.testing.assert_allclose(d_q[b, k - 1], jax.nn.softmax(mtp_logits[k - 1][b, n[b] - 2]),
                                   atol=2e-5, err_msg=f"row {b} depth {k}")
    a = jnp.asarray(rng.integers(0, g + 1, len(prompts)), jnp.int32)
    state = commit(state, d_tok, a, jnp.asarray(rng.choice(ALPHABET, len(prompts)), jnp.int32),
                   h_draft)


def test_greedy_equals_ar(fused_target):
  prompts = random_prompts([3, 9, 17, 30])
  ref = Decoder(fused_target, "ar").generate(prompts, 24, GREEDY)
  for dec in (Decoder(fused_target, "mtp", 1), Decoder(fused_target, "mtp", 3),
              Decoder(fused_target, "mtp", "auto", auto_costs=[1.0, 1.0, 1.0])):
    gen = dec.generate(prompts, 24, GREEDY)
    for b in range(len(prompts)):
      np.testing.assert_array_equal(gen.tokens[b], ref.tokens[b],
                                    err_msg=f"G={dec.longest_draft} row {b}")
  assert gen.accepted_histogram[:, 1:].sum() > 0


def test_stage_attaches_the_fusion_to_a_trained_module(monkeypatch, tmp_path):
  """A frozen cached stage with feature layers, started from a workdir without
  them: the fusion starts at the identity, trains, and the cache holds
  [h^(0); h^0] per token; the backbone stays bit-identical; a modules file
  written from it round-trips the fusion."""
  t = 32
  rng = np.random.default_rng(0)
  rows = stage_rows.pack_rows([rng.integers(32, 127, int(rng.integers(5, 40))) for _ in range(30)],
                              t)
  rows = {k: v[:10] for k, v in rows.items()}
  ev = stage_rows.eval_batches({k: v[:8] for k, v in rows.items()}, 4, 2)
  monkeypatch.setattr(data_lib, "epoch_rows", lambda cfg, **kw: rows, raising=False)
  monkeypatch.setattr(data_lib, "make_eval_batches", lambda cfg, **kw: ev)
  base = tiny_config(mtp=dict(depth=1), train=dict(num_steps=2, batch_size=4, seq_len=t,
                                                   eval_every=2),
                     checkpoint=dict(every_steps=2))
  src = str(tmp_path / "src")
  train(base, src, log=lambda s: None)
  cfg = base.replace(mtp=dict(recursive_steps=1, distill_weight=1.0, feature_layers="0"),
                     train=dict(init_from=src, freeze_backbone=True, hidden_cache=True,
                                num_steps=3, eval_every=3),
                     checkpoint=dict(every_steps=3))
  out = str(tmp_path / "stage")
  logs = []
  train(cfg, out, log=logs.append)
  assert any("initialised parameters from" in line for line in logs), logs
  meta = json.load(open(os.path.join(out, "hidden_cache", "meta.json")))
  assert meta["shape"] == [10, t, 2 * cfg.model.d_model]
  assert meta["source"]["feature_layers"] == "0"
  from mtp import loading
  _, before, _ = loading.load_model(src)
  cfg_out, after, _ = loading.load_model(out)
  assert cfg_out.mtp.feature_layers == "0"
  b = dict(nnx.to_flat_state(nnx.state(before, nnx.Param)))
  a = dict(nnx.to_flat_state(nnx.state(after, nnx.Param)))
  for path, v in b.items():
    if path[0] != "mtp":
      np.testing.assert_array_equal(a[path].get_value(), v.get_value(), err_msg=str(path))
  kernel = np.asarray(a[("mtp", 0, "fuse", "proj", "kernel")].get_value())
  d = cfg.model.d_model
  assert not np.array_equal(kernel, np.concatenate([np.zeros((d, d)), np.eye(d)]))   # trained
  # the modules file carries the fusion and its config
  from mtp.export import modules as modules_lib
  path = str(tmp_path / "m.safetensors")
  modules_lib.write_modules_file(after, cfg_out, path, step=3, dtype="float32")
  mf = modules_lib.read_modules_file(path)
  assert mf.cfg.mtp.feature_layers == "0"
  np.testing.assert_array_equal(mf.tensors["mtp.0.fuse.proj.kernel"], kernel)
  # changing existing feature layers in a later stage is refused
  with pytest.raises(ckpt_lib.CheckpointError, match="mtp.feature_layers"):
    train(cfg.replace(mtp=dict(feature_layers=""), train=dict(init_from=out)),
          str(tmp_path / "again"), log=lambda s: None)
