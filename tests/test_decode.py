"""Decoding engine: cache exactness, greedy equality, budgets/EOS, bad input.

The statistical (end-to-end distribution) tests live in
tests/test_decode_distribution.py.
"""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from decode import compiled
from decode import drafters as drafters_lib
from decode import kv_cache
from decode import round as round_lib
from decode import state as state_lib
from decode.decoder import DecodeError, Decoder, NonFiniteLogitsError, SamplingParams
from mtp import model as model_lib
from mtp import tokenizer as tok
from tests.conftest import ALPHABET, random_prompts, tiny_config, with_noisy_mtp

GREEDY = SamplingParams(temperature=0.0)


_prompts = random_prompts


@pytest.fixture(scope="module")
def target(trained_markov):
  """The trained Markov model with noise on its MTP modules only: the main
  head is unchanged, but drafts are wrong often enough that rows accept
  different numbers of drafts (a well-trained drafter on a Markov source
  can settle into cycles where every draft is accepted)."""
  return with_noisy_mtp(trained_markov[1], 0.5)


@pytest.fixture(scope="module")
def ar_greedy(target):
  """AR greedy reference for a batch of prompts of different lengths (one
  prompt bucket, 8: the shape of tests/test_one_token_prompt.py's batches)."""
  prompts = _prompts([2, 4, 6, 8])
  return prompts, Decoder(target, "ar").generate(prompts, 24, GREEDY)


# -- cache exactness --------------------------------------------------------------

@pytest.mark.parametrize("num_draft_tokens", [2, 1])
def test_mtp_draft_and_verify_logits_equal_cache_free_forward(target, num_draft_tokens):
  """After prefill and over rounds with random accepted lengths (forced, per
  row), every MTP module's q_k equals a cache-free forward of the backbone and
  modules over the committed tokens followed by the drafts, and the verify
  distributions equal the cache-free target's (docs/design.md section 6)."""
  g = num_draft_tokens
  dec = Decoder(target, "mtp", g)
  warp = SamplingParams(temperature=1.0)
  prompts = _prompts([2, 7, 12], seed=g)
  state, prefill_len = dec.prepare(prompts, 40, seed=0)
  state = dec.prefill(state, prefill_len)
  propose = jax.jit(lambda params, s: round_lib.propose(dec.drafter, *dec.models(params), s, warp,
                                                         dec.longest_draft))
  commit = jax.jit(functools.partial(round_lib.commit, dec.drafter))
  full = jax.jit(lambda params, x: (lambda o: (o.logits, o.mtp_logits))(
      dec.models(params)[0](x)))
  rng = np.random.default_rng(1)
  for _ in range(6):
    state, (d_tok, d_probs, p, h0, _) = propose(dec.target_params, state)
    n = np.asarray(state.length)
    # the whole token buffer, every row at once: committed + drafts, then slots
    # not written yet, which a causal forward never lets positions < n + g see
    # (one compiled shape for every round instead of one per row length)
    logits, mtp_logits = full(dec.target_params, state.tokens)
    for b in range(len(prompts)):
      np.testing.assert_allclose(p[b], jax.nn.softmax(logits[b, n[b] - 1:n[b] + g]), atol=2e-5)
      for k in range(1, min(g, target.mtp_depth) + 1):
        np.testing.assert_allclose(d_probs[b, k - 1], jax.nn.softmax(mtp_logits[k - 1][b, n[b] - 2]),
                                   atol=2e-5, err_msg=f"row {b} depth {k}")
    a = jnp.asarray(rng.integers(0, g + 1, len(prompts)), jnp.int32)
    nxt = jnp.asarray(rng.choice(ALPHABET, len(prompts)), jnp.int32)
    state = commit(state, d_tok, a, nxt, h0)


