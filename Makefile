# The two commands of the README:
#   make run    set up .venv (with vLLM's CPU build if the resolved config runs vLLM on a machine without CUDA)
#               and run the main job on its default config
#   make test   set up .venv (with vLLM's CPU build) and run the whole test suite: what CI runs
# and, for iteration: make test-fast (no torchrun world, no vLLM, no real weights; docs/testing.md)
# and, for benchmarks/bench_vs_trl.py only: make setup-bench (.venv-bench: .venv plus TRL)
CONFIG ?= configs/default.yaml
PY := .venv/bin/python
STAMP := .venv/.installed
VLLM_STAMP := .venv/.vllm-installed
BENCH_STAMP := .venv-bench/.installed

.PHONY: setup setup-vllm setup-bench run test test-fast

$(STAMP): setup.py constraints.txt requirements-cpu.txt tools/setup_env.sh
	bash tools/setup_env.sh
	touch $(STAMP)

$(VLLM_STAMP): $(STAMP)
	bash tools/setup_env.sh --with-vllm
	touch $(VLLM_STAMP)

setup: $(STAMP)

setup-vllm: $(VLLM_STAMP)

# TRL for benchmarks/bench_vs_trl.py, in its own .venv-bench (never a dependency of the package)
$(BENCH_STAMP): $(STAMP)
	bash tools/setup_env.sh --with-bench
	touch $(BENCH_STAMP)

setup-bench: $(BENCH_STAMP)

# vLLM follows the resolved config (its base: files and the --set of ARGS included), not the file's text:
# `python -m hacpo_megatron.config --engines` names the engines the run starts. With a vllm engine, a machine without
# CUDA gets vLLM's CPU build first (make setup-vllm); a CUDA machine needs vLLM's CUDA build, which make does not
# install: there, with vLLM missing, it prints the pip line and stops. (SUBMAKE, not $(MAKE): `make -n run` would
# run a line that names $(MAKE).)
SUBMAKE := $(MAKE)
HAS_CUDA := import sys, torch; sys.exit(not torch.cuda.is_available())
HAS_VLLM := import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)

run: $(STAMP)
	@engines=$$($(PY) -m hacpo_megatron.config --config $(CONFIG) $(ARGS) --engines) || exit $$?; \
	echo "engines of this run: $$(echo $$engines)"; \
	if echo "$$engines" | grep -qx vllm; then \
	  if ! $(PY) -c '$(HAS_CUDA)'; then $(SUBMAKE) --no-print-directory setup-vllm || exit $$?; \
	  elif ! $(PY) -c '$(HAS_VLLM)'; then \
	    echo "this config runs vLLM on a CUDA machine: install vLLM's CUDA build (make setup-vllm is the CPU one):" >&2; \
	    echo "  .venv/bin/python -m pip install -e '.[vllm]'    (README.md: Quick start, on a GPU)" >&2; exit 1; \
	  fi; \
	fi
	$(PY) -m hacpo_megatron.launch --config $(CONFIG) $(ARGS)

# Two tests at a time, on 2 pytest-xdist workers: a whole file (or xdist_group) per worker at a time, the heavy
# ones first (tests/conftest.py, docs/testing.md). In one process, as before: make test XDIST= (or PYTEST_ARGS=-n0).
XDIST ?= -n 2 --dist loadgroup

# every run shows where its time goes: the 15 slowest tests
test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q tests $(XDIST) --durations=15 $(PYTEST_ARGS)

# the fast tier: algorithms, config, bridge, rewards, data, reporting, ... in minutes
FAST := not slow and not distributed and not vllm and not real_weights
test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "$(FAST)" $(XDIST) --durations=10 $(PYTEST_ARGS)
