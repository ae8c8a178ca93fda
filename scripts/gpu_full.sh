#!/usr/bin/env bash
# The whole GPU validation of a commit in one device call: every GPU test, the samples, the
# benchmark.  Logs and the results JSON under $OUT; a short summary last.
#   bash scripts/gpu_full.sh [bench shapes]      (MOK_BENCH_COMMIT names the commit: no .git there)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$(dirname "$0")/.."; export PYTHONPATH="$PWD"; out="${OUT:-gpu_logs}"; mkdir -p "$out"
ngpu=$(nvidia-smi -L | wc -l)
tests=$(ls tests/test_*gpu*.py); [ "$ngpu" -ge 2 ] && tests="$tests $(ls tests/test_*multigpu*.py)"
timeout "${PYTEST_BUDGET:-330}" python3 -m pytest -q -s -rs -p no:cacheprovider $tests > "$out/pytest.txt" 2>&1
echo "pytest rc=$?" >> "$out/pytest.txt"
{ timeout 60 python3 samples/train_moe.py --steps 8; timeout 60 python3 samples/train_moe_ep.py --one-process \
    --ranks-per-gpu 2 --steps 5 --tokens 2048; timeout 90 mpirun --allow-run-as-root -np 2 -x PYTHONPATH \
    python3 samples/train_moe_ep.py --steps 5 --tokens 2048; } > "$out/samples.txt" 2>&1
timeout "${BENCH_BUDGET:-200}" python3 bench/bench_moe.py --shapes "${1:-qwen3-30b-a3b,deepseek-v3,deepseek-v3-shared}" \
    --out "$out" > "$out/bench.txt" 2>&1
echo "== GPUs: $ngpu"; grep -E "^[a-z0-9_]+: out=|EP=2 vs|ep2|PASS|FAIL" "$out/pytest.txt" | head -30
grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$out/pytest.txt" | tail -25
echo "== samples"; grep -E "step|loss|rank|Error|error" "$out/samples.txt" | tail -14
echo "== bench"; tail -6 "$out/bench.txt"
