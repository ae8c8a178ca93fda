#!/usr/bin/env bash
# Several experiment variants against this tree in one device call, for a diagnosis rather than a
# merge (scripts/gpu_patch_ab.sh is the A/B with numerics and suites).  A variant is a '+'-joined
# list of patches applied together; variant 0 is this tree.  Each variant's tree gets the patches and
# all its cubins built on the device (the variants in parallel), then:
#   * a slice FP8 trace of each (profile_layer.py --trace): the phases' task-time medians and span;
#   * the mok-only bench at $MOK_SHAPES (default the slice), $MOK_PRECS (default fp8_block), the
#     variants alternating $MOK_ROUNDS rounds (default 2).
#     bash scripts/gpu_variants.sh "bench/experiments/a.patch" "bench/experiments/a.patch+bench/experiments/b.patch"
# MOK_NCU=1: instead of the traces and the bench, one ncu capture of each variant's slice FP8 forward
# (warp states: where the warps stall, "No Instruction" among them; --clock-control none), and its
# per-instruction SASS page as ncu_src_N.csv (bench/experiments/ncu_source_digest.py reads it).
set -uo pipefail
specs=("$@"); root=$PWD
source "$(dirname "$0")/gpu_env.sh"
offline_install
t0=$SECONDS; shapes="${MOK_SHAPES:-deepseek-v3-ep8-slice}"; precs="${MOK_PRECS:-fp8_block}"
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
trees=("$root")
for i in "${!specs[@]}"; do
  v=/tmp/variant$((i + 1)); trees+=("$v")
  ps=(); for p in ${specs[$i]//+/ }; do ps+=("$root/$p"); done
  patched_tree "$v" 8 "${ps[@]}" > "$out/build$((i + 1)).txt" 2>&1 &
done
wait
for i in "${!specs[@]}"; do echo "== variant $((i + 1)) = ${specs[$i]}: $(grep -c 'spill' "$out/build$((i + 1)).txt") spill lines, \
$(grep -ci 'error' "$out/build$((i + 1)).txt") error lines"; done
echo "== builds ($((SECONDS - t0)) s)"
if [ -n "${MOK_NCU:-}" ]; then
  for i in "${!trees[@]}"; do tree=${trees[$i]}
    (cd "$tree" && PYTHONPATH="$tree" timeout 140 ncu --clock-control none --kernel-name "regex:moe_forward_fp8" --launch-skip 1 \
       --launch-count 1 --section WarpStateStats --section SourceCounters -o /tmp/ncu_$i -f \
       --metrics 'sm__cycles_elapsed.avg.per_second,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
       python3 bench/profile_layer.py --shape deepseek-v3-ep8-slice --precision fp8_block --iters 2) > "$out/ncu_$i.txt" 2>&1
    echo "== ncu variant $i rc=$? ($((SECONDS - t0)) s)"
    ncu -i /tmp/ncu_$i.ncu-rep --page details >> "$out/ncu_$i.txt" 2>&1
    ncu -i /tmp/ncu_$i.ncu-rep --page source --csv --print-source sass > "$out/ncu_src_$i.csv" 2>&1
    grep -E "Duration|per_second|Warp Cycles Per Issued|issue_stalled" "$out/ncu_$i.txt" |
      grep -vE " 0(\.0+)?$| 0\.0[0-4][0-9]*$" | head -30
  done
  pack_out; exit 0
fi
for i in "${!trees[@]}"; do echo "== trace variant $i"; trace_slice "${trees[$i]}" "$out/trace_$i.txt"; done
for r in $(seq "${MOK_ROUNDS:-2}"); do for i in "${!trees[@]}"; do
  echo "== variant $i round $r ($((SECONDS - t0)) s)"; bench_mok "${trees[$i]}" "$out/bench_${i}_$r.txt" "$shapes" "$precs" "v$i"
done; done
echo "total $((SECONDS - t0)) s"
pack_out
