# The two commands: `make pipeline` (install + run the whole pipeline) and `make test` (install + run the tests).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: install system-deps pipeline repro test test-fast clean-results

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# the CPU build of torch first: a range it satisfies then installs nothing more (see README)
	$(BIN)/pip install --quiet torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet -e ".[dev]"
	touch $@

system-deps:
	./infra/install_system_deps.sh

pipeline: install
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/arlflow pipeline

repro: install
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc repro

test: install system-deps
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pytest -q --durations=15

test-fast: install
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pytest -q -m "not slow"

clean-results:
	rm -rf data artifacts metrics mlflow.db mlartifacts mlruns dvc.lock .prefect .arlflow
