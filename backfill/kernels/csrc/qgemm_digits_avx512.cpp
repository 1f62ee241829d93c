// The digit form's kernels (digits.h) on AVX-512: x's preparation, vpdpbusd dots for a few rows,
// and the AMX tile unit (TDPBF16PS) for groups of 16 rows, all to the bits of digits_gemm_scalar.
// A unit of its own: its target adds VNNI, AVX512-BF16 and AMX, which only the CPUs that pass
// amx_ready() / the VNNI check in qgemm.cpp run (isa.h).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c")
#include <cpuid.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd_avx512.h"

#include "qgemm_kernels.h"
#include "digits.h"

#define DG_AI inline __attribute__((always_inline))
#define DG_UNROLL _Pragma("GCC unroll 16")

namespace backfill {
namespace {

// The pair order (digit_pair_column) within each 16 columns: element j takes column kPairOrder[j].
alignas(64) constexpr int32_t kPairOrder[16] = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};

// Where block b (32 columns) of `tile` keeps its 16 rows' codes (4 nibble words; Q8_0: 8 byte
// words), and its scale d and offset m (Q4_K: sub-block b % 8 of super-block b / 8, its 6-bit scale
// and min applied; Q8_0: none).
template <QType T>
DG_AI const uint8_t* digit_codes(const uint8_t* tile, int64_t b) {
  if constexpr (T == QType::Q4_K) return tile + b / 8 * kQ4_KTileBlockBytes + tile_off::kQ4_KQs + 4 * 64 * (b % 8);
  else if constexpr (T == QType::Q8_0) return tile + b * kTileRows * block_bytes(T) + tile_off::kQ8_0Qs;
  else return tile + b * kTileRows * block_bytes(T) + (T == QType::Q4_1 ? tile_off::kQ4_1Qs : tile_off::kQ4_0Qs);
}
template <QType T>
DG_AI void digit_scales(const uint8_t* tile, int64_t b, VF* d, VF* m) {
  if constexpr (T == QType::Q4_K) {
    DqQ4_K<false>::scales(tile + b / 8 * kQ4_KTileBlockBytes, static_cast<int>(b % 8), d, m);
  } else if constexpr (T == QType::Q8_0) {
    *d = vf_load_f16(tile + b * kTileRows * block_bytes(T));
    *m = vf_zero();
  } else {
    const uint8_t* blk = tile + b * kTileRows * block_bytes(T);
    *d = vf_load_f16(blk);
    *m = T == QType::Q4_1 ? vf_load_f16(blk + tile_off::kQ4_1M) : vf_mul(*d, vf_set1(-8.0f));
  }
}

// c u rounded once for one row's 16 columns from its three byte dots (digits.h).
DG_AI __m512 digit_sum(__m512i c2, __m512i c1, __m512i c0, float u) {
  const __m512i t = _mm512_add_epi32(_mm512_slli_epi32(c1, 8), c0);
  const __m512i a = _mm512_add_epi32(c2, _mm512_srai_epi32(t, 16));
  const __m512i l = _mm512_and_si512(t, _mm512_set1_epi32(0xFFFF));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(u * 65536.0f),
                         _mm512_mul_ps(_mm512_cvtepi32_ps(l), _mm512_set1_ps(u)));
}

