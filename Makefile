# hetero_infer: the two commands are `make demo` and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# Use the active virtualenv when there is one, else make .venv.
ifdef VIRTUAL_ENV
VENV := $(VIRTUAL_ENV)
else
VENV := .venv
endif
BIN := $(VENV)/bin
PY := $(BIN)/python
# Kernels run in Triton's interpreter when there is no GPU (set before triton is imported).
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
TEST_ENV :=
else
TEST_ENV := TRITON_INTERPRET=1
endif
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
NBDEV_WORKERS ?= 2

.PHONY: help setup install-torch demo test export check-sync check-clean readme check-readme nbtest pytest docs-check clean

help:
	@echo "make demo        set up, then run the main job on the shipped demo model"
	@echo "make test        set up, then check notebooks/library sync and run every test"
	@echo "make docs-check  render every notebook to HTML (no Quarto) and fail on any error"

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch first (the CPU build where there is no GPU), and only when none is installed.
setup: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(MAKE) --no-print-directory install-torch
	$(PY) -m pip install --quiet -e ".[dev]"

install-torch: $(PY)
ifeq ($(HAS_GPU),1)
	$(PY) -m pip install --quiet torch
else
	@if $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/', timeout=5)" >/dev/null 2>&1; then \
	  echo "installing the CPU build of torch"; $(PY) -m pip install --quiet torch --index-url $(TORCH_CPU_INDEX); \
	else \
	  echo "PyTorch's CPU index is unreachable: installing torch==2.13.0 (a CPU wheel from the configured index)"; \
	  $(PY) -m pip install --quiet torch==2.13.0; \
	fi
endif

demo: setup
	$(BIN)/hetero-infer demo

export:
	$(BIN)/nbdev_export

check-sync: export
	@test -z "$$(git status --porcelain -- hetero_infer)" || { git status --porcelain -- hetero_infer; \
	  echo "hetero_infer/ differs from what the notebooks export: edit nbs/, run nbdev_export, commit both"; exit 1; }

check-clean:
	$(BIN)/nbdev_clean
	@test -z "$$(git status --porcelain -- nbs)" || { git status --porcelain -- nbs; \
	  echo "notebooks are not clean (or not committed): run nbdev_clean and commit"; exit 1; }

readme:
	$(PY) .ci/readme.py

check-readme:
	$(PY) .ci/readme.py --check

nbtest:
	$(TEST_ENV) $(BIN)/nbdev_test --n_workers $(NBDEV_WORKERS) --timing

pytest:
	$(TEST_ENV) $(PY) -m pytest tests -q

test: setup check-sync check-clean check-readme nbtest pytest

docs-check: setup
	$(PY) .ci/docs_check.py

clean:
	rm -rf _docs _proc _site_check build dist *.egg-info
