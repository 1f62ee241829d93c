// The packed weight layout the fast kernels read (private to the kernels; see qgemm.h).
// No torch or STL headers: the ISA translation units include this file (see isa.h).
//
// A matrix W [N, K] is cut into tiles of 16 output rows (N padded with all-zero rows to a
// multiple of 16). A tile holds its 16 rows' blocks along K one after another; a "tile block"
// (16 rows x one GGUF block) holds the same fields as the 16 raw blocks (same bytes, so the same
// bits per weight as the file; Q6_K's codes a byte each, below), transposed so that one field of
// the 16 rows is 16 adjacent values: a 16-byte load followed by a byte -> int32 widening gives one
// SIMD value per row (codes: one load gives several columns, see the words below).
//
//   packed = [tile 0][tile 1]...            tile = [block 0][block 1]...[block K/bs - 1]
//   tile block, by type (offsets in bytes; "[16] h" = 16 fp16 halves, one per row r;
//   "group g" = 16 bytes, byte r belongs to row r):
//   Q4_0  288 B  d[16] h @0 | qs: 4 words @32 (nibble words, below)
//   Q4_1  320 B  d[16] h @0 | m[16] h @32 | qs: 4 words @64 (nibble words)
//   Q8_0  544 B  d[16] h @0 | qs: 8 words @32 (byte words, below)
//   Q4_K 2368 B  d[16] h @0 | dmin[16] h @32 | scales: 16 groups @64, group j byte r = row r's
//                6-bit sc_j (j < 8) or m_{j-8} (ggml's get_scale_min_k4, out of its 12 bytes) |
//                qs: 32 words @320 (nibble words)
//   Q6_K 4384 B  d[16] h @0 | scales: 16 groups @32 (int8, one per 16 elements) |
//                codes: 32 word pairs @288 (six-bit words, below)
//   F16     32 B per k: [16] h (tile = [K][16] fp16)    F32  64 B per k (tile = [K][16] fp32)
// q[r][k] is the element's integer code (k within the block), exactly as ggml defines it.
// Nibble words (the 4-bit types): a "word" w = 64 bytes, 16 little-endian uint32, the one of row r
// holding its codes of columns 8w .. 8w + 7, column 8w + c in bits 4c .. 4c + 3. One plain load
// gives 8 columns of the 16 rows; a kernel takes column c out with one and (see code_x_scale).
//
// Byte words (Q8_0): word w = 64 bytes, 16 uint32, the one of row r holding its codes of columns
// 4w .. 4w + 3, column 4w + c in bits 8c .. 8c + 7, each as u = q + 128 (the int8 code's byte with
// its top bit flipped): a kernel takes column c out with one and (c = 3: one shift), where a
// byte -> int32 widening and a conversion took two operations a column, and the block gets the
// offset m = -128 d (w = u d + m = q d). On a Zen 4 EPYC (2 threads) the default model's LM head
// ([49152, 576]) at one row 10-20% faster, the batch-1 decode step ~2.7% (~75 us); at 8 rows ~3%
// faster, at 32 rows 4-8% slower (the offset's fold, an FMA a row, tile and block, where the
// conversions it saves were shared by the rows), the batch-32 step ~1%.
//
// Six-bit words (Q6_K): pair p = 128 bytes, word A (64 bytes: 16 uint32, row r's the r-th) then
// word B; row r's A holds its codes of columns 8p, 8p + 2, 8p + 4, 8p + 6 in bits 0, 8, 16, 24 (6
// bits each), its B those of 8p + 1, 8p + 3, 8p + 5 in bits 4, 12, 20 and of 8p + 7 in bits 26-31:
// column 8p + c at bit 4c for c < 7, as a nibble word puts it, so one and takes it out in place
// (and one shift column 7) and x is scaled as for the nibble words. The file packs a code in 6.5
// bits (a low nibble and two high bits in other bytes): assembling one took 5-6 operations a
// column, ~2x a Q4_K column's time at one row; a byte each costs 2 bits a weight more.
//
// Bits per weight: Q4_0 4.5, Q4_1 5, Q8_0 8.5, F16 16, F32 32 (the file's); Q4_K 4.625 (the file's
// 4.5 with its 6-bit scales a byte each: taking them out of the file's 12 bytes per sub-block and
// tile cost a Q4_K matrix 4-6% at 1-8 rows on AVX-512, 3-15% on AVX2); Q6_K 8.5625 (the file's
// 6.5625 with each code widened to 8 bits).
#pragma once

