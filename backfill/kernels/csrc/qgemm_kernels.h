// The packed GEMM kernels, written once over 16-lane vector primitives and compiled by each ISA
// unit (qgemm_avx512.cpp: VF = one zmm; qgemm_avx2.cpp: VF = two ymm), which defines before
// including this file:
//   VF (16 floats), VI (16 int32): vf_zero, vf_set1, vf_load, vf_store, vf_load_n, vf_store_n,
//   vf_bcast, vf_fma (a * b + c, one rounding), vf_mul, vf_add, vf_load_f16 (16 halves),
//   vi_load_u8 / vi_load_s8 (16 bytes widened), vi_load_u32 (16 uint32), vi_and, vi_and_bcast
//   (a & the uint32 at m, every lane), vi_srl<s>, vi_to_f, vi_as_f (the bits as they are),
//   vf_nib_lo (float(v & 15)),
//   vf_block_tree (the sum of the 16 lanes in block_sum's order, packed.h),
//   pack_x16 (x's 16 rows column by column, scaled as pack_x scales them, as many columns as it
//   does: see pack_x; pack_x8.h does up to 8 rows);
//   and the blocking constants: kFusedMaxM, fused_nt(mr), kFusedGroupMR, fused_groups_max_m(type), kVfRegs, kPanelNT, kPanelMaxMR,
//   kPanelMaxMRF (the block types' panels), kPanelKc; kNibbleWordTiles (0: none) and
//   nibble_word_fma4 (one row of a nibble type, that many tiles a call: qgemm_avx2.cpp).
// Everything here has internal linkage: each ISA unit gets its own copy (see isa.h).
//
// Numbers (the invariant every path keeps, see TileJob): lanes run across 16 output rows. For
// F32 / F16, y[i, n] is one FMA chain over k = 0 .. K-1 in order on the reference's weights. For
// the block types, the chain runs over blocks: each block's codes times x in a chain of their
// own (S; the scaled-code types' products scaled, see code_x_scale), folded in as y = fma(S, d, y),
// y = fma(X, m, y) with the block's scale and offset, d and m computed as dequantize_row_ref
// computes them ("exact product, one rounding": the fp16 scale times a small integer fits
// fp32's 24 bits). Blocking (how many rows / tiles per kernel call, panels or registers,
// threads) never changes a chain.
#pragma once

#define BF_AI inline __attribute__((always_inline))
#define BF_UNROLL _Pragma("GCC unroll 16")

