"""Byte-level tokenizer: UTF-8 bytes plus three special tokens.

Ids 0..255 are the UTF-8 bytes, then ``PAD_ID = 256``, ``BOS_ID = 257`` and
``EOS_ID = 258``; ``VOCAB_SIZE = 259`` real tokens. Models may use a larger
(padded) vocabulary.

Ids that can never be a correct next token (``NEVER_EMITTED_IDS``, and the
boolean form ``emittable_mask``) get probability exactly 0 on every decoding
path: the model's head sets their logits to -inf (``mtp.model``), so the
target's p, every drafter's q, the residual and the bonus token never hold
them at any temperature, top-k or top-p. They are, from the tokenizer and the
training targets (``train.losses.shifted_targets``):

- vocabulary padding, ids >= ``VOCAB_SIZE``: no text encodes to them;
- ``PAD_ID``: padding is never a training target (the loss masks it);
- ``BOS_ID``: every document starts with BOS and no target crosses a
  document boundary, so BOS is never the token that follows a position;
- the 13 bytes that no UTF-8 text contains (RFC 3629: 0xC0 and 0xC1, which
  could only start overlong forms, and 0xF5..0xFF, beyond U+10FFFF):
  ``encode`` only takes ``str``, so every training byte sequence is valid
  UTF-8 (lone surrogates, kept by ``surrogatepass``, encode to ED A0..BF xx).

EOS is a target (it ends every document) and stays emittable.

Every Unicode string round-trips exactly through ``encode``/``decode``.
``decode`` is lenient for display: special tokens are dropped and a split
multi-byte character becomes U+FFFD instead of raising. ``StreamDecoder``
emits text incrementally and holds back an incomplete UTF-8 sequence until
its remaining bytes arrive.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence

import numpy as np

NUM_BYTES = 256
PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
VOCAB_SIZE = 259
SPECIAL_NAMES = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>"}
INVALID_UTF8_BYTES = (0xC0, 0xC1) + tuple(range(0xF5, 0x100))
NEVER_EMITTED_IDS = (PAD_ID, BOS_ID) + INVALID_UTF8_BYTES   # plus every id >= VOCAB_SIZE


def emittable_mask(vocab_size: int) -> np.ndarray:
  """bool [vocab_size]: True for ids a model may emit (valid UTF-8 bytes and
  EOS); False for ``NEVER_EMITTED_IDS`` and vocabulary padding (>= VOCAB_SIZE).

  Raises ValueError if ``vocab_size < VOCAB_SIZE``.
  """
  if vocab_size < VOCAB_SIZE:
    raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {VOCAB_SIZE} ids")
  mask = np.arange(vocab_size) < VOCAB_SIZE
  mask[list(NEVER_EMITTED_IDS)] = False
  return mask


class ByteTokenizer:
  """UTF-8 byte tokenizer with PAD/BOS/EOS. Stateless; cheap to construct."""

  pad_id = PAD_ID
  bos_id = BOS_ID
  eos_id = EOS_ID
  vocab_size = VOCAB_SIZE

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
    """Encodes ``text`` to int32 ids [T] (T = UTF-8 byte count + specials).

    Raises:
      TypeError: if ``text`` is not a ``str`` (bytes must be decoded by the
        caller, who decides how to treat invalid UTF-8).
    """
    if not isinstance(text, str):
      raise TypeError(f"ByteTokenizer.encode expects str, got {type(text).__name__}")
    ids = np.frombuffer(text.encode("utf-8", errors="surrogatepass"), dtype=np.uint8).astype(np.int32)
    parts = []
    if add_bos:
      parts.append(np.array([BOS_ID], np.int32))
    parts.append(ids)
    if add_eos:
      parts.append(np.array([EOS_ID], np.int32))
    return np.concatenate(parts) if len(parts) > 1 else ids

  def decode_bytes(self, ids: Iterable[int]) -> bytes:
    """The raw bytes of ``ids``; special and out-of-range ids are dropped."""
    return bytes(int(i) for i in ids if 0 <= int(i) < NUM_BYTES)

  def decode(self, ids: Iterable[int], *, errors: str = "replace") -> str:
    """Decodes ids to text. With ``errors="strict"`` an invalid or split
    UTF-8 sequence raises ``UnicodeDecodeError``; the default replaces it."""
    return self.decode_bytes(ids).decode("utf-8", errors=errors)

  def stream_decoder(self) -> "StreamDecoder":
    return StreamDecoder()


class StreamDecoder:
  """Incremental decoder for streaming: ``push(ids)`` returns the text that
  became complete; an unfinished multi-byte character waits for its bytes."""

  def __init__(self):
    self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

  def push(self, ids: Sequence[int]) -> str:
    return self._dec.decode(bytes(int(i) for i in ids if 0 <= int(i) < NUM_BYTES))

  def flush(self) -> str:
    return self._dec.decode(b"", final=True)
