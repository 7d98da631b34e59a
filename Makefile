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

.PHONY: help setup install-torch demo test export lint check-sync check-clean readme check-readme nbtest pytest docs-check clean mutation

help:
	@echo "make demo        set up, then run the main job on the shipped demo model"
	@echo "make test        set up, then check notebooks/library sync, lint, and run every test"
	@echo "make export      nbdev_export, then ruff format the generated modules (use it instead of nbdev_export)"
	@echo "make lint        ruff format --check and ruff check over nbs/, hetero_infer/, tests/, .ci/"
	@echo "make docs-check  render every notebook to HTML (no Quarto) and fail on any error"
	@echo "make mutation    mutation-test the core modules (slow; not part of make test);"
	@echo "                 MUTATION_MODULES=\"structured quant\": groups (Makefile) or modules"

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

# nbdev_export through .ci/export.py, which lets a notebook export several fresh modules
# (`#| export layers`); nbdev writes `__all__` 120 columns wide, so ruff formats the generated modules
# as it formats the notebooks.
export:
	$(PY) .ci/export.py
	$(BIN)/ruff format --quiet hetero_infer

# ruff (rules in pyproject.toml): every notebook, module, test and CI script formatted and checked.
lint:
	$(BIN)/ruff format --check --quiet nbs hetero_infer tests .ci || { echo "run: $(BIN)/ruff format nbs tests .ci && make export"; exit 1; }
	$(BIN)/ruff check --quiet nbs hetero_infer tests .ci

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

# One torch thread per notebook-test worker: NBDEV_WORKERS workers each running torch's default (one thread per core)
# oversubscribe the cores and make the run slower, not faster.
NB_THREADS ?= 1
nbtest:
	$(TEST_ENV) OMP_NUM_THREADS=$(NB_THREADS) MKL_NUM_THREADS=$(NB_THREADS) $(BIN)/nbdev_test --n_workers $(NBDEV_WORKERS) --timing

# pytest-xdist: PYTEST_WORKERS processes, one torch thread each (as for the notebooks).
PYTEST_WORKERS ?= 2
pytest:
	$(TEST_ENV) OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest tests -q -n $(PYTEST_WORKERS) --durations=15

test: setup check-sync check-clean check-readme lint nbtest pytest

# mutmut 3 (config in setup.cfg), module by module, niced; results accumulate in mutants/ (git-ignored), each run's log
# in mutants/run-MODULE.log. Fails when mutmut fails. Score per module = killed / mutants checked (killed, survived,
# timeout, suspicious, segfault); "no tests" (no selected test calls the function) and "not checked" are counted apart.
# MUTATION_MODULES names modules (engine.llm_engine) or groups of them (below); default: core.
MUTATION_GROUP_core := kv_cache.block_manager kv_cache.prefix_cache scheduler.scheduler \
  scheduler.output scheduler.admission sample.sampler sample.penalties engine.llm engine.llm_engine \
  engine.output_processor engine.request_state engine.prompt_logprobs engine.plugins \
  engine.tokenization core.sampling_params core.sequence core.outputs core.config
MUTATION_GROUP_spec_decode := spec_decode.speculator spec_decode.proposers
MUTATION_GROUP_parallel := parallel.runner parallel.shards
MUTATION_GROUP_structured := structured.tool_calls structured.grammar structured.openai \
  structured.plugin structured.cli
MUTATION_GROUP_quant := quant.checkpoints quant.int8_matmul quant.quantize quant.plugin quant.kernels
MUTATION_GROUP_moe := moe.kernels moe.model moe.parallel moe.layer
MUTATION_GROUP_kv_offload := kv_offload.swap kv_offload.host_pool kv_offload.prefix_tier kv_offload.bench \
  kv_offload.block_manager kv_offload.scheduler kv_offload.tier kv_offload.plugin
MUTATION_LATER_GROUPS := spec_decode parallel structured quant moe kv_offload
MUTATION_GROUP_later := $(foreach g,$(MUTATION_LATER_GROUPS),$(MUTATION_GROUP_$(g)))
MUTATION_MODULES ?= core
MUTATION_LIST := $(foreach m,$(MUTATION_MODULES),$(or $(MUTATION_GROUP_$(m)),$(m)))
mutation: setup
	@mkdir -p mutants; for m in $(MUTATION_LIST); do echo "== mutating hetero_infer.$$m (log: mutants/run-$$m.log)"; \
	  CI=true OMP_NUM_THREADS=1 $(TEST_ENV) nice -n 19 $(BIN)/mutmut run --max-children 2 "hetero_infer.$$m.*" \
	    >mutants/run-$$m.log 2>&1 || { tr '\r' '\n' <mutants/run-$$m.log | tail -40; echo "mutmut run failed for $$m"; exit 1; }; \
	  echo "mutmut's summary (checked/total over all modules  killed no-tests timeout suspicious survived skipped type-check):"; \
	  tr '\r' '\n' <mutants/run-$$m.log | grep -E '[0-9]+/[0-9]+ +🎉|mutations/second' | tail -2; done
	@$(BIN)/mutmut results --all true >mutants/results.txt || { echo "mutmut results failed"; exit 1; }
	@for m in $(MUTATION_LIST); do awk -v m="hetero_infer.$$m." 'index($$1,m)==1 { st=$$0; sub(/^[^:]*: /,"",st); c[st]++ } \
	  END { chk=c["killed"]+c["survived"]+c["timeout"]+c["suspicious"]+c["segfault"]; \
	    printf "%s: %d/%d checked mutants killed (%.1f%%)  survived %d  timeout %d  suspicious %d  segfault %d | no tests %d  not checked %d  skipped %d\n", \
	      substr(m,1,length(m)-1), c["killed"], chk, chk ? 100*c["killed"]/chk : 0, c["survived"], c["timeout"], c["suspicious"], \
	      c["segfault"], c["no tests"], c["not checked"], c["skipped"] }' mutants/results.txt; done
	@echo "== mutants not killed in these modules (inspect one with: $(BIN)/mutmut show NAME)"; \
	  for m in $(MUTATION_LIST); do grep -F "hetero_infer.$$m." mutants/results.txt | grep -Ev ': (killed|not checked)$$' || true; done

docs-check: setup
	$(PY) .ci/docs_check.py

clean:
	rm -rf _docs _proc _site_check build dist *.egg-info
