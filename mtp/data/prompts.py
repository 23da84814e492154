"""Prompts cut from a dataset's documents: held-out prompts for decoding
benchmarks (``held_out_prompts``, validation split) and prompts from the
training split that self-distillation continues (``training_prompts``).
Both are deterministic for a seed.
"""

from __future__ import annotations

import numpy as np

from mtp.config import DataConfig
from mtp.data.corpora import DataError
from mtp.data.sources import as_bytes, load_documents, load_source


def held_out_prompts(dataset: str, n: int, prompt_bytes: int, seed: int = 0,
                     data_dir: str = "") -> list[str]:
  """n held-out prompts (str) of about ``prompt_bytes`` bytes (cut at a UTF-8
  boundary) from the validation split of ``dataset``, each starting at a
  line boundary of a different document (documents cycle when n exceeds
  them); deterministic for a seed. Raises DataError (unknown dataset, or no
  validation document longer than prompt_bytes + 64)."""
  docs = [d for d in load_documents(DataConfig(name=dataset, data_dir=data_dir), "validation")
          if len(d.encode()) > prompt_bytes + 64]
  if not docs:
    raise DataError(f"no validation document of {dataset} is longer than {prompt_bytes + 64} bytes")
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    doc = docs[i % len(docs)]
    lines = np.cumsum([0] + [len(l) for l in doc.splitlines(keepends=True)])
    starts = lines[lines < len(doc) - 2 * prompt_bytes] if len(doc) > 2 * prompt_bytes else [0]
    start = int(rng.choice(starts))
    raw = doc[start:].encode()[:prompt_bytes]
    out.append(raw.decode("utf-8", errors="ignore") or doc[:prompt_bytes])
  return out


def training_prompts(data_cfg: DataConfig, n: int, prompt_bytes: int, seed: int = 0
                     ) -> list[tuple[str, str]]:
  """``n`` prompts ``(source_name, text)`` cut from training documents
  (split ``data_cfg.train_split``): each the last ``prompt_bytes`` bytes (or
  fewer, at a UTF-8 boundary) before a random line boundary at least 16
  bytes into a document. Documents are drawn in a seeded random order,
  cycling when ``n`` exceeds those long enough. Deterministic for a seed.

  Raises DataError (dataset or split missing, or no training document with a
  line boundary past its 16th byte).
  """
  src = load_source(data_cfg, data_cfg.train_split)
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(src))
  out, tried = [], 0
  while len(out) < n:
    if tried >= len(order) and not out:
      raise DataError(f"no training document of '{data_cfg.name}' has a line boundary "
                      "past its 16th byte to cut a prompt at")
    rec = src[int(order[tried % len(order)])]
    tried += 1
    raw = as_bytes(rec[data_cfg.text_feature])
    ends = np.flatnonzero(np.frombuffer(raw, np.uint8)[16:] == 0x0A) + 17    # just after a newline
    if not ends.size:
      continue
    end = int(rng.choice(ends))
    text = raw[max(0, end - prompt_bytes):end].decode("utf-8", errors="ignore")
    if not text:
      continue
    name = as_bytes(rec["name"]).decode("utf-8", "replace") if "name" in rec else ""
    out.append((name or f"doc{int(order[(tried - 1) % len(order)])}", text))
  return out
