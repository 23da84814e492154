"""Experiments and benchmarks: thin command-line scripts over the benchmark
library in the packages (mtp/timing.py, mtp/report.py, mtp/cli.py,
decode/bench*.py, train/bench.py, train/ablation.py, mtp/drafts.py; see
docs/design.md section 2.1). No script imports another.

Run one from the repository root as ``python scripts/NAME.py ...`` (the
package installed, e.g. ``make install``) or ``python -m scripts.NAME ...``.
"""
