#!/usr/bin/env bash
# One ncu capture of the FP8 forward megakernel at the deepseek-v3 EP = 8 slice (bench/NOTES-2026-12-02.md,
# round 10, "Next"): is the FP8 tile engine bound by shared memory (SS-mode wgmma rereading A per
# 128-column sub-tile, plus the TMA writes) rather than by the tensor pipe?  Compare
#   "Shared Memory" throughput (MemoryWorkloadAnalysis_Tables) and the tensor pipe's active share
#   (sm__pipe_tensor_op_gmma_cycles_active) with the same figures of the bf16 forward (moe_forward).
# Logs under $OUT (ncu_fp8.txt, ncu_bf16.txt); about 2-4 minutes of device time.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Which counter sees the wgmma operand reads is itself to be checked: the LSU wavefronts count only
# ld/st.shared; the data-bank counters should count every shared-memory access (wgmma operand
# fetch and TMA writes included).  The bf16 kernel, whose traffic is known (~127 B/cycle at peak:
# bench/NOTES-FP8.md), calibrates them.
metrics=sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed
for prec in fp8_block bf16; do
  k=moe_forward_fp8; [ "$prec" = bf16 ] && k="moe_forward$"
  timeout 240 ncu --clock-control none --kernel-name "regex:$k" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis \
    --metrics "$metrics" \
    python3 bench/profile_layer.py --shape deepseek-v3-ep8-slice --precision "$prec" --iters 2 \
    > "$out/ncu_${prec%_block}.txt" 2>&1
  echo "== ncu $prec rc=$?"
  grep -E "Shared|gmma|bank|Duration|SM Busy|Compute \(SM\)|Memory Throughput|wavefronts" "$out/ncu_${prec%_block}.txt" | head -24
done
