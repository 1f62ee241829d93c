// AVX-512 (F, BW, VL, DQ) kernels (Skylake-X, Ice Lake, Zen 4 and later). See isa.h.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

#include "isa.h"
#include "qgemm.h"

namespace backfill {

bool qgemm_avx512_supports(QType) { return false; }  // TODO: vectorized kernels

void qgemm_avx512(const float* x, int64_t m, int64_t ldx, const QMatrix& w, const float* bias, float* y,
                int64_t ldy, int64_t n_begin, int64_t n_end) {
  qgemm_ref(x, m, ldx, w, bias, y, ldy, n_begin, n_end);
}

}  // namespace backfill
