// The decoder's non-GEMM kernels over a SIMD width W (GCC vector extensions), included once by
// each ISA translation unit after it defines BF_LANES, BF_TABLE (the table's function name),
// BF_NAME, the vector types vf / vi / vh (W floats / int32s / uint16s) and eight ISA primitives:
// `vf fmadd(vf a, vf b, vf c)` (a * b + c, fused where the ISA has FMA), `vf rcp_estimate(vf d)`
// (1 / d to 12 bits or better), `vf splat(float s)` (a broadcast; NOTE: `vf{} + s` costs an add, since
// 0 + -0 is +0, and a lane-by-lane loop compiles to one masked broadcast per lane),
// `vf load_bf16(const uint16_t* p)` (W bf16 bit patterns at p as fp32s, exactly: bits << 16),
// `vf load_f16(const uint16_t* p)` (W IEEE halves at p as fp32s, exactly), `vf widen_f16(vh h)` (the
// same from a vector vh of W halves), `vh load_u8_high(const uint8_t* p)` (W bytes at p as the
// high bytes of W 16-bit words, the low bytes zero) and
// `float f16_to_float(uint16_t h)` (one of them).
// Everything here has internal linkage, so each unit keeps its own copies (see isa.h).
// No include guard on purpose: one inclusion per unit.

#include <cstdint>

#include "fused_kernels.h"

