"""Experiments and benchmarks: one module per benchmark or experiment,
holding its library and its ``main``, plus the libraries several share
(bench_lib.py, baseline_decoders.py, draft_models.py; llamacpp_worker.py
runs in a process of its own), over the packages' helpers (mtp/timing.py,
mtp/report.py, mtp/cli.py, train/bench.py, experiments/ablation.py; see
docs/design.md section 2.1). A script imports another module of scripts/
only as ``scripts.NAME``; nothing outside scripts/ imports scripts/.

Run one from the repository root as ``python scripts/NAME.py ...`` (the
package installed, e.g. ``make install``) or ``python -m scripts.NAME ...``.
"""
