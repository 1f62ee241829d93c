// Scalar reference kernels: the definition of every format's numbers (ggml's dequantize_row_*
// formulas, operation for operation) and a plain GEMM over them. No SIMD, no threads.
#include <cstring>
#include <vector>

#include "packed.h"
#include "qgemm.h"

namespace backfill {
namespace {

void dequant_q4_0(const BlockQ4_0* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, y += QK) {
    const float d = fp16_to_fp32(b[i].d);
    for (int j = 0; j < QK / 2; ++j) {
      y[j] = static_cast<float>((b[i].qs[j] & 0x0F) - 8) * d;
      y[j + QK / 2] = static_cast<float>((b[i].qs[j] >> 4) - 8) * d;
    }
  }
}

void dequant_q4_1(const BlockQ4_1* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, y += QK) {
    const float d = fp16_to_fp32(b[i].d), m = fp16_to_fp32(b[i].m);
    for (int j = 0; j < QK / 2; ++j) {
      y[j] = static_cast<float>(b[i].qs[j] & 0x0F) * d + m;
      y[j + QK / 2] = static_cast<float>(b[i].qs[j] >> 4) * d + m;
    }
  }
}

void dequant_q8_0(const BlockQ8_0* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, y += QK) {
    const float d = fp16_to_fp32(b[i].d);
    for (int j = 0; j < QK; ++j) y[j] = static_cast<float>(b[i].qs[j]) * d;
  }
}

// ggml's get_scale_min_k4: the j-th 6-bit scale and min of a Q4_K super-block.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void dequant_q4_k(const BlockQ4_K* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
    const uint8_t* q = b[i].qs;
    for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, q += 32) {
      uint8_t sc, m;
      scale_min_k4(is, b[i].scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      scale_min_k4(is + 1, b[i].scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
}

void dequant_q6_k(const BlockQ6_K* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d);
    const uint8_t* ql = b[i].ql;
    const uint8_t* qh = b[i].qh;
    const int8_t* sc = b[i].scales;
    for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * sc[is] * static_cast<float>(q1);
        y[l + 32] = d * sc[is + 2] * static_cast<float>(q2);
        y[l + 64] = d * sc[is + 4] * static_cast<float>(q3);
        y[l + 96] = d * sc[is + 6] * static_cast<float>(q4);
      }
    }
  }
}

// The factored form (see TileJob): q[k] the codes (as fp32), d[b] / m[b] block b's scale and
// offset, computed as the fast kernels' producers compute them (so w = fma(q, d, m) bit for bit).
void factor_q4(const uint8_t* qs, float* q) {
  for (int j = 0; j < QK / 2; ++j) {
    q[j] = static_cast<float>(qs[j] & 0x0F);
    q[j + QK / 2] = static_cast<float>(qs[j] >> 4);
  }
}

void factor_q4_k(const BlockQ4_K* b, int64_t nb, float* q, float* d, float* m) {
  for (int64_t i = 0; i < nb; ++i) {
    const float bd = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
    const uint8_t* qs = b[i].qs;
    for (int c = 0; c < 4; ++c, qs += 32, q += 64) {  // sub-blocks 2c (low nibbles), 2c + 1 (high)
      for (int h = 0; h < 2; ++h) {
        uint8_t sc, mn;
        scale_min_k4(2 * c + h, b[i].scales, &sc, &mn);
        *d++ = bd * static_cast<float>(sc);
        *m++ = dmin * (static_cast<float>(mn) * -1.0f);
      }
      for (int l = 0; l < 32; ++l) {
        q[l] = static_cast<float>(qs[l] & 0xF);
        q[l + 32] = static_cast<float>(qs[l] >> 4);
      }
    }
  }
}

void factor_q6_k(const BlockQ6_K* b, int64_t nb, float* q, float* d, float* m) {
  for (int64_t i = 0; i < nb; ++i) {
    const float bd = fp16_to_fp32(b[i].d);
    for (int j = 0; j < QK_K / 16; ++j) {
      *d = bd * static_cast<float>(b[i].scales[j]);
      *m++ = *d++ * -32.0f;
    }
    const uint8_t* ql = b[i].ql;
    const uint8_t* qh = b[i].qh;
    for (int n = 0; n < QK_K; n += 128, q += 128, ql += 64, qh += 32) {
      for (int l = 0; l < 32; ++l) {
        q[l] = static_cast<float>((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4));
        q[l + 32] = static_cast<float>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
        q[l + 64] = static_cast<float>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
        q[l + 96] = static_cast<float>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
      }
    }
  }
}

}  // namespace

