// The digit form of the block types' products (qgemm.h: digit_form; Q4_0, Q4_1, Q4_K, Q8_0): exact
// integer sums that the AMX tile unit, AVX-512 VNNI and plain C++ all compute to the same bits at
// any row count, so a process can run AMX from a group of 10-16 rows and vector integer dots below
// them without breaking batch invariance. Measured first in scripts/amx_digits.cpp (BENCHMARKS.md,
// sessions 61-63). The grid holds 24 bits since session 64: 27 bits took 32 vpdpwssd (16-bit
// pairs) a row, tile and block, as many as the FMA kernel's FMAs, and the vector dots ran ~0.8x its
// speed; 24 bits as three bytes take 24 vpdpbusd (four codes a lane), ~1.0-1.25x.
// No torch or STL headers (the ISA translation units include this file, see isa.h).
//
// x, per row and 32-column block, on a fixed-point grid: E the exponent of the block's largest
// |x| (at least kDigitMinExp), u = 2^(E - 22), X[k] = round(x[k] / u) (round to nearest even;
// |X| <= 2^23, and 2^23 saturates to 2^23 - 1: 24 bits, as an fp32 holds the largest |x|). Per
// weight row n and block b, with q the codes, d and m the block's scale and offset as
// factored_row_ref gives them (Q4_0: m = -8 d):
//   c  = sum_k q[k] X[k]                 (an integer, exact: |c| < 2^32)
//   S  = round(c) u                      (the exact sum x q rounded once: an fp32 holds it)
//   Xb = round(sum_k X[k]) u             (the block's sum of x, rounded once)
//   y  = fma(S, d, y), then y = fma(Xb, m, y), over the blocks in order from +0
// (Q8_0: q its int8 codes, |c| < 2^35, and y = fma(S, d, y) only), then y + bias, + the old y
// where accumulating (as TileJob's). x loses what the grid cannot hold (below 2^-23 of the block's
// largest |x|: about the error of one fp32 rounding of the block's sum), so the numbers differ from
// the fp32 chains of TileJob by about an fp32 rounding, within its accuracy bound. A block whose
// largest |x| is not finite or reaches 2^(kDigitMaxExp + 1) gives NaN (its S and Xb), as an
// overflowing fp32 sum would give inf or NaN.
//
// The vector kernel (AVX-512 VNNI byte dots, int32 sums) takes X as three bytes, X = D2 2^16 +
// D1 2^8 + D0 (D2 = X >> 16 signed, D1 and D0 unsigned): c = C2 2^16 + C1 2^8 + C0 with C the
// codes' dots with each (exact: |C| < 2^21), rounded once as fma(A, 2^16 u, L u), A = C2 + (T >> 16)
// and L = T & 0xFFFF for T = C1 2^8 + C0. The 4-bit codes are the dots' unsigned operand against
// D2 and their signed one against D1 and D0; Q8_0's packed bytes (q + 128) the unsigned one against
// D2 (its sum started at -128 sum D2) and, their top bits flipped (q), the signed one against D1
// and D0.
// The AMX kernel (tile dot products of bf16 pairs, fp32 sums) holds XA = X >> 12 (signed) and XB =
// X & 4095 as 6-bit digits (exact in bf16), times 2^12 u and u, against the codes as bf16(q), its
// two sum tiles started at 0 (|q| <= 15, Q8_0's <= 128, keep them below 2^24 units): every
// partial sum is an integer below 2^24 times a power of two, so any summation order gives the
// same bits, the two tiles' sum is c u rounded once, and u >= 2^-121 keeps every value normal
// (the unit flushes subnormals). (Q8_0 on the AMX-INT8 unit instead, byte digits against the
// packed bytes as they are: three int32 sum tiles a block to store and fold, no faster than the
// vector dots.)
#pragma once

#include "packed.h"

