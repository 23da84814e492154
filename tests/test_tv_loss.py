"""The acceptance objective: total variation TV(p, q) = 1 - sum_x min(p, q)
as the MTP modules' distillation divergence (``mtp.distill_divergence`` =
"tv" or "mix" with ``mtp.tv_weight``), against a loop-based numpy
reference in the full, the reduced (-inf outside V') and the compact
(logits over V' only) forms, with padding and loss masks; finite
gradients at p == q; the config fields; and a short frozen-backbone run
whose held-out TV to the teacher drops."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp import config as config_lib
from mtp import draft_vocab as draft_vocab_lib
from mtp.config import ConfigError
from mtp.model import ModelOutput, build_model
from tests.conftest import ALPHABET, markov_batch, tiny_config, with_noisy_mtp
from train import losses
from train.loop import Trainer, make_loss_fn

B, T, V, DEPTH = 3, 12, 16, 2
PADDED = np.array([13, 14])            # ids every head gives -inf (vocabulary padding)
KEPT = np.array([0, 1, 2, 4, 5, 7, 9, 11, 12, 13])   # V' (13 is padded: p = q = 0 there)


def _probs(x):
  """softmax in float64 of logits with -inf entries."""
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _case(seed, tau_scale=2.0):
  """Random logits [B, T, V] with padded ids, packed documents, a padded row and a loss mask."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 13, (B, T)).astype(np.int32)
  seg = np.asarray([[1] * 5 + [2] * 5 + [3] * 2, [1] * 12, [1] * 7 + [0] * 5], np.int32)
  loss_mask = (rng.random((B, T)) < 0.7).astype(np.int32)
  main = rng.normal(size=(B, T, V)) * tau_scale
  mtp = [rng.normal(size=(B, T, V)) * tau_scale for _ in range(DEPTH)]
  main[..., PADDED] = -np.inf
  for m in mtp:
    m[..., PADDED] = -np.inf
  return tokens, seg, loss_mask, main.astype(np.float32), [m.astype(np.float32) for m in mtp]


def _reference_mtp(main, mtp, tokens, seg, loss_mask, lam, w, tau, a, kept=None):
  """lambda / D * sum_k [(1 - w) CE_k + w tau^2 ((1 - a) KL_k + a TV_k)], loop by loop.
  kept: None (full vocabulary) or V' ids: q is 0 outside V' (module logits
  -inf there), CE over targets in V' only, KL against the teacher restricted
  to V' and renormalised, TV against the full teacher."""
  inside = np.ones(V, bool) if kept is None else np.isin(np.arange(V), kept)
  total = 0.0
  for k, z in enumerate(mtp, 1):
    ce = div = 0.0
    n_in = n = 0
    for b in range(B):
      for i in range(T):
        j = i + k + 1
        if j >= T or seg[b, i] == 0 or seg[b, j] != seg[b, i] or loss_mask[b, j] != 1:
          continue
        q = _probs(np.where(inside, z[b, i], -np.inf) / tau)
        p = _probs(main[b, i + k] / tau)
        tv = 0.5 * np.abs(p - q).sum()
        pr = np.where(inside, p, 0.0)
        pr = pr / pr.sum()
        nz = pr > 0
        kl = np.sum(pr[nz] * (np.log(pr[nz]) - np.log(q[nz])))
        div += (1 - a) * kl + a * tv
        n += 1
        if inside[tokens[b, j]]:
          ce -= np.log(_probs(np.where(inside, z[b, i], -np.inf))[tokens[b, j]])
          n_in += 1
    total += (1 - w) * ce / max(n_in, 1) + w * tau ** 2 * div / max(n, 1)
  return lam / DEPTH * total


def _mtp_part(loss, sums):
  """The loss minus its main-head term (the forms differ in the main head only)."""
  main = sums["main"]
  return float(loss) - float(main["nll"]) / max(float(main["count"]), 1.0)


