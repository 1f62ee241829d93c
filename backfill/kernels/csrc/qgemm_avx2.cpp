// AVX2 + FMA + F16C kernels (x86-64 CPUs since Haswell / Zen): VF = two ymm. See isa.h and
// qgemm_kernels.h.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "isa.h"

namespace backfill {
namespace {

#define AI inline __attribute__((always_inline))

struct VF {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
struct VI {
  __m256i lo, hi;
};

// Lane masks for the first n of 16 lanes (maskload / maskstore read the sign bits).
AI __m256i lanes_below(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
AI VF vf_zero() { return VF{_mm256_setzero_ps(), _mm256_setzero_ps()}; }
AI VF vf_set1(float f) { return VF{_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
AI VF vf_load(const float* p) { return VF{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
AI void vf_store(float* p, VF a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
AI VF vf_load_n(const float* p, int n) {
  return VF{_mm256_maskload_ps(p, lanes_below(n)), _mm256_maskload_ps(p + 8, lanes_below(n - 8))};
}
AI void vf_store_n(float* p, VF a, int n) {
  _mm256_maskstore_ps(p, lanes_below(n), a.lo);
  _mm256_maskstore_ps(p + 8, lanes_below(n - 8), a.hi);
}
AI VF vf_bcast(const float* p) {
  const __m256 b = _mm256_broadcast_ss(p);
  return VF{b, b};
}
AI VF vf_fma(VF a, VF b, VF c) { return VF{_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
AI VF vf_mul(VF a, VF b) { return VF{_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
AI VF vf_add(VF a, VF b) { return VF{_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
AI VF vf_load_f16(const uint8_t* p) {
  return VF{_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
// Two 8-byte loads, each widened by one vpmovzxbd / vpmovsxbd with a memory operand.
AI VI vi_load_u8(const uint8_t* p) {
  return VI{_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
AI VI vi_load_s8(const uint8_t* p) {
  return VI{_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
AI VI vi_load_u32(const uint8_t* p) {
  return VI{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
AI VI vi_and_bcast(VI a, const uint32_t* m) {
  const __m256i mm = _mm256_set1_epi32(static_cast<int>(*m));
  return VI{_mm256_and_si256(a.lo, mm), _mm256_and_si256(a.hi, mm)};
}
AI VI vi_and(VI a, int m) {
  const __m256i mm = _mm256_set1_epi32(m);
  return VI{_mm256_and_si256(a.lo, mm), _mm256_and_si256(a.hi, mm)};
}
template <int S>
AI VI vi_srl(VI a) { return VI{_mm256_srli_epi32(a.lo, S), _mm256_srli_epi32(a.hi, S)}; }
template <int S>
AI VI vi_sll(VI a) { return VI{_mm256_slli_epi32(a.lo, S), _mm256_slli_epi32(a.hi, S)}; }
AI VI vi_or_and(VI a, VI b, int m) {
  const VI bm = vi_and(b, m);
  return VI{_mm256_or_si256(a.lo, bm.lo), _mm256_or_si256(a.hi, bm.hi)};
}
AI VF vi_to_f(VI a) { return VF{_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
AI VF vf_nib_lo(VI a) { return vi_to_f(vi_and(a, 0xF)); }

// block_sum's order (packed.h): lanes l + (l + 8), then + (l + 4), + (l + 2), + (l + 1).
AI float vf_block_tree(VF a) {
  const __m256 h = _mm256_add_ps(a.lo, a.hi);
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}

// pack_x's 16-row fast path: AVX2 blocks are at most 6 rows (kFusedMaxM, kPanelMaxMR below), so
// it is never reached here; all columns are left to pack_x's scalar copy.
AI int64_t pack_x16(const float*, int64_t, int64_t, float*) { return 0; }

#undef AI

// Blocking (16 ymm): fused MR x NT x 2 accumulators; panels (9+ rows) run 6 x 16 (12
// accumulators, 2 weight registers, a broadcast).
constexpr int kFusedMaxM = 4;
// 5-8 rows: two fused halves (on a Zen 5 EPYC running these AVX2 kernels, BACKFILL_ISA=avx2:
// the decode step at batch 8 10-15% faster than on the panels, batch 6 the same; not measured on
// an AVX2-only CPU).
constexpr bool kFusedHalves = true;
constexpr int fused_nt(int mr) { return mr == 1 ? 2 : 1; }  // (factored sums at one row: 4 tiles 9-11% slower)
constexpr int kVfRegs = 8;  // VF registers (16 ymm: 8 VF)
constexpr int kPanelNT = 1;
constexpr int kPanelMaxMR = 6;
// The block types' panels: 6 x 16 with their sums y in memory (3 x 16 with y in registers ran
// ~35% slower).
constexpr int kPanelMaxMRF = 6;
constexpr int64_t kPanelKc = 256;  // a panel of 16 KB

}  // namespace
}  // namespace backfill

#include "qgemm_kernels.h"

namespace backfill {

void packed_gemm_avx2(const TileJob& job) { run_packed_gemm(job); }

}  // namespace backfill
