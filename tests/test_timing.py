"""mtp/timing.py: the interleaved-repeats timer (call order, warm-up count,
shapes, per-round pairing) with fake functions and a fake clock, and the
spread / format helpers. No sleeping, no real timings asserted."""

import numpy as np
import pytest

from mtp import timing


class FakeClock:
  """``time.perf_counter`` stand-in: advances only when a fake function says so."""

  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


@pytest.fixture
def clock(monkeypatch):
  c = FakeClock()
  monkeypatch.setattr(timing.time, "perf_counter", c)
  return c


def _fns(clock, log, costs):
  """{name: fn} whose r-th call (warm-up included) takes costs[name](r) fake seconds."""
  calls = {name: 0 for name in costs}

  def make(name):
    def fn():
      log.append(name)
      clock.now += costs[name](calls[name])
      calls[name] += 1
    return fn
  return {name: make(name) for name in costs}, calls


def test_order_warmup_and_rotation(clock):
  log = []
  fns, calls = _fns(clock, log, {"a": lambda r: 1.0, "b": lambda r: 2.0, "c": lambda r: 3.0})
  times = timing.interleaved_times(fns, 4, warmup=2)
  # warm-up: every fn `warmup` times in the mapping's order, then one call each per round,
  # the start rotating by one each round
  assert log[:6] == ["a", "b", "c", "a", "b", "c"]
  assert log[6:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
  assert calls == {"a": 6, "b": 6, "c": 6}
  assert list(times) == ["a", "b", "c"]
  for name, cost in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
    assert times[name].shape == (4,) and times[name].dtype == np.float64
    np.testing.assert_array_equal(times[name], cost)      # warm-up calls are not timed


def test_index_r_is_round_r(clock):
  log = []
  # the timed call of round r (after one warm-up call) costs r + 1 for "x", 10 (r + 1) for "y"
  fns, _ = _fns(clock, log, {"x": lambda k: float(k), "y": lambda k: 10.0 * k})
  times = timing.interleaved_times(fns, 3)                  # warmup defaults to 1
  assert log == ["x", "y", "x", "y", "y", "x", "x", "y"]
  np.testing.assert_array_equal(times["x"], [1.0, 2.0, 3.0])
  np.testing.assert_array_equal(times["y"], [10.0, 20.0, 30.0])
  np.testing.assert_array_equal(times["y"] / times["x"], 10.0)   # per-round ratios pair up


def test_no_warmup_single_fn_and_errors(clock):
  log = []
  fns, calls = _fns(clock, log, {"only": lambda r: 0.5})
  times = timing.interleaved_times(fns, 2, warmup=0)
  assert calls == {"only": 2} and times["only"].tolist() == [0.5, 0.5]
  for kw in ({"repeats": 0}, {"repeats": 1.5}, {"repeats": 1, "warmup": -1}):
    with pytest.raises(ValueError):
      timing.interleaved_times(fns, **kw)
  with pytest.raises(ValueError, match="no functions"):
    timing.interleaved_times({}, 1)


def test_spread_stats_prefix_and_empty():
  v = [3.0, 1.0, 2.0, 4.0, 5.0]
  s = timing.spread(v)
  assert list(s) == list(timing.STATS)
  assert s["n"] == 5 and isinstance(s["n"], int)
  assert (s["mean"], s["median"], s["min"], s["max"]) == (3.0, 3.0, 1.0, 5.0)
  assert s["std"] == pytest.approx(np.std(v)) and s["p10"] == pytest.approx(1.4)
  assert s["p90"] == pytest.approx(4.6)
  assert timing.spread(np.array(v), ("median", "min", "max"), "wall_s_") == {
      "wall_s_median": 3.0, "wall_s_min": 1.0, "wall_s_max": 5.0}
  assert timing.spread([], ("mean", "min", "max", "std", "n")) == {
      "mean": None, "min": None, "max": None, "std": None, "n": 0}
  with pytest.raises(ValueError, match="unknown statistic"):
    timing.spread(v, ("mode",))


def test_format_spread():
  s = timing.spread([0.001, 0.002, 0.004])
  assert timing.format_spread(s, ".1f", 1e3) == "2.0 [1.0, 4.0]"            # median first
  assert timing.format_spread(s, ".2f", 1e3, center="mean") == "2.33 [1.00, 4.00]"
  seeds = timing.spread([-0.5, 0.25], ("mean", "min", "max", "std", "n"))
  assert timing.format_spread(seeds, ".2f", signed=True) == "-0.12 [-0.50, +0.25]"
  assert timing.format_spread(timing.spread([1.5], ("mean", "min", "max", "n")), ".1f") == "1.5"
  assert timing.format_spread(timing.spread([], ("mean", "n"))) == "-"
  assert timing.format_spread({}) == "-"