void dequantize_row_ref(const QMatrix& w, int64_t row, float* out) {
  const uint8_t* src = w.data + row * w.row_bytes;
  const int64_t nb = w.cols / block_elems(w.type);
  switch (w.type) {
    case QType::F32:
      std::memcpy(out, src, sizeof(float) * w.cols);
      break;
    case QType::F16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
      for (int64_t k = 0; k < w.cols; ++k) out[k] = fp16_to_fp32(h[k]);
      break;
    }
    case QType::Q4_0: dequant_q4_0(reinterpret_cast<const BlockQ4_0*>(src), nb, out); break;
    case QType::Q4_1: dequant_q4_1(reinterpret_cast<const BlockQ4_1*>(src), nb, out); break;
    case QType::Q8_0: dequant_q8_0(reinterpret_cast<const BlockQ8_0*>(src), nb, out); break;
    case QType::Q4_K: dequant_q4_k(reinterpret_cast<const BlockQ4_K*>(src), nb, out); break;
    case QType::Q6_K: dequant_q6_k(reinterpret_cast<const BlockQ6_K*>(src), nb, out); break;
  }
}

int64_t factored_block_elems(QType t) {
  switch (t) {
    case QType::F32: case QType::F16: return 0;
    case QType::Q6_K: return 16;
    default: return 32;
  }
}

void factored_row_ref(const QMatrix& w, int64_t row, float* q, float* d, float* m) {
  const uint8_t* src = w.data + row * w.row_bytes;
  const int64_t nb = w.cols / block_elems(w.type);
  switch (w.type) {
    case QType::F32: case QType::F16: break;
    case QType::Q4_0: {
      const auto* b = reinterpret_cast<const BlockQ4_0*>(src);
      for (int64_t i = 0; i < nb; ++i, q += QK) {
        d[i] = fp16_to_fp32(b[i].d);
        m[i] = d[i] * -8.0f;
        factor_q4(b[i].qs, q);
      }
      break;
    }
    case QType::Q4_1: {
      const auto* b = reinterpret_cast<const BlockQ4_1*>(src);
      for (int64_t i = 0; i < nb; ++i, q += QK) {
        d[i] = fp16_to_fp32(b[i].d);
        m[i] = fp16_to_fp32(b[i].m);
        factor_q4(b[i].qs, q);
      }
      break;
    }
    case QType::Q8_0: {
      const auto* b = reinterpret_cast<const BlockQ8_0*>(src);
      for (int64_t i = 0; i < nb; ++i, q += QK) {
        d[i] = fp16_to_fp32(b[i].d);
        m[i] = d[i] * -static_cast<float>(kByteCodeOffset);  // the packed tiles' codes are q + 128 (packed.h)
        for (int j = 0; j < QK; ++j) q[j] = static_cast<float>(b[i].qs[j] + kByteCodeOffset);
      }
      break;
    }
    case QType::Q4_K: factor_q4_k(reinterpret_cast<const BlockQ4_K*>(src), nb, q, d, m); break;
    case QType::Q6_K: factor_q6_k(reinterpret_cast<const BlockQ6_K*>(src), nb, q, d, m); break;
  }
}

void qgemm_ref(const float* x, int64_t m, int64_t ldx, const QMatrix& w, const float* bias, float* y,
               int64_t ldy, int64_t n_begin, int64_t n_end) {
  std::vector<float> row(static_cast<size_t>(w.cols));
  for (int64_t n = n_begin; n < n_end; ++n) {
    dequantize_row_ref(w, n, row.data());
    for (int64_t i = 0; i < m; ++i) {
      const float* xi = x + i * ldx;
      float acc = 0.0f;
      for (int64_t k = 0; k < w.cols; ++k) acc += xi[k] * row[static_cast<size_t>(k)];
      y[i * ldy + n] = bias != nullptr ? acc + bias[n] : acc;
    }
  }
}

}  // namespace backfill
