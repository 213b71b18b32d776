#!/usr/bin/env bash
# On the GPU host (no network; PyTorch installed): install the wheels carried in .whl/ (see
# scripts/gpu_wheels.sh) into /tmp/site, set the environment novarl's tests expect, and run "$@".
#   scripts/gpu_env.sh python3 -m pytest -q tests/test_ppo.py
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch-ext RAY_AUTH_MODE=disabled
export HF_HUB_OFFLINE=1 NOVARL_CACHE_DIR=/tmp/novarl-cache
exec "$@"
