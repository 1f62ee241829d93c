// Per-instruction-set kernel entry points. Each lives in its own translation unit compiled
// for that ISA via `#pragma GCC target` (so one binary runs on any x86-64 CPU and picks its
// kernels at run time); those units include no torch or STL headers, so no inline function
// compiled for AVX-512 can be linked into code that runs on an AVX2-only CPU. Their helpers
// are static / in anonymous namespaces for the same reason.
#pragma once

#include "packed.h"

namespace backfill {

// Run one TileJob (see packed.h); all three give bit-identical y.
void packed_gemm_avx512(const TileJob& job);  // qgemm_avx512.cpp: AVX-512 F/BW/VL/DQ + FMA + F16C
void packed_gemm_avx2(const TileJob& job);    // qgemm_avx2.cpp: AVX2 + FMA + F16C
void packed_gemm_scalar(const TileJob& job);  // repack.cpp: portable C++ (fmaf chains)

}  // namespace backfill
