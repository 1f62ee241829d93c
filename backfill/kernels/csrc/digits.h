// The digit form of the 4-bit types' products (qgemm.h: digit_form; Q4_0, Q4_1, Q4_K): exact
// integer sums that the AMX tile unit, AVX-512 VNNI and plain C++ all compute to the same bits at
// any row count, so a process can run AMX from a group of 10-16 rows and vector integer dots below
// them without breaking batch invariance. Measured first in scripts/amx_digits.cpp (BENCHMARKS.md,
// sessions 61-63).
// No torch or STL headers (the ISA translation units include this file, see isa.h).
//
// x, per row and 32-column block, on a fixed-point grid: E the exponent of the block's largest
// |x| (at least kDigitMinExp), u = 2^(E - 26), X[k] = round(x[k] / u) (|X| < 2^27, round to
// nearest even), split X = XA 2^14 + XB (XA = X >> 14 signed, XB = X & 0x3FFF). Per weight row n
// and block b, with q the codes, d and m the block's scale and offset as factored_row_ref gives
// them (Q4_0: m = -8 d):
//   ca = sum_k q[k] XA[k], cb = sum_k q[k] XB[k]       (integers, exact: |ca| < 2^22, cb < 2^23)
//   S  = fma(ca, 2^14 u, cb u)                          (the exact sum x q rounded once)
//   Xb = fma(sum XA, 2^14 u, (sum XB) u)                (the block's sum of x, rounded once)
//   y  = fma(S, d, y), then y = fma(Xb, m, y), over the blocks in order from +0
// then y + bias, + the old y where accumulating (as TileJob's). x loses what the grid cannot hold
// (below 2^-27 of the block's largest |x|: about the error of one fp32 rounding of the block's
// sum), so the numbers differ from the fp32 chains of TileJob by about an fp32 rounding, within
// its accuracy bound. A block whose largest |x| is not finite or reaches 2^(kDigitMaxExp + 1)
// gives NaN (its Xb), as an overflowing fp32 sum would give inf or NaN.
//
// The AMX kernel (tile dot products of bf16 pairs, fp32 sums) holds the grid's 7-bit digits of
// XA and XB (exact in bf16) against the codes as bf16(16 + q), its sum tiles started at
// -16 (sum XA) 2^14 u and -16 (sum XB) u: every partial sum is an integer below 2^24 times a power
// of two, so any summation order gives the same bits, and u >= 2^-125 keeps every value normal
// (the unit flushes subnormals).
#pragma once

#include "packed.h"

