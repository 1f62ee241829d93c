// Python bindings of the CPU kernels (a pybind11 module built by torch.utils.cpp_extension).
#include <torch/extension.h>

#include "qgemm.h"

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

// x [M, K] fp32 (rows may be strided) -> y [M, N] fp32
torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t cols,
                      const c10::optional<torch::Tensor>& bias) {
  const QMatrix q = as_qmatrix(w, qtype, cols);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x must be 2-D fp32 on CPU");
  TORCH_CHECK(x.size(1) == cols && x.stride(1) == 1, "x must be [M, ", cols, "] with unit inner stride");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == q.rows,
                "bias must be contiguous fp32 [N]");
    b = bias->data_ptr<float>();
  }
  torch::Tensor y = torch::empty({x.size(0), q.rows}, x.options());
  if (x.size(0) > 0) qgemm(x.data_ptr<float>(), x.size(0), x.stride(0), q, b, y.data_ptr<float>(), q.rows);
  return y;
}

// rows [R] int64 (or all rows) -> [R, cols] fp32
torch::Tensor dequantize(const torch::Tensor& w, int64_t qtype, int64_t cols, const c10::optional<torch::Tensor>& rows) {
  const QMatrix q = as_qmatrix(w, qtype, cols);
  torch::Tensor index = rows.has_value() ? rows->contiguous() : torch::arange(q.rows, torch::kInt64);
  TORCH_CHECK(index.scalar_type() == torch::kInt64 && index.dim() == 1, "rows must be 1-D int64");
  if (index.numel() > 0) {
    TORCH_CHECK(index.min().item<int64_t>() >= 0 && index.max().item<int64_t>() < q.rows, "row index out of range");
  }
  torch::Tensor out = torch::empty({index.numel(), cols}, torch::kFloat32);
  dequantize_rows(q, index.data_ptr<int64_t>(), index.numel(), out.data_ptr<float>(), cols);
  return out;
}

}  // namespace

void register_decoder(pybind11::module& m);  // decoder.cpp

}  // namespace backfill

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "backfill CPU kernels: linear layers over GGUF-quantized weights, fused decoder steps";
  m.def("isa", &backfill::active_isa, "instruction set the kernels run with: avx512, avx2 or scalar");
  m.def("qlinear", &backfill::qlinear, "y = x @ W^T (+ bias) with W as stored (ggml type)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("qtype"), pybind11::arg("cols"),
        pybind11::arg("bias") = pybind11::none());
  m.def("dequantize", &backfill::dequantize, "rows of W as fp32", pybind11::arg("weight"), pybind11::arg("qtype"),
        pybind11::arg("cols"), pybind11::arg("rows") = pybind11::none());
  backfill::register_decoder(m);
}
