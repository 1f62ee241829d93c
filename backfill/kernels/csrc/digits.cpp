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

void prepare_digits(const float* x, int64_t m, int64_t ldx, int64_t cols, QType t, uint8_t* out,
                    int64_t row_begin) {
  const int64_t nb = cols / 32;
  for (int64_t i = row_begin; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + i * ldx + 32 * b;
      uint8_t* rec = out + ((i - row_begin) * nb + b) * kDigitRowBytes;
      std::memset(rec, 0, kDigitRowBytes);
      uint32_t max_bits = 0;
      for (int k = 0; k < 32; ++k) {
        uint32_t bits;
        std::memcpy(&bits, xb + k, 4);
        max_bits = std::max(max_bits, bits & 0x7FFFFFFFu);
      }
      int e = 0;
      float u = NAN, xs = NAN;  // (a block that gives NaN: both)
      int32_t sum2 = 0;
      if (digit_exponent(max_bits, &e)) {
        const float scale = digit_pow2(22 - e);
        u = digit_pow2(e - 22);
        int32_t sum = 0;
        for (int j = 0; j < 32; ++j) {
          const int32_t v = std::min(static_cast<int32_t>(std::nearbyint(xb[digit_column(t, j)] * scale)), kDigitMax);
          rec[digit_rec::kD2 + j] = static_cast<uint8_t>(v >> 16);  // (int8)
          rec[digit_rec::kD1 + j] = static_cast<uint8_t>((v >> 8) & 255);
          rec[digit_rec::kD0 + j] = static_cast<uint8_t>(v & 255);
          sum += v;
          sum2 += v >> 16;
        }
        xs = static_cast<float>(sum) * u;
      }
      std::memcpy(rec + digit_rec::kU, &u, 4);
      std::memcpy(rec + digit_rec::kXb, &xs, 4);
      std::memcpy(rec + digit_rec::kSumD2, &sum2, 4);
    }
  }
}

void digits_gemm_scalar(const DigitJob& job) {
  const int64_t nb = job.x.nb;
  // (amx_end 0: every row a record; Q8_0's packed codes are q + 128, its m = -128 d unused)
  const bool q8 = job.type == QType::Q8_0;
  const int64_t offset = q8 ? kByteCodeOffset : 0;
  factored_reference(job, [&](int64_t i, const float* codes, const float* dw, const float* mw) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* rec = job.x.rows + (i * nb + b) * kDigitRowBytes;
      int64_t c = 0;
      for (int j = 0; j < 32; ++j) {
        const int64_t v = static_cast<int8_t>(rec[digit_rec::kD2 + j]) * 65536 + rec[digit_rec::kD1 + j] * 256 +
                          rec[digit_rec::kD0 + j];
        c += (static_cast<int64_t>(codes[32 * b + digit_column(job.type, j)]) - offset) * v;
      }
      float u, xs;
      std::memcpy(&u, rec + digit_rec::kU, 4);
      std::memcpy(&xs, rec + digit_rec::kXb, 4);
      acc = std::fma(static_cast<float>(c) * u, dw[b], acc);
      if (!q8) acc = std::fma(xs, mw[b], acc);
    }
    return acc;
  });
}

}  // namespace backfill
