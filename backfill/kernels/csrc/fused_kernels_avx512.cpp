// AVX-512 build of the decoder kernels (W = 16). See fused_kernels_impl.h and isa.h.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

#include <cstdint>

namespace backfill {
namespace {
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));  // W halves
inline vf fmadd(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
inline vf splat(float s) { return (vf)_mm512_set1_ps(s); }
inline vf rcp_estimate(vf d) { return (vf)_mm512_rcp14_ps((__m512)d); }  // 12+ bits
// 16 bf16 bit patterns as fp32s (each the high half of its lane, the low half zero): one word
// permute with a zeroing mask, where a zero-extension and a shift took two operations.
inline vf load_bf16(const uint16_t* p) {
  const __m512i words = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i index = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0, 4, 0,
                                         3, 0, 2, 0, 1, 0, 0, 0);
  return (vf)_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, index, words);
}
inline vf widen_f16(vh h) { return (vf)_mm512_cvtph_ps((__m256i)h); }
// 16 bytes as the high bytes of 16 words (low bytes zero): the bytes in both 128-bit lanes (a
// load), then one byte shuffle, where a zero-extension and a shift took two operations.
inline vh load_u8_high(const uint8_t* p) {
  const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i index = _mm256_setr_epi8(-1, 0, -1, 1, -1, 2, -1, 3, -1, 4, -1, 5, -1, 6, -1, 7,  //
                                         -1, 8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14, -1, 15);
  return (vh)_mm256_shuffle_epi8(bytes, index);
}
inline vf load_f16(const uint16_t* p) {
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline float f16_to_float(uint16_t h) { return _cvtsh_ss(h); }
}  // namespace
}  // namespace backfill

#define BF_LANES 16
#define BF_TABLE decoder_kernels_avx512
#define BF_NAME "avx512"
#include "fused_kernels_impl.h"
