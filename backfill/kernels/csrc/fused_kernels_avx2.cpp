// AVX2 + FMA build of the decoder kernels (W = 8). See fused_kernels_impl.h and isa.h.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include <cstdint>

namespace backfill {
namespace {
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
inline vf fmadd(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
inline vf splat(float s) { return (vf)_mm256_set1_ps(s); }
inline vf rcp_estimate(vf d) { return (vf)_mm256_rcp_ps((__m256)d); }  // 12+ bits
}  // namespace
}  // namespace backfill

#define BF_LANES 8
#define BF_TABLE decoder_kernels_avx2
#define BF_NAME "avx2"
#include "fused_kernels_impl.h"