namespace backfill {
namespace {

// ---------------------------------------------------------------------------------------------
// Weight producers, one per type. F16: for_each<NT>(tiles, k0, kn, fn) calls fn(k, w) for k = k0,
// k0 + 1, .., k0 + kn - 1 in order, w[t] the 16 weights (fp32) of tiles[t] at column k. The
// block types: for_each_code (below).

// kXScale: x[k]'s scale against column k's code, by k % 8 (packed.h: code_x_scale,
// subnormal_x_scale), or null (x as it is).
struct DqF32 {
  static constexpr bool kIsPanel = true;  // a tile is already a [K][16] fp32 panel: nothing to do
  static constexpr bool kFactored = false, kHasMin = false;
  static constexpr const float* kXScale = nullptr;
  static constexpr int64_t kQB = 0;
};

struct DqF16 {
  static constexpr bool kIsPanel = false, kFactored = false, kHasMin = false;
  static constexpr const float* kXScale = nullptr;
  static constexpr int64_t kQB = 0;
  template <int NT, class Fn>
  BF_AI static void for_each(const uint8_t* const* tiles, int64_t k0, int64_t kn, Fn&& fn) {
    for (int64_t k = k0; k < k0 + kn; ++k) {
      VF w[NT];
      BF_UNROLL for (int t = 0; t < NT; ++t) w[t] = vf_load_f16(tiles[t] + 32 * k);
      fn(k, w);
    }
  }
};

// The block types' codes, factored (see TileJob): for_each_code<NT>(tiles, k0, kn, code, fold)
// calls code(k, q) for k = k0 .. k0 + kn - 1 in order, q[t] the integer codes (as fp32, exact)
// of tiles[t] at column k, and after each block's last column fold(b, d, m): block b (columns
// kQB b ..), d[t] / m[t] its per-row scale and offset (m: kHasMin only), w = fma(q, d, m).
// k0 and kn are multiples of 32.

// Nibble c's mask in a nibble word's uint32 (packed.h), read as a broadcast from memory: held in
// registers they left too few for a 16-row block's accumulators (the allocator copied them round
// every column: 16-32 rows ~3% slower).
alignas(64) constexpr uint32_t kNibbleMask[8] = {0xFu, 0xF0u, 0xF00u, 0xF000u, 0xF0000u, 0xF00000u, 0xF000000u, 0xF0000000u};

// The subnormal form (packed.h) of one nibble word's 8 columns, no conversions: word(t) = tile
// t's word (held in a register, or loaded again per column: nibble_codes_from_memory).
template <int NT, class Word, class Code>
BF_AI void nibble_columns_subnormal(Word&& word, int64_t k, Code&& code) {
  VF q[NT];
#pragma GCC unroll 6
  for (int c = 0; c < 6; ++c) {
    BF_UNROLL for (int t = 0; t < NT; ++t) q[t] = vi_as_f(vi_and_bcast(word(t), kNibbleMask + c));
    code(k + c, q);
  }
  BF_UNROLL for (int t = 0; t < NT; ++t) q[t] = vi_as_f(vi_and_bcast(vi_srl<4>(word(t)), kNibbleMask + 5));
  code(k + 6, q);
  BF_UNROLL for (int t = 0; t < NT; ++t) q[t] = vi_as_f(vi_srl<28>(word(t)));
  code(k + 7, q);
}

// Column 8w + c of NT tiles' nibble words v (packed.h): its codes as fp32, q for c = 0 (vf_nib_lo)
// and c = 7 (shifted down), else q 2^4c, nibble c taken out in place by one and (x is scaled by
// 2^-4c against it: code_x_scale). kSub: the subnormal form.
template <int NT, bool kSub, class Code>
BF_AI void nibble_columns(const VI* v, int64_t k, Code&& code) {
  if constexpr (kSub) {
    nibble_columns_subnormal<NT>([&](int t) __attribute__((always_inline)) { return v[t]; }, k, code);
    return;
  }
  VF q[NT];
  BF_UNROLL for (int t = 0; t < NT; ++t) q[t] = vf_nib_lo(v[t]);
  code(k, q);
#pragma GCC unroll 6
  for (int c = 1; c < 7; ++c) {
    BF_UNROLL for (int t = 0; t < NT; ++t) q[t] = vi_to_f(vi_and_bcast(v[t], kNibbleMask + c));
    code(k + c, q);
  }
  BF_UNROLL for (int t = 0; t < NT; ++t) q[t] = vi_to_f(vi_srl<28>(v[t]));
  code(k + 7, q);
}

// 32 columns k0 .. k0 + 31 of 4-bit codes, 4 nibble words per tile: one plain load per 8 columns,
// then two operations per column, where bytes widened (a cross-lane shuffle) and split into two
// nibbles took four per two columns and the shuffle. Q4_1 [3072, 576] on one core of a Zen 4
// EPYC from cache: 16% faster at 1 row, 11% at 2, 7% at 4, 4% at 8, the same from 16 (AVX2: 3-4%
// at 1-8 rows); the batch-1 step ~5-10%.
// The subnormal form with each column's words read again by its AND (from L1) instead of held
// in registers, where the ISA asks for it (kSubCodesFromMemory: AVX2, 16 registers) and a call
// takes several tiles (one or two rows). On a Zen 4 forced to AVX2 ([3072, 768], 1 thread, from
// cache): 1 row 86 -> 76 us (Q4_1) and 92 -> 85 (Q4_K), 2 rows 119 -> 121 and 146 -> 127; a
// Q4_1 GEMV from memory at 2 threads 34.9 -> 40.2 GB/s; but 6-64 rows (one tile a call) 5-10%
// slower, so they keep the registers (as AVX-512's 32 do at every row count: its words re-read
// took a one-row GEMV from cache from 26.4 to 23.4 GB/s). The empty asm keeps the compiler from
// loading a word once for its 8 columns.
template <int NT, class Code>
BF_AI void nibble_codes_from_memory(const uint8_t* const* qs, int64_t k0, Code&& code) {
  const uint8_t* p[NT];
  BF_UNROLL for (int t = 0; t < NT; ++t) p[t] = qs[t];
  for (int w = 0; w < 4; ++w) {
    const auto word = [&](int t) __attribute__((always_inline)) {
      asm("" : "+r"(p[t]));
      return vi_load_u32(p[t] + 64 * w);
    };
    nibble_columns_subnormal<NT>(word, k0 + 8 * w, code);
  }
}

// A code callback that also takes (NibbleWords{}, k, qs, w) runs word w of NT tiles (columns
// k .. k + 7, the subnormal form) in one call: the ISA unit's nibble_word_fma4 (fused_block).
struct NibbleWords {};

template <int NT, bool kSub, class Code>
BF_AI void nibble_codes(const uint8_t* const* qs, int64_t k0, Code&& code) {
  if constexpr (kSub && requires { code(NibbleWords{}, k0, qs, 0); }) {
    BF_UNROLL for (int w = 0; w < 4; ++w) code(NibbleWords{}, k0 + 8 * w, qs, w);
    return;
  }
  if constexpr (kSub && kSubCodesFromMemory && NT >= 2) {
    nibble_codes_from_memory<NT>(qs, k0, code);
    return;
  }
  for (int w = 0; w < 4; ++w) {
    VI v[NT];
    BF_UNROLL for (int t = 0; t < NT; ++t) v[t] = vi_load_u32(qs[t] + 64 * w);
    nibble_columns<NT, kSub>(v, k0 + 8 * w, code);
  }
}

// The nibble types' x scales and d, nibble or subnormal form (packed.h).
template <bool kSub>
constexpr const float* nibble_x_scales() { return kSub ? kSubnormalXScale : kNibbleXScale; }
template <bool kSub>
BF_AI VF subnormal_d(VF d) { return kSub ? vf_mul(d, vf_set1(kSubnormalDScale)) : d; }

// f(t) read as a[t] (a fold's d and m: see DqQ4).
template <class F>
struct Indexed {
  const F& f;
  BF_AI VF operator[](int t) const { return f(t); }
};

// Q4_0 (w = (q - 8) d: m = -8 d) and Q4_1 (w = q d + m): one tile block per 32 columns.
template <bool kMin, bool kSub>
struct DqQ4 {
  static constexpr bool kIsPanel = false, kFactored = true, kHasMin = true;
  static constexpr bool kSubnormalNibbles = kSub;  // (fused_nt_of)
  static constexpr const float* kXScale = nibble_x_scales<kSub>();
  static constexpr int64_t kQB = QK;
  static constexpr int64_t kBlockBytes = kMin ? 320 : 288;
  static constexpr int64_t kChunkBytes = kBlockBytes;  // (a tile's bytes per 32 columns: chunk_lines)
  static constexpr int64_t kQs = kMin ? tile_off::kQ4_1Qs : tile_off::kQ4_0Qs;
  template <int NT, class Code, class Fold>
  BF_AI static void for_each_code(const uint8_t* const* tiles, int64_t k0, int64_t kn, Code&& code, Fold&& fold) {
    for (int64_t b = k0 / QK; b < (k0 + kn) / QK; ++b) {
      const uint8_t* qs[NT];
      BF_UNROLL for (int t = 0; t < NT; ++t) qs[t] = tiles[t] + b * kBlockBytes + kQs;
      nibble_codes<NT, kSub>(qs, b * QK, code);
      const auto d = [&](int t) __attribute__((always_inline)) {
        return subnormal_d<kSub>(vf_load_f16(tiles[t] + b * kBlockBytes));
      };
      const auto m = [&](int t) __attribute__((always_inline)) {
        const uint8_t* blk = tiles[t] + b * kBlockBytes;
        return kMin ? vf_load_f16(blk + tile_off::kQ4_1M) : vf_mul(vf_load_f16(blk), vf_set1(-8.0f));
      };
      if constexpr (kVfRegs < 16 && NT >= 4) {
        // (16 ymm: read where the fold takes them, tile by tile; all at once they outnumbered
        // the registers beside 4 tiles' sums and spilled: a one-row GEMV ~4% slower)
        fold(b, Indexed<decltype(d)>{d}, Indexed<decltype(m)>{m});
      } else {  // (32 zmm, or fewer tiles: all first, ahead of their use; AVX-512 ~5% faster)
        VF dv[NT], mv[NT];
        BF_UNROLL for (int t = 0; t < NT; ++t) {
          dv[t] = d(t);
          mv[t] = m(t);
        }
        fold(b, dv, mv);
      }
    }
  }
};

// Byte words (packed.h): column 4w + c of NT tiles' words v as fp32, u 2^8c for c = 0 .. 2 taken
// out in place by one and, u for c = 3 (shifted down); kSub: the subnormal form (u 2^(8c - 149),
// no conversion).
alignas(64) constexpr uint32_t kByteMask[3] = {0xFFu, 0xFF00u, 0xFF0000u};
template <int NT, bool kSub, class Code>
BF_AI void byte_columns(const VI* v, int64_t k, Code&& code) {
  VF q[NT];
  BF_UNROLL for (int c = 0; c < 3; ++c) {
    BF_UNROLL for (int t = 0; t < NT; ++t) {
      const VI u = vi_and_bcast(v[t], kByteMask + c);
      q[t] = kSub ? vi_as_f(u) : vi_to_f(u);
    }
    code(k + c, q);
  }
  BF_UNROLL for (int t = 0; t < NT; ++t) q[t] = kSub ? vi_as_f(vi_srl<24>(v[t])) : vi_to_f(vi_srl<24>(v[t]));
  code(k + 3, q);
}

// Q8_0: w = u d + m, u = q + 128 (the byte words' codes), m = -128 d.
template <bool kSub>
struct DqQ8_0 {
  static constexpr bool kIsPanel = false, kFactored = true, kHasMin = true;
  static constexpr const float* kXScale = kSub ? kSubnormalXScaleQ8_0 : kByteXScale;
  static constexpr int64_t kQB = QK;
  static constexpr int64_t kChunkBytes = kTileRows * 34;  // (chunk_lines)
  template <int NT, class Code, class Fold>
  BF_AI static void for_each_code(const uint8_t* const* tiles, int64_t k0, int64_t kn, Code&& code, Fold&& fold) {
    for (int64_t b = k0 / QK; b < (k0 + kn) / QK; ++b) {
      for (int w = 0; w < QK / 4; ++w) {
        VI v[NT];
        BF_UNROLL for (int t = 0; t < NT; ++t) v[t] = vi_load_u32(tiles[t] + b * 544 + tile_off::kQ8_0Qs + 64 * w);
        byte_columns<NT, kSub>(v, b * QK + 4 * w, code);
      }
      VF d[NT], m[NT];
      BF_UNROLL for (int t = 0; t < NT; ++t) {
        d[t] = vf_load_f16(tiles[t] + b * 544);
        m[t] = vf_mul(d[t], vf_set1(-static_cast<float>(kByteCodeOffset)));
        d[t] = subnormal_d<kSub>(d[t]);
      }
      fold(b, d, m);
    }
  }
};

// Q4_K: per 32-column sub-block j, d_j = d sc_j and m_j = -(dmin mn_j) (w = d_j q + m_j), the
// 6-bit sc_j / mn_j as ggml's get_scale_min_k4 takes them out of its 12 scale bytes (done at load: packed.h).
template <bool kSub>
struct DqQ4_K {
  static constexpr bool kIsPanel = false, kFactored = true, kHasMin = true;
  static constexpr bool kSubnormalNibbles = kSub;  // (fused_nt_of)
  static constexpr const float* kXScale = nibble_x_scales<kSub>();
  static constexpr int64_t kQB = 32;
  static constexpr int64_t kChunkBytes = kQ4_KTileBlockBytes / 8;  // (chunk_lines)
  template <int NT, class Code, class Fold>
  BF_AI static void for_each_code(const uint8_t* const* tiles, int64_t k0, int64_t kn, Code&& code, Fold&& fold) {
    for (int64_t s = k0 / 32; s < (k0 + kn) / 32; ++s) {
      const int64_t b = s / 8;
      const int j = static_cast<int>(s % 8);
      const uint8_t* qs[NT];
      BF_UNROLL for (int t = 0; t < NT; ++t) qs[t] = tiles[t] + b * kQ4_KTileBlockBytes + tile_off::kQ4_KQs + 4 * 64 * j;
      nibble_codes<NT, kSub>(qs, s * 32, code);
      VF d1[NT], m1[NT];
      BF_UNROLL for (int t = 0; t < NT; ++t) {
        scales(tiles[t] + b * kQ4_KTileBlockBytes, j, &d1[t], &m1[t]);
        d1[t] = subnormal_d<kSub>(d1[t]);
      }
      fold(s, d1, m1);
    }
  }
  // Sub-block j's d_j and m_j of the 16 rows of the tile block at blk (its scales unpacked:
  // packed.h).
  BF_AI static void scales(const uint8_t* blk, int j, VF* d, VF* m) {
    const uint8_t* sc = blk + tile_off::kQ4_KScales;  // [16][16] bytes: sc_0..7, m_0..7
    const VI scj = vi_load_u8(sc + 16 * j), mj = vi_load_u8(sc + 16 * (8 + j));
    *d = vf_mul(vf_load_f16(blk), vi_to_f(scj));
    *m = vf_mul(vf_load_f16(blk + tile_off::kQ4_KDmin), vf_mul(vi_to_f(mj), vf_set1(-1.0f)));
  }
};

// Column 8p + c of NT tiles' six-bit word pairs (a, b: packed.h), as nibble_columns reads a nibble
// word: q 2^4c for c < 7, taken out in place by one and (masks from memory, as kNibbleMask), q
// for c = 7 (shifted down).
alignas(64) constexpr uint32_t kSixBitMask[7] = {
    0x3Fu << six_bit_shift(0), 0x3Fu << six_bit_shift(1), 0x3Fu << six_bit_shift(2), 0x3Fu << six_bit_shift(3),
    0x3Fu << six_bit_shift(4), 0x3Fu << six_bit_shift(5), 0x3Fu << six_bit_shift(6)};
static_assert(six_bit_shift(7) + 6 == 32, "column 7's field is the word's top: one shift takes it out");
// The subnormal form (packed.h) of one six-bit word pair's 8 columns: columns 0 .. 4 by one and,
// 5 and 6 shifted to bits 16 .. 21 and anded, 7 shifted down; read as they are. word(t, w) = tile
// t's word A (w = 0) or B (1), held in a register or loaded again (six_bit_columns_from_memory).
template <int NT, class Word, class Code>
BF_AI void six_bit_columns_subnormal(Word&& word, int64_t k, Code&& code) {
  VF q[NT];
#pragma GCC unroll 5
  for (int c = 0; c < 5; ++c) {
    BF_UNROLL for (int t = 0; t < NT; ++t) q[t] = vi_as_f(vi_and_bcast(word(t, six_bit_word(c)), kSixBitMask + c));
    code(k + c, q);
  }
  BF_UNROLL for (int t = 0; t < NT; ++t) q[t] = vi_as_f(vi_and_bcast(vi_srl<4>(word(t, 1)), kSixBitMask + 4));
  code(k + 5, q);
  BF_UNROLL for (int t = 0; t < NT; ++t) q[t] = vi_as_f(vi_and_bcast(vi_srl<8>(word(t, 0)), kSixBitMask + 4));
  code(k + 6, q);
  BF_UNROLL for (int t = 0; t < NT; ++t) q[t] = vi_as_f(vi_srl<six_bit_shift(7)>(word(t, 1)));
  code(k + 7, q);
}

// kSub: the subnormal form.
template <int NT, bool kSub, class Code>
BF_AI void six_bit_columns(const VI* a, const VI* b, int64_t k, Code&& code) {
  if constexpr (kSub) {
    six_bit_columns_subnormal<NT>([&](int t, int w) __attribute__((always_inline)) { return w == 0 ? a[t] : b[t]; },
                                  k, code);
    return;
  }
  VF q[NT];
#pragma GCC unroll 7
  for (int c = 0; c < 7; ++c) {
    BF_UNROLL for (int t = 0; t < NT; ++t) {
      q[t] = vi_to_f(vi_and_bcast(six_bit_word(c) == 0 ? a[t] : b[t], kSixBitMask + c));
    }
    code(k + c, q);
  }
  BF_UNROLL for (int t = 0; t < NT; ++t) q[t] = vi_to_f(vi_srl<six_bit_shift(7)>(b[t]));
  code(k + 7, q);
}

// six_bit_columns' subnormal form with each column's word read again from memory (L1) by its
// AND, as nibble_codes_from_memory: pair[t] = tile t's word pair (word A, then B 64 bytes on).
template <int NT, class Code>
BF_AI void six_bit_columns_from_memory(const uint8_t* const* pair, int64_t k, Code&& code) {
  const uint8_t* p[NT];
  BF_UNROLL for (int t = 0; t < NT; ++t) p[t] = pair[t];
  const auto word = [&](int t, int w) __attribute__((always_inline)) {
    asm("" : "+r"(p[t]));
    return vi_load_u32(p[t] + 64 * w);
  };
  six_bit_columns_subnormal<NT>(word, k, code);
}

// Q6_K: per 16-column sub-block, d_s = d sc and m_s = -32 d_s (w = d_s (q - 32)), q the 6-bit
// codes of the six-bit words: two plain loads per 8 columns, then two operations a column (the
// subnormal form: 11 per 8 columns), where the file's split codes (a low nibble and two high
// bits, bytes widened) took 5-6.
template <bool kSub>
struct DqQ6_K {
  static constexpr bool kIsPanel = false, kFactored = true, kHasMin = true;
  static constexpr const float* kXScale = kSub ? kSubnormalXScaleQ6_K : kNibbleXScale;
  static constexpr int64_t kQB = 16;
  static constexpr int64_t kChunkBytes = kQ6_KTileBlockBytes / 8;  // (chunk_lines)
  template <int NT, class Code, class Fold>
  BF_AI static void for_each_code(const uint8_t* const* tiles, int64_t k0, int64_t kn, Code&& code, Fold&& fold) {
    for (int64_t s = k0 / 16; s < (k0 + kn) / 16; ++s) {
      const int64_t b = s / 16;
      const int j = static_cast<int>(s % 16);  // scale index; columns 16 j .. 16 j + 15: pairs 2 j, 2 j + 1
      for (int h = 0; h < 2; ++h) {
        const uint8_t* pairs[NT];
        BF_UNROLL for (int t = 0; t < NT; ++t) {
          pairs[t] = tiles[t] + b * kQ6_KTileBlockBytes + tile_off::kQ6_KQs + 128 * (2 * j + h);
        }
        if constexpr (kSub && kSubCodesFromMemory && NT >= 2) {
          six_bit_columns_from_memory<NT>(pairs, s * 16 + 8 * h, code);
          continue;
        }
        VI wa[NT], wb[NT];
        BF_UNROLL for (int t = 0; t < NT; ++t) {
          wa[t] = vi_load_u32(pairs[t]);
          wb[t] = vi_load_u32(pairs[t] + 64);
        }
        six_bit_columns<NT, kSub>(wa, wb, s * 16 + 8 * h, code);
      }
      VF ds[NT], nds[NT];
      BF_UNROLL for (int t = 0; t < NT; ++t) {
        const uint8_t* blk = tiles[t] + b * kQ6_KTileBlockBytes;
        ds[t] = vf_mul(vf_load_f16(blk), vi_to_f(vi_load_s8(blk + tile_off::kQ6_KScales + 16 * j)));
        nds[t] = vf_mul(ds[t], vf_set1(-32.0f));
        ds[t] = subnormal_d<kSub>(ds[t]);
      }
      fold(s, ds, nds);
    }
  }
};

// X[b] of one row: the sum of x[qb b .. qb b + qb - 1] in block_sum's order (packed.h: the
// definition, which the scalar kernels call), out[b * stride] for b < cols / qb.
BF_AI void block_sums(const float* x, int64_t cols, int64_t qb, float* out, int64_t stride) {
  for (int64_t b = 0; b < cols / qb; ++b, out += stride) {
    const float* xb = x + b * qb;
    *out = vf_block_tree(qb == 32 ? vf_add(vf_load(xb), vf_load(xb + 16)) : vf_load(xb));
  }
}

// ---------------------------------------------------------------------------------------------
// Epilogue: y[row0 + i, 16 (tile0 + t) ..] = acc (+ bias) (+ y if accumulate), the last tile cut
// at N.

// (Job: a TileJob or a PreparedJob, packed.h: the fields read here are the same.)
template <int MR, int NT, class Job>
BF_AI void store_acc(const VF (&acc)[MR][NT], const Job& job, int64_t row0, int64_t tile0) {
  // the job's fields in locals: stores through y may alias job as far as the compiler knows,
  // which would reload (and re-test) them row by row
  const float* const bias_p = job.bias;
  float* const y = job.y;
  const int64_t ldy = job.ldy, rows = job.rows;
  const bool accumulate = job.accumulate;
  BF_UNROLL for (int t = 0; t < NT; ++t) {
    const int64_t n0 = (tile0 + t) * kTileRows;
    const int64_t cnt = rows - n0 < kTileRows ? rows - n0 : kTileRows;
    if (cnt <= 0) continue;
    const int c = static_cast<int>(cnt);
    VF bias = vf_zero();
    if (bias_p != nullptr) bias = c == kTileRows ? vf_load(bias_p + n0) : vf_load_n(bias_p + n0, c);
    float* yp = y + row0 * ldy + n0;
    BF_UNROLL for (int i = 0; i < MR; ++i, yp += ldy) {
      VF v = acc[i][t];
      if (bias_p != nullptr) v = vf_add(v, bias);
      if (c == kTileRows) {
        if (accumulate) v = vf_add(vf_load(yp), v);
        vf_store(yp, v);
      } else {
        if (accumulate) v = vf_add(vf_load_n(yp, c), v);
        vf_store_n(yp, v, c);
      }
    }
  }
}

// Rows [row0, row0 + mr) of x packed column by column, out [K][mr]: the kernels' broadcasts then
// walk one pointer (the row pointers would not fit the general registers beside the rest).
// 16 rows: the ISA unit's pack_x16 first, up to 8 pack_x8 (register transposes), the columns
// they left here. The scaled-code types' columns scaled against their codes (Dq::kXScale),
// every path by the same products.
// One row: x times its scales 16 columns at a time (pack_x8's transposes of one row: ~2% of a
// batch-1 step).
template <class Dq>
BF_AI int64_t pack_x1(const float* x, int64_t cols, float* out) {
  constexpr const float* kScale = Dq::kXScale;
  float pattern[16];
  for (int i = 0; i < 16; ++i) pattern[i] = kScale != nullptr ? kScale[i % 8] : 1.0f;
  const VF scale = vf_load(pattern);
  int64_t k = 0;
  for (; k + 16 <= cols; k += 16) vf_store(out + k, kScale != nullptr ? vf_mul(vf_load(x + k), scale) : vf_load(x + k));
  return k;
}

template <class Dq>
inline void pack_x(const TileJob& job, int64_t row0, int mr, float* out) {
  const float* x = job.x + row0 * job.ldx;
  constexpr const float* kScale = Dq::kXScale;
  const int64_t k0 = mr == 1    ? pack_x1<Dq>(x, job.cols, out)
                     : mr == 16 ? pack_x16(x, job.ldx, job.cols, out, kScale)
                                : pack_x8(x, job.ldx, job.cols, mr, out, kScale);
  for (int64_t k = k0; k < job.cols; ++k) {
    const float s = kScale != nullptr ? kScale[k % 8] : 1.0f;
    for (int i = 0; i < mr; ++i) {
      const float v = x[i * job.ldx + k];
      out[k * mr + i] = s != 1.0f ? v * s : v;
    }
  }
}

// Size of block b when `rows` are cut into num_blocks blocks differing by at most one row.
inline int block_rows(int64_t rows, int64_t num_blocks, int64_t b) {
  return static_cast<int>(rows / num_blocks + (b < rows % num_blocks ? 1 : 0));
}

// ---------------------------------------------------------------------------------------------
// Fused kernel (few rows): decode NT tiles straight into registers (F16: weights; the block types:
// codes, each block's sums folded with its scale and offset) and FMA them into MR x NT
// accumulators; the weights are read once per call, from memory. NT tiles give NT x MR
// independent chains, enough to hide the FMA latency at MR = 1. At one row, the factored form
// takes one FMA per weight where dequantizing took two: the step's GEMMs on one core of a Zen 5
// EPYC, from memory, 2.21-2.31 ms against 2.60-2.76 (AVX-512), 4.25-4.30 against 5.06-5.13
// (AVX2).

// The job's side prefetch (TileJob::side), spread evenly over the job's FMA blocks (the panel
// kernel: one every few columns of each block, issued in bursts they would wait for miss
// buffers and stall the FMAs; the fused kernel: a few lines per 32-column chunk).
struct SideCursor {
  const SidePrefetch* side = nullptr;
  int64_t per_block = 0;  // lines per FMA block
  int64_t left = 0;       // lines still to prefetch
  const char* p = nullptr;
  int64_t span = 0, span_left = 0;

