// AMX probe: whether the tile unit's bf16 dot products are batch invariant (a row's result
// independent of the other rows and of its position), whether an FMA kernel could reproduce
// them bit for bit, and what each tile operation costs on this CPU: the facts an AMX GEMM for
// backfill's kernels would rest on (BENCHMARKS.md, session 61).
// Build and run (a CPU with AMX-BF16, Linux >= 5.16):
//   g++ -O2 -march=native -mamx-tile -mamx-bf16 scripts/amx_probe.cpp -o /tmp/amx_probe && /tmp/amx_probe
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <random>

namespace {

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
alignas(64) TileConfig g_config;

// Tiles 0-7 all 64 bytes wide: 1 and 3 (B) 16 rows, the others (A: 2, C: 0, 4-6) `rows`.
void configure(int rows) {
  g_config = TileConfig{};
  for (int t = 0; t < 8; ++t) {
    g_config.colsb[t] = 64;
    g_config.rows[t] = 16;
  }
  for (int t : {0, 2, 4, 5, 6, 7}) g_config.rows[t] = static_cast<uint8_t>(rows);
  asm volatile("" ::: "memory");  // GCC does not see ldtilecfg read the config
  _tile_loadconfig(&g_config);
}

alignas(64) uint16_t g_a[16 * 32], g_b[16 * 32], g_buf[4][512];
alignas(64) float g_c[16 * 16], g_c1[16];

uint16_t bf16_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

float float_of(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <class Body>
double ns_per_iteration(Body body, long n = 2000000) {
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) body(i);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e9 / n;
}

}  // namespace

