# The two commands of the README:
#   make run    set up .venv and run the main job on its default config
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

# a config with a vLLM engine gets vLLM's CPU build first (make setup-vllm)
NEEDS_VLLM := $(shell grep -qE '^[^#]*engine:[[:space:]]*vllm' $(CONFIG) 2>/dev/null && echo yes)

run: $(STAMP) $(if $(NEEDS_VLLM),$(VLLM_STAMP))
	$(PY) -m hacpo_megatron.launch --config $(CONFIG) $(ARGS)

# every run shows where its time goes: the 15 slowest tests
test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q tests --durations=15 $(PYTEST_ARGS)

# the fast tier: algorithms, config, bridge, rewards, data, reporting, ... in minutes
FAST := not slow and not distributed and not vllm and not real_weights
test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "$(FAST)" --durations=10 $(PYTEST_ARGS)