DG_AI int32_t load_i32(const uint8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

// Rows [row0, row0 + MR) against tiles [tile0, tile0 + NT) with vpdpbusd, 8 quads of columns a
// block: a nibble word's lane gives 4 codes as bytes by one and (its even columns) or a shift and
// an and (odd), dotted with x's D2 (signed: the codes the unsigned operand) and D1, D0 (unsigned:
// the codes the signed one) of those columns; a byte word's lane is 4 codes q + 128 (unsigned,
// against D2, the sum started at -128 sum D2) and, its top bits flipped, q (signed, against D1 and
// D0). Prefetching as q8_block does.
template <QType T, int MR, int NT>
__attribute__((noinline)) void digit_block(const DigitJob& job, int64_t row0, int64_t tile0, bool lead,
                                           SideCursor& side) {
  const int64_t tb = tile_bytes(job.type, job.cols), nb = job.x.nb, cb = tb / nb;
  if (lead && tile0 == job.tile_begin)
    for (int64_t c = 0; c < kFusedPrefetchChunks; ++c) prefetch_chunk<NT>(job, tile0, c, nb, tb, cb);
  const uint8_t* tiles[NT];
  DG_UNROLL for (int t = 0; t < NT; ++t) tiles[t] = job.w + (tile0 + t) * tb;
  VF y[MR][NT];
  DG_UNROLL for (int i = 0; i < MR; ++i) DG_UNROLL for (int t = 0; t < NT; ++t) y[i][t] = vf_zero();
  constexpr bool kBytes = T == QType::Q8_0;
  const __m512i mask = _mm512_set1_epi32(0x0F0F0F0F), flip = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  for (int64_t b = 0; b < nb; ++b) {
    if (lead) prefetch_chunk<NT>(job, tile0, b + kFusedPrefetchChunks, nb, tb, cb);
    side.burst();
    const uint8_t* codes[NT];
    DG_UNROLL for (int t = 0; t < NT; ++t) codes[t] = digit_codes<T>(tiles[t], b);
    const uint8_t* rec[MR];
    __m512i c2[MR][NT], c1[MR][NT], c0[MR][NT];
    DG_UNROLL for (int i = 0; i < MR; ++i) {
      rec[i] = job.x.rows + ((row0 + i - job.x.amx_end) * nb + b) * kDigitRowBytes;
      const __m512i start = kBytes ? _mm512_set1_epi32(-128 * load_i32(rec[i] + digit_rec::kSumD2)) : _mm512_setzero_si512();
      DG_UNROLL for (int t = 0; t < NT; ++t) {
        c2[i][t] = start;
        c1[i][t] = c0[i][t] = _mm512_setzero_si512();
      }
    }
    __m512i v[NT];
    DG_UNROLL for (int p = 0; p < 8; ++p) {
      __m512i ucode[NT], scode[NT];  // (the dots' unsigned and signed operands)
      DG_UNROLL for (int t = 0; t < NT; ++t) {
        if constexpr (kBytes) {
          ucode[t] = _mm512_loadu_si512(codes[t] + 64 * p);
          scode[t] = _mm512_xor_si512(ucode[t], flip);
        } else {
          if (p % 2 == 0) v[t] = _mm512_loadu_si512(codes[t] + 32 * p);
          ucode[t] = scode[t] = _mm512_and_si512(p % 2 == 0 ? v[t] : _mm512_srli_epi32(v[t], 4), mask);
        }
      }
      DG_UNROLL for (int i = 0; i < MR; ++i) {
        const __m512i b2 = _mm512_set1_epi32(load_i32(rec[i] + digit_rec::kD2 + 4 * p));
        const __m512i b1 = _mm512_set1_epi32(load_i32(rec[i] + digit_rec::kD1 + 4 * p));
        const __m512i b0 = _mm512_set1_epi32(load_i32(rec[i] + digit_rec::kD0 + 4 * p));
        DG_UNROLL for (int t = 0; t < NT; ++t) {
          c2[i][t] = _mm512_dpbusd_epi32(c2[i][t], ucode[t], b2);
          c1[i][t] = _mm512_dpbusd_epi32(c1[i][t], b1, scode[t]);
          c0[i][t] = _mm512_dpbusd_epi32(c0[i][t], b0, scode[t]);
        }
      }
    }
    VF d[NT], m[NT];
    DG_UNROLL for (int t = 0; t < NT; ++t) digit_scales<T>(tiles[t], b, &d[t], &m[t]);
    DG_UNROLL for (int i = 0; i < MR; ++i) {
      float u, xs;
      __builtin_memcpy(&u, rec[i] + digit_rec::kU, 4);
      __builtin_memcpy(&xs, rec[i] + digit_rec::kXb, 4);
      const VF xsv = vf_set1(xs);
      DG_UNROLL for (int t = 0; t < NT; ++t) {
        y[i][t] = vf_fma(VF{digit_sum(c2[i][t], c1[i][t], c0[i][t], u)}, d[t], y[i][t]);
        if constexpr (!kBytes) y[i][t] = vf_fma(m[t], xsv, y[i][t]);
      }
    }
  }
  store_acc<MR, NT>(y, job, row0, tile0);
}

template <int N>
struct Int {
  static constexpr int value = N;
};

constexpr int kDigitNT1 = 4;  // one row: 4 tiles
// more rows: 2 tiles x up to 4 rows (three sums a row and tile; on a 2-core Sapphire Rapids Xeon
// 3 x 2, 4 x 1 and 2 x 2 ran 2-20% slower at 4-12 rows)
constexpr int kDigitNT = 2;
constexpr int kDigitMR = 4;

template <QType T, int NT, int MR = 1>
void digit_rows(const DigitJob& job, int mr, int64_t row0, int64_t tile0, bool lead, SideCursor& side) {
  if constexpr (MR < kDigitMR) {
    if (mr != MR) return digit_rows<T, NT, MR + 1>(job, mr, row0, tile0, lead, side);
  }
  digit_block<T, MR, NT>(job, row0, tile0, lead, side);
}

// Rows [r0, r1) with the vector dots: tiles in groups, rows kDigitMR at a time (as q8_run).
template <QType T>
void vnni_rows(const DigitJob& job, int64_t r0, int64_t r1, SideCursor& side) {
  int64_t tile = job.tile_begin;
  if (r1 - r0 == 1) {
    for (; tile + kDigitNT1 <= job.tile_end; tile += kDigitNT1) digit_block<T, 1, kDigitNT1>(job, r0, tile, true, side);
    for (; tile < job.tile_end; ++tile) digit_block<T, 1, 1>(job, r0, tile, true, side);
    return;
  }
  const auto rows = [&](auto nt, int64_t tile0) {
    for (int64_t row = r0; row < r1; row += kDigitMR)
      digit_rows<T, decltype(nt)::value>(job, static_cast<int>(r1 - row < kDigitMR ? r1 - row : kDigitMR), row, tile0,
                                         row == r0, side);
  };
  for (; tile + kDigitNT <= job.tile_end; tile += kDigitNT) rows(Int<kDigitNT>{}, tile);
  for (; tile < job.tile_end; ++tile) rows(Int<1>{}, tile);
}

int64_t vnni_bursts(int64_t rows, int64_t tiles, int64_t nb) {
  if (rows <= 0) return 0;
  if (rows == 1) return (tiles / kDigitNT1 + tiles % kDigitNT1) * nb;
  return (tiles / kDigitNT + tiles % kDigitNT) * ((rows + kDigitMR - 1) / kDigitMR) * nb;
}

// ---------------------------------------------------------------------------------------------
// AMX: per group of up to 16 rows, its blocks as build_group prepared them (DigitRows: groups);
// per chunk of up to kAmxChunk tiles (a job's tiles cut into equal chunks), blocks outer (the
// group's 4 A tiles stay in tile registers), tiles inner: the tile block's codes converted to
// bf16(q) (a shift, an and and a word permute per 8 columns: convert_codes; Q8_0's ~4 operations a
// column of 16: convert_codes8) kConvAhead tile blocks ahead into a ring, 4 TDPBF16PS into two
// zeroed sum tiles, stored and folded into y kFoldLag tile blocks later. Tiles: 0-3 A, 4 B, 5-7
// the sums in turn. (A 2-core Sapphire Rapids Xeon, a Q4_1 [3072, 576] at 16 rows from memory, one
// thread: session 64's loop 1.45-1.5x the FMA kernels' speed, session 65's ~1.77x: the rings in
// L1, codes as bf16(q) without start tiles, no divisions, the delayed tile stores.)

constexpr int kAmxChunk = 16;
constexpr int kConvAhead = 3;
constexpr int kFoldLag = 3;  // >= 2: a tile block's sums are stored in the next one's turn
// The code tiles' and the sums' rings, apart: a B slot is written kConvAhead tile blocks before
// its tile load and a sums slot read kFoldLag after its tile stores. Small, so that the loop's
// lines stay in L1 (48 KB on a Sapphire Rapids) beside y (16 KB at 16 tiles) and the group's
// blocks: its tile and vector stores to lines L1 has lost cost ~2x more (a microbenchmark: tile
// work with 16 vector stores a tile block 35 ns with 32 KB of buffers, 57 with 48 KB). One
// shared ring of 8 (16 KB of sums, 8 KB of codes): the default model's Q4_1 linears at 16 rows
// ~5% slower on a 2-core Sapphire Rapids Xeon (in-process A/B, 7 rounds).
constexpr int kBRing = 4;    // > kConvAhead, a power of two
constexpr int kSumRing = 4;  // > kFoldLag, a power of two
// With several groups of rows, a chunk's codes are converted once, by the first group, and kept for
// the others while they take at most this much (else converted again per group, through the ring):
// a Q8_0 tile block's conversion (~128 vector operations) costs about half its tile work at 16 rows
// (the default model's LM head at 32 / 64 rows 4.7 -> 4.3 / 9.7 -> 7.6-8.3 ms; a 2,048-token
// prompt's Q4_1 ~2% faster).
constexpr int64_t kKeepBytes = 512 * 1024;

struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void load_tile_config(int rows) {
  alignas(64) TileConfig cfg;
  __builtin_memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  const int group_tiles[] = {0, 1, 2, 3, 5, 6, 7};  // A and the sums: the group's rows
  for (int t : group_tiles) cfg.rows[t] = static_cast<uint8_t>(rows);
  _tile_loadconfig(&cfg);
}

// This thread's scratch, 64-byte aligned, grown on demand and kept (never freed: one per thread).
uint8_t* amx_scratch(int64_t bytes) {
  static thread_local uint8_t* buf = nullptr;
  static thread_local int64_t cap = 0;
  if (cap < bytes) {
    free(buf);
    cap = (bytes + 4095) / 4096 * 4096;
    buf = static_cast<uint8_t*>(aligned_alloc(64, static_cast<size_t>(cap)));
    __builtin_memset(buf, 0, static_cast<size_t>(cap));  // (a partial group's sum rows past its own are read, never stored)
  }
  return buf;
}

// Q8_0's tile block codes as the B tile: row p holds the 16 rows' pairs (q of columns 2 p, 2 p + 1)
// as bf16: a byte word's lane (4 columns, q + 128) gives rows 2 w and 2 w + 1 by its top bits
// flipped, each byte sign-extended and converted to fp32 (exact: 8 bits), and each pair's upper
// halves (the bf16, exactly) merged into a lane.
DG_AI void convert_codes8(const uint8_t* qs, uint16_t* out) {
  const __m512i flip = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  const __m512i upper = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  DG_UNROLL for (int w = 0; w < 8; ++w) {
    const __m512i s = _mm512_xor_si512(_mm512_loadu_si512(qs + 64 * w), flip);
    const __m512i f0 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(s, 24), 24)));
    const __m512i f1 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(s, 16), 24)));
    const __m512i f2 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(s, 8), 24)));
    const __m512i f3 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srai_epi32(s, 24)));
    // (ternary logic 0xEA: (a & b) | c)
    _mm512_store_si512(out + 32 * (2 * w), _mm512_ternarylogic_epi32(f1, upper, _mm512_srli_epi32(f0, 16), 0xEA));
    _mm512_store_si512(out + 32 * (2 * w + 1), _mm512_ternarylogic_epi32(f3, upper, _mm512_srli_epi32(f2, 16), 0xEA));
  }
}

