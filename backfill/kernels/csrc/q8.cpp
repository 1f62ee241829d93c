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
  const int64_t K = job.cols, nb = job.x.nb;
  const PackedMatrix w{job.w, job.type, job.rows, K};
  const QMatrix one_row{nullptr, job.type, 1, K, K / block_elems(job.type) * block_bytes(job.type)};
  std::vector<uint8_t> raw(static_cast<size_t>(one_row.row_bytes));  // [row_bytes] GGUF row
  std::vector<float> codes(static_cast<size_t>(K)), dw(static_cast<size_t>(nb)), mw(static_cast<size_t>(nb));
  const int64_t n_end = std::min(job.tile_end * kTileRows, job.rows);
  for (int64_t n = job.tile_begin * kTileRows; n < n_end; ++n) {
    unpack_row(w, n, raw.data());
    QMatrix qm = one_row;
    qm.data = raw.data();
    factored_row_ref(qm, 0, codes.data(), dw.data(), mw.data());
    for (int64_t i = 0; i < job.x.m; ++i) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* xq = reinterpret_cast<const int8_t*>(job.x.q + (i * nb + b) * 32);
        int32_t sum = 0;
        for (int j = 0; j < 32; ++j)
          sum += static_cast<int32_t>(codes[static_cast<size_t>(32 * b + q8_dot_column(j))]) * xq[j];
        const float dx = job.x.d[i * nb + b], sx = job.x.s[i * nb + b];
        acc = std::fma(static_cast<float>(sum), dw[static_cast<size_t>(b)] * dx, acc);
        acc = std::fma(mw[static_cast<size_t>(b)], sx, acc);
      }
      if (job.bias != nullptr) acc = acc + job.bias[n];
      float& out = job.y[i * job.ldy + n];
      out = job.accumulate ? out + acc : acc;
    }
  }
}

}  // namespace backfill
