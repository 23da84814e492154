"""Byte-level tokenizer: UTF-8 bytes 0..255, ``PAD_ID = 256``, ``BOS_ID =
257``, ``EOS_ID = 258`` (``VOCAB_SIZE = 259``; models may pad the vocabulary).

``NEVER_EMITTED_IDS`` (``emittable_mask``) get probability exactly 0 on
every decoding path (the head sets their logits to -inf): vocabulary
padding, PAD (never a target), BOS (no target crosses a document) and the
13 bytes no UTF-8 text contains (0xC0, 0xC1, 0xF5..0xFF; ``encode`` refuses
lone surrogates). EOS stays emittable. Every str round-trips through
``encode``/``decode``; ``decode`` drops special tokens and shows a split
character as U+FFFD; ``StreamDecoder`` holds back incomplete UTF-8.

Tokenizer interface (also ``mtp.bpe.BPETokenizer``): ``kind``, ``encode``,
``decode``, ``stream_decoder()``, ``bos_id``/``eos_id``/``pad_id``,
``stop_ids``, ``vocab_size``, ``emittable_mask(V)``, ``chat_template``,
``apply_chat_template``. A workdir keeps it under ``tokenizer/``."""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

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
  """bool [vocab_size]: True for ids a model may emit (valid UTF-8 bytes, EOS),
  False for ``NEVER_EMITTED_IDS`` and padding. Raises ValueError if
  ``vocab_size < VOCAB_SIZE``."""
  if vocab_size < VOCAB_SIZE:
    raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {VOCAB_SIZE} ids")
  mask = np.arange(vocab_size) < VOCAB_SIZE
  mask[list(NEVER_EMITTED_IDS)] = False
  return mask


class ByteTokenizer:
  """UTF-8 byte tokenizer with PAD/BOS/EOS. Stateless; cheap to construct."""

  kind = "byte"
  pad_id = PAD_ID
  bos_id = BOS_ID
  eos_id = EOS_ID
  vocab_size = VOCAB_SIZE
  stop_ids = (EOS_ID,)
  eos_ids = stop_ids
  never_emitted_ids = NEVER_EMITTED_IDS
  chat_template = None

  def emittable_mask(self, vocab_size: int) -> np.ndarray:
    """bool [vocab_size]; module-level ``emittable_mask``."""
    return emittable_mask(vocab_size)

  def apply_chat_template(self, messages, *, add_generation_prompt: bool = True) -> np.ndarray:
    """The byte tokenizer has no chat template: raises ValueError."""
    raise ValueError("the byte tokenizer has no chat template (use a raw prompt, or a workdir "
                     "imported with a BPE tokenizer: python -m mtp.importers)")

  def to_dict(self) -> dict[str, Any]:
    return {"kind": "byte"}

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
    """int32 ids [T] of ``text`` (T = UTF-8 bytes + specials). Raises TypeError
    for a non-``str`` and ValueError naming the position of a lone surrogate."""
    if not isinstance(text, str):
      raise TypeError(f"ByteTokenizer.encode expects str, got {type(text).__name__}")
    try:
      raw = text.encode("utf-8")
    except UnicodeEncodeError as e:
      raise ValueError(f"text is not valid Unicode: lone surrogate U+{ord(text[e.start]):04X} at "
                       f"character {e.start} (it has no UTF-8 form)") from None
    ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int32)
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


# ----------------------------------------------------------------------------
# The model's head mask and a workdir's tokenizer
# ----------------------------------------------------------------------------

from mtp.tokenizer_files import (HF_TOKENIZER_FILE, META_FILE, TOKENIZER_DIR,  # noqa: E402
                                 TokenizerError)


def head_mask(model_cfg) -> np.ndarray:
  """bool [model_cfg.vocab_size]: the ids the head may emit (others get -inf):
  ``emittable_mask`` for ``model.tokenizer == "byte"``; for "bpe", ids <
  ``model.num_tokens`` except ``model.never_emitted``."""
  if model_cfg.tokenizer == "byte":
    return emittable_mask(model_cfg.vocab_size)
  mask = np.arange(model_cfg.vocab_size) < model_cfg.num_tokens
  never = [int(x) for x in model_cfg.never_emitted.split(",") if x.strip()]   # validated in config
  mask[never] = False
  return mask


def save_tokenizer(tokenizer, workdir: str) -> str:
  """Writes ``tokenizer`` to ``WORKDIR/tokenizer/`` (``tokenizer_meta.json``,
  plus ``tokenizer.json`` for a BPE tokenizer). Returns the folder."""
  folder = os.path.join(workdir, TOKENIZER_DIR)
  os.makedirs(folder, exist_ok=True)
  meta = tokenizer.to_dict()
  if meta["kind"] != "byte":
    tokenizer.save_model_file(os.path.join(folder, HF_TOKENIZER_FILE))
  from mtp.files import write_atomic
  write_atomic(os.path.join(folder, META_FILE), json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
  return folder


def tokenizer_from_meta(meta: Mapping[str, Any], folder: str):
  """The tokenizer described by ``meta`` (a ``tokenizer_meta.json`` dict)
  whose files lie in ``folder``. Raises TokenizerError."""
  kind = meta.get("kind")
  if kind == "byte":
    return ByteTokenizer()
  if kind == "bpe":
    from mtp import bpe
    return bpe.BPETokenizer.from_files(folder, meta)
  raise TokenizerError(f"{os.path.join(folder, META_FILE)}: unknown tokenizer kind {kind!r} "
                       "(expected 'byte' or 'bpe')")


EXPORT_CONFIG_FILE = "config.json"   # mtp.export's config.json (its "mtp" entry)


def _exported_meta(path: str):
  """The ``tokenizer_meta.json`` content an ``mtp.export`` directory of a
  BPE model keeps in its config.json (``mtp.tokenizer``), or None (no such
  entry: a byte-tokenizer export, or not an export)."""
  cfg_path = os.path.join(path, EXPORT_CONFIG_FILE)
  if not os.path.isfile(cfg_path):
    return None
  try:
    with open(cfg_path, encoding="utf-8") as f:
      hf = json.load(f)
  except (OSError, ValueError) as e:
    raise TokenizerError(f"{cfg_path}: unreadable ({e})") from e
  entry = hf.get("mtp") if isinstance(hf, dict) else None
  if not isinstance(entry, dict) or "format_version" not in entry:
    return None                      # a training workdir's config.json, or a foreign file
  meta = entry.get("tokenizer")
  if meta is not None and not isinstance(meta, dict):
    raise TokenizerError(f"{cfg_path}: mtp.tokenizer is not a JSON object")
  return meta


def load_tokenizer(workdir: str):
  """The tokenizer saved in ``workdir`` (``save_tokenizer``), or an export's
  (config.json's ``mtp`` entry and ``tokenizer.json``), else the byte
  tokenizer. Raises TokenizerError for an unreadable or inconsistent one."""
  folder = os.path.join(workdir, TOKENIZER_DIR)
  meta_path = os.path.join(folder, META_FILE)
  if not os.path.isfile(meta_path):
    meta = _exported_meta(workdir)
    return ByteTokenizer() if meta is None else tokenizer_from_meta(meta, workdir)
  try:
    with open(meta_path, encoding="utf-8") as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise TokenizerError(f"{meta_path}: unreadable ({e})") from e
  if not isinstance(meta, dict):
    raise TokenizerError(f"{meta_path}: expected a JSON object")
  return tokenizer_from_meta(meta, folder)
