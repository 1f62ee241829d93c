// Python bindings of the CPU kernels (a pybind11 module built by torch.utils.cpp_extension).
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <vector>

#include "attention_cpu.h"
#include "hugepages.h"
#include "qgemm.h"
#include "team.h"

namespace backfill {
namespace {

QMatrix as_qmatrix(const torch::Tensor& w, int64_t qtype, int64_t cols) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "weight must be a contiguous 2-D uint8 CPU tensor of raw blocks");
  const QType type = static_cast<QType>(qtype);
  const int64_t elems = block_elems(type);
  TORCH_CHECK(elems > 0, "unsupported ggml type ", qtype);
  TORCH_CHECK(cols % elems == 0, "cols ", cols, " is not a multiple of the block size ", elems);
  const int64_t row_bytes = cols / elems * block_bytes(type);
  TORCH_CHECK(w.size(1) == row_bytes, "weight rows hold ", w.size(1), " bytes, expected ", row_bytes);
  return QMatrix{w.data_ptr<uint8_t>(), type, w.size(0), cols, row_bytes};
}

// A type the packed kernels read, whose blocks divide `cols`.
QType checked_type(int64_t qtype, int64_t cols) {
  const QType type = static_cast<QType>(qtype);
  TORCH_CHECK(block_elems(type) > 0 && cols % block_elems(type) == 0, "bad type ", qtype, " or cols ", cols);
  return type;
}

PackedMatrix as_packed(const torch::Tensor& packed, int64_t qtype, int64_t rows, int64_t cols) {
  const QType type = checked_type(qtype, cols);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.numel() == packed_bytes(type, rows, cols),
              "packed weight must be the contiguous uint8 tensor repack() returned");
  return PackedMatrix{packed.data_ptr<uint8_t>(), type, rows, cols};
}

// raw [N, row_bytes] uint8 in GGUF layout -> packed uint8 [packed_bytes], into `out` (a
// contiguous uint8 CPU tensor of that size, e.g. a slice of one buffer for all weights) if given.
torch::Tensor repack_weight(const torch::Tensor& raw, int64_t qtype, int64_t cols,
                            const c10::optional<torch::Tensor>& out) {
  const QMatrix q = as_qmatrix(raw, qtype, cols);
  const int64_t nbytes = packed_bytes(q.type, q.rows, cols);
  torch::Tensor packed;
  if (out.has_value() && out->defined()) {
    packed = *out;
    TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                    packed.numel() == nbytes,
                "out must be a contiguous uint8 CPU tensor of ", nbytes, " bytes");
  } else {
    packed = torch::empty({nbytes}, torch::kUInt8);
  }
  repack(q, packed.data_ptr<uint8_t>());
  return packed;
}

int64_t packed_size(int64_t qtype, int64_t rows, int64_t cols) {
  const QType type = checked_type(qtype, cols);
  TORCH_CHECK(rows >= 0, "rows must not be negative, got ", rows);
  return packed_bytes(type, rows, cols);
}

// x [M, K] fp32 (rows may be strided) -> y [M, N] fp32; `out` (a [M, N] view with unit inner
// stride) receives it in place, added to when `accumulate`.
torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& packed, int64_t qtype, int64_t rows, int64_t cols,
                      const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& out,
                      bool accumulate, bool q8_activations) {
  PackedMatrix w = as_packed(packed, qtype, rows, cols);
  w.q8_activations = q8_activations;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x must be 2-D fp32 on CPU");
  TORCH_CHECK(x.size(1) == cols && x.stride(1) == 1, "x must be [M, ", cols, "] with unit inner stride");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == rows,
                "bias must be contiguous fp32 [N]");
    b = bias->data_ptr<float>();
  }
  torch::Tensor y;
  if (out.has_value() && out->defined()) {
    y = *out;
    TORCH_CHECK(y.scalar_type() == torch::kFloat32 && y.dim() == 2 && y.size(0) == x.size(0) && y.size(1) == rows &&
                    y.stride(1) == 1,
                "out must be a [M, N] fp32 view with unit inner stride");
  } else {
    TORCH_CHECK(!accumulate, "accumulate needs out");
    y = torch::empty({x.size(0), rows}, x.options());
  }
  if (x.size(0) > 0) packed_gemm(x.data_ptr<float>(), x.size(0), x.stride(0), w, b, y.data_ptr<float>(), y.stride(0), accumulate);
  return y;
}

