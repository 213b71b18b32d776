#!/usr/bin/env bash
# Issue 35's measurement on the lent GPU machine (no network; wheels in .whl/ from scripts/gpu_wheels.sh),
# in one call that fits a session's device time (15 min, the machine's start included):
# benchmarks/bench_train_gpu.py over BENCH_CASES (default: its default cases, most wanted first) within
# BENCH_SECONDS (cases that would not fit are listed as not run), then the tests only a GPU runs for the
# training kernels and Megatron-core, the frozen reference's and the parked policy's on one GPU, in the time left of
# TOTAL_SECONDS, and last, where 90 s are left, what parking costs beside a step (benchmarks/bench_parking.py,
# its table in bench.log). The table goes to
# OUT_DIR/train_gpu*.md as each case ends, the runs' JSON to $OUT/train_gpu.json, the profiled steps of
# fixed-compile, packed-compile and megatron-packed-compile as gzipped Chrome traces ($OUT/trace_*.json.gz; with
# the breakdown's plot train_gpu.png, 8 files in all, as many as the device tool brings back; the machine, the
# bench's and the tests' output in bench.log and gpu_tests.log)
# (`python benchmarks/bench_train_gpu.py --plot-from <it>` draws the time breakdown where matplotlib is);
# the report charges the traced cases' idle stretches to what the host ran then (BENCH_TRACE_STACKS=1: located
# by Python frames, slower).
#   scripts/gpu_bench.sh [OUT_DIR]
# On the device tool: command `scripts/gpu_bench.sh "$OUT"`, carry [".whl"], timeout_s 540. A dry run of the
# script here: NOVARL_GPU_ENV=1 BENCH_ARGS=--tiny TOTAL_SECONDS=240 scripts/gpu_bench.sh /tmp/gpu-dry-run
# One H100 took ~40-60 s a case (each compiles; the variable-length ones longest).
set -uo pipefail
out=${1:-${OUT:-gpu-bench}}
mkdir -p "$out"
if [ -z "${NOVARL_GPU_ENV:-}" ]; then NOVARL_GPU_ENV=1 exec scripts/gpu_env.sh bash "$0" "$out"; fi
total=${TOTAL_SECONDS:-500}  # of the call's 540 s: the wheels' install before this line takes ~10-30 s
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/bench.log"
cases=${BENCH_CASES:-}
report="$out/train_gpu.md"
[ -e "$report" ] && report="$out/train_gpu_$(date +%H%M%S).md"  # a second call keeps the first's table
python3 benchmarks/bench_train_gpu.py --out "$report" --budget "${BENCH_SECONDS:-$((total - 120))}" \
    ${cases:+--cases "$cases"} ${BENCH_ARGS:-} 2>&1 | tail -n 80 | tee -a "$out/bench.log"
left=$((total - SECONDS - 5))
if [ -z "${SKIP_TESTS:-}" ] && [ "$left" -gt 30 ]; then
    # SIGINT at the limit: pytest still prints what failed; the CPU-only policy tests of test_training_kernels.py
    # (a CPU model on a one-rank group that is NCCL on a CUDA host) are left to CI
    timeout -s INT -k 15 "$left" python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider -p no:warnings \
        -k "not learns_the_bundled_task and not generation_on_the_gpu and not context_parallelism and not \
            one_data_parallel_shard and not optimizer_step_is_queued and not (one_device and cpu) and not \
            lora_and_activation_checkpointing and not (deepspeed_compiled and cpu) and not two_ranks" \
        tests/test_training_kernels.py tests/test_megatron_gpu.py tests/test_frozen_reference.py \
        tests/test_parking.py::test_parking_frees_the_gpu_memory_of_a_policy_and_it_trains_on \
        tests/test_weight_sync.py::test_the_host_arena_pins_its_buffers_on_a_gpu_host 2>&1 | tail -n 60 \
        | tee "$out/gpu_tests.log"
else
    echo "GPU tests not run: ${left} s left" | tee "$out/gpu_tests.log"
fi
# what parking costs beside a training step (benchmarks/bench_parking.py), when a minute and a half is left
left=$((total - SECONDS - 5))
if [ -z "${SKIP_PARKING:-}" ] && [ "$left" -gt 90 ]; then
    # (its table into bench.log: the device tool brings 8 files back, and the run writes 8 already)
    case "${BENCH_ARGS:-}" in *--tiny*) parking_args=--tiny ;; *) parking_args= ;; esac  # (the dry run's)
    timeout -s INT -k 10 "$left" python3 benchmarks/bench_parking.py $parking_args 2>&1 | tail -n 12 \
        | tee -a "$out/bench.log"
else
    echo "parking not measured: ${left} s left" | tee -a "$out/bench.log"
fi
