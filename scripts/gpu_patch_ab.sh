#!/usr/bin/env bash
# A/B of an experiment patch (or several, applied together) against this tree in one device call, the
# patches applied and their cubins built on the device (patches in bench/experiments leave the cubins out):
#   * bitwise FP8 outputs on ab_numerics' 18 cases, both trees;
#   * a slice FP8 trace (profile_layer.py --trace) of each;
#   * the mok-only bench, the trees alternating $MOK_ROUNDS rounds (default 2) at $MOK_SHAPES
#     (default deepseek-v3-ep8-slice,qwen3-30b-a3b), FP8 (and bf16 once, for the ratio; $MOK_PRECS: these
#     precisions in every run);
#   * where the bits are equal (or MOK_SUITES=1: a patch that changes the numerics on purpose), the
#     patched tree's suites while time lasts: $MOK_TESTS (default the FP8 forward + staged suites), with
#     -k "$MOK_K" where set.
#     bash scripts/gpu_patch_ab.sh bench/experiments/bg_combine.patch [MORE.patch ...]   (logs under $OUT)
# Part 2, on the warm machine right after (the patched tree alone, ~330 s): the bench of record (graph, PyTorch,
# qwen3 + the slice), the EP + trace suites and the FP8 backward suite:
#     MOK_PART=2 bash scripts/gpu_patch_ab.sh bench/experiments/bg_combine.patch
# MOK_BUDGET (default 580): the seconds this script may take; the suites get what is left of it (the
# first part's only where 250 s are), so a call with a shorter timeout still ends in pack_out.
set -uo pipefail
patches=(); for p in "$@"; do patches+=("$(realpath "$p")"); done
name=$(for p in "${patches[@]}"; do basename "$p" .patch; done | paste -sd+)
patch=/tmp/applied.patch; cat "${patches[@]}" > "$patch"   # separate files: one patch, applied at once
source "$(dirname "$0")/gpu_env.sh"
offline_install
old=$PWD; new=/tmp/patched; t0=$SECONDS; budget=${MOK_BUDGET:-580}
shapes="${MOK_SHAPES:-deepseek-v3-ep8-slice,qwen3-30b-a3b}"
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
if [ ! -f "$new/.patched" ] || ! cmp -s "$new/.patched" "$patch"; then  # a warm machine keeps /tmp
  patched_tree "$new" 16 "$patch" > "$out/build.txt" 2>&1 && cp "$patch" "$new/.patched"
  echo "== build rc=$? ($((SECONDS - t0)) s)"; grep -E "spill|error" "$out/build.txt" | sort | uniq -c | head -6
fi
if [ "${MOK_PART:-1}" = 2 ]; then
  cd "$new"
  PYTHONPATH=$new timeout 80 python3 bench/bench_moe.py --timing graph --out "$out" --commit "$(cat "$old/.commit" 2>/dev/null \
    || echo patched)+$name" --shapes qwen3-30b-a3b,deepseek-v3-ep8-slice --precision bf16,fp8_block \
    > "$out/record.txt" 2>&1
  echo "== record rc=$? ($((SECONDS - t0)) s)"; grep -A6 "^shape" "$out/record.txt" | grep -v "step memory\|^---"
  run_pytest ep 150 tests/test_ep_gpu.py tests/test_trace_gpu.py
  MOK_GREP="FP8ERR" run_pytest fp8_bwd $((budget - (SECONDS - t0))) tests/test_fp8_backward_gpu.py
  echo "total $((SECONDS - t0)) s"
  cd "$old" && pack_out record.txt ep.txt fp8_bwd.txt
  exit 0
fi
for side in old new; do tree=$old; [ $side = new ] && tree=$new
  (cd "$tree" && PYTHONPATH="$tree" timeout 100 python3 "$tree/bench/ab_numerics.py" --precision fp8_block --save /tmp/ab_$side.npz) \
    > "$out/ab_$side.txt" 2>&1
done
python3 bench/ab_numerics.py --compare /tmp/ab_old.npz /tmp/ab_new.npz > "$out/ab_compare.txt" 2>&1
echo "== numerics ($((SECONDS - t0)) s)"; tail -n 1 "$out/ab_compare.txt"
for side in old new; do tree=$old; [ $side = new ] && tree=$new
  echo "== trace $side"; trace_slice "$tree" "$out/trace_$side.txt"
done
for r in $(seq "${MOK_ROUNDS:-2}"); do for side in old new; do tree=$old; [ $side = new ] && tree=$new
  precs=fp8_block; [ $side = old ] && [ "$r" = 1 ] && precs=bf16,fp8_block
  [ -n "${MOK_PRECS:-}" ] && precs=$MOK_PRECS   # e.g. bf16,fp8_block where the patch moves bf16 too
  echo "== $side round $r ($((SECONDS - t0)) s)"; bench_mok "$tree" "$out/bench_${side}_$r.txt" "$shapes" "$precs" $side
done; done
if { grep -q " 0 differ" "$out/ab_compare.txt" || [ -n "${MOK_SUITES:-}" ]; } && [ $((SECONDS - t0)) -lt $((budget - 250)) ]; then
  # shellcheck disable=SC2086
  cd "$new" && MOK_GREP="FP8ERR" run_pytest fp8_forward_new $((budget - (SECONDS - t0))) \
    ${MOK_TESTS:-tests/test_fp8_forward_gpu.py tests/test_fp8_staged_gpu.py} ${MOK_K:+-k "$MOK_K"}
fi
echo "total $((SECONDS - t0)) s"
cd "$old" && pack_out ab_compare.txt fp8_forward_new.txt