def test_auto_draft_lengths_keep_every_module_cache_exact(target):
  """With a variable draft length (G_max = 3 > D = 2), rounds at g = 0 (AR
  steps) let the module caches fall behind by more than a window, so the
  modules catch up over committed positions before drafting: q_k must still
  equal the cache-free forward at every round, whatever the g sequence."""
  dec = Decoder(target, "mtp", "auto", max_draft_tokens=3, auto_costs=[1.0, 1.0, 1.0, 1.0])
  warp = SamplingParams(temperature=1.0)
  prompts = _prompts([2, 7, 12], seed=4)
  state, prefill_len = dec.prepare(prompts, 60, seed=0)
  state = dec.prefill(state, prefill_len)
  props = {g: jax.jit(lambda params, s, g=g: round_lib.propose(dec.drafter, *dec.models(params), s, warp, g))
           for g in range(4)}
  commit = jax.jit(functools.partial(round_lib.commit, dec.drafter))
  full = jax.jit(lambda params, x: dec.models(params)[0](x).mtp_logits)
  rng = np.random.default_rng(5)
  for g in [0, 0, 0, 0, 0, 0, 2, 1, 0, 3, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3]:
    state, (d_tok, d_q, p, h0, _) = props[g](dec.target_params, state)
    n = np.asarray(state.length)
    if g:   # the whole buffer at once (causal: slots past n + g are never seen)
      mtp_logits = full(dec.target_params, state.tokens)
      for b in range(len(prompts)):
        for k in range(1, min(g, target.mtp_depth) + 1):
          np.testing.assert_allclose(d_q[b, k - 1], jax.nn.softmax(mtp_logits[k - 1][b, n[b] - 2]),
                                     atol=2e-5, err_msg=f"g={g} row {b} depth {k}")
    a = jnp.asarray(rng.integers(0, g + 1, len(prompts)), jnp.int32)
    nxt = jnp.asarray(rng.choice(ALPHABET, len(prompts)), jnp.int32)
    state = commit(state, d_tok, a, nxt, h0)


def test_draft_model_drafts_equal_cache_free_forward(target):
  draft = model_lib.build_model(tiny_config(mtp=dict(depth=0), model=dict(num_layers=1)), seed=7)
  g = 3
  dec = Decoder(target, "draft", g, draft)
  warp = SamplingParams(temperature=1.0)
  prompts = _prompts([2, 6], seed=3)
  state, prefill_len = dec.prepare(prompts, 40, seed=0)
  state = dec.prefill(state, prefill_len)
  propose = jax.jit(lambda tp, dp, s: round_lib.propose(dec.drafter, *dec.models(tp, dp), s, warp,
                                                         dec.longest_draft))
  commit = jax.jit(functools.partial(round_lib.commit, dec.drafter))
  rng = np.random.default_rng(2)
  forward = jax.jit(lambda tp, dp, x: jax.nn.softmax(dec.models(tp, dp)[1](x).logits))
  for _ in range(5):
    state, (d_tok, d_probs, p, h0, _) = propose(dec.target_params, dec.draft_params, state)
    n = np.asarray(state.length)
    ref = forward(dec.target_params, dec.draft_params, state.tokens)   # every row's whole
    # buffer at once (causal: the slots past n + g are never seen)
    for b in range(len(prompts)):
      np.testing.assert_allclose(d_probs[b], ref[b, n[b] - 1:n[b] - 1 + g], atol=2e-5)
    # include all-accepted rounds, where d_G was never fed to the draft model
    a = jnp.asarray(rng.choice([0, g, g], len(prompts)), jnp.int32)
    state = commit(state, d_tok, a, jnp.asarray(rng.choice(ALPHABET, len(prompts)), jnp.int32), h0)


# -- greedy equality ----------------------------------------------------------------

def _both_forms(dec, prompts, max_new, sp):
  """(generate's, stream's) Generation; the stream traced no decoding
  program: it runs the while_loop's program one round per call."""
  one = dec.generate(prompts, max_new, sp)
  traced, real = [], compiled.ProgramSpec.round_at
  with mock.patch.object(compiled.ProgramSpec, "round_at",
                         lambda self, *a: traced.append(a) or real(self, *a)):
    two = dec.stream(prompts, max_new, sp)
  assert not traced and dec.programs.round._cache_size() == 0
  return one, two


