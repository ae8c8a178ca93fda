#!/usr/bin/env bash
# The bench of record in one device call: bench/bench_moe.py, mok_rt in bf16 and fp8_block against the PyTorch
# baseline, graph-timed, at qwen3-30b-a3b (T = 16384), the deepseek-v3 EP = 8 slice and deepseek-v3 (256 experts,
# T = 8192), each shape in one process.  On a card of 80 GB deepseek-v3's three sides (PyTorch, mok bf16, mok
# fp8_block) run in processes of their own (one process does not fit: FP8 alone holds ~71 GiB after its check
# run), pipelined (a graph capture's own workspace blocks did not fit beside it, 2026-12-07; at 16-50 ms a step
# the host's ~0.3 ms is hidden either way), and the ratios are read across the three.
# Then, while $SECONDS < $MOK_SWEEP_BEFORE (default 0: never), qwen3 and the slice at 1024 / 4096 tokens.
# JSONs and a log under $OUT; the commit from .commit (written by the caller) or `git`.
#     bash scripts/gpu_record.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
log=$(mktemp -d /tmp/record.XXXXXX)   # this call's own: a warm machine keeps /tmp between calls
# .commit first: the device's copy may carry main's last landed commit as its git HEAD, with the tree
# under test as uncommitted changes (2026-12-06: JSONs labelled 5693879-dirty for 650a841)
c=$(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,memory.total --format=csv > "$log/gpu.txt"
b() { local n=$1 t=$2; shift 2
  PYTHONPATH=$PWD timeout "$t" python3 bench/bench_moe.py --timing graph --out "$out" --commit "$c" "$@" \
    > "$log/bench_$n.txt" 2>&1; echo "rc=$? at ${SECONDS}s" >> "$log/bench_$n.txt"; }
if big_card; then
  b dsv3 120 --shapes deepseek-v3 --precision bf16,fp8_block
else
  b dsv3_torch 75 --shapes deepseek-v3 --impl torch
  b dsv3_bf16 75 --shapes deepseek-v3 --impl mok --precision bf16 --timing pipelined
  b dsv3_fp8 75 --shapes deepseek-v3 --impl mok --precision fp8_block --timing pipelined
fi
b main 80 --shapes qwen3-30b-a3b,deepseek-v3-ep8-slice --precision bf16,fp8_block
[ "$SECONDS" -lt "${MOK_SWEEP_BEFORE:-0}" ] && b sweep $((230 - SECONDS)) --shapes qwen3-30b-a3b,deepseek-v3-ep8-slice \
  --tokens 1024,4096 --precision bf16,fp8_block
for f in "$log"/*; do echo "=== $f"; cat "$f"; done > "$out/record.log"
for f in "$log"/bench_*.txt; do
  echo "== $(basename "$f" .txt)"; grep -A12 "^shape" "$f" | grep -v "step memory\|^---\|^shape\|^rc="; grep "rc=\|Error" "$f" | tail -3
done
