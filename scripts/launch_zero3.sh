#!/usr/bin/env bash
# GRPO with DeepSpeed ZeRO-3 and optimizer + parameter offload to the CPU.
#
#   scripts/launch_zero3.sh CONFIG.yaml [key.path=value ...]
#
# When (NovaRL seed 004): the GPUs are memory-constrained even with ZeRO-3 or FSDP2
# sharding. The optimizer state and step (DeepSpeed's CPU Adam) and the parameters live in
# CPU memory and stream to the GPUs layer by layer. Keep gradient accumulation modest:
# each optimizer step runs on the CPU. `novarl plan -c CONFIG.yaml` shows whether plain
# ZeRO-3 would fit instead.
#
# The first run builds DeepSpeed's CPU Adam C++ op (30-45 s on 2 cores, progress shown),
# cached in $NOVARL_CACHE_DIR/torch_extensions (default ~/.cache/novarl). Several nodes:
# start Ray on each and set RAY_ADDRESS, as the README shows.
set -euo pipefail
if [[ $# -lt 1 ]]; then
    echo "usage: $0 CONFIG.yaml [key.path=value ...]" >&2
    exit 2
fi
config=$1
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
novarl=${NOVARL:-$(command -v novarl || echo "$here/.venv/bin/novarl")}
exec "$novarl" train -c "$config" --preset zero3-offload "$@"
