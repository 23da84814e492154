"""Prompts of one token decode with every method.

A BPE tokenizer that adds no BOS (SmolLM2's) encodes a one-word prompt as
one token, and a prompt of BOS alone is one token too. The MTP modules
draft the round starting at n from position n-2, which a row of n = 1 does
not have: its first round is an AR step (``decode.round``: drafts marked
absent), drafting starts from the second; the draft model drafts x_1 from
x_0 at once. Checked here: greedy output identical to AR and to a
cache-free argmax (AR, MTP G = 1..3, "auto", a tree, the draft model; both
forms; BOS-only and non-BOS prompts; a ragged batch of 1-, 2- and 5-token
prompts), the joint law of the first two tokens at T = 1 (chi-square, the
harness of tests/test_decode_distribution.py), the CLI path on a BPE
tokenizer without BOS, and the one-line error for an empty prompt.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from decode.auto.schedule import AutoSchedule
from decode.decoder import DecodeError, Decoder, SamplingParams
from mtp import model as model_lib
from mtp import tokenizer as tok
from tests.conftest import random_prompts, tiny_config, with_noisy_mtp
from tests.schedules import CyclingSchedule
from tests.test_decode_distribution import (ALPHA, NUM_SAMPLES, _perturbed, chi_square_pvalue,
                                            exact_pair_law)

GREEDY = SamplingParams(temperature=0.0)
MAX_NEW = 24
BOS_ONLY = np.asarray([tok.BOS_ID], np.int32)
ONE_BYTE = np.asarray([ord("c")], np.int32)      # one token, no BOS
ONE_TOKEN = {"bos_only": BOS_ONLY, "no_bos": ONE_BYTE}
# two batches of one compiled shape, that of tests/test_decode.py's batch (4 rows,
# prompt bucket 8, 24 new tokens): programs compiled by either file are loaded by the other
PROMPTS = {
    "one_token": [BOS_ONLY, ONE_BYTE, np.asarray([ord("e")], np.int32), BOS_ONLY],   # 1 token each
    "ragged": [BOS_ONLY, random_prompts([4], seed=3)[0], ONE_BYTE,
               random_prompts([1], seed=4)[0]],    # 1, 5, 1 and 2 tokens
}


@pytest.fixture(scope="module")
def target(trained_markov):
  """The trained Markov model, noise on its MTP modules (drafts sometimes wrong)."""
  return with_noisy_mtp(trained_markov[1], 0.5)


@pytest.fixture(scope="module")
def small_draft():
  return model_lib.build_model(tiny_config(mtp=dict(depth=0), model=dict(num_layers=1)), seed=5)


def cache_free_greedy(model, prompt: np.ndarray, max_new: int) -> np.ndarray:
  """Greedy continuation by a cache-free forward over a fixed buffer per
  step (causal, so slots past the row are never seen), cut after EOS."""
  buf = np.full((1, 64), tok.PAD_ID, np.int32)
  buf[0, :len(prompt)] = prompt
  forward = jax.jit(lambda x: model(x).logits)
  out = []
  for n in range(len(prompt), len(prompt) + max_new):
    nxt = int(jnp.argmax(forward(jnp.asarray(buf))[0, n - 1]))
    buf[0, n] = nxt
    out.append(nxt)
    if nxt == tok.EOS_ID:
      break
  return np.asarray(out, np.int32)


@pytest.fixture(scope="module")
def references(target):
  """Per prompt set: the AR decoder's greedy tokens, checked against the
  cache-free argmax."""
  out = {}
  for name, prompts in PROMPTS.items():
    gen = Decoder(target, "ar").generate(prompts, MAX_NEW, GREEDY)
    for b, p in enumerate(prompts):
      np.testing.assert_array_equal(gen.tokens[b], cache_free_greedy(target, p, MAX_NEW),
                                    err_msg=f"{name} row {b}")
    out[name] = gen
  return out


def _decoders(target, small_draft):
  return {
      "ar": lambda: Decoder(target, "ar"),
      "mtp_g1": lambda: Decoder(target, "mtp", 1),
      "mtp_g2": lambda: Decoder(target, "mtp", 2),
      "mtp_g3": lambda: Decoder(target, "mtp", 3),
      "auto": lambda: Decoder(target, "mtp", "auto", max_draft_tokens=3,
                              auto_costs=[1.0, 1.05, 1.1, 1.15]),
      "auto_cycling": lambda: Decoder(target, "mtp", "auto", max_draft_tokens=3,
                                      schedule=CyclingSchedule(3), auto_costs=[1.0] * 4),
      "tree": lambda: Decoder(target, "mtp", tree=(3, 2)),
      "draft_small": lambda: Decoder(target, "draft", 2, small_draft),
      "draft_self": lambda: Decoder(target, "draft", 3, target),
  }


METHODS = ["ar", "mtp_g1", "mtp_g2", "mtp_g3", "auto", "auto_cycling", "tree", "draft_small",
           "draft_self"]


@pytest.mark.parametrize("method", METHODS)
def test_one_token_prompts_decode_greedy_as_ar(target, small_draft, references, method,
                                               monkeypatch):
  """Every method, both forms, a batch of one-token prompts (BOS alone and
  without BOS) and a ragged batch [1, 5, 1, 2 tokens]: the tokens of AR
  (and of the cache-free argmax, ``references``)."""
  monkeypatch.setattr(AutoSchedule, "drafting_pays", lambda self, *a, **k: True)
  dec = _decoders(target, small_draft)[method]()
  for name, prompts in PROMPTS.items():
    ref = references[name]
    for form in ("generate", "stream"):
      gen = getattr(dec, form)(prompts, MAX_NEW, GREEDY)
      for b in range(len(prompts)):
        np.testing.assert_array_equal(gen.tokens[b], ref.tokens[b],
                                      err_msg=f"{method} {form} {name} row {b}")
      np.testing.assert_array_equal(gen.prompt_lengths, [len(p) for p in prompts])
      assert gen.accepted_histogram.sum() == gen.target_calls.sum()   # one entry per round
      if gen.draft_length_histogram is not None:
        np.testing.assert_array_equal(gen.draft_length_histogram.sum(1), gen.target_calls)
  if method == "draft_self":
    # p == q from the first round on: the draft model drafts x_1 from x_0
    # (every round accepts all G drafts but where the budget cuts it)
    assert gen.accepted_histogram[:, 0].sum() == 0


def test_mtp_first_round_of_a_one_token_row_is_an_ar_step(target):
  """A row of one token has no position n-2 to draft from: in its first
  round it accepts nothing (a = 0, one token) and "auto" counts the round at
  draft length 0 with no position tested, while the 5-token row of the same
  batch (and the 2-token row: position 0 is n-2) drafts in that round."""
  dec = Decoder(target, "mtp", "auto", max_draft_tokens=2, auto_costs=[1.0] * 3)
  state, p = dec.prepare(PROMPTS["ragged"], MAX_NEW, seed=0)
  state = dec.prefill(state, p)
  state = jax.device_get(dec.programs.round(dec.target_params, dec.draft_params, GREEDY,
                                            state, 2))
  np.testing.assert_array_equal(state.accepted_histogram[[0, 2]], [[1, 0, 0]] * 2)
  np.testing.assert_array_equal(state.length[[0, 2]], [2, 2])
  np.testing.assert_array_equal(state.auto.draft_length_histogram, [[1, 0, 0], [0, 0, 1],
                                                                    [1, 0, 0], [0, 0, 1]])
  np.testing.assert_array_equal(state.auto.position_tested[[0, 2]], 0)
  assert state.auto.position_tested[1, 0] == 1


@pytest.mark.parametrize("method", ["mtp_g2", "mtp_g3", "auto", "draft"])
def test_drafts_after_a_one_token_prompt_equal_a_cache_free_forward(target, small_draft, method):
  """Rows of 1, 5, 1 and 2 tokens, rounds with random accepted lengths (all
  accepted in the first round where a row may draft): every draft
  distribution equals a cache-free forward over the committed tokens and
  the earlier drafts (MTP module k at position n-2; the draft model at
  n-1..), so nothing a one-token row's first round writes into the drafter's
  caches is read as a committed entry later. A one-token row's first MTP
  round has no draft (q = 0, ids absent)."""
  from decode import round as round_lib
  warp = SamplingParams(temperature=1.0)
  if method == "draft":
    dec, gs = Decoder(target, "draft", 3, small_draft), [3] * 5
  elif method == "auto":
    dec = Decoder(target, "mtp", "auto", max_draft_tokens=3, auto_costs=[1.0] * 4)
    gs = [2, 0, 0, 3, 1, 0, 2]
  else:
    g = int(method[-1])
    dec, gs = Decoder(target, "mtp", g), [g] * 5
  prompts = PROMPTS["ragged"]
  state, p = dec.prepare(prompts, 40, seed=0)
  state = dec.prefill(state, p)
  props = {g: jax.jit(lambda tp, dp, s, g=g: round_lib.propose(dec.drafter, *dec.models(tp, dp),
                                                               s, warp, g)) for g in set(gs)}
  commit = jax.jit(lambda s, d, a, nxt, h0: round_lib.commit(dec.drafter, s, d, a, nxt, h0))
  model = small_draft if method == "draft" else target
  params = dec.draft_params if method == "draft" else dec.target_params
  forward = jax.jit(lambda prm, x: (lambda o: (jax.nn.softmax(o.logits), o.mtp_logits))(
      nnx.merge(nnx.graphdef(model), prm)(x)))
  rng = np.random.default_rng(4)
  drafted_once = np.zeros(len(prompts), bool)
  for g in gs:
    n = np.asarray(state.length)
    state, (d_tok, d_q, _, h0, _) = props[g](dec.target_params, dec.draft_params, state)
    a = rng.integers(0, g + 1, len(prompts))
    if g:
      probs, mtp_logits = forward(params, state.tokens)
      for b in range(len(prompts)):
        if n[b] < dec.drafter.min_length:
          assert method != "draft"
          np.testing.assert_array_equal(d_tok[b], round_lib.NO_DRAFT)
          assert not np.asarray(d_q[b]).any()
          a[b] = 0
          continue
        if not drafted_once[b]:
          a[b], drafted_once[b] = g, True
        if method == "draft":
          np.testing.assert_allclose(d_q[b], probs[b, n[b] - 1:n[b] - 1 + g], atol=2e-5,
                                     err_msg=f"row {b} n={n[b]}")
        for k in range(1, min(g, target.mtp_depth) + 1) if method != "draft" else ():
          np.testing.assert_allclose(d_q[b, k - 1], jax.nn.softmax(mtp_logits[k - 1][b, n[b] - 2]),
                                     atol=2e-5, err_msg=f"g={g} row {b} n={n[b]} depth {k}")
    state = commit(state, d_tok, jnp.asarray(a, jnp.int32),
                   jnp.asarray(rng.choice(np.frombuffer(b"abcdef ", np.uint8), len(prompts)),
                               jnp.int32), h0)
  assert drafted_once.all()


@pytest.mark.parametrize("method,prompt", [("mtp_g2", "bos_only"), ("mtp_g3", "no_bos"),
                                           ("tree", "bos_only"), ("draft", "no_bos")])
def test_first_two_tokens_of_a_one_token_prompt_follow_the_target_law(trained_markov, method,
                                                                      prompt):
  """T = 1: the joint law of the first two emitted tokens (the first from the
  one-token row's first round, the second from a drafted round, or both
  from the draft model's rounds) equals the exact target law by a
  chi-square test; drafts are accepted along the way."""
  model = trained_markov[1]
  sp = SamplingParams(temperature=1.0)
  one = ONE_TOKEN[prompt]
  dec = {"mtp_g2": lambda: Decoder(model, "mtp", 2),
         "mtp_g3": lambda: Decoder(model, "mtp", 3),
         "tree": lambda: Decoder(model, "mtp", tree=(2, 2)),
         "draft": lambda: Decoder(model, "draft", 2, _perturbed(model))}[method]()
  gen = dec.generate([one] * NUM_SAMPLES, 2, sp, seed=17)
  assert all(len(t) == 2 for t in gen.tokens)      # EOS has ~no mass on this source
  pairs = np.stack([t[:2] for t in gen.tokens])
  pvalue = chi_square_pvalue(pairs, exact_pair_law(model, sp, one))
  assert pvalue > ALPHA, f"{method} {prompt}: chi-square p={pvalue:.2e}"
  assert gen.accepted_histogram[:, 1:].sum() > 0


def test_empty_prompt_is_one_line_error(target):
  """No token is an error (one line); one token leaves max_seq_len - 1 new
  tokens of room."""
  dec = Decoder(target, "mtp", 2)
  with pytest.raises(DecodeError, match=r"^prompt 1 has no token as encoded: give at least 1$"):
    dec.prepare([BOS_ONLY, np.zeros(0, np.int32)], 4, 0)
  max_len = target.cfg.max_seq_len
  dec.prepare([BOS_ONLY], max_len - 1, 0)
  with pytest.raises(DecodeError, match=rf"max_new_tokens must be at most {max_len - 1} to leave"):
    dec.prepare(random_prompts([max_len - 1]), max_len, 0)


# -- the CLI path on a BPE tokenizer without BOS ------------------------------------------

@pytest.fixture(scope="module")
def bpe_workdir(tmp_path_factory):
  """A workdir of a random D = 2 model with the tiny BPE tokenizer (no BOS
  added, as SmolLM2's): checkpoint and tokenizer/."""
  from mtp import bpe
  from mtp import checkpoint as ckpt_lib
  from tests.tiny_bpe import gguf_tokenizer_metadata, train_tiny_bpe
  bpe_tok = bpe.BPETokenizer.from_gguf_metadata(gguf_tokenizer_metadata(train_tiny_bpe(320)))
  cfg = tiny_config(model=dict(vocab_size=320, tokenizer="bpe", num_tokens=bpe_tok.vocab_size,
                               never_emitted=str(bpe_tok.pad_id)))
  model = model_lib.build_model(cfg, seed=3)
  path = str(tmp_path_factory.mktemp("bpe_wd"))
  ckpt = ckpt_lib.Checkpointer(path)
  ckpt.save(1, nnx.state(model, nnx.Param), {}, None, cfg)
  ckpt.close()
  tok.save_tokenizer(bpe_tok, path)
  return path, model, bpe_tok


@pytest.mark.parametrize("method,kw", [("ar", {}), ("mtp", dict(num_draft_tokens=2)),
                                       ("mtp", dict(num_draft_tokens="auto")),
                                       ("mtp", dict(tree="2,2"))],
                         ids=["ar", "mtp", "auto", "tree"])
def test_cli_one_character_prompt_on_a_bpe_tokenizer_without_bos(bpe_workdir, method, kw,
                                                                capsys):
  """``decode.cli.run`` (what ``python -m decode --prompt H`` runs) on a BPE
  model: "H" is one token as encoded, and the streamed continuation is AR's."""
  from decode.cli.run import DecodeRequest, run
  from decode.cli.texts import encode_prompts, encode_rows
  path, model, bpe_tok = bpe_workdir
  (ids,) = encode_prompts(["H"], bpe_tok)
  assert len(ids) == 1 and bpe_tok.bos_id not in ids
  ref = Decoder(model, "ar", tokenizer=bpe_tok).generate([ids], 12, GREEDY)
  report = run(DecodeRequest(path, ["H"], method=method, max_new_tokens=12, sampling=GREEDY,
                             **kw)).to_json()
  assert report["results"][0]["tokens"] == ref.tokens[0].tolist()
  assert capsys.readouterr().out.startswith("H")
  gen = Decoder(model, "mtp", 3, tokenizer=bpe_tok).stream(
      encode_rows(["H", "Hello there"], bpe_tok), 12, GREEDY)
  np.testing.assert_array_equal(gen.tokens[0], ref.tokens[0])
