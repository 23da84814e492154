"""The lossless decoding tests on a tiny model with a small BPE vocabulary
(issue 21): the engine reads the model's tokenizer (its end-of-turn id ends
a row, 258 is an ordinary token, the head mask comes from the config), and
greedy equality, the chi-square law of the first two tokens, trees and stop
strings hold as on the byte models."""

import numpy as np
import pytest

from decode.decoder import DecodeError, Decoder, SamplingParams
from decode.stops import StopConditions
from mtp import bpe
from mtp import tokenizer as tok
from tests.conftest import markov_transition, tiny_config, with_noisy_mtp
from tests.schedules import CyclingSchedule
from tests.test_decode_distribution import ALPHA, chi_square_pvalue, exact_pair_law
from tests.tiny_bpe import gguf_tokenizer_metadata, train_tiny_bpe

GREEDY = SamplingParams(temperature=0.0)
V = 320


@pytest.fixture(scope="module")
def bpe_tok():
  return bpe.BPETokenizer.from_gguf_metadata(gguf_tokenizer_metadata(train_tiny_bpe(V)))


@pytest.fixture(scope="module")
def states(bpe_tok):
  """The Markov source's tokens: five byte symbols, id 258 (the byte
  tokenizer's EOS; an ordinary token here) and the tokenizer's EOS."""
  eos = bpe_tok.eos_id
  assert eos != tok.EOS_ID and 258 not in bpe_tok.stop_ids and 258 != bpe_tok.pad_id
  ascii_ids = [bpe_tok.token_to_id(c) for c in "abcd"] + [bpe_tok.token_to_id("Ġ")]
  return np.asarray(ascii_ids + [258, eos], np.int32)


@pytest.fixture(scope="module")
def bpe_model(bpe_tok, states):
  """A D = 2 model with model.tokenizer = "bpe", trained ~150 steps on a
  Markov source over ``states`` (mass on a few ids, as the byte fixture)."""
  from train.loop import Trainer
  cfg = tiny_config(model=dict(vocab_size=V, tokenizer="bpe", num_tokens=bpe_tok.vocab_size,
                               never_emitted=str(bpe_tok.pad_id)),
                    train=dict(num_steps=150, batch_size=16, seq_len=32, warmup_steps=10,
                               learning_rate=1e-2))
  trainer = Trainer(cfg)
  state = trainer.init_state()
  rng = np.random.default_rng(0)
  trans = markov_transition(1)[:len(states), :len(states)]
  trans /= trans.sum(1, keepdims=True)
  cum = np.cumsum(trans, 1)
  for _ in range(cfg.train.num_steps):
    s = np.empty((16, 31), np.int64)
    s[:, 0] = rng.integers(0, len(states), 16)
    for t in range(1, 31):
      s[:, t] = (rng.random(16)[:, None] > cum[s[:, t - 1]]).sum(1)
    toks = np.concatenate([np.full((16, 1), bpe_tok.bos_id), states[s]], 1).astype(np.int32)
    batch = {"tokens": toks, "segment_ids": np.ones_like(toks),
             "positions": np.broadcast_to(np.arange(32, dtype=np.int32), toks.shape).copy()}
    state, _ = trainer.train_step(state, batch)
  return with_noisy_mtp(trainer.model(state.params), 0.5)


