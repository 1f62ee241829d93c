// AVX-512 build of the decoder kernels (W = 16). See fused_kernels_impl.h and isa.h.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

#include <cstdint>

namespace backfill {
namespace {
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
inline vf fmadd(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
inline vf splat(float s) { return (vf)_mm512_set1_ps(s); }
inline vf rcp_estimate(vf d) { return (vf)_mm512_rcp14_ps((__m512)d); }  // 12+ bits
}  // namespace
}  // namespace backfill

#define BF_LANES 16
#define BF_TABLE decoder_kernels_avx512
#define BF_NAME "avx512"
#include "fused_kernels_impl.h"
