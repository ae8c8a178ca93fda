#!/usr/bin/env bash
# The fp8_block engine, forward and backward on the GPU (one device call of at most 10 minutes per part).
#     bash scripts/gpu_fp8.sh [all|probe|wgrad|wide|forward|backward|bf16|bench|profile|profile_bwd]...  (default: all)
# all = probe, forward, backward, bench.  Each test file runs in a pytest process of its own, and
# inside it every GEMM / forward / backward test in a child process (tests/_gpu.run_isolated): a
# kernel fault kills its process's CUDA context, and the first GPU run lost 40 tests to one
# illegal instruction.
#   probe    tests/test_fp8_gemm_probe_gpu.py (quantisers, both GEMM schedules, FP8PROBE timings)
#   wgrad    tests/test_fp8_wgrad_probe_gpu.py (1D-1D wgrad GEMM probe; FP8WGRAD / BF16WGRAD timings; not in all)
#   wide     tests/test_fp8_wide_probe_gpu.py (one m64nNk32 batch per K block, N = 160 / 192; FP8WIDE timings; not in all)
#   forward  tests/test_fp8_forward_gpu.py (the megakernel against the FP8 oracle)
#   backward tests/test_fp8_backward_gpu.py (moe_backward_fp8 against the oracle's backward_fp8)
#   bf16     the bf16 GPU tests of the host paths FP8 shares (layer, TMA, prepared calls, graphs, DLPack)
#   bench    bench/bench_fp8_forward.py --backward, qwen3-30b-a3b (T = 16384) and the deepseek-v3 EP = 8 slice
#   profile  a per-task trace of the FP8 forward (bench/profile_layer.py --precision fp8_block)
#   profile_bwd  the same with the FP8 backward at qwen3-30b-a3b, 4096 tokens (where FP8 f+b is 0.93x bf16)
# Logs under $OUT; a short summary per part.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
offline_install
echo "== install"; tail -1 "$out/install.txt"

export MOK_GREP="FP8ERR|FP8PROBE|FP8WGRAD|BF16WGRAD|FP8WIDE"
parts=()
for part in "${@:-all}"; do
  if [ "$part" = all ]; then parts+=(probe forward backward bench); else parts+=("$part"); fi
done
for part in "${parts[@]}"; do
  case "$part" in
    probe) run_pytest probe 200 tests/test_fp8_gemm_probe_gpu.py ;;
    wgrad) run_pytest wgrad 300 tests/test_fp8_wgrad_probe_gpu.py ;;
    wide) run_pytest wide 240 tests/test_fp8_wide_probe_gpu.py ;;
    forward) run_pytest forward 240 tests/test_fp8_forward_gpu.py ;;
    backward) run_pytest backward 240 tests/test_fp8_backward_gpu.py ;;
    bf16) run_pytest bf16 300 tests/test_layer_gpu.py tests/test_moe_tma_gpu.py tests/test_prepared_calls_gpu.py \
            tests/test_graphs_gpu.py tests/test_dlpack_gpu.py ;;
    bench)
      timeout 200 python3 bench/bench_fp8_forward.py --shapes qwen3-30b-a3b,deepseek-v3-ep8-slice --iters 10 --backward > "$out/bench_fp8.txt" 2>&1
      echo "bench rc=$?" >> "$out/bench_fp8.txt"; echo "== bench"; tail -5 "$out/bench_fp8.txt" ;;
    profile)
      timeout 120 python3 bench/profile_layer.py --shape qwen3-30b-a3b --precision fp8_block --iters 3 \
          --trace "$out/fp8_trace.json" > "$out/profile_fp8.txt" 2>&1
      echo "profile rc=$?" >> "$out/profile_fp8.txt"; echo "== profile"; tail -25 "$out/profile_fp8.txt" ;;
    profile_bwd)
      timeout 120 python3 bench/profile_layer.py --shape qwen3-30b-a3b --tokens 4096 --precision fp8_block --fp8-backward \
          --iters 3 --trace "$out/fp8_bwd_trace.json" > "$out/profile_fp8_bwd.txt" 2>&1
      echo "profile rc=$?" >> "$out/profile_fp8_bwd.txt"; echo "== profile_bwd"; tail -40 "$out/profile_fp8_bwd.txt"
      rm -f "$out/fp8_bwd_trace.json" ;;
    *) echo "unknown part: $part"; exit 2 ;;
  esac
done
