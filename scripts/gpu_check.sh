#!/usr/bin/env bash
# The test suite on a CUDA host that has PyTorch but none of novarl's other needs and no network
# (the GPU machine some sessions are lent). Wheels for Python 3.12 come in .whl/ (scripts/gpu_wheels.sh
# downloads them where pip works); Ray and vLLM are too large to carry, so their tests skip.
#   scripts/gpu_check.sh [OUT_DIR] [pytest arguments...]
# First the tests that only a GPU runs, then the whole suite on CUDA (every backend picks the GPU
# when there is one: bf16 by default, NCCL process groups, Megatron-core without its CPU emulation).
set -uo pipefail
out=${1:-gpu-check}; shift || true
mkdir -p "$out"
if [ -z "${NOVARL_GPU_ENV:-}" ]; then NOVARL_GPU_ENV=1 exec scripts/gpu_env.sh bash "$0" "$out" "$@"; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/machine.txt"
python3 - <<'EOF' | tee -a "$out/machine.txt"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for name in ("transformers", "pydantic", "megatron.core", "deepspeed", "peft", "datasets", "math_verify"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:  # noqa: BLE001 (a report of what is there)
        print(name, "missing:", type(error).__name__, error)
EOF
gpu_tests="tests/test_megatron_gpu.py tests/test_gpu_monitor.py"
timeout 220 python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$out/gpu_tests.xml" $gpu_tests "$@" 2>&1 | tee "$out/gpu_tests.log"
timeout "${SUITE_SECONDS:-330}" python3 -m pytest -q -rfEs -p no:cacheprovider -n "${WORKERS:-12}" --dist loadfile \
    --timeout 240 --junitxml="$out/suite.xml" tests --ignore tests/test_megatron_gpu.py "$@" 2>&1 | tail -n 400 | tee "$out/suite.log"
