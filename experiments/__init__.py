"""One-off studies whose results are committed (results/NAME*.{json,md},
read in docs/results/): one module per study, holding its library and its
``main`` (experiments/README.md lists them), plus what several share
(common.py) and the libraries only they use (ablation.py, vocab_sweep.py).
The benchmarks and tools a user runs often stay in scripts/.

An experiment may import mtp, train, decode and scripts; nothing of those
imports experiments/ (tests/test_import_graph.py). It imports another
module of experiments/ only as ``experiments.NAME``.

Run one from the repository root as ``python -m experiments.NAME ...``
(the form its OUT.md records, ``common.command_line``); ``python
experiments/NAME.py ...`` works too once the package is installed with
experiments/ in it (``make install`` after this pyproject.toml).
"""
