// Run-time ISA choice and multi-threading for the linear kernels (torch's intra-op pool).
#include <ATen/Parallel.h>

#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <vector>

#include "isa.h"
#include "qgemm.h"

namespace backfill {
namespace {

enum class Isa { Scalar, Avx2, Avx512 };

Isa detect_isa() {
  Isa best = Isa::Scalar;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::Avx2;
  if (best == Isa::Avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    best = Isa::Avx512;
#endif
  // BACKFILL_ISA lowers the choice (never raises it past what the CPU has): tests run every path.
  if (const char* forced = std::getenv("BACKFILL_ISA")) {
    if (std::strcmp(forced, "scalar") == 0) best = Isa::Scalar;
    else if (std::strcmp(forced, "avx2") == 0 && best == Isa::Avx512) best = Isa::Avx2;
  }
  return best;
}

Isa isa() {
  static const Isa chosen = detect_isa();
  return chosen;
}

QgemmFn pick(QType t) {
  switch (isa()) {
    case Isa::Avx512:
      if (qgemm_avx512_supports(t)) return qgemm_avx512;
      [[fallthrough]];
    case Isa::Avx2:
      if (qgemm_avx2_supports(t)) return qgemm_avx2;
      [[fallthrough]];
    case Isa::Scalar:
      break;
  }
  return qgemm_ref;
}

}  // namespace

const char* active_isa() {
  switch (isa()) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    case Isa::Scalar: break;
  }
  return "scalar";
}

// NOTE: placeholder packed layout = the GGUF layout itself, run by the reference kernels.
int64_t packed_bytes(QType type, int64_t rows, int64_t cols) {
  return rows * (cols / block_elems(type)) * block_bytes(type);
}

void repack(const QMatrix& raw, uint8_t* out) {
  std::memcpy(out, raw.data, static_cast<size_t>(raw.rows * raw.row_bytes));
}

static QMatrix as_raw(const PackedMatrix& w) {
  return QMatrix{w.data, w.type, w.rows, w.cols, w.cols / block_elems(w.type) * block_bytes(w.type)};
}

void packed_gemm(const float* x, int64_t m, int64_t ldx, const PackedMatrix& pw, const float* bias, float* y,
                 int64_t ldy, bool accumulate) {
  const QMatrix w = as_raw(pw);
  const QgemmFn fn = pick(w.type);
  // Output rows are split between threads in multiples of 16 (a whole SIMD tile each).
  constexpr int64_t kTile = 16;
  const int64_t num_tiles = (w.rows + kTile - 1) / kTile;
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * kTile, n1 = std::min(end * kTile, w.rows);
    if (!accumulate) {
      fn(x, m, ldx, w, bias, y, ldy, n0, n1);
      return;
    }
    std::vector<float> tmp(static_cast<size_t>(m * (n1 - n0)));
    fn(x, m, ldx, QMatrix{w.data + n0 * w.row_bytes, w.type, n1 - n0, w.cols, w.row_bytes},
       bias == nullptr ? nullptr : bias + n0, tmp.data(), n1 - n0, 0, n1 - n0);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t n = n0; n < n1; ++n) y[i * ldy + n] += tmp[static_cast<size_t>(i * (n1 - n0) + n - n0)];
  });
}

void packed_dequantize_rows(const PackedMatrix& pw, const int64_t* rows, int64_t num_rows, float* out,
                            int64_t ld_out) {
  const QMatrix w = as_raw(pw);
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequantize_row_ref(w, rows[i], out + i * ld_out);
  });
}

}  // namespace backfill
