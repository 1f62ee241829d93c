// The packed layout's conversions (GGUF blocks <-> tile blocks, see packed.h) and the portable
// scalar packed GEMM: the numbers every SIMD kernel reproduces, in plain C++.
//
// A block is split into its integer codes (one per element: 4, 6 or 8 bits) and its other fields
// (fp16 scales, 6-bit scale bytes, fp32/fp16 values), each moved as-is: repack is a permutation
// of the file's bits (Q4_K's 6-bit scales and Q6_K's codes given 8 bits each, the bits added
// always 0), so unpack_row(repack(raw)) == raw and every kernel dequantizes exactly the file's
// numbers.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "isa.h"
#include "repack.h"

namespace backfill {
namespace {

// A non-code field of a raw block: `count` values of `size` bytes at raw_off; value j of tile
// row r sits at packed_off + (16 j + r) * size in the tile block.
struct Field {
  int raw_off;
  int count;
  int size;
  int packed_off;
};

// The fields of each type (at most 3), in raw-block order; {0, 0, 0, 0} ends the list.
void fields_of(QType t, Field* f) {
  std::memset(f, 0, 4 * sizeof(Field));
  switch (t) {
    case QType::F32: f[0] = {0, 1, 4, 0}; break;
    case QType::F16: f[0] = {0, 1, 2, 0}; break;
    case QType::Q4_0: f[0] = {0, 1, 2, 0}; break;
    case QType::Q4_1: f[0] = {0, 1, 2, 0}; f[1] = {2, 1, 2, tile_off::kQ4_1M}; break;
    case QType::Q8_0: f[0] = {0, 1, 2, 0}; break;
    case QType::Q4_K:  // (its 12 scale bytes: q4_k_scales_to_tile)
      f[0] = {0, 1, 2, 0};
      f[1] = {2, 1, 2, tile_off::kQ4_KDmin};
      break;
    case QType::Q6_K:
      f[0] = {208, 1, 2, 0};
      f[1] = {192, 16, 1, tile_off::kQ6_KScales};
      break;
  }
}

// A Q4_K block's 12 scale bytes (raw, at block offset 4) <-> tile row r's 16 unpacked scales
// (packed.h): sc_j and m_j as ggml's get_scale_min_k4 takes them out, and back (all 96 bits
// carry a value, so the round trip is exact).
void q4_k_scales_to_tile(const uint8_t* q, uint8_t* tb, int r) {
  uint8_t* out = tb + tile_off::kQ4_KScales + r;
  for (int j = 0; j < 4; ++j) {
    out[16 * j] = q[j] & 63;
    out[16 * (8 + j)] = q[j + 4] & 63;
    out[16 * (4 + j)] = static_cast<uint8_t>((q[j + 8] & 0xF) | (q[j] >> 6) << 4);
    out[16 * (12 + j)] = static_cast<uint8_t>((q[j + 8] >> 4) | (q[j + 4] >> 6) << 4);
  }
}
void q4_k_scales_from_tile(const uint8_t* tb, int r, uint8_t* q) {
  const uint8_t* in = tb + tile_off::kQ4_KScales + r;
  for (int j = 0; j < 4; ++j) {
    const uint8_t sc_lo = in[16 * j], m_lo = in[16 * (8 + j)], sc_hi = in[16 * (4 + j)], m_hi = in[16 * (12 + j)];
    q[j] = static_cast<uint8_t>(sc_lo | (sc_hi >> 4) << 6);
    q[j + 4] = static_cast<uint8_t>(m_lo | (m_hi >> 4) << 6);
    q[j + 8] = static_cast<uint8_t>((sc_hi & 0xF) | (m_hi & 0xF) << 4);
  }
}

// Nibble pairs of ggml's 32-element Q4 layout: q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4.
void q4_codes(const uint8_t* qs, uint8_t* q) {
  for (int j = 0; j < 16; ++j) {
    q[j] = qs[j] & 0xF;
    q[j + 16] = qs[j] >> 4;
  }
}
void q4_put(const uint8_t* q, uint8_t* qs) {
  for (int j = 0; j < 16; ++j) qs[j] = static_cast<uint8_t>(q[j] | q[j + 16] << 4);
}

// Integer codes q[0 .. block_elems) of one raw block (none for F32 / F16).
void raw_codes(QType t, const uint8_t* b, uint8_t* q) {
  switch (t) {
    case QType::F32: case QType::F16: break;
    case QType::Q4_0: q4_codes(b + 2, q); break;
    case QType::Q4_1: q4_codes(b + 4, q); break;
    case QType::Q8_0: std::memcpy(q, b + 2, QK); break;
    case QType::Q4_K:  // 64-element chunks: q[64c + l] = qs[32c + l] & 15, q[64c + 32 + l] = qs[32c + l] >> 4
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
          q[64 * c + l] = b[16 + 32 * c + l] & 0xF;
          q[64 * c + 32 + l] = b[16 + 32 * c + l] >> 4;
        }
      break;
    case QType::Q6_K:  // ggml's dequantize_row_q6_K index map, 6-bit codes 0..63
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = b + 64 * h;
        const uint8_t* qh = b + 128 + 32 * h;
        uint8_t* o = q + 128 * h;
        for (int l = 0; l < 32; ++l) {
          o[l] = static_cast<uint8_t>((ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4);
          o[l + 32] = static_cast<uint8_t>((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4);
          o[l + 64] = static_cast<uint8_t>((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
          o[l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4);
        }
      }
      break;
  }
}

void raw_put_codes(QType t, const uint8_t* q, uint8_t* b) {
  switch (t) {
    case QType::F32: case QType::F16: break;
    case QType::Q4_0: q4_put(q, b + 2); break;
    case QType::Q4_1: q4_put(q, b + 4); break;
    case QType::Q8_0: std::memcpy(b + 2, q, QK); break;
    case QType::Q4_K:
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) b[16 + 32 * c + l] = static_cast<uint8_t>(q[64 * c + l] | q[64 * c + 32 + l] << 4);
      break;
    case QType::Q6_K:
      for (int h = 0; h < 2; ++h) {
        uint8_t* ql = b + 64 * h;
        uint8_t* qh = b + 128 + 32 * h;
        const uint8_t* o = q + 128 * h;
        for (int l = 0; l < 32; ++l) {
          ql[l] = static_cast<uint8_t>((o[l] & 0xF) | (o[l + 64] & 0xF) << 4);
          ql[l + 32] = static_cast<uint8_t>((o[l + 32] & 0xF) | (o[l + 96] & 0xF) << 4);
          qh[l] = static_cast<uint8_t>((o[l] >> 4) | (o[l + 32] >> 4) << 2 | (o[l + 64] >> 4) << 4 | (o[l + 96] >> 4) << 6);
        }
      }
      break;
  }
}

// Where the codes of tile row r go in a tile block (packed.h): nibble words, byte words (Q8_0),
// six-bit words (Q6_K).
void tile_put_codes(QType t, const uint8_t* q, uint8_t* tb, int r) {
  // nibble words: row r's uint32 of word w, byte j = columns 8w + 2j (low) and 8w + 2j + 1
  auto put_words = [&](int64_t off, int n) {
    for (int k = 0; k < n; k += 2)
      tb[off + 64 * (k / 8) + 4 * r + (k % 8) / 2] = static_cast<uint8_t>((q[k] & 0xF) | (q[k + 1] & 0xF) << 4);
  };
  switch (t) {
    case QType::F32: case QType::F16: break;
    case QType::Q4_0: put_words(tile_off::kQ4_0Qs, QK); break;
    case QType::Q4_1: put_words(tile_off::kQ4_1Qs, QK); break;
    case QType::Q8_0:
      for (int k = 0; k < QK; ++k) tb[tile_off::kQ8_0Qs + byte_word_offset(k, r)] = static_cast<uint8_t>(q[k] + kByteCodeOffset);
      break;
    case QType::Q4_K: put_words(tile_off::kQ4_KQs, QK_K); break;
    case QType::Q6_K:  // six-bit word pairs: words A, B of row r, 64 bytes apart
      for (int p = 0; p < QK_K / 8; ++p) {
        uint32_t words[2] = {0, 0};
        for (int c = 0; c < 8; ++c) words[six_bit_word(c)] |= (q[8 * p + c] & 0x3Fu) << six_bit_shift(c);
        for (int w = 0; w < 2; ++w) std::memcpy(tb + tile_off::kQ6_KQs + 128 * p + 64 * w + 4 * r, &words[w], 4);
      }
      break;
  }
}

void tile_codes(QType t, const uint8_t* tb, int r, uint8_t* q) {
  auto get_words = [&](int64_t off, int n) {
    for (int k = 0; k < n; k += 2) {
      const uint8_t v = tb[off + 64 * (k / 8) + 4 * r + (k % 8) / 2];
      q[k] = v & 0xF;
      q[k + 1] = v >> 4;
    }
  };
  switch (t) {
    case QType::F32: case QType::F16: break;
    case QType::Q4_0: get_words(tile_off::kQ4_0Qs, QK); break;
    case QType::Q4_1: get_words(tile_off::kQ4_1Qs, QK); break;
    case QType::Q8_0:
      for (int k = 0; k < QK; ++k) q[k] = static_cast<uint8_t>(tb[tile_off::kQ8_0Qs + byte_word_offset(k, r)] - kByteCodeOffset);
      break;
    case QType::Q4_K: get_words(tile_off::kQ4_KQs, QK_K); break;
    case QType::Q6_K:
      for (int p = 0; p < QK_K / 8; ++p) {
        uint32_t words[2];
        for (int w = 0; w < 2; ++w) std::memcpy(&words[w], tb + tile_off::kQ6_KQs + 128 * p + 64 * w + 4 * r, 4);
        for (int c = 0; c < 8; ++c) q[8 * p + c] = static_cast<uint8_t>((words[six_bit_word(c)] >> six_bit_shift(c)) & 0x3F);
      }
      break;
  }
}

}  // namespace

void repack_tiles(const QMatrix& raw, uint8_t* out, int64_t tile_begin, int64_t tile_end) {
  const QType t = raw.type;
  const int64_t nb = raw.cols / block_elems(t), bb = block_bytes(t), tbb = tile_block_bytes(t);
  Field fields[4];
  fields_of(t, fields);
  uint8_t codes[QK_K];  // one block's integer codes
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    uint8_t* dst = out + tile * nb * tbb;
    std::memset(dst, 0, static_cast<size_t>(nb * tbb));  // padding rows: all zero
    for (int r = 0; r < kTileRows && tile * kTileRows + r < raw.rows; ++r) {
      const uint8_t* src = raw.data + (tile * kTileRows + r) * raw.row_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* rb = src + b * bb;
        uint8_t* tb = dst + b * tbb;
        for (const Field* f = fields; f->count > 0; ++f)
          for (int j = 0; j < f->count; ++j)
            std::memcpy(tb + f->packed_off + (16 * j + r) * f->size, rb + f->raw_off + j * f->size, f->size);
        if (t == QType::Q4_K) q4_k_scales_to_tile(rb + 4, tb, r);
        raw_codes(t, rb, codes);
        tile_put_codes(t, codes, tb, r);
      }
    }
  }
}

