# make demo: set up .venv (if missing), train the tiny config on the embedded
#            python_stdlib corpus, then speculative-decode a code prompt with it.
# make test: set up .venv (if missing) and run the test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/tiny
STAMP := $(VENV)/.installed

.PHONY: demo test install clean-demo

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m train --config configs/tiny.py --workdir $(WORKDIR)
	$(PY) -m decode --workdir $(WORKDIR) --method mtp --num_draft_tokens 2 --compare \
	  --prompt "$$(printf 'import os\nimport sys\n\n\ndef main(')" --max_new_tokens 200 --temperature 0.7

test: $(STAMP)
	$(PY) -m pytest -q tests

clean-demo:
	rm -rf $(WORKDIR)
