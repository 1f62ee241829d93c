// AVX2 + FMA build of the decoder kernels (W = 8). See fused_kernels_impl.h and isa.h.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include <cstdint>

namespace backfill {
namespace {
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint16_t vh __attribute__((vector_size(16)));  // W halves
inline vf fmadd(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
inline vf splat(float s) { return (vf)_mm256_set1_ps(s); }
inline vf rcp_estimate(vf d) { return (vf)_mm256_rcp_ps((__m256)d); }  // 12+ bits
// 8 bf16 bit patterns as fp32s (each the high half of its lane): the 16 bytes in both 128-bit
// lanes (a load), then one byte shuffle (words 0-3 to lane 0, 4-7 to lane 1, low halves zeroed).
inline vf load_bf16(const uint16_t* p) {
  const __m256i words = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i index = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,  //
                                         -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
  return (vf)_mm256_shuffle_epi8(words, index);
}
inline vf widen_f16(vh h) { return (vf)_mm256_cvtph_ps((__m128i)h); }
// 8 bytes as the high bytes of 8 words (low bytes zero): one interleave with zeros.
inline vh load_u8_high(const uint8_t* p) {
  return (vh)_mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline vf load_f16(const uint16_t* p) {
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float f16_to_float(uint16_t h) { return _cvtsh_ss(h); }
}  // namespace
}  // namespace backfill

#define BF_LANES 8
#define BF_TABLE decoder_kernels_avx2
#define BF_NAME "avx2"
#include "fused_kernels_impl.h"
