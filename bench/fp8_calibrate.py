"""What the best available "fp8_block" GEMM reaches on this GPU, next to mok_rt's FP8 tile engine.

    python bench/fp8_calibrate.py [--shapes NAME,...] [--iters 20]

The same E4M3 operands and fp32 block scales (x: 1 x 128 along K, weights: 128 x 128; the
DeepSeek-V3 recipe that mok_rt's ``fp8_block`` implements) go through
  * cuBLAS's block-scaled FP8 GEMM (``torch._scaled_mm`` with 1 x 128 / 128 x 128 scale tensors,
    CUDA >= 12.9, Hopper only), bf16 out;
  * mok_rt's standalone FP8 engine probe (tests/cuda/fp8_gemm_probe.cu: the plain schedule, one K
    block in flight per warpgroup; the overlap schedule, two; and the overlap schedule on 2-CTA
    clusters multicasting B, fp8_mc_probe.cuh), bf16 out, as one group and as the grouped shape
    the megakernel runs (``groups`` x ``rows``), each bitwise against the plain one;
  * per-tensor FP8 ``torch._scaled_mm`` (no block scales: the FP8 ceiling) and bf16 ``torch.mm``
    on the same shapes (bf16 copies of the dequantised operands).
Each is checked against the others (relative Frobenius between the cuBLAS and probe outputs) and
timed with CUDA events (median of ``--iters`` after warm-up).  Prints one line per (shape, engine)
and a table last.  Needs torch, CuPy, and the probe's cubin (built on the fly with nvcc, or given
by MOK_FP8_PROBE_CUBIN).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

# name: (groups, rows per group, N, K) -- the megakernel's GEMMs at the bench shapes (bench_moe.py)
SHAPES = {
    "dense_8192": (1, 8192, 8192, 8192),
    "dsv3slice_gate_up": (32, 2048, 4096, 7168),   # deepseek-v3 EP = 8 slice, T = 8192, k = 8
    "dsv3slice_down": (32, 2048, 7168, 2048),
    "qwen3_gate_up": (128, 1024, 1536, 2048),      # qwen3-30b-a3b, T = 16384, k = 8
    "qwen3_down": (128, 1024, 2048, 768),
}


def _events_ms(torch, fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    ev[0].record()
    for i in range(iters):
        fn()
        ev[i + 1].record()
    ev[-1].synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(iters))


def _rel(torch, a, b) -> float:
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def run_shape(name: str, iters: int) -> list[dict]:
    import torch
    import test_fp8_gemm_probe_gpu as P
    import test_fp8_mc_probe_gpu as M
    from _gpu import cp, median_launch_ms

    groups, rows, n, k = SHAPES[name]
    m, kb, nb = groups * rows, -(-k // 128), -(-n // 128)
    flops = 2.0 * m * n * k
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(len(name))
    # E4M3 operands: Gaussian values (not zeros), saturated to +-448, bytes without NaN.
    qa = (torch.randn(m, k, device=dev, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    qb = (torch.randn(groups, n, k, device=dev, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    sa_km = (torch.rand(kb, m, device=dev, generator=g) + 0.5) / 448          # [KB, M]: the probe's layout
    sb = (torch.rand(groups, nb, kb, device=dev, generator=g) + 0.5) / 448    # [G, NB, KB]
    res: list[dict] = []

    def record(engine, ms, **extra):
        r = {"shape": name, "engine": engine, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), **extra}
        print(json.dumps(r), flush=True)
        res.append(r)

    # cuBLAS block-scaled, one call per group (cuBLAS has no grouped block-scaled GEMM); as one
    # dense GEMM when there is one group, or over the concatenated rows with group 0's weights
    # (same FLOPs and bytes as the grouped problem; the bits are not compared then).
    l4 = -(-kb // 4) * 4
    sa_t = sa_km.t()                                                           # [M, KB], stride (1, M)

    def sb_torch(gi):                                                          # [L4, NB], stride (1, L4)
        pad = torch.zeros(nb, l4, device=dev)
        pad[:, :kb] = sb[gi]
        return pad.t()

    sb0 = sb_torch(0)
    cublas_out = None
    try:
        fn = lambda: torch._scaled_mm(qa, qb[0].t(), sa_t, sb0, out_dtype=torch.bfloat16)  # noqa: E731
        cublas_out = fn()
        record("cublas_block_1x128_128x128", _events_ms(torch, fn, iters),
               note="dense over all rows with group 0's weights" if groups > 1 else "")
    except Exception as ex:  # noqa: BLE001 -- reported, the other engines still run
        print(f"cuBLAS block-scaled {name}: {type(ex).__name__}: {ex}"[:400], flush=True)

    one = torch.ones((), device=dev)
    try:
        fn = lambda: torch._scaled_mm(qa, qb[0].t(), one, one, out_dtype=torch.bfloat16)  # noqa: E731
        fn()
        record("cublas_fp8_per_tensor", _events_ms(torch, fn, iters))
    except Exception as ex:  # noqa: BLE001
        print(f"cuBLAS per-tensor {name}: {type(ex).__name__}: {ex}"[:400], flush=True)

    a16 = qa.to(torch.bfloat16)
    b16 = qb[0].to(torch.bfloat16)
    record("cublas_bf16", _events_ms(torch, lambda: torch.mm(a16, b16.t()), iters))
    del a16, b16

    # mok_rt's probe: the same bytes and scales (CuPy views through DLPack).
    stream = cp.cuda.Stream(non_blocking=True)
    qa_c = cp.from_dlpack(qa.view(torch.uint8))
    qb_c = cp.from_dlpack(qb.view(torch.uint8))
    sa_c, sb_c = cp.from_dlpack(sa_km), cp.from_dlpack(sb)
    first = {}   # the plain probe's bits per label: every other engine must match them
    engines = [(name, lambda _name=name, **kw: P.Gemm(kernel=_name, **kw)) for name in P.KERNELS]
    engines += [("fp8_gemm_probe_mc", M.Mc), ("fp8_gemm_probe_mc_own", lambda **kw: M.Mc(kernel=M.CONTROL, **kw)),
                ("fp8_gemm_probe_lean_mc", lambda **kw: M.Mc(kernel=M.LEAN, **kw))]
    for kernel, make in engines:
        for label, grp in (("dense", False), ("grouped", True)):
            if not grp and groups > 1:
                gm = make(rows=[m], n=n, k=k, qa=qa_c, sa_kmajor=sa_c, qb=qb_c[:1], sb=sb_c[:1], c_bf16=True)
            elif grp:
                gm = make(rows=[rows] * groups, n=n, k=k, qa=qa_c, sa_kmajor=sa_c, qb=qb_c, sb=sb_c, c_bf16=True)
            else:
                continue
            c = gm.run(stream)
            extra = {"resident_clusters": gm.resident_clusters()} if hasattr(gm, "resident_clusters") else {}
            if cublas_out is not None and (not grp or groups == 1):   # the same product as cuBLAS's
                got = torch.from_dlpack(c.view(cp.uint16)).view(torch.bfloat16)
                extra["rel_vs_cublas"] = float(f"{_rel(torch, got, cublas_out):.3g}")
            bits = c.view(cp.uint16)
            if label in first:
                extra["same_bits_as_plain"] = bool(cp.array_equal(bits, first[label]))
            else:
                first[label] = bits.copy()
            ms = median_launch_ms(gm.launch, stream, iters=iters)
            record(f"mok_probe_{kernel.removeprefix('fp8_gemm_probe').strip('_') or 'plain'}_{label}", ms, **extra)
            del gm, c, bits
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    out = []
    for name in args.shapes.split(","):
        out += run_shape(name, args.iters)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\n{'shape':20} {'engine':30} {'ms':>7} {'TFLOP/s':>8}  rel_vs_cublas  same_bits_as_plain")
    for r in out:
        print(f"{r['shape']:20} {r['engine']:30} {r['ms']:7.3f} {r['tflops']:8.1f}  {r.get('rel_vs_cublas', ''):13}"
              f"  {r.get('same_bits_as_plain', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
