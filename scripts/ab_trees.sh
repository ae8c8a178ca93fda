#!/usr/bin/env bash
# A/B of this tree against another source tree in one device call: bitwise outputs on the GPU
# suites' cases (bench/ab_numerics.py), then the mok-only benchmark, the two trees alternating.
#   bash scripts/ab_trees.sh OLD_TREE [shapes] [rounds]      (logs and JSON under $OUT)
set -uo pipefail
old="$(cd "$1" && pwd)"   # before gpu_env.sh changes the directory
source "$(dirname "$0")/gpu_env.sh"
new="$PWD"; out="${OUT:-ab_logs}"; mkdir -p "$out"
shapes="${2:-qwen3-30b-a3b,deepseek-v3}"; rounds="${3:-2}"
PYTHONPATH="$old" timeout 70 python3 "$new/bench/ab_numerics.py" --save "$out/old.npz" > "$out/ab_old.txt" 2>&1
PYTHONPATH="$new" timeout 70 python3 "$new/bench/ab_numerics.py" --save "$out/new.npz" > "$out/ab_new.txt" 2>&1
python3 bench/ab_numerics.py --compare "$out/old.npz" "$out/new.npz" > "$out/ab_compare.txt" 2>&1
for r in $(seq "$rounds"); do
  for side in old new; do
    tree=$old; [ $side = new ] && tree=$new
    (cd "$tree" && PYTHONPATH="$tree" timeout 150 python3 bench/bench_moe.py --impl mok --shapes "$shapes" \
      --out "$out/bench_${side}_$r" --commit "$side") > "$out/bench_${side}_$r.txt" 2>&1
  done
done
echo "== numerics"; tail -n 3 "$out/ab_old.txt" "$out/ab_new.txt"; tail -n 12 "$out/ab_compare.txt"; rm -f "$out"/*.npz
for f in "$out"/bench_*_*.txt; do echo "== $(basename "$f")"; grep -E "^\|" "$f" | tail -4; done
