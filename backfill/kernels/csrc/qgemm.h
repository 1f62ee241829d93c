// Linear layers over weights as stored: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32
// activations and accumulation; W in any QType. Also row dequantization (embeddings, tests).
#pragma once

#include "qtypes.h"

namespace backfill {

struct Team;  // team.h

// Scalar reference: dequantize row `row` of `w` into out[0 .. w.cols). Defines the numbers
// every fast kernel must reproduce (up to fp32 summation order).
void dequantize_row_ref(const QMatrix& w, int64_t row, float* out);

// The block types' factored form (the fast kernels' numbers, see TileJob): row `row`'s integer
// codes q[0 .. cols) as fp32 and each block's scale d and offset m (blocks of
// factored_block_elems(type) columns: 32, 16 for Q6_K; 0 for F32 / F16, which are not factored),
// w = fma(q, d, m) exactly as dequantize_row_ref gives it.
int64_t factored_block_elems(QType type);
void factored_row_ref(const QMatrix& w, int64_t row, float* q, float* d, float* m);

// Scalar reference GEMM over output rows [n_begin, n_end): single-threaded.
void qgemm_ref(const float* x, int64_t m, int64_t ldx, const QMatrix& w, const float* bias, float* y,
               int64_t ldy, int64_t n_begin, int64_t n_end);

// Which instruction set the fast kernels use on this CPU: "avx512", "avx2" or "scalar"
// (detected once at run time; BACKFILL_ISA=avx2|scalar forces a lower one, for tests).
const char* active_isa();
// Switch the fast kernels to "avx512", "avx2" or "scalar" from now on (tests, benchmarks); false
// (and no change) for an unknown name or one this CPU cannot run. Not for use mid-GEMM.
bool set_active_isa(const char* name);

// ---------------------------------------------------------------------------------------------
// The fast path: weights re-laid-out once at load time ("packed": same blocks, same bits per
// weight, interleaved so a SIMD register holds one weight of each of 16 output rows), then read
// as stored by every step. The packed layout is private to these kernels.

// A packed matrix: `rows` output features (N), `cols` input features (K), of `type`.
struct PackedMatrix {
  const uint8_t* data;
  QType type;
  int64_t rows;
  int64_t cols;
  // Opt-in: x quantized to int8 per 32-column block for this matrix's products (q8.h), where
  // its type allows it (q8_activation_type); not exact, and not batch-dependent either.
  bool q8_activations = false;
};

// Bytes the packed form of a [rows, cols] matrix of `type` takes.
int64_t packed_bytes(QType type, int64_t rows, int64_t cols);
// raw: rows x w.row_bytes in GGUF layout -> out: packed_bytes(...) bytes.
void repack(const QMatrix& raw, uint8_t* out);

// Whether the 4-bit types' codes are read in their subnormal form (packed.h: TileJob), on every
// ISA: measured once per process where not set (BACKFILL_SUBNORMAL_CODES=0 / 1, or
// set_subnormal_codes). The numbers are the nibble form's unless |x q| or a code sum falls below
// 2^-41 (packed.h); every ISA and batch agree either way. Not for use mid-GEMM.
bool subnormal_codes();
void set_subnormal_codes(bool on);

// Whether Q4_0 / Q4_1 / Q4_K / Q8_0 products run in the digit form (digits.h: x on a 24-bit
// fixed-point grid per 32-column block, exact integer sums, one rounding a block), whose numbers
// the AMX tile unit and the VNNI byte dots reproduce at any row count: on by default where the CPU
// and OS run AMX and the AVX-512 VNNI kernels (BACKFILL_DIGITS=0 / 1 decides instead;
// BACKFILL_AMX_ROWS sets the fewest rows a group of 16 runs AMX with, 0: never). Every ISA and
// batch agree in either form; the two forms differ by about one fp32 rounding a block. Not for use
// mid-GEMM.
bool digit_form();
void set_digit_form(bool on);
// Whether the digit form runs on the AMX tile unit in this process.
bool amx_active();
// The fewest rows packed_gemm runs w's products with on the AMX tile unit (a group of up to 16),
// or 0 where it never does (another type or form, int8 activations, no AMX).
int64_t amx_group_rows(const PackedMatrix& w);
// Whether packed_gemm computes w's products in the digit form.
bool digit_form_runs(const PackedMatrix& w);

// Whether this CPU runs the int8-activation kernels with VNNI ("avx512vnni") or without
// ("avx2", "scalar"): the numbers are the same.
const char* q8_isa();

// y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T (+ bias[N]) (+ y if accumulate).
// Multi-threaded over torch's intra-op pool. Batch invariant: y[i, n] does not depend on M,
// on the other rows of x, on the thread count or on the ISA. `side` (optional): memory the
// threads prefetch as they compute, spread over their FMA blocks (the scalar kernels ignore it).
// It never changes y. `team` (optional): run by every thread of a team, each its share of the
// output tiles, and return without a barrier (see team.h).
void packed_gemm(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, const float* bias, float* y,
                 int64_t ldy, bool accumulate, const SidePrefetch* side = nullptr, const Team* team = nullptr);
// The bytes of w a team thread reads first in packed_gemm(x of m rows, w, .., team): the start and
// end of its share of the tiles (what a thread waiting at a barrier before it may prefetch).
// Empty where it has none.
void packed_gemm_share(const PackedMatrix& w, int64_t m, const Team& team, const uint8_t** begin,
                       const uint8_t** end);
// out[i, :] = row rows[i] of W as fp32 (bit-exact with dequantize_row_ref); `team` as packed_gemm's.
void packed_dequantize_rows(const PackedMatrix& w, const int64_t* rows, int64_t num_rows, float* out,
                            int64_t ld_out, const Team* team = nullptr);

}  // namespace backfill
