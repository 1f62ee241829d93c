// Run-time ISA choice and multi-threading for the linear kernels (torch's intra-op pool).
#include <ATen/Parallel.h>

#include <cstdlib>
#include <cstring>
#include <algorithm>

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

void qgemm(const float* x, int64_t m, int64_t ldx, const QMatrix& w, const float* bias, float* y, int64_t ldy) {
  const QgemmFn fn = pick(w.type);
  // Output rows are split between threads in multiples of 16 (a whole SIMD tile each).
  constexpr int64_t kTile = 16;
  const int64_t num_tiles = (w.rows + kTile - 1) / kTile;
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    fn(x, m, ldx, w, bias, y, ldy, begin * kTile, std::min(end * kTile, w.rows));
  });
}

void dequantize_rows(const QMatrix& w, const int64_t* rows, int64_t num_rows, float* out, int64_t ld_out) {
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequantize_row_ref(w, rows[i], out + i * ld_out);
  });
}

}  // namespace backfill
