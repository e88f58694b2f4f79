# Two entry points: `make run` (set up, then serve the default model on http://127.0.0.1:8000) and `make test`.
# Setup makes a virtual environment in .venv; where no NVIDIA GPU is present it installs the CPU build of
# torch first, so that the torch requirement does not pull a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test lint setup

run: $(VENV)/.runtime
	$(BIN)/strata serve

test: $(VENV)/.test lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

lint: $(VENV)/.test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

setup: $(VENV)/.test

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/python -m pip install -q torch==2.13.0; fi
	touch $@

$(VENV)/.runtime: $(VENV)/.torch pyproject.toml
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@
