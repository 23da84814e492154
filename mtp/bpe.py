"""BPE tokenizer on Hugging Face ``tokenizers``, with chat templates.

``BPETokenizer`` implements ``mtp.tokenizer``'s interface over a
``tokenizer.json`` (``from_files``, ``from_hf_dir``) or GGUF metadata
(``from_gguf_metadata``). ``encode`` treats text as text: a string spelling
a special token is cut into ordinary tokens, never the control token.
Control tokens come only from the chat template (``apply_chat_template``
renders it with sentinel contents, in jinja2's sandbox with ``trim_blocks``
and ``lstrip_blocks``); when no content spells a special token the ids
equal transformers' ``apply_chat_template(..., tokenize=True)``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from mtp.tokenizer_files import HF_TOKENIZER_FILE, META_FILE, TokenizerError

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizers of GGUF ``tokenizer.ggml.pre`` values we build (llama.cpp's
# llama-vocab.cpp). "smollm": every digit alone, then GPT-2's split (what
# SmolLM2's own tokenizer.json does: Digits(individual_digits) + ByteLevel).
_GPT2_PRE = ("default", "gpt2", "gpt-2")
_DIGITS_THEN_GPT2_PRE = ("smollm",)
SUPPORTED_GGUF_PRE = _GPT2_PRE + _DIGITS_THEN_GPT2_PRE

_SENTINEL = "\ue000mtp-content-{}\ue001"


def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character table (ByteLevel)."""
  bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
  cs, n = list(bs), 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return {b: chr(c) for b, c in zip(bs, cs)}


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, **extra) -> str:
  """Renders a Hugging Face chat template (jinja2, sandboxed, as
  transformers' ``apply_chat_template`` does). Raises ValueError for a
  template error or ``raise_exception`` in the template."""
  import jinja2
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise ValueError(f"chat template: {message}")

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent,
                                                                   ensure_ascii=False)
  env.globals["raise_exception"] = raise_exception
  try:
    return env.from_string(template).render(messages=list(messages),
                                            add_generation_prompt=add_generation_prompt, **extra)
  except jinja2.TemplateError as e:
    raise ValueError(f"chat template cannot be rendered: {type(e).__name__}: {e}") from e


class BPEStreamDecoder:
  """``push(ids) -> str``: the text that became complete (a character split
  over several tokens waits for its last byte); ``flush()`` the rest."""

  def __init__(self, tokenizer, skip_special_tokens: bool = True):
    from tokenizers.decoders import DecodeStream
    self._tok = tokenizer
    self._skip = skip_special_tokens
    self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    self._pending: list[int] = []       # ids since the last complete chunk

  def push(self, ids: Sequence[int]) -> str:
    out = []
    for i in ids:
      i = int(i)
      if not 0 <= i < self._tok.get_vocab_size(with_added_tokens=True):
        continue                          # padding ids: never text
      self._pending.append(i)
      chunk = self._stream.step(self._tok, i)
      if chunk is not None:
        out.append(chunk)
        self._pending = []
    return "".join(out)

  def flush(self) -> str:
    """What is held back at the end (an incomplete character), decoded with
    replacement characters; resets the decoder."""
    text = self._tok.decode(self._pending, skip_special_tokens=self._skip) if self._pending else ""
    self.__init__(self._tok, self._skip)
    return text