namespace backfill {
namespace {

constexpr int64_t W = BF_LANES;
constexpr int64_t BK = kAttentionTileKeys;  // keys per inner tile
constexpr int64_t NV = BK / W;              // registers holding one row's scores of a key tile
static_assert(BK % W == 0, "a key tile is a whole number of registers");
constexpr float kNegInf = -__builtin_inff();

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}
inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
// W 16-bit cache elements widened to fp32, exactly (the ISA's load_bf16 / load_f16).
inline vf load(const Bf16* p) { return load_bf16(&p->bits); }
inline vf load(const F16* p) { return load_f16(&p->bits); }
// W 8-bit cache elements widened to fp32, exactly, as IEEE halves (the ISA's widen_f16): an E5M2
// code is a half's top byte; an E4M3 code there, shifted down one bit arithmetically (the sign
// copied) and the copy cleared, has its sign, exponent and significand at a half's places: a
// half 2^-8 times its value (subnormals too: both scale by 2^-8), which one exact product takes
// back to it; its NaN codes (exponent and significand all ones) are made a half NaN.
typedef int16_t vsh __attribute__((vector_size(sizeof(vh))));
inline vf load(const F8E5M2* p) { return widen_f16(load_u8_high(&p->bits)); }
inline vf load(const F8E4M3* p) {
  const vh h = (vh)((vsh)load_u8_high(&p->bits) >> 1) & 0xbf80;
  return widen_f16((h & 0x3f80) == 0x3f80 ? (h | 0x7e00) : h) * splat(0x1p8f);
}
inline float to_float(float x) { return x; }
inline float to_float(F16 x) { return f16_to_float(x.bits); }
// One 8-bit element (prompt chunks broadcast K one element at a time; the K^T copy): a table of
// the 256 codes' values, built at compile time from the formats' definitions (powers of two:
// exact), one load where the widening above took ~8 dependent operations an element.
struct Fp8Values {
  float v[256];
  constexpr Fp8Values(int exponent_bits, int bias) : v{} {
    const int mantissa_bits = 7 - exponent_bits, max_exponent = (1 << exponent_bits) - 1;
    const bool e4m3 = exponent_bits == 4;
    for (int code = 0; code < 256; ++code) {
      const int e = (code & 0x7f) >> mantissa_bits, m = code & ((1 << mantissa_bits) - 1);
      float x;
      if (e4m3 ? (code & 0x7f) == 0x7f : (e == max_exponent && m != 0)) x = __builtin_nanf("");
      else if (!e4m3 && e == max_exponent) x = __builtin_inff();
      else {  // the significand (as an integer) times 2^exponent
        x = static_cast<float>(e == 0 ? m : (1 << mantissa_bits) + m);
        const int exponent = (e == 0 ? 1 : e) - bias - mantissa_bits;
        for (int k = 0; k < -exponent; ++k) x *= 0.5f;
        for (int k = 0; k < exponent; ++k) x *= 2.0f;
      }
      v[code] = code & 0x80 ? -x : x;
    }
  }
};
constexpr Fp8Values kE4M3Values{4, 7}, kE5M2Values{5, 15};
inline float to_float(F8E5M2 x) { return kE5M2Values.v[x.bits]; }
inline float to_float(F8E4M3 x) { return kE4M3Values.v[x.bits]; }
inline float to_float(Bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}
inline float hsum(vf v) {  // fixed left-to-right order
  float s = v[0];
  for (int64_t i = 1; i < W; ++i) s += v[i];
  return s;
}
// Lane permutations i -> i ^ h for h = W/2, W/4, ..., 1 (constants: built at compile time).
struct LaneMasks {
  int32_t swap[5][W];
  constexpr LaneMasks() : swap{} {
    for (int64_t k = 0, h = W / 2; h >= 1; ++k, h /= 2)
      for (int64_t i = 0; i < W; ++i) swap[k][i] = static_cast<int32_t>(i ^ h);
  }
};
constexpr LaneMasks kLaneMasks{};

// Lanes summed as a butterfly: lane 0 ends as ((v0 + v8) + (v4 + v12)) + ... for W = 16.
inline float hsum_tree(vf v) {
  for (int64_t k = 0, h = W / 2; h >= 1; ++k, h /= 2) {
    vi swap;
    __builtin_memcpy(&swap, kLaneMasks.swap[k], sizeof swap);
    v += __builtin_shuffle(v, swap);
  }
  return v[0];
}
inline float hmax(vf v) {  // exact in any order
  float m = v[0];
  for (int64_t i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
inline vi iota() {
  vi v;
  for (int64_t i = 0; i < W; ++i) v[i] = static_cast<int32_t>(i);
  return v;
}
// 1 / d to ~2 ulp: the ISA's estimate and one Newton step, a fraction of a division's cost
inline vf reciprocal(vf d) {
  const vf r = rcp_estimate(d);
  return r * (splat(2.0f) - d * r);
}
// exp(x), Cephes' expf polynomial (~1 ulp over the clamped range). x is clamped to [-86, 88]
// so that 2^n stays a normal float: callers that need exact zeros (masked scores) select them.
inline vf vexp(vf x) {
  x = x < splat(-86.0f) ? splat(-86.0f) : x;
  x = x > splat(88.0f) ? splat(88.0f) : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  // NOTE: every multiply-add spelled as fmadd: GCC would otherwise choose per expression
  // whether to fuse it (-ffp-contract=fast), and both attention layouts must round alike.
  const vf t = fmadd(x, splat(1.44269504088896341f), magic);
  const vf n = t - magic;  // round(x / ln 2)
  vf r = fmadd(n, splat(-0.693359375f), x);
  r = fmadd(n, splat(2.12194440e-4f), r);
  vf p = splat(1.9875691500e-4f);
  p = fmadd(p, r, splat(1.3981999507e-3f));
  p = fmadd(p, r, splat(8.3334519073e-3f));
  p = fmadd(p, r, splat(4.1665795894e-2f));
  p = fmadd(p, r, splat(1.6666665459e-1f));
  p = fmadd(p, r, splat(5.0000001201e-1f));
  p = fmadd(p, r * r, r + splat(1.0f));
  // GCC vector casts reinterpret the bits: the low bits of t hold n + 0x400000
  const vi exponent = ((vi)t - (vi{} + 0x4B400000)) << 23;  // n << 23
  return (vf)((vi)p + exponent);
}

void rms_norm(const float* x, const float* w, float eps, int64_t n, float* y) {
  vf acc{};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vf v = load(x + i);
    acc = fmadd(v, v, acc);
  }
  float sum_sq = hsum(acc);
  for (; i < n; ++i) sum_sq += x[i] * x[i];
  // (x * rstd) * w, in F.rms_norm's order
  const float rstd = 1.0f / __builtin_sqrtf(sum_sq / static_cast<float>(n) + eps);
  const vf vr = splat(rstd);
  for (i = 0; i + W <= n; i += W) store(y + i, load(x + i) * vr * load(w + i));
  for (; i < n; ++i) y[i] = x[i] * rstd * w[i];
}

void silu_mul(const float* gate, const float* up, int64_t n, float* y) {
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vf g = load(gate + i);
    // g * sigmoid(g): a reciprocal, not a division (vdivps bounded the whole loop)
    store(y + i, g * reciprocal(splat(1.0f) + vexp(-g)) * load(up + i));
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    y[i] = g / (1.0f + vexp(splat(-g))[0]) * up[i];
  }
}

// P . V's blocking (pv_rows): D cut into slices of at most kPvSlice registers, a block of rows x
// slice registers of accumulators at most kAccRegs (AVX-512 has 32 vector registers, others 16).
// AVX2 / SSE: slices of 3 registers, 4 rows a block, 12 FMA chains in flight where whole-D slices
// of one row ran 8, all that 2 FMA pipes x 4 cycles of latency can overlap (on a Zen 4 forced
// to AVX2: a prompt chunk's attention ~20% faster with the score blocking below, a decode's ~5%;
// AVX-512, one FMA a cycle on a Zen 4, has chains to spare).
constexpr int64_t kAccRegs = W >= 16 ? 16 : 12;
constexpr int64_t kPvSlice = W >= 16 ? 8 : 3;
// Decodes (keys across lanes: a few rows) on 16 registers: slices of 4 registers, 3 rows a block,
// the rows' P broadcast before V is loaded one register at a time (12 accumulators and 3 + 1
// operands). P . V then walks V twice where slices of 3 walked it three times (head_dim 64),
// 12 FMA chains in every pass where the last had 6. On a Zen 4 EPYC forced to AVX2, one layer's
// decode attention, K/V in cache: 16 decodes over 128 keys 5.5% faster (one thread), over 512
// 10%, one over 4,000 12%, 8 over 1,024 (2 threads) 11%; K/V from memory (16 x 2,048) the same.
constexpr int64_t kPvSliceKeys = W >= 16 ? 8 : 4;
// Cache elements a 64-byte line holds (one prefetch each).
template <typename CacheT>
constexpr int64_t kLineElems = 64 / static_cast<int64_t>(sizeof(CacheT));
// Rows across lanes prefetch K/V chunks this many keys ahead (keys across lanes: see attend_keys).
constexpr int64_t kPrefetchKeys = 16;
// Tiles of at most this many rows (query tokens x G: decodes, chunks of a token or two) put
// keys across the lanes, larger ones rows. A speed choice only: both layouts run each row's
// arithmetic alike (see "Two layouts" below).
constexpr int64_t kKeyLaneRows = 8;
// Rows across lanes: score blocks of KJ keys x RV registers of rows (KJ1 keys when the tile is
// one register of rows, so that enough independent FMA chains are in flight). AVX2 / SSE: 4 keys
// x 3 registers, 12 chains and 3 + 1 registers of operands in 16 (2 keys x 4 registers ran 8).
constexpr int64_t KJ = 4;
constexpr int64_t KJ1 = W >= 16 ? 8 : 4;
constexpr int64_t RV = W >= 16 ? 4 : 3;
// Keys across lanes: score blocks of KR rows x KV registers of keys (read in place from the
// cache's K panels, or from a [D, KV * W] copy where the block size is not a multiple of W). A
// decode's 3-4 rows x 4 registers: 12-16 FMA chains in flight (hot decode attention on a Zen 5
// EPYC ~3% faster than 2 registers); AVX2's 16 registers hold 3 x 4 (see dot_block).
constexpr int64_t KR = W >= 16 ? 4 : 3;
constexpr int64_t KV = 4;
constexpr int64_t KB = KV * W;
static_assert(NV % KV == 0, "a key tile is whole key blocks");
constexpr int64_t PK = kAttentionPartitionKeys;

inline int64_t padded_rows(int64_t rows) { return (rows + W - 1) / W * W; }
// The rows whose softmax state a tile keeps: keys across lanes read it row by row, rows across
// lanes W rows at a time (the padding rows too).
inline int64_t state_rows(int64_t rows) { return rows <= kKeyLaneRows ? rows : padded_rows(rows); }

int64_t attention_scratch(const AttentionShape& s, int64_t max_rows) {
  const int64_t rows = padded_rows(max_rows), d = s.head_dim;
  // O, folded O [rows, D] | max, sum, alpha, folded max, folded sum [rows] | Q [rows, D] |
  // P [BK, rows] | K^T [D, KB] or V [BK, D] | lo, hi [rows] int32 | zeros [D, block_size]
  static_assert(KB <= BK, "the K^T buffer holds a key tile's V rows");
  return 2 * rows * d + 5 * rows + rows * d + BK * rows + d * BK + 2 * rows + d * s.block_size;
}

// o[r][x0 : x0 + DV*W] += sum_j p[r, j] * v_rows[j][x0 : x0 + DV*W] for NR rows (p[r, j] at
// p + r * p_row + j * p_key), over the tile's keys j in [j0, j1): the rows' slices of O stay in
// registers over them, each V load feeds NR FMAs. Per output element one fma chain over the
// keys in key order. ahead (null: none): runs of d_len floats to prefetch, ahead[2 j] and
// ahead[2 j + 1] (those not null) beside key j.
template <int64_t DV, int64_t NR, typename CacheT>
inline void pv_block(const float* p, int64_t p_row, int64_t p_key, const CacheT* const* v_rows, int64_t j0,
                     int64_t j1, int64_t x0, float* o, int64_t d_len, const CacheT* const* ahead) {
  vf acc[NR][DV];
  for (int64_t r = 0; r < NR; ++r)
    for (int64_t x = 0; x < DV; ++x) acc[r][x] = load(o + r * d_len + x0 + x * W);
  for (int64_t j = j0; j < j1; ++j) {
    if (ahead != nullptr)
      for (int64_t c = 2 * j; c < 2 * j + 2; ++c)
        if (ahead[c] != nullptr)
          for (int64_t x = 0; x < d_len; x += kLineElems<CacheT>) __builtin_prefetch(ahead[c] + x, 0, 2);  // prefetcht1
    if (v_rows[j] == nullptr) continue;  // outside the tile's key range: p is 0 for every row
    if constexpr (W < 16 && NR * DV + DV + 1 > 16) {  // 16 registers: P first (kPvSliceKeys)
      vf pr[NR];
      for (int64_t r = 0; r < NR; ++r) pr[r] = splat(p[r * p_row + j * p_key]);
      for (int64_t x = 0; x < DV; ++x) {
        const vf v = load(v_rows[j] + x0 + x * W);
        for (int64_t r = 0; r < NR; ++r) acc[r][x] = fmadd(pr[r], v, acc[r][x]);
      }
    } else {
      vf v[DV];
      for (int64_t x = 0; x < DV; ++x) v[x] = load(v_rows[j] + x0 + x * W);
      for (int64_t r = 0; r < NR; ++r) {
        const vf pr = splat(p[r * p_row + j * p_key]);
        for (int64_t x = 0; x < DV; ++x) acc[r][x] = fmadd(pr, v[x], acc[r][x]);
      }
    }
  }
  for (int64_t r = 0; r < NR; ++r)
    for (int64_t x = 0; x < DV; ++x) store(o + r * d_len + x0 + x * W, acc[r][x]);
}

// The last n (1 <= n <= N) rows as one block.
template <int64_t DV, int64_t N, typename CacheT>
inline void pv_tail(const float* p, int64_t p_row, int64_t p_key, const CacheT* const* v_rows, int64_t j0, int64_t j1,
                    int64_t x0, float* o, int64_t d_len, int64_t n, const CacheT* const* ahead) {
  if constexpr (N > 1) {
    if (n < N) return pv_tail<DV, N - 1>(p, p_row, p_key, v_rows, j0, j1, x0, o, d_len, n, ahead);
  }
  pv_block<DV, N>(p, p_row, p_key, v_rows, j0, j1, x0, o, d_len, ahead);
}

template <int64_t DV, typename CacheT>
inline void pv_rows(const float* p, int64_t p_row, int64_t p_key, const CacheT* const* v_rows, int64_t j0, int64_t j1,
                    int64_t x0, float* o, int64_t d_len, int64_t rows, const CacheT* const* ahead) {
  constexpr int64_t NR = kAccRegs / DV > 0 ? kAccRegs / DV : 1;
  int64_t r = 0;
  for (; r + NR <= rows; r += NR, ahead = nullptr)
    pv_block<DV, NR>(p + r * p_row, p_row, p_key, v_rows, j0, j1, x0, o + r * d_len, d_len, ahead);
  if (r < rows)
    pv_tail<DV, NR>(p + r * p_row, p_row, p_key, v_rows, j0, j1, x0, o + r * d_len, d_len, rows - r, ahead);
}

// O[rows, D] += P . V over the tile's keys [j0, j1), D cut into slices of at most Slice
// registers (how D is cut never changes an element's fma chain); the runs `ahead` are prefetched
// once, spread over the first block's keys.
template <int64_t Slice, typename CacheT>
inline void accumulate_pv(const float* p, int64_t p_row, int64_t p_key, const CacheT* const* v_rows, int64_t j0,
                          int64_t j1, float* o, int64_t d_len, int64_t rows, const CacheT* const* ahead = nullptr) {
  static_assert(Slice >= 1 && Slice <= 8, "slices of 1 to 8 registers");
  for (int64_t x0 = 0; x0 < d_len; x0 += Slice * W, ahead = nullptr) {
    switch ((d_len - x0) / W >= Slice ? Slice : (d_len - x0) / W) {
      case 1: pv_rows<1>(p, p_row, p_key, v_rows, j0, j1, x0, o, d_len, rows, ahead); break;
      case 2: pv_rows<2>(p, p_row, p_key, v_rows, j0, j1, x0, o, d_len, rows, ahead); break;
      case 3: pv_rows<3>(p, p_row, p_key, v_rows, j0, j1, x0, o, d_len, rows, ahead); break;
      case 4: pv_rows<4>(p, p_row, p_key, v_rows, j0, j1, x0, o, d_len, rows, ahead); break;
      case 5: pv_rows<5>(p, p_row, p_key, v_rows, j0, j1, x0, o, d_len, rows, ahead); break;
      case 6: pv_rows<6>(p, p_row, p_key, v_rows, j0, j1, x0, o, d_len, rows, ahead); break;
      case 7: pv_rows<7>(p, p_row, p_key, v_rows, j0, j1, x0, o, d_len, rows, ahead); break;
      default: pv_rows<8>(p, p_row, p_key, v_rows, j0, j1, x0, o, d_len, rows, ahead); break;
    }
  }
}

// --- Two layouts, one arithmetic ---
// Every row r and key j of a key tile [kb, kb + BK) go through, in either layout:
//   s = fma chain over d = 0 .. D - 1 of q'[r, d] * k[j, d], from 0 (q' = q * scale);
//   p = exp(s - new_max) where the row sees the key, else 0 (new_max = max(old max, the tile's
//   seen scores), alpha = exp(old max - new_max), 0 before the row's first key);
//   tile_sum = sum_j p as the butterfly of hsum_tree over the lane sums
//   t_l = ((p[l] + p[l + W]) + p[l + 2W]) + ...; row_sum = fma(row_sum, alpha, tile_sum);
//   O[r] *= alpha (unless 1); O[r, x] = fma chain over the tile's keys of p * v[j, x].
// Rows across lanes (attend_rows) does each step as one lane of a row register; keys across
// lanes (attend_keys) as one lane of a key register, with the row's scalars broadcast. Every
// operation is lane-wise and IEEE (fma is exact-then-round, commutative in its factors), so
// a row gets the same bits from both.

// out[b * out_stride + v * W + l] = sum over d = 0 .. D - 1 of bcast[b][d * b_stride] *
// vecs[v][d * vec_stride + l] for NB broadcast rows x NVEC registers, each sum one fma chain in
// d order. The scores of both layouts: rows across lanes broadcasts K elements (a key's, d apart
// by the cache's block size) against Q^T, keys across lanes Q rows against K^T (read in place
// from the cache, see attend_keys); a product's factor order never matters: fma is exact, then
// rounds.
template <int64_t NVEC, int64_t NB, typename VecT, typename BcastT>
inline void dot_block(const VecT* const* vecs, int64_t vec_stride, const BcastT* const* bcast, int64_t b_stride,
                      int64_t d_len, float* out, int64_t out_stride) {
  vf acc[NB][NVEC];
  for (int64_t b = 0; b < NB; ++b)
    for (int64_t v = 0; v < NVEC; ++v) acc[b][v] = vf{};
  for (int64_t d = 0; d < d_len; ++d) {
    if constexpr (W < 16 && NB < NVEC) {
      // 16 registers: NB broadcasts, then one vector at a time, so that 3 x 4 accumulators fit
      // (a decode's 3 rows x 4 registers of keys: 12 FMA chains where 3 x 2 ran 6; AVX2 decode
      // attention ~5% faster on a Zen 4). AVX-512 keeps the order below: this one ran ~4% slower.
      vf x[NB];
      for (int64_t b = 0; b < NB; ++b) x[b] = splat(to_float(bcast[b][d * b_stride]));
      for (int64_t v = 0; v < NVEC; ++v) {
        vf vec = load(vecs[v] + d * vec_stride);
        asm("" : "+v"(vec));  // one load per vector (see below)
        for (int64_t b = 0; b < NB; ++b) acc[b][v] = fmadd(x[b], vec, acc[b][v]);
      }
    } else {
      vf vec[NVEC];
      for (int64_t v = 0; v < NVEC; ++v) {
        vec[v] = load(vecs[v] + d * vec_stride);
        asm("" : "+v"(vec[v]));  // one load per vector: GCC would fold it into every FMA (NB loads)
      }
      for (int64_t b = 0; b < NB; ++b) {
        const vf x = splat(to_float(bcast[b][d * b_stride]));
        for (int64_t v = 0; v < NVEC; ++v) acc[b][v] = fmadd(x, vec[v], acc[b][v]);
      }
    }
  }
  for (int64_t b = 0; b < NB; ++b)
    for (int64_t v = 0; v < NVEC; ++v) store(out + b * out_stride + v * W, acc[b][v]);
}

// The same for the last n (1 <= n <= N) broadcast rows, as one block.
template <int64_t NVEC, int64_t N, typename VecT, typename BcastT>
inline void dot_tail(const VecT* const* vecs, int64_t vec_stride, const BcastT* const* bcast, int64_t b_stride,
                     int64_t d_len, float* out, int64_t out_stride, int64_t n) {
  if constexpr (N > 1) {
    if (n < N) return dot_tail<NVEC, N - 1>(vecs, vec_stride, bcast, b_stride, d_len, out, out_stride, n);
  }
  dot_block<NVEC, N>(vecs, vec_stride, bcast, b_stride, d_len, out, out_stride);
}

// Keys across lanes: scores[r * BK + j] = Q'[r] . K[j] for every row and NVEC registers of keys
// (kt[v]: register v's keys for d = 0, the next d kt_stride floats on), KR rows a block.
template <int64_t NVEC, typename KeyT>
inline void key_scores(const KeyT* const* kt, int64_t kt_stride, const float* const* q_rows, int64_t rows,
                       int64_t d_len, float* scores) {
  int64_t r = 0;
  for (; r + KR <= rows; r += KR) dot_block<NVEC, KR>(kt, kt_stride, q_rows + r, 1, d_len, scores + r * BK, BK);
  if (r < rows) dot_tail<NVEC, KR>(kt, kt_stride, q_rows + r, 1, d_len, scores + r * BK, BK, rows - r);
}

// Everything one tile's key walk needs. Per row: the state of the current partition (acc,
// row_max, row_sum) and of the partitions folded so far (folded_*).
template <typename CacheT>
struct TileState {
  const AttentionShape& s;
  const AttentionTile& t;
  const CacheT* k_cache;
  const CacheT* v_cache;
  int64_t d_len, group, rows, rows_pad;
  int64_t first, last;  // key positions visited
  float* acc;           // [rows, D] unnormalized output over the partition's keys so far
  float* row_max;       // [rows_pad]
  float* row_sum;       // [rows_pad]
  float* alpha;         // [rows_pad] this key tile's rescale factors
  float* folded_acc;    // [rows, D] unnormalized output over the folded partitions
  float* folded_max;    // [rows_pad]
  float* folded_sum;    // [rows_pad]
  float* q_buf;         // scaled; keys across lanes: Q [rows, D]; rows across lanes: Q^T [D, rows_pad]
  float* probs;         // keys across lanes: [rows, BK]; rows across lanes: [BK, rows_pad]
  float* kt;            // keys across lanes, a block size W does not divide: K^T [D, KB] of one score block;
                        // rows across lanes, a 16- or 8-bit cache: the key tile's V rows widened [BK, D]
  int32_t* lo;          // [rows_pad] first key position each row sees
  int32_t* hi;          // [rows_pad] last
  const CacheT* zeros;  // rows across lanes: [D, block_size], the K of a key no row sees
  int64_t page_head;    // kv_prefetch_page_head()
};

// Where the keys of a key tile and of the next one (j < 2 BK: position kb + j) sit in this
// head's panels of the caches (see fused_kernels.h), in elements from a cache's start: k[j] is
// the key's K element 0 (element d is d * block_size further on), v[j] its V row. The D elements
// at v[j] in the K cache are the key's "chunk" of its K panel: a block's chunks tile its K panel
// as its V rows tile its V panel (what the prefetches walk).
struct KeyOffsets {
  int64_t k[2 * BK];
  int64_t v[2 * BK];
};

// k_rows[j] (unless k_rows is null) / v_rows[j] for j in [begin, end): key kb + j's K element 0
// / V row (zeros / null where no row sees it, and so never read).
template <typename CacheT>
void tile_rows(const TileState<CacheT>& st, int64_t kb, const KeyOffsets& off, const CacheT** k_rows,
               const CacheT** v_rows, int64_t begin = 0, int64_t end = BK) {
  for (int64_t j = begin; j < end; ++j) {
    const int64_t p = kb + j;
    const bool seen = p >= st.first && p <= st.last;
    if (k_rows != nullptr) k_rows[j] = seen ? st.k_cache + off.k[j] : st.zeros;
    v_rows[j] = seen ? st.v_cache + off.v[j] : nullptr;
  }
}

// The K and V chunks of keys kb + j, j in [begin, end), into the cache ahead of use.
// Into L2 (prefetcht1, as the GEMM's weights: see qgemm_kernels.h), not L1, whose few miss
// buffers held a core's reads from memory to ~9 GB/s: on a Zen 4 EPYC (2 threads) a decode over
// 1,000 keys, K/V from memory, took 59-66 us a layer against 91, over 4,000 keys 244-276 against
// 366-371, 32 decodes over 128 keys 274-289 against 347-352; one or two key tiles further
// ahead, no faster. Where st.page_head is set, only the chunks that start within that many bytes
// of a 4 KB page (the K chunk's offset; V's has the same): see kv_prefetch_page_head.
// NOTE: always_inline: as a function of its own GCC finds it pure (prefetches write nothing)
// and, as it returns nothing, deletes every call.
template <typename CacheT>
__attribute__((always_inline)) inline void prefetch_keys(const TileState<CacheT>& st, int64_t kb,
                                                         const KeyOffsets& off, int64_t begin, int64_t end) {
  for (int64_t j = begin; j < end && kb + j <= st.last; ++j)
    if (kb + j >= st.first &&
        (st.page_head == 0 || (reinterpret_cast<uintptr_t>(st.k_cache + off.v[j]) & 4095) < static_cast<uintptr_t>(st.page_head)))
      for (int64_t x = 0; x < st.d_len; x += kLineElems<CacheT>) {
        __builtin_prefetch(st.k_cache + off.v[j] + x, 0, 2);
        __builtin_prefetch(st.v_cache + off.v[j] + x, 0, 2);
      }
}

// O[r] *= alpha[r] for the rows whose running max rose this key tile (alpha 0: the row saw no
// key before, its O is all +0 and stays so).
template <typename CacheT>
void rescale_rows(const TileState<CacheT>& st) {
  for (int64_t r = 0; r < st.rows; ++r) {
    const float a = st.alpha[r];
    if (a == 1.0f || a == 0.0f) continue;
    float* o = st.acc + r * st.d_len;
    for (int64_t x = 0; x < st.d_len; x += W) store(o + x, load(o + x) * splat(a));
  }
}

// Rows across lanes (prompt chunks): scores as K . Q^T (K elements broadcast from the cache,
// Q transposed once per tile), the online softmax W rows at a time.
template <typename CacheT>
void attend_rows(const TileState<CacheT>& st, int64_t kb, const KeyOffsets& off, const CacheT** v_rows) {
  const int64_t d_len = st.d_len, rows_pad = st.rows_pad, k_stride = st.s.block_size;
  const CacheT* k_rows[BK];
  tile_rows(st, kb, off, k_rows, v_rows);
  // this tile's keys past the first few (prefetched by the tile before) and the next's first:
  // prompt chunks are compute-bound, a short distance suffices
  prefetch_keys(st, kb, off, kPrefetchKeys, BK + kPrefetchKeys);
  // probs[j][r] = K[j] . Q'[r]: KJ keys x RV registers of rows a block (KJ1 keys when the tile
  // is one register of rows; the last 1 to 3 registers of rows as one block)
  if (rows_pad == W) {
    const float* q_t[1] = {st.q_buf};
    for (int64_t j = 0; j < BK; j += KJ1)
      dot_block<1, KJ1>(q_t, W, k_rows + j, k_stride, d_len, st.probs + j * W, W);
  } else {
    // row blocks outer, keys inner: a block's Q^T (RV registers x D) and the tile's K panels stay
    // in L1 while every key passes over them, where keys outer streamed all of Q^T from L2 once
    // per KJ keys (AVX2: 128 B of Q^T per 8 FMAs, the L2's bandwidth)
    int64_t rb = 0;
    const float* q_t[4];  // (RV, or the remainder's 1 to 3)
    for (; rb + RV * W <= rows_pad; rb += RV * W) {
      for (int64_t v = 0; v < RV; ++v) q_t[v] = st.q_buf + rb + v * W;
      for (int64_t j = 0; j < BK; j += KJ)
        dot_block<RV, KJ>(q_t, rows_pad, k_rows + j, k_stride, d_len, st.probs + j * rows_pad + rb, rows_pad);
    }
    static_assert(RV <= 4, "the remainder below is 1 to 3 registers of rows");
    for (int64_t v = 0; v < RV; ++v) q_t[v] = st.q_buf + rb + v * W;
    for (int64_t j = 0; j < BK; j += KJ) {
      float* scores = st.probs + j * rows_pad + rb;
      switch ((rows_pad - rb) / W) {
        case 3: dot_block<3, KJ>(q_t, rows_pad, k_rows + j, k_stride, d_len, scores, rows_pad); break;
        case 2: dot_block<2, KJ>(q_t, rows_pad, k_rows + j, k_stride, d_len, scores, rows_pad); break;
        case 1: dot_block<1, KJ>(q_t, rows_pad, k_rows + j, k_stride, d_len, scores, rows_pad); break;
        default: break;
      }
    }
  }
  for (int64_t rb = 0; rb < rows_pad; rb += W) {  // W rows at a time; masked scores never count
    vi lo, hi;
    __builtin_memcpy(&lo, st.lo + rb, sizeof lo);
    __builtin_memcpy(&hi, st.hi + rb, sizeof hi);
    vf tile_max = splat(kNegInf);
    for (int64_t j = 0; j < BK; ++j) {
      const vi k_pos = vi{} + static_cast<int32_t>(kb + j);
      const vf sc = (k_pos >= lo) & (k_pos <= hi) ? load(st.probs + j * rows_pad + rb) : splat(kNegInf);
      tile_max = sc > tile_max ? sc : tile_max;
    }
    const vf old_max = load(st.row_max + rb);
    const vf new_max = old_max > tile_max ? old_max : tile_max;
    const vi seen = new_max > splat(kNegInf);  // rows that have seen a key (else p stays 0)
    // rescale of the earlier sum and output; 0 where there was none yet (their values are 0)
    const vf alpha = old_max > splat(kNegInf) ? vexp(old_max - new_max) : vf{};
    vf part[W];  // part[l]: keys l, l + W, l + 2W, ... summed in that order (see hsum_tree)
    for (int64_t jv = 0; jv < NV; ++jv) {
#pragma GCC unroll 16
      for (int64_t l = 0; l < W; ++l) {  // unrolled: part[] stays in registers
        const int64_t j = jv * W + l;
        const vi k_pos = vi{} + static_cast<int32_t>(kb + j);
        float* pj = st.probs + j * rows_pad + rb;
        const vf pv = (k_pos >= lo) & (k_pos <= hi) & seen ? vexp(load(pj) - new_max) : vf{};
        store(pj, pv);
        part[l] = jv == 0 ? pv : part[l] + pv;
      }
    }
#pragma GCC unroll 8
    for (int64_t h = W / 2; h >= 1; h /= 2)
#pragma GCC unroll 8
      for (int64_t l = 0; l < h; ++l) part[l] = part[l] + part[l + h];
    store(st.row_sum + rb, fmadd(load(st.row_sum + rb), alpha, part[0]));
    store(st.row_max + rb, new_max);
    store(st.alpha + rb, alpha);
  }
  rescale_rows(st);
  if constexpr (sizeof(CacheT) == sizeof(float)) {  // fp32: read in place
    accumulate_pv<kPvSlice>(st.probs, 1, rows_pad, v_rows, 0, BK, st.acc, d_len, st.rows);
  } else {
    // Every block of rows reads each V row: widened once here (exactly: the same values), where
    // widening it per block took an E4M3 cache's prompt (3,000 tokens) ~15% longer than fp32's.
    const float* v32[BK];
    for (int64_t j = 0; j < BK; ++j) {
      v32[j] = nullptr;
      if (v_rows[j] == nullptr) continue;
      float* dst = st.kt + j * d_len;
      for (int64_t x = 0; x < d_len; x += W) store(dst + x, load(v_rows[j] + x));
      v32[j] = dst;
    }
    accumulate_pv<kPvSlice>(st.probs, 1, rows_pad, v32, 0, BK, st.acc, d_len, st.rows);
  }
}

// Keys across lanes (decodes): each row's scores as NV registers of keys, read in place from the
// cache's K panels (K^T per block and head: a register of W keys of one block, for one d, is W
// consecutive floats; a block size W does not divide goes through a K^T copy), its softmax row
// by row. Only the keys some row sees are worked on: the tile's [j0, j1) (a decode's last key
// tile is mostly past its last key); the others' scores are masked, their P never read.
template <typename CacheT>
void attend_keys(const TileState<CacheT>& st, int64_t kb, const KeyOffsets& off, const CacheT** v_rows) {
  const int64_t d_len = st.d_len, rows = st.rows, block_size = st.s.block_size;
  const int64_t j0 = st.first > kb ? st.first - kb : 0;
  const int64_t j1 = st.last + 1 - kb < BK ? st.last + 1 - kb : BK;
  const bool in_place = block_size % W == 0;  // a register's keys then lie in one block, in order
  const CacheT* k_rows[BK];  // read only by the K^T copy
  tile_rows(st, kb, off, in_place ? nullptr : k_rows, v_rows, j0, j1);
  // A decode reads each K/V element once: memory bounds it, and prefetches spread over the work
  // keep it busy. The next key tile's K and V chunks go ahead beside P . V (those beside keys
  // outside [j0, j1) here). Null: there is no next tile.
  const CacheT* next_chunks[2 * BK];
  const CacheT* const* next = kb + BK <= st.last ? next_chunks : nullptr;
  if (next != nullptr) {
    for (int64_t j = 0; j < BK; ++j) {
      const int64_t p = kb + BK + j;
      const bool seen = p >= st.first && p <= st.last;
      next_chunks[2 * j] = seen ? st.k_cache + off.v[BK + j] : nullptr;
      next_chunks[2 * j + 1] = seen ? st.v_cache + off.v[BK + j] : nullptr;
    }
    prefetch_keys(st, kb, off, BK, BK + j0);
    prefetch_keys(st, kb, off, BK + j1, 2 * BK);
  }
  const float* q_rows[kKeyLaneRows];
  for (int64_t r = 0; r < rows; ++r) q_rows[r] = st.q_buf + r * d_len;
  for (int64_t jb0 = j0 / KB * KB; jb0 < j1; jb0 += KB) {
    // the block's registers of keys some row sees: [c0, c1) (the scores of the others are
    // masked to -inf below whatever they hold, so they need not be computed: the bits are the same)
    const int64_t c0 = jb0 < j0 ? (j0 - jb0) / W : 0;
    const int64_t c1 = jb0 + KB > j1 ? (j1 - jb0 + W - 1) / W : KV;
    // probs[r][j] = Q'[r] . K[j]: KR rows x the block's seen registers of keys
    float* scores = st.probs + jb0 + c0 * W;
    static_assert(KV == 2 || KV == 4, "a score block is up to two or four registers of keys");
    auto score_block = [&](const auto* const* kt, int64_t kt_stride) {
      switch (c1 - c0) {
        case 1: key_scores<1>(kt, kt_stride, q_rows, rows, d_len, scores); break;
        case 2: key_scores<2>(kt, kt_stride, q_rows, rows, d_len, scores); break;
        case 3: if constexpr (KV == 4) key_scores<3>(kt, kt_stride, q_rows, rows, d_len, scores); break;
        default: if constexpr (KV == 4) key_scores<4>(kt, kt_stride, q_rows, rows, d_len, scores); break;
      }
    };
    if (in_place) {
      // register c: keys jb0 + c W .. + W - 1 from the first one's element d on (the first is
      // at or before a seen key, so its offset is set; unseen keys' lanes are masked)
      const CacheT* kt[KV];
      for (int64_t c = c0; c < c1; ++c) kt[c - c0] = st.k_cache + off.k[jb0 + c * W];
      score_block(kt, block_size);
    } else {
      for (int64_t jb = jb0 + c0 * W; jb < jb0 + c1 * W; ++jb) {
        const bool seen = jb >= j0 && jb < j1;
        for (int64_t d = 0; d < d_len; ++d)
          st.kt[d * KB + jb - jb0] = seen ? to_float(k_rows[jb][d * block_size]) : 0.0f;
      }
      const float* kt[KV];
      for (int64_t c = c0; c < c1; ++c) kt[c - c0] = st.kt + c * W;
      score_block(kt, KB);
    }
  }
  // mask by position, then the online-softmax update, over the registers of seen keys
  // [v0, v1): the others' p are 0 and would add nothing (x + 0 is x: p is never -0)
  const int64_t v0 = j0 / W, v1 = (j1 + W - 1) / W;
  for (int64_t r = 0; r < rows; ++r) {
    float* pr = st.probs + r * BK;
    const vi lo = vi{} + st.lo[r], hi = vi{} + st.hi[r];
    vf sc[NV];
    vi valid[NV];
    vf vmax = splat(kNegInf);
    for (int64_t v = v0; v < v1; ++v) {
      const vi k_pos = iota() + static_cast<int32_t>(kb + v * W);
      valid[v] = (k_pos >= lo) & (k_pos <= hi);
      sc[v] = valid[v] ? load(pr + v * W) : splat(kNegInf);
      vmax = sc[v] > vmax ? sc[v] : vmax;
    }
    const float tile_max = hmax(vmax);
    const float old_max = st.row_max[r];
    const float new_max = old_max > tile_max ? old_max : tile_max;
    const vi seen = vi{} + (new_max > kNegInf ? -1 : 0);
    const float alpha = old_max > kNegInf ? vexp(splat(old_max - new_max))[0] : 0.0f;
    vf sum{};
    for (int64_t v = v0; v < v1; ++v) {
      const vf pv = valid[v] & seen ? vexp(sc[v] - splat(new_max)) : vf{};
      store(pr + v * W, pv);
      sum = v == v0 ? pv : sum + pv;
    }
    st.row_sum[r] = fmadd(splat(st.row_sum[r]), splat(alpha), splat(hsum_tree(sum)))[0];
    st.row_max[r] = new_max;
    st.alpha[r] = alpha;
  }
  rescale_rows(st);
  accumulate_pv<kPvSliceKeys>(st.probs, BK, 1, v_rows, j0, j1, st.acc, d_len, rows, next);
}

// Folds a row's state over one partition (max m, sum s, unnormalized output o [D]) into its
// state over the partitions before it (*fm, *fs, fo [D]); partitions come in position order. A
// partition where the row saw no key (m = -inf) changes nothing; the first one it saw is copied.
// NOTE: noinline: the one compiled copy serves both the tile walk and attention_combine.
__attribute__((noinline)) void fold_row(float m, float s, const float* o, float* fm, float* fs, float* fo,
                                        int64_t d_len) {
  if (m == kNegInf) return;
  if (*fm == kNegInf) {
    *fm = m;
    *fs = s;
    for (int64_t x = 0; x < d_len; x += W) store(fo + x, load(o + x));
    return;
  }
  const float new_max = *fm > m ? *fm : m;
  const vf a = vexp(splat(*fm - new_max)), b = vexp(splat(m - new_max));  // every lane alike
  *fs = fmadd(splat(*fs), a, splat(s) * b)[0];
  for (int64_t x = 0; x < d_len; x += W) store(fo + x, fmadd(load(fo + x), a, load(o + x) * b));
  *fm = new_max;
}

// dst[D] = o / sum, an all-zero element's sign canonicalized to +0 (x + 0 is x, and +0 for -0):
// a masked key's fma(0, v, -0) could otherwise turn one into the other (see fused_kernels.h).
inline void write_row(const float* o, float sum, float* dst, int64_t d_len) {
  const vf denom = splat(sum);  // > 0: every query sees at least its own key
  for (int64_t x = 0; x < d_len; x += W) store(dst + x, load(o + x) / denom + splat(0.0f));
}

// The tile's partition state folded, then reset for the next partition.
template <typename CacheT>
void end_partition(const TileState<CacheT>& st) {
  for (int64_t r = 0; r < st.rows; ++r)
    fold_row(st.row_max[r], st.row_sum[r], st.acc + r * st.d_len, st.folded_max + r, st.folded_sum + r,
             st.folded_acc + r * st.d_len, st.d_len);
  for (int64_t r = 0; r < state_rows(st.rows); ++r) {
    st.row_max[r] = kNegInf;
    st.row_sum[r] = 0.0f;
  }
  for (int64_t x = 0; x < st.rows * st.d_len; ++x) st.acc[x] = 0.0f;
}

// Flash-attention style: the tile's rows (query token i, head g -> row i * G + g) walk the
// sequence's keys in tiles of BK absolute positions, an online softmax in fp32 per partition of
// PK absolute positions, the partitions folded in order (see the invariant in fused_kernels.h).
template <typename CacheT>
void attention_tile(const AttentionShape& s, const AttentionTile& t, const float* q, int64_t ldq,
                    const CacheT* k_cache, const CacheT* v_cache, float* out, int64_t ldo, float* scratch) {
  const int64_t d_len = s.head_dim, group = s.group, rows = t.num_q * group, rows_pad = padded_rows(rows);
  const bool keys_across = rows <= kKeyLaneRows;
  // keys visited: the tile's key range within the rows' causal (and windowed) reach
  const int64_t reach_last = t.pos + t.num_q - 1;
  const int64_t reach_first = s.window > 0 && t.pos - s.window + 1 > 0 ? t.pos - s.window + 1 : 0;
  const int64_t last = t.key_end - 1 < reach_last ? t.key_end - 1 : reach_last;
  const int64_t first = t.key_begin > reach_first ? t.key_begin : reach_first;
  float* acc = scratch;
  float* folded_acc = acc + rows_pad * d_len;
  float* row_max = folded_acc + rows_pad * d_len;
  float* row_sum = row_max + rows_pad;
  float* alpha = row_sum + rows_pad;
  float* folded_max = alpha + rows_pad;
  float* folded_sum = folded_max + rows_pad;
  float* q_buf = folded_sum + rows_pad;
  float* probs = q_buf + rows_pad * d_len;
  float* kt = probs + BK * rows_pad;
  int32_t* lo = reinterpret_cast<int32_t*>(kt + d_len * BK);
  int32_t* hi = lo + rows_pad;
  CacheT* zeros = reinterpret_cast<CacheT*>(hi + rows_pad);
  const TileState<CacheT> st{s,          t,          k_cache, v_cache, d_len, group, rows, rows_pad, first,
                     last,       acc,        row_max, row_sum, alpha, folded_acc, folded_max,
                     folded_sum, q_buf,      probs,   kt,      lo,    hi,    zeros, kv_prefetch_page_head()};

  for (int64_t i = 0; i < t.num_q; ++i) {
    const float* src = q + (t.token + i) * ldq + t.kv_head * group * d_len;  // [G, D]
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      if (keys_across)  // a row of its own: whole registers (d_len % W == 0)
        for (int64_t d = 0; d < d_len; d += W) store(q_buf + r * d_len + d, load(src + g * d_len + d) * splat(s.scale));
      else
        for (int64_t d = 0; d < d_len; ++d) q_buf[d * rows_pad + r] = src[g * d_len + d] * s.scale;
    }
  }
  for (int64_t r = 0, q_pos_all = t.pos, g = 0; r < state_rows(rows); ++r) {  // q_pos_all = pos + r / group
    row_max[r] = folded_max[r] = kNegInf;
    row_sum[r] = folded_sum[r] = 0.0f;
    // the row sees [lo, hi] of the visited keys: its causal (and windowed) reach, narrowed to
    // the tile's key range (only a partition tile's is narrower); padded rows: an empty range
    const int64_t q_pos = r < rows ? (q_pos_all < last ? q_pos_all : last) : -1;
    lo[r] = static_cast<int32_t>(s.window > 0 && q_pos_all - s.window + 1 > first ? q_pos_all - s.window + 1 : first);
    hi[r] = static_cast<int32_t>(q_pos);
    if (!keys_across && r >= rows)
      for (int64_t d = 0; d < d_len; ++d) q_buf[d * rows_pad + r] = 0.0f;
    if (++g == group) g = 0, ++q_pos_all;
  }
  for (int64_t x = 0; x < rows * d_len; ++x) acc[x] = 0.0f;
  if (!keys_across)
    for (int64_t x = 0; x < d_len * s.block_size; ++x) zeros[x] = CacheT{};

