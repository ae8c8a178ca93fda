#!/usr/bin/env bash
# The one device call #18 is waiting for (bench/NOTES-FP8-3.md rounds 22-23), ready to run:
#   1. scripts/gpu_record.sh: the bench of record (deepseek-v3 in one process on a card of > 100 GB,
#      as three on 80 GB; qwen3 and the slice; the 1 k / 4 k sweep while $SECONDS < MOK_SWEEP_BEFORE);
#   2. on a card of > 100 GB, the deepseek-v3 FP8 backward trace (profile_layer.py --trace);
#   3. with VARIANT=NAME, the A/B of .carry/base against .carry/NAME (FP8 numerics, two mok-only rounds), then
#      both trees' slice FP8 backward traces (worst_window_summary);
# each step only while $SECONDS leaves room before $END (default 540).  Before the call, here:
#     git rev-parse --short HEAD > .commit
#     mkdir -p .carry/base && cp mok_rt/cubins/* .carry/base/
#     bash scripts/build_variant.sh bench/experiments/NAME.patch .carry/NAME STEM...   # for step 3
# and carry [".commit", ".carry"].  Logs under $OUT: record.log, record_summary.txt, the rest (the
# record's JSONs in rec/, the A/B's, the traces) in logs.tgz.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
END=${END:-540}
trap 'pack_out record.log record_summary.txt' EXIT   # the rest in $OUT/logs.tgz
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
MOK_SWEEP_BEFORE=${MOK_SWEEP_BEFORE:-0} bash scripts/gpu_record.sh 2>&1 | tee "$out/record_summary.txt"
mkdir -p "$out/rec"; mv "$out"/*.json "$out/rec/" 2>/dev/null
if big_card && [ $SECONDS -lt $((END - 240)) ]; then
  PYTHONPATH=$PWD timeout 70 python3 bench/profile_layer.py --shape deepseek-v3 --precision fp8_block --fp8-backward \
    --iters 3 --trace /tmp/t_dsv3.json > "$out/trace_dsv3_fp8.txt" 2>&1
  echo "== trace deepseek-v3 fp8 rc=$? at ${SECONDS}s"; grep -E "^iter 2" "$out/trace_dsv3_fp8.txt"
  grep -A11 "^backward (rank 0, device" "$out/trace_dsv3_fp8.txt" | head -12
fi
v=${VARIANT:-}
[ -n "$v" ] && [ -d .carry/base ] && [ -d ".carry/$v" ] || { echo "no VARIANT with .carry/base and .carry/\$VARIANT: A/B skipped"; exit 0; }
echo "== A/B base / $v at ${SECONDS}s"
[ $SECONDS -lt $((END - 160)) ] && MOK_PRECISIONS=fp8_block MOK_NUMERICS=fp8_block MOK_ROUNDS=2 \
  timeout $((END - SECONDS)) bash scripts/ab_cubins.sh base=.carry/base "$v=.carry/$v" 2>&1 | tail -16
for n in "$v" base; do
  [ $SECONDS -gt $((END - 20)) ] && break
  [ -d /tmp/ab_$n ] || continue  # the A/B (which makes the tree copies) did not run
  (cd /tmp/ab_$n && PYTHONPATH=/tmp/ab_$n timeout 40 python3 bench/profile_layer.py --shape deepseek-v3-ep8-slice \
     --precision fp8_block --fp8-backward --iters 3 --trace /tmp/t_$n.json) > "$out/trace_$n.txt" 2>&1
  echo "== trace $n rc=$? at ${SECONDS}s"
  grep -A11 "^backward (rank 0, device" "$out/trace_$n.txt" | grep -E "backward|widen|combine|wgrad|routed_dx|SM busy"
  grep -A14 "^backward (rank 0): most idle" "$out/trace_$n.txt" | head -16
done
echo "done at ${SECONDS}s"
