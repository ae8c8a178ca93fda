#!/usr/bin/env bash
# Validation of the TMA + wgmma engine (engine "tma", cuda_src/moe/moe_layer_tma.cu) in one device
# call on one H200 (< 600 s): its own tests, the one-GPU suites re-run on it, a regression pass
# of the default engine, then the benchmark on the new engine.  Logs + results JSON under $OUT.
#   MOK_BENCH_COMMIT=<sha> bash scripts/gpu_tma.sh [bench shapes]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$(dirname "$0")/.."; export PYTHONPATH="$PWD"; out="${OUT:-gpu_logs}"; mkdir -p "$out"
py() { python3 -m pytest -q -s -rs -p no:cacheprovider "$@"; }
suite="tests/test_moe_kernel_gpu.py tests/test_layer_gpu.py tests/test_ep_gpu.py tests/test_interop_gpu.py"

# 1. the engine's own tests (explicit engine="tma"; also compares it with "tile")
timeout "${TMA_BUDGET:-150}" py tests/test_moe_tma_gpu.py > "$out/tma_tests.txt" 2>&1
echo "rc=$?" >> "$out/tma_tests.txt"
# 2. the existing one-GPU suites, unchanged, on the new engine
MOK_RT_GEMM_ENGINE=tma timeout "${SUITE_BUDGET:-150}" py $suite > "$out/suite_tma.txt" 2>&1
echo "rc=$?" >> "$out/suite_tma.txt"
# 3. the default engine after the shared-header changes (workers, split waits)
timeout "${REGRESS_BUDGET:-60}" py tests/test_moe_kernel_gpu.py tests/test_ep_gpu.py > "$out/suite_tile.txt" 2>&1
echo "rc=$?" >> "$out/suite_tile.txt"
# 4. benchmark on the new engine against the PyTorch baseline in the same run
timeout "${BENCH_BUDGET:-210}" python3 bench/bench_moe.py --engine tma \
    --shapes "${1:-qwen3-30b-a3b,deepseek-v3,deepseek-v3-shared}" --out "$out" > "$out/bench.txt" 2>&1
echo "rc=$?" >> "$out/bench.txt"

for f in tma_tests suite_tma suite_tile; do
  echo "== $f"; grep -E "^(FAILED|ERROR)|ENGINE|passed|failed|error word|rc=" "$out/$f.txt" | tail -12
done
echo "== bench (tma)"; tail -8 "$out/bench.txt"