// One tile block's codes as the B tile: row p = 4 w + c holds the 16 rows' pairs (q of columns
// 8 w + c, 8 w + c + 4) as bf16: a nibble word's 32-bit lane shifted by 4 c and masked to the
// two codes' nibbles (one per 16-bit half), each half then looked up in a table of bf16(0 .. 15)
// by one word permute. (bf16(16 + q), 0x4180 | q << 3 by a shift and one ternary logic, needed
// sum tiles started at -16 times x's digit sums: two more tile loads a tile block, which cost
// more beside the vector work than the permute; a 2-core Sapphire Rapids Xeon, the default
// model's Q4_1 linears at 16 rows, ~3-6% faster.)
DG_AI void convert_codes(const uint8_t* qs, uint16_t* out) {
  alignas(64) static constexpr uint16_t kBf16Codes[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0,
                                                          0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130,
                                                          0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i table = _mm512_load_si512(kBf16Codes), mask = _mm512_set1_epi32(0x000F000F);
  DG_UNROLL for (int w = 0; w < 4; ++w) {
    const __m512i word = _mm512_loadu_si512(qs + 64 * w);  // (Q4_0's tile blocks are 288 bytes)
    _mm512_store_si512(out + 32 * (4 * w + 0), _mm512_permutexvar_epi16(_mm512_and_si512(word, mask), table));
    _mm512_store_si512(out + 32 * (4 * w + 1),
                       _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi32(word, 4), mask), table));
    _mm512_store_si512(out + 32 * (4 * w + 2),
                       _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi32(word, 8), mask), table));
    _mm512_store_si512(out + 32 * (4 * w + 3),
                       _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi32(word, 12), mask), table));
  }
}

