"""Stop conditions (issue 23.5): stop strings and stop token ids, exact
however the stop falls relative to a speculative round (inside an accepted
block, split across rounds, at the budget, inside a tree path), and nothing
past a stop is ever streamed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode import drafters as drafters_lib
from decode.decoder import DecodeError, Decoder, SamplingParams
from decode.stops import StopConditions, StopMatcher, cut_at_stop_strings
from mtp import model as model_lib
from mtp import tokenizer as tok
from tests.conftest import random_prompts, with_noisy_mtp

GREEDY = SamplingParams(temperature=0.0)
BYTES = lambda i: tok.ByteTokenizer().decode_bytes([i])


# -- the matcher alone ----------------------------------------------------------------

def test_matcher_holds_back_a_possible_stop_and_cuts_before_it():
  toks = {1: b"ab", 2: b"c\n", 3: b"\nxy", 4: b"z"}
  m = StopMatcher(["\n\n"], toks.__getitem__)
  assert m.feed([1]) == (1, b"ab", False)
  assert m.feed([2]) == (1, b"c", False)          # "\n" held back: may start the stop
  keep, text, stopped = m.feed([3, 4])
  assert (keep, text, stopped) == (1, b"", True)   # stop completed by token 3: cut there
  assert m.feed([4]) == (0, b"", True)


def test_matcher_stop_inside_one_token_and_flush_without_stop():
  toks = {1: b"xSTOPy", 2: b"ST", 3: b"OQ"}
  keep, text, stopped = StopMatcher(["STOP"], toks.__getitem__).feed([1, 2])
  assert (keep, text, stopped) == (1, b"x", True)
  m = StopMatcher(["STOP"], toks.__getitem__)
  assert m.feed([2]) == (1, b"", False)
  assert m.feed([3]) == (1, b"STOQ", False)        # "STO" was held back, then released
  assert m.flush() == b""
  m = StopMatcher(["STOP", "ZZ"], toks.__getitem__)
  assert m.feed([2]) == (1, b"", False) and m.flush() == b"ST"


def test_first_occurrence_wins_among_several_stops():
  ids = np.asarray([1, 2, 3], np.int32)
  toks = {1: b"a", 2: b"bc", 3: b"d"}
  cut, stopped = cut_at_stop_strings(ids, ["cd", "b"], toks.__getitem__)
  assert stopped and cut.tolist() == [1, 2]


def test_bad_stop_conditions_name_the_flag():
  for sc, match in [(StopConditions(token_ids=(999,)), "stop_token_ids.*\\[0, 263\\]"),
                    (StopConditions(strings=("",)), "--stop"),
                    (StopConditions(strings=("x" * 300,)), "at most 256"),
                    (StopConditions(strings=("\ud800",)), "surrogate")]:
    with pytest.raises(DecodeError, match=match):
      sc.validate(264)


# -- end to end -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def target(trained_markov):
  return with_noisy_mtp(trained_markov[1], 0.5)


@pytest.fixture(scope="module")
def reference(target):
  """AR greedy continuations without stops (the text stops are cut from)."""
  prompts = random_prompts([3, 9, 17, 30], seed=11)
  return prompts, Decoder(target, "ar").generate(prompts, 40, GREEDY)


class _StopProposer(drafters_lib.DraftModelDrafter):
  """Test drafter: always proposes the stop string's ids (one-hot q), so
  the stop lands inside accepted blocks whenever the target agrees."""

  def __init__(self, ids):
    self.ids = jnp.asarray(ids, jnp.int32)

  def init_state(self, draft, batch, cache_len):
    return {}

  def prefill(self, draft, state, tokens, lengths, h0, prefill_len):
    return state

  def draft(self, draft, state, tokens, n, key, params, g):
    d = jnp.broadcast_to(jnp.resize(self.ids, (g,)), (n.shape[0], g))
    for j in range(g):
      tokens = model_lib.write_cache(tokens, d[:, j:j + 1], n + j)
    return state, tokens, d, jax.nn.one_hot(d, 264, dtype=jnp.float32)


@pytest.fixture(scope="module")
def shared_decoders(target):
  """Decoders compiled once for the module (stop strings change no shape)."""
  return {"ar": Decoder(target, "ar"), "mtp3": Decoder(target, "mtp", 3),
          "tree": Decoder(target, "mtp", tree=(2, 2))}


def _decoders(shared, target, stop_ids):
  return {**shared, "proposer": Decoder(target, "draft", 3, target,
                                        drafter=_StopProposer(stop_ids))}


@pytest.mark.parametrize("where", [4, 37])
def test_stop_string_output_equals_ar_however_it_falls(target, shared_decoders, reference, where):
  """A stop string taken from row 0's AR output at offset ``where`` (the
  rows' other stops fall anywhere; 37 = at the budget's end): every method, both forms, gives AR's tokens cut
  after the token completing the stop, text cut before it; the stream
  never hands on a token or byte past the stop."""
  prompts, ref = reference
  row0 = ref.tokens[0]
  stop = b"".join(BYTES(int(i)) for i in row0[where:where + 3]).decode("utf-8")
  stops = StopConditions(strings=(stop,))
  want = []
  for ids in ref.tokens:
    cut, found = cut_at_stop_strings(ids, [stop], BYTES)
    want.append((cut, found))
  assert want[0][1]
  for name, dec in _decoders(shared_decoders, target, row0[where:where + 3]).items():
    gen = dec.generate(prompts, 40, GREEDY, stops=stops)
    streamed_ids = [[] for _ in prompts]
    streamed_text = [b"" for _ in prompts]
    sgen = dec.stream(prompts, 40, GREEDY, stops=stops,
                      on_tokens=lambda r, ids: streamed_ids[r].extend(ids.tolist()),
                      on_text=lambda r, b: streamed_text.__setitem__(r, streamed_text[r] + b))
    for b, (cut, found) in enumerate(want):
      for form, g in (("generate", gen), ("stream", sgen)):
        np.testing.assert_array_equal(g.tokens[b], cut, err_msg=f"{name} {form} row {b}")
        assert g.finish_reasons[b] == ("stop" if found else "length"), (name, form, b)
        text = b"".join(BYTES(int(i)) for i in ref.tokens[b])
        assert g.texts[b] == (text[:text.find(stop.encode())] if found else text)
      assert streamed_ids[b] == cut.tolist(), (name, b)
      assert streamed_text[b] == sgen.texts[b], (name, b)
      assert len(sgen.emit_times[b]) == len(cut)


def test_stop_token_id_kept_and_equal_to_ar(target, shared_decoders, reference):
  prompts, ref = reference
  stop_id = int(ref.tokens[1][6])
  stops = StopConditions(token_ids=(stop_id,))
  for name, dec in _decoders(shared_decoders, target, [stop_id] * 3).items():
    for form in ("generate", "stream"):
      gen = getattr(dec, form)(prompts, 40, GREEDY, stops=stops)
      for b, ids in enumerate(ref.tokens):
        hits = np.nonzero(ids == stop_id)[0]
        cut = ids[:hits[0] + 1] if len(hits) else ids
        np.testing.assert_array_equal(gen.tokens[b], cut, err_msg=f"{name} {form} row {b}")
        assert gen.finish_reasons[b] == ("stop" if len(hits) else "length")


def test_sampling_stream_equals_generate_with_stops(target):
  """At T = 1 a speculative row's law is AR's (the chi-square tests); for
  one seed both forms emit the same tokens, stops included."""
  prompts = random_prompts([4, 8, 6, 5], seed=3)
  dec = Decoder(target, "mtp", 2)
  free = dec.generate(prompts, 30, SamplingParams(1.0), seed=5)
  stop = bytes(free.tokens[0][5:7].tolist()).decode("utf-8")
  stops = StopConditions(strings=(stop,), token_ids=(int(free.tokens[2][3]),))
  one = dec.generate(prompts, 30, SamplingParams(1.0), seed=5, stops=stops)
  two = dec.stream(prompts, 30, SamplingParams(1.0), seed=5, stops=stops)
  for b in range(len(prompts)):
    np.testing.assert_array_equal(one.tokens[b], two.tokens[b])
  assert one.finish_reasons == two.finish_reasons
  assert one.finish_reasons[0] == "stop" and one.finish_reasons[2] == "stop"
