// The AVX-512 (F, BW, VL, DQ) vector primitives and blocking constants of the packed kernels
// (qgemm_kernels.h): VF = one zmm. Included by the AVX-512 translation units only
// (qgemm_avx512.cpp, qgemm_q8_avx512.cpp), after their `#pragma GCC target`; internal linkage,
// as isa.h requires.
#pragma once
#include <immintrin.h>

#include "isa.h"

namespace backfill {
namespace {

#define AI inline __attribute__((always_inline))

struct VF {
  __m512 v;
};
struct VI {
  __m512i v;
};

AI __mmask16 first_n(int n) { return static_cast<__mmask16>((1u << n) - 1); }
AI VF vf_zero() { return VF{_mm512_setzero_ps()}; }
AI VF vf_set1(float f) { return VF{_mm512_set1_ps(f)}; }
AI VF vf_load(const float* p) { return VF{_mm512_loadu_ps(p)}; }
AI void vf_store(float* p, VF a) { _mm512_storeu_ps(p, a.v); }
AI VF vf_load_n(const float* p, int n) { return VF{_mm512_maskz_loadu_ps(first_n(n), p)}; }
AI void vf_store_n(float* p, VF a, int n) { _mm512_mask_storeu_ps(p, first_n(n), a.v); }
AI VF vf_bcast(const float* p) { return VF{_mm512_set1_ps(*p)}; }
AI VF vf_fma(VF a, VF b, VF c) { return VF{_mm512_fmadd_ps(a.v, b.v, c.v)}; }
AI VF vf_mul(VF a, VF b) { return VF{_mm512_mul_ps(a.v, b.v)}; }
AI VF vf_add(VF a, VF b) { return VF{_mm512_add_ps(a.v, b.v)}; }
AI VF vf_load_f16(const uint8_t* p) {
  return VF{_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
AI VI vi_load_u8(const uint8_t* p) {
  return VI{_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
AI VI vi_load_s8(const uint8_t* p) {
  return VI{_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
AI VI vi_load_u32(const uint8_t* p) { return VI{_mm512_loadu_si512(p)}; }
AI VI vi_and_bcast(VI a, const uint32_t* m) { return VI{_mm512_and_si512(a.v, _mm512_set1_epi32(static_cast<int>(*m)))}; }
AI VI vi_and(VI a, int m) { return VI{_mm512_and_si512(a.v, _mm512_set1_epi32(m))}; }
template <int S>
AI VI vi_srl(VI a) { return VI{_mm512_srli_epi32(a.v, S)}; }
AI VF vi_to_f(VI a) { return VF{_mm512_cvtepi32_ps(a.v)}; }
AI VF vi_as_f(VI a) { return VF{_mm512_castsi512_ps(a.v)}; }
// float(v & 15) as a table lookup: vpermps reads only the low 4 bits of each index, so this is
// one shuffle instead of an and plus a conversion (the same exact values).
AI VF vf_nib_lo(VI a) {
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return VF{_mm512_permutexvar_ps(a.v, table)};
}

// block_sum's order (packed.h): lanes l + (l + 8), then + (l + 4), + (l + 2), + (l + 1).
AI float vf_block_tree(VF a) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}

// Column k of pack_x16's output: v (x's 16 rows at column k), scaled as pack_x scales it
// (scale: by k % 8, or null).
AI void put_column(float* out, int64_t k, __m512 v, const float* scale) {
  const float s = scale != nullptr ? scale[k % 8] : 1.0f;
  _mm512_storeu_ps(out + k * 16, s != 1.0f ? _mm512_mul_ps(v, _mm512_set1_ps(s)) : v);
}

// out[k][16] = x[0 .. 15][k] for k < cols rounded down to 16 (x rows ldx floats apart; times
// scale[k % 8] where it is not 1 and scale is not null, as pack_x's scalar loop): 16 x 16 blocks
// transposed in registers (unpacks within 128-bit lanes, then a 4 x 4 transpose of the lanes),
// where a scalar copy stores every float on a line of its own. Returns the columns done.
AI int64_t pack_x16(const float* x, int64_t ldx, int64_t cols, float* out, const float* scale) {
  int64_t k0 = 0;
  for (; k0 + 16 <= cols; k0 += 16) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(x + i * ldx + k0);
    for (int p = 0; p < 8; ++p) {
      t[2 * p] = _mm512_unpacklo_ps(r[2 * p], r[2 * p + 1]);
      t[2 * p + 1] = _mm512_unpackhi_ps(r[2 * p], r[2 * p + 1]);
    }
    for (int q = 0; q < 16; q += 4) {  // r[q + c], 128-bit lane L: column 4 L + c of rows q .. q + 3
      const __m512d a = _mm512_castps_pd(t[q]), b = _mm512_castps_pd(t[q + 1]);
      const __m512d c = _mm512_castps_pd(t[q + 2]), d = _mm512_castps_pd(t[q + 3]);
      r[q] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
      r[q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
      r[q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
      r[q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int c = 0; c < 4; ++c) {
      const __m512 v0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
      const __m512 v2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
      const __m512 v3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
      put_column(out, k0 + c, _mm512_shuffle_f32x4(v0, v2, 0x88), scale);
      put_column(out, k0 + 4 + c, _mm512_shuffle_f32x4(v0, v2, 0xDD), scale);
      put_column(out, k0 + 8 + c, _mm512_shuffle_f32x4(v1, v3, 0x88), scale);
      put_column(out, k0 + 12 + c, _mm512_shuffle_f32x4(v1, v3, 0xDD), scale);
    }
  }
  return k0;
}

#undef AI

}  // namespace
}  // namespace backfill

#include "pack_x8.h"

namespace backfill {
namespace {

// Blocking (32 zmm): fused MR x NT accumulators + NT weights + scales stay in registers (one row
// takes 6 tiles: more weight streams in flight, +7-9% on a step from memory vs 4; 7 and 8
// spill); 9-16 rows take one tile (up to 16 accumulators; on a Zen 5 EPYC the step at batch 9-16
// ran 8-25% faster than on the panels, its linears ~25%); panels (F32 weights) run 12 x 32 (24
// accumulators, 2 weight vectors, broadcasts).
constexpr int kFusedMaxM = 16;
// 17+ rows: fused groups of up to 16 rows, each tile's passes back to back, for every type and
// row count (panels: F32 only). On a Zen 5 EPYC the LM head at 32 rows 4.5 -> 4.1 ms, the decode
// step at batch 20 8% and at 32 6% faster than on the panels; on a Zen 4 EPYC (2 threads) the
// decode step at batch 36-64 1-4%, a [3072, 768] matrix at 256 rows 3-22% (F16 22, Q4_1 17, Q8_0
// 10, Q4_K 9, Q4_0 5, Q6_K 3) and at 1,024 rows 2-6%, the default model's prompt linears 7-10%.
constexpr int kFusedGroupMR = 16;
constexpr int64_t fused_groups_max_m(QType) { return INT64_MAX; }
constexpr int fused_nt(int mr) { return mr == 1 ? 6 : mr <= 2 ? 4 : mr <= 4 ? 3 : mr <= 8 ? 2 : 1; }
// The subnormal form keeps the nibble words in registers (qgemm_kernels.h: nibble_codes_from_memory).
constexpr bool kSubCodesFromMemory = false;
constexpr int kNibbleWordTiles = 0;  // (no nibble_word_fma4: see qgemm_avx2.cpp)
void nibble_word_fma4(VF (&)[4], const uint8_t* const*, const float*, const uint32_t*);
constexpr int kVfRegs = 32;  // VF registers (32 zmm)
constexpr int kPanelNT = 2;
constexpr int kPanelMaxMR = 12;
// The block types' panels: 6 x 32, their sums y in registers beside the 12 code sums (12 x 32
// with y in memory: prompt-sized GEMMs 8-11% slower than dequantized panels, 6 x 32 2-5%; 7 x 32
// spills).
constexpr int kPanelMaxMRF = 6;
constexpr int64_t kPanelKc = 192;  // 2 panels of 12 KB

}  // namespace
}  // namespace backfill

