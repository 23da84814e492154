"""Text in and out of the Decoder for ``python -m decode``: prompt files
(one prompt per line, or JSONL chat prompts), the UTF-8 check of prompt
text, encoding (raw text or one chat message with the model's template)
and the streamed decoding of a batch of prompts to text (``decode_texts``).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import TextIO

import numpy as np

from decode.errors import DecodeError
from decode.sampling import SamplingParams
from decode.decoder import Decoder
from decode.stops import StopConditions
from mtp import tokenizer as tok


def read_prompt_file(path: str) -> list[str]:
  """One prompt per line, every line taken literally (no escapes; a prompt
  cannot contain a newline: use ``--prompt $'...'`` for one multi-line
  prompt), so prompt i is line i+1. Line ends are ``\\n``, ``\\r\\n`` or
  ``\\r``; a final line end is optional.

  A UTF-8 byte-order mark at the start of the file (editors on Windows
  write one) is not part of the first prompt.

  Raises DecodeError for a missing file, an empty line (naming it: an empty
  prompt is an error), non-UTF-8 bytes (naming the line) or an empty file.
  """
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
  """A JSONL prompt file: one JSON object per line, ``{"prompt": str,
  "category": str (optional), "system": str (optional)}`` (blank lines
  skipped), e.g. the held-out set ``mtp/data/heldout_chat.jsonl``. With a
  model whose tokenizer has a chat template each object is a chat (an
  optional system message, the prompt as the user message, the generation
  prompt appended); without one the prompt is raw text. Results and
  statistics are then also reported per ``category``.

  Raises DecodeError, one line naming the file and the line: invalid UTF-8
  or JSON, not an object, a missing or empty ``prompt``, a value that is not
  a string, an unknown field, or no prompt at all.
  """
  from mtp.data.chat import read_prompt_jsonl
  from mtp.data.corpora import DataError
  try:
    return read_prompt_jsonl(path, what="--prompt_file")
  except DataError as e:
    raise DecodeError(str(e)) from None


def check_prompt_text(prompts: Sequence[str], flag: str = "--prompt") -> None:
  """Raises DecodeError for text that is not valid Unicode: Python turns
  command-line bytes that are not UTF-8 into lone surrogates (PEP 383), so a
  byte such as 0xFF typed into --prompt arrives as U+DCFF; it is refused,
  naming the prompt, the byte and its position, instead of being fed to the
  model as other bytes."""
  for i, p in enumerate(prompts):
    for j, ch in enumerate(p):
      if 0xD800 <= ord(ch) <= 0xDFFF:
        what = (f"byte 0x{ord(ch) - 0xDC00:02X}" if 0xDC80 <= ord(ch) <= 0xDCFF
                else f"lone surrogate U+{ord(ch):04X}")
        raise DecodeError(f"{flag} (prompt {i}) is not valid UTF-8: {what} at character {j}; "
                          "give UTF-8 text")


def encode_prompts(prompts: Sequence[str], tokenizer=None, chat: bool = False,
                   systems: Sequence[str | None] | None = None) -> list[np.ndarray]:
  """Token ids per prompt with ``tokenizer`` (default the byte tokenizer):
  raw text (BOS first where the tokenizer adds one: always for the byte
  tokenizer), or with ``chat`` one user message rendered with the
  tokenizer's chat template (generation prompt appended). Text is always
  encoded as text: a prompt that spells a special token (``<|im_start|>``)
  never becomes the control token; only the template emits those.

  ``systems``: per prompt an optional system message (placed before the
  user message; needs ``chat``).

  Raises DecodeError for an empty prompt, text that is not valid UTF-8
  (``check_prompt_text``), ``chat`` with a tokenizer that has no template,
  or a system message without ``chat``.
  """
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


def decode_texts(decoder: Decoder, prompts: Sequence[str], *, max_new_tokens: int,
                 sampling: SamplingParams, num_samples: int = 1, seed: int = 0,
                 warmup: bool = True, out: TextIO | None = None,
                 stops: StopConditions | None = None, chat: bool = False,
                 systems: Sequence[str | None] | None = None, interruptible: bool = False):
  """Decodes every prompt ``num_samples`` times in one batch (stream form).

  With one prompt and one sample, text is streamed to ``out`` as it is
  emitted (never past a stop string), after the prompt (raw prompts) or
  alone (``chat``: the reply to one user message). ``warmup`` first
  compiles what the stream runs (``Decoder.warm_up``: the same shapes and
  programs, one token per row; "auto" calibrates there), so timings
  exclude compilation and the answer is generated once. ``interruptible``:
  Ctrl-C during the decoding ends it at a round boundary, the text so far
  kept (and finished on ``out``) and the ``Generation`` marked
  ``interrupted`` (``Decoder.stream``); else it raises KeyboardInterrupt.
  Returns the ``Generation``.
  """
  if not (isinstance(num_samples, int) and num_samples >= 1):
    raise DecodeError(f"--num_samples={num_samples!r} must be an integer >= 1")
  encoded = [p for p in encode_prompts(prompts, decoder.tokenizer, chat, systems)
             for _ in range(num_samples)]
  if warmup:
    decoder.warm_up(encoded, max_new_tokens, sampling, seed, stops=stops)
  on_text = None
  if out is not None and len(encoded) == 1:
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    if not chat:
      out.write(prompts[0])
    def on_text(row, data):
      out.write(utf8.decode(data))
      out.flush()
  gen = decoder.stream(encoded, max_new_tokens, sampling, seed, stops=stops, on_text=on_text,
                       interruptible=interruptible)
  if on_text is not None:
    out.write(utf8.decode(b"", final=True) + "\n")
  return gen
