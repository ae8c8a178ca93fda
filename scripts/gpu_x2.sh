#!/usr/bin/env bash
# One device call on nvidia-h200-x2 that validates a commit: the one-GPU suites on both engines in
# parallel (one GPU each), then the two-GPU suites and MPI checks, then the one-GPU benchmark.
# Logs and results JSON under $OUT; a short summary last.
#   MOK_BENCH_COMMIT=<sha> bash scripts/gpu_x2.sh [engine for the bench: tma|tile]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false OMPI_MCA_btl_vader_single_copy_mechanism=none
cd "$(dirname "$0")/.."; export PYTHONPATH="$PWD"; out="${OUT:-gpu_logs}"; mkdir -p "$out"
engine="${1:-tma}"
py="python3 -m pytest -q -s -rs --durations=12 -p no:cacheprovider"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi -L > "$out/gpus.txt"; ngpu=$(wc -l < "$out/gpus.txt")
{ cuobjdump -sass mok_rt/cubins/moe_layer_tma.sm_90a.cubin | grep -cE "HGMMA" ;
  cuobjdump -sass mok_rt/cubins/moe_layer_tma.sm_90a.cubin | grep -cE "LDL|STL" ; } > "$out/sass.txt" 2>&1

# 1. one-GPU suites, one GPU each, in parallel.  GPU 0: the TMA engine; GPU 1: EP (ranks share it).
stamp "phase 1"
( export CUDA_VISIBLE_DEVICES=0
  timeout -k 5 "${TMA_BUDGET:-150}" $py tests/test_moe_tma_gpu.py > "$out/tma_tests.txt" 2>&1
  echo "rc=$?" >> "$out/tma_tests.txt"
  MOK_RT_GEMM_ENGINE=tma timeout -k 5 "${SUITE_BUDGET:-150}" $py tests/test_moe_kernel_gpu.py tests/test_layer_gpu.py \
    tests/test_interop_gpu.py > "$out/suite_tma.txt" 2>&1
  echo "rc=$?" >> "$out/suite_tma.txt" ) &
( export CUDA_VISIBLE_DEVICES="$(( ngpu > 1 ? 1 : 0 ))"
  timeout -k 5 "${EP_BUDGET:-300}" $py tests/test_ep_gpu.py tests/test_schedule_gpu.py > "$out/ep.txt" 2>&1
  echo "rc=$?" >> "$out/ep.txt" ) &
wait
stamp "phase 1 done"
# 2. across both GPUs: symmetric memory and EP, both process models, and the MPI scripts; on the
#    TMA engine when phase 1 passed it, else on the default engine.
if [ "$ngpu" -ge 2 ]; then
  if grep -q "^rc=0" "$out/tma_tests.txt" && grep -q "^rc=0" "$out/suite_tma.txt"; then
    export MOK_RT_GEMM_ENGINE=tma; fi
  echo "multigpu engine: ${MOK_RT_GEMM_ENGINE:-default}" > "$out/multigpu_engine.txt"
  timeout -k 5 "${MULTI_BUDGET:-200}" $py tests/test_symmetric_multigpu.py tests/test_ep_multigpu.py \
    > "$out/multigpu.txt" 2>&1
  echo "rc=$?" >> "$out/multigpu.txt"
  for s in mpi_symmetric_check mpi_ep_check; do
    timeout -k 5 60 mpirun --allow-run-as-root -np 2 -x PYTHONPATH -x OMPI_MCA_btl_vader_single_copy_mechanism \
      python3 tests/$s.py > "$out/$s.txt" 2>&1; echo "rc=$?" >> "$out/$s.txt"
  done
  stamp "phase 2 done"
fi
# 3. the one-GPU benchmark against the PyTorch baseline in the same run (BENCH=0: skip).
if [ "${BENCH:-1}" = 1 ]; then
  timeout -k 5 "${BENCH_BUDGET:-200}" python3 bench/bench_moe.py --engine "$engine" \
    --shapes "${BENCH_SHAPES:-qwen3-30b-a3b,deepseek-v3,deepseek-v3-shared}" --out "$out" > "$out/bench.txt" 2>&1
  echo "rc=$?" >> "$out/bench.txt"
fi
stamp "phase 3 done"

cat "$out/multigpu_engine.txt" 2>/dev/null
echo "== GPUs: $ngpu; SASS HGMMA / LDL+STL counts: $(tr '\n' ' ' < "$out/sass.txt")"
for f in tma_tests suite_tma ep multigpu mpi_symmetric_check mpi_ep_check; do
  [ -f "$out/$f.txt" ] || continue
  echo "== $f"; grep -E "^(FAILED|ERROR)|ENGINE|passed|failed|PASS|FAIL|rc=" "$out/$f.txt" | tail -10
done
[ -f "$out/bench.txt" ] && { echo "== bench ($engine)"; tail -8 "$out/bench.txt"; }
