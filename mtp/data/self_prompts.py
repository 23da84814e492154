"""Self-written chat prompts: user turns the target writes itself (Magpie,
Xu et al. 2024), filtered, deduplicated and kept apart from the held-out set.

``user_turn_prefix`` finds the chat template's user-turn prefix, which
``scripts.self_prompts.sample_user_turns`` continues and cuts at the
end-of-turn id (no stop within the cap: ``unfinished``, dropped).
``filter_prompts`` rejects with one reason per text: ``empty``,
``too_short`` / ``too_long``, ``non_printable`` (control, private-use,
unassigned or U+FFFD), ``repetition`` (n-gram, character run or few
distinct words), ``assistant_like`` (answers instead of asking),
``duplicate`` (same normalised text) and ``heldout_overlap``
(``mtp.data.chat.overlaps`` against the held-out set). Output is
``read_prompt_jsonl``'s format (``{"category": "self_written", "prompt"}``);
``as_chat_prompt`` and ``mix_prompt_sources`` (seeded, by weight) adapt it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import unicodedata
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mtp.data import chat as chat_lib
from mtp.data.corpora import DataError

CATEGORY = "self_written"
SOURCE = "self_written"
REASONS = ("unfinished", "empty", "too_short", "too_long", "non_printable", "repetition",
           "assistant_like", "duplicate", "heldout_overlap")
# openings of an assistant's turn, not a user's (Magpie's known failure: the
# model answers as the assistant instead of asking); matched at the start,
# case-insensitively
_ASSISTANT_OPENINGS = re.compile(
    r"^\W*(?:(?:hello|hi|hey|greetings)\b[^.?!]{0,40}[,.!]?\s*)?"
    r"(?:how (?:can|may) i (?:help|assist) you|what can i (?:do|help) (?:for )?you"
    r"|i'?m (?:here|happy|glad) to help"
    r"|i am (?:here|happy|glad) to help|as an ai\b|i'?m an ai\b|i am an ai\b"
    r"|sure[,!.]? (?:here|i can)|certainly[,!.]? (?:here|i can))", re.I)
# two probe contents whose rendered chats share exactly the tokens before a user's content
_PROBES = ("Q", "z")


@dataclasses.dataclass(frozen=True)
class FilterSettings:
  """Thresholds of ``filter_prompts`` (module docstring).

  min_chars >= 1, max_chars >= min_chars, min_words >= 1; ngram >= 1 and
  max_ngram_repeats >= 1 (a word n-gram may occur at most this often);
  max_char_run >= 1 (longest run of one character); min_distinct_words in
  [0, 1] (share of distinct words in a text of >= 12 words).
  """
  min_chars: int = 12
  max_chars: int = 2000
  min_words: int = 3
  ngram: int = 3
  max_ngram_repeats: int = 3
  max_char_run: int = 16
  min_distinct_words: float = 0.3

  def validate(self) -> "FilterSettings":
    """Returns self or raises DataError naming the field and its range."""
    for name, lo in (("min_chars", 1), ("min_words", 1), ("ngram", 1), ("max_ngram_repeats", 1),
                     ("max_char_run", 1)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise DataError(f"{name}={v!r} must be an integer >= {lo}")
    if isinstance(self.max_chars, bool) or not isinstance(self.max_chars, int) \
        or self.max_chars < self.min_chars:
      raise DataError(f"max_chars={self.max_chars!r} must be an integer >= min_chars="
                      f"{self.min_chars}")
    if not 0 <= self.min_distinct_words <= 1:
      raise DataError(f"min_distinct_words={self.min_distinct_words!r} must be in [0, 1]")
    return self


# -- filters -------------------------------------------------------------------------------

def normalise(text: str) -> str:
  """The dedupe key: lower-cased words (runs of letters and digits in any
  script), punctuation dropped, joined by single spaces."""
  return " ".join(re.findall(r"\w+", text.lower()))


_BAD_CATEGORIES = {"Cc", "Cf", "Cs", "Co", "Cn"}


def _non_printable(text: str) -> bool:
  return any(c == "\ufffd" or (c not in "\n\t" and unicodedata.category(c) in _BAD_CATEGORIES)
             for c in text)


def _repetitive(text: str, s: FilterSettings) -> bool:
  if re.search(r"(.)\1{%d,}" % s.max_char_run, text, re.S):
    return True
  words = text.lower().split()
  grams = Counter(tuple(words[i:i + s.ngram]) for i in range(len(words) - s.ngram + 1))
  if grams and max(grams.values()) > s.max_ngram_repeats:
    return True
  return len(words) >= 12 and len(set(words)) < s.min_distinct_words * len(words)


def check_text(text: str, settings: FilterSettings = FilterSettings()) -> str | None:
  """The first reason (``REASONS``, in order) ``text`` fails the per-text
  filters (empty, length, printable, repetition, assistant-like), or None
  when it passes."""
  t = text.strip()
  if not t:
    return "empty"
  if len(t) < settings.min_chars or len(t.split()) < settings.min_words:
    return "too_short"
  if len(t) > settings.max_chars:
    return "too_long"
  if _non_printable(t):
    return "non_printable"
  if _repetitive(t, settings):
    return "repetition"
  if _ASSISTANT_OPENINGS.match(t):
    return "assistant_like"
  return None


def filter_prompts(texts: Sequence[str], settings: FilterSettings = FilterSettings(), *,
                   heldout: Sequence[str] | None = None,
                   seen: set[str] | None = None) -> tuple[list[str], list[str | None]]:
  """Keeps the texts that pass every filter (module docstring), in order.

  Args:
    texts: candidate user turns (stripped of surrounding whitespace here).
    settings: thresholds (validated).
    heldout: reference texts no kept prompt may overlap (``chat.overlaps``);
      None = the package's held-out chat prompts (``prompt_text`` of each).
    seen: normalised keys of prompts kept earlier (updated in place with the
      new ones), so several calls dedupe across batches; None = a new set.
  Returns:
    (kept texts, reasons): reasons[i] is None for a kept texts[i], else its
    first failing reason; a later copy of a kept text is a ``duplicate``.
  """
  settings.validate()
  if heldout is None:
    heldout = [chat_lib.prompt_text(p) for p in chat_lib.heldout_chat_prompts()]
  seen = set() if seen is None else seen
  texts = [t.strip() for t in texts]
  reasons: list[str | None] = [check_text(t, settings) for t in texts]
  candidates = [i for i, r in enumerate(reasons) if r is None]
  for j, _ in chat_lib.overlaps([texts[i] for i in candidates], heldout):
    reasons[candidates[j]] = "heldout_overlap"
  kept = []
  for i, t in enumerate(texts):
    if reasons[i] is not None:
      continue
    key = normalise(t)
    if key in seen:
      reasons[i] = "duplicate"
      continue
    seen.add(key)
    kept.append(t)
  return kept, reasons


# -- sampling from the target ----------------------------------------------------------------

def user_turn_prefix(tokenizer) -> np.ndarray:
  """int32 ids [P] of the tokenizer's chat template up to where a first user
  message's content starts (the template's default system turn included):
  the common prefix of the rendered chats of two one-character user
  messages, so the control tokens are ids exactly as in a real chat. Raises
  DataError for a tokenizer without a chat template."""
  if not getattr(tokenizer, "chat_template", None):
    raise DataError(f"self-written prompts need a tokenizer with a chat template; this "
                    f"{getattr(tokenizer, 'kind', type(tokenizer).__name__)} tokenizer has none")
  a, b = (np.asarray(tokenizer.apply_chat_template([{"role": "user", "content": c}],
                                                   add_generation_prompt=False), np.int32)
          for c in _PROBES)
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  if n == 0:
    raise DataError("the chat template renders nothing before a user's content: no prefix to "
                    "sample user turns from")
  return a[:n]


@dataclasses.dataclass(frozen=True)
class SampleSettings:
  """How user turns are sampled: temperature >= 0, top_p in (0, 1], top_k
  >= 0 (``decode.sampling.SamplingParams``); max_len >= 1 sampled tokens per
  turn (a turn without an end-of-turn id by then is ``unfinished``);
  batch_size >= 1 rows per decoder call; seed >= 0; max_rounds >= 1 calls
  at most (the generator stops early once it has ``num_prompts``)."""
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_len: int = 128
  batch_size: int = 32
  seed: int = 0
  max_rounds: int = 64

  def validate(self) -> "SampleSettings":
    for name, lo in (("max_len", 1), ("batch_size", 1), ("seed", 0), ("max_rounds", 1),
                     ("top_k", 0)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise DataError(f"{name}={v!r} must be an integer >= {lo}")
    if not self.temperature >= 0:
      raise DataError(f"temperature={self.temperature!r} must be >= 0")
    if not 0 < self.top_p <= 1:
      raise DataError(f"top_p={self.top_p!r} must be in (0, 1]")
    return self


# -- files and mixing --------------------------------------------------------------------------

def write_prompt_jsonl(path: str, prompts: Sequence[Mapping[str, str]]) -> None:
  """Writes prompts (``{"category", "prompt"[, "system"]}``) one JSON object
  per line, UTF-8, in the format ``chat.read_prompt_jsonl`` reads (written
  whole or not at all: ``mtp.cli.write_atomic``)."""
  from mtp.files import write_atomic
  write_atomic(path, "".join(json.dumps({k: p[k] for k in chat_lib.HELDOUT_FIELDS if k in p},
                                        ensure_ascii=False) + "\n" for p in prompts))


def as_chat_prompt(p: Mapping[str, Any], source: str = SOURCE) -> dict:
  """A JSONL prompt (``{"category", "prompt"[, "system"]}``) in the form
  ``chat.chat_prompts`` returns: ``{"category", "messages", "source"}``
  (a dict already in that form is returned as a copy)."""
  if "messages" in p:
    return dict(p)
  return {"category": p.get("category", CATEGORY), "messages": chat_lib.prompt_messages(p),
          "source": source}


def read_self_prompts(path: str) -> list[dict]:
  """A self-written prompt file (``write_prompt_jsonl``) as chat prompts
  (``as_chat_prompt``). Raises DataError as ``chat.read_prompt_jsonl``."""
  return [as_chat_prompt(p) for p in chat_lib.read_prompt_jsonl(path, what="prompt file")]


def mix_counts(names: Sequence[str], weights: Mapping[str, float], n: int) -> dict[str, int]:
  """{name: c_s}: how many of ``n`` prompts each source gives
  (``mix_prompt_sources``' largest-remainder counts, in ``names``' order).
  Raises DataError for n < 0 or weights that are negative, non-finite or all 0."""
  if isinstance(n, bool) or not isinstance(n, int) or n < 0:
    raise DataError(f"n={n!r} must be an integer >= 0")
  w = np.asarray([float(weights.get(s, 0.0)) for s in names])
  if not np.all(np.isfinite(w)) or np.any(w < 0) or not w.sum() > 0:
    raise DataError(f"prompt source weights {dict(weights)} must be finite, >= 0, and not all 0")
  exact = n * w / w.sum()
  counts = np.floor(exact).astype(int)
  order = sorted(range(len(names)), key=lambda i: (-(exact[i] - counts[i]), i))
  for i in order[:n - int(counts.sum())]:
    counts[i] += 1
  return {name: int(c) for name, c in zip(names, counts)}


def mix_prompt_sources(sources: Mapping[str, Sequence], weights: Mapping[str, float], n: int,
                       seed: int = 0) -> list:
  """``n`` prompts mixed from several lists by weight, deterministic.

  Source s contributes its first c_s items (its own order: a longer list
  extends a shorter one, as ``chat_prompts`` does), c_s = n * w_s / sum(w)
  rounded by largest remainder (ties to the earlier source in ``sources``'
  order), so the counts sum to n exactly; the chosen items are then
  shuffled together with ``numpy.random.default_rng(seed)``. Items are
  returned as given (mix prompt dicts of one form, e.g. ``as_chat_prompt``).

  Raises DataError: a weight for an unknown source, a negative or non-finite
  weight, all weights 0, n < 0, or a source with fewer than c_s items.
  """
  unknown = sorted(set(weights) - set(sources))
  if unknown:
    raise DataError(f"prompt source weights name unknown source(s) {unknown}; sources: "
                    f"{list(sources)}")
  counts = mix_counts(list(sources), weights, n)
  chosen = []
  for name, c in counts.items():
    if c > len(sources[name]):
      raise DataError(f"prompt source {name!r} has {len(sources[name])} prompts; its weight "
                      f"asks for {c} of {n}")
    chosen += list(sources[name][:c])
  perm = np.random.default_rng(seed).permutation(len(chosen))
  return [chosen[i] for i in perm]
