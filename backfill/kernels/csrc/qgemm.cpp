// Run-time ISA choice and multi-threading for the packed linear kernels (torch's intra-op pool).
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "digits.h"
#include "isa.h"
#include "q8.h"
#include "qgemm.h"
#include "repack.h"
#include "team.h"

namespace backfill {
namespace {

enum class Isa : int { Scalar = 0, Avx2 = 1, Avx512 = 2 };

// The best kernels this CPU runs.
Isa cpu_isa() {
  Isa best = Isa::Scalar;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::Avx2;
  if (best == Isa::Avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    best = Isa::Avx512;
#endif
  return best;
}

bool parse_isa(const char* name, Isa* out) {
  if (std::strcmp(name, "scalar") == 0) *out = Isa::Scalar;
  else if (std::strcmp(name, "avx2") == 0) *out = Isa::Avx2;
  else if (std::strcmp(name, "avx512") == 0) *out = Isa::Avx512;
  else return false;
  return true;
}

// BACKFILL_ISA lowers the choice (never raises it past what the CPU has): tests run every path.
Isa initial_isa() {
  const Isa best = cpu_isa();
  Isa forced;
  if (const char* env = std::getenv("BACKFILL_ISA"); env != nullptr && parse_isa(env, &forced) && forced < best)
    return forced;
  return best;
}

std::atomic<int> g_isa{-1};  // Isa, or -1 before the first use

Isa isa() {
  int v = g_isa.load(std::memory_order_relaxed);
  if (v < 0) {
    v = static_cast<int>(initial_isa());
    g_isa.store(v, std::memory_order_relaxed);
  }
  return static_cast<Isa>(v);
}

bool cpu_has_vnni() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool vnni = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  return vnni;
#else
  return false;
#endif
}

// The digit form's kernels run vectorized where the AVX-512 ones do and VNNI is there; elsewhere
// (AVX2, scalar, AVX-512 without VNNI) the portable ones, slowly: the form is then on only where
// asked for (tests).
bool digit_kernels_fast() { return isa() == Isa::Avx512 && cpu_has_vnni(); }

std::atomic<int> g_digits{-1};  // 0 / 1, or -1 before the first use

bool use_digit_form() {
  int v = g_digits.load(std::memory_order_acquire);
  if (v < 0) {
    const char* env = std::getenv("BACKFILL_DIGITS");
    if (env != nullptr && (std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0)) v = env[0] == '1';
    else v = isa() == Isa::Avx512 && cpu_has_vnni() && amx_ready() ? 1 : 0;
    int expected = -1;
    if (!g_digits.compare_exchange_strong(expected, v, std::memory_order_acq_rel)) v = expected;
  }
  return v == 1;
}

// The fewest rows a group of 16 runs on the tile unit with (0: none): a partial group below it
// takes the vector dots. The tile unit's time is its group's whatever its rows, the dots' grows
// with them: on a 2-core Sapphire Rapids Xeon with session 65's tile loop (one thread, from
// memory) the default model's Q4_1 shapes ran 1.0-1.08x faster on the tile unit at 6 rows, 1.4x
// at 10; its Q8_0 LM head (two threads), whose codes cost ~4x more to convert, 0.78x at 8 rows,
// 1.04x at 10, 1.10x at 12. In whole decode steps 6 rows lost (shards of 6 rows at batch 12 and
// a team of 6 slower, batch 16 in shards of 8 slower than one team), 10 gained (batch 20-22,
// shards of 10-11 rows, 3-9% faster than on the dots), all else the same as 12 (session 64's).
int64_t amx_min_rows() {
  static const int64_t rows = [] {
    if (!amx_ready()) return int64_t{0};
    const char* env = std::getenv("BACKFILL_AMX_ROWS");
    if (env != nullptr && *env != '\0') return static_cast<int64_t>(std::atoi(env));
    return int64_t{10};
  }();
  return rows;
}

// x's digit form: the rows below the AMX groups (if any) prepared by every thread for itself, the
// AMX groups once for all: with a team of several threads, each prepares its share of the blocks
// (of every group) and syncs (TeamBarrier::parts), so a team thread returns from here only once
// all have come; without one, over torch's pool. Kept between calls (per thread; a team's two
// alternating parts apart from the buffer of calls outside a team).
DigitRows prepare_x_digits(const float* x, int64_t m, int64_t ldx, int64_t cols, const Team* team,
                           const PackedMatrix& w) {
  thread_local std::vector<uint8_t> rows_buf, group_buf[3];
  thread_local std::vector<const uint8_t*> group_at;
  const bool fast = digit_kernels_fast();
  const int64_t nb = cols / 32, amx_end = fast ? digit_amx_end(m, amx_min_rows()) : 0;
  const int64_t groups = (amx_end + 15) / 16;
  const int64_t rows_bytes = (m - amx_end) * nb * kDigitRowBytes + 64;
  if (static_cast<int64_t>(rows_buf.size()) < rows_bytes) rows_buf.resize(static_cast<size_t>(rows_bytes));
  uint8_t* records = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(rows_buf.data()) + 63) & ~uintptr_t{63});
  if (fast) prepare_digits_avx512(x, m, ldx, cols, w.type, records, amx_end);
  else prepare_digits(x, m, ldx, cols, w.type, records, amx_end);
  DigitRows rows{records, m, nb};
  rows.amx_end = amx_end;
  if (groups == 0) return rows;
  group_at.resize(static_cast<size_t>(groups * nb));
  const auto own = [&](std::vector<uint8_t>& buf, int64_t count) {
    const int64_t need = count * kDigitGroupBlockBytes + 64;
    if (static_cast<int64_t>(buf.size()) < need) buf.resize(static_cast<size_t>(need));
    return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  };
  // (block b of group g at base + ((b - b0) groups + g) kDigitGroupBlockBytes, b0 the first block
  // of the part that holds it)
  const auto point = [&](const uint8_t* base, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t g = 0; g < groups; ++g)
        group_at[static_cast<size_t>(g * nb + b)] = base + ((b - b0) * groups + g) * kDigitGroupBlockBytes;
  };
  const bool shared = team != nullptr && team->size > 1 && team->barrier != nullptr && team->size <= TeamBarrier::kMaxParts;
  if (!shared) {
    uint8_t* base = own(group_buf[2], groups * nb);
    if (team == nullptr)
      at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
        build_digit_blocks(x, ldx, amx_end, b0, b1, w.type, base + b0 * groups * kDigitGroupBlockBytes);
      });
    else
      build_digit_blocks(x, ldx, amx_end, 0, nb, w.type, base);
    point(base, 0, nb);
  } else {
    // each thread its share of the blocks (of every group), in its own memory
    TeamBarrier& shared_at = *team->barrier;
    const int64_t parity = shared_at.calls[team->index]++ % 2;
    const auto [b0, b1] = team->share(nb, 1);
    uint8_t* base = own(group_buf[parity], (b1 > b0 ? b1 - b0 : 0) * groups);
    build_digit_blocks(x, ldx, amx_end, b0, b1, w.type, base);
    shared_at.parts[parity][team->index] = base;
    const uint8_t *ahead = nullptr, *ahead_end = nullptr;
    packed_gemm_share(w, m, *team, &ahead, &ahead_end);
    team->sync(ahead, ahead_end);
    for (int64_t t = 0; t < team->size; ++t) {
      const Team other{t, team->size, nullptr};
      const auto [o0, o1] = other.share(nb, 1);
      point(shared_at.parts[parity][t], o0, o1);
    }
  }
  rows.groups = group_at.data();
  return rows;
}

