#!/usr/bin/env bash
# The whole GPU validation of a commit in one device call on nvidia-h200-x2 (< 600 s): every
# one-GPU suite (split over the two GPUs), the two-GPU suites, the MPI checks and samples, the
# one-GPU benchmark and the EP = 2 benchmark.  At most 8 files come back from $OUT: the logs are
# p1_gpu0, p1_gpu1, p2, bench1, bench2 and the two results JSONs.  Summary last.
#   MOK_BENCH_COMMIT=<sha> bash scripts/gpu_x2.sh      (BENCH=0: the suites alone)
# On one GPU it runs phase 1 on it and the one-GPU benchmark; phase 2 and EP = 2 need two.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export OMPI_MCA_btl_vader_single_copy_mechanism=none PYTHONPATH="$PWD"
py="python3 -m pytest -q -s -rs --durations=8 -p no:cacheprovider"
shapes="${BENCH_SHAPES:-qwen3-30b-a3b,deepseek-v3,deepseek-v3-shared}"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
ngpu=$(nvidia-smi -L | wc -l); g1=$(( ngpu > 1 ? 1 : 0 ))

# 1. one-GPU suites, one GPU each.
{ nvidia-smi -L; echo "SASS moe_layer: HGMMA $(cuobjdump -sass mok_rt/cubins/moe_layer.sm_90a.cubin | grep -c HGMMA)" \
    "LDL/STL $(cuobjdump -sass mok_rt/cubins/moe_layer.sm_90a.cubin | grep -cE 'LDL|STL')"; } > "$out/p1_gpu0.txt" 2>&1
( export CUDA_VISIBLE_DEVICES=0
  timeout -k 5 "${P1_BUDGET:-240}" $py tests/test_moe_tma_gpu.py tests/test_moe_kernel_gpu.py tests/test_layer_gpu.py \
    tests/test_interop_gpu.py tests/test_dlpack_gpu.py tests/test_gemm_probe_gpu.py \
    tests/test_trace_gpu.py tests/test_graphs_gpu.py tests/test_torch_ops_gpu.py \
    >> "$out/p1_gpu0.txt" 2>&1; echo "rc=$?" >> "$out/p1_gpu0.txt" ) &
( export CUDA_VISIBLE_DEVICES=$g1
  timeout -k 5 "${P1_BUDGET:-240}" $py tests/test_ep_gpu.py tests/test_schedule_gpu.py tests/test_symmetric_gpu.py \
    > "$out/p1_gpu1.txt" 2>&1; echo "rc=$?" >> "$out/p1_gpu1.txt" ) &
wait
stamp "phase 1 done"

# 2. across both GPUs: symmetric memory and EP in both process models, MPI scripts, samples.
if [ "$ngpu" -ge 2 ]; then
  { timeout -k 5 "${P2_BUDGET:-150}" $py tests/test_symmetric_multigpu.py tests/test_ep_multigpu.py; echo "rc=$?"
    for s in mpi_symmetric_check mpi_ep_check; do
      echo "== mpirun -np 2 tests/$s.py"
      timeout -k 5 60 mpirun --allow-run-as-root -np 2 -x PYTHONPATH -x OMPI_MCA_btl_vader_single_copy_mechanism \
        python3 tests/$s.py; echo "rc=$?"
    done
    echo "== samples"
    timeout 60 python3 samples/train_moe.py --steps 8; echo "rc=$?"
    timeout 60 python3 samples/train_moe_ep.py --one-process --steps 5 --tokens 2048; echo "rc=$?"
    timeout 90 mpirun --allow-run-as-root -np 2 -x PYTHONPATH python3 samples/train_moe_ep.py --steps 5 --tokens 2048
    echo "rc=$?"; } > "$out/p2.txt" 2>&1
  stamp "phase 2 done"
fi

# 3. benchmarks against the PyTorch baseline in the same run: one GPU (pipelined, then the
#    serial latency of qwen3), then EP = 2 (one process per GPU).
if [ "${BENCH:-1}" != 0 ]; then
{ CUDA_VISIBLE_DEVICES=0 timeout -k 5 "${B1_BUDGET:-150}" python3 bench/bench_moe.py --shapes "$shapes" --out "$out"
  echo "rc=$?"; echo "== serial timing (host waits for each call)"
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 60 python3 bench/bench_moe.py --shapes qwen3-30b-a3b --timing serial \
    --out /tmp/mok_serial; echo "rc=$?"; } > "$out/bench1.txt" 2>&1
stamp "bench 1 done"
if [ "$ngpu" -ge 2 ]; then
  timeout -k 5 "${B2_BUDGET:-180}" python3 -m torch.distributed.run --nproc-per-node=2 bench/bench_moe.py \
    --shapes "$shapes" --out "$out" > "$out/bench2.txt" 2>&1; echo "rc=$?" >> "$out/bench2.txt"
  stamp "bench 2 done"
fi
fi

for f in p1_gpu0 p1_gpu1 p2; do
  [ -f "$out/$f.txt" ] || continue
  echo "== $f"; grep -E "^(FAILED|ERROR)|SASS|== |passed|failed|ALL|FAIL|rc=" "$out/$f.txt" | tail -14
done
for f in bench1 bench2; do
  [ -f "$out/$f.txt" ] && { echo "== $f"; grep -E "^[a-z0-9-]+ +[0-9]|rc=|Error" "$out/$f.txt" | tail -8; }
done