// Block b of `tile`'s codes as a B tile at out; `ahead`: the chunk's first pass over the weights,
// which reads them from memory: two blocks of the tile ahead go into L2 beside it.
template <QType T>
DG_AI void convert_block(const uint8_t* tile, int64_t b, int64_t nb, bool ahead, uint16_t* out) {
  if (ahead && b + 2 < nb) {
    const uint8_t* next = digit_codes<T>(tile, b + 2);
    for (int l = 0; l < (T == QType::Q8_0 ? 512 : 256); l += 64) _mm_prefetch(reinterpret_cast<const char*>(next + l), _MM_HINT_T1);
    // (the scales: Q4_0 / Q4_1 before their codes, Q4_K's at the head of each 256 columns)
    const uint8_t* head = T == QType::Q4_K ? ((b + 2) % 8 == 0 ? tile + (b + 2) / 8 * kQ4_KTileBlockBytes : nullptr)
                                           : tile + (b + 2) * kTileRows * block_bytes(T);
    if (head != nullptr)
      for (int l = 0; l < (T == QType::Q4_K ? 320 : 64); l += 64) _mm_prefetch(reinterpret_cast<const char*>(head + l), _MM_HINT_T1);
  }
  if constexpr (T == QType::Q8_0) convert_codes8(digit_codes<T>(tile, b), out);
  else convert_codes(digit_codes<T>(tile, b), out);
}

