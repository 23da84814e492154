"""Byte-level tokenizer: UTF-8 bytes plus three special tokens.

Ids 0..255 are the UTF-8 bytes, then ``PAD_ID = 256``, ``BOS_ID = 257`` and
``EOS_ID = 258``; ``VOCAB_SIZE = 259`` real tokens. Models may use a larger
(padded) vocabulary; ids at or above ``VOCAB_SIZE`` are never produced (the
model masks their logits, see ``mtp.model``).

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
