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

# pack_out KEEP...: the device call returns at most 8 files from $OUT, two folders deep (2026-12-07: a record's
# 13 JSONs and logs did not come back): everything under $out but the files named goes into $out/logs.tgz.
pack_out() {
  local keep=() f items=(); for f in "$@" logs.tgz; do keep+=(! -name "$f"); done
  (cd "$out" && mapfile -d '' items < <(find . -mindepth 1 -maxdepth 1 "${keep[@]}" -print0) &&
     [ ${#items[@]} -gt 0 ] && tar czf /tmp/logs.tgz "${items[@]}" && rm -rf "${items[@]}" && mv /tmp/logs.tgz logs.tgz)
}

# big_card: a card of more than 100 GB (H200), where deepseek-v3 with all 256 experts fits one process.
big_card() { [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)" -gt 100000 ] 2>/dev/null; }

offline_install() {
  PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/.whl" python3 -m pip install -q -e '.[test]' > "$out/install.txt" 2>&1
  echo "install rc=$?" >> "$out/install.txt"
}

# run_pytest NAME BUDGET_S FILES...: one pytest process (log $out/NAME.txt), then its summary lines
# (and those matching $MOK_GREP, e.g. the FP8 error lines).
run_pytest() {
  local name=$1 budget=$2; shift 2
  timeout "$budget" python3 -m pytest -q -rs -s -p no:cacheprovider "$@" > "$out/$name.txt" 2>&1
  echo "pytest rc=$?" >> "$out/$name.txt"
  echo "== $name"; grep -E "^(FAILED|ERROR)|passed|failed|rc=|GPU tests${MOK_GREP:+|$MOK_GREP}" "$out/$name.txt" | tail -40
}