int main() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    std::puts("no AMX tile data permission (kernel or CPU without AMX)");
    return 1;
  }
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (auto& v : g_a) v = bf16_of(normal(rng));
  for (auto& v : g_b) v = bf16_of(static_cast<float>(rng() % 16));  // 4-bit codes, exact in bf16

  // Batch invariance: each row of C = sum over 4 tiles of A_t B_t (x-like values over a wide
  // range of exponents, 4-bit codes), computed alone in a 1-row tile against all 16 rows at
  // once, over many random draws.
  std::uniform_int_distribution<int> exponent(-20, 20);
  alignas(64) static uint16_t as[4][16 * 32], bs[4][16 * 32];
  int mismatches = 0, trials = 200;
  for (int trial = 0; trial < trials; ++trial) {
    for (int t = 0; t < 4; ++t) {
      for (auto& v : as[t]) v = bf16_of(std::ldexp(normal(rng), exponent(rng)));
      for (auto& v : bs[t]) v = bf16_of(static_cast<float>(rng() % 16));
    }
    configure(16);
    _tile_zero(0);
    for (int t = 0; t < 4; ++t) {
      _tile_loadd(1, bs[t], 64);
      _tile_loadd(2, as[t], 64);
      _tile_dpbf16ps(0, 2, 1);
    }
    _tile_stored(0, g_c, 64);
    configure(1);
    for (int r = 0; r < 16; ++r) {
      _tile_zero(0);
      for (int t = 0; t < 4; ++t) {
        _tile_loadd(1, bs[t], 64);
        _tile_loadd(2, as[t] + 32 * r, 64);
        _tile_dpbf16ps(0, 2, 1);
      }
      _tile_stored(0, g_c1, 64);
      mismatches += std::memcmp(g_c1, g_c + 16 * r, 64) != 0;
    }
  }
  std::printf("rows whose 1-row result differs from the 16-row one: %d of %d\n", mismatches, 16 * trials);
  // The last draw's 16-row results against two emulations an FMA kernel could run: an fp32 FMA
  // chain over the products in order, and the products summed exactly per tile, rounded once.
  int chain_differs = 0, exact_differs = 0;
  for (int r = 0; r < 16; ++r)
    for (int j = 0; j < 16; ++j) {
      float chain = 0.0f, once = 0.0f;
      for (int t = 0; t < 4; ++t) {
        double exact = 0.0;
        for (int k = 0; k < 32; ++k) {
          const float a = float_of(as[t][32 * r + k]), b = float_of(bs[t][32 * (k / 2) + 2 * j + k % 2]);
          chain = std::fma(a, b, chain);
          exact += static_cast<double>(a) * b;
        }
        once = static_cast<float>(once + exact);
      }
      chain_differs += chain != g_c[16 * r + j];
      exact_differs += once != g_c[16 * r + j];
    }
  std::printf("of 256 results, differ from an fp32 FMA chain: %d, from exact tile sums rounded once: %d\n",
              chain_differs, exact_differs);

  // Numbers both units compute exactly: x on its block's fixed-point grid, 28 bits (X = x
  // 2^(26 - E) truncated, E the exponent of the block's largest |x|), cut into 7-bit digits
  // X = L0 2^21 + L1 2^14 + L2 2^7 + L3 (L0 signed); the tile unit sums codes (0 .. 15) times
  // L0 2^7 and L1 into one tile, times L2 2^7 and L3 into another: every partial sum is an
  // integer below 2^23, so any order gives the same bits, and an fp32 FMA chain over
  // q (L0 2^7 + L1) reproduces the first tile exactly.
  {
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    alignas(64) static uint16_t hi[2][16 * 32], codes[16 * 32];
    alignas(64) static float ca[16 * 16];
    float xs[16][32], chain_a[16][16];
    for (int r = 0; r < 16; ++r)
      for (int k = 0; k < 32; ++k) xs[r][k] = std::ldexp(uniform(rng), exponent(rng) / 4);
    for (auto& v : codes) v = bf16_of(static_cast<float>(rng() % 16));
    for (int r = 0; r < 16; ++r) {
      float largest = 0.0f;
      for (float v : xs[r]) largest = std::max(largest, std::fabs(v));
      const float scale = std::ldexp(1.0f, 26 - std::ilogb(largest));
      int32_t digits01[32];
      for (int k = 0; k < 32; ++k) {
        const int32_t x = static_cast<int32_t>(xs[r][k] * scale);
        const int32_t l0 = x >> 21, l1 = (x - l0 * (1 << 21)) >> 14;
        hi[0][32 * r + k] = bf16_of(static_cast<float>(l0 * 128));
        hi[1][32 * r + k] = bf16_of(static_cast<float>(l1));
        digits01[k] = l0 * 128 + l1;
      }
      for (int j = 0; j < 16; ++j) {
        float c = 0.0f;
        for (int k = 0; k < 32; ++k)
          c = std::fma(float_of(codes[32 * (k / 2) + 2 * j + k % 2]), static_cast<float>(digits01[k]), c);
        chain_a[r][j] = c;
      }
    }
    configure(16);
    _tile_loadd(1, codes, 64);
    _tile_zero(0);
    _tile_loadd(2, hi[0], 64);
    _tile_dpbf16ps(0, 2, 1);
    _tile_loadd(2, hi[1], 64);
    _tile_dpbf16ps(0, 2, 1);
    _tile_stored(0, ca, 64);
    int differ = 0;
    for (int r = 0; r < 16; ++r)
      for (int j = 0; j < 16; ++j) differ += ca[16 * r + j] != chain_a[r][j];
    std::printf("fixed-point digits: of 256 tile sums, differ from the fp32 FMA chain: %d\n", differ);
  }

  for (int rows : {16, 1}) {
    configure(rows);
    _tile_loadd(1, g_b, 64);
    _tile_loadd(2, g_a, 64);
    _tile_loadd(3, g_b, 64);
    const double dp = ns_per_iteration([](long) {
                        _tile_dpbf16ps(0, 2, 1);
                        _tile_dpbf16ps(4, 2, 3);
                        _tile_dpbf16ps(5, 2, 1);
                        _tile_dpbf16ps(6, 2, 3);
                      }) / 4;
    std::printf("%2d-row A/C tiles: TDPBF16PS %.2f ns\n", rows, dp);
  }
  configure(16);
  std::printf("tileloadd (L1) %.2f ns\n", ns_per_iteration([](long i) { _tile_loadd(2, g_buf[i & 3], 64); }));
  std::printf("tilestored %.2f ns\n", ns_per_iteration([](long i) { _tile_stored(0, g_buf[i & 3], 64); }));
  __m512 acc = _mm512_setzero_ps();
  const double back = ns_per_iteration([&acc](long i) {
    _tile_stored(0, g_buf[i & 3], 64);
    const float* c = reinterpret_cast<const float*>(g_buf[(i + 2) & 3]);  // stored two rounds before
    for (int r = 0; r < 16; ++r) acc = _mm512_add_ps(acc, _mm512_load_ps(c + 16 * r));
  });
  asm volatile("" : : "v"(acc));
  std::printf("tilestored + 16 vector loads of an earlier store: %.2f ns\n", back);
  _tile_release();
  return 0;
}
