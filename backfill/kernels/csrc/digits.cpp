// The digit form's definition in portable C++ (digits.h): x's preparation, shared with the ISAs
// that have no kernels of their own, and the scalar GEMM whose numbers the AVX-512 VNNI and AMX
// kernels reproduce bit for bit.
#include "digits.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "qgemm.h"
#include "repack.h"

namespace backfill {

void prepare_digits(const float* x, int64_t m, int64_t ldx, int64_t cols, const DigitBuffers& out) {
  const int64_t nb = cols / 32;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + i * ldx + 32 * b;
      const int64_t at = i * nb + b;
      uint32_t max_bits = 0;
      for (int k = 0; k < 32; ++k) {
        uint32_t bits;
        std::memcpy(&bits, xb + k, 4);
        max_bits = std::max(max_bits, bits & 0x7FFFFFFFu);
      }
      int e = 0;
      int16_t* xa = out.xa + at * 32;
      int16_t* xl = out.xb + at * 32;
      if (!digit_exponent(max_bits, &e)) {
        std::fill(xa, xa + 32, int16_t{0});
        std::fill(xl, xl + 32, int16_t{0});
        out.u[at] = 1.0f;
        out.xs[at] = NAN;
        continue;
      }
      const float scale = digit_pow2(26 - e), u = digit_pow2(e - 26);
      int32_t sa = 0, sb = 0;
      for (int j = 0; j < 32; ++j) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[digit_pair_column(j)] * scale));
        xa[j] = static_cast<int16_t>(v >> 14);
        xl[j] = static_cast<int16_t>(v & 0x3FFF);
        sa += v >> 14;
        sb += v & 0x3FFF;
      }
      out.u[at] = u;
      out.xs[at] = std::fma(static_cast<float>(sa), u * 16384.0f, static_cast<float>(sb) * u);
    }
  }
}

void digits_gemm_scalar(const DigitJob& job) {
  const int64_t nb = job.x.nb;
  // (amx_end 0: every row in the int16 form)
  factored_reference(job, [&](int64_t i, const float* codes, const float* dw, const float* mw) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = i * nb + b;
      int32_t ca = 0, cb = 0;
      for (int j = 0; j < 32; ++j) {
        const int32_t q = static_cast<int32_t>(codes[32 * b + digit_pair_column(j)]);
        ca += q * job.x.xa[at * 32 + j];
        cb += q * job.x.xb[at * 32 + j];
      }
      const float u = job.x.u[at];
      const float s = std::fma(static_cast<float>(ca), u * 16384.0f, static_cast<float>(cb) * u);
      acc = std::fma(s, dw[b], acc);
      acc = std::fma(job.x.xs[at], mw[b], acc);
    }
    return acc;
  });
}

}  // namespace backfill