def _run(form, main, mtp, tokens, seg, loss_mask, **kw):
  """mtp_loss in ``form``: "full", "reduced" (full logits, -inf outside V') or
  "compact" (logits over V' only, the full teacher's normaliser passed in)."""
  lse = None
  if form == "full":
    out = ModelOutput(jnp.asarray(main), tuple(map(jnp.asarray, mtp)), ())
  elif form == "reduced":
    mask = np.isin(np.arange(V), KEPT) & ~np.isin(np.arange(V), PADDED)
    mtp = [np.where(mask, m, -np.inf).astype(np.float32) for m in mtp]
    out = ModelOutput(jnp.asarray(main), tuple(map(jnp.asarray, mtp)), (), jnp.asarray(mask))
  else:
    ids = jnp.asarray(KEPT, jnp.int32)
    out = ModelOutput(jnp.asarray(main[..., KEPT]), tuple(jnp.asarray(m[..., KEPT]) for m in mtp),
                      (), None, ids)
    lse = losses.full_logsumexp(jnp.asarray(main), kw.get("distill_temperature", 1.0))
  return losses.mtp_loss(out, jnp.asarray(tokens), jnp.asarray(seg), 0.4, depth=DEPTH,
                         loss_mask=jnp.asarray(loss_mask), byte_level=False,
                         teacher_logsumexp=lse, **kw)


# -- the per-position divergence ------------------------------------------------------

