"""How deep ``python -m decode`` calls the acceptance rule: the Python stack
when ``decode.acceptance.rejection_sample`` is first traced for the answer
holds at most ``MAX_HOPS`` project calls from ``decode/__main__.py``'s
``main``, each with one job (docs/design.md section 2.0)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_HOPS = 6
EXPECTED = [("decode/__main__.py", "main"), ("decode/cli/run.py", "run"),
            ("decode/decoder.py", "stream"), ("decode/loops.py", "stream_rounds"),
            ("decode/loops.py", "generate_loop"), ("decode/round.py", "chain_round")]

# python -m decode with the warm-up off (so the answer's stream traces the
# round) and rejection_sample recording the project frames above it on its
# first call; they are printed as the last line of stdout
RUNNER = """
import json, os, runpy, sys, traceback
import decode.acceptance as acceptance
from decode.decoder import Decoder
Decoder.warm_up = lambda self, *a, **k: None
real, seen = acceptance.rejection_sample, []
def recording(*a, **k):
  if not seen:
    seen.append([(os.path.relpath(f.filename), f.name) for f in traceback.extract_stack()[:-1]])
  return real(*a, **k)
acceptance.rejection_sample = recording
sys.argv = ["decode"] + sys.argv[1:]
try:
  runpy.run_module("decode", run_name="__main__", alter_sys=True)
except SystemExit as e:
  assert not e.code, e.code
print(json.dumps(seen[0]))
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """An untrained tiny model (D = 2) saved as a checkpoint workdir."""
  from flax import nnx
  from mtp import checkpoint as ckpt_lib
  from mtp.model import Transformer
  cfg = tiny_config()
  model = Transformer(cfg.model, cfg.mtp.depth, rngs=nnx.Rngs(0))
  path = str(tmp_path_factory.mktemp("call_path_wd"))
  ckpt = ckpt_lib.Checkpointer(path)
  ckpt.save(1, nnx.state(model, nnx.Param), {}, None, cfg)
  ckpt.close()
  return path


def project_calls(frames):
  """The (file, function) frames of project files (not tests/, not the
  virtual environment, not the runner's ``<string>``) from ``main`` on."""
  ours = [(f, name) for f, name in frames
          if not f.startswith(("..", "tests/", "<", "/")) and "/.venv/" not in f
          and not f.startswith(".venv/")]
  names = [name for _, name in ours]
  assert "main" in names, ours
  return ours[names.index("main"):]


def test_python_m_decode_reaches_rejection_sample_in_at_most_six_calls(workdir):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  r = subprocess.run([sys.executable, "-c", RUNNER, "--workdir", workdir, "--prompt", "ab",
                      "--method", "mtp", "--num_draft_tokens", "2", "--temperature", "1",
                      "--max_new_tokens", "4"],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  chain = project_calls(json.loads(r.stdout.strip().splitlines()[-1]))
  assert len(chain) <= MAX_HOPS, chain
  assert [tuple(c) for c in chain] == EXPECTED, chain