torch::Tensor index_or_all(const c10::optional<torch::Tensor>& rows, int64_t num_rows) {
  torch::Tensor index = rows.has_value() ? rows->contiguous() : torch::arange(num_rows, torch::kInt64);
  TORCH_CHECK(index.scalar_type() == torch::kInt64 && index.dim() == 1, "rows must be 1-D int64");
  if (index.numel() > 0) {
    TORCH_CHECK(index.min().item<int64_t>() >= 0 && index.max().item<int64_t>() < num_rows, "row index out of range");
  }
  return index;
}

// Raw GGUF rows [R] int64 (or all rows) -> [R, cols] fp32 (the scalar reference).
torch::Tensor dequantize(const torch::Tensor& raw, int64_t qtype, int64_t cols, const c10::optional<torch::Tensor>& rows) {
  const QMatrix q = as_qmatrix(raw, qtype, cols);
  const torch::Tensor index = index_or_all(rows, q.rows);
  torch::Tensor out = torch::empty({index.numel(), cols}, torch::kFloat32);
  const int64_t* ids = index.data_ptr<int64_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, index.numel(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequantize_row_ref(q, ids[i], dst + i * cols);
  });
  return out;
}

// Packed rows [R] int64 (or all rows) -> [R, cols] fp32 (embedding lookups).
torch::Tensor dequantize_packed(const torch::Tensor& packed, int64_t qtype, int64_t rows, int64_t cols,
                                const c10::optional<torch::Tensor>& row_ids) {
  const PackedMatrix w = as_packed(packed, qtype, rows, cols);
  const torch::Tensor index = index_or_all(row_ids, rows);
  torch::Tensor out = torch::empty({index.numel(), cols}, torch::kFloat32);
  packed_dequantize_rows(w, index.data_ptr<int64_t>(), index.numel(), out.data_ptr<float>(), cols);
  return out;
}

// logits [S, V] fp32 -> [S] int64, each row's torch.argmax (first maximum; NaN is the maximum),
// vectorized (torch's argmax runs one element at a time).
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32 && logits.dim() == 2,
              "logits must be a 2-D float32 CPU tensor");
  TORCH_CHECK(logits.size(1) >= 1 && logits.size(1) < (int64_t{1} << 31), "logits: bad row length ", logits.size(1));
  const torch::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  torch::Tensor out = torch::empty({rows}, torch::kInt64);  // [S]
  argmax_each_row(x.data_ptr<float>(), rows, cols, out.data_ptr<int64_t>());
  return out;
}

// The roofline's compute ceiling in GFLOP/s: every intra-op thread runs the widest kernels'
// register-only FMA loop (fma_loop) at once, best of `repeats` timings of `rounds` rounds each.
// A measured matmul is no ceiling: torch's fp32 GEMM reaches 85% of it on an Ice Lake Xeon and
// under half on a Zen 5 EPYC, where the packed kernels run faster than it.
double fma_peak_gflops(int64_t rounds, int64_t repeats) {
  TORCH_CHECK(rounds > 0 && repeats > 0, "rounds and repeats must be positive");
  const DecoderKernels& kernels = elementwise_kernels();
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(threads);
  double best = 0;
  for (int64_t r = 0; r <= repeats; ++r) {  // round 0 warms up (clocks, thread pool)
    const auto start = std::chrono::steady_clock::now();
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) sink[t] = kernels.fma_loop(rounds);
    });
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double flops = 2.0 * static_cast<double>(threads * rounds * kernels.fma_chains * kernels.lanes);
    if (r > 0 && flops / seconds > best) best = flops / seconds;
  }
  TORCH_CHECK(std::isfinite(sink[0]), "fma loop diverged");
  return best / 1e9;
}

