// The decoder's non-GEMM kernels over a SIMD width W (GCC vector extensions), included once by
// each ISA translation unit after it defines BF_LANES, BF_TABLE (the table's function name),
// BF_NAME and `vf fmadd(vf a, vf b, vf c)` (a * b + c, fused where the ISA has FMA).
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
inline vf splat(float s) { return vf{} + s; }
inline float hsum(vf v) {  // fixed left-to-right order
  float s = v[0];
  for (int64_t i = 1; i < W; ++i) s += v[i];
  return s;
}
inline float hmax(vf v) {
  float m = v[0];
  for (int64_t i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
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
    store(y + i, g / (splat(1.0f) + vexp(-g)) * load(up + i));
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    y[i] = g / (1.0f + vexp(splat(-g))[0]) * up[i];
  }
}

int64_t attention_scratch(const AttentionShape& s) {
  const int64_t rows = kAttentionTileQueries * s.group, d = s.head_dim;
  // Q [rows, D] | K^T [D, BK] | P [rows, BK] | O [rows, D] | running max, sum [rows] each
  return rows * d + d * BK + rows * BK + rows * d + 2 * rows;
}

// scores[r][0:BK] = Q[r] . K^T tile, NR rows at a time so each K^T load feeds NR FMAs.
template <int64_t NR>
inline void score_rows(const float* q, int64_t d_len, const float* kt, float* scores) {
  vf acc[NR][NV];
  for (int64_t r = 0; r < NR; ++r)
    for (int64_t v = 0; v < NV; ++v) acc[r][v] = vf{};
  for (int64_t d = 0; d < d_len; ++d) {
    vf k[NV];
    for (int64_t v = 0; v < NV; ++v) k[v] = load(kt + d * BK + v * W);
    for (int64_t r = 0; r < NR; ++r) {
      const vf qs = splat(q[r * d_len + d]);
      for (int64_t v = 0; v < NV; ++v) acc[r][v] = fmadd(qs, k[v], acc[r][v]);
    }
  }
  for (int64_t r = 0; r < NR; ++r)
    for (int64_t v = 0; v < NV; ++v) store(scores + r * BK + v * W, acc[r][v]);
}

// o[0:D] += sum_j p[j] * v_rows[j][0:D] for two rows at once (each V load feeds two FMAs).
inline void accumulate_pv2(const float* p0, const float* p1, const float* const* v_rows, int64_t d_len, float* o0,
                           float* o1) {
  for (int64_t j = 0; j < BK; ++j) {
    if (p0[j] == 0.0f && p1[j] == 0.0f) continue;  // masked or outside the range (v_rows[j] may be null)
    const vf a = splat(p0[j]), b = splat(p1[j]);
    const float* vj = v_rows[j];
    for (int64_t x = 0; x < d_len; x += W) {
      const vf v = load(vj + x);
      store(o0 + x, fmadd(a, v, load(o0 + x)));
      store(o1 + x, fmadd(b, v, load(o1 + x)));
    }
  }
}
inline void accumulate_pv1(const float* p0, const float* const* v_rows, int64_t d_len, float* o0) {
  for (int64_t j = 0; j < BK; ++j) {
    if (p0[j] == 0.0f) continue;
    const vf a = splat(p0[j]);
    const float* vj = v_rows[j];
    for (int64_t x = 0; x < d_len; x += W) store(o0 + x, fmadd(a, load(vj + x), load(o0 + x)));
  }
}

