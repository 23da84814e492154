"""Benchmarks a user reruns on each model or change and the tools beside
them: one module per benchmark, holding its library and its ``main``, plus
the libraries several share (bench_lib.py, baseline_decoders.py,
draft_models.py, hlo_kernels.py; llamacpp_worker.py runs in a process of
its own), over the packages' helpers (mtp/timing.py, mtp/report.py,
mtp/cli.py, train/bench.py; see docs/design.md section 2.1). The one-off
studies whose results are committed live in experiments/. A script
imports another module of scripts/ only as ``scripts.NAME``; nothing
outside scripts/ and experiments/ imports scripts/.

Run one from the repository root as ``python scripts/NAME.py ...`` (the
package installed, e.g. ``make install``) or ``python -m scripts.NAME ...``.
"""
