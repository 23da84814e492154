"""B = 4,000 rows of a 5-token prompt, 2 new tokens, T = 1 (the chi-square
tests' sampling), tiny_config random model: seconds per generate call with
the old padding (PROMPT_BUCKET 64, every length a multiple of 64) and the new
(decode.kv_cache.bucket), each in a process of its own. Writes JSON to argv[2].

    PYTHONPATH=. .venv/bin/python results/prompt_bucket_2026-12-07/bench.py old|new OUT.json
"""
import datetime, json, math, platform, subprocess, sys, time
import numpy as np
from decode import kv_cache
from decode.decoder import Decoder, SamplingParams
from mtp import model as model_lib
from tests.conftest import tiny_config
from tests.test_decode_distribution import PROMPT, _perturbed

mode, out = sys.argv[1], sys.argv[2]
if mode == "old":      # the padding of 6872ab9
  kv_cache.cache_length = lambda n, m, h: (64 * math.ceil(n / 64), 64 * math.ceil((64 * math.ceil(n / 64) + m + h) / 64))
model = model_lib.build_model(tiny_config(), seed=0)
sp, rows = SamplingParams(1.0), []
for method, g, draft in (("draft", 2, _perturbed(model)), ("mtp", 2, None)):
  dec = Decoder(model, method, g, draft)
  t0 = time.perf_counter(); dec.generate([PROMPT] * 4000, 2, sp, seed=0); t1 = time.perf_counter()
  per = []
  for s in range(3):
    a = time.perf_counter(); dec.generate([PROMPT] * 4000, 2, sp, seed=s + 1); per.append(time.perf_counter() - a)
  rows.append({"method": method, "g": g, "cache_length": dec.cache_length([PROMPT], 2),
               "first_call_s": t1 - t0, "call_s": per, "call_s_median": float(np.median(per))})
meta = {"command": "PYTHONPATH=. .venv/bin/python " + " ".join(sys.argv),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "machine": f"{platform.processor() or platform.machine()}, 2 AMD EPYC cores, 24 GB, JAX CPU",
        "date": datetime.datetime.utcnow().isoformat(timespec="seconds") + "Z"}
json.dump({"meta": meta, "mode": mode, "rows": rows}, open(out, "w"), indent=1)
print(mode, [(r["method"], r["cache_length"], round(r["call_s_median"], 3)) for r in rows])
