"""A reduced draft vocabulary V' (issue 22 item 3; FastMTP's compressed draft
vocabulary): selection, the head over V', exact decoding with targets whose
mass lies outside V', the checkpoint round trip and the training loss."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from decode import drafters as drafters_lib
from decode.decoder import Decoder, SamplingParams
from mtp import checkpoint as ckpt_lib
from mtp import config as config_lib
from mtp import draft_vocab as dv
from mtp import export as export_lib
from mtp import loading
from mtp import tokenizer as tok
from mtp.model import DraftVocab, ModelOutput, Transformer, build_model, count_params
from tests.conftest import ALPHABET, random_prompts, tiny_config
from tests.test_decode_distribution import ALPHA, PROMPT, chi_square_pvalue, exact_pair_law
from train import losses

GREEDY = SamplingParams(temperature=0.0)
V = 264
SIZE = V // 4                 # |V'| = 66


# -- selection (pure functions) --------------------------------------------------

def test_token_counts_count_only_loss_positions():
  tokens = np.array([[1, 2, 2, 3], [3, 3, 0, 1]])
  np.testing.assert_array_equal(dv.token_counts(tokens, vocab_size=5), [1, 2, 2, 3, 0])
  mask = np.array([[0, 1, 1, 0], [1, 0, 0, 1]])
  np.testing.assert_array_equal(dv.token_counts(tokens, mask, vocab_size=5), [0, 1, 2, 1, 0])
  # an id outside [0, V) at a position the mask leaves out is not an error
  np.testing.assert_array_equal(dv.token_counts([[9, 1]], [[0, 1]], vocab_size=2), [0, 1])
  with pytest.raises(ValueError, match=r"\[0, 5\)"):
    dv.token_counts([[5]], vocab_size=5)
  with pytest.raises(ValueError, match="shape"):
    dv.token_counts(tokens, mask[:, :2], vocab_size=5)
  with pytest.raises(ValueError, match=r"\[N, T\]"):
    dv.token_counts([1, 2], vocab_size=5)


def test_select_most_frequent_ties_by_id_always_included_sorted():
  counts = np.array([5, 9, 9, 1, 0, 9, 3])
  np.testing.assert_array_equal(dv.select(counts, 3), [1, 2, 5])
  np.testing.assert_array_equal(dv.select(counts, 2), [1, 2])            # tie 9,9,9 -> lower ids
  np.testing.assert_array_equal(dv.select(counts, 3, always=(4,)), [1, 2, 4])
  np.testing.assert_array_equal(dv.select(counts, 4, always=[6, 4]), [1, 2, 4, 6])
  # allowed: ids the head never emits are not chosen by frequency (always ids still are)
  allowed = np.ones(7, bool)
  allowed[[1, 2]] = False
  np.testing.assert_array_equal(dv.select(counts, 3, always=(2,), allowed=allowed), [0, 2, 5])
  out = dv.select(counts, 7)
  assert out.dtype == np.int32 and out.tolist() == list(range(7))


@pytest.mark.parametrize("size,kw,match", [
    (8, {}, r"\[1, 7\]"), (0, {}, r"\[1, 7\]"), (1, {"always": (3, 4)}, "do not fit"),
    (2, {"always": (7,)}, r"\[0, 7\)"), (6, {"allowed": np.arange(7) < 3}, r"\[1, 3\]")])
def test_select_errors(size, kw, match):
  with pytest.raises(ValueError, match=match):
    dv.select(np.arange(7), size, **kw)


def test_config_field_is_validated():
  assert tiny_config().mtp.draft_vocab_size == 0
  for bad in (-1, V + 1):
    with pytest.raises(config_lib.ConfigError, match=r"mtp.draft_vocab_size.*\[1, model.vocab_size"):
      tiny_config(mtp=dict(draft_vocab_size=bad))
  with pytest.raises(config_lib.ConfigError, match="mtp.draft_vocab_size.*mtp.depth = 0"):
    tiny_config(mtp=dict(depth=0, draft_vocab_size=4))
  assert "mtp.draft_vocab_size" in config_lib.ARCHITECTURE_FIELDS


# -- the head over V' -------------------------------------------------------------

def _ids_without(exclude, size=SIZE, seed=0):
  """``size`` sorted ids: EOS, ALPHABET minus ``exclude``, then random others."""
  rng = np.random.default_rng(seed)
  keep = [int(a) for a in ALPHABET if a not in set(exclude)] + [tok.EOS_ID]
  emittable = tok.emittable_mask(V)
  others = [int(i) for i in rng.permutation(tok.NUM_BYTES)
            if emittable[i] and i not in set(ALPHABET) and i not in keep]
  return np.sort(np.asarray(keep + others[:size - len(keep)], np.int32))


def with_draft_vocab(model, ids):
  """A copy of ``model`` (no V') with the draft vocabulary ``ids``."""
  out = Transformer(model.cfg, model.mtp_depth, rngs=nnx.Rngs(0), draft_vocab_size=len(ids))
  flat = dict(nnx.to_flat_state(nnx.state(out, nnx.Param)))
  flat.update(dict(nnx.to_flat_state(nnx.state(model, nnx.Param))))
  nnx.update(out, nnx.from_flat_state(flat))
  dv.set_draft_vocab(out, ids)
  return out


@pytest.mark.parametrize("tied", [True, False])
def test_mtp_head_equals_the_full_head_on_vprime_and_is_minus_inf_elsewhere(tied):
  cfg = tiny_config(model=dict(tie_embeddings=tied))
  full = build_model(cfg, seed=3)
  ids = _ids_without([], seed=1)
  ids[-1] = tok.PAD_ID                      # a never-emitted id inside V' keeps its -inf
  ids = np.sort(ids)
  model = with_draft_vocab(full, ids)
  h = jax.random.normal(jax.random.key(0), (2, 3, cfg.model.d_model))
  for k in (1, 2):
    ref = np.asarray(full.mtp_head(k, h))
    got = np.asarray(model.mtp_head(k, h))
    assert got.shape == ref.shape == (2, 3, V) and got.dtype == np.float32
    np.testing.assert_allclose(got[..., ids], ref[..., ids], rtol=1e-6, atol=1e-6)
    outside = np.setdiff1d(np.arange(V), ids)
    assert np.all(got[..., outside] == -np.inf)
    assert np.all(got[..., tok.PAD_ID] == -np.inf)
    compact, cids = model.mtp_head_compact(k, h)
    np.testing.assert_array_equal(cids, ids)
    np.testing.assert_array_equal(np.asarray(compact), got[..., ids])
  # the main head never changes
  np.testing.assert_array_equal(np.asarray(model.head(h)), np.asarray(full.head(h)))
  mask = np.asarray(model.draft_mask())
  assert mask.sum() == len(ids) - 1 and not mask[tok.PAD_ID]
  assert count_params(model) == count_params(full)
  with pytest.raises(ValueError, match="draft vocabulary"):
    full.mtp_head_compact(1, h)


def test_set_draft_vocab_checks_ids():
  model = build_model(tiny_config(mtp=dict(draft_vocab_size=4)))
  assert isinstance(model.draft_vocab, DraftVocab)
  np.testing.assert_array_equal(dv.draft_vocab_ids(model), [0, 1, 2, 3])   # placeholder
  for bad, match in (([1, 2, 3], r"\[4\]"), ([3, 2, 5, 6], "sorted"), ([1, 1, 2, 3], "sorted"),
                     ([1, 2, 3, V], r"\[0, 264\)"), ([0.0, 1, 2, 3], "integers")):
    with pytest.raises(ValueError, match=match):
      dv.set_draft_vocab(model, np.asarray(bad))
  with pytest.raises(ValueError, match="no draft vocabulary"):
    dv.set_draft_vocab(build_model(tiny_config()), [1, 2])
  params = dv.with_draft_vocab(nnx.state(model, nnx.Param), [5, 6, 7, 8])
  np.testing.assert_array_equal(params["draft_vocab"][...], [5, 6, 7, 8])
  np.testing.assert_array_equal(dv.draft_vocab_ids(model), [0, 1, 2, 3])  # a copy
  with pytest.raises(ValueError, match="no draft_vocab"):
    dv.with_draft_vocab(nnx.state(build_model(tiny_config()), nnx.Param), [1])


# -- decoding stays exact ---------------------------------------------------------

@pytest.fixture(scope="module")
def target(trained_markov):
  return trained_markov[1]


@pytest.fixture(scope="module")
def prompt_law(target):
  """The target's next-token law after PROMPT (T = 1), [V] float64."""
  logits = target(jnp.asarray(PROMPT[None])).logits[0, -1]
  return np.asarray(jax.nn.softmax(logits), np.float64)


@pytest.fixture(scope="module")
def vmodel(target, prompt_law):
  """The trained Markov target with V' = a quarter of the ids that leaves out
  the two most likely next tokens after PROMPT (and so much of the mass the
  Markov source puts on them elsewhere)."""
  top2 = np.argsort(-prompt_law)[:2]
  return with_draft_vocab(target, _ids_without(top2))


def test_greedy_equals_ar_with_targets_outside_vprime(vmodel):
  ids = dv.draft_vocab_ids(vmodel)
  prompts = random_prompts([3, 6, 11, 17], seed=4)
  ref = Decoder(vmodel, "ar").generate(prompts, 24, GREEDY)
  emitted = np.concatenate(ref.tokens)
  outside = ~np.isin(emitted, ids)
  assert outside.sum() >= 5, "the target's greedy token must lie outside V' at some positions"
  assert (~outside).sum() >= 5
  for dec, forms in ((Decoder(vmodel, "mtp", 3), ("generate", "stream")),
                     (Decoder(vmodel, "mtp", tree=(2, 2)), ("generate",))):
    for form in forms:
      gen = getattr(dec, form)(prompts, 24, GREEDY)
      for b in range(len(prompts)):
        np.testing.assert_array_equal(gen.tokens[b], ref.tokens[b], err_msg=f"{form} row {b}")
      assert gen.accepted_histogram[:, 1:].sum() > 0, "some drafts in V' must be accepted"


def test_no_draft_is_accepted_when_vprime_misses_every_likely_token(target):
  """Fails if V' were ignored: with V' holding none of the ids the target
  emits, a greedy draft is never accepted (the full-vocabulary heads of the
  same modules get many accepted), and the output is still AR's."""
  prompts = random_prompts([4, 9, 13], seed=5)
  ref = Decoder(target, "ar").generate(prompts, 20, GREEDY)
  ids = np.setdiff1d(np.arange(SIZE + 40), np.concatenate(ref.tokens))[:SIZE].astype(np.int32)
  blind = with_draft_vocab(target, ids)
  full = Decoder(target, "mtp", 2).generate(prompts, 20, GREEDY)
  assert full.accepted_histogram[:, 1:].sum() > 0
  gen = Decoder(blind, "mtp", 2).generate(prompts, 20, GREEDY)
  assert gen.accepted_histogram[:, 1:].sum() == 0
  for b in range(len(prompts)):
    np.testing.assert_array_equal(gen.tokens[b], ref.tokens[b])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_lie_in_vprime_and_q_is_zero_outside(vmodel, temperature):
  """The drafter's head_pick: every draft in V' (also where the full head's
  argmax is outside it), q = 0 (T > 0) or -inf logits (T = 0) outside V',
  and the same draft law as picking from the scattered full-vocabulary
  logits (``mtp_head``)."""
  from decode import sampling
  ids = dv.draft_vocab_ids(vmodel)
  sp = SamplingParams(temperature)
  h = jax.random.normal(jax.random.key(1), (64, 1, vmodel.cfg.d_model)) * 3
  u = None if sp.greedy else sampling.uniform_open(jax.random.key(2), (64, SIZE))
  d, q = drafters_lib.head_pick(vmodel, 1, h, u, sp)
  d, q = np.asarray(d), np.asarray(q)
  assert np.isin(d, ids).all()
  outside = np.setdiff1d(np.arange(V), ids)
  logits = np.asarray(vmodel.mtp_head(1, h))[:, 0]
  if sp.greedy:
    assert np.all(q[:, outside] == -np.inf)
    np.testing.assert_array_equal(d, logits.argmax(-1))
    # the full-vocabulary head would have drafted outside V' for some rows
    full = Transformer(vmodel.cfg, vmodel.mtp_depth, rngs=nnx.Rngs(0))
    nnx.update(full, nnx.state(vmodel, nnx.All(nnx.Param, nnx.Not(DraftVocab))))
    assert (~np.isin(np.asarray(full.mtp_head(1, h))[:, 0].argmax(-1), ids)).any()
  else:
    assert np.all(q[:, outside] == 0)
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
    ref = np.asarray(sampling.warped_probs(jnp.asarray(logits), sp))
    np.testing.assert_allclose(q, ref, rtol=1e-5, atol=1e-7)
    assert (q[np.arange(64), d] > 0).all()


def test_first_two_tokens_follow_the_target_law_at_t1(vmodel, prompt_law):
  """Chi-square (significance 1e-3) of the first two tokens of 4000 rows at
  T = 1 against the exact law, with V' leaving out the two most likely
  first tokens: the residual must carry that mass."""
  ids = dv.draft_vocab_ids(vmodel)
  assert dv.outside_mass(prompt_law, ids) > 0.3
  sp = SamplingParams(temperature=1.0)
  law = exact_pair_law(vmodel, sp)
  gen = Decoder(vmodel, "mtp", 2).generate([PROMPT] * 4000, 2, sp, seed=7)
  pairs = np.stack([t[:2] for t in gen.tokens])
  assert chi_square_pvalue(pairs, law) > ALPHA
  assert gen.accepted_histogram[:, 1:].sum() > 0
  # emitted from the residual, outside V': as often as the target puts mass there
  assert abs((~np.isin(pairs[:, 0], ids)).mean() - dv.outside_mass(prompt_law, ids)) < 0.05


# -- saved with the checkpoint, never trained, refused by export ---------------------

def test_checkpoint_round_trip_resume_and_no_gradient(tmp_path):
  from train.loop import Trainer, split_trainable
  from tests.conftest import markov_batch, markov_transition
  cfg = tiny_config(mtp=dict(draft_vocab_size=SIZE), train=dict(batch_size=4, seq_len=16))
  ids = _ids_without([], seed=2)
  trainer = Trainer(cfg)
  state = trainer.init_state()
  state = dataclasses.replace(state, params=dv.with_draft_vocab(state.params, ids))
  trainable, frozen = split_trainable(cfg, state.params)
  assert "draft_vocab" not in trainable and "draft_vocab" in frozen
  rng = np.random.default_rng(0)
  for _ in range(2):
    state, metrics = trainer.train_step(state, markov_batch(rng, 4, 16, markov_transition()))
    assert np.isfinite(float(metrics["loss"]))
  np.testing.assert_array_equal(state.params["draft_vocab"][...], ids)
  ckpt = ckpt_lib.Checkpointer(str(tmp_path))
  ckpt.save(2, state.params, state.opt_state, None, cfg)
  params, opt = ckpt.restore(2, trainer.abstract_params, trainer.abstract_opt_state)  # resume
  ckpt.close()
  np.testing.assert_array_equal(params["draft_vocab"][...], ids)
  assert params["draft_vocab"][...].dtype == jnp.int32
  cfg2, model, step = loading.load_model(str(tmp_path))
  assert step == 2 and cfg2.mtp.draft_vocab_size == SIZE
  np.testing.assert_array_equal(dv.draft_vocab_ids(model), ids)
  with pytest.raises(export_lib.ExportError, match="mtp.draft_vocab_size"):
    export_lib.write_export(model, cfg2, str(tmp_path / "hf"))


# -- the training loss ------------------------------------------------------------

def test_loss_with_vprime_is_finite_and_its_teacher_is_the_renormalised_restriction():
  rng = np.random.default_rng(0)
  b, t, v = 2, 6, 12
  ids = np.array([0, 2, 3, 5, 8, 11])
  draft_mask = np.isin(np.arange(v), ids)
  main = rng.normal(size=(b, t, v)).astype(np.float32) * 2
  mtp = np.where(draft_mask, rng.normal(size=(b, t, v)), -np.inf).astype(np.float32)
  tokens = rng.integers(0, v, (b, t)).astype(np.int32)
  tokens[:, 3] = 1                                   # a target outside V'
  out = ModelOutput(jnp.asarray(main), (jnp.asarray(mtp),), (), jnp.asarray(draft_mask))

  def loss(mtp_logits, w):
    o = dataclasses.replace(out, mtp_logits=(mtp_logits,))
    return losses.mtp_loss(o, jnp.asarray(tokens), None, 1.0, distill_weight=w)

  for w in (0.0, 0.5, 1.0):
    value, sums = loss(jnp.asarray(mtp), w)
    grad = jax.grad(lambda x: loss(x, w)[0])(jnp.asarray(mtp))
    assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all()
  s = jax.tree.map(np.asarray, sums["mtp_1"])
  # positions i = 0..T-3 have a target t_{i+2}; the teacher is the main head at i+1
  valid = np.arange(t - 2)
  targets = tokens[:, valid + 2]
  inside = draft_mask[targets]
  assert s["positions"] == b * len(valid) and s["count"] == inside.sum() < s["positions"]
  teacher = main[:, valid + 1]
  p = np.exp(teacher - teacher.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  p_r = np.where(draft_mask, p, 0) / np.where(draft_mask, p, 0).sum(-1, keepdims=True)
  q = np.exp(mtp[:, valid] - mtp[:, valid].max(-1, keepdims=True))
  q /= q.sum(-1, keepdims=True)
  kl = np.sum(np.where(draft_mask, p_r * (np.log(np.where(draft_mask, p_r, 1))
                                           - np.log(np.where(draft_mask, q, 1))), 0), -1)
  np.testing.assert_allclose(s["kl"], kl.sum(), rtol=1e-5)
  np.testing.assert_allclose(s["outside"], (1 - np.where(draft_mask, p, 0).sum(-1)).sum(), rtol=1e-5)
  assert s["agree"] == (q.argmax(-1) == p_r.argmax(-1)).sum()
  assert s["agree_full"] == (q.argmax(-1) == p.argmax(-1)).sum()
  # the distillation term at w = 1 is exactly the mean KL to the restricted teacher
  value, _ = loss(jnp.asarray(mtp), 1.0)
  main_nll = float(sums["main"]["nll"]) / float(sums["main"]["count"])
  np.testing.assert_allclose(float(value) - main_nll, kl.mean(), rtol=1e-5)
  metrics = losses.summarize(sums)
  assert metrics["mtp_1/teacher_kl_restricted"] == pytest.approx(kl.mean(), rel=1e-5)
  assert metrics["mtp_1/teacher_kl"] == metrics["mtp_1/teacher_kl_restricted"]
  assert 0 < metrics["mtp_1/teacher_mass_outside"] < 1
  assert metrics["mtp_1/targets_in_draft_vocab"] == pytest.approx(inside.mean())
  # the T = 1 acceptance sum_v min(p, q) against the full teacher (q = 0 outside V')
  np.testing.assert_allclose(s["overlap"], np.minimum(p, q).sum(-1).sum(), rtol=1e-5)
  # without V' the sums have no V' keys (positions, outside, agree_full)
  _, plain = losses.mtp_loss(ModelOutput(jnp.asarray(main), (jnp.asarray(main),), ()),
                             jnp.asarray(tokens), None, 1.0)
  assert set(plain["mtp_1"]) == {"nll", "count", "correct", "byte_nll", "byte_count", "kl", "agree",
                                 "overlap"}


def test_bench_draft_head_quick(tmp_path):
  import importlib
  import json
  out = str(tmp_path / "bdh")
  importlib.import_module("experiments.bench_draft_head").main(
      ["--d_model", "32", "--vocab", "300", "--draft_vocab", "64", "--tokens", "1",
       "--repeats", "1", "--out", out])
  results = json.load(open(out + ".json"))["results"]
  assert {(r["draft_vocab"], r["variant"]) for r in results} == {
      (v, k) for v in (300, 64) for k in ("logits", "argmax", "sample")}
  assert all(r["call_us"] > 0 and r["loop_us"] > 0 for r in results)
  assert open(out + ".md").readline().startswith("Command: `python -m experiments.bench_draft_head")
