#!/usr/bin/env bash
# A/B of cubin sets in one device call: each NAME=DIR makes a copy of this tree whose
# mok_rt/cubins/ files are replaced by DIR's (built here from patched sources, carried), then
#   * bitwise outputs of every variant against the first (bench/ab_numerics.py, bf16 and fp8_block),
#   * the mok-only benchmark, the variants alternating for $MOK_ROUNDS rounds (default 2).
#     bash scripts/ab_cubins.sh base=.carry/base lean=.carry/lean ...   (logs under $OUT)
# $MOK_SHAPES (default qwen3-30b-a3b,deepseek-v3-ep8-slice), $MOK_PRECISIONS (default bf16,fp8_block),
# $MOK_TOKENS (optional bench_moe --tokens), $MOK_NUMERICS (precisions compared, default "bf16 fp8_block").
set -uo pipefail
declare -a names dirs
for a in "$@"; do names+=("${a%%=*}"); dirs+=("$(cd "${a#*=}" && pwd)"); done
source "$(dirname "$0")/gpu_env.sh"
src="$PWD"
shapes="${MOK_SHAPES:-qwen3-30b-a3b,deepseek-v3-ep8-slice}"; precs="${MOK_PRECISIONS:-bf16,fp8_block}"
for i in "${!names[@]}"; do
  t="/tmp/ab_${names[$i]}"; rm -rf "$t"; mkdir -p "$t"
  tar -C "$src" --exclude=./.carry --exclude=./.whl -cf - . | tar -C "$t" -xf -
  cp "${dirs[$i]}"/*.cubin "$t/mok_rt/cubins/"
  [ -f "${dirs[$i]}/manifest.json" ] && cp "${dirs[$i]}/manifest.json" "$t/mok_rt/cubins/"
  for p in ${MOK_NUMERICS:-bf16 fp8_block}; do
    (cd "$t" && PYTHONPATH="$t" timeout 120 python3 bench/ab_numerics.py --precision $p --save "/tmp/ab_${names[$i]}_$p.npz") \
      > "$out/numerics_${names[$i]}_$p.txt" 2>&1
  done
done
{
  for i in "${!names[@]}"; do
    [ "$i" = 0 ] && continue
    for p in ${MOK_NUMERICS:-bf16 fp8_block}; do
      echo "-- ${names[$i]} vs ${names[0]}, $p"
      python3 bench/ab_numerics.py --compare "/tmp/ab_${names[0]}_$p.npz" "/tmp/ab_${names[$i]}_$p.npz" | tail -4
    done
  done
} > "$out/numerics_compare.txt" 2>&1
for r in $(seq "${MOK_ROUNDS:-2}"); do
  for i in "${!names[@]}"; do
    n=${names[$i]}; t="/tmp/ab_$n"
    (cd "$t" && PYTHONPATH="$t" timeout 200 python3 bench/bench_moe.py --impl mok --shapes "$shapes" --precision "$precs" \
       ${MOK_TOKENS:+--tokens "$MOK_TOKENS"} --out "$out/bench_$n" --commit "$n") > "$out/bench_${n}_$r.txt" 2>&1
    echo "bench $n round $r rc=$?" >> "$out/bench_${n}_$r.txt"
  done
done
echo "== numerics"; cat "$out/numerics_compare.txt"; grep -h -i "error\|Traceback" "$out"/numerics_*_*.txt | head -5
for r in $(seq "${MOK_ROUNDS:-2}"); do for n in "${names[@]}"; do
  echo "== $n round $r"; grep -E "^[a-z].*[0-9]  |^  \+ |vs mok_rt bf16|rc=" "$out/bench_${n}_$r.txt" | tail -12
done; done