namespace backfill {

// The types the digit form computes: Q4_0, Q4_1 and Q4_K (nibble words, 32-column blocks or
// sub-blocks; Q4_K's d and m those of a sub-block, its 6-bit scale and min applied, as
// factored_row_ref gives them) and Q8_0 (byte words).
inline bool digit_type(QType t) {
  return t == QType::Q4_0 || t == QType::Q4_1 || t == QType::Q4_K || t == QType::Q8_0;
}

constexpr int kDigitMinExp = -99;
constexpr int kDigitMaxExp = 110;

// Element j of a block's 32 in pair order holds column digit_pair_column(j): pair p = j / 2 =
// 4 w + c holds columns 8 w + c and 8 w + c + 4, the two codes one 32-bit lane of nibble word w
// gives by one shift (4 c) and one and (packed.h: nibble words); the AMX A tiles take x in this
// order.
constexpr int digit_pair_column(int j) { return 8 * (j / 8) + (j / 2) % 4 + 4 * (j % 2); }
// Element j of a block's 32 in byte order holds column digit_byte_column(j): quad j / 4 = 2 w + h
// holds columns 8 w + h, 8 w + h + 2, 8 w + h + 4, 8 w + h + 6, the four bytes of a 32-bit lane of
// nibble word w after one and (h = 0) or a shift and an and (h = 1); the VNNI kernel's digits
// (Q8_0's in column order: a byte word's lane holds 4 consecutive columns).
constexpr int digit_byte_column(int j) { return 8 * (j / 8) + (j / 4) % 2 + 2 * (j % 4); }
inline int digit_column(QType t, int j) { return t == QType::Q8_0 ? j : digit_byte_column(j); }
// X's largest value (2^23 rounds down to it).
constexpr int32_t kDigitMax = (1 << 23) - 1;

// x prepared. Rows [amx_end, m), per row i and block b a record of kDigitRowBytes at rows + ((i -
// amx_end) nb + b) kDigitRowBytes: D2 [32] int8, D1 [32] uint8, D0 [32] uint8 (digit_column order),
// u, Xb (fp32), sum D2 (int32). Rows [0, amx_end) in groups of 16 for the AMX kernel instead (the
// last one fewer), per group and block kDigitGroupBlockBytes: the 4 A tiles (1 KB each: 16 rows x
// 32 bf16 in pair order (Q8_0: column order), XA's high and low 6 bits times 2^12 u, XB's times u),
// then the 16 rows' Xb (0 past the group's rows; Q8_0: 0, NaN for a block that gives NaN, which its
// m = 0 carries into y).
constexpr int64_t kDigitRowBytes = 128;
// A record's fields (byte offsets): the three digits' 32 bytes each, u, Xb, sum D2.
namespace digit_rec {
constexpr int64_t kD2 = 0, kD1 = 32, kD0 = 64, kU = 96, kXb = 100, kSumD2 = 104;
}  // namespace digit_rec
constexpr int64_t kDigitGroupXb = 4 * 1024;  // a group block's Xb (16 fp32), after its 4 A tiles
constexpr int64_t kDigitGroupBlockBytes = kDigitGroupXb + 64;
struct DigitRows {
  const uint8_t* rows;  // [m - amx_end][nb] records
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

// Rows [row_begin, m) of x (row stride ldx, cols % 32 == 0) in the digit form for weights of type
// t, as records (DigitRows: rows) at out.
void prepare_digits(const float* x, int64_t m, int64_t ldx, int64_t cols, QType t, uint8_t* out,
                    int64_t row_begin);  // digits.cpp
void prepare_digits_avx512(const float* x, int64_t m, int64_t ldx, int64_t cols, QType t, uint8_t* out,
                           int64_t row_begin);
// Blocks [b0, b1) of every group of rows [0, amx_end) (16 rows each, the last one fewer) as AMX
// group blocks (DigitRows), block b of group g at out + ((b - b0) groups + g) kDigitGroupBlockBytes
// (amx_ready() only).
void build_digit_blocks(const float* x, int64_t ldx, int64_t amx_end, int64_t b0, int64_t b1, QType t, uint8_t* out);

// One job of the digit-form GEMM (digit_type types only).
using DigitJob = PreparedJob<DigitRows>;

void digits_gemm_scalar(const DigitJob& job);  // digits.cpp: portable C++, the definition
// qgemm_digits_avx512.cpp: the AMX tile unit for rows [0, x.amx_end), AVX-512 VNNI (vpdpbusd) for
// the rest; needs VNNI.
void digits_gemm_avx512(const DigitJob& job);
// Whether this CPU and OS run AMX-BF16 for this process (asks the kernel for the tile data
// permission once; false where it cannot).
bool amx_ready();

}  // namespace backfill
