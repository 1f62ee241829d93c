// A measurement prototype, not product code (session 62; BENCHMARKS.md, "Session 62"): an exact
// GEMM over the packed Q4_1 tiles (packed.h) on the AMX tile unit, in numbers an FMA kernel can
// reproduce bit for bit at any row count (so a process could run AMX from 16 rows and FMAs below
// without breaking batch invariance).
//   x, per row and 32-column block, on a fixed-point grid: u = 2^(E - 26) (E the exponent of the
//   block's largest |x|, at least -99), X = round(x / u) (|X| < 2^27), X = XA 2^14 + XB, XA = L0 2^7
//   + L1, XB = L2 2^7 + L3 (7-bit digits, L0 signed). The A tiles hold the digits times 2^14 u or u
//   (exact in bf16), the code tile bf16(16 + q) (one shift and one ternlog a row of codes, no
//   table), each sum tile starts at -16 (sum XA) 2^14 u (or -16 (sum XB) u), so after two TDPs
//   C_a = sum q XA 2^14 u and C_b = sum q XB u exactly (every partial sum an integer below 2^24
//   times a power of two: any order gives the same bits). Then S = C_a + C_b (one rounding: the
//   exact sum rounded once), y = fma(S, d, y), y = fma(Xb, m, y) with Xb = fma(sum XA, 2^14 u, (sum XB) u).
//   The check: every result against scalar fp32 chains of the same numbers (must print 0 differ).
// Loop: per 16-row group and chunk of CT output tiles, blocks outer (the group's 4 digit tiles
// stay in tile registers), tiles inner; the code tile of a tile block converted CONV_AHEAD tile
// blocks ahead into a ring, its two sum tiles stored and folded LAG tile blocks later.
// build: g++ -O2 -march=native -o amx_digits scripts/amx_digits.cpp
// run:   ./amx_digits M N K reps [CT] [zeros]   e.g. ./amx_digits 32 3072 576 50
//        (-DVAR=0: tile operations only, 1: + codes' conversion, 2: + fold, 3: all (default);
//         "zeros" as the 6th argument: x and the codes all zero, to see the tile unit's speed
//         depend on the data)
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <chrono>
#include <vector>
#include <algorithm>
#include <unistd.h>
#include <sys/syscall.h>

