"""Interleaved timing: the one timer the benchmarks, the CLI's ``--compare``
and the decoder's round-cost calibration share.

``interleaved_times`` calls every function once per round, in turn, so
noise on a shared machine (bursts, frequency drift, another job) hits
every variant alike; results keep the round index so per-round ratios can
be taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np


def interleaved_times(fns: Mapping[str, Callable[[], object]], repeats: int, *,
                      warmup: int = 1) -> dict[str, np.ndarray]:
  """Seconds per call of each function, measured interleaved.

  Every fn is first called ``warmup`` times (compilation, caches), then
  ``repeats`` rounds run in which every fn is called once, in the mapping's
  order. Each fn must block until its work is done (wrap device work with
  ``jax.block_until_ready``).

  Args:
    fns: name -> zero-argument callable.
    repeats: timed rounds, >= 1.
    warmup: untimed calls per fn before the first round, >= 0.
  Returns:
    name -> float64 array [repeats] of seconds; index r is round r.
  Raises:
    ValueError: repeats < 1 or warmup < 0.
  """
  if repeats < 1 or warmup < 0:
    raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
  for fn in fns.values():
    for _ in range(warmup):
      fn()
  out = {name: np.zeros(repeats, np.float64) for name in fns}
  for r in range(repeats):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      fn()
      out[name][r] = time.perf_counter() - t0
  return out
