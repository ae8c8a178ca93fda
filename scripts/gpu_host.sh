#!/usr/bin/env bash
# The host-path work (issue 17, item 1) on the GPU in one device call: the host cost of a step at
# T = 2048 and 16384 on the workspace's stream and on CuPy's, pipelined (10 steps per wait) and
# waiting after every step (bench/host_profile.py, with its
# cProfile at 2048), the bitwise check of cached against fresh launches, and the GPU tests the
# caches and the import order touch (graphs, layer, TMA, interop, torch ops).  Logs under $OUT;
# a short summary last.      bash scripts/gpu_host.sh [pytest budget s]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
offline_install
{ for t in 2048 16384; do for burst in 10 1; do   # 10: the pipelined loop; 1: a wait after every step
    timeout 120 python3 bench/host_profile.py --tokens "$t" --steps 300 --burst "$burst"
    timeout 120 python3 bench/host_profile.py --tokens "$t" --steps 300 --burst "$burst" --producer-stream; done; done
  timeout 120 python3 bench/host_profile.py --tokens 2048 --steps 50 --profile; } > "$out/host.txt" 2>&1
timeout "${1:-420}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_prepared_calls_gpu.py \
    tests/test_prepared_calls.py tests/test_import_order.py tests/test_graphs_gpu.py tests/test_layer_gpu.py tests/test_moe_tma_gpu.py \
    tests/test_schedule_gpu.py tests/test_dlpack_gpu.py tests/test_interop_gpu.py tests/test_torch_ops_gpu.py \
    tests/test_trace_gpu.py > "$out/pytest.txt" 2>&1
echo "pytest rc=$?" >> "$out/pytest.txt"
echo "== install"; tail -1 "$out/install.txt"
echo "== host cost"; grep -E "host enqueue|calls per step|Error" "$out/host.txt"
echo "== pytest"; grep -E "^(FAILED|ERROR)|passed|failed|rc=|GPU tests" "$out/pytest.txt" | tail -25