  const CacheT* v_rows[BK];
  // Where this key tile's keys and the next's sit (the next's carried over to the following
  // tile): one block-table read per block, no division per key.
  KeyOffsets off;
  const int64_t kb_first = first / BK * BK, panel_floats = d_len * s.block_size;
  int64_t num_known = 0;  // off[0 : num_known) are this tile's already
  for (int64_t kb = kb_first; kb <= last; kb += BK) {
    if (kb % PK == 0 && kb != kb_first) end_partition(st);
    const int64_t end = last + 1 - kb < 2 * BK ? last + 1 - kb : 2 * BK;
    if (num_known > 0) {
      __builtin_memcpy(off.k, off.k + BK, static_cast<size_t>(num_known) * sizeof(int64_t));
      __builtin_memcpy(off.v, off.v + BK, static_cast<size_t>(num_known) * sizeof(int64_t));
    }
    if (num_known < end) {
      int64_t block = (kb + num_known) / s.block_size, in_block = (kb + num_known) % s.block_size;
      int64_t panel = (t.block_table[block] * s.num_kv_heads + t.kv_head) * panel_floats;
      for (int64_t j = num_known; j < end; ++j) {
        off.k[j] = panel + in_block;
        off.v[j] = panel + in_block * d_len;
        if (++in_block == s.block_size && j + 1 < end) {
          in_block = 0;
          panel = (t.block_table[++block] * s.num_kv_heads + t.kv_head) * panel_floats;
        }
      }
    }
    num_known = end - BK;  // the next tile's, if any (this tile's keys reach past kb + BK then)
    if (kb == kb_first)  // the first keys (keys across lanes: the whole first key tile)
      prefetch_keys(st, kb, off, 0, keys_across ? BK : kPrefetchKeys);
    if (keys_across)
      attend_keys(st, kb, off, v_rows);
    else
      attend_rows(st, kb, off, v_rows);
  }

