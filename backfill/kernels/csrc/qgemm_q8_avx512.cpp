// The int8-activation kernels (q8.h) on AVX-512 VNNI (Ice Lake, Cascade Lake, Zen 4 and later):
// one vpdpbusd per 64 code x activation products. A unit of its own: its target adds VNNI,
// which AVX-512 CPUs without it (Skylake-X) lack; they run the AVX2 kernels (isa.h).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include "simd_avx512.h"

namespace backfill {
namespace {

inline __attribute__((always_inline)) VI vi_zero() { return VI{_mm512_setzero_si512()}; }
inline __attribute__((always_inline)) VI vq_dot(VI acc, VI a, int32_t word) {
  return VI{_mm512_dpbusd_epi32(acc.v, a.v, _mm512_set1_epi32(word))};
}

// One row: 4 tiles (8 nibble registers, 4 sums, 4 y); more rows: 2 tiles x 4 rows (8 sums, 8 y).
constexpr int kQ8NT1 = 4;
constexpr int kQ8NT = 2;
constexpr int kQ8MR = 4;

}  // namespace
}  // namespace backfill

#include "qgemm_kernels.h"
#include "q8_kernels.h"

namespace backfill {

void q8_gemm_avx512vnni(const Q8Job& job) { run_q8_gemm(job); }

void quantize_rows_q8_avx512(const float* x, int64_t m, int64_t ldx, int64_t cols, uint8_t* q, float* d, float* s) {
  // bytes 0 .. 15 of a block in dot order (q8_dot_column): columns 0, 2, 4, 6, 1, 3, 5, 7, 8, ..
  const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  const int64_t nb = cols / 32;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b, q += 32, ++d, ++s) {
      const __m512 a = _mm512_loadu_ps(x + i * ldx + 32 * b), c = _mm512_loadu_ps(x + i * ldx + 32 * b + 16);
      const bool nan = (_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q)) != 0;
      const float amax = nan ? __builtin_nanf("") : _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
      const float scale = q8_scale(amax);
      const __m512 inv = _mm512_set1_ps(q8_inverse(scale));
      __m512i sum = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(order, h == 0 ? a : c), inv);
        v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_min_ps(_mm512_max_ps(v, lo), hi));
        const __m512i r = _mm512_cvtps_epi32(v);  // round to nearest even (the default MXCSR)
        sum = _mm512_add_epi32(sum, r);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(r));
      }
      *d = scale;
      *s = scale * static_cast<float>(_mm512_reduce_add_epi32(sum));
    }
  }
}

}  // namespace backfill