#include "qtypes.h"

namespace backfill {

constexpr int64_t kTileRows = 16;

// Bytes of one tile block (16 rows x block_elems(type) columns): exactly 16 raw blocks, but for
// Q4_K's unpacked scales and Q6_K's wider codes (the table above).
constexpr int64_t kQ4_KTileBlockBytes = 64 + 16 * kTileRows + 32 * 64;
constexpr int64_t kQ6_KTileBlockBytes = 32 + 256 + kTileRows * 256;
inline int64_t tile_block_bytes(QType t) {
  return t == QType::Q4_K ? kQ4_KTileBlockBytes : t == QType::Q6_K ? kQ6_KTileBlockBytes : kTileRows * block_bytes(t);
}
// Bytes of one whole tile (16 rows x cols).
inline int64_t tile_bytes(QType t, int64_t cols) { return cols / block_elems(t) * tile_block_bytes(t); }
inline int64_t num_tiles(int64_t rows) { return (rows + kTileRows - 1) / kTileRows; }

// Field offsets inside a tile block (see the table above).
namespace tile_off {
constexpr int64_t kQ4_0Qs = 32;
constexpr int64_t kQ4_1M = 32, kQ4_1Qs = 64;
constexpr int64_t kQ8_0Qs = 32;
constexpr int64_t kQ4_KDmin = 32, kQ4_KScales = 64, kQ4_KQs = 320;
constexpr int64_t kQ6_KScales = 32, kQ6_KQs = 288;
}  // namespace tile_off

// The nibble-word types (Q4_0, Q4_1, Q4_K) and how their kernels scale: column k's code is read
// in place, as float(q << 4c) = q 2^4c for c = k % 8 in 1 .. 6 (an and, no shift; c = 0 and 7 are
// read as q), and x[k] is scaled by 2^-4c to match (x packed for the kernels, or the scalar
// kernel's product). A power of two: x[k] 2^-4c times q 2^4c is x[k] q exactly, the same FMA,
// unless x[k] 2^-4c falls below fp32's normal range (|x[k]| < 2^-102), where it loses bits the
// same way on every path.
inline bool nibble_words(QType t) { return t == QType::Q4_0 || t == QType::Q4_1 || t == QType::Q4_K; }
// Column 8p + c's field in its six-bit word pair (the layout above; repack and the kernels both
// read it here): word B (1) for c odd, A (0) for c even; its lowest bit.
constexpr int six_bit_word(int c) { return c % 2; }
constexpr int six_bit_shift(int c) { return c < 7 ? 4 * c : 26; }
// Byte words (Q8_0): where row r's code of column k sits among its block's codes, and what its byte
// adds to the code (u = q + kByteCodeOffset); repack, the reference and the kernels read them here.
constexpr int64_t byte_word_offset(int k, int r) { return 64 * (k / 4) + 4 * r + k % 4; }
constexpr int kByteCodeOffset = 128;
// The types whose column k's code is read as q 2^4c (c = k % 8 in 1 .. 6), x scaled to match: the
// nibble words and Q6_K's six-bit words.
// Q8_0's byte words the same way: column 4w + c read in place as u 2^8c (c = 0 .. 2; c = 3
// shifted down: u), x[k] scaled by 2^-8c.
inline bool scaled_codes(QType t) { return nibble_words(t) || t == QType::Q6_K || t == QType::Q8_0; }
// (by k % 8, for the kernels' x packing)
constexpr float kNibbleXScale[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};
constexpr float kByteXScale[8] = {1.0f, 0x1p-8f, 0x1p-16f, 1.0f, 1.0f, 0x1p-8f, 0x1p-16f, 1.0f};
// x[k]'s scale against column k's code, and the code's (1 / it: powers of two), a scaled-code type's.
inline float code_x_scale(QType t, int64_t k) { return t == QType::Q8_0 ? kByteXScale[k % 8] : kNibbleXScale[k % 8]; }
inline float code_scale(QType t, int64_t k) { return 1.0f / code_x_scale(t, k); }

// The scaled-code types' subnormal form (TileJob::subnormal_codes; qgemm.cpp decides where it
// runs), told here for the nibble words (Q6_K's six-bit words below).
// Column 8w + c's code is taken out of its word by one and for c = 0 .. 5 (bits 4c .. 4c + 3),
// one shift for c = 7 (down to bits 0 .. 3) and a shift and an and for c = 6 (down to bits
// 20 .. 23), and those bits are read as they are as an fp32: a subnormal, q 2^(s_c - 149) with
// s_c = 0, 4, .., 20, 20, 0 (for c = 5 a q >= 8 sets the exponent's lowest bit: the value is
// still q 2^20 2^-149). No int -> float conversion: one operation a column fewer, which on a
// Zen 4 EPYC is a third of the 4-bit decode's vector work at one row (the FMA, the and and the
// conversion share its four pipes). x[k] is scaled by 2^(64 - s_c) to match (subnormal_x_scale)
// and the block's d by 2^85 (kSubnormalDScale): every product x q 2^-85 exactly, the code sums S
// 2^-85 times the nibble form's and y = fma(S, d, y) the same bits, unless |x q| or a partial sum
// |S| falls below 2^-41 (it is then rounded to a multiple of 2^-64 2^-85, not to 24 bits) or
// |x| reaches 2^64 (x 2^64 overflows). Reading subnormals at full speed is the CPU's business
// (AMD's Zen cores do; some Intel cores take a microcode assist), and MXCSR.DAZ (denormals are
// zero, torch.set_flush_denormal) would read every code as 0: the kernels check it per job
// (subnormals_read) and take the nibble form instead.
// Q6_K's six-bit words the same way: columns 0 .. 4 by one and in place (bits 4c .. 4c + 5, below
// the exponent), 5 and 6 shifted down to bits 16 .. 21 first (one shift and one and, as the
// conversion's and and conversion), 7 by one shift: s_c = 0, 4, 8, 12, 16, 16, 16, 0.
// Q8_0's byte words: columns 0 .. 2 by one and in place (bits 8c .. 8c + 7; at c = 2 a u >= 128
// sets the exponent's lowest bit, as a nibble at c = 5 does), 3 by one shift: s_c = 0, 8, 16, 0.
constexpr int kSubnormalShift[8] = {0, 4, 8, 12, 16, 20, 20, 0};
constexpr int kSubnormalShiftQ6_K[8] = {0, 4, 8, 12, 16, 16, 16, 0};
constexpr int kSubnormalShiftQ8_0[8] = {0, 8, 16, 0, 0, 8, 16, 0};
constexpr float kSubnormalXScale[8] = {0x1p64f, 0x1p60f, 0x1p56f, 0x1p52f, 0x1p48f, 0x1p44f, 0x1p44f, 0x1p64f};
constexpr float kSubnormalXScaleQ6_K[8] = {0x1p64f, 0x1p60f, 0x1p56f, 0x1p52f, 0x1p48f, 0x1p48f, 0x1p48f, 0x1p64f};
constexpr float kSubnormalXScaleQ8_0[8] = {0x1p64f, 0x1p56f, 0x1p48f, 0x1p64f, 0x1p64f, 0x1p56f, 0x1p48f, 0x1p64f};
constexpr float kSubnormalDScale = 0x1p85f;
inline float subnormal_x_scale(QType t, int64_t k) {
  return t == QType::Q6_K   ? kSubnormalXScaleQ6_K[k % 8]
         : t == QType::Q8_0 ? kSubnormalXScaleQ8_0[k % 8]
                            : kSubnormalXScale[k % 8];
}
// The code q of column k as the subnormal form reads it: q 2^(s_c - 149) (exact: q < 256).
inline float subnormal_code(QType t, float q, int64_t k) {
  const int s = t == QType::Q6_K   ? kSubnormalShiftQ6_K[k % 8]
                : t == QType::Q8_0 ? kSubnormalShiftQ8_0[k % 8]
                                   : kSubnormalShift[k % 8];
  return q * (0x1p-149f * static_cast<float>(1 << s));
}
// Whether this thread's MXCSR lets subnormal inputs through (DAZ clear).
inline bool subnormals_read() {
#if defined(__x86_64__) || defined(__i386__)
  return (__builtin_ia32_stmxcsr() & 0x40u) == 0;
#else
  return true;
#endif
}

// X_b of the factored sums below: the sum of a block's qb (32 or 16) values x[0 .. qb - 1] as a
// fixed tree over 16 lanes: s[l] = x[l] + x[l + 16] (32 columns) or x[l] (16), then lanes l and
// l + 8, l + 4, l + 2, l + 1.
inline float block_sum(const float* x, int64_t qb) {
  float s[16];
  for (int l = 0; l < 16; ++l) s[l] = qb == 32 ? x[l] + x[l + 16] : x[l];
  for (int h = 8; h >= 1; h /= 2)
    for (int l = 0; l < h; ++l) s[l] = s[l] + s[l + h];
  return s[0];
}

// One job of the packed GEMM: y[:, 16*tile_begin ..) for output tiles [tile_begin, tile_end),
// single-threaded (qgemm.cpp splits the tiles between threads). y[i, n] = (sum_k x[i, k] *
// w[n, k] + bias[n]) (+ y[i, n] if accumulate), the sum in fp32 in one fixed order that every
// ISA and every blocking reproduces bit for bit:
// - F32 / F16: one FMA chain over k = 0, 1, ..., K - 1 (from +0) on the weights exactly as
//   dequantize_row_ref gives them;
// - the block types, factored: a weight is w = q d_b + m_b (q its integer code, d_b and m_b its
//   block's per-row scale and offset: see qgemm_kernels.h), and y is one chain over the blocks
//   b = 0, 1, ... (from +0) of y = fma(S_b, d_b, y), then y = fma(X_b, m_b, y) (types with an
//   offset), where S_b is the FMA chain over the block's columns in order (from +0) of x[i, k] q
//   (the 4-bit types: of x[i, k] 2^-4c times q 2^4c, the same product for every normal x, see
//   code_x_scale) and X_b the block's sum of x[i, k] (block_sum). One FMA per weight and row
//   where dequantizing first takes two at one row: a decode step's GEMMs are FMA-bound on one
//   core.
struct TileJob {
  const float* x;  // [m, K], row stride ldx
  int64_t m;
  int64_t ldx;
  const uint8_t* w;  // packed [num_tiles(N)] tiles
  QType type;
  int64_t rows;  // N (columns of y past N are never written)
  int64_t cols;  // K
  const float* bias;  // [N] or null
  float* y;  // [m, N], row stride ldy
  int64_t ldy;
  bool accumulate;
  int64_t tile_begin;
  int64_t tile_end;
  float* scratch;  // job_scratch_floats(cols) floats, 64-byte aligned, private to this job
  // Lines [side_begin, side_end) of `side` to prefetch while the job computes (null: none).
  const SidePrefetch* side;
  int64_t side_begin;
  int64_t side_end;
  // The scaled-code types' codes (nibble words, Q6_K) in their subnormal form (above), where this
  // thread reads subnormals (subnormals_read); else as scaled integers. Other types: no effect.
  bool subnormal_codes = false;
};

// One job of a GEMM over x prepared per row and block (Rows: q8.h's Q8Rows, the int8 activations;
// digits.h's DigitRows, the digit form): y[i, 16 tile ..] for tiles [tile_begin, tile_end), all
// rows of x; the weights packed as for the exact kernels.
template <class Rows>
struct PreparedJob {
  Rows x;
  const uint8_t* w;
  QType type;
  int64_t rows;  // N
  int64_t cols;  // K
  const float* bias;
  float* y;
  int64_t ldy;
  bool accumulate;
  int64_t tile_begin;
  int64_t tile_end;
  // Lines [side_begin, side_end) of `side` to prefetch while the job computes (as TileJob's).
  const SidePrefetch* side;
  int64_t side_begin;
  int64_t side_end;
};

// A job's scratch: [panels: <= 2048 columns x 16 rows][partial sums: <= kScratchPartRows rows x 4
// tiles x 16][x packed: ~512 KB, and at least 16 rows x K][the packed rows' block sums X: a
// sixteenth of x packed (blocks of 16 columns or more)] fp32.
constexpr int64_t kScratchPanelFloats = 2048 * kTileRows;
constexpr int64_t kScratchPartRows = 1024;
constexpr int64_t kScratchPartFloats = kScratchPartRows * 4 * kTileRows;
constexpr int64_t kScratchXFloats = 512 * 1024 / 4;
inline int64_t job_scratch_x_floats(int64_t cols) {
  return kScratchXFloats > 16 * cols ? kScratchXFloats : 16 * cols;
}
inline int64_t job_scratch_floats(int64_t cols) {
  return kScratchPanelFloats + kScratchPartFloats + job_scratch_x_floats(cols) + job_scratch_x_floats(cols) / 16;
}

}  // namespace backfill
