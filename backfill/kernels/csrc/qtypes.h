// Quantized weight formats, exactly as GGUF stores them (ggml's block layouts), and the
// matrix descriptor every kernel takes. No torch headers here: this file is included by the
// ISA-specific translation units, which must not instantiate torch's inline functions.
#pragma once

#include <cstddef>
#include <cstdint>

namespace backfill {

// ggml type ids (gguf.constants.GGMLQuantizationType), so Python passes the file's own id.
enum class QType : int32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q8_0 = 8,
  Q4_K = 12,
  Q6_K = 14,
};

constexpr int64_t QK = 32;     // elements per block of the 32-element formats
constexpr int64_t QK_K = 256;  // elements per super-block of the k-quants

// All blocks are packed (no padding), as in ggml; fp16 fields are raw IEEE half bits.
struct BlockQ4_0 {  // w = d * (q - 8); q[i] low nibble of qs[i], q[i + 16] high nibble
  uint16_t d;
  uint8_t qs[QK / 2];
};
struct BlockQ4_1 {  // w = d * q + m; nibble order as Q4_0
  uint16_t d;
  uint16_t m;
  uint8_t qs[QK / 2];
};
struct BlockQ8_0 {  // w = d * q
  uint16_t d;
  int8_t qs[QK];
};
struct BlockQ4_K {  // 8 sub-blocks of 32: w = d * sc[j] * q - dmin * m[j], 6-bit sc/m packed in scales
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qs[QK_K / 2];
};
struct BlockQ6_K {  // 16 sub-blocks of 16: w = d * sc[j] * (q - 32), q = 4 low bits | 2 high bits << 4
  uint8_t ql[QK_K / 2];
  uint8_t qh[QK_K / 4];
  int8_t scales[QK_K / 16];
  uint16_t d;
};
static_assert(sizeof(BlockQ4_0) == 18, "ggml block_q4_0 layout");
static_assert(sizeof(BlockQ4_1) == 20, "ggml block_q4_1 layout");
static_assert(sizeof(BlockQ8_0) == 34, "ggml block_q8_0 layout");
static_assert(sizeof(BlockQ4_K) == 144, "ggml block_q4_K layout");
static_assert(sizeof(BlockQ6_K) == 210, "ggml block_q6_K layout");

// Elements per block and bytes per block of each type.
inline int64_t block_elems(QType t) {
  switch (t) {
    case QType::F32: case QType::F16: return 1;
    case QType::Q4_0: case QType::Q4_1: case QType::Q8_0: return QK;
    case QType::Q4_K: case QType::Q6_K: return QK_K;
  }
  return 0;
}
inline int64_t block_bytes(QType t) {
  switch (t) {
    case QType::F32: return 4;
    case QType::F16: return 2;
    case QType::Q4_0: return sizeof(BlockQ4_0);
    case QType::Q4_1: return sizeof(BlockQ4_1);
    case QType::Q8_0: return sizeof(BlockQ8_0);
    case QType::Q4_K: return sizeof(BlockQ4_K);
    case QType::Q6_K: return sizeof(BlockQ6_K);
  }
  return 0;
}

// A weight matrix W [rows, cols] (rows = output features N, cols = input features K), each
// row `row_bytes` long, blocks along K, rows contiguous one after another.
struct QMatrix {
  const uint8_t* data;
  QType type;
  int64_t rows;
  int64_t cols;
  int64_t row_bytes;  // cols / block_elems * block_bytes
};

// IEEE half -> float, portable (the ISA kernels use F16C / AVX-512 conversions instead).
inline float fp16_to_fp32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

// Memory to pull toward the caches while a GEMM computes (the next layer's K/V while a
// compute-bound MLP runs): `num_spans` spans of `span_lines` 64-byte lines each; line i is
// spans[i / span_lines] + 64 (i % span_lines).
struct SidePrefetch {
  const char* const* spans;
  int64_t num_spans;
  int64_t span_lines;
};

}  // namespace backfill