// Flash-attention style: the tile's rows (query token i, head g -> row i * G + g) walk the
// sequence's keys in tiles of BK absolute positions, with an online softmax in fp32. Every
// sum runs in a fixed order that depends only on this sequence and head (batch invariance).
void attention_tile(const AttentionShape& s, const AttentionTile& t, const float* q, int64_t ldq,
                    const float* k_cache, const float* v_cache, float* out, int64_t ldo, float* scratch) {
  const int64_t d_len = s.head_dim, group = s.group, rows = t.num_q * group;
  float* qt = scratch;                     // [rows, D] scaled queries
  float* kt = qt + rows * d_len;           // [D, BK] keys of the current tile, transposed
  float* probs = kt + d_len * BK;          // [rows, BK] scores, then probabilities
  float* acc = probs + rows * BK;          // [rows, D] unnormalized output
  float* row_max = acc + rows * d_len;     // [rows]
  float* row_sum = row_max + rows;         // [rows]
  const vf scale = splat(s.scale);
  for (int64_t i = 0; i < t.num_q; ++i) {
    const float* src = q + (t.token + i) * ldq + t.kv_head * group * d_len;  // [G, D]
    for (int64_t x = 0; x < group * d_len; x += W) store(qt + i * group * d_len + x, load(src + x) * scale);
  }
  for (int64_t x = 0; x < rows * d_len; ++x) acc[x] = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    row_max[r] = kNegInf;
    row_sum[r] = 0.0f;
  }

  const int64_t kv_stride = s.num_kv_heads * d_len;  // floats from one token to the next
  const int64_t last = t.pos + t.num_q - 1;
  const int64_t first = s.window > 0 && t.pos - s.window + 1 > 0 ? t.pos - s.window + 1 : 0;
  const float* v_rows[BK];
  for (int64_t kb = first / BK * BK; kb <= last; kb += BK) {
    for (int64_t j = 0; j < BK; ++j) {
      const int64_t p = kb + j;
      if (p < first || p > last) {  // never read: no row sees it (its score is masked below)
        v_rows[j] = nullptr;
        for (int64_t d = 0; d < d_len; ++d) kt[d * BK + j] = 0.0f;
        continue;
      }
      const int64_t slot = t.block_table[p / s.block_size] * s.block_size + p % s.block_size;
      const int64_t offset = slot * kv_stride + t.kv_head * d_len;
      const float* k_row = k_cache + offset;
      v_rows[j] = v_cache + offset;
      for (int64_t d = 0; d < d_len; ++d) kt[d * BK + j] = k_row[d];
    }
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) score_rows<4>(qt + r * d_len, d_len, kt, probs + r * BK);
    for (; r < rows; ++r) score_rows<1>(qt + r * d_len, d_len, kt, probs + r * BK);

    // Mask by position, then the online-softmax update of each row.
    for (r = 0; r < rows; ++r) {
      const int64_t q_pos = t.pos + r / group;
      const int64_t lo = s.window > 0 ? q_pos - s.window + 1 : 0;
      float* pr = probs + r * BK;
      vf sc[NV];
      vi valid[NV];
      float tile_max = kNegInf;
      for (int64_t v = 0; v < NV; ++v) {
        const vi k_pos = iota() + static_cast<int32_t>(kb + v * W);
        valid[v] = (k_pos >= vi{} + static_cast<int32_t>(lo)) & (k_pos <= vi{} + static_cast<int32_t>(q_pos));
        sc[v] = valid[v] ? load(pr + v * W) : splat(kNegInf);
        const float m = hmax(sc[v]);
        tile_max = m > tile_max ? m : tile_max;
      }
      if (tile_max == kNegInf) {  // this row sees no key of the tile
        for (int64_t j = 0; j < BK; ++j) pr[j] = 0.0f;
        continue;
      }
      const float old_max = row_max[r];
      const float new_max = old_max > tile_max ? old_max : tile_max;
      float tile_sum = 0.0f;
      for (int64_t v = 0; v < NV; ++v) {
        const vf pv = valid[v] ? vexp(sc[v] - splat(new_max)) : vf{};
        store(pr + v * W, pv);
        tile_sum += hsum(pv);
      }
      if (old_max != new_max && old_max != kNegInf) {
        const float alpha = vexp(splat(old_max - new_max))[0];
        row_sum[r] *= alpha;
        float* o = acc + r * d_len;
        for (int64_t x = 0; x < d_len; x += W) store(o + x, load(o + x) * splat(alpha));
      }
      row_sum[r] += tile_sum;
      row_max[r] = new_max;
    }
    for (r = 0; r + 2 <= rows; r += 2)
      accumulate_pv2(probs + r * BK, probs + (r + 1) * BK, v_rows, d_len, acc + r * d_len, acc + (r + 1) * d_len);
    if (r < rows) accumulate_pv1(probs + r * BK, v_rows, d_len, acc + r * d_len);
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