def _prompts(bpe_tok, states, lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [np.concatenate([[bpe_tok.bos_id], rng.choice(states[:-1], n)]).astype(np.int32)
          for n in lengths]


def test_a_bpe_model_needs_its_tokenizer(bpe_model):
  with pytest.raises(DecodeError, match="needs its tokenizer"):
    Decoder(bpe_model, "ar")


def test_greedy_equals_ar_and_the_tokenizers_eos_ends_rows(bpe_model, bpe_tok, states):
  prompts = _prompts(bpe_tok, states, [2, 7, 13, 20])
  ar = Decoder(bpe_model, "ar", tokenizer=bpe_tok)
  ref = ar.generate(prompts, 24, GREEDY)
  assert all(bpe_tok.eos_id not in t[:-1] for t in ref.tokens)        # nothing after EOS
  for r, t in zip(ref.finish_reasons, ref.tokens):
    assert r == ("eos" if t[-1] == bpe_tok.eos_id else "length")
  decoders = [Decoder(bpe_model, "mtp", g, tokenizer=bpe_tok) for g in (1, 3)]
  decoders += [Decoder(bpe_model, "mtp", tree=(2, 2), tokenizer=bpe_tok),
               Decoder(bpe_model, "mtp", "auto", max_draft_tokens=3, tokenizer=bpe_tok,
                       schedule=CyclingSchedule(3)),
               Decoder(bpe_model, "draft", 2, bpe_model, tokenizer=bpe_tok)]
  for dec in decoders:
    for form in ("generate", "stream"):
      gen = getattr(dec, form)(prompts, 24, GREEDY)
      for b in range(len(prompts)):
        np.testing.assert_array_equal(gen.tokens[b], ref.tokens[b], err_msg=f"{form} row {b}")
      assert gen.finish_reasons == ref.finish_reasons


def test_never_emitted_ids_get_probability_zero(bpe_model, bpe_tok, states):
  """PAD (model.never_emitted) and ids past the tokenizer's vocabulary are
  never emitted, even at a high temperature; 258 is."""
  mask = tok.head_mask(bpe_model.cfg)
  assert not mask[bpe_tok.pad_id] and mask[258]
  prompts = _prompts(bpe_tok, states, [3, 5, 9, 4] * 4, seed=2)
  for method in ("ar", "mtp"):
    gen = Decoder(bpe_model, method, 2, tokenizer=bpe_tok).generate(prompts, 32,
                                                                    SamplingParams(4.0), seed=1)
    emitted = np.concatenate(gen.tokens)
    assert mask[emitted].all(), sorted(set(emitted[~mask[emitted]]))


@pytest.mark.parametrize("sp", [SamplingParams(1.0), SamplingParams(0.7, top_k=3)],
                         ids=["chain_t1", "tree_t0.7_top3"])
def test_first_two_tokens_follow_the_target_law(bpe_model, bpe_tok, states, sp):
  prompt = _prompts(bpe_tok, states, [4], seed=5)[0]
  law = exact_pair_law(bpe_model, sp, prompt)
  dec = (Decoder(bpe_model, "mtp", 2, tokenizer=bpe_tok) if sp.top_k == 0 else
         Decoder(bpe_model, "mtp", tree=(2, 2), tokenizer=bpe_tok))
  gen = dec.generate([prompt] * 4000, 2, sp, seed=11)
  pairs = np.stack([np.pad(t, (0, 2 - len(t)), constant_values=bpe_tok.eos_id)[:2]
                    for t in gen.tokens])
  # a first token that is EOS ends the row: its pair is (EOS, EOS) by the padding,
  # so fold the law's EOS row onto (EOS, EOS) the same way
  lw = law.copy()
  lw[bpe_tok.eos_id] = 0
  lw[bpe_tok.eos_id, bpe_tok.eos_id] = law[bpe_tok.eos_id].sum()
  assert chi_square_pvalue(pairs, lw) > ALPHA
  assert gen.accepted_histogram[:, 1:].sum() > 0


def test_stop_string_on_bpe_bytes(bpe_model, bpe_tok, states):
  """Stop strings are matched on the BPE tokens' bytes (``decode_bytes``)."""
  prompts = _prompts(bpe_tok, states, [3, 8], seed=7)
  ref = Decoder(bpe_model, "ar", tokenizer=bpe_tok).generate(prompts, 20, GREEDY)
  ids = ref.tokens[0]
  text = bpe_tok.decode_bytes(ids)
  at = next(i for i in range(2, len(text) - 1) if text[i] < 128 and text[i + 1] < 128)
  stop = text[at:at + 2].decode("ascii")
  stops = StopConditions(strings=(stop,))
  for dec in (Decoder(bpe_model, "ar", tokenizer=bpe_tok),
              Decoder(bpe_model, "mtp", 3, tokenizer=bpe_tok)):
    gen = dec.stream(prompts, 20, GREEDY, stops=stops)
    assert gen.finish_reasons[0] == "stop"
    assert gen.texts[0] == text[:text.find(stop.encode())]
