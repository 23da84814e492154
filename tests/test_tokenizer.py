import numpy as np
import pytest

from mtp import tokenizer as tok


@pytest.mark.parametrize("text", ["", "def f(x):\n  return x", "héllo wörld", "日本語 🚀 \u0000 \U0010ffff"])
def test_roundtrip(text):
  t = tok.ByteTokenizer()
  ids = t.encode(text, add_bos=True, add_eos=True)
  assert ids.dtype == np.int32
  assert ids[0] == tok.BOS_ID and ids[-1] == tok.EOS_ID
  assert t.decode(ids, errors="strict") == text
  assert len(ids) == len(text.encode("utf-8")) + 2


def test_special_ids_distinct_and_in_vocab():
  ids = {tok.PAD_ID, tok.BOS_ID, tok.EOS_ID}
  assert len(ids) == 3 and all(255 < i < tok.VOCAB_SIZE for i in ids)


def test_split_multibyte_never_raises_and_streams():
  t = tok.ByteTokenizer()
  ids = t.encode("a🚀b")
  assert "\ufffd" in t.decode(ids[:3])            # cut inside the 4-byte emoji
  dec = t.stream_decoder()
  pieces = [dec.push([i]) for i in ids] + [dec.flush()]
  assert "".join(pieces) == "a🚀b"
  assert pieces[1:4] == ["", "", ""]               # held back until complete


def test_encode_rejects_bytes():
  with pytest.raises(TypeError, match="expects str"):
    tok.ByteTokenizer().encode(b"abc")


def test_lone_surrogates_are_refused_not_encoded():
  """Issue 23.4: '\\ud800' has no UTF-8 form; encode used to return its
  surrogatepass bytes (ED A0 80), which are not UTF-8."""
  import pytest
  with pytest.raises(ValueError, match="lone surrogate U\\+D800 at character 2"):
    tok.ByteTokenizer().encode("ab\ud800c")
  with pytest.raises(ValueError, match="U\\+DCFF"):
    tok.ByteTokenizer().encode("def \udcff(")      # an undecodable argv byte 0xFF
