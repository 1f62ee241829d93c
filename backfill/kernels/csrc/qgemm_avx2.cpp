// AVX2 + FMA + F16C kernels (x86-64 CPUs since Haswell / Zen): VF = two ymm. See isa.h and
// qgemm_kernels.h.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "isa.h"

namespace backfill {
namespace {

#define AI inline __attribute__((always_inline))

struct VF {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
struct VI {
  __m256i lo, hi;
};

// Lane masks for the first n of 16 lanes (maskload / maskstore read the sign bits).
AI __m256i lanes_below(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
AI VF vf_zero() { return VF{_mm256_setzero_ps(), _mm256_setzero_ps()}; }
AI VF vf_set1(float f) { return VF{_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
AI VF vf_load(const float* p) { return VF{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
AI void vf_store(float* p, VF a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
AI VF vf_load_n(const float* p, int n) {
  return VF{_mm256_maskload_ps(p, lanes_below(n)), _mm256_maskload_ps(p + 8, lanes_below(n - 8))};
}
AI void vf_store_n(float* p, VF a, int n) {
  _mm256_maskstore_ps(p, lanes_below(n), a.lo);
  _mm256_maskstore_ps(p + 8, lanes_below(n - 8), a.hi);
}
AI VF vf_bcast(const float* p) {
  const __m256 b = _mm256_broadcast_ss(p);
  return VF{b, b};
}
AI VF vf_fma(VF a, VF b, VF c) { return VF{_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
AI VF vf_mul(VF a, VF b) { return VF{_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
AI VF vf_add(VF a, VF b) { return VF{_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
AI VF vf_load_f16(const uint8_t* p) {
  return VF{_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
// Two 8-byte loads, each widened by one vpmovzxbd / vpmovsxbd with a memory operand.
AI VI vi_load_u8(const uint8_t* p) {
  return VI{_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
AI VI vi_load_s8(const uint8_t* p) {
  return VI{_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
AI VI vi_load_u32(const uint8_t* p) {
  return VI{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
AI VI vi_and_bcast(VI a, const uint32_t* m) {
  const __m256i mm = _mm256_set1_epi32(static_cast<int>(*m));
  return VI{_mm256_and_si256(a.lo, mm), _mm256_and_si256(a.hi, mm)};
}
AI VI vi_and(VI a, int m) {
  const __m256i mm = _mm256_set1_epi32(m);
  return VI{_mm256_and_si256(a.lo, mm), _mm256_and_si256(a.hi, mm)};
}
template <int S>
AI VI vi_srl(VI a) { return VI{_mm256_srli_epi32(a.lo, S), _mm256_srli_epi32(a.hi, S)}; }
AI VF vi_to_f(VI a) { return VF{_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
AI VF vi_as_f(VI a) { return VF{_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
AI VF vf_nib_lo(VI a) { return vi_to_f(vi_and(a, 0xF)); }

// block_sum's order (packed.h): lanes l + (l + 8), then + (l + 4), + (l + 2), + (l + 1).
AI float vf_block_tree(VF a) {
  const __m256 h = _mm256_add_ps(a.lo, a.hi);
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}

// pack_x's 16-row fast path: AVX2 blocks are at most 6 rows (kFusedMaxM, kPanelMaxMR below), so
// it is never reached here (pack_x8.h does theirs).
AI int64_t pack_x16(const float*, int64_t, int64_t, float*, const float*) { return 0; }

AI VI vi_zero() { return VI{_mm256_setzero_si256(), _mm256_setzero_si256()}; }
// The int8-activation dot (q8_kernels.h): vpmaddubsw (unsigned codes <= 15 times int8 x, pairs
// summed to int16: |sum| <= 2 * 15 * 128, never saturating), then vpmaddwd by ones to int32.
AI VI vq_dot(VI acc, VI a, int32_t word) {
  const __m256i x = _mm256_set1_epi32(word), ones = _mm256_set1_epi16(1);
  return VI{_mm256_add_epi32(acc.lo, _mm256_madd_epi16(_mm256_maddubs_epi16(a.lo, x), ones)),
            _mm256_add_epi32(acc.hi, _mm256_madd_epi16(_mm256_maddubs_epi16(a.hi, x), ones))};
}

// One row, 4 tiles, one nibble word each (8 columns of 16 rows, the subnormal form:
// qgemm_kernels.h, nibble_columns_subnormal): acc[t] += tile t's codes times x, column by column
// (x[c]: the packed x of the word's column c; words[t]: tile t's word; masks: kNibbleMask). Every
// chain takes its FMAs in column order: the generic code's chains, the same bits. One asm
// statement, two columns at a time (their x and masks broadcast once, then the 8 tile halves'
// and + FMA pairs, each and reading the word from L1): the compiler, given these operations as
// intrinsics at 4 tiles, took every tile's codes out before the FMAs and spilled them. With the
// fold's d and m read at the fold (DqQ4) and the prefetches unrolled, a one-row Q4_1 GEMV
// [960, 576] from L2 on one core of a Zen 4 EPYC forced to AVX2 went from 9.1 to 10.7 weights a
// cycle (3 tiles a call, the generic code: 9.1; AVX-512: 12.0); vmovdqu + two register ands ran
// the same as the ands from memory.
#define BF_NIB_PAIR(T, H)                                \
  "vpand " #H "*32(%[w" #T "]), %%ymm14, %%ymm11\n\t"   \
  "vfmadd231ps %%ymm11, %%ymm12, %[a" #T #H "]\n\t"     \
  "vpand " #H "*32(%[w" #T "]), %%ymm15, %%ymm10\n\t"   \
  "vfmadd231ps %%ymm10, %%ymm13, %[a" #T #H "]\n\t"
// columns 6 and 7: nibble 6 shifted down to nibble 5's place (its mask), nibble 7 to the bottom
#define BF_NIB_LAST(T, H)                                \
  "vmovdqu " #H "*32(%[w" #T "]), %%ymm10\n\t"          \
  "vpsrld $4, %%ymm10, %%ymm11\n\t"                      \
  "vpand %%ymm14, %%ymm11, %%ymm11\n\t"                  \
  "vfmadd231ps %%ymm11, %%ymm12, %[a" #T #H "]\n\t"     \
  "vpsrld $28, %%ymm10, %%ymm10\n\t"                     \
  "vfmadd231ps %%ymm10, %%ymm13, %[a" #T #H "]\n\t"
#define BF_NIB_ALL(OP) OP(0, 0) OP(0, 1) OP(1, 0) OP(1, 1) OP(2, 0) OP(2, 1) OP(3, 0) OP(3, 1)
// columns XA and XB's x (ymm12, ymm13) and the masks at byte offsets MA and MB (ymm14, ymm15)
#define BF_NIB_LOAD(XA, XB, MA, MB)                      \
  "vbroadcastss " #XA "*4(%[x]), %%ymm12\n\t"           \
  "vbroadcastss " #XB "*4(%[x]), %%ymm13\n\t"           \
  "vpbroadcastd " #MA "(%[m]), %%ymm14\n\t"             \
  "vpbroadcastd " #MB "(%[m]), %%ymm15\n\t"
AI void nibble_word_fma4(VF (&acc)[4], const uint8_t* const* words, const float* x, const uint32_t* masks) {
  using Word = const uint8_t(*)[64];
  asm(BF_NIB_LOAD(0, 1, 0, 4) BF_NIB_ALL(BF_NIB_PAIR)
      BF_NIB_LOAD(2, 3, 8, 12) BF_NIB_ALL(BF_NIB_PAIR)
      BF_NIB_LOAD(4, 5, 16, 20) BF_NIB_ALL(BF_NIB_PAIR)
      BF_NIB_LOAD(6, 7, 20, 20) BF_NIB_ALL(BF_NIB_LAST)
      : [a00] "+x"(acc[0].lo), [a01] "+x"(acc[0].hi), [a10] "+x"(acc[1].lo), [a11] "+x"(acc[1].hi),
        [a20] "+x"(acc[2].lo), [a21] "+x"(acc[2].hi), [a30] "+x"(acc[3].lo), [a31] "+x"(acc[3].hi)
      : [w0] "r"(words[0]), [w1] "r"(words[1]), [w2] "r"(words[2]), [w3] "r"(words[3]),
        "m"(*reinterpret_cast<Word>(words[0])), "m"(*reinterpret_cast<Word>(words[1])),
        "m"(*reinterpret_cast<Word>(words[2])), "m"(*reinterpret_cast<Word>(words[3])),
        [x] "r"(x), "m"(*reinterpret_cast<const float(*)[8]>(x)), [m] "r"(masks),
        "m"(*reinterpret_cast<const uint32_t(*)[8]>(masks))
      : "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
}
#undef BF_NIB_PAIR
#undef BF_NIB_LAST
#undef BF_NIB_ALL
#undef BF_NIB_LOAD

#undef AI

}  // namespace
}  // namespace backfill

#include "pack_x8.h"

namespace backfill {
namespace {

// The int8-activation kernels' blocking: one row 2 tiles, more rows 1 tile x 4 rows (at 8 rows of
// x on a Zen 4 forced to AVX2, Q4_1 [1024, 576]: 1.79x fp32 where 2 rows ran 1.54x).
constexpr int kQ8NT1 = 2;
constexpr int kQ8NT = 1;
constexpr int kQ8MR = 4;

// Blocking (16 ymm): fused MR x NT x 2 accumulators; panels (past fused_groups_max_m: prompt
// chunks) run 6 x 16 (12 accumulators, 2 weight registers, a broadcast).
constexpr int kFusedMaxM = 4;
// 5+ rows: fused groups of up to 6 rows, one tile a pass, each tile's passes back to back (12
// chains; y in memory), up to fused_groups_max_m rows, the panels above. On a Zen 5 EPYC forced
// to AVX2, two halves (groups of 4) at batch 8 ran 10-15% faster than the panels. On a Zen 4
// EPYC forced to AVX2 (2 threads), groups of 6 against the panels (9+ rows) and halves (5-8): the
// decode step (Q4_1, Q8_0 LM head), medians of 20 paired steps: batch 5 +27%, 6 +16%, 12 +20%,
// 32 +3-16%, 48 +3%; a [3072, 768] matrix of each type at 6 rows +16-53%; at 12 rows F16 / Q4_0
// / Q4_1 / Q8_0 +7-14%, Q4_K +1%, Q6_K -14%; at 32 rows +6-19%, Q4_K -5%, Q6_K -25%; at 256 rows
// -3% to +1%, Q4_K -11%, Q6_K -33%. The panels decode a tile once for all rows, as a phase of
// its own (~7% of their time at 32 rows, measured by skipping it); the groups decode it again
// per group, on the pipes the FMAs leave free, which the k-quants' decoding overflows. Groups of
// 4 (8 chains) ran no faster than the panels. Q6_K's six-bit words (two operations a column, as
// the nibbles; the Q6_K figures above are its split codes'), a [2048, 1536] matrix on one core
// of the Zen 4, groups against the panels: 7 rows +11%, 8 +7%, 10 +5%, 12 -3%, 32 -10%.
constexpr int kFusedGroupMR = 6;
constexpr int64_t fused_groups_max_m(QType type) {
  return type == QType::Q6_K ? 10 : type == QType::Q4_K ? 12 : 64;
}
// Tiles a fused call takes: one row 3 (6 FMA chains), two rows 2 (8 chains), where 2 and 1 left
// 4: 2 FMA pipes x 4 cycles of latency need 8 in flight. On a Zen 4 forced to AVX2 (one thread,
// weights in cache, a [3072, 768] matrix of each type) one row ran 8-11% faster for F16 / Q4_0 /
// Q4_1 / Q4_K (Q8_0 3%, Q6_K the same), two rows 20-45% faster (Q6_K ~20%); 4 tiles at one row
// and 2 tiles at 3-4 rows spill (1.5x slower).
constexpr int fused_nt(int mr) { return mr == 1 ? 3 : mr == 2 ? 2 : 1; }
// The subnormal form reads the nibble words and Q6_K's six-bit words from memory at one and two
// rows (qgemm_kernels.h: nibble_codes_from_memory, six_bit_columns_from_memory).
constexpr bool kSubCodesFromMemory = true;
// One row of a nibble type (Q4_0, Q4_1, Q4_K) in the subnormal form: 4 tiles a call (8 FMA
// chains), each word through nibble_word_fma4.
constexpr int kNibbleWordTiles = 4;
constexpr int kVfRegs = 8;  // VF registers (16 ymm: 8 VF)
constexpr int kPanelNT = 1;
constexpr int kPanelMaxMR = 6;
// The block types' panels: 6 x 16 with their sums y in memory (3 x 16 with y in registers ran
// ~35% slower).
constexpr int kPanelMaxMRF = 6;
constexpr int64_t kPanelKc = 256;  // a panel of 16 KB

}  // namespace
}  // namespace backfill

#include "qgemm_kernels.h"
#include "q8_kernels.h"

namespace backfill {

void packed_gemm_avx2(const TileJob& job) { run_packed_gemm(job); }
void q8_gemm_avx2(const Q8Job& job) { run_q8_gemm(job); }

void quantize_rows_q8_avx2(const float* x, int64_t m, int64_t ldx, int64_t cols, uint8_t* q, float* d, float* s) {
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // (q8_dot_column)
  const __m256i unlane = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const int64_t nb = cols / 32;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b, q += 32, ++d, ++s) {
      const float* xb = x + i * ldx + 32 * b;
      __m256 v[4], amax = _mm256_setzero_ps(), unord = _mm256_setzero_ps();
      for (int g = 0; g < 4; ++g) {
        v[g] = _mm256_loadu_ps(xb + 8 * g);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[g]));
        unord = _mm256_or_ps(unord, _mm256_cmp_ps(v[g], v[g], _CMP_UNORD_Q));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
      const float scale = q8_scale(_mm256_movemask_ps(unord) != 0 ? __builtin_nanf("") : _mm_cvtss_f32(m4));
      const __m256 inv = _mm256_set1_ps(q8_inverse(scale));
      __m256i r[4], sum = _mm256_setzero_si256();
      for (int g = 0; g < 4; ++g) {
        __m256 t = _mm256_mul_ps(_mm256_permutevar8x32_ps(v[g], order), inv);
        t = _mm256_and_ps(_mm256_min_ps(_mm256_max_ps(t, lo), hi), _mm256_cmp_ps(t, t, _CMP_ORD_Q));
        r[g] = _mm256_cvtps_epi32(t);  // round to nearest even (the default MXCSR)
        sum = _mm256_add_epi32(sum, r[g]);
      }
      const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(w, unlane));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      *d = scale;
      *s = scale * static_cast<float>(_mm_cvtsi128_si32(s4));
    }
  }
}

}  // namespace backfill