  // Lines [begin, end) of s over `blocks` blocks; nothing to prefetch (no s, no lines, no
  // blocks) leaves the cursor empty.
  void start(const SidePrefetch* s, int64_t begin, int64_t end, int64_t blocks) {
    if (s == nullptr || end <= begin || blocks <= 0) return;
    side = s;
    left = end - begin;
    per_block = (left + blocks - 1) / blocks;
    span = begin / s->span_lines;
    span_left = s->span_lines - begin % s->span_lines;
    p = s->spans[span] + 64 * (begin % s->span_lines);
  }
  // Lines for the next block.
  BF_AI int64_t quota() const { return per_block < left ? per_block : left; }
  // (the cursor in locals: in a loop of its own the members were stored back every line)
  BF_AI void burst() {
    int64_t n = quota();
    if (n <= 0) return;
    left -= n;
    const char* q = p;
    int64_t lines = span_left, at = span;
    while (n > 0) {
      const int64_t run = n < lines ? n : lines;
      for (int64_t i = 0; i < run; ++i) __builtin_prefetch(q + 64 * i, 0, 3);
      n -= run;
      lines -= run;
      q += 64 * run;
      if (lines == 0 && (n > 0 || left > 0)) {
        q = side->spans[++at];
        lines = side->span_lines;
      }
    }
    p = q;
    span_left = lines;
    span = at;
  }
  BF_AI void next_line() {
    if (left <= 0) return;
    __builtin_prefetch(p, 0, 3);
    --left;
    if (--span_left == 0 && left > 0) {
      p = side->spans[++span];
      span_left = side->span_lines;
    } else {
      p += 64;
    }
  }
};

// The fused kernel's software prefetch, in 32-column chunks ahead of the one being computed. Its
// NT weight streams are short (a tile is 5-15 KB at these models' widths) and restart at every
// group, too short for the hardware prefetcher to reach full bandwidth: without it a batch-1
// step read its Q4_1 weights at ~17 GB/s on a Zen 5 EPYC whose cores read 40 GB/s (2 threads;
// 6 chunks: 1.7x faster at M = 1, 1.6x at M = 4-8; 2x on its AVX2 path; 2-16 chunks all within
// the noise of 6, 2 clearly slower). Into L2 (prefetcht1), not L1: the lines a core has asked
// DRAM for are few in L1's miss buffers, more in L2's, and the L1 then fills from L2 on its
// own. On a Zen 4 EPYC the batch-1 step's linears from memory took 3.6-3.9 ms against 4.7-5.9
// into L1 (the whole step 4.2-4.6 against 5.8-6.0 ms); batches 8 and 32 the same.
constexpr int64_t kFusedPrefetchChunks = 6;

// Prefetch chunk c of the group of NT tiles at tile0, where a chunk c >= nc runs on into the
// next group (the job's tiles are one contiguous range: the next group's streams start where
// this group's end). cb = a tile's bytes per 32-column chunk, tile bytes / nc (for the k-quants,
// whose blocks span 256 columns, a proportional share of the block). Into L2: at 6 tiles x 6
// chunks it is ~12 KB ahead for Q4_1, ~20 KB for Q8_0.
// kLines: cb's lines, ceil(cb / 64), where the caller's type fixes cb (the prefetches then
// unrolled: the loop's own instructions had cost a one-row Q4_1 GEMV on AVX2 ~3%), else 0.
// (Job: a TileJob or a PreparedJob, packed.h.)
template <int NT, int64_t kLines = 0, class Job>
BF_AI void prefetch_chunk(const Job& job, int64_t tile0, int64_t c, int64_t nc, int64_t tb, int64_t cb) {
  while (c >= nc) {
    c -= nc;
    tile0 += NT;
  }
  const uint8_t* p = job.w + tile0 * tb + c * cb;
  BF_UNROLL for (int t = 0; t < NT; ++t, p += tb) {
    if (tile0 + t >= job.tile_end) break;
    if constexpr (kLines > 0) {
      BF_UNROLL for (int64_t l = 0; l < kLines; ++l) __builtin_prefetch(p + 64 * l, 0, 2);  // prefetcht1
    } else {
      for (int64_t off = 0; off < cb; off += 64) __builtin_prefetch(p + off, 0, 2);
    }
  }
}

// A tile's lines per 32-column chunk (prefetch_chunk's kLines) for the types whose Dq says its
// bytes per 32 columns (kChunkBytes), else 0.
template <class Dq>
constexpr int64_t chunk_lines() {
  if constexpr (requires { Dq::kChunkBytes; }) return (Dq::kChunkBytes + 63) / 64;
  return 0;
}

// Block sums X a row of K columns needs: one per block for the types with an offset, else none.
template <class Dq>
constexpr int64_t x_sum_blocks(int64_t cols) {
  if constexpr (Dq::kHasMin) return cols / Dq::kQB;
  return 0;
}

// Rows [row0, row0 + mr) of x as their block sums, out [x_sum_blocks][mr] (see block_sums;
// nothing for the types without an offset).
template <class Dq>
inline void pack_xs(const TileJob& job, int64_t row0, int mr, float* out) {
  if constexpr (Dq::kHasMin)
    for (int i = 0; i < mr; ++i) block_sums(job.x + (row0 + i) * job.ldx, job.cols, Dq::kQB, out + i, mr);
}

// One block's code sums s of MR rows x NT tiles folded into the rows' sums (TileJob): y = fma(s,
// d, y), then y = fma(X, m, y) for the types with an offset (xs: the block's X of the MR rows);
// s back to +0. y in registers (kYRegs), else in memory, ym [MR][NT][16].
// (d, m: VF arrays, or Indexed)
template <class Dq, bool kYRegs, int MR, int NT, class D, class M>
BF_AI void fold_sums(VF (&s)[MR][NT], VF (&y)[MR][NT], float* ym, const D& d, const M& m, const float* xs) {
  BF_UNROLL for (int i = 0; i < MR; ++i) {
    VF xm = vf_zero();
    if constexpr (Dq::kHasMin) xm = vf_bcast(xs + i);
    BF_UNROLL for (int t = 0; t < NT; ++t) {
      VF v = kYRegs ? y[i][t] : vf_load(ym + (i * NT + t) * 16);
      v = vf_fma(s[i][t], d[t], v);
      if constexpr (Dq::kHasMin) v = vf_fma(xm, m[t], v);
      if constexpr (kYRegs) y[i][t] = v;
      else vf_store(ym + (i * NT + t) * 16, v);
      s[i][t] = vf_zero();
    }
  }
}

// A callable with both callables' overloads.
template <class A, class B>
struct Overload : A, B {
  using A::operator();
  using B::operator();
};

// Whether Dq is a nibble type read in the subnormal form (the ISA's nibble_word_fma4 runs it).
template <class Dq>
constexpr bool subnormal_nibbles() {
  if constexpr (requires { Dq::kSubnormalNibbles; }) return Dq::kSubnormalNibbles;
  return false;
}

// Tiles a fused call takes for mr rows: fused_nt, but kNibbleWordTiles at one row where the ISA
// has nibble_word_fma4.
template <class Dq>
constexpr int fused_nt_of(int mr) {
  return mr == 1 && kNibbleWordTiles > 0 && subnormal_nibbles<Dq>() ? kNibbleWordTiles : fused_nt(mr);
}

// MR rows x NT tiles: the rows' chains in MR x NT accumulators. The block types keep each
// block's code sums S there and fold them into y (TileJob) block by block: y in registers where
// both fit beside the codes and a broadcast, else in memory (used once a block).
template <class Dq, int MR, int NT>
__attribute__((noinline)) void fused_block(const TileJob& job, const float* xp, const float* xs, int64_t tile0,
                                           SideCursor& side, int64_t row0 = 0) {
  const int64_t tb = tile_bytes(job.type, job.cols);
  const uint8_t* tiles[NT];
  BF_UNROLL for (int t = 0; t < NT; ++t) tiles[t] = job.w + (tile0 + t) * tb;
  VF acc[MR][NT];
  BF_UNROLL for (int i = 0; i < MR; ++i) BF_UNROLL for (int t = 0; t < NT; ++t) acc[i][t] = vf_zero();
  const auto fma_column = [&](int64_t k, const VF* w) __attribute__((always_inline)) {
    BF_UNROLL for (int i = 0; i < MR; ++i) {
      const VF xb = vf_bcast(xp + k * MR + i);
      BF_UNROLL for (int t = 0; t < NT; ++t) acc[i][t] = vf_fma(xb, w[t], acc[i][t]);
    }
  };
  if constexpr (!Dq::kFactored) {
    if (job.cols % 32 != 0) {  // F16 only (the block types' K is a multiple of 32)
      Dq::template for_each<NT>(tiles, 0, job.cols, fma_column);
      store_acc<MR, NT>(acc, job, row0, tile0);
      return;
    }
  }
  // (registers: S and y, two columns of codes, a broadcast and X; AVX2 at one row: y in
  // registers: the body the same, the LM head 9% slower)
  constexpr bool kYRegs = !Dq::kFactored || 2 * MR * NT + 2 * NT + 2 <= kVfRegs;
  VF y[MR][NT];
  alignas(64) float ym[kYRegs ? 16 : MR * NT * 16];
  BF_UNROLL for (int i = 0; i < MR; ++i) BF_UNROLL for (int t = 0; t < NT; ++t) {
    if constexpr (kYRegs) y[i][t] = vf_zero();
    else vf_store(ym + (i * NT + t) * 16, vf_zero());
  }
  const auto fold = [&](int64_t b, const auto& d, const auto& m) __attribute__((always_inline)) {
    fold_sums<Dq, kYRegs>(acc, y, ym, d, m, xs + b * MR);
  };
  const int64_t nc = job.cols / 32, cb = tb / nc;
  // (unrolled at one row only: on AVX2 at 4-32 rows they ran 5% slower than the loop)
  constexpr int64_t kPrefetchLines = MR == 1 ? chunk_lines<Dq>() : 0;
  if (tile0 == job.tile_begin) {  // the job's first chunks; later groups were prefetched by the one before
    for (int64_t c = 0; c < kFusedPrefetchChunks; ++c) prefetch_chunk<NT, kPrefetchLines>(job, tile0, c, nc, tb, cb);
  }
  for (int64_t c = 0; c < nc; ++c) {
    prefetch_chunk<NT, kPrefetchLines>(job, tile0, c + kFusedPrefetchChunks, nc, tb, cb);
    side.burst();
    if constexpr (MR == 1 && NT == kNibbleWordTiles && subnormal_nibbles<Dq>()) {
      const auto fma_words = [&](NibbleWords, int64_t k, const uint8_t* const* qs, int w) __attribute__((always_inline)) {
        const uint8_t* words[NT];
        BF_UNROLL for (int t = 0; t < NT; ++t) words[t] = qs[t] + 64 * w;
        nibble_word_fma4(acc[0], words, xp + k, kNibbleMask);
      };
      Dq::template for_each_code<NT>(tiles, 32 * c, 32, Overload<decltype(fma_column), decltype(fma_words)>{fma_column, fma_words}, fold);
    } else if constexpr (Dq::kFactored) Dq::template for_each_code<NT>(tiles, 32 * c, 32, fma_column, fold);
    else Dq::template for_each<NT>(tiles, 32 * c, 32, fma_column);
  }
  if constexpr (Dq::kFactored) {
    BF_UNROLL for (int i = 0; i < MR; ++i) BF_UNROLL for (int t = 0; t < NT; ++t) {
      acc[i][t] = kYRegs ? y[i][t] : vf_load(ym + (i * NT + t) * 16);
    }
  }
  store_acc<MR, NT>(acc, job, row0, tile0);
}

// Tiles [tile_begin, tile_end) for rows [row0, row0 + MR): groups of NT tiles, the rest in one
// smaller group.
template <class Dq, int MR, int NT>
void fused_tiles(const TileJob& job, const float* xp, const float* xs, int64_t tile_begin, int64_t tile_end,
                 SideCursor& side) {
  int64_t tile = tile_begin;
  for (; tile + NT <= tile_end; tile += NT) fused_block<Dq, MR, NT>(job, xp, xs, tile, side);
  if constexpr (NT > 1) {
    if (tile < tile_end) fused_tiles<Dq, MR, NT - 1>(job, xp, xs, tile, tile_end, side);
  }
}

// All job.m rows (<= kFusedMaxM) at once; xp = x packed [K][m], xs = its block sums [K / kQB][m].
template <class Dq, int MR = 1>
void fused_rows(const TileJob& job, int mr, const float* xp, const float* xs) {
  if constexpr (MR < kFusedMaxM) {
    if (mr != MR) return fused_rows<Dq, MR + 1>(job, mr, xp, xs);
  }
  constexpr int nt = fused_nt_of<Dq>(MR);
  SideCursor side;  // one share per 32-column chunk (fused_block)
  side.start(job.side, job.side_begin, job.side_end, (job.tile_end - job.tile_begin + nt - 1) / nt * (job.cols / 32));
  fused_tiles<Dq, MR, nt>(job, xp, xs, job.tile_begin, job.tile_end, side);
}

// One tile for an MR-row group (1 <= mr <= kFusedGroupMR), rows [row0, row0 + mr).
template <class Dq, int MR = 1>
void fused_group(int mr, const TileJob& job, const float* xp, const float* xs, int64_t tile, SideCursor& side,
                 int64_t row0) {
  if constexpr (MR < kFusedGroupMR) {
    if (mr != MR) return fused_group<Dq, MR + 1>(mr, job, xp, xs, tile, side, row0);
  }
  fused_block<Dq, MR, 1>(job, xp, xs, tile, side, row0);
}

// kFusedMaxM + 1 .. fused_groups_max_m(type) rows: groups of at most kFusedGroupMR rows (block_rows),
// each tile's passes back to back (the later ones read the tile from L1): the decoding in
// registers overlaps the FMAs, where the panel kernel runs it as a phase of its own. Rows in
// chunks whose packed x (~512 KB, as the panel kernel's) stays in L2 while all the job's tiles
// pass over it; each chunk reads the weights again. xp, xs: scratch for a chunk's x packed group
// after group ([K][mr] each) and their block sums the same way.
template <class Dq>
void fused_groups(const TileJob& job, float* xp, float* xs) {
  const int64_t nb = x_sum_blocks<Dq>(job.cols);
  int64_t chunk = kScratchXFloats / job.cols;
  chunk = chunk < kFusedGroupMR ? kFusedGroupMR : chunk;
  const auto groups_of = [](int64_t rows) { return (rows + kFusedGroupMR - 1) / kFusedGroupMR; };
  SideCursor side;
  if (job.side != nullptr) {
    int64_t groups = 0;  // group passes per tile, all chunks
    for (int64_t r0 = 0; r0 < job.m; r0 += chunk) groups += groups_of(chunk < job.m - r0 ? chunk : job.m - r0);
    side.start(job.side, job.side_begin, job.side_end, groups * (job.tile_end - job.tile_begin) * (job.cols / 32));
  }
  for (int64_t r0 = 0; r0 < job.m; r0 += chunk) {
    const int64_t rows = chunk < job.m - r0 ? chunk : job.m - r0, num_groups = groups_of(rows);
    for (int64_t g = 0, row = 0; g < num_groups; ++g) {
      const int mr = block_rows(rows, num_groups, g);
      pack_x<Dq>(job, r0 + row, mr, xp + row * job.cols);
      pack_xs<Dq>(job, r0 + row, mr, xs + row * nb);
      row += mr;
    }
    for (int64_t tile = job.tile_begin; tile < job.tile_end; ++tile) {
      for (int64_t g = 0, row = 0; g < num_groups; ++g) {
        const int mr = block_rows(rows, num_groups, g);
        fused_group<Dq>(mr, job, xp + row * job.cols, xs + row * nb, tile, side, r0 + row);
        row += mr;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Panel kernel (F32 weights at any M; AVX2 past fused_groups_max_m): NT tiles decoded into fp32
// panels [kc][16] a column chunk at a time (kPanelKc columns: the panels stay in L1; F16: weights,
// the block types: codes, with each block's scale and offset beside them), then every block of MR
// <= panel_max_mr rows runs an MR x NT register-blocked FMA loop over the chunk (broadcast x,
// 16-wide weights), so the decoding is shared by all the rows. Between chunks each block's
// accumulators wait in `part` (fp32, stored and reloaded exactly: the chains are the same as
// unchunked). The block types' fold costs 2 FMAs per row, tile and block where the dequantization
// was shared by the panel's rows: prompt chunks run ~3-8% slower than dequantized (AVX-512 / AVX2,
// Zen 5).

static_assert(kPanelNT <= 4 && kPanelMaxMR <= 16 && kFusedMaxM <= 16 && kFusedGroupMR <= 16, "partial sums / packed x exceed the scratch");

// The block types' panels hold codes, not weights; their blocks' d and m wait beside them
// ([kPanelKc / 16][2][16] floats a tile: the most blocks a chunk holds).
constexpr int64_t kPanelDmFloats = kPanelKc / 16 * 32;
static_assert(kPanelNT * (kPanelKc * kTileRows + kPanelDmFloats) <= kScratchPanelFloats, "panels exceed the job scratch");

// Rows per panel block: the block types hold their sums y in registers beside the code sums
// where both fit (kPanelMaxMRF rows), else in `part`.
template <class Dq>
constexpr int panel_max_mr() { return Dq::kFactored ? kPanelMaxMRF : kPanelMaxMR; }

template <class Dq, int MR, int NT>
__attribute__((noinline)) void panel_block(const TileJob& job, int64_t row0, const float* xp, const float* xs,
                                           int64_t tile0, const float* const* panels, const float* const* dms,
                                           int64_t k0, int64_t kn, float* part, bool first, bool last,
                                           SideCursor& weights, SideCursor& side) {
  xp += k0 * MR;  // x packed [K][MR]
  // this block's prefetches, evenly over its columns: the next chunk's weights, then side lines
  const int64_t n_weights = weights.quota(), n = n_weights + side.quota();
  const int64_t stride = n > 0 && kn / n > 1 ? kn / n : 1, per_step = n > kn ? (n + kn - 1) / kn : 1;
  int64_t next_prefetch = n > 0 ? 0 : kn, issued = 0;
  const float* p[NT];
  BF_UNROLL for (int t = 0; t < NT; ++t) p[t] = panels[t];
  VF acc[MR][NT];
  BF_UNROLL for (int i = 0; i < MR; ++i) BF_UNROLL for (int t = 0; t < NT; ++t) {
    acc[i][t] = first || Dq::kFactored ? vf_zero() : vf_load(part + (i * NT + t) * kTileRows);
  }
  // columns [k, k1) into the accumulators
  const auto columns = [&](int64_t k, int64_t k1) __attribute__((always_inline)) {
    for (; k < k1; ++k) {
      if (k == next_prefetch) {
        for (int64_t i = 0; i < per_step && issued < n; ++i, ++issued) {
          if (issued < n_weights) weights.next_line();
          else side.next_line();
        }
        next_prefetch = issued < n ? k + stride : kn;
      }
      VF w[NT];
      BF_UNROLL for (int t = 0; t < NT; ++t) w[t] = vf_load(p[t] + 16 * k);
      BF_UNROLL for (int i = 0; i < MR; ++i) {
        const VF xb = vf_bcast(xp + k * MR + i);
        BF_UNROLL for (int t = 0; t < NT; ++t) acc[i][t] = vf_fma(xb, w[t], acc[i][t]);
      }
    }
  };
  if constexpr (!Dq::kFactored) {
    columns(0, kn);
    if (last) {
      store_acc<MR, NT>(acc, job, row0, tile0);
    } else {
      BF_UNROLL for (int i = 0; i < MR; ++i) BF_UNROLL for (int t = 0; t < NT; ++t) {
        vf_store(part + (i * NT + t) * kTileRows, acc[i][t]);
      }
    }
  } else {
    // each block's code sums fold into y: in registers where they fit beside the sums, the
    // weights and a broadcast (loaded from / stored to `part` between chunks), else in `part`
    constexpr int64_t qb = Dq::kQB;
    constexpr bool kYRegs = 2 * MR * NT + NT + 1 <= kVfRegs;  // S and y, the weights, a broadcast
    const float* xsb = xs + k0 / qb * MR;  // this chunk's first block
    VF y[MR][NT];
    BF_UNROLL for (int i = 0; i < MR; ++i) BF_UNROLL for (int t = 0; t < NT; ++t) {
      if constexpr (kYRegs) y[i][t] = first ? vf_zero() : vf_load(part + (i * NT + t) * kTileRows);
      else if (first) vf_store(part + (i * NT + t) * kTileRows, vf_zero());
    }
    for (int64_t bl = 0; bl < kn / qb; ++bl) {
      columns(bl * qb, bl * qb + qb);
      VF dv[NT], mv[NT];
      BF_UNROLL for (int t = 0; t < NT; ++t) {
        dv[t] = vf_load(dms[t] + 32 * bl);
        mv[t] = Dq::kHasMin ? vf_load(dms[t] + 32 * bl + 16) : dv[t];
      }
      fold_sums<Dq, kYRegs>(acc, y, part, dv, mv, xsb + bl * MR);
    }
    BF_UNROLL for (int i = 0; i < MR; ++i) BF_UNROLL for (int t = 0; t < NT; ++t) {
      if constexpr (kYRegs) acc[i][t] = y[i][t];
      else acc[i][t] = vf_load(part + (i * NT + t) * kTileRows);
    }
    if (last) {
      store_acc<MR, NT>(acc, job, row0, tile0);
    } else if constexpr (kYRegs) {
      BF_UNROLL for (int i = 0; i < MR; ++i) BF_UNROLL for (int t = 0; t < NT; ++t) {
        vf_store(part + (i * NT + t) * kTileRows, acc[i][t]);
      }
    }
  }
}

template <class Dq, int NT, int MR = 1>
void panel_rows(int mr, const TileJob& job, int64_t row0, const float* xp, const float* xs, int64_t tile0,
                const float* const* panels, const float* const* dms, int64_t k0, int64_t kn, float* part, bool first,
                bool last, SideCursor& weights, SideCursor& side) {
  if constexpr (MR < panel_max_mr<Dq>()) {
    if (mr != MR)
      return panel_rows<Dq, NT, MR + 1>(mr, job, row0, xp, xs, tile0, panels, dms, k0, kn, part, first, last, weights,
                                        side);
  }
  panel_block<Dq, MR, NT>(job, row0, xp, xs, tile0, panels, dms, k0, kn, part, first, last, weights, side);
}

// Columns [k0, k0 + kn) of one tile into panel [kn][16]: its weights (F16), or its codes and
// each block's d and m into dm [kn / kQB][2][16] (the block types).
template <class Dq>
__attribute__((noinline)) void dequant_panel(const uint8_t* tile, int64_t k0, int64_t kn, float* panel, float* dm) {
  const uint8_t* tiles[1] = {tile};
  const auto put = [&](int64_t k, const VF* w) __attribute__((always_inline)) { vf_store(panel + 16 * (k - k0), w[0]); };
  if constexpr (Dq::kFactored) {
    Dq::template for_each_code<1>(tiles, k0, kn, put, [&](int64_t b, const auto& d, const auto& m) __attribute__((always_inline)) {
      float* at = dm + 32 * (b - k0 / Dq::kQB);
      vf_store(at, d[0]);
      vf_store(at + 16, m[0]);
    });
  } else {
    Dq::template for_each<1>(tiles, k0, kn, put);
  }
}

// Rows [row_begin, row_end) x tiles [tile0, tile0 + NT), in balanced blocks of <= kPanelMaxMR rows
// (block_rows); xp = those rows packed by pack_x, block after block; xs their block sums, the
// same way (block types).
template <class Dq, int NT>
void panel_group(const TileJob& job, int64_t row_begin, int64_t row_end, const float* xp, const float* xs,
                 int64_t tile0, SideCursor& side) {
  const int64_t tb = tile_bytes(job.type, job.cols);
  float* part = job.scratch + kScratchPanelFloats;  // [rows][NT][16] partial sums
  const int64_t rows = row_end - row_begin;
  constexpr int64_t max_mr = panel_max_mr<Dq>();
  const int64_t num_blocks = (rows + max_mr - 1) / max_mr;
  const int64_t nb = x_sum_blocks<Dq>(job.cols);  // X per row
  for (int64_t k0 = 0; k0 < job.cols; k0 += kPanelKc) {
    const int64_t kn = job.cols - k0 < kPanelKc ? job.cols - k0 : kPanelKc;
    const float* panels[NT];
    const float* dms[NT];
    BF_UNROLL for (int t = 0; t < NT; ++t) {
      const uint8_t* tile = job.w + (tile0 + t) * tb;
      dms[t] = nullptr;
      if constexpr (Dq::kIsPanel) {
        panels[t] = reinterpret_cast<const float*>(tile) + kTileRows * k0;
      } else {
        float* panel = job.scratch + t * kTileRows * kPanelKc;  // [kn][16]
        float* dm = job.scratch + NT * kTileRows * kPanelKc + t * kPanelDmFloats;
        dequant_panel<Dq>(tile, k0, kn, panel, dm);
        panels[t] = panel;
        dms[t] = dm;
      }
    }
    // The next chunk's weights (these tiles' next columns, or the next group's first ones) come
    // from memory while this chunk's FMAs run, spread over them: the dequantization loop alone is
    // too short for the hardware prefetcher to hide the latency (+5-10% measured at M = 16-32),
    // and issued at once the prefetches stall the FMAs on miss buffers (LM head at 32 rows on a
    // Zen 5: 5.2-5.4 -> 4.5-4.7 ms).
    const char* next_spans[NT];
    SidePrefetch next_chunk{next_spans, 0, 0};
    SideCursor weights;
    {
      const bool last = k0 + kPanelKc >= job.cols;
      const int64_t next = last ? 0 : k0 + kPanelKc, next_n = job.cols - next < kPanelKc ? job.cols - next : kPanelKc;
      const int64_t next_tile = last ? tile0 + NT : tile0;
      const int64_t begin = next / block_elems(job.type) * tile_block_bytes(job.type);
      const int64_t bytes = next_n / block_elems(job.type) * tile_block_bytes(job.type);
      for (int64_t t = next_tile; t < next_tile + NT && t < job.tile_end; ++t)
        next_spans[next_chunk.num_spans++] = reinterpret_cast<const char*>(job.w + t * tb + begin);
      next_chunk.span_lines = (bytes + 63) / 64;
      weights.start(&next_chunk, 0, next_chunk.num_spans * next_chunk.span_lines, num_blocks);
    }
    int64_t row = row_begin;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int mr = block_rows(rows, num_blocks, b);
      panel_rows<Dq, NT>(mr, job, row, xp + (row - row_begin) * job.cols, xs + (row - row_begin) * nb, tile0, panels,
                         dms, k0, kn, part + (row - row_begin) * NT * kTileRows, k0 == 0, k0 + kn == job.cols, weights,
                         side);
      row += mr;
    }
  }
}

template <class Dq>
void panel_path(const TileJob& job, float* xp, float* xs) {
  // Rows in chunks whose x slice (~512 KB) stays in L2 while all the job's tiles pass over it;
  // each chunk dequantizes the weights again (a few % of the FMAs at these sizes).
  int64_t chunk = kScratchXFloats / job.cols;
  constexpr int64_t max_mr = panel_max_mr<Dq>();
  chunk = chunk < max_mr ? max_mr : chunk > kScratchPartRows ? kScratchPartRows : chunk;
  const int64_t nb = x_sum_blocks<Dq>(job.cols);  // X per row
  SideCursor side;
  if (job.side != nullptr) {
    const int64_t tiles = job.tile_end - job.tile_begin, groups = tiles / kPanelNT + tiles % kPanelNT;
    const int64_t k_chunks = (job.cols + kPanelKc - 1) / kPanelKc;
    int64_t blocks = 0;  // FMA blocks the job runs (panel_rows calls)
    for (int64_t r0 = 0; r0 < job.m; r0 += chunk) {
      const int64_t r1 = r0 + chunk < job.m ? r0 + chunk : job.m;
      blocks += groups * k_chunks * ((r1 - r0 + max_mr - 1) / max_mr);
    }
    side.start(job.side, job.side_begin, job.side_end, blocks);
  }
  for (int64_t r0 = 0; r0 < job.m; r0 += chunk) {
    const int64_t r1 = r0 + chunk < job.m ? r0 + chunk : job.m;
    const int64_t num_blocks = (r1 - r0 + max_mr - 1) / max_mr;
    for (int64_t b = 0, row = r0; b < num_blocks; ++b) {  // block b -> xp + (row - r0) K: [K][mr]
      const int mr = block_rows(r1 - r0, num_blocks, b);
      pack_x<Dq>(job, row, mr, xp + (row - r0) * job.cols);
      pack_xs<Dq>(job, row, mr, xs + (row - r0) * nb);
      row += mr;
    }
    int64_t tile = job.tile_begin;
    for (; tile + kPanelNT <= job.tile_end; tile += kPanelNT) panel_group<Dq, kPanelNT>(job, r0, r1, xp, xs, tile, side);
    for (; tile < job.tile_end; ++tile) panel_group<Dq, 1>(job, r0, r1, xp, xs, tile, side);
  }
}

template <class Dq>
void run_job(const TileJob& job) {
  float* xp = job.scratch + kScratchPanelFloats + kScratchPartFloats;  // x packed
  float* xs = xp + job_scratch_x_floats(job.cols);                      // its block sums
  if constexpr (!Dq::kIsPanel) {  // F32 tiles are read in place by the panel kernel at any M
    if (job.m <= kFusedMaxM) {
      pack_x<Dq>(job, 0, static_cast<int>(job.m), xp);
      pack_xs<Dq>(job, 0, static_cast<int>(job.m), xs);
      fused_rows<Dq>(job, static_cast<int>(job.m), xp, xs);
      return;
    }
    if (job.m <= fused_groups_max_m(job.type) && job.cols % 32 == 0) {
      fused_groups<Dq>(job, xp, xs);
      return;
    }
  }
  panel_path<Dq>(job, xp, xs);
}

template <bool kSub>
BF_AI void run_packed_gemm_as(const TileJob& job) {
  switch (job.type) {
    case QType::F32: run_job<DqF32>(job); break;
    case QType::F16: run_job<DqF16>(job); break;
    case QType::Q4_0: run_job<DqQ4<false, kSub>>(job); break;
    case QType::Q4_1: run_job<DqQ4<true, kSub>>(job); break;
    case QType::Q8_0: run_job<DqQ8_0<kSub>>(job); break;
    case QType::Q4_K: run_job<DqQ4_K<kSub>>(job); break;
    case QType::Q6_K: run_job<DqQ6_K<kSub>>(job); break;
  }
}

// The scaled-code types in their subnormal form where the job asks for it and this thread's MXCSR
// reads subnormals (packed.h).
BF_AI void run_packed_gemm(const TileJob& job) {
  if (job.subnormal_codes && subnormals_read()) run_packed_gemm_as<true>(job);
  else run_packed_gemm_as<false>(job);
}

}  // namespace
}  // namespace backfill

#undef BF_AI
#undef BF_UNROLL
