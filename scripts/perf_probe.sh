#!/usr/bin/env bash
# Performance probes in one GPU call: host/device split, ncu kernel summary, the wgmma probe,
# the sample, and the benchmark of the named shapes.  Logs under $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "== profile quick";  timeout 60 python3 bench/profile_layer.py --shape quick --iters 4 2>&1 | tail -4
echo "== profile qwen3";  timeout 90 python3 bench/profile_layer.py --shape qwen3-30b-a3b --iters 3 2>&1 | tail -3
echo "== ncu quick"
timeout 120 ncu --clock-control none --print-summary per-kernel python3 bench/profile_layer.py --shape quick --iters 2 \
  > "$out/ncu_quick.txt" 2>&1; grep -E "^  [a-z_]+|Duration|gpu__time" "$out/ncu_quick.txt" | head -40
echo "== wgmma probe"
timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/test_gemm_probe_gpu.py > "$out/probe.txt" 2>&1
grep -E "PROBE|passed|failed|Error" "$out/probe.txt" | head -20
echo "== train_moe"; timeout 60 python3 samples/train_moe.py --steps 6 2>&1 | tail -7
echo "== bench ${BENCH_SHAPES:-qwen3-30b-a3b}"
timeout "${BENCH_BUDGET:-200}" python3 bench/bench_moe.py --shapes "${BENCH_SHAPES:-qwen3-30b-a3b}" --out "$out" 2>&1 | tail -8
