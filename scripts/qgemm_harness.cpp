// The packed GEMM kernels alone, on one core, without torch or Python: one TileJob of a random
// Q4_1 or Q8_0 matrix [N, K] (fixed scales, random codes: the speed does not depend on them)
// times M rows of x, run back to back (the weights stay in L2 / L3 from N x K ~ 1 MB), for the
// AVX2 and the AVX-512 units (where the CPU runs them). Prints the best of 7 bursts and weights x
// rows a cycle at GHZ (default 3.63, a Zen 4 EPYC here). The 4-bit codes in their subnormal form
// unless SUBNORMAL=0 (a CPU that reads subnormals through a microcode assist, as the Xeons here,
// runs the converted form: python -m backfill.kernels says which). Built and run by
// scripts/qgemm_harness.sh.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>

#include "isa.h"
#include "packed.h"

using namespace backfill;

static double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? atol(argv[1]) : 960, k = argc > 2 ? atol(argv[2]) : 576;
  const bool q8 = argc > 3 && argv[3][0] == '8';  // "8": Q8_0, else Q4_1
  const int64_t m = argc > 4 ? atol(argv[4]) : 1;
  const double ghz = getenv("GHZ") ? atof(getenv("GHZ")) : 3.63;
  const int64_t block = q8 ? 544 : 320, halves = q8 ? 16 : 32;  // tile block bytes, fp16 d (m)
  const int64_t tb = k / 32 * block, tiles = (n + 15) / 16;
  uint8_t* w = static_cast<uint8_t*>(aligned_alloc(64, tiles * tb));
  for (int64_t b = 0; b < tiles * (k / 32); ++b) {
    uint8_t* blk = w + b * block;
    for (int64_t i = 0; i < halves; ++i) reinterpret_cast<uint16_t*>(blk)[i] = 0x2C00;  // 2^-4
    for (int64_t i = 2 * halves; i < block; ++i) blk[i] = static_cast<uint8_t>(rand());
  }
  float* x = static_cast<float*>(aligned_alloc(64, m * k * 4));
  for (int64_t i = 0; i < m * k; ++i) x[i] = static_cast<float>(rand() % 200 - 100) / 50.0f;
  float* y = static_cast<float*>(aligned_alloc(64, m * n * 4));
  float* scratch = static_cast<float*>(aligned_alloc(64, job_scratch_floats(k) * 4));
  TileJob job{x, m, k, w, q8 ? QType::Q8_0 : QType::Q4_1, n, k, nullptr, y, n, false, 0, tiles, scratch, nullptr, 0, 0};
  job.subnormal_codes = !getenv("SUBNORMAL") || atoi(getenv("SUBNORMAL")) != 0;  // default on
  const int64_t calls = 2000 / m + 1;
  for (int isa = 0; isa < 2; ++isa) {
    if (isa == 1 && !__builtin_cpu_supports("avx512bw")) break;
    double best = 1e9;
    for (int r = 0; r < 7; ++r) {
      const double t0 = now();
      for (int64_t i = 0; i < calls; ++i) isa == 1 ? packed_gemm_avx512(job) : packed_gemm_avx2(job);
      const double t = (now() - t0) / calls;
      best = t < best ? t : best;
    }
    printf("%s %s [%ld, %ld] x %ld rows: %.2f us, %.2f weights x rows a cycle\n", isa == 1 ? "avx512" : "avx2  ",
           q8 ? "Q8_0" : "Q4_1", static_cast<long>(n), static_cast<long>(k), static_cast<long>(m), best * 1e6,
           static_cast<double>(m * n * k) / (best * ghz * 1e9));
  }
  return y[0] != y[0];  // (y read: the calls are not optimized away)
}
