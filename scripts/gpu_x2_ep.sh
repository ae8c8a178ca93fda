#!/usr/bin/env bash
# Issue 20's measurement on nvidia-h200-x2 in one device call (< 600 s): EP = 1 (GPU 0 alone) and
# EP = 2 (one process per GPU, with the PyTorch + NCCL baseline) of the same tree at
# qwen3-30b-a3b (16384 and 4096 tokens per rank) and deepseek-v3 (8192), then the EP = 2 timeline
# of one qwen3 step across the two GPUs (the ranks' traces on one clock: %globaltimer, which the
# two GPUs of one host share to well under a task's length).  Logs and JSON under $OUT.
#   bash scripts/gpu_x2_ep.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH="$PWD"
commit="$(git rev-parse HEAD 2>/dev/null || cat .commit)"
bench() {  # name, then bench_moe arguments
  local name=$1; shift
  timeout -k 5 150 "$@" --out "$out" --commit "$commit" > "$out/$name.txt" 2>&1; echo "rc=$?" >> "$out/$name.txt"
  echo "== $name"; grep -E "^[a-z0-9-]+ +[0-9]|rc=|Error" "$out/$name.txt" | tail -6
}
bench ep1_qwen3 env CUDA_VISIBLE_DEVICES=0 python3 bench/bench_moe.py --shapes qwen3-30b-a3b --tokens 4096,16384
bench ep1_dsv3 env CUDA_VISIBLE_DEVICES=0 python3 bench/bench_moe.py --shapes deepseek-v3
bench ep2_qwen3 python3 -m torch.distributed.run --nproc-per-node=2 bench/bench_moe.py --shapes qwen3-30b-a3b --tokens 4096,16384
bench ep2_dsv3 python3 -m torch.distributed.run --nproc-per-node=2 bench/bench_moe.py --shapes deepseek-v3
timeout -k 5 90 python3 bench/profile_layer.py --shape qwen3-30b-a3b --ep 2 --devices 0,1 --tokens 16384 --iters 3 \
  --trace "$out/ep2_timeline.json" > "$out/timeline.txt" 2>&1; echo "rc=$?" >> "$out/timeline.txt"
echo "== timeline"; grep -E "under the push|iter 2|rc=|Error" "$out/timeline.txt"
