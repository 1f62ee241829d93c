// pack_x's few-row fast path (qgemm_kernels.h) with 256-bit registers, for the units built with
// AVX2 (qgemm_avx2.cpp, qgemm_avx512.cpp): included after their `#pragma GCC target` and
// <immintrin.h>; internal linkage, as isa.h requires.
#pragma once

#include "packed.h"

namespace backfill {
namespace {

// out[k][mr] = x[0 .. mr - 1][k] (x rows ldx floats apart; times scale[k % 8] where it is not 1
// and scale is not null: the products pack_x's scalar loop takes) for k < cols rounded down to 8,
// mr <= 8: 8 x 8 blocks transposed in registers, each column stored as 8 floats whose lanes past
// mr the next column overwrites (the block's last column of all: a masked store). A scalar copy
// of a few rows stored one float at a time, then scaled them in a second pass: on a Zen 4 EPYC
// forced to AVX2, ~2.5% of a 32-decode step. Returns the columns done (0 for mr > 8).
inline __attribute__((always_inline)) int64_t pack_x8(const float* x, int64_t ldx, int64_t cols, int mr,
                                                       float* out, const float* scale) {
  const int64_t end = cols / 8 * 8;
  if (mr > 8 || mr < 1 || end == 0) return 0;
  const float* row[8];
  for (int i = 0; i < 8; ++i) row[i] = x + (i < mr ? i : mr - 1) * ldx;  // lanes past mr: any row's
  const __m256i kept = _mm256_cmpgt_epi32(_mm256_set1_epi32(mr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int64_t k0 = 0; k0 < end; k0 += 8) {
    __m256 r[8], t[8], s[8], c[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(row[i] + k0);
    for (int p = 0; p < 4; ++p) {  // t[2p], t[2p + 1]: rows 2p, 2p + 1 interleaved
      t[2 * p] = _mm256_unpacklo_ps(r[2 * p], r[2 * p + 1]);
      t[2 * p + 1] = _mm256_unpackhi_ps(r[2 * p], r[2 * p + 1]);
    }
    for (int h = 0; h < 2; ++h) {  // s[4h + j]: column j (128-bit lane 0) and j + 4 (lane 1) of rows 4h .. 4h + 3
      s[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
      s[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
      s[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
      s[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
    }
    for (int j = 0; j < 4; ++j) {
      c[j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x20);
      c[j + 4] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x31);
    }
    for (int j = 0; j < 8; ++j) {
      const float s = scale != nullptr ? scale[j] : 1.0f;  // (k0 % 8 == 0)
      if (s != 1.0f) c[j] = _mm256_mul_ps(c[j], _mm256_set1_ps(s));
      float* dst = out + (k0 + j) * mr;
      if (j == 7 && k0 + 8 == end) _mm256_maskstore_ps(dst, kept, c[j]);
      else _mm256_storeu_ps(dst, c[j]);
    }
  }
  return end;
}

}  // namespace
}  // namespace backfill
