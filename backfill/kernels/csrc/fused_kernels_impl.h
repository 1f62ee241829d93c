// The decoder's non-GEMM kernels over a SIMD width W (GCC vector extensions), included once by
// each ISA translation unit after it defines BF_LANES, BF_TABLE (the table's function name),
// BF_NAME, the vector types vf / vi (W floats / int32s) and three ISA primitives:
// `vf fmadd(vf a, vf b, vf c)` (a * b + c, fused where the ISA has FMA), `vf rcp_estimate(vf d)`
// (1 / d to 12 bits or better) and `vf splat(float s)` (a broadcast; NOTE: `vf{} + s` costs an add, since
// 0 + -0 is +0, and a lane-by-lane loop compiles to one masked broadcast per lane).
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
inline float hsum(vf v) {  // fixed left-to-right order
  float s = v[0];
  for (int64_t i = 1; i < W; ++i) s += v[i];
  return s;
}
// Lane permutations i -> i ^ h for h = W/2, W/4, ..., 1 (constants: built at compile time).
struct SwapMasks {
  int32_t lanes[5][W];
  constexpr SwapMasks() : lanes{} {
    for (int64_t k = 0, h = W / 2; h >= 1; ++k, h /= 2)
      for (int64_t i = 0; i < W; ++i) lanes[k][i] = static_cast<int32_t>(i ^ h);
  }
};
constexpr SwapMasks kSwapMasks{};

