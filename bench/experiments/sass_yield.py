"""Experiment: set the yield hint on the promotion FFMAs of FP8 GEMM kernels in a cubin.

    python bench/experiments/sass_yield.py IN.cubin OUT.cubin KERNEL [KERNEL ...] [--min-run 16]

sm_90 SASS is 128-bit; the scheduling control bits sit in the high 64-bit word: bit 45 is the
yield hint (0: the warp scheduler may switch warps after this instruction), bits 58..61 the
operand-reuse flags (a reused operand needs the warp to issue again, so a yielding instruction
must not set them).  ptxas already leaves every other FFMA of a promotion yielding; this clears
the reuse flags and the no-yield bit on the rest of every run of >= min-run register-form FFMAs
(opcode 0x223), so the other warpgroup's wgmma issue is not held behind 64 FFMAs.  Prints what
it changed per kernel.  Arithmetic is unchanged (reuse is a register-file cache hint only).
"""
from __future__ import annotations

import argparse
import struct
import sys

NO_YIELD = 1 << 45
REUSE = 0xF << 58
OPC_FFMA_RRR = 0x223


def sections(elf: bytes) -> dict[str, tuple[int, int]]:
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    hdr = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    stroff = hdr[shstrndx][4]
    out = {}
    for name, _type, _flags, _addr, off, size in hdr:
        end = elf.index(b"\0", stroff + name)
        out[elf[stroff + name:end].decode()] = (off, size)
    return out


def patch(elf: bytearray, kernel: str, min_run: int) -> tuple[int, int]:
    off, size = sections(bytes(elf))[f".text.{kernel}"]
    n = size // 16
    is_ffma = [struct.unpack_from("<Q", elf, off + 16 * i)[0] & 0xFFF == OPC_FFMA_RRR for i in range(n)]
    runs = changed = 0
    i = 0
    while i < n:
        j = i
        while j < n and is_ffma[j]:
            j += 1
        if j - i >= min_run:
            runs += 1
            for k in range(i, j):
                at = off + 16 * k + 8
                hi, = struct.unpack_from("<Q", elf, at)
                new = hi & ~(REUSE | NO_YIELD)
                if new != hi:
                    struct.pack_into("<Q", elf, at, new)
                    changed += 1
        i = max(j, i + 1)
    return runs, changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("kernels", nargs="+")
    ap.add_argument("--min-run", type=int, default=16)
    a = ap.parse_args(argv)
    elf = bytearray(open(a.src, "rb").read())
    for k in a.kernels:
        runs, changed = patch(elf, k, a.min_run)
        print(f"{k}: {runs} FFMA runs, {changed} instructions changed")
    open(a.dst, "wb").write(elf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
