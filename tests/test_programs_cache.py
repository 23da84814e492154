"""decode.compiled.clear_cache frees the compiled programs' memory mappings.

On the CPU each XLA executable holds ~7 memory mappings; a process that
keeps every program it compiled passes the kernel's vm.max_map_count and
XLA's next compile segfaults (docs/testing.md). tests/conftest.py calls
clear_cache after every test file; a long-lived user process can too."""

import gc
import os

import pytest

from decode import compiled
from decode.decoder import Decoder, SamplingParams
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0)


def _maps() -> int:
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


@pytest.mark.cpu_only   # the mappings are XLA:CPU's JIT code; accelerators keep theirs on the device
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")
def test_clear_cache_frees_the_mappings_of_unreferenced_programs(trained_markov):
  model = trained_markov[1]
  compiled.clear_cache()
  gc.collect()
  base = _maps()
  for g in (1, 2):
    for batch in (1, 2, 3):      # each batch size compiles its own executables
      Decoder(model, "mtp", g).generate(random_prompts([3 + i for i in range(batch)]), 8, GREEDY)
  gc.collect()
  grown = _maps() - base
  assert grown > 100, grown     # the cached programs still hold their executables
  compiled.clear_cache()
  gc.collect()
  left = _maps() - base
  assert left < 0.25 * grown, (grown, left)
