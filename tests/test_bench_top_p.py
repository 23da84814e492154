"""experiments/bench_top_p.py: the nucleus statistics it reports agree with the
warp the decoder runs, on hand-checked and random rows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from decode import sampling
from experiments import bench_top_p


def test_nucleus_sizes_hand_example():
  # probs 0.1, 0.4, 0.2, 0.3 -> sorted 0.4, 0.3, 0.2, 0.1; mass before: 0, .4, .7, .9
  x = np.log(np.array([[0.1, 0.4, 0.2, 0.3]]))
  got = [int(bench_top_p.nucleus_sizes(x, 1.0, p)[0]) for p in (0.3, 0.65, 0.75, 0.95)]
  assert got == [1, 2, 3, 4]
  # T = 2 flattens: probs ~ sqrt(p) = .325 .282 .230 .163 (sorted), 0.35 needs two
  assert int(bench_top_p.nucleus_sizes(x, 2.0, 0.35)[0]) == 2


def test_nucleus_sizes_match_the_decoders_warp():
  rng = np.random.default_rng(0)
  x = (rng.normal(size=(40, 300)) * rng.uniform(0.2, 6, size=(40, 1))).astype(np.float32)
  compared = 0
  for t, p in ((1.0, 0.9), (0.7, 0.8), (1.3, 0.95)):
    want = bench_top_p.nucleus_sizes(x, t, p)
    z = jnp.asarray(x - x.max(-1, keepdims=True)) / t
    kept = np.isfinite(np.asarray(sampling._top_k_top_p(z, jnp.int32(0), jnp.float32(p), 16))).sum(-1)
    # rows whose boundary mass sits within float32 rounding of top_p are skipped
    q = np.exp(np.asarray(z, np.float64))
    q = -np.sort(-q / q.sum(-1, keepdims=True), -1)
    far = np.min(np.abs(np.cumsum(q, -1) - q - p), -1) > 1e-5
    np.testing.assert_array_equal(kept[far], want[far])
    compared += int(far.sum())
  assert compared > 100


def test_nucleus_stats_fit_share():
  x = np.log(np.array([[0.1, 0.4, 0.2, 0.3], [0.97, 0.01, 0.01, 0.01]]))
  (row,) = bench_top_p.nucleus_stats(x, [1.0], [0.75], candidates=(2, 3))
  assert row["positions"] == 2 and row["nucleus_max"] == 3 and row["fits_candidates"] == 0.5
  assert row["fits_second_tier"] == 1.0


def test_warp_times_and_markdown_run():
  rng = np.random.default_rng(1)
  x = (rng.normal(size=(12, 64)) * 4).astype(np.float32)
  w = bench_top_p.warp_times(x, (2, 2), 1.0, 0.9, repeats=2)
  assert w["shape"] == [2, 2, 64] and w["candidates_s"]["median"] > 0
  assert w["first_tier_only_s"]["median"] > 0 and 0 <= w["blocks_fitting_second_tier"] <= 1
  md = bench_top_p.markdown({"nucleus": bench_top_p.nucleus_stats(x, [1.0], [0.9]), "warp": [w],
                             "decode": []}, {"command": "x", "workdir": "w"})
  assert "fits in" in md and "full sort / candidates" in md
