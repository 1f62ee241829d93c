// The opt-in int8-activation path (`--activation-quantization int8`, as llama.cpp's Q8
// activations): x quantized per row and 32-column block to int8, dotted with the 4-bit codes as
// integers, each block's integer sum scaled in fp32. Not exact: x loses what int8 cannot hold
// (about 1/254 of the block's largest |x|); `backfill bench divergence` measures what that costs
// against the fp32 path. The packed weights are the same bytes the exact kernels read.
// No torch or STL headers (the ISA translation units include this file, see isa.h).
#pragma once

#include "packed.h"

namespace backfill {

// The types this path computes (the nibble-word types: 4-bit codes, 32-column blocks or
// sub-blocks); any other type keeps the exact fp32 kernels.
inline bool q8_activation_type(QType t) { return t == QType::Q4_0 || t == QType::Q4_1 || t == QType::Q4_K; }

// x quantized, per row i and 32-column block b (nb = K / 32 blocks a row):
//   scale d = max |x| / 127 (0 for an all-zero block), q[k] = round(x[k] / d) in [-127, 127],
//   q stored in the kernels' dot order (q8_dot_column), s = d * sum(q) (the offset term's x).
// The sums y[i, n] = sum_b fma(float(S_b), dw_b * d, .) then fma(m_b, s, .) in block order,
// S_b the block's exact integer sum of code * q, dw_b / m_b the weight block's scale and offset
// exactly as factored_row_ref gives them; every ISA computes those same numbers.
struct Q8Rows {
  const uint8_t* q;  // [m][nb][32] int8 in dot order
  const float* d;    // [m][nb]
  const float* s;    // [m][nb]
  int64_t m;
  int64_t nb;
};

// Byte j of a block's 32 in dot order holds column q8_dot_column(j): int32 word 2w (w = 0 .. 3)
// holds columns 8w, 8w + 2, 8w + 4, 8w + 6 and word 2w + 1 columns 8w + 1, .., 8w + 7, the
// columns the even and odd nibbles of a nibble word's lane hold (packed.h).
inline int q8_dot_column(int j) { return 8 * (j / 8) + 2 * (j % 4) + (j / 4) % 2; }

// Quantizes rows x[0 .. m) (row stride ldx, K columns, K % 32 == 0) into q (m K bytes), d and s
// (m K / 32 floats each). Round to nearest even; a NaN in a block makes its scale NaN (and so
// every sum it enters), as the fp32 path would.
void quantize_rows_q8(const float* x, int64_t m, int64_t ldx, int64_t cols, uint8_t* q, float* d, float* s);
// The same numbers, vectorized (per ISA, as the kernels below).
void quantize_rows_q8_avx512(const float* x, int64_t m, int64_t ldx, int64_t cols, uint8_t* q, float* d, float* s);
void quantize_rows_q8_avx2(const float* x, int64_t m, int64_t ldx, int64_t cols, uint8_t* q, float* d, float* s);

// A block's scale from its largest |x| (NaN if any x is NaN) and the multiplier that maps x to
// [-127, 127]: every ISA computes these two the same way.
inline float q8_scale(float amax) { return amax / 127.0f; }
inline float q8_inverse(float scale) { return scale > 0.0f && scale <= 3.4028235e38f ? 1.0f / scale : 0.0f; }

// One job of the int8-activation GEMM (q8_activation_type types only).
using Q8Job = PreparedJob<Q8Rows>;

void q8_gemm_avx512vnni(const Q8Job& job);  // qgemm_q8_avx512.cpp: AVX-512 VNNI (vpdpbusd)
void q8_gemm_avx2(const Q8Job& job);        // qgemm_avx2.cpp: AVX2 vpmaddubsw + vpmaddwd
void q8_gemm_scalar(const Q8Job& job);      // q8.cpp: portable C++

}  // namespace backfill
