#!/usr/bin/env bash
# One GPU-machine session: environment, the GPU test suites, optional extra commands; logs under
# $OUT (or ./gpu_logs), a short table last.  Usage: scripts/gpu_check.sh [pytest selection ...]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out="${OUT:-gpu_logs}"; mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import cuda.core, cuda.bindings, numpy; print('cuda.core', cuda.core.__version__, 'cuda.bindings', cuda.bindings.__version__, 'numpy', numpy.__version__)"
} > "$out/env.txt" 2>&1
sel=("$@"); [ ${#sel[@]} -eq 0 ] && sel=(tests)
timeout "${PYTEST_BUDGET:-540}" python3 -m pytest -q -rs -p no:cacheprovider --timeout=300 "${sel[@]}" -s > "$out/pytest.txt" 2>&1
rc=$?
echo "== env"; cat "$out/env.txt"
echo "== pytest (rc=$rc)"; grep -E "relative Frobenius|^[a-z0-9_]+: out=|PASS|FAIL|Error|error" "$out/pytest.txt" | head -60
tail -25 "$out/pytest.txt"
