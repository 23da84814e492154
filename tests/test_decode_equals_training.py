"""Decoding equals training (issue 49 item 5): for a trained module, greedy
``--method mtp`` at G = 1 accepts a draft exactly where the module's
teacher-forced argmax over the emitted text (``Transformer.__call__``'s
mtp_logits[0], the training forward) equals the next token. Simulated
round by round, the teacher-forced argmax gives the decoder's accepted
histogram; an offset, cache position or draft-vocabulary mapping that
drifts between training and decoding changes it."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from decode.decoder import Decoder, SamplingParams
from mtp import draft_vocab as draft_vocab_lib
from tests.conftest import ALPHABET, random_prompts, with_noisy_mtp

GREEDY = SamplingParams(temperature=0.0)
NEW = 32


@nnx.jit
def _module1_argmax(model, tokens):
  out = model(tokens, jnp.arange(tokens.shape[1])[None], jnp.ones_like(tokens))
  return jnp.argmax(out.mtp_logits[0][0], -1)


def _teacher_forced_drafts(model, seq: np.ndarray) -> np.ndarray:
  """[len(seq)] ids: entry i < len(seq) - 1 is module 1's argmax at position
  i (h_i, emb of seq[i + 1]), its guess for seq[i + 2], as in training; one
  program for every row (seq padded to 64: causal, the padding is not seen)."""
  t = np.zeros((1, max(64, len(seq))), np.int32)
  t[0, :len(seq)] = seq
  return np.asarray(_module1_argmax(model, jnp.asarray(t)))[:len(seq)]


def _simulated_histogram(drafts: np.ndarray, seq: np.ndarray, prompt_len: int, new: int):
  """[rejected, accepted] rounds of greedy G = 1 decoding: the prefill
  caches the prompt but its last token; a round at n, the last token not
  yet run through the target (P - 1 first), drafts drafts[n - 1] for
  seq[n + 1] and emits 2 tokens when it equals it (draft + bonus), else 1."""
  hist, n, end = [0, 0], prompt_len - 1, prompt_len - 1 + new
  while n < end:
    ok = int(drafts[n - 1] == seq[n + 1])
    hist[ok] += 1
    n += 1 + ok
  return hist


@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_greedy_g1_drafts_are_the_teacher_forced_argmax(trained_markov, vocab):
  _, model, _ = trained_markov
  model = with_noisy_mtp(model, 0.3)      # drafts right often, not always: both outcomes occur
  if vocab == "reduced":      # V': most of the alphabet and a few others, so the mapping matters
    ids = np.unique(np.concatenate([ALPHABET[:-3], [0, 1, 2]])).astype(np.int32)
    model = draft_vocab_lib.with_draft_vocab_size(model, ids)
  prompts = random_prompts([5, 9, 14], seed=3)
  gen = Decoder(model, "mtp", 1).generate(prompts, NEW, GREEDY)
  accepted_somewhere = 0
  for b, p in enumerate(prompts):
    out = gen.tokens[b]
    assert len(out) == NEW
    seq = np.concatenate([p, out]).astype(np.int32)
    want = _simulated_histogram(_teacher_forced_drafts(model, seq), seq, len(p), NEW)
    np.testing.assert_array_equal(gen.accepted_histogram[b], want, err_msg=f"row {b}")
    accepted_somewhere += want[1] > 0 and want[0] > 0
  assert gen.accepted_histogram[:, 1].sum() > 0       # drafts are accepted: a drift would show
  if vocab == "reduced":                               # ids outside V' make rejections too
    assert accepted_somewhere >= 2, gen.accepted_histogram
