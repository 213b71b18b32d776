#!/usr/bin/env bash
# Issue 35's measurement in one call on the lent GPU machine (no network; wheels in .whl/ from
# scripts/gpu_wheels.sh): the tests only a GPU runs for the training kernels and Megatron-core, then
# benchmarks/bench_train_gpu.py over its default cases (or BENCH_CASES), the table written to OUT_DIR.
#   scripts/gpu_bench.sh [OUT_DIR]          # ~8-9 minutes on one H100
set -uo pipefail
out=${1:-${OUT:-gpu-bench}}
mkdir -p "$out"
if [ -z "${NOVARL_GPU_ENV:-}" ]; then NOVARL_GPU_ENV=1 exec scripts/gpu_env.sh bash "$0" "$out"; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/machine.txt"
timeout "${TEST_SECONDS:-150}" python3 -m pytest -q -rs -p no:cacheprovider -k "not learns_the_bundled_task" \
    tests/test_training_kernels.py tests/test_megatron_gpu.py 2>&1 | tail -n 40 | tee "$out/gpu_tests.log"
cases=${BENCH_CASES:-}
timeout "${BENCH_SECONDS:-420}" python3 benchmarks/bench_train_gpu.py --out "$out/train_gpu.md" \
    ${cases:+--cases "$cases"} 2>&1 | tail -n 80 | tee "$out/bench.log"
