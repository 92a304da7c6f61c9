#!/usr/bin/env bash
# GRPO on a lent GPU machine in one command (under 8 minutes on one H200): update-phase MFU,
# decode tokens/s, weight-sync GB/s next to a device-to-device copy. Uses what that machine has
# (torch, transformers; no Ray, vLLM or datasets) and this checkout's code, not installed.
#
#   bash tests/benchmarks/gpu.sh --fetch-wheels   # here, once: tensordict's and megatron-core's Python 3.12
#                                                 # wheels into tests/benchmarks/wheels/
#   bash tests/benchmarks/gpu.sh [bench_gpu.py flags]   # there, with tests/benchmarks/wheels carried
#   bash tests/benchmarks/gpu.sh --strategy megatron --steps 3   # megatron-core's GPU path (no TE needed)
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = "--fetch-wheels" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    -d tests/benchmarks/wheels tensordict==0.15.3 pyvers==0.2.3 megatron-core==0.16.1
  ls tests/benchmarks/wheels
  exit 0
fi
if ! python3 -c "import tensordict, megatron.core" 2>/dev/null; then
  if ls tests/benchmarks/wheels/tensordict-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site tests/benchmarks/wheels/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
  else
    echo "tensordict is not installed here and tests/benchmarks/wheels/ holds no wheel of it: run 'bash tests/benchmarks/gpu.sh --fetch-wheels' where pip works and carry tests/benchmarks/wheels" >&2
    exit 2
  fi
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
timeout 480 python3 tests/benchmarks/bench_gpu.py "$@"