// probs [S, V] fp32 (>= 0, unnormalized), u [S] fp64 in [0, 1) -> [S] int64: per row the token
// inverse-CDF sampling picks, exactly as the torch reference (sampler.py, inverse_cdf_sample):
//   cdf = probs.cumsum(-1, dtype=float64); target = (1 - u) * cdf[-1];
//   torch.searchsorted(cdf, target).clamp_max(V - 1)
// The same sequential float64 sums (torch's CPU cumsum adds in index order) and the same lower-
// bound search, so the same index bit for bit; one pass in place of torch's scalar cumsum over a
// [S, V] float64 tensor (~14 ms at [32, 49152]).
torch::Tensor inverse_cdf_sample(const torch::Tensor& probs, const torch::Tensor& u) {
  TORCH_CHECK(probs.device().is_cpu() && probs.scalar_type() == torch::kFloat32 && probs.dim() == 2,
              "probs must be a 2-D float32 CPU tensor");
  TORCH_CHECK(probs.size(1) >= 1, "probs: empty rows");
  TORCH_CHECK(u.device().is_cpu() && u.scalar_type() == torch::kFloat64 && u.numel() == probs.size(0),
              "u must hold one float64 per row");
  const torch::Tensor p = probs.contiguous();
  const torch::Tensor draws = u.contiguous();
  const int64_t rows = p.size(0), cols = p.size(1);
  torch::Tensor out = torch::empty({rows}, torch::kInt64);  // [S]
  const float* src = p.data_ptr<float>();
  const double* draw = draws.data_ptr<double>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<double> cdf(cols);  // [V]
    for (int64_t r = begin; r < end; ++r) {
      const float* row = src + r * cols;
      double sum = 0.0;
      for (int64_t i = 0; i < cols; ++i) cdf[i] = sum += static_cast<double>(row[i]);
      const double target = (1.0 - draw[r]) * sum;
      int64_t lo = 0, hi = cols;  // torch's searchsorted (lower bound, side="left"), NaN included
      while (lo < hi) {
        const int64_t mid = lo + ((hi - lo) >> 1);
        if (!(cdf[mid] >= target)) lo = mid + 1; else hi = mid;
      }
      dst[r] = lo < cols - 1 ? lo : cols - 1;
    }
  });
  return out;
}

// run_team's contract (team.h), for tests: every thread of torch's pool meets 2 x `rounds`
// barriers, each round adding index + 1 to a shared total that every thread checks between the
// round's two barriers; thread `fail_thread` (-1: none) throws before round `fail_round`. The
// first barrier of each round is given 4 KB of the thread's own memory to prefetch while it
// waits, from where the last left off: it must return a pointer whole lines on, never past the end.
// Returns the team's size; a failure raises here (the other threads stop at their next barrier).
int64_t team_selftest(int64_t rounds, int64_t fail_thread, int64_t fail_round) {
  std::atomic<int64_t> total{0}, size{0};
  std::atomic<bool> early{false}, bad_ahead{false};
  run_team([&](const Team& team) {
    if (team.index == 0) size = team.size;
    std::vector<uint8_t> mine(static_cast<size_t>(4096 * rounds));
    const uint8_t* ahead = mine.data();
    for (int64_t r = 0; r < rounds; ++r) {
      TORCH_CHECK(team.index != fail_thread || r != fail_round, "team thread ", team.index, " failed in round ", r);
      total.fetch_add(team.index + 1);
      const uint8_t* end = mine.data() + 4096 * (r + 1);
      const uint8_t* after = team.sync(ahead, end);
      if (after < ahead || after > end || (after - ahead) % 64 != 0) bad_ahead = true;
      ahead = after;
      if (total.load() != (r + 1) * team.size * (team.size + 1) / 2) early = true;
      team.sync();
    }
  });
  TORCH_CHECK(!early, "a team barrier let a thread through before the others arrived");
  TORCH_CHECK(!bad_ahead, "a team barrier's prefetch went past its range or by part of a line");
  return size;
}

}  // namespace