def test_auto_greedy_equals_ar(target, ar_greedy):
  """Draft length chosen every round (measured costs, and a schedule that
  switches every round through g = 0..3): output identical to AR."""
  from tests.schedules import CyclingSchedule
  prompts, ref = ar_greedy
  for dec in (Decoder(target, "mtp", "auto"),
              Decoder(target, "mtp", "auto", max_draft_tokens=3, schedule=CyclingSchedule(3),
                      auto_costs=[1.0, 1.0, 1.0, 1.0])):      # the cycle ignores costs
    for gen in _both_forms(dec, prompts, 24, GREEDY):
      for b in range(len(prompts)):
        np.testing.assert_array_equal(gen.tokens[b], ref.tokens[b], err_msg=f"{dec.schedule} row {b}")
      hist = gen.draft_length_histogram
      assert hist.shape == (len(prompts), dec.longest_draft + 1)
      np.testing.assert_array_equal(hist.sum(1), gen.target_calls)   # one chosen g per round
  assert (hist > 0).all(axis=0).sum() == dec.longest_draft + 1       # the cycle visited every g
  # sampling: both forms run the same segments, so they emit the same tokens for a seed
  dec = Decoder(target, "mtp", "auto", auto_costs=[1.0, 1.05, 1.1])
  one = dec.generate(prompts, 40, SamplingParams(1.0), seed=3)
  two = dec.stream(prompts, 40, SamplingParams(1.0), seed=3)
  for b in range(len(prompts)):
    np.testing.assert_array_equal(one.tokens[b], two.tokens[b])
  np.testing.assert_array_equal(one.draft_length_histogram, two.draft_length_histogram)


@pytest.mark.parametrize("g", [1, 2, 3])
def test_mtp_greedy_equals_ar(target, ar_greedy, g):
  """Batch of prompts with different lengths; G = 3 > D = 2 reuses module D."""
  prompts, ref = ar_greedy
  dec = Decoder(target, "mtp", g)
  for gen in _both_forms(dec, prompts, 24, GREEDY):
    for b in range(len(prompts)):
      np.testing.assert_array_equal(gen.tokens[b], ref.tokens[b], err_msg=f"G={g} row {b}")
  hist = gen.accepted_histogram
  assert hist[:, 1:].sum() > 0, "the trained drafter should get some drafts accepted"
  # rows accepted different numbers of drafts in the same rounds
  assert len({tuple(h) for h in hist}) > 1


def test_ar_stream_equals_while_loop(target, ar_greedy):
  prompts, ref = ar_greedy
  gen = Decoder(target, "ar").stream(prompts, 24, GREEDY)
  for b in range(len(prompts)):
    np.testing.assert_array_equal(gen.tokens[b], ref.tokens[b])
  assert (gen.target_calls == 24).all()


class _FixedDrafter(drafters_lib.DraftModelDrafter):
  """Test drafter: proposes tokens from a rule, with one-hot q."""

  def __init__(self, rule):
    self.rule = rule

  def init_state(self, draft, batch, cache_len):
    return {}

  def prefill(self, draft, state, tokens, lengths, h0, prefill_len):
    return state

  def draft(self, draft, state, tokens, n, key, params, g):
    d = self.rule(key, tokens, n, g)
    for j in range(g):
      tokens = model_lib.write_cache(tokens, d[:, j:j + 1], n + j)
    return state, tokens, d, jax.nn.one_hot(d, 264, dtype=jnp.float32)


@pytest.mark.parametrize("rule_name", ["random", "adversarial_pad", "copy_last"])
def test_greedy_equals_ar_with_random_and_adversarial_drafters(target, ar_greedy, rule_name):
  rules = {
      "random": lambda key, tokens, n, g: jax.random.choice(key, jnp.asarray(ALPHABET), (n.shape[0], g)),
      # ids the target can never emit at temperature 0 here (PAD / vocab padding)
      "adversarial_pad": lambda key, tokens, n, g: jnp.full((n.shape[0], g), tok.PAD_ID, jnp.int32)
      .at[:, -1].set(263),
      "copy_last": lambda key, tokens, n, g: jnp.repeat(
          drafters_lib.gather_rows(tokens, (n - 1)[:, None]), g, axis=1),
  }
  prompts, ref = ar_greedy
  dec = Decoder(target, "draft", 3, target, drafter=_FixedDrafter(rules[rule_name]))
  gen = dec.generate(prompts, 24, GREEDY)
  for b in range(len(prompts)):
    np.testing.assert_array_equal(gen.tokens[b], ref.tokens[b], err_msg=f"{rule_name} row {b}")
  if rule_name == "adversarial_pad":
    assert gen.accepted_histogram[:, 1:].sum() == 0