// The int8-activation kernels of one ISA: x's quantization and the GEMM.
struct Q8Kernels {
  void (*quantize)(const float*, int64_t, int64_t, int64_t, uint8_t*, float*, float*);
  void (*gemm)(const Q8Job&);
};

Q8Kernels q8_kernels() {
  static const bool vnni = cpu_has_vnni();
  switch (isa()) {
    case Isa::Avx512: return vnni ? Q8Kernels{quantize_rows_q8_avx512, q8_gemm_avx512vnni}
                                  : Q8Kernels{quantize_rows_q8_avx2, q8_gemm_avx2};
    case Isa::Avx2: return {quantize_rows_q8_avx2, q8_gemm_avx2};
    case Isa::Scalar: break;
  }
  return {quantize_rows_q8, q8_gemm_scalar};
}

// x's int8 form for the calling thread (each member of a team quantizes for itself: no barrier),
// kept between calls.
Q8Rows quantize_x(const Q8Kernels& kernels, const float* x, int64_t m, int64_t ldx, int64_t cols) {
  thread_local std::vector<uint8_t> q;
  thread_local std::vector<float> ds;
  const int64_t nb = cols / 32;
  if (static_cast<int64_t>(q.size()) < m * cols) q.resize(static_cast<size_t>(m * cols));
  if (static_cast<int64_t>(ds.size()) < 2 * m * nb) ds.resize(static_cast<size_t>(2 * m * nb));
  kernels.quantize(x, m, ldx, cols, q.data(), ds.data(), ds.data() + m * nb);
  return Q8Rows{q.data(), ds.data(), ds.data() + m * nb, m, nb};
}