class BPETokenizer:
  """A ``tokenizers`` BPE with special ids, stop ids and a chat template.

  Args:
    tokenizer: a ``tokenizers.Tokenizer`` (its specials registered as special
      added tokens).
    bos_id, eos_id, pad_id: special ids (None when the vocabulary has none).
    stop_ids: ids that end a generation (default: ``(eos_id,)``); the chat
      template's end-of-turn token belongs here.
    chat_template: jinja2 source or None.
    add_bos: whether ``encode(text)`` prepends BOS by default (GGUF
      ``tokenizer.ggml.add_bos_token``; SmolLM2: False).
    never_emitted: ids the model's head never emits (recorded; the model reads
      its own copy, ``model.never_emitted``).
  Raises TokenizerError when an id is outside the vocabulary.
  """

  kind = "bpe"

  def __init__(self, tokenizer, *, bos_id: int | None, eos_id: int | None,
               pad_id: int | None = None, stop_ids: Iterable[int] | None = None,
               chat_template: str | None = None, add_bos: bool = False,
               never_emitted: Iterable[int] = (), source: str = "<tokenizer>"):
    import tokenizers
    self._tok = tokenizer
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
    stops = [eos_id] if stop_ids is None else list(stop_ids)
    self.stop_ids = tuple(sorted({int(i) for i in stops if i is not None}))
    self.eos_ids = self.stop_ids
    self.chat_template = chat_template
    self.add_bos = bool(add_bos)
    self.never_emitted_ids = tuple(sorted({int(i) for i in never_emitted}))
    self.source = source
    for name, ids in (("bos_id", [bos_id]), ("eos_id", [eos_id]), ("pad_id", [pad_id]),
                      ("stop_ids", self.stop_ids), ("never_emitted", self.never_emitted_ids)):
      for i in ids:
        if i is not None and not 0 <= int(i) < self.vocab_size:
          raise TokenizerError(f"{source}: {name} {i} is outside the vocabulary "
                               f"[0, {self.vocab_size})")
    # A copy that never parses special tokens in the text (user text).
    self._text_tok = tokenizers.Tokenizer.from_str(tokenizer.to_str())
    self._text_tok.encode_special_tokens = True
    self._tok.encode_special_tokens = False
    specials = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]
    self.special_tokens = tuple(sorted(specials))
    self._special_ids = {s: tokenizer.token_to_id(s) for s in specials}
    self._special_re = (re.compile("|".join(re.escape(s) for s in sorted(specials, key=len,
                                                                         reverse=True)))
                        if specials else None)

  # -- construction -------------------------------------------------------

  @classmethod
  def from_files(cls, folder: str, meta: Mapping[str, Any]) -> "BPETokenizer":
    """From ``folder/tokenizer.json`` and a ``tokenizer_meta.json`` dict
    (``to_dict``). Raises TokenizerError naming the file."""
    import tokenizers
    path = os.path.join(folder, HF_TOKENIZER_FILE)
    try:
      tk = tokenizers.Tokenizer.from_file(path)
    except Exception as e:   # tokenizers raises plain Exception for bad JSON
      raise TokenizerError(f"{path}: not a readable tokenizers file ({e})") from e
    try:
      return cls(tk, bos_id=meta.get("bos_id"), eos_id=meta.get("eos_id"),
                 pad_id=meta.get("pad_id"), stop_ids=meta.get("stop_ids"),
                 chat_template=meta.get("chat_template"), add_bos=meta.get("add_bos", False),
                 never_emitted=meta.get("never_emitted", ()),
                 source=os.path.join(folder, META_FILE))
    except TypeError as e:
      raise TokenizerError(f"{os.path.join(folder, META_FILE)}: malformed ({e})") from e

  @classmethod
  def from_hf_dir(cls, path: str, hf_config: Mapping[str, Any] | None = None) -> "BPETokenizer":
    """From a Hugging Face model directory: ``tokenizer.json``, special
    tokens and chat template from ``tokenizer_config.json`` (and
    ``chat_template.jinja`` when present), ids from ``config.json`` /
    ``generation_config.json``. Raises TokenizerError naming the file."""
    import tokenizers
    tj = os.path.join(path, HF_TOKENIZER_FILE)
    if not os.path.isfile(tj):
      raise TokenizerError(f"{path}: no {HF_TOKENIZER_FILE} (a tokenizer is required to import "
                           "a model)")
    try:
      tk = tokenizers.Tokenizer.from_file(tj)
    except Exception as e:
      raise TokenizerError(f"{tj}: not a readable tokenizers file ({e})") from e

    def read(name):
      p = os.path.join(path, name)
      if not os.path.isfile(p):
        return {}
      try:
        with open(p, encoding="utf-8") as f:
          return json.load(f)
      except (OSError, ValueError) as e:
        raise TokenizerError(f"{p}: unreadable ({e})") from e

    tc, gen, hf = read("tokenizer_config.json"), read("generation_config.json"), dict(
        hf_config or read("config.json"))

    def token_id(key):
      v = tc.get(key)
      if isinstance(v, dict):
        v = v.get("content")
      return tk.token_to_id(v) if isinstance(v, str) else None

    def first(*values):
      for v in values:
        if v is not None:
          return v[0] if isinstance(v, list) and v else v
      return None

    bos = first(gen.get("bos_token_id"), hf.get("bos_token_id"), token_id("bos_token"))
    eos = first(token_id("eos_token"), gen.get("eos_token_id"), hf.get("eos_token_id"))
    pad = first(gen.get("pad_token_id"), hf.get("pad_token_id"), token_id("pad_token"))
    stops = set()
    for v in (gen.get("eos_token_id"), hf.get("eos_token_id"), eos):
      stops.update(v if isinstance(v, list) else [v] if v is not None else [])
    template = tc.get("chat_template")
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
      with open(jinja, encoding="utf-8") as f:
        template = f.read()
    if isinstance(template, list):        # named templates: take "default"
      template = next((t["template"] for t in template if t.get("name") == "default"), None)
    # The post-processor may add BOS; encode() adds it explicitly instead.
    add_bos = bool(tc.get("add_bos_token", False))
    tk.post_processor = None
    return cls(tk, bos_id=bos, eos_id=eos, pad_id=pad, stop_ids=sorted(stops),
               chat_template=template, add_bos=add_bos, source=tj)

  @classmethod
  def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str = "<gguf>") -> "BPETokenizer":
    """From GGUF tokenizer metadata (values already decoded: ``tokens`` list
    of str, ``merges`` list of "a b" str, ``token_type`` list of int).

    Keys read: ``tokenizer.ggml.model`` (must be ``gpt2``: byte-level BPE),
    ``.pre``, ``.tokens``, ``.merges``, ``.token_type``, ``.bos_token_id``,
    ``.eos_token_id``, ``.padding_token_id``, ``.eot_token_id``,
    ``.eom_token_id``, ``.add_bos_token``, ``tokenizer.chat_template``.
    Control tokens (type 3) become special added tokens, user-defined ones
    (type 4) plain added tokens, as llama.cpp matches both whole.

    Raises TokenizerError naming the key for what is missing or unsupported.
    """
    import tokenizers
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

    def need(key):
      if key not in meta:
        raise TokenizerError(f"{source}: no '{key}' metadata (needed for the tokenizer)")
      return meta[key]

    kind = need("tokenizer.ggml.model")
    if kind != "gpt2":
      raise TokenizerError(f"{source}: tokenizer.ggml.model={kind!r} is not supported (only "
                           "'gpt2', a byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_GGUF_PRE:
      raise TokenizerError(f"{source}: tokenizer.ggml.pre={pre!r} is not supported (supported: "
                           f"{', '.join(SUPPORTED_GGUF_PRE)})")
    tokens = list(need("tokenizer.ggml.tokens"))
    merges = list(need("tokenizer.ggml.merges"))
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
      raise TokenizerError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for "
                           f"{len(tokens)} tokens")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, t in enumerate(tokens):
      key = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
      vocab.setdefault(key, i)
    if len(vocab) != len(tokens):
      raise TokenizerError(f"{source}: tokenizer.ggml.tokens holds duplicate tokens")
    pairs = []
    for m in merges:
      parts = m.split(" ")
      if len(parts) != 2:
        raise TokenizerError(f"{source}: tokenizer.ggml.merges entry {m!r} is not 'a b'")
      pairs.append(tuple(parts))
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                         byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                          use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
      tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                  byte_level])
    else:
      tk.pre_tokenizer = byte_level
    tk.decoder = decoders.ByteLevel()
    control = [AddedToken(tokens[i], special=True, normalized=False)
               for i, ty in enumerate(types) if ty == TOKEN_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, ty in enumerate(types) if ty == TOKEN_USER_DEFINED]
    tk.add_special_tokens(control)
    if user:
      tk.add_tokens(user)
    if tk.get_vocab_size(with_added_tokens=True) != len(tokens):
      raise TokenizerError(f"{source}: the tokenizer built from tokenizer.ggml.tokens has "
                           f"{tk.get_vocab_size(with_added_tokens=True)} ids, expected "
                           f"{len(tokens)}")
    get = lambda k: (int(meta[k]) if meta.get(k) is not None else None)
    bos, eos = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
    stops = [i for i in (eos, get("tokenizer.ggml.eot_token_id"),
                         get("tokenizer.ggml.eom_token_id")) if i is not None]
    return cls(tk, bos_id=bos, eos_id=eos, pad_id=get("tokenizer.ggml.padding_token_id"),
               stop_ids=stops, chat_template=meta.get("tokenizer.chat_template"),
               add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)), source=source)

  # -- interface ------------------------------------------------------------

  def encode(self, text: str, *, add_bos: bool | None = None, add_eos: bool = False) -> np.ndarray:
    """int32 ids [T] of ``text``, special-token spellings encoded as text.
    ``add_bos`` defaults to the tokenizer's ``add_bos``. Raises TypeError
    for a non-str."""
    if not isinstance(text, str):
      raise TypeError(f"BPETokenizer.encode expects str, got {type(text).__name__}")
    ids = self._text_tok.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids = [self.bos_id] + ids
    if add_eos and self.eos_id is not None:
      ids = ids + [self.eos_id]
    return np.asarray(ids, np.int32)

  def decode_bytes(self, ids: Iterable[int]) -> bytes:
    """The output bytes of ``ids``: byte-level BPE tokens mapped back to
    their bytes (GPT-2's byte alphabet), other added tokens as UTF-8, special
    tokens and unknown ids dropped. A character split over tokens stays split
    (stop strings are matched on these bytes: ``decode.stops``)."""
    if not hasattr(self, "_byte_of"):
      self._byte_of = {c: b for b, c in bytes_to_unicode().items()}
      self._special_id_set = set(self._special_ids.values())
    out = bytearray()
    for i in ids:
      i = int(i)
      piece = self._tok.id_to_token(i)
      if piece is None or i in self._special_id_set:
        continue
      try:
        out += bytes(self._byte_of[c] for c in piece)
      except KeyError:
        out += piece.encode("utf-8")
    return bytes(out)

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
    """Text of ``ids`` (ids outside the vocabulary, i.e. padding, dropped)."""
    ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
    return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

  def stream_decoder(self, skip_special_tokens: bool = True) -> BPEStreamDecoder:
    return BPEStreamDecoder(self._tok, skip_special_tokens)

  def emittable_mask(self, vocab_size: int) -> np.ndarray:
    """bool [vocab_size]: ids < ``self.vocab_size`` except ``never_emitted_ids``."""
    if vocab_size < self.vocab_size:
      raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's "
                       f"{self.vocab_size} ids")
    mask = np.arange(vocab_size) < self.vocab_size
    mask[list(self.never_emitted_ids)] = False
    return mask

  def id_to_token(self, i: int) -> str | None:
    return self._tok.id_to_token(int(i))

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                  add_generation_prompt: bool = True) -> str:
    """The chat template's text (what transformers' ``apply_chat_template(
    tokenize=False)`` gives). Raises ValueError without a template."""
    if not self.chat_template:
      raise ValueError(f"{self.source}: this tokenizer has no chat template")
    tok = lambda i: self._tok.id_to_token(i) if i is not None else ""
    return render_chat_template(self.chat_template, messages,
                                add_generation_prompt=add_generation_prompt,
                                bos_token=tok(self.bos_id), eos_token=tok(self.eos_id))

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True) -> np.ndarray:
    """int32 ids [T] of the rendered chat: the template's control tokens as
    control ids, every message's content as text (see the module docstring).

    Raises ValueError without a template, for a non-str content, or for a
    template that does not place each content exactly once.
    """
    if not self.chat_template:
      raise ValueError(f"{self.source}: this tokenizer has no chat template")
    contents, masked = [], []
    for m in messages:
      c = m.get("content")
      if not isinstance(c, str):
        raise ValueError(f"chat message content must be a str, got {type(c).__name__}")
      masked.append({**m, "content": _SENTINEL.format(len(contents))})
      contents.append(c)
    text = self.render_chat(masked, add_generation_prompt=add_generation_prompt)
    pieces = re.split("\ue000mtp-content-(\\d+)\ue001", text)
    order = [int(x) for x in pieces[1::2]]
    if sorted(order) != list(range(len(contents))):
      raise ValueError("the chat template does not place each message's content exactly once; "
                       "cannot keep user text apart from control tokens")
    # Segments: ("text", str) or ("special", id); template text is scanned for
    # control tokens, contents are not.
    segments: list[tuple[str, Any]] = []
    for j, piece in enumerate(pieces):
      if j % 2:
        segments.append(("text", contents[int(piece)]))
        continue
      pos = 0
      for m in (self._special_re.finditer(piece) if self._special_re else ()):
        segments.append(("text", piece[pos:m.start()]))
        segments.append(("special", self._special_ids[m.group(0)]))
        pos = m.end()
      segments.append(("text", piece[pos:]))
    ids, run = [], []
    for kind, value in segments + [("special", None)]:
      if kind == "text":
        run.append(value)
        continue
      if run and "".join(run):
        ids += self._text_tok.encode("".join(run), add_special_tokens=False).ids
      run = []
      if value is not None:
        ids.append(value)
    return np.asarray(ids, np.int32)

  # -- persistence ---------------------------------------------------------

  def to_dict(self) -> dict[str, Any]:
    """``tokenizer_meta.json`` content (``tokenizer.json`` holds the rest)."""
    return {"kind": "bpe", "vocab_size": self.vocab_size, "bos_id": self.bos_id,
            "eos_id": self.eos_id, "pad_id": self.pad_id, "stop_ids": list(self.stop_ids),
            "add_bos": self.add_bos, "never_emitted": list(self.never_emitted_ids),
            "special_tokens": list(self.special_tokens), "chat_template": self.chat_template}

  def save_model_file(self, path: str) -> None:
    from mtp.files import write_atomic
    write_atomic(path, self._tok.to_str(pretty=True))

  def tokenizers_json(self) -> dict[str, Any]:
    """The ``tokenizers`` model as the JSON object ``save_model_file``
    writes (a fresh copy: callers may edit it)."""
    return json.loads(self._tok.to_str())

  def with_never_emitted(self, ids: Iterable[int]) -> "BPETokenizer":
    """A copy whose ``never_emitted_ids`` are ``ids``."""
    import tokenizers
    return BPETokenizer(tokenizers.Tokenizer.from_str(self._tok.to_str()), bos_id=self.bos_id,
                        eos_id=self.eos_id, pad_id=self.pad_id, stop_ids=self.stop_ids,
                        chat_template=self.chat_template, add_bos=self.add_bos,
                        never_emitted=ids, source=self.source)
