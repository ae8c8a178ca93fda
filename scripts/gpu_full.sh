#!/usr/bin/env bash
# The GPU validation of a commit in one device call: the README's install and test commands (the
# GPU machine is offline: pip takes the build backend from .whl/), then the samples.  Logs under
# $OUT; a short summary last.        bash scripts/gpu_full.sh [pytest budget in seconds]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
offline_install
timeout "${1:-460}" python3 -m pytest -q -rs -p no:cacheprovider > "$out/pytest.txt" 2>&1
echo "pytest rc=$?" >> "$out/pytest.txt"
{ timeout 60 python3 samples/train_moe.py --steps 8; timeout 60 python3 samples/train_moe_ep.py --one-process \
    --ranks-per-gpu 2 --steps 5 --tokens 2048; } > "$out/samples.txt" 2>&1
echo "== install"; tail -3 "$out/install.txt"
echo "== pytest"; grep -E "^(FAILED|ERROR)|passed|failed|rc=|GPU tests" "$out/pytest.txt" | tail -25
echo "== samples"; grep -E "step|loss|done|Error|error" "$out/samples.txt" | tail -10