def test_draft_model_greedy_equals_ar(target, ar_greedy):
  prompts, ref = ar_greedy
  small = model_lib.build_model(tiny_config(mtp=dict(depth=0), model=dict(num_layers=1)), seed=5)
  for draft in (target, small):    # the target as its own drafter accepts everything
    gen = Decoder(target, "draft", 2, draft).generate(prompts, 24, GREEDY)
    for b in range(len(prompts)):
      np.testing.assert_array_equal(gen.tokens[b], ref.tokens[b])
  full = Decoder(target, "draft", 2, target).generate(prompts, 24, GREEDY)
  # p == q: every draft accepted (only the budget can cut the last round short)
  assert full.accepted_histogram[:, :2].sum() == 0


# -- EOS, budget, lengths -----------------------------------------------------------

def _commit_case(g, d_tok, a, nxt, n, prompt_len, max_new):
  target = model_lib.build_model(tiny_config(mtp=dict(depth=0), model=dict(num_layers=1)), seed=0)
  b = len(n)
  state = state_lib.init_state(target.cfg, [np.zeros(2, np.int32)] * b, 1, 0, 64, g)
  state = state.replace(length=jnp.asarray(n, jnp.int32), prompt_len=jnp.asarray(prompt_len, jnp.int32),
                        max_new=jnp.asarray(max_new, jnp.int32))
  out = round_lib.commit(None, state, jnp.asarray(d_tok, jnp.int32), jnp.asarray(a, jnp.int32),
                         jnp.asarray(nxt, jnp.int32), None)
  out = jax.device_get(out)
  return {"length": out.length, "done": out.done, "tokens": out.tokens,
          "accepted_histogram": out.accepted_histogram}


def test_eos_inside_accepted_block_and_budget_mid_block():
  e = tok.EOS_ID
  out = _commit_case(
      g=4,
      d_tok=[[10, e, 12, 13], [10, 11, 12, 13], [10, 11, 12, 13], [10, 11, 12, 13]],
      a=[4, 4, 1, 4], nxt=[99, 99, e, 99],
      n=[5, 5, 5, 5], prompt_len=[5, 5, 5, 3], max_new=[50, 3, 50, 50])
  # row 0: EOS is the 2nd accepted draft: emit [10, EOS], stop
  # row 1: budget 3 reached inside the block: emit [10, 11, 12], stop
  # row 2: one accepted then EOS as the residual token: emit [10, EOS], stop
  # row 3: all accepted + bonus: 5 tokens, continue
  np.testing.assert_array_equal(out["length"], [7, 8, 7, 10])
  np.testing.assert_array_equal(out["done"], [True, True, True, False])
  np.testing.assert_array_equal(out["tokens"][0, 5:7], [10, e])
  np.testing.assert_array_equal(out["tokens"][1, 5:8], [10, 11, 12])
  np.testing.assert_array_equal(out["tokens"][3, 5:10], [10, 11, 12, 13, 99])
  np.testing.assert_array_equal(out["accepted_histogram"][:, 4], [1, 1, 0, 1])


def test_done_rows_emit_nothing_more(target):
  prompts = _prompts([4, 20])
  gen = Decoder(target, "mtp", 2).generate(prompts, 7, SamplingParams(temperature=1.0), seed=3)
  assert all(len(t) <= 7 for t in gen.tokens)
  assert all(len(t) == 7 or t[-1] == tok.EOS_ID for t in gen.tokens)


# -- bad input ------------------------------------------------------------------------

