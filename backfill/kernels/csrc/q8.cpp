// The int8-activation path's portable parts (q8.h): the quantization of x, shared by every ISA,
// and the scalar kernel, whose numbers the SIMD kernels reproduce bit for bit.
#include "q8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "qgemm.h"
#include "repack.h"

namespace backfill {

void quantize_rows_q8(const float* x, int64_t m, int64_t ldx, int64_t cols, uint8_t* q, float* d, float* s) {
  const int64_t nb = cols / 32;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + i * ldx + 32 * b;
      float amax = 0.0f;
      bool nan = false;
      for (int k = 0; k < 32; ++k) {
        const float a = std::fabs(xb[k]);
        nan = nan || a != a;
        amax = a > amax ? a : amax;
      }
      if (nan) amax = NAN;  // a NaN in x gives NaN sums, as the fp32 path does
      const float scale = q8_scale(amax), inv = q8_inverse(scale);
      int32_t sum = 0;
      int8_t* qb = reinterpret_cast<int8_t*>(q + (i * nb + b) * 32);
      for (int j = 0; j < 32; ++j) {
        float v = xb[q8_dot_column(j)] * inv;  // |v| <= 127 up to a rounding of inv: clamped
        v = v != v ? 0.0f : v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;  // (NaN: the scale carries it)
        const int32_t r = static_cast<int32_t>(std::nearbyint(v));
        qb[j] = static_cast<int8_t>(r);
        sum += r;
      }
      d[i * nb + b] = scale;
      s[i * nb + b] = scale * static_cast<float>(sum);
    }
  }
}

void q8_gemm_scalar(const Q8Job& job) {
  const int64_t nb = job.x.nb;
  factored_reference(job, [&](int64_t i, const float* codes, const float* dw, const float* mw) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* xq = reinterpret_cast<const int8_t*>(job.x.q + (i * nb + b) * 32);
      int32_t sum = 0;
      for (int j = 0; j < 32; ++j) sum += static_cast<int32_t>(codes[32 * b + q8_dot_column(j)]) * xq[j];
      const float dx = job.x.d[i * nb + b], sx = job.x.s[i * nb + b];
      acc = std::fma(static_cast<float>(sum), dw[b] * dx, acc);
      acc = std::fma(mw[b], sx, acc);
    }
    return acc;
  });
}

}  // namespace backfill
