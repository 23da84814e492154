"""Speedup theory of decode/cli/theory.py against hand-computed values."""

import pytest

from decode.cli import theory


@pytest.mark.parametrize("alpha,g,tau", [(0.0, 3, 1.0), (0.5, 1, 1.5), (0.5, 2, 1.75),
                                         (0.8, 4, (1 - 0.8 ** 5) / 0.2), (1.0, 3, 4.0)])
def test_expected_accepted_length(alpha, g, tau):
  assert theory.expected_accepted_length(alpha, g) == pytest.approx(tau)


def test_ideal_speedup_and_inverse():
  # alpha 0.8, G 2, c 0.1: (1 - 0.512) / (0.2 * 1.2) = 2.0333
  assert theory.ideal_speedup(0.8, 2, 0.1) == pytest.approx(0.488 / 0.24)
  assert theory.ideal_speedup(1.0, 3, 0.0) == pytest.approx(4.0)
  for alpha in (0.1, 0.45, 0.9):
    for g in (1, 3, 6):
      tau = theory.expected_accepted_length(alpha, g)
      assert theory.alpha_from_tau(tau, g) == pytest.approx(alpha, abs=1e-9)
  assert theory.alpha_from_tau(1.0, 2) == pytest.approx(0.0, abs=1e-9)
  assert theory.alpha_from_tau(3.0, 2) == pytest.approx(1.0, abs=1e-9)