def test_host_weights_are_moved_to_the_device_once(target):
  """A model whose parameters are numpy arrays (as orbax restores them
  without a sharding) is decoded from device copies made once: passed as
  numpy, every jitted round would copy the weights to the device again."""
  graphdef, params = nnx.split(target, nnx.Param)
  host = nnx.merge(graphdef, jax.tree.map(np.asarray, params))
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(nnx.state(host, nnx.Param)))
  dec = Decoder(host, "mtp", 2)
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(dec.target_params))


def test_bad_input_errors(target):
  dec = Decoder(target, "mtp", 2)
  max_len = target.cfg.max_seq_len
  with pytest.raises(DecodeError, match=r"prompt 0 has no token as encoded: give at least 1"):
    dec.prepare([np.zeros(0, np.int32)], 4, 0)
  with pytest.raises(DecodeError, match=f"no room left.*at most {max_len - 4} tokens as encoded"):
    dec.prepare(_prompts([max_len - 1]), 4, 0)
  with pytest.raises(DecodeError, match=f"max_new_tokens must be at most {max_len - 1}"):
    dec.prepare(_prompts([max_len - 1]), max_len, 0)
  with pytest.raises(DecodeError, match="at most 3 new tokens"):
    dec.prepare(_prompts([max_len - 4]), 4, 0)
  with pytest.raises(DecodeError, match="max_new_tokens"):
    dec.prepare(_prompts([3]), 0, 0)
  for bad in (target.cfg.vocab_size, -1):       # an id past the vocabulary, not a NaN later
    with pytest.raises(DecodeError, match=f"prompt 1 holds token id {bad}, outside .*vocabulary"):
      dec.prepare(_prompts([3]) + [np.asarray([tok.BOS_ID, 70, bad], np.int32)], 4, 0)
  for sp, flag in [(SamplingParams(-1.0), "temperature"), (SamplingParams(1.0, -1), "top_k"),
                   (SamplingParams(1.0, 0, 0.0), "top_p"), (SamplingParams(1.0, 0, 1.5), "top_p")]:
    with pytest.raises(DecodeError, match=flag):
      sp.validate()
  with pytest.raises(DecodeError, match="num_draft_tokens"):
    Decoder(target, "mtp", 0)
  with pytest.raises(DecodeError, match="mtp.depth"):
    Decoder(model_lib.build_model(tiny_config(mtp=dict(depth=0)), seed=0), "mtp", 2)
  other = model_lib.build_model(tiny_config(model=dict(vocab_size=272), mtp=dict(depth=0)), seed=0)
  with pytest.raises(DecodeError, match="vocab"):
    Decoder(target, "draft", 2, other)
  with pytest.raises(DecodeError, match="method"):
    Decoder(target, "beam")


def test_cache_length_buckets():
  """Prompts pad to 8, 16, 32, 64, then multiples of 64; the cache holds
  the padded prompt, the budget and the headroom, in at least 64 slots."""
  assert ([kv_cache.bucket(n) for n in (0, 1, 8, 9, 16, 17, 33, 64, 65, 128, 129)]
          == [8, 8, 8, 16, 16, 32, 64, 64, 128, 128, 192])
  for n in range(1, 200, 7):
    for max_new, room in ((1, 4), (24, 12), (300, 10)):
      p, s = kv_cache.cache_length(n, max_new, room)
      assert n <= p < max(2 * n, 16) if n <= 64 else 0 <= p - n < 64
      assert s >= max(64, p + max_new + room) and s == kv_cache.bucket(s)


def test_prompt_at_maximum_length_generates_to_the_limit(target):
  """A prompt leaving exactly max_new_tokens of room decodes without overflow."""
  max_len = target.cfg.max_seq_len
  prompts = _prompts([max_len - 1 - 5])
  gen = Decoder(target, "mtp", 3).generate(prompts, 5, GREEDY)
  ref = Decoder(target, "ar").generate(prompts, 5, GREEDY)
  np.testing.assert_array_equal(gen.tokens[0], ref.tokens[0])


# -- non-finite logits ------------------------------------------------------------------

