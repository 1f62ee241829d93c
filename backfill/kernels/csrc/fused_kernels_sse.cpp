// Baseline x86-64 (SSE2) build of the decoder kernels (W = 4), for CPUs without AVX2 and for
// head_dim not a multiple of 8. See fused_kernels_impl.h.
#include <emmintrin.h>

#include <cstdint>

namespace backfill {
namespace {
typedef float vf __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(16)));
typedef uint16_t vh __attribute__((vector_size(8)));  // W halves
inline vf fmadd(vf a, vf b, vf c) { return a * b + c; }  // no FMA in the baseline: two roundings
inline vf splat(float s) { return (vf)_mm_set1_ps(s); }
inline vf rcp_estimate(vf d) { return (vf)_mm_rcp_ps((__m128)d); }  // 12+ bits
// 4 bf16 bit patterns as fp32s: interleaved with zero words below them.
inline vf load_bf16(const uint16_t* p) {
  const __m128i words = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm_unpacklo_epi16(_mm_setzero_si128(), words);
}
// IEEE halves to fp32 without F16C (not in the baseline), exactly: normals rebias the exponent,
// subnormals are their significand times 2^-24, infinities and NaNs keep an all-ones exponent.
inline vf widen_f16(vh halves) {
  const vi h = __builtin_convertvector(halves, vi);
  const vi em = h & 0x7fff, sign = (h & 0x8000) << 16;
  const vf normal = (vf)((em << 13) + (112 << 23));
  const vf subnormal = __builtin_convertvector(em, vf) * (vf{} + 0x1p-24f);
  vf r = em < 0x400 ? subnormal : normal;
  r = em >= 0x7c00 ? (vf)((em << 13) | 0x7f800000) : r;
  return (vf)((vi)r | sign);
}
// 4 bytes as the high bytes of 4 words (low bytes zero): one interleave with zeros.
inline vh load_u8_high(const uint8_t* p) {
  uint32_t bytes;
  __builtin_memcpy(&bytes, p, sizeof bytes);
  const __m128i w = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_cvtsi32_si128(static_cast<int>(bytes)));
  vh h;
  __builtin_memcpy(&h, &w, sizeof h);
  return h;
}
inline vf load_f16(const uint16_t* p) {
  vh h;
  __builtin_memcpy(&h, p, sizeof h);
  return widen_f16(h);
}
inline float f16_to_float(uint16_t h) {
  const uint16_t words[4] = {h, 0, 0, 0};
  return load_f16(words)[0];
}
}  // namespace
}  // namespace backfill

#define BF_LANES 4
#define BF_TABLE decoder_kernels_sse
#define BF_NAME "sse"
#include "fused_kernels_impl.h"
