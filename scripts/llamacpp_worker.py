r"""llama.cpp in a process of its own: the worker behind the ``llamacpp``
baseline of ``scripts.baseline_decoders`` (``LlamaCppGenerate``).

    python -m scripts.llamacpp_worker --model SmolLM2.gguf [--threads 2] [--n_ctx 2048]

Why a separate process: a crash inside the library takes only the worker
down, and the benchmark reports it (``LlamaCppGenerate`` raises an error
with the exit status) instead of dying with it. This is not hypothetical:
``llama-cpp-python`` 0.3.36 built natively (``-march=native``) on this
machine's Intel CPU, whose virtual machine lists AMX in /proc/cpuinfo but
does not enable the AMX tile state, dies on its first ``ldtilecfg`` (a
general protection fault in ``libggml-cpu.so``, exit status -11), with or
without JAX in the process; ``make install-llamacpp`` builds it without AMX
(docs/results.md 13.7). The worker imports only the standard library and
``llama_cpp``, so JAX and this project's code stay out of its process.

Protocol (one JSON object per line; the worker answers every request in
order on its stdout and logs nothing there):

    -> {"ids": [int, ...], "max_new": int, "stop_ids": [int, ...]}
    <- {"tokens": [int, ...]}          the new ids, a final stop id included
    <- {"error": "message"}            a bad request; the worker keeps serving

The first line the worker writes is ``{"ready": true, "llama_cpp_version":
...}`` once the model is loaded (or ``{"error": ...}`` and exit status 2 when
it cannot be). End of input ends the worker with status 0. Greedy decoding
as ``llama_cpp.Llama.generate`` with ``temp=0``, ``top_k=1``, no repeat
penalty, the KV cache reset before every request (no prefix reuse between
repeats).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TextIO


def serve(generate: Callable[[Sequence[int], int, Sequence[int]], list[int]],
          requests: Iterable[str], out: TextIO) -> int:
  """Answers JSON-line requests with ``generate(ids, max_new, stop_ids) ->
  new ids`` until ``requests`` ends; returns the number answered (errors
  included). A malformed request (not JSON, missing or non-integer fields,
  max_new < 1, empty ids) gets ``{"error": ...}`` naming the field and the
  worker goes on."""
  served = 0
  for line in requests:
    if not line.strip():
      continue
    try:
      req = json.loads(line)
      ids, max_new, stop_ids = req["ids"], req["max_new"], req.get("stop_ids", [])
      if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
        raise ValueError("'ids' must be a non-empty list of integers")
      if not (isinstance(max_new, int) and max_new >= 1):
        raise ValueError(f"'max_new'={max_new!r} must be an integer >= 1")
      if not (isinstance(stop_ids, list) and all(isinstance(i, int) for i in stop_ids)):
        raise ValueError("'stop_ids' must be a list of integers")
      reply = {"tokens": [int(t) for t in generate(ids, max_new, stop_ids)]}
    except (ValueError, KeyError, TypeError) as e:
      reply = {"error": f"{type(e).__name__}: {e}"}
    out.write(json.dumps(reply) + "\n")
    out.flush()
    served += 1
  return served


def llama_generate(llm) -> Callable[[Sequence[int], int, Sequence[int]], list[int]]:
  """``generate(ids, max_new, stop_ids)`` on a ``llama_cpp.Llama``: greedy,
  the cache reset first, stopping after a stop id or ``max_new`` tokens."""
  def generate(ids, max_new, stop_ids):
    stops = {int(i) for i in stop_ids}
    llm.reset()
    out = []
    for t in llm.generate([int(i) for i in ids], top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                          repeat_penalty=1.0, reset=True):
      out.append(int(t))
      if t in stops or len(out) >= max_new:
        break
    return out
  return generate


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", required=True, help="GGUF file")
  ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads, >= 1")
  ap.add_argument("--n_ctx", type=int, default=2048, help="context llama.cpp allocates, >= 16")
  args = ap.parse_args(argv)
  out = sys.stdout
  try:
    if args.threads < 1 or args.n_ctx < 16:
      raise ValueError(f"--threads={args.threads} must be >= 1 and --n_ctx={args.n_ctx} >= 16")
    import llama_cpp
    llm = llama_cpp.Llama(model_path=args.model, n_threads=args.threads,
                          n_threads_batch=args.threads, n_ctx=args.n_ctx, seed=0, verbose=False)
  except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
    hint = (" (install it: make install-llamacpp)" if isinstance(e, ModuleNotFoundError) else "")
    out.write(json.dumps({"error": f"cannot load {args.model!r} in llama.cpp: "
                                   f"{type(e).__name__}: {e}{hint}"}) + "\n")
    out.flush()
    return 2
  out.write(json.dumps({"ready": True, "llama_cpp_version": llama_cpp.__version__}) + "\n")
  out.flush()
  try:
    serve(llama_generate(llm), sys.stdin, out)
  finally:
    llm.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