namespace backfill {

// The types the digit form computes: Q4_0, Q4_1 and Q4_K (nibble words, 32-column blocks or
// sub-blocks; Q4_K's d and m those of a sub-block, its 6-bit scale and min applied, as
// factored_row_ref gives them).
inline bool digit_type(QType t) { return t == QType::Q4_0 || t == QType::Q4_1 || t == QType::Q4_K; }

constexpr int kDigitMinExp = -99;
constexpr int kDigitMaxExp = 110;

// Element j of a block's 32 in pair order holds column digit_pair_column(j): pair p = j / 2 =
// 4 w + c holds columns 8 w + c and 8 w + c + 4, the two codes one 32-bit lane of nibble word w
// gives by one shift (4 c) and one and (packed.h: nibble words); the AMX A tiles and the VNNI
// kernels' 16-bit pairs both take x in this order.
constexpr int digit_pair_column(int j) { return 8 * (j / 8) + (j / 2) % 4 + 4 * (j % 2); }

// x prepared. Rows [amx_end, m), per row i and block b (index (i - amx_end) nb + b): XA and XB
// in pair order, the grid unit u and Xb. Rows [0, amx_end) in groups of 16 for the AMX kernel
// instead (the last one fewer), per group and block kDigitGroupBlockBytes: the 4 A tiles (1 KB each: 16 rows x 32 bf16 in pair order, XA's high
// and low 7 bits times 2^14 u, XB's times u), the two sum tiles' starting values (1 KB each:
// -16 (sum XA) 2^14 u and -16 (sum XB) u in every column of a row), the 16 rows' Xb (0 past the
// group's rows).
constexpr int64_t kDigitGroupBlockBytes = 6 * 1024 + 64;
struct DigitRows {
  const int16_t* xa;  // [m - amx_end][nb][32]
  const int16_t* xb;  // [m - amx_end][nb][32]
  const float* u;     // [m - amx_end][nb]
  const float* xs;    // [m - amx_end][nb] Xb
  int64_t m;
  int64_t nb;
  const uint8_t* const* groups = nullptr;  // [(amx_end + 15) / 16][nb]: each group's blocks
  int64_t amx_end = 0;
};

// The rows of m that run on the AMX kernel: whole groups of 16, and a last partial group of at
// least min_rows rows (min_rows 0: none).
inline int64_t digit_amx_end(int64_t m, int64_t min_rows) {
  if (min_rows <= 0) return 0;
  const int64_t whole = m / 16 * 16;
  return m - whole >= min_rows ? m : whole;
}

// Writable buffers for m rows of nb blocks (one allocation, carved up by digit_buffers).
inline int64_t digit_buffer_bytes(int64_t m, int64_t nb) { return m * nb * (2 * 64 + 2 * 4) + 64; }
struct DigitBuffers {
  int16_t* xa;
  int16_t* xb;
  float* u;
  float* xs;
};
inline DigitBuffers digit_buffers(void* mem, int64_t m, int64_t nb) {
  const uintptr_t p = (reinterpret_cast<uintptr_t>(mem) + 63) & ~uintptr_t{63};
  int16_t* xa = reinterpret_cast<int16_t*>(p);
  int16_t* xb = xa + m * nb * 32;
  float* u = reinterpret_cast<float*>(xb + m * nb * 32);
  return DigitBuffers{xa, xb, u, u + m * nb};
}

// The block's grid: E from the largest |x|'s bits (an integer max of |x|'s bits: NaN above inf
// above every finite value), or false where the block gives NaN.
inline bool digit_exponent(uint32_t max_abs_bits, int* e) {
  int exp = static_cast<int>(max_abs_bits >> 23) - 127;
  if (exp > kDigitMaxExp) return false;  // (also inf and NaN: 128)
  *e = exp < kDigitMinExp ? kDigitMinExp : exp;
  return true;
}
// 2^n as an fp32, for n in the normal range.
inline float digit_pow2(int n) {
  const uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// Rows x[0 .. m) (row stride ldx, cols % 32 == 0) in the digit form, into `out`'s m x nb blocks
// (amx_end 0).
void prepare_digits(const float* x, int64_t m, int64_t ldx, int64_t cols, const DigitBuffers& out);         // digits.cpp
// The same bits for rows [row_begin, m), into `out`'s (m - row_begin) x nb blocks (amx_end
// row_begin).
void prepare_digits_avx512(const float* x, int64_t m, int64_t ldx, int64_t cols, const DigitBuffers& out,
                           int64_t row_begin);
// Blocks [b0, b1) of every group of rows [0, amx_end) (16 rows each, the last one fewer) as AMX
// group blocks (DigitRows), block b of group g at out + ((b - b0) groups + g) kDigitGroupBlockBytes
// (amx_ready() only).
void build_digit_blocks(const float* x, int64_t ldx, int64_t amx_end, int64_t b0, int64_t b1, uint8_t* out);

// One job of the digit-form GEMM (digit_type types only).
using DigitJob = PreparedJob<DigitRows>;

void digits_gemm_scalar(const DigitJob& job);  // digits.cpp: portable C++, the definition
// qgemm_digits_avx512.cpp: the AMX tile unit for rows [0, x.amx_end), AVX-512 VNNI (vpdpwssd) for
// the rest; needs VNNI.
void digits_gemm_avx512(const DigitJob& job);
// Whether this CPU and OS run AMX-BF16 for this process (asks the kernel for the tile data
// permission once; false where it cannot).
bool amx_ready();

}  // namespace backfill