inline float hsum_tree(vf v) {  // pairwise: log2(W) shuffles and adds
  for (int64_t k = 0, h = W / 2; h >= 1; ++k, h /= 2) {
    vi swap;
    __builtin_memcpy(&swap, kSwapMasks.lanes[k], sizeof swap);
    v += __builtin_shuffle(v, swap);
  }
  return v[0];
}
inline float hmax(vf v) {
  float m = v[0];
  for (int64_t i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
// 1 / d to ~2 ulp: the ISA's estimate and one Newton step, a fraction of a division's cost
inline vf reciprocal(vf d) {
  const vf r = rcp_estimate(d);
  return r * (splat(2.0f) - d * r);
}
inline vi iota() {
  vi v;
  for (int64_t i = 0; i < W; ++i) v[i] = static_cast<int32_t>(i);
  return v;
}

// exp(x), Cephes' expf polynomial (~1 ulp over the clamped range). x is clamped to [-86, 88]
// so that 2^n stays a normal float: callers that need exact zeros (masked scores) select them.
inline vf vexp(vf x) {
  x = x < splat(-86.0f) ? splat(-86.0f) : x;
  x = x > splat(88.0f) ? splat(88.0f) : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf t = x * splat(1.44269504088896341f) + magic;
  const vf n = t - magic;  // round(x / ln 2)
  vf r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
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

// Accumulator registers a register block may hold (AVX-512 has 32 vector registers, others 16).
constexpr int64_t kAccRegs = W >= 16 ? 16 : 8;
// Tiles of at most this many rows (query tokens x G) compute scores key by key.
constexpr int64_t kDirectRows = 8;
// How far ahead (in keys) K/V rows are prefetched.
constexpr int64_t kPrefetchKeys = 16;
// Score blocks of the row-vectorized path: KJ keys x RV registers of rows.
constexpr int64_t KJ = W >= 16 ? 4 : 2;
constexpr int64_t RV = 4;

inline int64_t padded_rows(int64_t rows) { return (rows + W - 1) / W * W; }

int64_t attention_scratch(const AttentionShape& s) {
  const int64_t rows = padded_rows(attention_tile_queries(s.group) * s.group), d = s.head_dim;
  // O [rows, D] | max, sum, alpha [rows] | Q [rows, D] | P [BK, rows] | lo, hi [rows] int32 | zeros [D]
  return rows * d + 3 * rows + rows * d + BK * rows + 2 * rows + d;
}

// o[r][x0 : x0 + DV*W] += sum_j p[r, j] * v_rows[j][x0 : x0 + DV*W] for NR rows (p[r, j] at
// p + r * p_row + j * p_key): the rows' slices of O stay in registers over the key tile, each
// V load feeds NR FMAs.
template <int64_t DV, int64_t NR>
inline void pv_block(const float* p, int64_t p_row, int64_t p_key, const float* const* v_rows, int64_t x0, float* o,
                     int64_t d_len) {
  vf acc[NR][DV];
  for (int64_t r = 0; r < NR; ++r)
    for (int64_t x = 0; x < DV; ++x) acc[r][x] = load(o + r * d_len + x0 + x * W);
  for (int64_t j = 0; j < BK; ++j) {
    if (v_rows[j] == nullptr) continue;  // outside the tile's key range: p is 0 for every row
    vf v[DV];
    for (int64_t x = 0; x < DV; ++x) v[x] = load(v_rows[j] + x0 + x * W);
    for (int64_t r = 0; r < NR; ++r) {
      const vf pr = splat(p[r * p_row + j * p_key]);
      for (int64_t x = 0; x < DV; ++x) acc[r][x] = fmadd(pr, v[x], acc[r][x]);
    }
  }
  for (int64_t r = 0; r < NR; ++r)
    for (int64_t x = 0; x < DV; ++x) store(o + r * d_len + x0 + x * W, acc[r][x]);
}

template <int64_t DV>
inline void pv_rows(const float* p, int64_t p_row, int64_t p_key, const float* const* v_rows, int64_t x0, float* o,
                    int64_t d_len, int64_t rows) {
  constexpr int64_t NR = kAccRegs / DV > 0 ? kAccRegs / DV : 1;
  int64_t r = 0;
  for (; r + NR <= rows; r += NR) pv_block<DV, NR>(p + r * p_row, p_row, p_key, v_rows, x0, o + r * d_len, d_len);
  for (; r < rows; ++r) pv_block<DV, 1>(p + r * p_row, p_row, p_key, v_rows, x0, o + r * d_len, d_len);
}

// O[rows, D] += P . V tile, D cut into slices of at most 8 registers.
inline void accumulate_pv(const float* p, int64_t p_row, int64_t p_key, const float* const* v_rows, float* o,
                          int64_t d_len, int64_t rows) {
  for (int64_t x0 = 0; x0 < d_len; x0 += 8 * W) {
    switch ((d_len - x0) / W >= 8 ? 8 : (d_len - x0) / W) {
      case 1: pv_rows<1>(p, p_row, p_key, v_rows, x0, o, d_len, rows); break;
      case 2: pv_rows<2>(p, p_row, p_key, v_rows, x0, o, d_len, rows); break;
      case 3: pv_rows<3>(p, p_row, p_key, v_rows, x0, o, d_len, rows); break;
      case 4: pv_rows<4>(p, p_row, p_key, v_rows, x0, o, d_len, rows); break;
      case 5: pv_rows<5>(p, p_row, p_key, v_rows, x0, o, d_len, rows); break;
      case 6: pv_rows<6>(p, p_row, p_key, v_rows, x0, o, d_len, rows); break;
      case 7: pv_rows<7>(p, p_row, p_key, v_rows, x0, o, d_len, rows); break;
      default: pv_rows<8>(p, p_row, p_key, v_rows, x0, o, d_len, rows); break;
    }
  }
}

// scores[j][rb : rb + NRV*W] = K[j] . Q^T for KJ keys x NRV registers of rows.
template <int64_t NRV>
inline void score_block(const float* qt, int64_t rows_pad, const float* const* k_rows, int64_t d_len, float* scores) {
  vf acc[KJ][NRV];
  for (int64_t j = 0; j < KJ; ++j)
    for (int64_t v = 0; v < NRV; ++v) acc[j][v] = vf{};
  for (int64_t d = 0; d < d_len; ++d) {
    vf qv[NRV];
    for (int64_t v = 0; v < NRV; ++v) qv[v] = load(qt + d * rows_pad + v * W);
    for (int64_t j = 0; j < KJ; ++j) {
      const vf k = splat(k_rows[j][d]);
      for (int64_t v = 0; v < NRV; ++v) acc[j][v] = fmadd(k, qv[v], acc[j][v]);
    }
  }
  for (int64_t j = 0; j < KJ; ++j)
    for (int64_t v = 0; v < NRV; ++v) store(scores + j * rows_pad + v * W, acc[j][v]);
}

// Everything one tile's key walk needs.
struct TileState {
  const AttentionShape& s;
  const AttentionTile& t;
  const float* k_cache;
  const float* v_cache;
  int64_t d_len, group, rows, rows_pad;
  int64_t first, last;  // key positions visited
  float* acc;           // [rows_pad, D] unnormalized output
  float* row_max;       // [rows_pad]
  float* row_sum;       // [rows_pad]
  float* alpha;         // [rows_pad] this key tile's rescale factors
  float* q_buf;         // direct: Q [rows, D]; row-vectorized: Q^T [D, rows_pad] (both scaled)
  float* probs;         // direct: [rows, BK]; row-vectorized: [BK, rows_pad]
  int32_t* lo;          // [rows_pad] first key position each row sees (row-vectorized path)
  int32_t* hi;          // [rows_pad] last
  const float* zeros;   // [D]
};

// Few rows (decodes): each key's dot products in place, the online softmax row by row.
void attend_direct(const TileState& st, int64_t kb, const int64_t* offsets, const float** v_rows) {
  const int64_t d_len = st.d_len, rows = st.rows;
  for (int64_t j = 0; j < BK; ++j) {
    const int64_t p = kb + j;
    if (p < st.first || p > st.last) {  // never read: no row sees it (its score is masked below)
      v_rows[j] = nullptr;
      continue;
    }
    const float* k_row = st.k_cache + offsets[j];
    v_rows[j] = st.v_cache + offsets[j];
    if (p + kPrefetchKeys <= st.last) {  // K and V rows a few keys ahead: hide memory latency
      const int64_t ahead = offsets[j + kPrefetchKeys];
      for (int64_t x = 0; x < d_len; x += 16) {
        __builtin_prefetch(st.k_cache + ahead + x);
        __builtin_prefetch(st.v_cache + ahead + x);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = st.q_buf + r * d_len;
      vf dot{};
      for (int64_t x = 0; x < d_len; x += W) dot = fmadd(load(qr + x), load(k_row + x), dot);
      st.probs[r * BK + j] = hsum_tree(dot);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // mask by position, then the online-softmax update
    const int64_t q_pos_all = st.t.pos + r / st.group;  // the row sees [lo, q_pos] of the visited keys
    const int64_t q_pos = q_pos_all < st.last ? q_pos_all : st.last;
    const int64_t lo =
        st.s.window > 0 && q_pos_all - st.s.window + 1 > st.first ? q_pos_all - st.s.window + 1 : st.first;
    float* pr = st.probs + r * BK;
    vf sc[NV];
    vi valid[NV];
    vf vmax = splat(kNegInf);
    for (int64_t v = 0; v < NV; ++v) {
      const vi k_pos = iota() + static_cast<int32_t>(kb + v * W);
      valid[v] = (k_pos >= vi{} + static_cast<int32_t>(lo)) & (k_pos <= vi{} + static_cast<int32_t>(q_pos));
      sc[v] = valid[v] ? load(pr + v * W) : splat(kNegInf);
      vmax = sc[v] > vmax ? sc[v] : vmax;
    }
    const float tile_max = hmax(vmax);
    if (tile_max == kNegInf) {  // this row sees no key of the tile
      for (int64_t j = 0; j < BK; ++j) pr[j] = 0.0f;
      continue;
    }
    const float old_max = st.row_max[r];
    const float new_max = old_max > tile_max ? old_max : tile_max;
    vf vsum{};
    for (int64_t v = 0; v < NV; ++v) {
      const vf pv = valid[v] ? vexp(sc[v] - splat(new_max)) : vf{};
      store(pr + v * W, pv);
      vsum += pv;
    }
    if (old_max != new_max && old_max != kNegInf) {
      const float alpha = vexp(splat(old_max - new_max))[0];
      st.row_sum[r] *= alpha;
      float* o = st.acc + r * d_len;
      for (int64_t x = 0; x < d_len; x += W) store(o + x, load(o + x) * splat(alpha));
    }
    st.row_sum[r] += hsum(vsum);
    st.row_max[r] = new_max;
  }
  accumulate_pv(st.probs, BK, 1, v_rows, st.acc, d_len, rows);
}

// Many rows (prompt chunks): scores as K . Q^T with the rows across SIMD lanes (K rows are read
// in place, Q was transposed once per tile), the online softmax W rows at a time.
void attend_row_vectorized(const TileState& st, int64_t kb, const int64_t* offsets, const float** v_rows) {
  const int64_t d_len = st.d_len, rows_pad = st.rows_pad;
  const float* k_rows[BK];
  for (int64_t j = 0; j < BK; ++j) {
    const int64_t p = kb + j;
    if (p < st.first || p > st.last) {
      k_rows[j] = st.zeros;
      v_rows[j] = nullptr;
      continue;
    }
    k_rows[j] = st.k_cache + offsets[j];
    v_rows[j] = st.v_cache + offsets[j];
    for (int64_t x = 0; x < d_len; x += 16) {  // this tile's V and the next keys' K, ahead of use
      if (p + kPrefetchKeys <= st.last) __builtin_prefetch(st.k_cache + offsets[j + kPrefetchKeys] + x);
      __builtin_prefetch(v_rows[j] + x);
    }
  }
  for (int64_t j = 0; j < BK; j += KJ) {
    int64_t rb = 0;
    for (; rb + RV * W <= rows_pad; rb += RV * W)
      score_block<RV>(st.q_buf + rb, rows_pad, k_rows + j, d_len, st.probs + j * rows_pad + rb);
    for (; rb < rows_pad; rb += W)
      score_block<1>(st.q_buf + rb, rows_pad, k_rows + j, d_len, st.probs + j * rows_pad + rb);
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
    vf tile_sum{};
    for (int64_t j = 0; j < BK; ++j) {
      const vi k_pos = vi{} + static_cast<int32_t>(kb + j);
      float* pj = st.probs + j * rows_pad + rb;
      const vf pv = (k_pos >= lo) & (k_pos <= hi) & seen ? vexp(load(pj) - new_max) : vf{};
      store(pj, pv);
      tile_sum += pv;
    }
    store(st.row_sum + rb, load(st.row_sum + rb) * alpha + tile_sum);
    store(st.row_max + rb, new_max);
    store(st.alpha + rb, alpha);
  }
  for (int64_t r = 0; r < st.rows; ++r) {
    const float a = st.alpha[r];
    if (a == 1.0f) continue;
    float* o = st.acc + r * d_len;
    for (int64_t x = 0; x < d_len; x += W) store(o + x, load(o + x) * splat(a));
  }
  accumulate_pv(st.probs, 1, rows_pad, v_rows, st.acc, d_len, st.rows);
}

// Flash-attention style: the tile's rows (query token i, head g -> row i * G + g) walk the
// sequence's keys in tiles of BK absolute positions, with an online softmax in fp32. Every
// sum runs in a fixed order that depends only on this sequence and head (batch invariance).
void attention_tile(const AttentionShape& s, const AttentionTile& t, const float* q, int64_t ldq,
                    const float* k_cache, const float* v_cache, float* out, int64_t ldo, float* scratch) {
  const int64_t d_len = s.head_dim, group = s.group, rows = t.num_q * group, rows_pad = padded_rows(rows);
  const bool direct = rows <= kDirectRows;
  // keys visited: the tile's key range within the rows' causal (and windowed) reach
  const int64_t reach_last = t.pos + t.num_q - 1;
  const int64_t reach_first = s.window > 0 && t.pos - s.window + 1 > 0 ? t.pos - s.window + 1 : 0;
  const int64_t last = t.key_end - 1 < reach_last ? t.key_end - 1 : reach_last;
  const int64_t first = t.key_begin > reach_first ? t.key_begin : reach_first;
  float* acc = scratch;
  float* row_max = acc + rows_pad * d_len;
  float* row_sum = row_max + rows_pad;
  float* alpha = row_sum + rows_pad;
  float* q_buf = alpha + rows_pad;
  float* probs = q_buf + rows_pad * d_len;
  int32_t* lo = reinterpret_cast<int32_t*>(probs + BK * rows_pad);
  int32_t* hi = lo + rows_pad;
  float* zeros = reinterpret_cast<float*>(hi + rows_pad);
  const TileState st{s, t, k_cache, v_cache, d_len, group, rows, rows_pad, first, last,
                     acc, row_max, row_sum, alpha, q_buf, probs, lo, hi, zeros};

  const vf scale = splat(s.scale);
  for (int64_t i = 0; i < t.num_q; ++i) {
    const float* src = q + (t.token + i) * ldq + t.kv_head * group * d_len;  // [G, D]
    if (direct) {
      for (int64_t x = 0; x < group * d_len; x += W) store(q_buf + i * group * d_len + x, load(src + x) * scale);
    } else {
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < d_len; ++d) q_buf[d * rows_pad + i * group + g] = src[g * d_len + d] * s.scale;
    }
  }
  for (int64_t r = 0; r < rows_pad; ++r) {
    row_max[r] = kNegInf;
    row_sum[r] = 0.0f;
    const int64_t q_pos_all = t.pos + r / group;  // padded rows: empty range, never counted
    const int64_t q_pos = r < rows ? (q_pos_all < last ? q_pos_all : last) : -1;
    lo[r] = static_cast<int32_t>(s.window > 0 && q_pos_all - s.window + 1 > first ? q_pos_all - s.window + 1 : first);
    hi[r] = static_cast<int32_t>(q_pos);
    if (!direct && r >= rows)
      for (int64_t d = 0; d < d_len; ++d) q_buf[d * rows_pad + r] = 0.0f;
  }
  for (int64_t x = 0; x < rows_pad * d_len; ++x) acc[x] = 0.0f;
  for (int64_t d = 0; d < d_len; ++d) zeros[d] = 0.0f;

  const int64_t kv_stride = s.num_kv_heads * d_len;  // floats from one token to the next
  const float* v_rows[BK];
  // offsets[j]: floats from the cache start to this head's row of position kb + j, for the
  // tile and kPrefetchKeys beyond (walked block by block: no division per key)
  int64_t offsets[BK + kPrefetchKeys];
  for (int64_t p = first; p < first + kPrefetchKeys && p <= last; ++p) {  // the first rows, ahead of use
    const int64_t offset = (t.block_table[p / s.block_size] * s.block_size + p % s.block_size) * kv_stride +
                           t.kv_head * d_len;
    for (int64_t x = 0; x < d_len; x += 16) {
      __builtin_prefetch(k_cache + offset + x);
      __builtin_prefetch(v_cache + offset + x);
    }
  }
  for (int64_t kb = first / BK * BK; kb <= last; kb += BK) {
    int64_t block = kb / s.block_size, in_block = kb % s.block_size;
    const int64_t end = last + 1 - kb < BK + kPrefetchKeys ? last + 1 - kb : BK + kPrefetchKeys;
    for (int64_t j = 0; j < end; ++j) {
      offsets[j] = (t.block_table[block] * s.block_size + in_block) * kv_stride + t.kv_head * d_len;
      if (++in_block == s.block_size) {
        in_block = 0;
        ++block;
      }
    }
    if (direct)
      attend_direct(st, kb, offsets, v_rows);
    else
      attend_row_vectorized(st, kb, offsets, v_rows);
  }

  if (t.partial != nullptr) {  // a key partition: leave the combination to the caller
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = t.partial + r * (d_len + 2);  // [D + 2]
      for (int64_t x = 0; x < d_len; x += W) store(dst + x, load(acc + r * d_len + x));
      dst[d_len] = row_max[r];
      dst[d_len + 1] = row_sum[r];
    }
    return;
  }
  for (int64_t i = 0; i < t.num_q; ++i) {
    float* dst = out + (t.token + i) * ldo + t.kv_head * group * d_len;  // [G, D]
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      const vf denom = splat(row_sum[r]);  // > 0: every query sees at least its own key
      for (int64_t x = 0; x < d_len; x += W) store(dst + g * d_len + x, load(acc + r * d_len + x) / denom);
    }
  }
}

const DecoderKernels kTable = {BF_NAME, W, attention_scratch, attention_tile, rms_norm, silu_mul};

}  // namespace

const DecoderKernels& BF_TABLE() { return kTable; }

}  // namespace backfill