def _with_nan(model, where: str):
  """A copy of ``model`` with one NaN entry in the first parameter whose
  path contains ``where`` ("blocks": the target; "mtp": a drafter module)."""
  graphdef, params = nnx.split(model, nnx.Param)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  done = False
  out = []
  for path, x in leaves:
    if not done and where in jax.tree_util.keystr(path):
      x = jnp.asarray(x).at[(0,) * x.ndim].set(jnp.nan)
      done = True
    out.append(x)
  return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, out))


@pytest.mark.parametrize("where,source", [("blocks", "target"), ("mtp", "drafter")])
def test_non_finite_logits_stop_with_an_error_and_emit_nothing(target, where, source):
  """Issue 10: one NaN weight used to decode as a valid-looking byte 0.
  Both forms, greedy and sampled, AR and MTP: an error naming the row and
  the position, and no token emitted from the bad logits."""
  bad = _with_nan(target, where)
  prompts = _prompts([5, 9])
  methods = [("mtp", 2)] + ([("ar", 0)] if source == "target" else [])
  for method, g in methods:
    dec = Decoder(bad, method, max(g, 1))
    for sp in (SamplingParams(1.0), GREEDY):
      for form in (dec.generate, dec.stream):
        # row 0: BOS + 5 bytes, so the first round's logits are those at position 5
        with pytest.raises(NonFiniteLogitsError, match=rf"{source} produced non-finite.*row 0 at position 5") as e:
          form(prompts, 20, sp)
        assert e.value.source == source and e.value.row == 0 and e.value.position == 5
        assert [len(r) for r in e.value.rows] == [0, 0], (method, sp, form)


def test_a_row_failing_mid_generation_keeps_what_came_before(target):
  """The flag set inside the round stops exactly the failing row: its
  earlier tokens stay, the round's tokens are not emitted, other rows go on."""
  from decode.errors import ERROR_TARGET
  from decode.round import flag_non_finite as _flag_non_finite
  dec = Decoder(target, "ar")
  state, _ = dec.prepare(_prompts([4, 6]), 10, 0)
  logits = jnp.zeros((2, 1, target.cfg.vocab_size)).at[1, 0, 5].set(jnp.inf)
  state = state.replace(length=jnp.asarray([7, 9], jnp.int32))
  state = _flag_non_finite(state, logits, None, state.length,
                           allowed=tok.head_mask(target.cfg))
  np.testing.assert_array_equal(state.error, [0, ERROR_TARGET])
  np.testing.assert_array_equal(state.error_pos[1], 8)
  out = round_lib.commit(None, state, None, jnp.zeros(2, jnp.int32), jnp.asarray([97, 98], jnp.int32),
                         None)
  np.testing.assert_array_equal(out.length, [8, 9])          # row 1 emits nothing
  np.testing.assert_array_equal(out.done, [False, True])
  # -inf at a never-emitted id (the head's own mask) is not an error
  masked = jnp.zeros((2, 1, target.cfg.vocab_size)).at[:, 0, tok.BOS_ID].set(-jnp.inf)
  state, _ = dec.prepare(_prompts([4, 6]), 10, 0)
  assert not _flag_non_finite(state, masked, None, state.length,
                          allowed=tok.head_mask(target.cfg)).error.any()


def test_high_temperature_never_emits_never_emitted_ids(target):
  """Issue 10: BOS (and PAD, vocabulary padding, non-UTF-8 bytes) were
  sampled at T = 1.3 by AR and MTP decoding; their probability is now
  exactly 0 on every path (target p, draft q, residual, bonus)."""
  never = ~tok.emittable_mask(target.cfg.vocab_size)
  prompts = _prompts([3, 7, 11, 5] * 4)
  for method, g in (("ar", 0), ("mtp", 2), ("mtp", 3), ("draft", 2)):
    dec = Decoder(target, method, max(g, 1), target if method == "draft" else None)
    for sp in (SamplingParams(3.0), SamplingParams(8.0, top_p=0.99)):
      gen = dec.generate(prompts, 48, sp, seed=1)
      emitted = np.concatenate(gen.tokens)
      assert not never[emitted].any(), (method, sp, sorted(set(emitted[never[emitted]])))
