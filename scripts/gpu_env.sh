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

# patched_tree DIR JOBS PATCH...: this tree (without .git, .carry, .whl) copied to DIR, the patches
# applied in order and every cubin built with JOBS compile jobs (bench/experiments patches leave the
# cubins out); the log on stdout, the status of the first failing step as the return code.
patched_tree() {
  local dir=$1 jobs=$2 p; shift 2
  rm -rf "$dir"; mkdir -p "$dir"
  tar --exclude=./.git --exclude=./.carry --exclude=./.whl -cf - . | tar -C "$dir" -xf - || return
  for p in "$@"; do (cd "$dir" && git apply "$p") || return; done
  (cd "$dir" && python3 -m mok_rt.build -j "$jobs" -v)
}

# trace_slice TREE LOG: a two-iteration slice FP8 trace of TREE (profile_layer.py --trace) into LOG,
# then its span and phase medians.
trace_slice() {
  (cd "$1" && PYTHONPATH="$1" timeout 40 python3 bench/profile_layer.py --shape deepseek-v3-ep8-slice \
     --precision fp8_block --iters 2 --trace "/tmp/tr_$(basename "$2" .txt).json") > "$2" 2>&1
  grep -E "tasks over|^  [a-z_]+ .*median|idle SMs" "$2" | head -8
}

# bench_mok TREE LOG SHAPES PRECS TAG: the mok-only bench of TREE into LOG, then its result lines
# (each once: bench_moe.py prints its table again at the end).
bench_mok() {
  (cd "$1" && PYTHONPATH="$1" timeout 100 python3 bench/bench_moe.py --impl mok --shapes "$3" --precision "$4" \
     --out "/tmp/b_$5" --commit "$5") > "$2" 2>&1
  grep -E "^[a-z].*[0-9] |^  \+ " "$2" | grep -v "step memory" | awk '!seen[$0]++' | head -4
}