#ifndef CONV_AHEAD
#define CONV_AHEAD 4
#endif
#ifndef VAR
#define VAR 3
#endif
#ifndef LAG
#define LAG 4
#endif
struct TileCfg { uint8_t palette; uint8_t start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
alignas(64) static TileCfg cfgv;
static void cfg(int rows) {
  memset(&cfgv, 0, sizeof cfgv); cfgv.palette = 1;
  for (int t = 0; t < 8; ++t) { cfgv.rows[t] = 16; cfgv.colsb[t] = 64; }
  for (int t : {0, 1, 2, 3, 5, 6}) cfgv.rows[t] = rows;  // A and C: the group's rows
  _tile_loadconfig(&cfgv);
}

int main(int argc, char** argv) {
  int M = argc > 1 ? atoi(argv[1]) : 32, N = argc > 2 ? atoi(argv[2]) : 3072, K = argc > 3 ? atoi(argv[3]) : 576;
  int reps = argc > 4 ? atoi(argv[4]) : 50;
  const int CT = argc > 5 ? atoi(argv[5]) : 8;
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { puts("no AMX permission"); return 1; }
  const int nb = K / 32, nt = N / 16, ng = (M + 15) / 16;
  std::vector<uint8_t> q(N * K); std::vector<float> d(N * nb), mn(N * nb), x(M * K);
  srand(1);
  for (auto& v : q) v = rand() & 15;
  for (auto& v : d) v = (float)(_Float16)((float)((rand() % 2000) + 1) * 1e-5f);
  for (auto& v : mn) v = (float)(_Float16)(-(float)((rand() % 2000)) * 1e-4f);
  for (auto& v : x) v = ((rand() / (float)RAND_MAX) - 0.5f) * 3.0f * powf(2.0f, (float)(rand() % 9 - 4));
  const bool zeros = argc > 6 && strcmp(argv[6], "zeros") == 0;
  if (zeros) { for (auto& v : x) v = 0.0f; for (auto& v : q) v = 0; }
  const int TB = 320;
  uint8_t* W = (uint8_t*)aligned_alloc(64, (size_t)nt * nb * TB);
  for (int t = 0; t < nt; ++t) for (int b = 0; b < nb; ++b) {
    uint8_t* p = W + ((size_t)t * nb + b) * TB;
    _Float16* dh = (_Float16*)p; _Float16* mh = (_Float16*)(p + 32); uint32_t* qs = (uint32_t*)(p + 64);
    for (int r = 0; r < 16; ++r) {
      int n = 16 * t + r; dh[r] = (_Float16)d[n * nb + b]; mh[r] = (_Float16)mn[n * nb + b];
      for (int w = 0; w < 4; ++w) { uint32_t v = 0; for (int c = 0; c < 8; ++c) v |= (uint32_t)q[n * K + 32 * b + 8 * w + c] << (4 * c); qs[16 * w + r] = v; }
    }
  }
  std::vector<float> y(M * N);
  // prepared x, per (group, block): A tiles [4][16 rows][32 bf16] | C init [2][16][16] fp32 ;
  // per (row, block): Xb (the grid unit u is folded into the digits)
  const size_t kGB = 4 * 1024 + 2 * 1024;
  uint8_t* P = (uint8_t*)aligned_alloc(64, (size_t)ng * nb * kGB);
  float* Xbs = (float*)aligned_alloc(64, (size_t)ng * nb * 16 * 4);  // [(g*nb + b)][16]
  uint8_t* arena = (uint8_t*)aligned_alloc(4096, 64 * 1024);
  float* cbuf = (float*)arena;
  uint16_t* ring = (uint16_t*)(arena + 20480);
  float* ybuf = (float*)aligned_alloc(4096, (size_t)16 * CT * 16 * 4);
  // A pair p = 4w + c holds k = 8w + c, 8w + c + 4: element e of an A row takes k = kord[e]
  alignas(64) uint16_t kord[32];
  for (int p = 0; p < 16; ++p) { int w = p / 4, c = p % 4; kord[2 * p] = 8 * w + c; kord[2 * p + 1] = 8 * w + c + 4; }
  const __m512i perm_k = _mm512_load_si512(kord);

  auto prep = [&]() {
    for (int g = 0; g < ng; ++g)
      for (int b = 0; b < nb; ++b) {
        uint8_t* gb = P + ((size_t)g * nb + b) * kGB;
        uint16_t* A = (uint16_t*)gb; float* C0 = (float*)(gb + 4096);
        float* xb = Xbs + ((size_t)g * nb + b) * 16;
        for (int r = 0; r < 16; ++r) {
          const int m = 16 * g + r;
          if (m >= M) {
            for (int s = 0; s < 4; ++s) memset(A + 512 * s + 32 * r, 0, 64);
            for (int s = 0; s < 2; ++s) _mm512_store_ps(C0 + 256 * s + 16 * r, _mm512_setzero_ps());
            xb[r] = 0; continue;
          }
          const float* xr = x.data() + (size_t)m * K + 32 * b;
          const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
          const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
          uint32_t bits; memcpy(&bits, &mx, 4);
          int E = (int)(bits >> 23) - 127; if (E < -99) E = -99;
          const float sc = ldexpf(1.0f, 26 - E), u = ldexpf(1.0f, E - 26);
          const __m512i X0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(sc)));
          const __m512i X1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(sc)));
          const __m512i XA0 = _mm512_srai_epi32(X0, 14), XA1 = _mm512_srai_epi32(X1, 14);
          const __m512i XB0 = _mm512_and_si512(X0, _mm512_set1_epi32(0x3FFF)), XB1 = _mm512_and_si512(X1, _mm512_set1_epi32(0x3FFF));
          // digits: XA = L0 128 + L1, XB = L2 128 + L3 (L1, L2, L3 in [0, 127])
          const __m512i m7 = _mm512_set1_epi32(127), h7 = _mm512_set1_epi32(~127);
          const __m512i dg[4][2] = {{_mm512_and_si512(XA0, h7), _mm512_and_si512(XA1, h7)},
                                    {_mm512_and_si512(XA0, m7), _mm512_and_si512(XA1, m7)},
                                    {_mm512_and_si512(XB0, h7), _mm512_and_si512(XB1, h7)},
                                    {_mm512_and_si512(XB0, m7), _mm512_and_si512(XB1, m7)}};
          for (int s = 0; s < 4; ++s) {
            const __m512 us = _mm512_set1_ps(s < 2 ? u * 16384.0f : u);
            const __m512bh bh = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_cvtepi32_ps(dg[s][1]), us), _mm512_mul_ps(_mm512_cvtepi32_ps(dg[s][0]), us));
            _mm512_store_si512(A + 512 * s + 32 * r, _mm512_permutexvar_epi16(perm_k, (__m512i)bh));
          }
          const float sa = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(XA0, XA1));
          const float sb = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(XB0, XB1));
          _mm512_store_ps(C0 + 16 * r, _mm512_set1_ps(-16.0f * sa * u * 16384.0f));
          _mm512_store_ps(C0 + 256 + 16 * r, _mm512_set1_ps(-16.0f * sb * u));
          xb[r] = fmaf(sa, u * 16384.0f, sb * u);
        }
      }
  };
  std::vector<const uint8_t*> wsrc(nb * CT);
  std::vector<const float*> xsrc(nb * CT);
  std::vector<float*> ydst(nb * CT);
  auto run = [&](bool do_prep) {
    if (do_prep) prep();
    int cfg_rows = -1;
    for (int t0 = 0; t0 < nt; t0 += CT) {
      const int ct = std::min(CT, nt - t0), nj = nb * ct;
      for (int g = 0; g < ng; ++g) {
        const int rows = std::min(16, M - 16 * g);
        if (rows != cfg_rows) { cfg(rows); cfg_rows = rows; }
        for (int j = 0; j < nj; ++j) {
          const int tt = j % ct, b = j / ct;
          wsrc[j] = W + ((size_t)(t0 + tt) * nb + b) * TB;
          xsrc[j] = Xbs + ((size_t)g * nb + b) * 16;
          ydst[j] = ybuf + tt * 16;
        }
        for (int i = 0; i < 16 * ct * 16; i += 16) _mm512_store_ps(ybuf + i, _mm512_setzero_ps());
        const size_t ystride = (size_t)ct * 16;
        auto fold = [&](int j) __attribute__((always_inline)) {
          const float* ca = cbuf + (j & 7) * 512;
          const float* cb = ca + 256;
          const uint8_t* p = wsrc[j];
          const __m512 dv = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)p));
          const __m512 mv = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(p + 32)));
          const float* __restrict xb = xsrc[j];
          float* __restrict yb = ydst[j];
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) {
            const __m512 S = _mm512_add_ps(_mm512_load_ps(ca + 16 * i), _mm512_load_ps(cb + 16 * i));
            __m512 yv = _mm512_load_ps(yb + i * ystride);
            yv = _mm512_fmadd_ps(S, dv, yv);
            yv = _mm512_fmadd_ps(_mm512_set1_ps(xb[i]), mv, yv);
            _mm512_store_ps(yb + i * ystride, yv);
          }
        };
        auto conv = [&](int j) __attribute__((always_inline)) {
          const uint8_t* p = wsrc[j] + 64;
          uint16_t* __restrict o = ring + (j & 7) * 512;
          const __m512i kBias = _mm512_set1_epi32(0x41804180), kMask = _mm512_set1_epi32(0x00780078);
#pragma GCC unroll 4
          for (int w = 0; w < 4; ++w) {
            const __m512i word = _mm512_load_si512(p + 64 * w);
            _mm512_store_si512(o + 32 * (4 * w + 0), _mm512_ternarylogic_epi32(_mm512_slli_epi32(word, 3), kMask, kBias, 0xEA));
            _mm512_store_si512(o + 32 * (4 * w + 1), _mm512_ternarylogic_epi32(_mm512_srli_epi32(word, 1), kMask, kBias, 0xEA));
            _mm512_store_si512(o + 32 * (4 * w + 2), _mm512_ternarylogic_epi32(_mm512_srli_epi32(word, 5), kMask, kBias, 0xEA));
            _mm512_store_si512(o + 32 * (4 * w + 3), _mm512_ternarylogic_epi32(_mm512_srli_epi32(word, 9), kMask, kBias, 0xEA));
          }
        };
        for (int j = 0; j < CONV_AHEAD && j < nj; ++j) conv(j);
        int j = 0;
        for (int b = 0; b < nb; ++b) {
          const uint8_t* gb = P + ((size_t)g * nb + b) * kGB;
          const uint16_t* a = (const uint16_t*)gb; const float* c0 = (const float*)(gb + 4096);
          _tile_loadd(0, a, 64); _tile_loadd(1, a + 512, 64); _tile_loadd(2, a + 1024, 64); _tile_loadd(3, a + 1536, 64);
          for (int tt = 0; tt < ct; ++tt, ++j) {
            const uint16_t* bt = ring + (j & 7) * 512;
            float* cdst = cbuf + (j & 7) * 512;
            if (j & 1) {
              _tile_loadd(7, bt, 64);
              _tile_loadd(5, c0, 64); _tile_loadd(6, c0 + 256, 64);
              _tile_dpbf16ps(5, 0, 7); _tile_dpbf16ps(6, 2, 7);
              _tile_dpbf16ps(5, 1, 7); _tile_dpbf16ps(6, 3, 7);
              _tile_stored(5, cdst, 64); _tile_stored(6, cdst + 256, 64);
            } else {
              _tile_loadd(4, bt, 64);
              _tile_loadd(5, c0, 64); _tile_loadd(6, c0 + 256, 64);
              _tile_dpbf16ps(5, 0, 4); _tile_dpbf16ps(6, 2, 4);
              _tile_dpbf16ps(5, 1, 4); _tile_dpbf16ps(6, 3, 4);
              _tile_stored(5, cdst, 64); _tile_stored(6, cdst + 256, 64);
            }
            if ((VAR & 1) && j + CONV_AHEAD < nj) conv(j + CONV_AHEAD);
            if ((VAR & 2) && j >= LAG) fold(j - LAG);
          }
        }
        for (int jj = std::max(0, nj - LAG); jj < nj; ++jj) fold(jj);
        for (int i = 0; i < rows; ++i)
          for (int tt = 0; tt < ct; ++tt)
            _mm512_storeu_ps(&y[(size_t)(16 * g + i) * N + 16 * (t0 + tt)], _mm512_load_ps(ybuf + (size_t)i * ct * 16 + tt * 16));
      }
    }
    _tile_release();
  };
  run(true);
  // reference: the defined numbers with scalar fp32 (integer chains in any order are exact)
  double maxrel = 0; long diff = 0;
  for (int i = 0; i < M; ++i) for (int n = 0; n < N; ++n) {
    double s = 0, sa = 0;
    for (int k = 0; k < K; ++k) { double w = q[n * K + k] * (double)d[n * nb + k / 32] + mn[n * nb + k / 32]; s += w * x[i * K + k]; sa += fabs(w * x[i * K + k]); }
    float acc = 0;
    for (int b = 0; b < nb; ++b) {
      const float* xr = x.data() + (size_t)i * K + 32 * b;
      float mx = 0; for (int k = 0; k < 32; ++k) mx = std::max(mx, fabsf(xr[k]));
      uint32_t bits; memcpy(&bits, &mx, 4);
      int E = (int)(bits >> 23) - 127; if (E < -99) E = -99;
      const float sc = ldexpf(1.0f, 26 - E), u = ldexpf(1.0f, E - 26);
      float ca = 0, cb = 0, sa2 = 0, sb2 = 0;
      for (int k = 0; k < 32; ++k) {
        const int32_t X = (int32_t)nearbyintf(xr[k] * sc);
        const float xa = (float)(X >> 14), xb = (float)(X & 0x3FFF);
        ca = fmaf((float)q[n * K + 32 * b + k], xa, ca); cb = fmaf((float)q[n * K + 32 * b + k], xb, cb);
        sa2 += xa; sb2 += xb;
      }
      const float S = fmaf(ca, u * 16384.0f, cb * u);
      acc = fmaf(S, d[n * nb + b], acc);
      acc = fmaf(fmaf(sa2, u * 16384.0f, sb2 * u), mn[n * nb + b], acc);
    }
    double e = fabs(s - y[i * N + n]) / sa; if (e > maxrel) maxrel = e;
    diff += acc != y[i * N + n];
  }
  printf("max err / sum|wx| = %.3g (2^-24 = %.3g); differ from scalar chains: %ld of %d\n", maxrel, pow(2, -24), diff, M * N);
  for (int pass = 0; pass < 2; ++pass) {
    std::vector<double> ts;
    for (int it = 0; it < 7; ++it) {
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) run(pass == 0);
      auto t1 = std::chrono::steady_clock::now();
      ts.push_back(std::chrono::duration<double>(t1 - t0).count() / reps);
    }
    std::sort(ts.begin(), ts.end());
    const double s = ts[3];
    printf("M=%d N=%d K=%d %s: %.1f us, %.1f ns per tile block (all rows)\n", M, N, K, pass == 0 ? "with prep" : "no prep  ", s * 1e6, s * 1e9 / (nt * nb));
  }
}