void unpack_row(const PackedMatrix& w, int64_t row, uint8_t* raw_row) {
  const QType t = w.type;
  const int64_t nb = w.cols / block_elems(t), bb = block_bytes(t), tbb = tile_block_bytes(t);
  const int r = static_cast<int>(row % kTileRows);
  const uint8_t* src = w.data + row / kTileRows * nb * tbb;
  Field fields[4];
  fields_of(t, fields);
  uint8_t codes[QK_K];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tb = src + b * tbb;
    uint8_t* rb = raw_row + b * bb;
    for (const Field* f = fields; f->count > 0; ++f)
      for (int j = 0; j < f->count; ++j)
        std::memcpy(rb + f->raw_off + j * f->size, tb + f->packed_off + (16 * j + r) * f->size, f->size);
    if (t == QType::Q4_K) q4_k_scales_from_tile(tb, r, rb + 4);
    tile_codes(t, tb, r, codes);
    raw_put_codes(t, codes, rb);
  }
}

// The scalar packed GEMM, the fast kernels' numbers (TileJob) one output at a time: F32 / F16 rows
// as dequantize_row_ref gives them, one fmaf chain over k ascending from +0; the block types
// factored (factored_row_ref: codes, block scales and offsets), the chain over blocks of
// y = fma(S, d, y), y = fma(X, m, y) (fmaf is correctly rounded, as the SIMD FMAs are).
void packed_gemm_scalar(const TileJob& job) {
  const int64_t K = job.cols, qb = factored_block_elems(job.type), nb = qb > 0 ? K / qb : 0;
  const bool words = scaled_codes(job.type);
  const bool sub = job.subnormal_codes && words && subnormals_read();  // (packed.h)
  const PackedMatrix w{job.w, job.type, job.rows, K};
  const QMatrix one_row{nullptr, job.type, 1, K, K / block_elems(job.type) * block_bytes(job.type)};
  std::vector<uint8_t> raw(static_cast<size_t>(one_row.row_bytes));  // [row_bytes] GGUF row
  std::vector<float> wrow(static_cast<size_t>(K));                   // [K] its fp32 weights, or codes
  std::vector<float> d(static_cast<size_t>(nb)), m(static_cast<size_t>(nb));
  std::vector<float> xs(static_cast<size_t>(job.m * nb));  // [m, nb] block sums of x
  for (int64_t i = 0; i < job.m; ++i)
    for (int64_t b = 0; b < nb; ++b)
      xs[static_cast<size_t>(i * nb + b)] = block_sum(job.x + i * job.ldx + b * qb, qb);
  const int64_t n_end = std::min(job.tile_end * kTileRows, job.rows);
  for (int64_t n = job.tile_begin * kTileRows; n < n_end; ++n) {
    unpack_row(w, n, raw.data());
    QMatrix q = one_row;
    q.data = raw.data();
    if (qb > 0) factored_row_ref(q, 0, wrow.data(), d.data(), m.data());
    else dequantize_row_ref(q, 0, wrow.data());
    for (int64_t i = 0; i < job.m; ++i) {
      const float* xi = job.x + i * job.ldx;
      float acc = 0.0f;
      if (qb == 0) {
        for (int64_t k = 0; k < K; ++k) acc = std::fma(xi[k], wrow[static_cast<size_t>(k)], acc);
      } else {
        for (int64_t b = 0; b < nb; ++b) {
          float s = 0.0f;
          for (int64_t k = b * qb; k < b * qb + qb; ++k) {  // scaled codes: the SIMD kernels' product
            const float q = wrow[static_cast<size_t>(k)];
            if (sub) {
              s = std::fma(xi[k] * subnormal_x_scale(job.type, k), subnormal_code(job.type, q, k), s);
            } else {
              const float sx = words ? code_x_scale(job.type, k) : 1.0f, sq = words ? code_scale(job.type, k) : 1.0f;
              s = std::fma(xi[k] * sx, q * sq, s);
            }
          }
          acc = std::fma(s, sub ? d[static_cast<size_t>(b)] * kSubnormalDScale : d[static_cast<size_t>(b)], acc);
          acc = std::fma(xs[static_cast<size_t>(i * nb + b)], m[static_cast<size_t>(b)], acc);
        }
      }
      if (job.bias != nullptr) acc = acc + job.bias[n];
      float& out = job.y[i * job.ldy + n];
      out = job.accumulate ? out + acc : acc;
    }
  }
}

}  // namespace backfill