// A tile block's two sums (ca, ca + 256: [16][16] each) into y (its 16 rows, ystride apart):
// y = fma(ca + cb, d, y), then fma(Xb, m, y), with d, m block b of `tile`'s and Xb its group block's.
template <QType T>
DG_AI void fold_block(const float* ca, const uint8_t* tile, int64_t b, const uint8_t* group_block, float* y,
                      int64_t ystride, int rows) {
  const float* cb = ca + 256;
  VF d, m;
  digit_scales<T>(tile, b, &d, &m);
  const float* xs = reinterpret_cast<const float*>(group_block + kDigitGroupXb);
  const auto row = [&](int i) __attribute__((always_inline)) {
    const __m512 s = _mm512_add_ps(_mm512_load_ps(ca + 16 * i), _mm512_load_ps(cb + 16 * i));
    __m512 yv = _mm512_load_ps(y + i * ystride);
    yv = _mm512_fmadd_ps(s, d.v, yv);
    yv = _mm512_fmadd_ps(_mm512_set1_ps(xs[i]), m.v, yv);
    _mm512_store_ps(y + i * ystride, yv);
  };
  if (rows == 16) {
    DG_UNROLL for (int i = 0; i < 16; ++i) row(i);
  } else {  // (a partial group's other rows are never stored)
    for (int i = 0; i < rows; ++i) row(i);
  }
}