using JobFn = void (*)(const TileJob&);

JobFn job_fn(Isa which) {
  switch (which) {
    case Isa::Avx512: return packed_gemm_avx512;
    case Isa::Avx2: return packed_gemm_avx2;
    case Isa::Scalar: break;
  }
  return packed_gemm_scalar;
}

// This thread's kernel scratch, 64-byte aligned, grown on demand and kept between calls.
float* thread_scratch(int64_t floats) {
  thread_local std::vector<float> buf;
  const size_t need = static_cast<size_t>(floats) + 16;
  if (buf.size() < need) buf.assign(need, 0.0f);
  const uintptr_t p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t{63});
}

// Whether the nibble words run in their subnormal form (packed.h) in this process, on every ISA
// alike (so that they keep agreeing bit for bit at every magnitude): measured once, on the best
// kernels this CPU has, from a Q4_1 matrix in cache at one row (where the form matters most),
// each form's best of 7 alternating rounds (2 where the subnormal form is over 4x slower); kept
// only if the two agree bit for bit and the subnormal form is at least 5% faster (a CPU that
// reads subnormals through a microcode assist is many times slower).
// BACKFILL_SUBNORMAL_CODES=0 / 1 decides instead.
bool measure_subnormal_codes() {
  const Isa best = cpu_isa();
  if (best == Isa::Scalar || !subnormals_read()) return false;
  constexpr int64_t kRows = 192, kCols = 1024, kRowBytes = kCols / 32 * 20;  // 12 tiles, ~120 KB
  std::vector<uint8_t> raw(static_cast<size_t>(kRows * kRowBytes));
  uint32_t seed = 12345;
  const auto next = [&seed] { return seed = seed * 1664525u + 1013904223u; };
  for (int64_t b = 0; b < kRows * kCols / 32; ++b) {
    uint8_t* blk = raw.data() + 20 * b;
    const uint16_t d = static_cast<uint16_t>(0x2000 + next() % 0x1000), m = static_cast<uint16_t>(0xA000 + next() % 0x1000);
    std::memcpy(blk, &d, 2);
    std::memcpy(blk + 2, &m, 2);
    for (int i = 4; i < 20; ++i) blk[i] = static_cast<uint8_t>(next() >> 24);
  }
  std::vector<uint8_t> packed(static_cast<size_t>(packed_bytes(QType::Q4_1, kRows, kCols)));
  repack_tiles(QMatrix{raw.data(), QType::Q4_1, kRows, kCols, kRowBytes}, packed.data(), 0, num_tiles(kRows));
  std::vector<float> x(kCols), y[2] = {std::vector<float>(kRows), std::vector<float>(kRows)};
  for (float& v : x) v = static_cast<float>(static_cast<int32_t>(next())) * 0x1p-31f;
  const JobFn fn = job_fn(best);
  double best_ns[2] = {1e30, 1e30};
  for (int round = 0; round < 8; ++round) {
    for (int sub = 0; sub < 2; ++sub) {
      TileJob job{x.data(), 1, kCols, packed.data(), QType::Q4_1, kRows, kCols, nullptr, y[sub].data(), kRows, false,
                  0, num_tiles(kRows), thread_scratch(job_scratch_floats(kCols)), nullptr, 0, 0};
      job.subnormal_codes = sub == 1;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 32; ++i) fn(job);
      const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
      if (round > 0) best_ns[sub] = std::min(best_ns[sub], ns);  // round 0 warms up
    }
    // a CPU that takes an assist per subnormal runs the form ~100x slower (an Intel Xeon: ~14 ms
    // a round against ~0.15): two rounds settle it, the six more would cost ~80 ms a process
    if (round >= 2 && best_ns[1] > 4.0 * best_ns[0]) return false;
  }
  return std::memcmp(y[0].data(), y[1].data(), sizeof(float) * kRows) == 0 && best_ns[1] < 0.95 * best_ns[0];
}

