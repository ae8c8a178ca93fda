#!/usr/bin/env bash
# The FP8 engine against cuBLAS's block-scaled FP8 GEMM on the same operands (bench/fp8_calibrate.py),
# the clocks and power under that load (nvidia-smi, read only), and the kernels of one FP8 forward
# at the deepseek-v3 slice (ncu durations: the megakernel against the schedule kernels around it).
#     bash scripts/gpu_calibrate.sh [mctests|calibrate|ncu|ncu_gemm]...   (default: calibrate ncu)
#   mctests   tests/test_fp8_mc_probe_gpu.py (the multicast probes, overlap and lean, against the overlap probe and float64)
#   ncu_gemm  ncu sections of cuBLAS's block-scaled kernel and the probe schedules (gate|up, deepseek-v3 slice)
#   ncu_src   ncu's per-instruction SASS page (stall samples, executed instructions) of the same kernels,
#             as CSV: where each engine's warps wait ($MOK_NCU_KERNELS, $MOK_NCU_APP: other kernels / program)
# The probe's cubin: $MOK_FP8_PROBE_CUBIN, else .carry/fp8_gemm_probe.sm_90a.cubin when carried, else
# built with nvcc there.  $MOK_TAG (default empty) suffixes the calibrate logs (variants in one call);
# $MOK_SHAPES restricts bench/fp8_calibrate.py's shapes.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -z "${MOK_FP8_PROBE_CUBIN:-}" ] && [ -f .carry/fp8_gemm_probe.sm_90a.cubin ] && export MOK_FP8_PROBE_CUBIN="$PWD/.carry/fp8_gemm_probe.sm_90a.cubin"
# ncu_gemm / ncu_src: cuBLAS's block-scaled kernel and the two probe schedules, unless $MOK_NCU_KERNELS
set -f; ncu_kernels=(${MOK_NCU_KERNELS:-'regex:^(?!fp8_gemm).*(nvjet|xmma|cutlass|gemm|Gemm)' 'regex:^fp8_gemm_probe$' 'regex:fp8_gemm_probe_overlap'}); set +f   # no pathname expansion of the patterns
for part in "${@:-calibrate ncu}"; do
  for p in $part; do
    case "$p" in
      calibrate)
        nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_event_reasons.active \
            --format=csv -lms 250 > "$out/smi${MOK_TAG:-}.csv" 2>&1 &
        smi=$!
        log="$out/calibrate${MOK_TAG:-}.txt"
        timeout 300 python3 bench/fp8_calibrate.py ${MOK_SHAPES:+--shapes "$MOK_SHAPES"} \
            --json "$out/calibrate${MOK_TAG:-}.json" > "$log" 2>&1
        echo "calibrate rc=$?" >> "$log"
        kill $smi 2>/dev/null
        echo "== calibrate${MOK_TAG:-} ($MOK_FP8_PROBE_CUBIN)"; sed -n '/^shape /,$p' "$log"
        echo "== clocks (SM MHz, W: min / median / max while running)"
        python3 - "$out/smi${MOK_TAG:-}.csv" <<'PY'
import csv, statistics, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r and r[0][:2] == "20"]
for i, name in ((1, "sm MHz"), (3, "power W")):
    v = sorted(float(r[i].split()[0]) for r in rows if r[i].strip().split()[0].replace(".", "").isdigit())
    if v: print(f"{name}: {v[0]} / {statistics.median(v)} / {v[-1]} over {len(v)} samples")
print("event reasons seen:", sorted({r[6].strip() for r in rows if len(r) > 6}))
PY
        ;;
      ncu)
        timeout 240 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
            python3 bench/profile_layer.py --shape deepseek-v3-ep8-slice --precision fp8_block --iters 2 \
            > "$out/ncu_fp8_slice.txt" 2>&1
        echo "ncu rc=$?" >> "$out/ncu_fp8_slice.txt"
        echo "== ncu"; grep -E "^\s+[a-z_A-Z].*\(|gpu__time_duration|rc=" "$out/ncu_fp8_slice.txt" | tail -30 ;;
      mctests)
        run_pytest mc_tests 240 tests/test_fp8_mc_probe_gpu.py ;;
      ncu_gemm)
        # The cuBLAS block-scaled kernel's name (tile, cluster, schedule), launch shape and stall
        # profile next to the probe's two schedules, at the deepseek-v3 slice's gate|up shape.
        for k in "${ncu_kernels[@]}"; do
          timeout 200 ncu --clock-control none -k "$k" -c 3 --section LaunchStats --section Occupancy \
              --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
              --section WarpStateStats --section SchedulerStats \
              python3 bench/fp8_calibrate.py --shapes dsv3slice_gate_up --iters 1 >> "$out/ncu_gemm.txt" 2>&1
          echo "ncu rc=$?" >> "$out/ncu_gemm.txt"
        done
        echo "== ncu_gemm"; grep -E "^  [a-zA-Z_].*\(|Registers Per|Threads  |Cluster Size|Duration|Compute \(SM\) Th|L2 Cache Th|DRAM Th|Shared Memory Configuration Size|Dynamic Shared|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|rc=" "$out/ncu_gemm.txt" | head -80 ;;
      ncu_src)
        for k in "${ncu_kernels[@]}"; do
          tag=$(echo "$k" | tr -c 'a-zA-Z0-9_\n' '_' | cut -c1-40)
          timeout 200 ncu --clock-control none -k "$k" -c 1 --section SourceCounters --section WarpStateStats \
              --section SpeedOfLight -o "/tmp/src_$tag" -f \
              python3 ${MOK_NCU_APP:-bench/fp8_calibrate.py --shapes dsv3slice_gate_up --iters 1} > /tmp/src_$tag.log 2>&1
          echo "ncu $k rc=$?"
          ncu -i "/tmp/src_$tag.ncu-rep" --page source --csv --print-source sass >> "$out/ncu_src.csv" 2>&1
          ncu -i "/tmp/src_$tag.ncu-rep" --page details >> "$out/ncu_src_details.txt" 2>&1
        done
        wc -l "$out/ncu_src.csv"; grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\)" "$out/ncu_src_details.txt" ;;
      *) echo "unknown part: $p"; exit 2 ;;
    esac
  done
done