void register_decoder(pybind11::module& m);  // decoder.cpp

}  // namespace backfill

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "backfill CPU kernels: linear layers over GGUF-quantized weights, fused decoder steps";
  m.def("isa", &backfill::active_isa, "instruction set the kernels run with: avx512, avx2 or scalar");
  m.def("set_isa", &backfill::set_active_isa,
        "tests / benchmarks: run the kernels with avx512, avx2 or scalar from now on (never above the CPU's); "
        "False if refused",
        pybind11::arg("name"));
  namespace py = pybind11;
  m.def("digit_form", &backfill::digit_form,
        "whether Q4_0 / Q4_1 / Q4_K / Q8_0 products run in the digit form (exact integer sums a block; AMX where the CPU has it)");
  m.def("set_digit_form", &backfill::set_digit_form,
        "tests / benchmarks: compute Q4_0 / Q4_1 / Q4_K / Q8_0 products in the digit form (True) or as fp32 chains (False) from now on",
        pybind11::arg("on"));
  m.def("amx", &backfill::amx_active, "whether the digit form runs on the AMX tile unit in this process");
  m.def("subnormal_codes", &backfill::subnormal_codes,
        "whether the 4-bit types' codes are read as subnormal floats (measured once per process)");
  m.def("set_subnormal_codes", &backfill::set_subnormal_codes,
        "tests / benchmarks: read the 4-bit codes as subnormals (True) or convert them (False) from now on",
        py::arg("on"));
  m.def("repack", &backfill::repack_weight, "raw GGUF rows -> the kernels' packed layout (into out if given)",
        py::arg("raw"), py::arg("qtype"), py::arg("cols"), py::arg("out") = py::none());
  m.def("packed_bytes", &backfill::packed_size, "bytes of the packed form of a [rows, cols] matrix of qtype",
        py::arg("qtype"), py::arg("rows"), py::arg("cols"));
  m.def("zeros_hugepages", &backfill::zeros_hugepages,
        "a zeroed uint8 CPU tensor of nbytes on transparent huge pages where the OS has them",
        py::arg("nbytes"), py::call_guard<py::gil_scoped_release>());
  m.def("hugepages_enabled", &backfill::hugepages_enabled,
        "whether zeros_hugepages maps 2 MiB-aligned, MADV_HUGEPAGE memory (Linux, BACKFILL_HUGEPAGES != 0)");
  m.def("qlinear", &backfill::qlinear, "y = x @ W^T (+ bias) (+ out if accumulate), W packed", py::arg("x"),
        py::arg("packed"), py::arg("qtype"), py::arg("rows"), py::arg("cols"), py::arg("bias") = py::none(),
        py::arg("out") = py::none(), py::arg("accumulate") = false, py::arg("q8_activations") = false);
  m.def("q8_isa", &backfill::q8_isa,
        "the int8-activation kernels' instruction set: avx512vnni, avx2 or scalar (the same numbers on each)");
  m.def("dequantize", &backfill::dequantize, "raw GGUF rows as fp32 (scalar reference)", py::arg("raw"),
        py::arg("qtype"), py::arg("cols"), py::arg("rows") = py::none());
  m.def("dequantize_packed", &backfill::dequantize_packed, "packed rows as fp32", py::arg("packed"),
        py::arg("qtype"), py::arg("rows"), py::arg("cols"), py::arg("row_ids") = py::none());
  m.def("fma_peak_gflops", &backfill::fma_peak_gflops,
        "fp32 FMA peak of this CPU in GFLOP/s on all intra-op threads (the roofline's compute ceiling)",
        py::arg("rounds") = 20000000, py::arg("repeats") = 3, py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &backfill::argmax_rows, "torch.argmax(logits, dim=-1) of [S, V] fp32, vectorized",
        py::arg("logits"), py::call_guard<py::gil_scoped_release>());
  m.def("inverse_cdf_sample", &backfill::inverse_cdf_sample,
        "per row: searchsorted(probs.cumsum(float64), (1 - u) * sum).clamp_max(V - 1), one pass",
        py::arg("probs"), py::arg("u"), py::call_guard<py::gil_scoped_release>());
  m.def("team_selftest", &backfill::team_selftest,
        "tests: run_team's barriers and error path over torch's pool (see bindings.cpp); the team's size",
        py::arg("rounds"), py::arg("fail_thread") = -1, py::arg("fail_round") = 0,
        py::call_guard<py::gil_scoped_release>());
  backfill::register_decoder(m);
}