  if (t.partial != nullptr) {  // one partition of a cut tile: attention_combine folds it
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = t.partial + r * (d_len + 2);  // [D + 2]
      for (int64_t x = 0; x < d_len; x += W) store(dst + x, load(acc + r * d_len + x));
      dst[d_len] = row_max[r];
      dst[d_len + 1] = row_sum[r];
    }
    return;
  }
  end_partition(st);
  for (int64_t i = 0; i < t.num_q; ++i) {
    float* dst = out + (t.token + i) * ldo + t.kv_head * group * d_len;  // [G, D]
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      write_row(folded_acc + r * d_len, folded_sum[r], dst + g * d_len, d_len);
    }
  }
}

// The table's entry: the caches' element type from the shape.
void attention_tile_any(const AttentionShape& s, const AttentionTile& t, const float* q, int64_t ldq,
                        const void* k_cache, const void* v_cache, float* out, int64_t ldo, float* scratch) {
  switch (s.kv_element) {
    case KvElement::kBf16:
      return attention_tile(s, t, q, ldq, static_cast<const Bf16*>(k_cache), static_cast<const Bf16*>(v_cache), out,
                            ldo, scratch);
    case KvElement::kF16:
      return attention_tile(s, t, q, ldq, static_cast<const F16*>(k_cache), static_cast<const F16*>(v_cache), out,
                            ldo, scratch);
    case KvElement::kF8E4M3:
      return attention_tile(s, t, q, ldq, static_cast<const F8E4M3*>(k_cache), static_cast<const F8E4M3*>(v_cache),
                            out, ldo, scratch);
    case KvElement::kF8E5M2:
      return attention_tile(s, t, q, ldq, static_cast<const F8E5M2*>(k_cache), static_cast<const F8E5M2*>(v_cache),
                            out, ldo, scratch);
    case KvElement::kF32: break;
  }
  attention_tile(s, t, q, ldq, static_cast<const float*>(k_cache), static_cast<const float*>(v_cache), out, ldo,
                 scratch);
}