std::atomic<int> g_subnormal{-1};  // 0 / 1, or -1 before the first use

// (decided once: the threads of a team that reach it together wait for the first one's answer)
bool use_subnormal_codes() {
  int v = g_subnormal.load(std::memory_order_acquire);
  if (v < 0) {
    static std::mutex deciding;
    const std::lock_guard<std::mutex> lock(deciding);
    v = g_subnormal.load(std::memory_order_acquire);
    if (v < 0) {
      const char* env = std::getenv("BACKFILL_SUBNORMAL_CODES");
      if (env != nullptr && (std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0)) v = env[0] == '1';
      else v = measure_subnormal_codes() ? 1 : 0;
      g_subnormal.store(v, std::memory_order_release);
    }
  }
  return v == 1;
}

}  // namespace

const char* active_isa() {
  switch (isa()) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    case Isa::Scalar: break;
  }
  return "scalar";
}

bool set_active_isa(const char* name) {
  Isa want;
  if (!parse_isa(name, &want) || want > cpu_isa()) return false;
  g_isa.store(static_cast<int>(want), std::memory_order_relaxed);
  return true;
}

bool subnormal_codes() { return use_subnormal_codes(); }
void set_subnormal_codes(bool on) { g_subnormal.store(on ? 1 : 0, std::memory_order_release); }

bool digit_form() { return use_digit_form(); }
void set_digit_form(bool on) { g_digits.store(on ? 1 : 0, std::memory_order_release); }
bool amx_active() { return use_digit_form() && digit_kernels_fast() && amx_min_rows() > 0; }
int64_t amx_group_rows(const PackedMatrix& w) {
  return digit_form_runs(w) && amx_active() ? amx_min_rows() : 0;
}
bool digit_form_runs(const PackedMatrix& w) {
  const bool q8 = w.q8_activations && q8_activation_type(w.type);
  return !q8 && digit_type(w.type) && use_digit_form();
}

const char* q8_isa() { return q8_kernels().gemm == q8_gemm_avx512vnni ? "avx512vnni" : active_isa(); }

int64_t packed_bytes(QType type, int64_t rows, int64_t cols) { return num_tiles(rows) * tile_bytes(type, cols); }

void repack(const QMatrix& raw, uint8_t* out) {
  at::parallel_for(0, num_tiles(raw.rows), 4, [&](int64_t begin, int64_t end) { repack_tiles(raw, out, begin, end); });
}