// Groups of rows [r0, r1) (16 each, the last one fewer) against the job's tiles on the tile unit.
template <QType T>
void amx_rows(const DigitJob& job, int64_t r0, int64_t r1, SideCursor& side) {
  const int64_t nb = job.x.nb, tb = tile_bytes(T, job.cols), groups = (r1 - r0 + 15) / 16;
  const int64_t max_nj = nb * (job.tile_end - job.tile_begin < kAmxChunk ? job.tile_end - job.tile_begin : kAmxChunk);
  const int64_t keep_bytes = groups > 1 && max_nj * 1024 <= kKeepBytes ? max_nj * 1024 : 0;
  uint8_t* scratch = amx_scratch(kSumRing * 512 * 4 + kBRing * 512 * 2 + 16 * kAmxChunk * 16 * 4 + keep_bytes);
  float* sums = reinterpret_cast<float*>(scratch);                      // [kSumRing][2][16][16]
  uint16_t* ring = reinterpret_cast<uint16_t*>(sums + kSumRing * 512);  // [kBRing][16][32]
  float* ybuf = reinterpret_cast<float*>(ring + kBRing * 512);          // [16][kAmxChunk][16]
  uint16_t* kept = reinterpret_cast<uint16_t*>(ybuf + 16 * kAmxChunk * 16);  // [nj][16][32] (keep_bytes)
  int cfg_rows = -1;
  // the job's tiles in equal chunks of at most kAmxChunk (a short last chunk reloads the A tiles
  // per block for few tiles)
  const int64_t num_chunks = (job.tile_end - job.tile_begin + kAmxChunk - 1) / kAmxChunk;
  for (int64_t c = 0, t0 = job.tile_begin; c < num_chunks; ++c) {
    const int ct = static_cast<int>((job.tile_end - t0) / (num_chunks - c));
    const int64_t t_next = t0 + ct;
    const int64_t nj = nb * ct;
    const uint8_t* chunk = job.w + t0 * tb;
    const bool keep = keep_bytes > 0 && nj * 1024 <= keep_bytes;
    // the B tile of tile block j
    const auto slot = [&](int64_t j) { return keep ? kept + j * 512 : ring + (j % kBRing) * 512; };
    for (int64_t g = 0; g < groups; ++g) {
      const bool convert = !keep || g == 0;
      const int rows = static_cast<int>(r1 - r0 - 16 * g < 16 ? r1 - r0 - 16 * g : 16);
      if (rows != cfg_rows) {
        load_tile_config(rows);
        cfg_rows = rows;
      }
      const uint8_t* const* grp = job.x.groups + (r0 / 16 + g) * nb;  // the group's blocks
      for (int i = 0; i < 16 * kAmxChunk * 16; i += 16) _mm512_store_ps(ybuf + i, _mm512_setzero_ps());
      const int64_t ystride = ct * 16;
      // tile block j = b ct + tt: tile t0 + tt, block b. The conversions and the folds each take
      // the tile blocks in order, one after the other: each keeps its own (j, b, tt), stepped
      // without a division (four 64-bit divisions a tile block cost ~7% of the loop's time)
      struct Cursor {
        int64_t j = 0, b = 0, tt = 0;
        DG_AI void next(int64_t ct) {
          ++j;
          if (++tt == ct) tt = 0, ++b;
        }
      };
      Cursor at_conv, at_fold;
      const auto conv = [&] {
        convert_block<T>(chunk + at_conv.tt * tb, at_conv.b, nb, g == 0, slot(at_conv.j));
        at_conv.next(ct);
      };
      const auto fold = [&] {
        fold_block<T>(sums + (at_fold.j % kSumRing) * 512, chunk + at_fold.tt * tb, at_fold.b, grp[at_fold.b],
                      ybuf + at_fold.tt * 16, ystride, rows);
        at_fold.next(ct);
      };
      if (convert)
        for (int64_t j = 0; j < kConvAhead && j < nj; ++j) conv();
      int64_t j = 0;
      int turn = 0;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* a = grp[b];
        _tile_loadd(0, a, 64);
        _tile_loadd(1, a + 1024, 64);
        _tile_loadd(2, a + 2048, 64);
        _tile_loadd(3, a + 3072, 64);
        for (int tt = 0; tt < ct; ++tt, ++j) {
          side.burst();
          float* cdst = sums + (j % kSumRing) * 512;
          float* prev = sums + ((j + kSumRing - 1) % kSumRing) * 512;  // tile block j - 1's sums
          _tile_loadd(4, slot(j), 64);
          // Tile block j's two sums in sum tiles (X, Y), the pairs (5, 6), (7, 5), (6, 7) in turn,
          // each sum stored after the next two sums' TDPs have gone out (tile block j - 1's beside
          // j's): a tile store right after its own TDPs waited for them, and held the vector work
          // behind it (the Q4_1 linears at 16 rows ~1.07x faster with the store one sum later,
          // ~1.04x more with two). The folds read tile block j - kFoldLag's sums: stored.
#define DG_SUMS(X, Y, PX, PY)                         \
  _tile_zero(X);                                      \
  _tile_dpbf16ps(X, 0, 4);                            \
  _tile_dpbf16ps(X, 1, 4);                            \
  if (j > 0) _tile_stored(PX, prev, 64);              \
  _tile_zero(Y);                                      \
  _tile_dpbf16ps(Y, 2, 4);                            \
  _tile_dpbf16ps(Y, 3, 4);                            \
  if (j > 0) _tile_stored(PY, prev + 256, 64);
          if (turn == 0) {
            DG_SUMS(5, 6, 6, 7)
          } else if (turn == 1) {
            DG_SUMS(7, 5, 5, 6)
          } else {
            DG_SUMS(6, 7, 7, 5)
          }
#undef DG_SUMS
          turn = turn == 2 ? 0 : turn + 1;
          if (convert && j + kConvAhead < nj) conv();
          if (j >= kFoldLag) fold();
        }
      }
      {  // the last tile block's sums: in the pair its turn left them in
        float* last = sums + ((nj - 1) % kSumRing) * 512;
        if (turn == 1) {
          _tile_stored(5, last, 64);
          _tile_stored(6, last + 256, 64);
        } else if (turn == 2) {
          _tile_stored(7, last, 64);
          _tile_stored(5, last + 256, 64);
        } else {
          _tile_stored(6, last, 64);
          _tile_stored(7, last + 256, 64);
        }
      }
      while (at_fold.j < nj) fold();
      for (int i = 0; i < rows; ++i)
        for (int tt = 0; tt < ct; ++tt) {
          const VF acc[1][1] = {{VF{_mm512_load_ps(ybuf + i * ystride + tt * 16)}}};
          store_acc<1, 1>(acc, job, r0 + 16 * g + i, t0 + tt);
        }
    }
    t0 = t_next;
  }
  _tile_release();
}

