"""The llama.cpp baseline's worker process (``scripts.llamacpp_worker``) and
its client (``scripts.baseline_decoders.LlamaCppGenerate``), driven through a
fake ``llama_cpp`` package put first on the worker's PYTHONPATH: the real
subprocess, pipe protocol, stop ids, budget, bad requests, a model that
fails to load and a worker that dies mid-call. (The real llama.cpp is the
``llamacpp`` extra; scripts/bench_chat.py --baselines llamacpp measures it.)
"""

import io
import json
import os

import numpy as np
import pytest

from scripts import baseline_decoders
from scripts import llamacpp_worker

FAKE = '''
__version__ = "0.0-fake"

class Llama:
    def __init__(self, model_path, **kw):
        import sys
        if "jax" in sys.modules:      # the worker must stay apart from JAX
            raise RuntimeError("jax was imported in the llama.cpp worker")
        if "missing" in model_path:
            raise ValueError(f"Failed to load model from file: {model_path}")
        self.kw = kw
        self.resets = 0
    def reset(self):
        self.resets += 1
    def generate(self, ids, **kw):
        assert kw["temp"] == 0.0 and kw["top_k"] == 1 and kw["repeat_penalty"] == 1.0
        t = ids[-1]
        while True:
            t = t + 1
            if t == 13:
                import os
                os._exit(11)          # a crash inside the library
            yield t
    def close(self):
        pass
'''


@pytest.fixture(scope="module")
def fake_env(tmp_path_factory):
  root = tmp_path_factory.mktemp("fake_llama")
  (root / "llama_cpp").mkdir()
  (root / "llama_cpp" / "__init__.py").write_text(FAKE)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(root), repo, env.get("PYTHONPATH", "")])
  return env


def test_serve_answers_in_order_and_survives_bad_requests():
  gen = lambda ids, max_new, stops: list(range(ids[-1] + 1, ids[-1] + 1 + max_new))
  lines = [json.dumps({"ids": [1, 2], "max_new": 3}), "not json", "",
           json.dumps({"ids": [], "max_new": 3}), json.dumps({"ids": [5], "max_new": 0}),
           json.dumps({"ids": [5]}), json.dumps({"ids": [7], "max_new": 2, "stop_ids": [8]})]
  out = io.StringIO()
  assert llamacpp_worker.serve(gen, lines, out) == 6          # the empty line is skipped
  replies = [json.loads(x) for x in out.getvalue().splitlines()]
  assert replies[0] == {"tokens": [3, 4, 5]} and replies[5] == {"tokens": [8, 9]}
  assert "JSONDecodeError" in replies[1]["error"] or "Expecting value" in replies[1]["error"]
  assert "'ids'" in replies[2]["error"] and "'max_new'=0" in replies[3]["error"]
  assert "max_new" in replies[4]["error"]


def test_llama_generate_stops_at_stop_id_and_budget():
  class Fake:
    resets = 0
    def reset(self):
      Fake.resets += 1
    def generate(self, ids, **kw):
      t = ids[-1]
      while True:
        t += 1
        yield t
  gen = llamacpp_worker.llama_generate(Fake())
  assert gen([1], 10, [4]) == [2, 3, 4]          # the stop id is kept
  assert gen([1], 2, [4]) == [2, 3]              # the budget
  assert Fake.resets == 2                        # no prefix reuse between calls


def test_worker_process_round_trip(fake_env):
  fn = baseline_decoders.LlamaCppGenerate("model.gguf", stop_ids=[9], n_threads=1, env=fake_env)
  try:
    assert fn.version == "0.0-fake"
    out = fn(np.array([3, 4], np.int32), 10)
    assert out.dtype == np.int32 and out.tolist() == [5, 6, 7, 8, 9]
    assert fn([0], 3).tolist() == [1, 2, 3]
  finally:
    fn.close()
  assert fn.proc.returncode == 0


def test_worker_that_cannot_load_names_the_file(fake_env):
  with pytest.raises(RuntimeError, match="cannot load 'missing.gguf'"):
    baseline_decoders.LlamaCppGenerate("missing.gguf", stop_ids=[9], env=fake_env)


def test_worker_crash_is_an_error_not_a_dead_benchmark(fake_env):
  fn = baseline_decoders.LlamaCppGenerate("model.gguf", stop_ids=[99], env=fake_env)
  with pytest.raises(RuntimeError, match=r"worker died while generating \(exit status 11"):
    fn([10], 8)                     # the fake library exits at token 13
  assert fn.proc.poll() == 11
  fn.close()                        # closing a dead worker is fine


def test_build_runs_llamacpp_in_a_worker(fake_env, tmp_path, monkeypatch):
  gguf = tmp_path / "m.gguf"
  gguf.write_bytes(b"GGUF")
  monkeypatch.setattr(baseline_decoders, "llamacpp_available", lambda: True)
  monkeypatch.setenv("PYTHONPATH", fake_env["PYTHONPATH"])    # the worker inherits it

  class Tok:
    stop_ids = (2,)
  fns, info = baseline_decoders.build(baseline_decoders.parse_specs("llamacpp:1"), str(gguf), None,
                                    Tok(), log=None)
  try:
    assert list(fns) == ["llamacpp_t1"] and info["llama_cpp_version"] == "0.0-fake"
    assert info["llamacpp_threads"] == {"llamacpp_t1": 1} and "worker" in info["llamacpp_process"]
    assert fns["llamacpp_t1"]([0], 5).tolist() == [1, 2]
  finally:
    for f in fns.values():
      f.close()
