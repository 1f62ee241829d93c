// Linear layers over weights as stored: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32
// activations and accumulation; W in any QType. Also row dequantization (embeddings, tests).
#pragma once

#include "qtypes.h"

namespace backfill {

// Scalar reference: dequantize row `row` of `w` into out[0 .. w.cols). Defines the numbers
// every fast kernel must reproduce (up to fp32 summation order).
void dequantize_row_ref(const QMatrix& w, int64_t row, float* out);

// Scalar reference GEMM over output rows [n_begin, n_end): single-threaded.
void qgemm_ref(const float* x, int64_t m, int64_t ldx, const QMatrix& w, const float* bias, float* y,
               int64_t ldy, int64_t n_begin, int64_t n_end);

// Which instruction set the fast kernels use on this CPU: "avx512", "avx2" or "scalar"
// (detected once at run time; BACKFILL_ISA=avx2|scalar forces a lower one, for tests).
const char* active_isa();

// Multi-threaded (torch's intra-op pool) dispatching entry points.
void qgemm(const float* x, int64_t m, int64_t ldx, const QMatrix& w, const float* bias, float* y, int64_t ldy);
void dequantize_rows(const QMatrix& w, const int64_t* rows, int64_t num_rows, float* out, int64_t ld_out);

}  // namespace backfill
