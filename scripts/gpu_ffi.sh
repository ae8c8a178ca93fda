#!/usr/bin/env bash
# The JAX XLA FFI custom calls on one GPU (issue 19): the jax_ops GPU tests, the CPU jax_ops /
# xla_ffi tests (same handlers, CPU platform), and samples/jax_custom_vjp.py --jit on the GPU.
# Assumes mok_rt is installed (pip install -e '.[test]') with jax[cuda13].  Summary last.
#   bash scripts/gpu_ffi.sh            (logs under $OUT, default gpu_logs/)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export MOK_RT_REQUIRE_GPU=1 PYTHONPATH="$PWD"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
py="python3 -m pytest -q -rs -p no:cacheprovider"

{ nvidia-smi -L; python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())
from mok_rt.frameworks import jax_ops; print('XLA FFI API version reported:', jax_ops.register_targets())"; } \
    > "$out/ffi_env.txt" 2>&1
stamp "env done"
timeout -k 5 300 $py tests/test_jax_ops_gpu.py > "$out/ffi_gpu_tests.txt" 2>&1; rc_gpu=$?
stamp "GPU tests rc=$rc_gpu"
timeout -k 5 240 $py tests/test_xla_ffi.py tests/test_jax_ops.py -k "not sample" > "$out/ffi_cpu_tests.txt" 2>&1; rc_cpu=$?
stamp "CPU-platform tests rc=$rc_cpu"
timeout -k 5 150 python3 samples/jax_custom_vjp.py --jit --backend cuda --steps 10 > "$out/ffi_sample.txt" 2>&1; rc_s=$?
stamp "sample --jit rc=$rc_s"

echo "===== environment"; cat "$out/ffi_env.txt"
echo "===== GPU tests (tail)"; tail -n 60 "$out/ffi_gpu_tests.txt"
echo "===== CPU-platform tests (tail)"; tail -n 15 "$out/ffi_cpu_tests.txt"
echo "===== sample --jit"; tail -n 16 "$out/ffi_sample.txt"
echo "===== summary: gpu_tests rc=$rc_gpu cpu_tests rc=$rc_cpu sample_jit rc=$rc_s"
