// Per-instruction-set kernel entry points. Each lives in its own translation unit compiled
// for that ISA via `#pragma GCC target` (so one binary runs on any x86-64 CPU and picks its
// kernels at run time); those units include no torch or STL headers, so no inline function
// compiled for AVX-512 can be linked into code that runs on an AVX2-only CPU.
#pragma once

#include "qtypes.h"

namespace backfill {

// Single-threaded y[:, n_begin:n_end] = x @ W[n_begin:n_end]^T (+ bias), fp32.
using QgemmFn = void (*)(const float* x, int64_t m, int64_t ldx, const QMatrix& w, const float* bias, float* y,
                         int64_t ldy, int64_t n_begin, int64_t n_end);

void qgemm_avx2(const float* x, int64_t m, int64_t ldx, const QMatrix& w, const float* bias, float* y,
                int64_t ldy, int64_t n_begin, int64_t n_end);
void qgemm_avx512(const float* x, int64_t m, int64_t ldx, const QMatrix& w, const float* bias, float* y,
                  int64_t ldy, int64_t n_begin, int64_t n_end);

// Whether the ISA kernels handle this type (else the reference kernel runs).
bool qgemm_avx2_supports(QType t);
bool qgemm_avx512_supports(QType t);

}  // namespace backfill
