r"""Decoders outside this project beside its AR and MTP decoders (issue 22
item 5): transformers' greedy ``generate``, its prompt-lookup assisted
generation, and llama.cpp (``llama-cpp-python``, the optional ``llamacpp``
extra). The library behind ``scripts/bench_baselines.py`` and
``scripts/bench_chat.py --baselines``.

Every baseline is a ``fn(prompt ids [P], max_new) -> new ids [n]`` for
``scripts.bench_lib.measure_point(..., baselines=)``, which times it in the same
interleaved rounds as the project's decoders (B = 1, the same pre-encoded
chat prompt in every cell, one untimed warm-up call first) and compares its
tokens with the AR decoder's (``scripts.bench_lib.summarize_baseline``). All
decode greedily, stop at the tokenizer's stop ids (the chat template's
end-of-turn token) or at ``max_new`` tokens, as our Decoder does.

- ``transformers``: ``generate(do_sample=False)`` on the same weights
  (``scripts.bench_hf.load_hf_model``: transformers' own GGUF loader,
  dequantised to float32, or a Hugging Face directory); the ids our head
  never emits suppressed (``scripts.bench_hf.generation_config``). Its tokens
  should equal ours exactly.
- ``prompt_lookup[:K]``: the same with ``prompt_lookup_num_tokens=K``
  (default 10, the number the method's author and transformers' docs
  suggest): prompt lookup decoding (Saxena 2023), speculative decoding whose
  drafts are the K tokens that followed the last matching n-gram
  (``max_matching_ngram_size``, transformers' default 2) of the prompt and
  the text so far; no second model. Greedy verification: the tokens equal
  plain greedy ``generate``'s up to floating-point ties between a block
  forward and a one-token forward.
- ``llamacpp[:THREADS]``: ``llama_cpp.Llama.generate`` in a worker process
  (``scripts.llamacpp_worker``: a crash there is an error, not the end of the
  benchmark) on the GGUF file itself (its
  own quantised kernels: Q4_1 / Q8_0 dot products, not our dequantised
  float32), greedy (``temp=0``, ``top_k=1``, no repeat penalty),
  ``n_threads`` threads, the prompt ids fed as ids and the KV cache
  cleared before every call (no prefix reuse between repeats). Its tokens
  may part from ours after a while; ``agreement_tokens`` says where.

A missing ``llama-cpp-python`` (or a baseline model that is not a GGUF
file) skips the llama.cpp baseline with one logged line; torch and
transformers are needed for the others (the ``hf`` extra) and imported
inside the functions that use them.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from mtp.cli import split_items
from scripts import bench_hf

NAMES = ("transformers", "prompt_lookup", "llamacpp")
DEFAULT_LOOKUP = 10
LLAMACPP_HINT = "make install-llamacpp"


@dataclasses.dataclass(frozen=True)
class Spec:
  """One requested baseline: ``kind`` in NAMES; ``lookup`` K for
  prompt_lookup; ``threads`` for llamacpp (None: the ``build`` default)."""
  kind: str
  lookup: int | None = None
  threads: int | None = None

  @property
  def label(self) -> str:
    """The row label: hf_greedy, hf_lookup{K}, llamacpp or llamacpp_t{THREADS}."""
    if self.kind == "llamacpp":
      return "llamacpp" if self.threads is None else f"llamacpp_t{self.threads}"
    return "hf_greedy" if self.kind == "transformers" else f"hf_lookup{self.lookup}"


def parse_specs(text: str) -> tuple[Spec, ...]:
  """"transformers,prompt_lookup:3,prompt_lookup,llamacpp,llamacpp:1" ->
  Specs (in order, duplicates dropped; ``prompt_lookup`` alone is K = 10,
  ``llamacpp:T`` runs llama.cpp with T threads). Raises ValueError naming a
  bad entry."""
  out = []
  if not str(text or "").strip():
    return ()
  for item in split_items("baselines", text):
    kind, _, arg = item.partition(":")
    if kind not in NAMES or (arg and kind == "transformers"):
      raise ValueError(f"unknown baseline {item!r}; known: transformers, prompt_lookup[:K], "
                       "llamacpp[:THREADS]")
    try:
      n = int(arg) if arg else (DEFAULT_LOOKUP if kind == "prompt_lookup" else None)
    except ValueError:
      n = 0
    if n is not None and n < 1:
      raise ValueError(f"baseline {item!r}: K / THREADS must be an integer >= 1")
    spec = Spec(kind, n if kind == "prompt_lookup" else None, n if kind == "llamacpp" else None)
    if spec not in out:
      out.append(spec)
  return tuple(out)


def llamacpp_available() -> bool:
  """Whether ``llama_cpp`` (the ``llamacpp`` extra) can be imported."""
  try:
    return importlib.util.find_spec("llama_cpp") is not None
  except (ImportError, ValueError):
    return False


class HFGenerate:
  """transformers' greedy ``generate`` of one prompt (B = 1), stopping at
  ``tokenizer.stop_ids`` or the budget; ``lookup`` K > 0 turns on prompt
  lookup decoding (``prompt_lookup_num_tokens=K``)."""

  def __init__(self, hf, model_cfg, tokenizer, lookup: int | None = None):
    self.hf, self.model_cfg, self.tokenizer, self.lookup = hf, model_cfg, tokenizer, lookup
    self._configs: dict[int, object] = {}

  def __call__(self, ids, max_new: int) -> np.ndarray:
    """int64 [n]: the new ids of ``ids`` (int [P]), a stop id included."""
    import torch
    if max_new not in self._configs:
      extra = {"prompt_lookup_num_tokens": self.lookup} if self.lookup else {}
      self._configs[max_new] = bench_hf.generation_config(
          self.model_cfg, self.tokenizer, max_new, self.tokenizer.stop_ids, **extra)
    x = torch.tensor(np.asarray(ids, np.int64)[None])
    with torch.no_grad():
      out = self.hf.generate(x, generation_config=self._configs[max_new],
                             attention_mask=torch.ones_like(x))
    return out[0, x.shape[1]:].numpy()


class LlamaCppGenerate:
  """llama.cpp's greedy decoding of one prompt, run in a worker process of
  its own (``python -m scripts.llamacpp_worker``: ``llama_cpp.Llama.generate``,
  ``temp=0``, ``top_k=1``, the KV cache reset before every call), stopping at
  ``stop_ids`` or the budget. A crash inside llama.cpp (a natively built
  ggml on a VM without AMX tile state dies on its first AMX instruction)
  ends the worker, not the benchmark. A call costs one JSON line each way on
  a pipe (well under a millisecond against the generation's ~10 ms per
  token).

  Args:
    path: the GGUF file; stop_ids: ids that end an answer (kept).
    n_threads: llama.cpp's threads; n_ctx: the context it allocates (prompt
      + budget must fit).
    env: the worker's environment (default: this process's).
  Raises:
    RuntimeError: the worker could not load the model (its message) or died
      (its exit status and stderr's last lines).
  """

  def __init__(self, path: str, stop_ids: Sequence[int], n_threads: int = 2, n_ctx: int = 2048,
               env: Mapping[str, str] | None = None):
    import subprocess
    import sys
    self.stop_ids = [int(i) for i in stop_ids]
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "scripts.llamacpp_worker", "--model", path,
         "--threads", str(n_threads), "--n_ctx", str(n_ctx)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        bufsize=1, env=None if env is None else dict(env))
    atexit.register(self.close)
    ready = self._reply("starting")
    self.version = ready.get("llama_cpp_version")

  def _reply(self, doing: str) -> dict:
    import json
    line = self.proc.stdout.readline()
    if not line:
      code = self.proc.wait(timeout=30)
      err = (self.proc.stderr.read() or "").strip().splitlines()[-5:]
      raise RuntimeError(f"the llama.cpp worker died while {doing} (exit status {code}"
                         + (f"; stderr: {' | '.join(err)}" if err else "") + ")")
    reply = json.loads(line)
    if "error" in reply:
      raise RuntimeError(f"llama.cpp worker: {reply['error']}")
    return reply

  def __call__(self, ids, max_new: int) -> np.ndarray:
    """int32 [n]: the new ids of ``ids`` (int [P]), a stop id included."""
    import json
    self.proc.stdin.write(json.dumps({"ids": [int(i) for i in ids], "max_new": int(max_new),
                                      "stop_ids": self.stop_ids}) + "\n")
    self.proc.stdin.flush()
    return np.asarray(self._reply("generating")["tokens"], np.int32)

  def close(self) -> None:
    """Ends the worker (end of input, then a kill after 10 s)."""
    import subprocess
    if self.proc.poll() is None:
      try:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
      except (OSError, subprocess.TimeoutExpired):
        self.proc.kill()
        self.proc.wait()


def build(specs: Sequence[Spec], source: str, model_cfg, tokenizer, n_threads: int = 2,
          log: Callable[[str], None] | None = print) -> tuple[dict[str, Callable], dict]:
  """The baselines of ``specs`` on the model ``source`` (a GGUF file or a
  Hugging Face directory holding the weights our target was imported from).

  Args:
    specs: ``parse_specs``' result.
    source: model path; llama.cpp needs a GGUF file.
    model_cfg: our target's ``model`` config section (the ids its head
      never emits are suppressed in ``generate`` too).
    tokenizer: our target's tokenizer (stop ids, PAD).
    n_threads: llama.cpp's threads where a spec names none (torch keeps its
      own setting, reported). ggml's threads wait for each other spinning:
      on cores shared with other jobs, more threads can be much slower.
    log: gets one line per skipped baseline (None: quiet).
  Returns:
    ({label: fn(prompt ids, max_new) -> new ids}, info): info has source,
    labels, skipped ({label: why}) and the versions and thread counts.
  """
  fns: dict[str, Callable] = {}
  info: dict = {"source": source, "skipped": {}}
  hf_specs = [s for s in specs if s.kind != "llamacpp"]
  if hf_specs:
    import torch
    import transformers
    hf = bench_hf.load_hf_model(source)
    for s in hf_specs:
      fns[s.label] = HFGenerate(hf, model_cfg, tokenizer, s.lookup)
    info.update(torch_version=torch.__version__, transformers_version=transformers.__version__,
                torch_threads=torch.get_num_threads(),
                prompt_lookup_num_tokens=[s.lookup for s in hf_specs if s.lookup])
  llama_specs = [s for s in specs if s.kind == "llamacpp"]
  if llama_specs:
    why = None
    if not llamacpp_available():
      why = f"llama-cpp-python is not installed ({LLAMACPP_HINT})"
    elif not os.path.isfile(source):
      why = f"{source} is not a GGUF file"
    if why is None:
      for s in llama_specs:
        fns[s.label] = LlamaCppGenerate(source, tokenizer.stop_ids, s.threads or n_threads)
      info.update(llama_cpp_version=fns[llama_specs[0].label].version,
                  llamacpp_process="worker (python -m scripts.llamacpp_worker)",
                  llamacpp_threads={s.label: s.threads or n_threads for s in llama_specs})
    else:
      for s in llama_specs:
        info["skipped"][s.label] = why
      if log is not None:
        log(f"llama.cpp baseline skipped: {why}")
  info["labels"] = list(fns)
  return fns, info


def check_prompt_ids(source: str, messages: Mapping[str, list], ids: Mapping[str, list]) -> dict:
  """Renders every chat (``messages``: {category: [messages, ...]}) with
  transformers' tokenizer of ``source`` (``apply_chat_template``, generation
  prompt appended) and compares the ids with ours (``ids``, the same
  layout). Returns {"prompts": n, "identical": k, "differ": [category, ...]}."""
  htk = bench_hf.load_hf_tokenizer(source)
  n, same, differ = 0, 0, []
  for cat, chats in messages.items():
    for m, ours in zip(chats, ids[cat]):
      theirs = htk.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
      theirs = theirs["input_ids"] if isinstance(theirs, Mapping) or hasattr(theirs, "keys") else theirs
      n += 1
      if [int(i) for i in theirs] == [int(i) for i in ours]:
        same += 1
      else:
        differ.append(cat)
  return {"prompts": n, "identical": same, "differ": differ}
