# Sourced by the scripts/gpu_*.sh device scripts: the one place for what every GPU run sets.
#   * No NVLink multicast objects, ever (they can take the host's shared GPUs out of service).
#   * The repository root as the working directory; $out = $OUT (the device call's log folder) or
#     gpu_logs.
#   * offline_install: the README's test install on the offline GPU machine (the build backend
#     comes from .whl/); its log in $out/install.txt.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
out="${OUT:-gpu_logs}"; mkdir -p "$out"

offline_install() {
  PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/.whl" python3 -m pip install -q -e '.[test]' > "$out/install.txt" 2>&1
  echo "install rc=$?" >> "$out/install.txt"
}