template <QType T>
void run_digits(const DigitJob& job) {
  const int64_t m = job.x.m, tiles = job.tile_end - job.tile_begin, nb = job.x.nb, amx_end = job.x.amx_end;
  SideCursor side;
  side.start(job.side, job.side_begin, job.side_end, (amx_end + 15) / 16 * tiles * nb + vnni_bursts(m - amx_end, tiles, nb));
  if (amx_end > 0) amx_rows<T>(job, 0, amx_end, side);
  if (amx_end < m) {
    // rows in chunks (~256 KB of x's records kept in L2 while the tiles pass over them)
    const int64_t per = (int64_t{1} << 18) / (nb * kDigitRowBytes), chunk = per > kDigitMR ? per : kDigitMR;
    for (int64_t r0 = amx_end; r0 < m; r0 += chunk) vnni_rows<T>(job, r0, r0 + chunk < m ? r0 + chunk : m, side);
  }
}

// One row-block of x on the grid (digits.h): X of its 32 columns in `order` within each half of 16
// (kPairOrder: the AMX tiles'; kByteOrder, kColumnOrder: the records' of the nibble and byte words),
// or false where the block gives NaN.
struct BlockDigits {
  __m512i x[2];
  float u;
};
DG_AI bool block_digits(const float* x, const int32_t* order, BlockDigits* out) {
  const __m512i perm = _mm512_load_si512(order), abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i v0 = _mm512_castps_si512(_mm512_loadu_ps(x)), v1 = _mm512_castps_si512(_mm512_loadu_ps(x + 16));
  const uint32_t max_bits =
      _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_and_si512(v0, abs_mask), _mm512_and_si512(v1, abs_mask)));
  int e = 0;
  if (!digit_exponent(max_bits, &e)) return false;
  out->u = digit_pow2(e - 22);
  const __m512 scale = _mm512_set1_ps(digit_pow2(22 - e));
  for (int h = 0; h < 2; ++h) {
    const __m512 v = _mm512_permutexvar_ps(perm, _mm512_castsi512_ps(h == 0 ? v0 : v1));
    // round to nearest even (the default MXCSR), 2^23 saturated
    out->x[h] = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, scale)), _mm512_set1_epi32(kDigitMax));
  }
  return true;
}
// The block's Xb (digits.h): its exact int32 sum of X (|sum X| < 2^28) rounded once, times u.
DG_AI float block_xb(const BlockDigits& dg) {
  return static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(dg.x[0], dg.x[1]))) * dg.u;
}

// The byte order (digit_byte_column) within each 16 columns.
alignas(64) constexpr int32_t kByteOrder[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};
alignas(64) constexpr int32_t kColumnOrder[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// Rows [row0, row0 + rows) of x (rows <= 16) as one AMX group's blocks (DigitRows: groups): the 4
// digit tiles, then the rows' Xb, round(sum X) u from the exact int32 sum (|sum X| < 2^28), +0 for
// 0 (Q4_0 / Q4_1 / Q4_K; Q8_0, whose m is 0: 0), NaN for a block that gives NaN.
void build_group(const float* x, int64_t ldx, int rows, int64_t b0, int64_t b1, uint8_t* out, int64_t stride,
                 bool bytes) {
  const __m512i hi6 = _mm512_set1_epi32(~63), lo6 = _mm512_set1_epi32(63), low12 = _mm512_set1_epi32(4095);
  for (int64_t b = b0; b < b1; ++b) {
    uint8_t* g = out + (b - b0) * stride;
    alignas(64) float xb[16] = {};
    for (int r = 0; r < rows; ++r) {
      BlockDigits dg;
      if (!block_digits(x + r * ldx + 32 * b, bytes ? kColumnOrder : kPairOrder, &dg)) {
        xb[r] = __builtin_nanf("");
        for (int s = 0; s < 4; ++s) _mm512_store_si512(g + 1024 * s + 64 * r, _mm512_setzero_si512());
        continue;
      }
      if (!bytes) xb[r] = block_xb(dg);
      const __m512 ua = _mm512_set1_ps(dg.u * 4096.0f), ub = _mm512_set1_ps(dg.u);
      const __m512i xa[2] = {_mm512_srai_epi32(dg.x[0], 12), _mm512_srai_epi32(dg.x[1], 12)};
      const __m512i xl[2] = {_mm512_and_si512(dg.x[0], low12), _mm512_and_si512(dg.x[1], low12)};
      const __m512i digit[4][2] = {{_mm512_and_si512(xa[0], hi6), _mm512_and_si512(xa[1], hi6)},
                                   {_mm512_and_si512(xa[0], lo6), _mm512_and_si512(xa[1], lo6)},
                                   {_mm512_and_si512(xl[0], hi6), _mm512_and_si512(xl[1], hi6)},
                                   {_mm512_and_si512(xl[0], lo6), _mm512_and_si512(xl[1], lo6)}};
      for (int s = 0; s < 4; ++s) {
        const __m512 scale = s < 2 ? ua : ub;
        const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(digit[s][0]), scale);
        const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(digit[s][1]), scale);
        _mm512_store_si512(g + 1024 * s + 64 * r, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
      }
    }
    _mm512_store_ps(reinterpret_cast<float*>(g + kDigitGroupXb), _mm512_load_ps(xb));
  }
}

}  // namespace

