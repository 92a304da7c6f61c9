#!/usr/bin/env bash
# What only a GPU can check, in one command and under 8 minutes on one H200 (each phase has its own
# budget; a phase that fails or runs out of time does not stop the others, and the exit status says
# whether all passed):
#   1. GRPO (240 s): bf16 update-phase MFU, decode tokens/s, weight-sync GB/s next to a
#      device-to-device copy of the same bytes (bench_gpu.py; [bench_gpu.py flags] go here)
#   1b. the update four ways (60 s): MFU with and without the chunked LM head, padded rows or
#      packed (padding_free)
#   2. the weight-broadcast group on NCCL (30 s): a 256 MiB wire-layout bucket, bit-exact, GB/s
#      with two GPUs (one GPU: a one-member group; NCCL takes a GPU per member)
#   3. the engines (vLLM, SGLang: 60 s each) where installed: greedy n > 1, stop tokens, seeds,
#      sleep(1)/sleep(2) then update then generate. Their wheels (vLLM 336 MB; SGLang 39 MB plus
#      its kernels) are larger than a run can carry, so a machine without them skips this phase.
# Uses what that machine has (torch, transformers; no Ray or datasets) and this checkout's code,
# not installed.
#
#   bash tests/benchmarks/gpu.sh --fetch-wheels   # here, once: tensordict's and megatron-core's Python 3.12
#                                                 # wheels into tests/benchmarks/wheels/
#   bash tests/benchmarks/gpu.sh [bench_gpu.py flags]   # there, with tests/benchmarks/wheels carried
#   bash tests/benchmarks/gpu.sh --strategy megatron --steps 3   # megatron-core's GPU path (no TE needed)
set -uo pipefail
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
RESULTS="${OUT:-tests/benchmarks/results}"  # on a lent machine, what is written under $OUT comes back
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
failed=()
phase() {  # phase NAME SECONDS COMMAND...
  local name=$1 budget=$2 start=$SECONDS rc
  shift 2
  echo "== $name (budget ${budget} s)"
  timeout "$budget" "$@"
  rc=$?
  echo "== $name: rc $rc after $((SECONDS - start)) s$([ "$rc" = 124 ] && echo ' (out of time)')"
  [ "$rc" = 0 ] || failed+=("$name")
}
phase grpo 240 python3 tests/benchmarks/bench_gpu.py --out "$RESULTS/gpu.json" "$@"
phase update 60 python3 tests/benchmarks/bench_gpu.py --check update --prompts 16 --out "$RESULTS/gpu_update.json"
phase weight-group 30 python3 tests/benchmarks/bench_gpu.py --check weight-group --out "$RESULTS/gpu_weight_group.json"
for engine in vllm sglang; do
  phase "engine-$engine" 60 python3 tests/benchmarks/bench_gpu.py --check engines --engines "$engine" \
    --out "$RESULTS/gpu_engine_$engine.json"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "all GPU checks passed"
