#!/usr/bin/env bash
# The release check of a commit in device calls of under 10 minutes each: the README's install,
# then every one-GPU test file by part, and the benchmark.  Logs under $OUT; a summary per part.
# (Across two GPUs: scripts/gpu_x2.sh.)  Worst-case budgets per part in brackets.
#   bash scripts/gpu_release.sh core       EP (both process models), trace, the FP8 forward / backward  [530 s]
#   bash scripts/gpu_release.sh layer      layer, prepared calls, graphs; bench_moe bf16 vs fp8_block   [210 s]
#   bash scripts/gpu_release.sh rest       every other GPU file except the GEMM probes; the samples      [600 s]
#   bash scripts/gpu_release.sh probes     the bf16 and FP8 GEMM probes                                  [540 s]
#   bash scripts/gpu_release.sh fp8probes  the FP8 wgrad (1D-1D) and wide-batch probes                   [300 s]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
offline_install
echo "== install"; tail -1 "$out/install.txt"

case "${1:-core}" in
  core)
    run_pytest ep 200 tests/test_ep_gpu.py tests/test_trace_gpu.py
    run_pytest fp8 330 tests/test_fp8_forward_gpu.py tests/test_fp8_backward_gpu.py ;;
  layer)
    run_pytest bf16 100 tests/test_layer_gpu.py tests/test_prepared_calls_gpu.py tests/test_graphs_gpu.py
    timeout 110 python3 bench/bench_moe.py --shapes qwen3-30b-a3b,deepseek-v3-ep8-slice --precision bf16,fp8_block \
      --timing graph --out "$out" --commit "$(git rev-parse HEAD 2>/dev/null || cat .commit)" > "$out/bench.txt" 2>&1
    echo "bench rc=$?" >> "$out/bench.txt"; echo "== bench"; tail -12 "$out/bench.txt" ;;
  rest)
    run_pytest rest 420 tests/test_dlpack_gpu.py tests/test_interop_gpu.py tests/test_torch_ops_gpu.py \
      tests/test_jax_ops_gpu.py tests/test_schedule_gpu.py tests/test_symmetric_gpu.py tests/test_moe_kernel_gpu.py \
      tests/test_moe_tma_gpu.py
    { timeout 60 python3 samples/train_moe.py --steps 6; timeout 60 python3 samples/train_moe.py --steps 6 --precision fp8_block
      timeout 60 python3 samples/train_moe_ep.py --one-process --ranks-per-gpu 2 --steps 4 --tokens 2048; } > "$out/samples.txt" 2>&1
    echo "== samples"; grep -E "^done|Error|error" "$out/samples.txt" | tail -6 ;;
  probes)
    run_pytest probes 540 tests/test_gemm_probe_gpu.py tests/test_fp8_gemm_probe_gpu.py ;;
  fp8probes)
    MOK_GREP="FP8ERR|FP8WGRAD|BF16WGRAD|FP8WIDE" run_pytest fp8probes 300 tests/test_fp8_wgrad_probe_gpu.py \
      tests/test_fp8_wide_probe_gpu.py ;;
  *) echo "unknown part: $1"; exit 2 ;;
esac
