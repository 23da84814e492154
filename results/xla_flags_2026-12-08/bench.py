"""Compile (first call) and run (second call) seconds of four decoding programs of a tiny target; NL=1 gives it 1 layer. Used by run.sh (results/suite_timing_2026-12-08.txt (5))."""
import time, sys, json, os
t00=time.perf_counter()
import jax, numpy as np
from decode.decoder import Decoder, SamplingParams
from mtp import model as model_lib
from tests.conftest import tiny_config, random_prompts
GREEDY = SamplingParams(temperature=0.0)
T1 = SamplingParams(temperature=1.0)
import os
model = model_lib.build_model(tiny_config(model=dict(num_layers=int(os.environ.get("NL","2")))), seed=1)
prompts = random_prompts([1, 5, 3, 2], seed=3)
out = {}
def timed(name, f):
  t = time.perf_counter(); f(); a = time.perf_counter() - t
  t = time.perf_counter(); f(); b = time.perf_counter() - t
  out[name] = (round(a, 2), round(b, 3))
timed("auto", lambda: Decoder(model, "mtp", "auto", max_draft_tokens=3, auto_costs=[1.0, 1.05, 1.1, 1.15]).generate(prompts, 24, GREEDY))
timed("mtp2", lambda: Decoder(model, "mtp", 2).generate(prompts, 24, GREEDY))
timed("tree", lambda: Decoder(model, "mtp", tree=(3, 2)).stream(prompts, 24, GREEDY))
big = [prompts[1]] * 4000
timed("mtp2_b4000", lambda: Decoder(model, "mtp", 2).generate(big, 2, T1))
out["total"] = round(time.perf_counter() - t00, 1)
print(os.environ.get("XLA_FLAGS", "-"), json.dumps(out))