def test_teacher_tv_is_one_minus_the_acceptance_probability():
  _, _, _, main, mtp = _case(0)
  tv = np.asarray(losses.teacher_tv(jnp.asarray(main), jnp.asarray(mtp[0])))
  p, q = _probs(main), _probs(mtp[0])
  np.testing.assert_allclose(tv, 0.5 * np.abs(p - q).sum(-1), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(tv, 1 - np.minimum(p, q).sum(-1), rtol=1e-5, atol=1e-6)


def test_compact_tv_equals_the_full_vocabulary_tv():
  """Over V' with the full normaliser: the mass outside V' counts, exactly as
  the full form with q = 0 outside V' (not the TV to the renormalised teacher)."""
  _, _, _, main, mtp = _case(1)
  tau = 1.5
  q_full = np.where(np.isin(np.arange(V), KEPT), mtp[0], -np.inf).astype(np.float32)
  full = losses.teacher_tv(jnp.asarray(main), jnp.asarray(q_full), tau)
  compact = losses.teacher_tv(jnp.asarray(main[..., KEPT]), jnp.asarray(mtp[0][..., KEPT]), tau,
                              losses.full_logsumexp(jnp.asarray(main), tau))
  np.testing.assert_allclose(np.asarray(compact), np.asarray(full), rtol=1e-5, atol=1e-6)
  p = _probs(main / tau)
  outside = p[..., ~np.isin(np.arange(V), KEPT)].sum(-1)
  assert np.all(np.asarray(full) >= 0.5 * outside - 1e-6)     # alpha <= p(V')
  renormalised = losses.teacher_tv(jnp.asarray(main[..., KEPT]), jnp.asarray(mtp[0][..., KEPT]), tau)
  assert np.mean(np.abs(np.asarray(renormalised) - np.asarray(full))) > 1e-3


# -- the objective against the numpy reference ------------------------------------------

@pytest.mark.parametrize("form", ["full", "reduced", "compact"])
@pytest.mark.parametrize("div,a,w,tau", [("tv", 1.0, 1.0, 1.0), ("tv", 1.0, 0.4, 2.0),
                                         ("mix", 0.3, 0.7, 1.0), ("mix", 0.8, 1.0, 1.5),
                                         ("kl", 0.0, 0.6, 1.0)])
def test_objective_matches_reference(form, div, a, w, tau):
  tokens, seg, loss_mask, main, mtp = _case(2)
  loss, sums = _run(form, main, mtp, tokens, seg, loss_mask, distill_weight=w,
                    distill_temperature=tau, distill_divergence=div, tv_weight=a)
  want = _reference_mtp(main, mtp, tokens, seg, loss_mask, 0.4, w, tau, a,
                        None if form == "full" else KEPT)
  np.testing.assert_allclose(_mtp_part(loss, sums), want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["full", "reduced", "compact"])
def test_mix_ends_are_kl_and_tv(form):
  tokens, seg, loss_mask, main, mtp = _case(3)
  kw = dict(distill_weight=0.5, distill_temperature=1.0)
  run = lambda **k: float(_run(form, main, mtp, tokens, seg, loss_mask, **kw, **k)[0])
  assert run(distill_divergence="mix", tv_weight=0.0) == run(distill_divergence="kl")
  assert run(distill_divergence="mix", tv_weight=1.0) == run(distill_divergence="tv")
  assert run(distill_divergence="tv") != run(distill_divergence="kl")


def test_compact_tv_needs_the_normaliser_and_divergence_is_checked():
  tokens, seg, loss_mask, main, mtp = _case(4)
  out = ModelOutput(jnp.asarray(main[..., KEPT]), tuple(jnp.asarray(m[..., KEPT]) for m in mtp),
                    (), None, jnp.asarray(KEPT, jnp.int32))
  with pytest.raises(ValueError, match="teacher_logsumexp"):
    losses.mtp_loss(out, jnp.asarray(tokens), jnp.asarray(seg), 0.4, distill_weight=1.0,
                    distill_divergence="tv", byte_level=False)
  with pytest.raises(ValueError, match="'kl', 'tv' or 'mix'"):
    _run("full", main, mtp, tokens, seg, loss_mask, distill_weight=1.0, distill_divergence="js")


@pytest.mark.parametrize("form", ["full", "compact"])
@pytest.mark.parametrize("div", ["tv", "mix"])
def test_gradient_is_finite_where_the_draft_equals_the_teacher(form, div):
  """Module k at i given the main head's logits at i + k: p == q at every
  position (TV 0 in the full form, 0.5 p(outside V') in the compact one);
  the loss and its gradient stay finite (d|x|/dx = 0 at x = 0), -inf ids included."""
  tokens, seg, loss_mask, main, _ = _case(5)
  mtp = [np.concatenate([main[:, k:], main[:, :k]], 1) for k in range(1, DEPTH + 1)]

  def f(arrays):
    if form == "full":
      out = ModelOutput(jnp.asarray(main), tuple(arrays), ())
      lse = None
    else:
      out = ModelOutput(jnp.asarray(main[..., KEPT]), tuple(m[..., KEPT] for m in arrays), (),
                        None, jnp.asarray(KEPT, jnp.int32))
      lse = losses.full_logsumexp(jnp.asarray(main))
    loss, sums = losses.mtp_loss(out, jnp.asarray(tokens), jnp.asarray(seg), 0.4, depth=DEPTH,
                                 distill_weight=1.0, distill_divergence=div, tv_weight=0.5,
                                 teacher_logsumexp=lse, loss_mask=jnp.asarray(loss_mask),
                                 byte_level=False)
    return loss - sums["main"]["nll"] / jnp.maximum(sums["main"]["count"], 1.0)

  arrays = [jnp.asarray(m) for m in mtp]
  value, grads = jax.value_and_grad(f)(arrays)
  assert np.isfinite(float(value))
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
  if form == "full" and div == "tv":
    assert abs(float(value)) < 1e-6


# -- the config ------------------------------------------------------------------------

def test_config_fields():
  cfg = tiny_config(mtp=dict(distill_weight=0.5, distill_divergence="mix", tv_weight=0.25))
  assert cfg.mtp.distill_divergence == "mix" and cfg.mtp.tv_weight == 0.25
  assert tiny_config().mtp.distill_divergence == "kl" and tiny_config().mtp.tv_weight == 0.5
  with pytest.raises(ConfigError, match=r"^mtp\.tv_weight=1\.5 is out of range: must be in \[0, 1\]"):
    tiny_config(mtp=dict(tv_weight=1.5))
  with pytest.raises(ConfigError, match=r"^mtp\.distill_divergence='js' is not allowed: .*'mix'"):
    tiny_config(mtp=dict(distill_divergence="js"))
  # a config.json saved before tv_weight existed still loads, with today's objective
  old = json.loads(tiny_config().to_json())
  del old["mtp"]["tv_weight"]
  assert config_lib.from_dict(old) == tiny_config()
  assert config_lib.from_dict(json.loads(cfg.to_json())) == cfg


# -- the training step's compact form (train.loop.make_loss_fn with h0) -------------------

def test_loss_fn_compact_form_equals_the_full_form():
  """The frozen stage's step from cached h0 with V' (compact logits plus the
  full teacher's normaliser) gives the same module terms as the full forward."""
  cfg = tiny_config(mtp=dict(draft_vocab_size=12, distill_weight=0.6, distill_divergence="mix",
                             tv_weight=0.7, distill_temperature=1.5))
  model = build_model(cfg)
  ids = np.sort(np.concatenate([ALPHABET, [10, 33, 120, 258, 200]]))
  draft_vocab_lib.set_draft_vocab(model, ids)
  graphdef, params = nnx.split(model, nnx.Param)
  loss_fn = make_loss_fn(graphdef, cfg.mtp.loss_weight, cfg.mtp)
  batch = markov_batch(np.random.default_rng(0), 4, 32, np.full((7, 7), 1 / 7))
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  h0 = model.backbone_hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
  loss_fn = jax.jit(loss_fn)         # one program per form, not one per operation
  full = _mtp_part(*loss_fn(params, batch))
  compact = _mtp_part(*loss_fn(params, {**batch, "h0": h0}))
  np.testing.assert_allclose(compact, full, rtol=1e-5)


# -- a short run lowers the TV on held-out batches ------------------------------------------

def _held_out_tv(trainer, params, batch):
  m = losses.summarize(trainer.eval_sums(params, [batch]))
  return [1.0 - m[f"mtp_{k}/teacher_overlap"] for k in (1, 2)]


def test_tv_training_lowers_the_held_out_tv(trained_markov):
  """20 frozen-backbone steps of the TV objective alone (w = 1) from the
  trained Markov model with noise on its modules (so that drafts are often
  rejected): on a held-out batch, TV(p_main, q_k) = 1 - alpha drops at both
  depths."""
  _, model, transition = trained_markov
  model = with_noisy_mtp(model, 1.0)
  cfg = tiny_config(mtp=dict(distill_weight=1.0, distill_divergence="tv"),
                    train=dict(num_steps=20, batch_size=16, seq_len=32, warmup_steps=0,
                               learning_rate=3e-3, freeze_backbone=True))
  trainer = Trainer(cfg)
  state = trainer.init_state(nnx.state(model, nnx.Param))
  held = markov_batch(np.random.default_rng(99), 16, 32, transition)
  before = _held_out_tv(trainer, state.params, held)
  rng = np.random.default_rng(1)
  for _ in range(cfg.train.num_steps):
    state, metrics = trainer.train_step(state, markov_batch(rng, 16, 32, transition))
  after = _held_out_tv(trainer, state.params, held)
  assert np.isfinite(float(metrics["loss"]))
  for k, (b, a) in enumerate(zip(before, after), 1):
    assert a < 0.5 * b, f"depth {k}: TV {b:.4f} -> {a:.4f}"


def test_frozen_compact_step_with_the_tv_term_runs_jitted(trained_markov):
  """The Trainer's jitted frozen step from cached h0 with a draft vocabulary
  (the compact form: the full teacher's normaliser inside the step) trains
  the modules only and lowers the mixed objective on its batch."""
  _, model, transition = trained_markov
  cfg = tiny_config(mtp=dict(distill_weight=1.0, distill_divergence="mix", tv_weight=0.5,
                             draft_vocab_size=12),
                    train=dict(num_steps=8, batch_size=8, seq_len=32, warmup_steps=0,
                               learning_rate=3e-3, freeze_backbone=True))
  trainer = Trainer(cfg)
  ids = np.sort(np.concatenate([ALPHABET, [10, 33, 120, 258, 200]]))
  full = dict(nnx.to_flat_state(nnx.state(with_noisy_mtp(model, 1.0), nnx.Param)))
  params = trainer.init_state(nnx.state(build_model(cfg), nnx.Param)).params
  for path, var in nnx.to_flat_state(params):        # the trained weights, V' set below
    if path in full:
      var[...] = full[path][...]
  params = draft_vocab_lib.with_draft_vocab(params, ids)
  state = trainer.init_state(params)
  batch = markov_batch(np.random.default_rng(3), 8, 32, transition)
  batch["h0"] = trainer.hidden_states(state.params, batch)
  losses_seen = []
  for _ in range(cfg.train.num_steps):
    state, metrics = trainer.train_step(state, batch)
    losses_seen.append(float(metrics["loss"]))
  assert all(np.isfinite(losses_seen)) and losses_seen[-1] < losses_seen[0]
