"""Text in and out of the Decoder for ``python -m decode``: prompt files
(lines or JSONL), the UTF-8 check, encoding (raw or chat template), a job's
rows (``encode_rows``) and one row's streamed text (``TextOut``)."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import TextIO

import numpy as np

from decode.errors import DecodeError
from mtp import tokenizer as tok


def read_prompt_file(path: str) -> list[str]:
  """One prompt per line, taken literally (prompt i is line i+1; line ends
  ``\\n``, ``\\r\\n`` or ``\\r``; a leading UTF-8 BOM dropped). Raises
  DecodeError for a missing file, an empty line, non-UTF-8 bytes (naming
  the line) or an empty file."""
  try:
    raw = open(path, "rb").read()
  except OSError as e:
    raise DecodeError(f"--prompt_file={path!r}: {e.strerror}") from e
  raw = raw.removeprefix(codecs.BOM_UTF8)
  prompts = []
  for i, line in enumerate(raw.splitlines(), 1):
    try:
      text = line.decode("utf-8")
    except UnicodeDecodeError as e:
      raise DecodeError(f"--prompt_file={path!r} line {i} is not valid UTF-8 "
                        f"(byte {e.start}: {line[e.start:e.start + 1]!r})") from e
    if not text:
      raise DecodeError(f"--prompt_file={path!r} line {i} is empty: every line is one prompt "
                        "(prompt i is line i+1); remove blank lines")
    prompts.append(text)
  if not prompts:
    raise DecodeError(f"--prompt_file={path!r} is empty: give one prompt per line")
  return prompts


def read_prompts(path: str) -> list[str] | list[dict]:
  """``--prompt_file``: a ``.jsonl`` file is read as chat prompts
  (``read_prompt_jsonl_file``), any other file as one prompt per line
  (``read_prompt_file``). Raises DecodeError."""
  return read_prompt_jsonl_file(path) if path.endswith(".jsonl") else read_prompt_file(path)


def read_prompt_jsonl_file(path: str) -> list[dict]:
  """A JSONL prompt file: per line ``{"prompt": str, "category": str
  (optional), "system": str (optional)}``, blank lines skipped (e.g.
  ``mtp/data/heldout_chat.jsonl``). Raises DecodeError naming the file and
  line: invalid UTF-8 or JSON, not an object, a missing or empty
  ``prompt``, a non-string value, an unknown field, or no prompt at all.
  """
  from mtp.data.chat import read_prompt_jsonl
  from mtp.data.corpora import DataError
  try:
    return read_prompt_jsonl(path, what="--prompt_file")
  except DataError as e:
    raise DecodeError(str(e)) from None


def check_prompt_text(prompts: Sequence[str], flag: str = "--prompt") -> None:
  """Raises DecodeError for text with lone surrogates (non-UTF-8 command-line
  bytes, PEP 383: 0xFF arrives as U+DCFF), naming the prompt, byte and
  position."""
  for i, p in enumerate(prompts):
    for j, ch in enumerate(p):
      if 0xD800 <= ord(ch) <= 0xDFFF:
        what = (f"byte 0x{ord(ch) - 0xDC00:02X}" if 0xDC80 <= ord(ch) <= 0xDCFF
                else f"lone surrogate U+{ord(ch):04X}")
        raise DecodeError(f"{flag} (prompt {i}) is not valid UTF-8: {what} at character {j}; "
                          "give UTF-8 text")


def encode_prompts(prompts: Sequence[str], tokenizer=None, chat: bool = False,
                   systems: Sequence[str | None] | None = None) -> list[np.ndarray]:
  """Token ids per prompt with ``tokenizer`` (default bytes): raw text (BOS
  first where the tokenizer adds one), or with ``chat`` one user message
  (after ``systems``' optional system message) in the chat template,
  generation prompt appended. Text that spells a special token never
  becomes the control token. Raises DecodeError for an empty prompt,
  invalid UTF-8, ``chat`` without a template, or a system message without
  ``chat``."""
  check_prompt_text(prompts, "--chat" if chat else "--prompt")
  tk = tokenizer or tok.ByteTokenizer()
  if chat and not tk.chat_template:
    raise DecodeError("--chat needs a tokenizer with a chat template (a workdir imported with "
                      "python -m mtp.importers); this model's tokenizer has none: use --prompt")
  out = []
  for i, p in enumerate(prompts):
    if not p:
      raise DecodeError(f"{'--chat' if chat else '--prompt'} (prompt {i}) is empty: give at "
                        "least one character")
    system = systems[i] if systems is not None else None
    if system and not chat:
      raise DecodeError(f"prompt {i} has a system message, which needs the chat template; this "
                        "model's tokenizer has none")
    if chat:
      msgs = ([{"role": "system", "content": system}] if system else []) + [
          {"role": "user", "content": p}]
      ids = tk.apply_chat_template(msgs, add_generation_prompt=True)
    elif tk.kind == "byte":
      ids = tk.encode(p, add_bos=True)
    else:
      ids = tk.encode(p)
    out.append(np.asarray(ids, np.int32))
  return out


def encode_rows(prompts: Sequence[str], tokenizer=None, *, num_samples: int = 1,
                chat: bool = False,
                systems: Sequence[str | None] | None = None) -> list[np.ndarray]:
  """The batch rows of ``prompts``: ``encode_prompts``'s ids of each prompt
  ``num_samples`` times in a row (row r is prompt r // num_samples). Raises
  DecodeError for num_samples < 1 and as ``encode_prompts``."""
  if not (isinstance(num_samples, int) and num_samples >= 1):
    raise DecodeError(f"--num_samples={num_samples!r} must be an integer >= 1")
  return [p for p in encode_prompts(prompts, tokenizer, chat, systems) for _ in range(num_samples)]


class TextOut:
  """One row's text on ``out`` while ``Decoder.stream`` hands it on: the
  ``prompt`` first (None: nothing, as before a chat reply), then each
  ``on_text(row, data)`` chunk decoded as UTF-8 incrementally (a character
  split across rounds waits for its last byte; invalid bytes print as
  U+FFFD), flushed per round; ``close()`` prints what is left and a newline."""

  def __init__(self, out: TextIO, prompt: str | None = None):
    self.out = out
    self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    if prompt is not None:
      out.write(prompt)

  def on_text(self, row: int, data: bytes) -> None:
    self.out.write(self._utf8.decode(data))
    self.out.flush()

  def close(self) -> None:
    self.out.write(self._utf8.decode(b"", final=True) + "\n")