void attention_combine(const AttentionShape& s, const AttentionTile& t, const float* partials, int64_t num_parts,
                       float* out, int64_t ldo) {
  const int64_t d_len = s.head_dim, group = s.group, rows = t.num_q * group;
  for (int64_t r = 0; r < rows; ++r) {
    // the output row holds the folded output until it is normalized in place
    float* dst = out + (t.token + r / group) * ldo + (t.kv_head * group + r % group) * d_len;  // [D]
    float folded_max = kNegInf, folded_sum = 0.0f;
    for (int64_t p = 0; p < num_parts; ++p) {
      const float* part = partials + (p * rows + r) * (d_len + 2);  // [D + 2]
      fold_row(part[d_len], part[d_len + 1], part, &folded_max, &folded_sum, dst, d_len);
    }
    write_row(dst, folded_sum, dst, d_len);
  }
}

// Each lane keeps the first index of its own maximum (strict >); the row's answer is the smallest
// index among the lanes holding the overall maximum, then the tail. NaN never wins a > test, so
// a row with one is settled by a scan for its first NaN (torch.argmax: NaN is the maximum).
int64_t argmax(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float best_value = x[0];
  bool has_nan = false;
  if (n >= W) {
    vf lane_max = load(x);
    vi lane_index = iota(), index = iota(), nan = lane_max != lane_max;
    for (i = W; i + W <= n; i += W) {
      const vf v = load(x + i);
      index += W;
      const vi greater = v > lane_max;
      lane_max = greater ? v : lane_max;
      lane_index = greater ? index : lane_index;
      nan |= v != v;
    }
    best_value = hmax(lane_max);
    best = n;
    for (int64_t l = 0; l < W; ++l) {
      has_nan |= nan[l] != 0;
      if (lane_max[l] == best_value && lane_index[l] < best) best = lane_index[l];
    }
  } else {
    i = 1;
    has_nan = x[0] != x[0];
  }
  for (; i < n; ++i) {
    has_nan |= x[i] != x[i];
    if (x[i] > best_value) best_value = x[i], best = i;
  }
  if (has_nan)
    for (i = 0; i < n; ++i)
      if (x[i] != x[i]) return i;
  return best;
}

// The roofline's compute ceiling: `rounds` x kFmaChains independent vector FMAs, enough chains to
// keep every FMA port busy through its latency (2 ports x 4-5 cycles on the CPUs we run on), no
// memory traffic. The return value depends on every chain, so none is optimized away.
constexpr int kFmaChains = 12;
float fma_loop(int64_t rounds) {
  vf acc[kFmaChains];
  _Pragma("GCC unroll 16") for (int j = 0; j < kFmaChains; ++j) acc[j] = splat(1.0f + 0.001f * static_cast<float>(j));
  const vf a = splat(0.999999f), b = splat(1e-7f);
  for (int64_t r = 0; r < rounds; ++r) {
    _Pragma("GCC unroll 16") for (int j = 0; j < kFmaChains; ++j) acc[j] = fmadd(acc[j], a, b);
  }
  vf sum = acc[0];
  for (int j = 1; j < kFmaChains; ++j) sum += acc[j];
  return hsum(sum);
}

const DecoderKernels kTable = {BF_NAME,  W,        attention_scratch, attention_tile_any, attention_combine,
                               rms_norm, silu_mul, argmax,            fma_loop,       kFmaChains};

}  // namespace

const DecoderKernels& BF_TABLE() { return kTable; }

}  // namespace backfill
