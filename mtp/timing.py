"""The one interleaved-repeats timer and the one spread / format helper.

Every benchmark (scripts/, ``python -m decode --compare``, the round-cost
calibration) times variants in ``repeats`` rounds that each run every
variant once, so machine noise hits all alike, and reports the median
(docs/design.md section 7): ``interleaved_times``; ``spread`` and
``format_spread`` summarise numbers. Imports neither ``train`` nor
``decode``; JAX only for ``xla_flops``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

# every statistic ``spread`` knows, in its default order
STATS = ("n", "mean", "std", "min", "p10", "median", "p90", "max")


def interleaved_times(fns: Mapping[str, Callable[[], object]], repeats: int, *,
                      warmup: int = 1) -> dict[str, np.ndarray]:
  """Seconds per call of each zero-argument callable in ``fns`` (each must
  block until done): ``warmup`` untimed calls each, then ``repeats`` rounds,
  round r calling each once in the order rotated to start at r mod len(fns).
  Returns {name: float64 [repeats]} (index r = round r, so per-round ratios
  pair close calls). Raises ValueError: repeats < 1, warmup < 0, no functions."""
  names = list(fns)
  if not names:
    raise ValueError("interleaved_times: no functions to time")
  if int(repeats) != repeats or repeats < 1:
    raise ValueError(f"interleaved_times: repeats={repeats!r} must be an integer >= 1")
  if int(warmup) != warmup or warmup < 0:
    raise ValueError(f"interleaved_times: warmup={warmup!r} must be an integer >= 0")
  for _ in range(int(warmup)):
    for name in names:
      fns[name]()
  out = {name: np.zeros(int(repeats), np.float64) for name in names}
  for r in range(int(repeats)):
    k = r % len(names)
    for name in names[k:] + names[:k]:
      t0 = time.perf_counter()
      fns[name]()
      out[name][r] = time.perf_counter() - t0
  return out


def spread(values: Sequence[float] | np.ndarray, stats: Sequence[str] = STATS,
           prefix: str = "") -> dict:
  """Summary statistics of ``values`` (no NaN for "missing": leave it out):
  ``stats`` from ``STATS`` (n, mean, std (population), min, p10, median,
  p90, max; numpy's linear percentiles), each key prefixed by ``prefix``.
  Returns {prefix + stat: value} in ``stats`` order; floats are None when
  ``values`` is empty. Raises ValueError: a name not in ``STATS``."""
  bad = [s for s in stats if s not in STATS]
  if bad:
    raise ValueError(f"spread: unknown statistic {bad[0]!r}; known: {', '.join(STATS)}")
  v = np.asarray(values, np.float64).reshape(-1)
  if v.size == 0:
    return {prefix + s: (0 if s == "n" else None) for s in stats}
  calc = {"n": lambda: int(v.size), "mean": lambda: float(v.mean()), "std": lambda: float(v.std()),
          "min": lambda: float(v.min()), "max": lambda: float(v.max()),
          "median": lambda: float(np.median(v)), "p10": lambda: float(np.percentile(v, 10)),
          "p90": lambda: float(np.percentile(v, 90))}
  return {prefix + s: calc[s]() for s in stats}


def format_spread(s: dict, fmt: str = ".3f", scale: float = 1.0, signed: bool = False,
                  center: str | None = None) -> str:
  """One ``spread`` as "center [min, max]" (e.g. "1.250 [1.100, 1.400]"):
  ``center`` defaults to "median" (else "mean"), values times ``scale``,
  formatted with ``fmt`` (signed with ``signed``); the center alone for n == 1
  or without min/max; "-" when empty."""
  if center is None:
    center = "median" if "median" in s else "mean"
  if not s or s.get(center) is None:
    return "-"
  f = lambda x: format(x * scale, ("+" if signed else "") + fmt)
  if s.get("n") == 1 or s.get("min") is None or s.get("max") is None:
    return f(s[center])
  return f"{f(s[center])} [{f(s['min'])}, {f(s['max'])}]"


def xla_flops(compiled) -> float | None:
  """FLOPs of a compiled JAX program (``jax.jit(f).lower(...).compile()``)
  from XLA's cost analysis; None when XLA reports none."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"]) if cost and "flops" in cost else None
