// The accumulator operands of the wgmma.mma_async wrappers (common/wgmma.cuh, common/wgmma_fp8.cuh),
// written once.  Inline asm needs every register spelled out twice: as a PTX placeholder in the
// instruction text ("%0, %1, ..., %(n-1)": MOK_WGMMA_D<n>) and as a "+f" constraint on d[0 .. n-1]
// (MOK_WGMMA_ACC<n>(d)), for the accumulator counts the wrappers use: N / 2 for m64nN (32, 64, 80,
// 96, 128).  The operands after them (descriptors, scale-d, transposes) are numbered from n on.
#pragma once

#define MOK_WGMMA_P0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define MOK_WGMMA_P16 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MOK_WGMMA_P32 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define MOK_WGMMA_P48 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MOK_WGMMA_P64 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define MOK_WGMMA_P80 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define MOK_WGMMA_P96 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
#define MOK_WGMMA_P112 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

#define MOK_WGMMA_D32 MOK_WGMMA_P0 ", " MOK_WGMMA_P16
#define MOK_WGMMA_D64 MOK_WGMMA_D32 ", " MOK_WGMMA_P32 ", " MOK_WGMMA_P48
#define MOK_WGMMA_D80 MOK_WGMMA_D64 ", " MOK_WGMMA_P64
#define MOK_WGMMA_D96 MOK_WGMMA_D80 ", " MOK_WGMMA_P80
#define MOK_WGMMA_D128 MOK_WGMMA_D96 ", " MOK_WGMMA_P96 ", " MOK_WGMMA_P112

#define MOK_WGMMA_ACC8(d, b) \
  "+f"(d[b + 0]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), "+f"(d[b + 6]), "+f"(d[b + 7])
#define MOK_WGMMA_ACC16(d, b) MOK_WGMMA_ACC8(d, b), MOK_WGMMA_ACC8(d, b + 8)
#define MOK_WGMMA_ACC32(d) MOK_WGMMA_ACC16(d, 0), MOK_WGMMA_ACC16(d, 16)
#define MOK_WGMMA_ACC64(d) MOK_WGMMA_ACC32(d), MOK_WGMMA_ACC16(d, 32), MOK_WGMMA_ACC16(d, 48)
#define MOK_WGMMA_ACC80(d) MOK_WGMMA_ACC64(d), MOK_WGMMA_ACC16(d, 64)
#define MOK_WGMMA_ACC96(d) MOK_WGMMA_ACC80(d), MOK_WGMMA_ACC16(d, 80)
#define MOK_WGMMA_ACC128(d) MOK_WGMMA_ACC96(d), MOK_WGMMA_ACC16(d, 96), MOK_WGMMA_ACC16(d, 112)
