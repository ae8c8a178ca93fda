#!/usr/bin/env bash
# The fp8_block forward (issue 18 step 2) on the GPU in one device call: its GPU tests (the probe's
# engine and quantisers first: they isolate a broken building block), the bf16 layer tests (the
# bf16 path must be unchanged), then the fp8-vs-bf16 forward timing.  Logs under $OUT; a short
# summary last.        bash scripts/gpu_fp8.sh [pytest budget in seconds]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."; out="${OUT:-gpu_logs}"; mkdir -p "$out"
PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/.whl" python3 -m pip install -q -e '.[test]' > "$out/install.txt" 2>&1
echo "install rc=$?" >> "$out/install.txt"
timeout "${1:-360}" python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_fp8_gemm_probe_gpu.py \
    tests/test_fp8_forward_gpu.py tests/test_layer_gpu.py tests/test_moe_tma_gpu.py > "$out/pytest.txt" 2>&1
echo "pytest rc=$?" >> "$out/pytest.txt"
timeout 150 python3 bench/bench_fp8_forward.py --iters 10 > "$out/bench_fp8.txt" 2>&1
echo "bench rc=$?" >> "$out/bench_fp8.txt"
echo "== install"; tail -1 "$out/install.txt"
echo "== pytest"; grep -E "^(FAILED|ERROR)|FP8ERR|passed|failed|rc=|GPU tests" "$out/pytest.txt" | tail -40
echo "== bench"; tail -6 "$out/bench_fp8.txt"
