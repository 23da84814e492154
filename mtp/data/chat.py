"""Chat prompts for an instruct target: training prompts built from the
embedded corpora (``chat_prompts``), the hand-written held-out set
(``heldout_chat_prompts``, ``mtp/data/heldout_chat.jsonl``) and the overlap
check between the two (``overlaps``).

A training prompt is ``{"category", "messages": [{"role": "user",
"content"}], "source"}`` (``source``: corpus/document, or
``"generated/CATEGORY"``), cut from one split of ``python_stdlib`` (``ast``:
functions, classes, docstrings, source windows) and ``python_docs``, in the
categories code, explain, qa, summarise, rewrite, docstring, tests and
(``mtp.data.chat_general``) math, translate, write, general. Contexts are
cut at a line boundary to ``max_context_chars``; no two prompts of a list
are equal; the stream is deterministic for (split, seed, categories) and
the stdlib, and prompt i does not depend on n.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from mtp.config import DataConfig
from mtp.data.chat_general import GENERAL_CATEGORIES, first_sentence, general_prompt
from mtp.data.corpora import DataError
from mtp.data.sources import as_bytes, load_source

CATEGORIES = ("code", "explain", "qa", "summarise", "rewrite", "docstring", "tests",
              *GENERAL_CATEGORIES)
HELDOUT_CATEGORIES = ("code", "math", "translation", "summarisation", "question_answering",
                      "writing")
HELDOUT_CHAT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                 "heldout_chat.jsonl")
HELDOUT_FIELDS = ("category", "prompt", "system")
MAX_CONTEXT_CHARS = 1200
_MAX_FUNC_LINES = 60          # longer functions never fit a context

# ----------------------------------------------------------------------------
# Templates (one list per category and kind of snippet)
# ----------------------------------------------------------------------------

_CODE_WRITE = (
    "Write a Python function `{sig}` that does the following:\n\n{doc}",
    "Implement this Python function. Its docstring says what it must do.\n\n```python\n"
    "def {sig}:\n    \"\"\"{doc}\"\"\"\n```",
    "I need a Python function named `{name}` with the signature `{sig}`. Here is its "
    "specification:\n\n{doc}\n\nPlease write it.",
)
_CODE_COMPLETE = (
    "Complete this Python code:\n\n```python\n{head}\n```",
    "Finish the body of this function from the `{module}` module:\n\n```python\n{head}\n```",
)
_EXPLAIN_CODE = (
    "What does this Python code do?\n\n```python\n{code}\n```",
    "Explain, step by step, how this function from `{module}` works:\n\n```python\n{code}\n```",
    "Can you walk me through this code?\n\n```python\n{code}\n```",
)
_EXPLAIN_MODULE = (
    "Explain what the Python module `{module}` is for. Its documentation starts:\n\n{doc}",
    "What is the `{module}` module of the Python standard library used for?",
    "Give an overview of Python's `{module}` module and when I would use it.",
)
_QA_OBJ = (
    "In Python's `{module}` module, what does `{name}` do?",
    "What does `{module}.{name}` return, and what arguments does it take?",
    "Here is the documentation of `{module}.{name}`:\n\n{doc}\n\nWhat is it for, and how do I "
    "call it?",
    "How do I use `{name}` from the `{module}` module? Give a short example.",
)
_QA_TOPIC = (
    "Read this excerpt from the Python documentation and answer: what is the main rule it "
    "describes?\n\n{text}",
    "What does the Python documentation say about \"{topic}\"?",
    "Based on this documentation, what should a Python programmer remember?\n\n{text}",
)
_SUMMARISE = (
    "Summarise this passage from the Python documentation in a few sentences:\n\n{text}",
    "Give a short summary of the following text:\n\n{text}",
    "TL;DR of this documentation, in three bullet points:\n\n{text}",
)
_REWRITE_TEXT = (
    "Rewrite this text in simpler words, for a beginner:\n\n{text}",
    "Simplify the following paragraph without losing its meaning:\n\n{text}",
    "Rewrite this passage more concisely:\n\n{text}",
)
_REWRITE_CODE = (
    "Rewrite this Python code to be easier to read:\n\n```python\n{code}\n```",
    "Refactor this function and add type hints:\n\n```python\n{code}\n```",
)
_DOCSTRING = (
    "Write a docstring for this Python function:\n\n```python\n{code}\n```",
    "Add a clear docstring to this code:\n\n```python\n{code}\n```",
)
_TESTS = (
    "Write unit tests with pytest for this function:\n\n```python\n{code}\n```",
    "How would you test this Python function? Write a few test cases.\n\n```python\n{code}\n```",
)


# ----------------------------------------------------------------------------
# Snippets from the corpora
# ----------------------------------------------------------------------------


def _cut(text: str, max_chars: int) -> str:
  """``text`` stripped, cut to at most ``max_chars`` characters at the last
  line (else space) boundary before the limit."""
  text = text.strip()
  if len(text) <= max_chars:
    return text
  head = text[:max_chars]
  for sep in ("\n", " "):
    j = head.rfind(sep)
    if j > max_chars // 2:
      return head[:j].rstrip()
  return head


def _clean_doc(doc: str) -> str:
  import inspect
  return inspect.cleandoc(doc).strip()


@functools.lru_cache(maxsize=256)
def _module_snippets(name: str, text: str) -> dict[str, Any]:
  """Snippets of one stdlib file: module name, module docstring, and the
  top-level / method functions with docstrings (name, signature, docstring,
  source, source without docstring, head = signature + docstring)."""
  module = name[:-3].replace("/", ".")
  if module.endswith(".__init__"):
    module = module[:-len(".__init__")]
  try:
    tree = ast.parse(text)
  except (SyntaxError, ValueError):
    return {"module": module, "doc": "", "funcs": []}
  funcs = []
  all_lines = text.splitlines()
  for node in ast.walk(tree):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
      continue
    if node.name.startswith("__") or node.end_lineno - node.lineno > _MAX_FUNC_LINES:
      continue
    doc = ast.get_docstring(node)
    if not doc or len(doc) < 40:
      continue
    start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
    indent = node.col_offset
    lines = [l[indent:] if not l[:indent].strip() else l.lstrip()
             for l in all_lines[start:node.end_lineno]]
    off = node.lineno - 1 - start
    first, last = node.body[0].lineno - 1 - start, node.body[0].end_lineno - 1 - start
    try:
      args = ast.unparse(node.args)
    except Exception:  # noqa: BLE001
      continue
    funcs.append({"name": node.name, "sig": f"{node.name}({args})", "doc": _clean_doc(doc),
                  "src": "\n".join(lines[off:]), "head": "\n".join(lines[off:last + 1]),
                  "no_doc": "\n".join(lines[off:first] + lines[last + 1:])})
  return {"module": module, "doc": _clean_doc(ast.get_docstring(tree) or ""), "funcs": funcs}


def _paragraphs(text: str, rng: np.random.Generator, max_chars: int) -> str:
  """A window of whole paragraphs (blank-line separated) of ``text`` starting
  at a random paragraph, at most ``max_chars`` characters."""
  paras = [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 40]
  if not paras:
    return _cut(text, max_chars)
  i = int(rng.integers(len(paras)))
  out = paras[i]
  for p in paras[i + 1:]:
    if len(out) + 2 + len(p) > max_chars:
      break
    out += "\n\n" + p
  return _cut(out, max_chars)


class _Corpus:
  """The documents of one split of both embedded corpora (read lazily)."""

  def __init__(self, split: str, data_dir: str):
    self.split = split
    self.code = load_source(DataConfig(name="python_stdlib", data_dir=data_dir), split)
    self.docs = load_source(DataConfig(name="python_docs", data_dir=data_dir), split)
    if not len(self.code) or not len(self.docs):
      raise DataError(f"split '{split}' of python_stdlib or python_docs is empty")

  @staticmethod
  def _record(src, i: int) -> tuple[str, str]:
    rec = src[int(i)]
    return (as_bytes(rec["name"]).decode("utf-8", "replace"),
            as_bytes(rec["text"]).decode("utf-8", "replace"))

  def module(self, rng) -> tuple[str, dict]:
    name, text = self._record(self.code, rng.integers(len(self.code)))
    return name, _module_snippets(name, text)

  def topic(self, rng) -> tuple[str, str]:
    return self._record(self.docs, rng.integers(len(self.docs)))


# Share of each category's prompts cut from a pydoc topic (the rest from a stdlib file).
_TOPIC_SHARE = {"summarise": 0.75, "rewrite": 0.6, "qa": 0.35}
# Share of translate prompts whose sentence is the first of a pydoc passage (the
# rest: composed everyday sentences, mtp.data.chat_general).
_PYDOC_TRANSLATE_SHARE = 0.25


def _pick(rng, seq):
  return seq[int(rng.integers(len(seq)))]


def _one_prompt(corpus: _Corpus, category: str, rng, max_chars: int) -> tuple[str, str] | None:
  """(content, source) for one prompt of ``category``, or None when the drawn
  document has no suitable snippet (the caller draws again)."""
  if category in GENERAL_CATEGORIES:
    if category == "translate" and rng.random() < _PYDOC_TRANSLATE_SHARE:
      topic, text = corpus.topic(rng)
      sentence = first_sentence(_paragraphs(text, rng, max_chars))
      if sentence is None:
        return None
      return (general_prompt(category, rng, split=corpus.split, pydoc_sentence=sentence),
              f"python_docs/{topic}")
    return general_prompt(category, rng, split=corpus.split), f"generated/{category}"
  if rng.random() < _TOPIC_SHARE.get(category, 0.0):
    topic, text = corpus.topic(rng)
    window = _paragraphs(text, rng, max_chars)
    if len(window) < 120:
      return None
    tmpl = {"summarise": _SUMMARISE, "rewrite": _REWRITE_TEXT, "qa": _QA_TOPIC}[category]
    return _pick(rng, tmpl).format(text=window, topic=topic), f"python_docs/{topic}"
  name, snip = corpus.module(rng)
  src = f"python_stdlib/{name}"
  funcs = [f for f in snip["funcs"] if len(f["src"]) <= max_chars]
  module = snip["module"]
  if category == "summarise":
    if len(snip["doc"]) < 200:
      return None
    return _pick(rng, _SUMMARISE).format(text=_cut(snip["doc"], max_chars)), src
  if category == "explain" and (rng.random() < 0.3 or not funcs):
    if len(snip["doc"]) < 60:
      return None
    return _pick(rng, _EXPLAIN_MODULE).format(module=module, doc=_cut(snip["doc"], max_chars)), src
  if not funcs:
    return None
  f = _pick(rng, funcs)
  if category == "code":
    if rng.random() < 0.6:
      return _pick(rng, _CODE_WRITE).format(sig=f["sig"], name=f["name"],
                                            doc=_cut(f["doc"], max_chars)), src
    return _pick(rng, _CODE_COMPLETE).format(head=_cut(f["head"], max_chars), module=module), src
  if category == "explain":
    return _pick(rng, _EXPLAIN_CODE).format(code=f["src"], module=module), src
  if category == "qa":
    return _pick(rng, _QA_OBJ).format(module=module, name=f["name"],
                                      doc=_cut(f["doc"], max_chars)), src
  if category == "rewrite":
    return _pick(rng, _REWRITE_CODE).format(code=f["src"]), src
  if category == "docstring":
    return _pick(rng, _DOCSTRING).format(code=f["no_doc"]), src
  if category == "tests":
    if len(f["src"]) > max_chars * 2 // 3:
      return None
    return _pick(rng, _TESTS).format(code=f["src"]), src
  raise DataError(f"unknown chat prompt category {category!r}; known: {CATEGORIES}")


def chat_prompts(n: int, *, seed: int = 0, split: str = "train", data_dir: str = "",
                 categories: Sequence[str] = CATEGORIES,
                 max_context_chars: int = MAX_CONTEXT_CHARS) -> list[dict]:
  """``n`` >= 0 training chat prompts from split ``split`` of the embedded
  corpora (module docstring); prompt i has category ``categories[i %
  len(categories)]`` and depends only on (seed, split, i, categories).
  data_dir: TFDS data dir ("" = default); max_context_chars >= 200.
  Returns ``[{"category", "messages": [{"role": "user", "content"}],
  "source"}]``. Raises DataError: a bad argument (named with its range), an
  unknown category, or unreadable corpora."""
  if not (isinstance(n, int) and n >= 0):
    raise DataError(f"n={n!r} must be an integer >= 0")
  if not (isinstance(seed, int) and seed >= 0):
    raise DataError(f"seed={seed!r} must be an integer >= 0")
  if not (isinstance(max_context_chars, int) and max_context_chars >= 200):
    raise DataError(f"max_context_chars={max_context_chars!r} must be an integer >= 200")
  categories = tuple(categories)
  bad = [c for c in categories if c not in CATEGORIES]
  if not categories or bad:
    raise DataError(f"categories={list(categories)!r}: each must be one of {CATEGORIES} "
                    "(at least one)")
  if n == 0:
    return []
  corpus = _Corpus(split, data_dir)
  out, seen = [], set()
  for i in range(n):
    category = categories[i % len(categories)]
    key = [seed, i, CATEGORIES.index(category)]
    if category in GENERAL_CATEGORIES:      # no corpus split to tell them apart
      key.append(zlib.crc32(split.encode()))
    rng = np.random.default_rng(key)
    for _ in range(200):
      got = _one_prompt(corpus, category, rng, max_context_chars)
      if got is not None and got[0] not in seen:
        break
    else:
      raise DataError(f"no document of split '{split}' gives a new '{category}' prompt "
                      "(200 draws)")
    content, source = got
    seen.add(content)
    out.append({"category": category, "messages": [{"role": "user", "content": content}],
                "source": source})
  return out


def prompt_text(p: Mapping[str, Any]) -> str:
  """The text of a prompt dict: its ``messages``' contents joined by newlines
  (system first), or its ``prompt`` (with ``system`` before it)."""
  if "messages" in p:
    return "\n".join(m["content"] for m in p["messages"])
  return "\n".join(x for x in (p.get("system"), p["prompt"]) if x)


def prompt_messages(p: Mapping[str, Any]) -> list[dict]:
  """Chat messages of a prompt dict (``messages`` as is, or ``system`` +
  ``prompt`` as a system and a user message)."""
  if "messages" in p:
    return [dict(m) for m in p["messages"]]
  msgs = [{"role": "system", "content": p["system"]}] if p.get("system") else []
  return msgs + [{"role": "user", "content": p["prompt"]}]


# ----------------------------------------------------------------------------
# Held-out prompts and the overlap check
# ----------------------------------------------------------------------------


def read_prompt_jsonl(path: str, *, what: str = "prompt file") -> list[dict]:
  """A JSONL file of prompts: one JSON object per line with a non-empty str
  ``"prompt"``, optional str ``"category"`` and ``"system"``; blank lines
  are skipped. Returns the objects (only those keys) in file order.

  Raises DataError, one line naming the file, the line number and the
  problem: unreadable file, invalid UTF-8 or JSON, not an object, missing or
  empty ``prompt``, a non-str value, an unknown field, or no prompt at all.
  """
  try:
    raw = open(path, "rb").read()
  except OSError as e:
    raise DataError(f"{what} {path!r}: {e.strerror}") from e
  raw = raw.removeprefix(b"\xef\xbb\xbf")         # a UTF-8 byte-order mark is not a prompt's
  out = []
  for i, line in enumerate(raw.splitlines(), 1):
    where = f"{what} {path!r} line {i}"
    try:
      text = line.decode("utf-8")
    except UnicodeDecodeError as e:
      raise DataError(f"{where} is not valid UTF-8 (byte {e.start})") from e
    if not text.strip():
      continue
    try:
      obj = json.loads(text)
    except json.JSONDecodeError as e:
      raise DataError(f"{where} is not valid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
      raise DataError(f"{where} must be a JSON object with a \"prompt\", got "
                      f"{type(obj).__name__}")
    unknown = sorted(set(obj) - set(HELDOUT_FIELDS))
    if unknown:
      raise DataError(f"{where}: unknown field(s) {unknown}; allowed: {list(HELDOUT_FIELDS)}")
    if "prompt" not in obj:
      raise DataError(f"{where}: missing field \"prompt\" (a non-empty string)")
    for k, v in obj.items():
      if not isinstance(v, str):
        raise DataError(f"{where}: field \"{k}\" must be a string, got {type(v).__name__}")
    if not obj["prompt"]:
      raise DataError(f"{where}: field \"prompt\" is empty")
    out.append({k: obj[k] for k in HELDOUT_FIELDS if k in obj})
  if not out:
    raise DataError(f"{what} {path!r} holds no prompt (one JSON object per line)")
  return out


def heldout_chat_prompts(path: str = HELDOUT_CHAT_PATH) -> list[dict]:
  """The held-out chat prompts (``{"category", "prompt"[, "system"]}`` per
  prompt, file order), by default the package's ``heldout_chat.jsonl``.
  Raises DataError (``read_prompt_jsonl``)."""
  return read_prompt_jsonl(path, what="held-out prompt file")


def _normalise(text: str) -> str:
  return " ".join(text.lower().split())


def _shingles(text: str, k: int) -> set[tuple[str, ...]]:
  words = _normalise(text).split(" ")
  return {tuple(words[i:i + k]) for i in range(len(words) - k + 1)}


def _words(text: str) -> tuple[str, ...]:
  """Lower-cased words without punctuation (for short texts)."""
  return tuple(re.findall(r"[a-z0-9]+", text.lower()))


def _contains(long: tuple[str, ...], short: tuple[str, ...]) -> bool:
  n = len(short)
  return any(long[i:i + n] == short for i in range(len(long) - n + 1))


def _substrings(text: str, k: int) -> set[str]:
  t = _normalise(text)
  return {t[i:i + k] for i in range(len(t) - k + 1)}


def overlaps(candidates: Iterable[str], reference: Iterable[str], *, shingle_words: int = 8,
             substring_chars: int = 40) -> list[tuple[int, str]]:
  """Which ``candidates`` overlap any ``reference`` text (a shared run of ``shingle_words`` words or a common substring of
  ``substring_chars`` characters, after lower-casing and collapsing
  whitespace). A text of fewer than ``shingle_words`` words has no such run:
  it overlaps when its words (lower-cased, punctuation dropped) appear in
  order inside the other text, so a short prompt repeated with other
  punctuation is caught too. Returns ``[(candidate_index, shared_text), ...]``
  (first evidence per overlapping candidate; empty when none overlaps)."""
  reference = list(reference)
  ref_sh, ref_sub = set(), set()
  for r in reference:
    ref_sh |= _shingles(r, shingle_words)
    ref_sub |= _substrings(r, substring_chars)
  ref_words = [_words(r) for r in reference]
  short_refs = [w for w in ref_words if 0 < len(w) < shingle_words]
  out = []
  for i, c in enumerate(candidates):
    hit = next((" ".join(s) for s in _shingles(c, shingle_words) if s in ref_sh), None)
    if hit is None:
      hit = next((s for s in _substrings(c, substring_chars) if s in ref_sub), None)
    if hit is None:
      cw = _words(c)
      if 0 < len(cw) < shingle_words:
        hit = next((" ".join(cw) for rw in ref_words if _contains(rw, cw)), None)
      if hit is None:
        hit = next((" ".join(sw) for sw in short_refs if _contains(cw, sw)), None)
    if hit is not None:
      out.append((i, hit))
  return out
