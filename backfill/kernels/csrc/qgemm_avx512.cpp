// AVX-512 (F, BW, VL, DQ) kernels (Skylake-X, Ice Lake, Zen 4 and later): VF = one zmm. See isa.h,
// simd_avx512.h and qgemm_kernels.h.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include "simd_avx512.h"

#include "qgemm_kernels.h"

namespace backfill {

void packed_gemm_avx512(const TileJob& job) { run_packed_gemm(job); }

}  // namespace backfill
