#!/usr/bin/env bash
# Issue 35's measurement on the lent GPU machine (no network; wheels in .whl/ from scripts/gpu_wheels.sh):
# the tests only a GPU runs for the training kernels and Megatron-core, then benchmarks/bench_train_gpu.py
# over BENCH_CASES (default: all its default cases), the table written to OUT_DIR/train_gpu*.md (and the
# runs' JSON to $OUT/train_gpu.json: `python benchmarks/bench_train_gpu.py --plot-from <it>` draws the
# time breakdown where matplotlib is, if the GPU host has none).
#   scripts/gpu_bench.sh [OUT_DIR]
# One H100 takes ~40-60 s a case (each compiles, the variable-length ones longest), more than one 600 s
# call holds with the tests, so split it (the machine stays warm between calls made at once):
#   BENCH_CASES=plain,fixed-compile,fixed-compile+eager-head,packed-compile,packed-compile+cudnn-varlen,\
#   var-packed-compile,var-packed-compile+cudnn-varlen scripts/gpu_bench.sh "$OUT"
#   SKIP_TESTS=1 BENCH_CASES=megatron,megatron-packed,megatron-packed+compile-layers,var-megatron-packed,\
#   packed-compile+padded-attention \
#   scripts/gpu_bench.sh "$OUT"
set -uo pipefail
out=${1:-${OUT:-gpu-bench}}
mkdir -p "$out"
if [ -z "${NOVARL_GPU_ENV:-}" ]; then NOVARL_GPU_ENV=1 exec scripts/gpu_env.sh bash "$0" "$out"; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/machine.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout "${TEST_SECONDS:-150}" python3 -m pytest -q -rs -p no:cacheprovider -k "not learns_the_bundled_task" \
        tests/test_training_kernels.py tests/test_megatron_gpu.py 2>&1 | tail -n 40 | tee "$out/gpu_tests.log"
fi
cases=${BENCH_CASES:-}
report="$out/train_gpu.md"
[ -e "$report" ] && report="$out/train_gpu_$(date +%H%M%S).md"  # a second call keeps the first's table
timeout "${BENCH_SECONDS:-420}" python3 benchmarks/bench_train_gpu.py --out "$report" \
    ${cases:+--cases "$cases"} 2>&1 | tail -n 80 | tee "$out/bench.log"
