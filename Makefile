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

.PHONY: install run test test-fast bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0 $(TORCH_ARGS)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[dev]" $(TORCH_ARGS)
	touch $@

run: install
	$(BIN)/python -m pipelines.full conf=$(CONF)

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

bench: install
	$(BIN)/python bench/verify.py
	$(BIN)/python bench/losses.py

lint: install
	$(BIN)/ruff check components pipelines tests bench

clean:
	rm -rf $(VENV) runs .pytest_cache
