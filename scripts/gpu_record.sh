#!/usr/bin/env bash
# The bench of record in one device call: bench/bench_moe.py, mok_rt in bf16 and fp8_block against the PyTorch
# baseline, graph-timed, at qwen3-30b-a3b (T = 16384), the deepseek-v3 EP = 8 slice and deepseek-v3 (256 experts,
# T = 8192), each shape in one process.  On a card of 80 GB deepseek-v3 runs as two processes, mok_rt's two
# precisions (--impl mok) and the baseline (--impl torch): together they do not fit (the baseline's weights and
# gradients beside mok_rt's bf16 and FP8 weights and gradients).
# Then, while $SECONDS < $MOK_SWEEP_BEFORE (default 0: never), qwen3 and the slice at 1024 / 4096 tokens.
# JSONs and a log under $OUT; the commit from .commit (written by the caller) or `git`.
#     bash scripts/gpu_record.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
log=/tmp/record; mkdir -p "$log"
# .commit first: the device's copy may carry main's last landed commit as its git HEAD, with the tree
# under test as uncommitted changes (2026-12-06: JSONs labelled 5693879-dirty for 650a841)
c=$(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,memory.total --format=csv > "$log/gpu.txt"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
b() { local n=$1 t=$2; shift 2
  PYTHONPATH=$PWD timeout "$t" python3 bench/bench_moe.py --timing graph --out "$out" --commit "$c" "$@" \
    > "$log/bench_$n.txt" 2>&1; echo "rc=$? at ${SECONDS}s" >> "$log/bench_$n.txt"; }
if [ "${mem:-0}" -gt 100000 ]; then
  b dsv3 120 --shapes deepseek-v3 --precision bf16,fp8_block
else   # 80 GB: mok_rt's two precisions in one process, the baseline in another
  b dsv3_mok 150 --impl mok --shapes deepseek-v3 --precision bf16,fp8_block
  b dsv3_torch 90 --impl torch --shapes deepseek-v3
fi
b main 80 --shapes qwen3-30b-a3b,deepseek-v3-ep8-slice --precision bf16,fp8_block
[ "$SECONDS" -lt "${MOK_SWEEP_BEFORE:-0}" ] && b sweep $((230 - SECONDS)) --shapes qwen3-30b-a3b,deepseek-v3-ep8-slice \
  --tokens 1024,4096 --precision bf16,fp8_block
for f in "$log"/*; do echo "=== $f"; cat "$f"; done > "$out/record.log"
for f in "$log"/bench_*.txt; do
  echo "== $(basename "$f" .txt)"; grep -A12 "^shape" "$f" | grep -v "step memory\|^---\|^shape"; grep "rc=\|Error" "$f" | tail -3
done