namespace {

// Tiles a thread's range of packed_gemm holds at least: a range is worth a thread from ~100k
// weight-uses on (dequantization counted as two rows; none with int8 activations).
int64_t gemm_grain(const PackedMatrix& w, int64_t m) {
  const bool q8 = w.q8_activations && q8_activation_type(w.type);
  return std::max<int64_t>(1, (int64_t{1} << 17) / (kTileRows * w.cols * (q8 ? m : m + 2)));
}

}  // namespace

void packed_gemm(const float* x, int64_t m, int64_t ldx, const PackedMatrix& w, const float* bias, float* y,
                 int64_t ldy, bool accumulate, const SidePrefetch* side, const Team* team) {
  if (m <= 0 || w.rows <= 0) return;
  // Threads take contiguous ranges of whole tiles: no output is shared, none depends on the split;
  // each job prefetches the share of the side lines its share of the tiles gives it.
  const int64_t tiles = num_tiles(w.rows), side_lines = side == nullptr ? 0 : side->num_spans * side->span_lines;
  if (w.q8_activations && q8_activation_type(w.type)) {
    const Q8Kernels kernels = q8_kernels();
    const Q8Rows xq = quantize_x(kernels, x, m, ldx, w.cols);
    for_share(team, tiles, gemm_grain(w, m), [&](int64_t begin, int64_t end) {
      kernels.gemm(Q8Job{xq, w.data, w.type, w.rows, w.cols, bias, y, ldy, accumulate, begin, end, side,
                         side_lines * begin / tiles, side_lines * end / tiles});
    });
    return;
  }
  if (digit_type(w.type) && use_digit_form()) {
    const DigitRows xd = prepare_x_digits(x, m, ldx, w.cols, team, w);
    const bool fast = digit_kernels_fast();
    for_share(team, tiles, gemm_grain(w, m), [&](int64_t begin, int64_t end) {
      const DigitJob job{xd,    w.data, w.type, w.rows, w.cols, bias, y, ldy, accumulate, begin, end,
                         side, side_lines * begin / tiles, side_lines * end / tiles};
      if (fast) digits_gemm_avx512(job);
      else digits_gemm_scalar(job);
    });
    return;
  }
  const JobFn fn = job_fn(isa());
  const bool subnormal = use_subnormal_codes();
  for_share(team, tiles, gemm_grain(w, m), [&](int64_t begin, int64_t end) {
    TileJob job{x,    m,   ldx,        w.data, w.type, w.rows, w.cols,
                bias, y,   ldy,        accumulate,     begin,  end,
                thread_scratch(job_scratch_floats(w.cols)),
                side, side_lines * begin / tiles, side_lines * end / tiles};
    job.subnormal_codes = subnormal;
    fn(job);
  });
}

void packed_gemm_share(const PackedMatrix& w, int64_t m, const Team& team, const uint8_t** begin,
                       const uint8_t** end) {
  const auto [first, last] = team.share(num_tiles(w.rows), gemm_grain(w, m));
  const int64_t bytes = tile_bytes(w.type, w.cols);
  *begin = w.data + first * bytes;
  *end = w.data + last * bytes;
}

void packed_dequantize_rows(const PackedMatrix& w, const int64_t* rows, int64_t num_rows, float* out,
                            int64_t ld_out, const Team* team) {
  const QMatrix one_row{nullptr, w.type, 1, w.cols, w.cols / block_elems(w.type) * block_bytes(w.type)};
  for_share(team, num_rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> raw(static_cast<size_t>(one_row.row_bytes));  // [row_bytes] one GGUF row
    QMatrix q = one_row;
    q.data = raw.data();
    for (int64_t i = begin; i < end; ++i) {
      unpack_row(w, rows[i], raw.data());
      dequantize_row_ref(q, 0, out + i * ld_out);
    }
  });
}

}  // namespace backfill
