"""Stop conditions beyond the token budget, exact wherever a stop falls in a
speculative round (docs/decoding.md, "Stops").

Stop ids (EOS and ``StopConditions.token_ids``) are checked on the device in
``decode.round.commit``: the first one among a round's emitted tokens ends
the row and is kept. Stop strings are matched on the host over the emitted
bytes (``StopMatcher``): the tokens are cut after the token completing the
first occurrence, the text right before it (as vLLM and transformers). The
stream form matches after every round and never streams a stop string's
bytes (``StreamStops``); the while_loop form cuts rows after the loop
(``finish_rows``). Finish reasons: ``FINISH_REASONS`` ("eos", "stop",
"length", "error", "interrupted")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from decode.errors import DecodeError

FINISH_REASONS = ("eos", "stop", "length", "error", "interrupted")
MAX_STOP_IDS = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 256


@dataclasses.dataclass(frozen=True)
class StopConditions:
  """token_ids: ids that end a row when emitted (kept in the output, like
  EOS); strings: texts that end a row when its output contains one (cut
  right before the first occurrence)."""
  token_ids: tuple[int, ...] = ()
  strings: tuple[str, ...] = ()

  def validate(self, vocab_size: int) -> "StopConditions":
    """Returns self. Raises DecodeError naming --stop_token_ids / --stop and
    the allowed range: at most 16 ids in [0, vocab_size), at most 16
    non-empty strings of at most 256 UTF-8 bytes each."""
    ids, strings = tuple(self.token_ids), tuple(self.strings)
    if len(ids) > MAX_STOP_IDS:
      raise DecodeError(f"--stop_token_ids has {len(ids)} ids; at most {MAX_STOP_IDS}")
    for i in ids:
      if not (isinstance(i, (int, np.integer)) and not isinstance(i, bool) and 0 <= i < vocab_size):
        raise DecodeError(f"--stop_token_ids: {i!r} must be an integer in [0, {vocab_size - 1}]")
    if len(strings) > MAX_STOP_STRINGS:
      raise DecodeError(f"--stop has {len(strings)} strings; at most {MAX_STOP_STRINGS}")
    for s in strings:
      if not isinstance(s, str) or not s:
        raise DecodeError(f"--stop: {s!r} must be a non-empty string")
      try:
        n = len(s.encode("utf-8"))
      except UnicodeEncodeError:
        raise DecodeError(f"--stop: {s!r} is not valid Unicode text (a lone surrogate)") from None
      if n > MAX_STOP_STRING_BYTES:
        raise DecodeError(f"--stop: a string of {n} UTF-8 bytes; at most {MAX_STOP_STRING_BYTES}")
    return self


def stop_id_array(stop_ids: Sequence[int], batch: int) -> np.ndarray:
  """[B, K] int32 of the stop ids for every row (K >= 1; -1 pads: never an id)."""
  ids = sorted(set(int(i) for i in stop_ids)) or [-1]
  return np.tile(np.asarray(ids, np.int32), (batch, 1))


class StopMatcher:
  """Incremental stop-string matching over one row's emitted tokens.

  ``feed(ids)`` takes the row's newly emitted ids and returns (number of
  those ids to keep, bytes safe to release, stopped). Bytes that could be
  the start of a stop string are held back until the next tokens decide;
  ``flush()`` releases them when the row ends without a stop.

  Args:
    strings: the stop strings (may be empty: everything is released).
    token_bytes: id -> the bytes that id stands for in the output (b"" for
      specials), e.g. ``lambda i: tokenizer.decode_bytes([i])``.
  """

  def __init__(self, strings: Sequence[str], token_bytes: Callable[[int], bytes]):
    self.stops = [s.encode("utf-8") for s in strings]
    self.token_bytes = token_bytes
    self.longest = max((len(s) for s in self.stops), default=0)
    self.buf = b""          # bytes not yet released
    self.stopped = False

  def _holdback(self) -> int:
    """Length of the longest suffix of buf that is a proper prefix of a stop."""
    best = 0
    for s in self.stops:
      for k in range(min(len(s) - 1, len(self.buf)), best, -1):
        if self.buf.endswith(s[:k]):
          best = k
          break
    return best

  def feed(self, ids: Sequence[int]) -> tuple[int, bytes, bool]:
    if self.stopped:
      return 0, b"", True
    out = b""
    for n, i in enumerate(ids, 1):
      self.buf += self.token_bytes(int(i))
      hits = [j for j in (self.buf.find(s) for s in self.stops) if j >= 0]
      if hits:
        cut = min(hits)
        out += self.buf[:cut]
        self.buf, self.stopped = b"", True
        return n, out, True
    keep = self._holdback()
    out += self.buf[:len(self.buf) - keep]
    self.buf = self.buf[len(self.buf) - keep:]
    return len(ids), out, False

  def flush(self) -> bytes:
    out, self.buf = self.buf, b""
    return out


def cut_at_stop_strings(ids: np.ndarray, strings: Sequence[str],
                        token_bytes: Callable[[int], bytes]) -> tuple[np.ndarray, bool]:
  """(ids cut after the token completing the first stop string, whether one
  was found); ids unchanged when none occurs."""
  if not strings:
    return ids, False
  keep, _, stopped = StopMatcher(strings, token_bytes).feed(ids)
  return ids[:keep], stopped


def finish_reason(ids: np.ndarray, *, eos_ids: Sequence[int],
                  stop_ids: Sequence[int], stopped_by_string: bool, error: bool) -> str:
  """The reason a row ended (``FINISH_REASONS``) from its final tokens."""
  if error:
    return "error"
  if stopped_by_string:
    return "stop"
  if len(ids) and int(ids[-1]) in set(eos_ids):
    return "eos"
  if len(ids) and int(ids[-1]) in set(stop_ids):
    return "stop"
  return "length"


class StreamStops:
  """The stream form's per-row stop-string matching and callbacks: ``on_new``
  (for ``decode.loops.stream_rounds``) feeds each row's new ids to its
  ``StopMatcher``, hands the kept ids to ``on_tokens(row, ids)`` and the
  released text to ``on_text(row, bytes)``; ``flush`` releases what was
  held back at the end. ``needed`` is False when there is nothing to watch
  (no stop strings, no callbacks: the loop then never reads tokens back)."""

  def __init__(self, strings, token_bytes, batch: int, on_tokens=None, on_text=None):
    self.matchers = [StopMatcher(strings, token_bytes) for _ in range(batch)]
    self.on_tokens, self.on_text = on_tokens, on_text
    self.needed = bool(strings) or on_tokens is not None or on_text is not None

  def on_new(self, row: int, ids: np.ndarray) -> tuple[int, bool]:
    keep, text, stopped = self.matchers[row].feed(ids)
    if self.on_tokens is not None and keep:
      self.on_tokens(row, ids[:keep])
    if self.on_text is not None and text:
      self.on_text(row, text)
    return keep, stopped

  def flush(self) -> None:
    if self.on_text is not None:
      for row, m in enumerate(self.matchers):
        if (rest := m.flush()):
          self.on_text(row, rest)


def finish_rows(gen, stops: StopConditions | None, token_bytes, eos_ids):
  """A ``Generation`` with rows cut at stop strings (the while_loop form
  stops at ids only; the stream form's rows are already cut and are found
  again at their end), each row's ``texts`` (output bytes, cut before a
  stop string) and ``finish_reasons``. Returns ``gen``."""
  stops = stops or StopConditions()
  gen.finish_reasons, gen.texts = [], []
  for i, ids in enumerate(gen.tokens):
    ids, by_string = cut_at_stop_strings(ids, stops.strings, token_bytes)
    gen.tokens[i] = ids
    if gen.emit_times is not None:
      gen.emit_times[i] = gen.emit_times[i][:len(ids)]
    m = StopMatcher(stops.strings, token_bytes)
    gen.texts.append(m.feed(ids)[1] + m.flush())
    gen.finish_reasons.append(finish_reason(ids, eos_ids=eos_ids, stop_ids=stops.token_ids,
                                            stopped_by_string=by_string, error=False))
  return gen


def mark_interrupted(gen, max_new_tokens: int):
  """An interrupted ``Generation``'s rows that ended neither at a stop nor at
  their budget of ``max_new_tokens`` get the finish reason "interrupted"
  (``finish_rows`` reads only the tokens, and would say "length"). Returns
  ``gen``; unchanged when it was not interrupted."""
  if gen.interrupted:
    gen.finish_reasons = ["interrupted" if r == "length" and len(ids) < max_new_tokens else r
                          for r, ids in zip(gen.finish_reasons, gen.tokens)]
  return gen
