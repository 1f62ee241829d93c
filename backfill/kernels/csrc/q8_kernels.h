// The int8-activation GEMM kernels (q8.h), written once over qgemm_kernels.h's 16-lane primitives
// and included after it by the ISA units that run them, which define beforehand:
//   vi_zero() (16 int32 zeros), vq_dot(acc, a, word): acc[l] + the sum over the 4 bytes j of lane
//   l of unsigned a[l].byte j times signed word.byte j (the int32 word broadcast), exactly;
//   the blocking constants kQ8NT1 (tiles at one row of x), kQ8NT and kQ8MR (tiles x rows above).
// Lanes run across 16 output rows as in the exact kernels; a nibble word (packed.h) gives the
// even columns of its 8 by one and and the odd ones by a shift and an and, each 4 codes a lane
// as bytes, dotted with 4 int8 x values per instruction (x in q8_dot_column order).
#pragma once

#include "q8.h"

#define BF_AI inline __attribute__((always_inline))
#define BF_UNROLL _Pragma("GCC unroll 16")

namespace backfill {
namespace {

// Block b's codes (4 nibble words), scale d and offset m (w = q d + m) of the 16 rows of `tile`.
template <QType T>
BF_AI const uint8_t* q8_weight_block(const uint8_t* tile, int64_t b, VF* d, VF* m) {
  if constexpr (T == QType::Q4_K) {  // b: a 32-column sub-block of a 256-column super-block
    const uint8_t* blk = tile + b / 8 * kQ4_KTileBlockBytes;
    DqQ4_K<false>::scales(blk, static_cast<int>(b % 8), d, m);
    return blk + tile_off::kQ4_KQs + 4 * 64 * (b % 8);
  } else {
    constexpr bool kMin = T == QType::Q4_1;
    const uint8_t* blk = tile + b * DqQ4<kMin, false>::kBlockBytes;
    *d = vf_load_f16(blk);
    *m = kMin ? vf_load_f16(blk + tile_off::kQ4_1M) : vf_mul(*d, vf_set1(-8.0f));
    return blk + DqQ4<kMin, false>::kQs;
  }
}

// Rows [row0, row0 + MR) of x against tiles [tile0, tile0 + NT): per block, the integer sums in
// MR x NT accumulators (the nibbles taken out once for all MR rows), then folded into y. The
// tiles' first pass over them (`lead`) prefetches their chunks ahead (kFusedPrefetchChunks
// 32-column chunks, into L2, running on into the next tiles) as the fused kernel does; every pass
// prefetches its share of the side lines. (On a Zen 4 EPYC without them: the step at batch 8 and
// 32 12% slower, the attention paying for its K/V.)
template <QType T, int MR, int NT>
__attribute__((noinline)) void q8_block(const Q8Job& job, int64_t row0, int64_t tile0, bool lead, SideCursor& side) {
  const int64_t tb = tile_bytes(job.type, job.cols), nb = job.x.nb, cb = tb / nb;
  if (lead && tile0 == job.tile_begin)  // the job's first chunks; later ones come ahead of use
    for (int64_t c = 0; c < kFusedPrefetchChunks; ++c) prefetch_chunk<NT>(job, tile0, c, nb, tb, cb);
  const uint8_t* tiles[NT];
  BF_UNROLL for (int t = 0; t < NT; ++t) tiles[t] = job.w + (tile0 + t) * tb;
  VF y[MR][NT];
  BF_UNROLL for (int i = 0; i < MR; ++i) BF_UNROLL for (int t = 0; t < NT; ++t) y[i][t] = vf_zero();
  for (int64_t b = 0; b < nb; ++b) {
    if (lead) prefetch_chunk<NT>(job, tile0, b + kFusedPrefetchChunks, nb, tb, cb);
    side.burst();
    const uint8_t* qs[NT];
    VF d[NT], m[NT];
    BF_UNROLL for (int t = 0; t < NT; ++t) qs[t] = q8_weight_block<T>(tiles[t], b, &d[t], &m[t]);
    VI acc[MR][NT];
    BF_UNROLL for (int i = 0; i < MR; ++i) BF_UNROLL for (int t = 0; t < NT; ++t) acc[i][t] = vi_zero();
    const uint8_t* xq = job.x.q + (row0 * nb + b) * 32;
    for (int w = 0; w < 4; ++w) {
      VI lo[NT], hi[NT];
      BF_UNROLL for (int t = 0; t < NT; ++t) {
        const VI v = vi_load_u32(qs[t] + 64 * w);
        lo[t] = vi_and(v, 0x0F0F0F0F);
        hi[t] = vi_and(vi_srl<4>(v), 0x0F0F0F0F);
      }
      BF_UNROLL for (int i = 0; i < MR; ++i) {
        int32_t even, odd;
        __builtin_memcpy(&even, xq + i * nb * 32 + 8 * w, 4);
        __builtin_memcpy(&odd, xq + i * nb * 32 + 8 * w + 4, 4);
        BF_UNROLL for (int t = 0; t < NT; ++t) {
          acc[i][t] = vq_dot(acc[i][t], lo[t], even);
          acc[i][t] = vq_dot(acc[i][t], hi[t], odd);
        }
      }
    }
    BF_UNROLL for (int i = 0; i < MR; ++i) {
      const VF dx = vf_set1(job.x.d[(row0 + i) * nb + b]), sx = vf_set1(job.x.s[(row0 + i) * nb + b]);
      BF_UNROLL for (int t = 0; t < NT; ++t) {
        y[i][t] = vf_fma(vi_to_f(acc[i][t]), vf_mul(d[t], dx), y[i][t]);
        y[i][t] = vf_fma(m[t], sx, y[i][t]);
      }
    }
  }
  store_acc<MR, NT>(y, job, row0, tile0);
}

template <QType T, int NT, int MR = 1>
void q8_rows(const Q8Job& job, int mr, int64_t row0, int64_t tile0, bool lead, SideCursor& side) {
  if constexpr (MR < kQ8MR) {
    if (mr != MR) return q8_rows<T, NT, MR + 1>(job, mr, row0, tile0, lead, side);
  }
  q8_block<T, MR, NT>(job, row0, tile0, lead, side);
}

// Rows [r0, r1) against tiles [tile0, tile0 + NT), kQ8MR rows at a time.
template <QType T, int NT>
void q8_row_range(const Q8Job& job, int64_t r0, int64_t r1, int64_t tile0, SideCursor& side) {
  for (int64_t row = r0; row < r1; row += kQ8MR)
    q8_rows<T, NT>(job, static_cast<int>(r1 - row < kQ8MR ? r1 - row : kQ8MR), row, tile0, row == r0, side);
}

// Rows of x in chunks (~256 KB of int8 x, kept in L2 while the job's tiles pass over them), each
// tile group against all the chunk's rows: every row's sums are the same whatever the chunk, the
// group or M.
template <QType T>
void q8_run(const Q8Job& job) {
  const int64_t m = job.x.m, tiles = job.tile_end - job.tile_begin;
  SideCursor side;  // spread over every block the job runs
  if (m == 1) {
    side.start(job.side, job.side_begin, job.side_end, (tiles + kQ8NT1 - 1) / kQ8NT1 * job.x.nb);
    int64_t tile = job.tile_begin;
    for (; tile + kQ8NT1 <= job.tile_end; tile += kQ8NT1) q8_block<T, 1, kQ8NT1>(job, 0, tile, true, side);
    for (; tile < job.tile_end; ++tile) q8_block<T, 1, 1>(job, 0, tile, true, side);
    return;
  }
  const int64_t chunk = (int64_t{1} << 18) / job.cols > kQ8MR ? (int64_t{1} << 18) / job.cols : kQ8MR;
  side.start(job.side, job.side_begin, job.side_end,
             (tiles / kQ8NT + tiles % kQ8NT) * ((m + kQ8MR - 1) / kQ8MR + (m + chunk - 1) / chunk) * job.x.nb);
  for (int64_t r0 = 0; r0 < m; r0 += chunk) {
    const int64_t r1 = r0 + chunk < m ? r0 + chunk : m;
    int64_t tile = job.tile_begin;
    for (; tile + kQ8NT <= job.tile_end; tile += kQ8NT) q8_row_range<T, kQ8NT>(job, r0, r1, tile, side);
    for (; tile < job.tile_end; ++tile) q8_row_range<T, 1>(job, r0, r1, tile, side);
  }
}

BF_AI void run_q8_gemm(const Q8Job& job) {
  switch (job.type) {
    case QType::Q4_0: q8_run<QType::Q4_0>(job); break;
    case QType::Q4_1: q8_run<QType::Q4_1>(job); break;
    case QType::Q4_K: q8_run<QType::Q4_K>(job); break;
    default: break;  // (q8_activation_type: never dispatched here)
  }
}

}  // namespace
}  // namespace backfill

#undef BF_AI
#undef BF_UNROLL