bool amx_ready() {
  static const bool ready = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), bf16 = d & (1u << 22), vnni = c & (1u << 11);
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    const bool avx512_bf16 = a & (1u << 5);
    if (!tile || !bf16 || !vnni || !avx512_bf16) return false;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0x60000u) != 0x60000u) return false;  // XTILECFG, XTILEDATA enabled by the OS
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

void build_digit_blocks(const float* x, int64_t ldx, int64_t amx_end, int64_t b0, int64_t b1, QType t, uint8_t* out) {
  const int64_t groups = (amx_end + 15) / 16;
  for (int64_t g = 0; g < groups; ++g)
    build_group(x + 16 * g * ldx, ldx, static_cast<int>(amx_end - 16 * g < 16 ? amx_end - 16 * g : 16), b0, b1,
                out + g * kDigitGroupBlockBytes, groups * kDigitGroupBlockBytes, t == QType::Q8_0);
}

void prepare_digits_avx512(const float* x, int64_t m, int64_t ldx, int64_t cols, QType t, uint8_t* out,
                           int64_t row_begin) {
  const int64_t nb = cols / 32;
  const __m512i byte = _mm512_set1_epi32(255);
  const int32_t* order = t == QType::Q8_0 ? kColumnOrder : kByteOrder;
  for (int64_t i = row_begin; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* rec = out + ((i - row_begin) * nb + b) * kDigitRowBytes;
      BlockDigits dg;
      float u = __builtin_nanf(""), xs = __builtin_nanf("");  // (a block that gives NaN: both)
      int32_t sum2 = 0;
      if (block_digits(x + i * ldx + 32 * b, order, &dg)) {
        __m512i d2[2];
        for (int h = 0; h < 2; ++h) {
          d2[h] = _mm512_srai_epi32(dg.x[h], 16);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(rec + digit_rec::kD2 + 16 * h), _mm512_cvtepi32_epi8(d2[h]));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(rec + digit_rec::kD1 + 16 * h),
                           _mm512_cvtepi32_epi8(_mm512_and_si512(_mm512_srli_epi32(dg.x[h], 8), byte)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(rec + digit_rec::kD0 + 16 * h),
                           _mm512_cvtepi32_epi8(_mm512_and_si512(dg.x[h], byte)));
        }
        u = dg.u;
        xs = block_xb(dg);
        sum2 = _mm512_reduce_add_epi32(_mm512_add_epi32(d2[0], d2[1]));
      } else {
        _mm512_storeu_si512(rec + digit_rec::kD2, _mm512_setzero_si512());  // (D2 and D1)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(rec + digit_rec::kD0), _mm256_setzero_si256());
      }
      __builtin_memcpy(rec + digit_rec::kU, &u, 4);
      __builtin_memcpy(rec + digit_rec::kXb, &xs, 4);
      __builtin_memcpy(rec + digit_rec::kSumD2, &sum2, 4);
    }
  }
}

void digits_gemm_avx512(const DigitJob& job) {
  if (job.type == QType::Q4_1) run_digits<QType::Q4_1>(job);
  else if (job.type == QType::Q4_0) run_digits<QType::Q4_0>(job);
  else if (job.type == QType::Q4_K) run_digits<QType::Q4_K>(job);
  else if (job.type == QType::Q8_0) run_digits<QType::Q8_0>(job);
}

}  // namespace backfill
