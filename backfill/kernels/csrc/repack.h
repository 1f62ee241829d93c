// GGUF rows <-> the packed tile layout (packed.h), single-threaded pieces; qgemm.cpp threads them.
#pragma once

#include <algorithm>
#include <vector>

#include "packed.h"
#include "qgemm.h"

namespace backfill {

// Tiles [tile_begin, tile_end) of packed(raw) into `out` (the whole packed buffer). Rows past
// raw.rows (the padding of the last tile) are written as all-zero bytes.
void repack_tiles(const QMatrix& raw, uint8_t* out, int64_t tile_begin, int64_t tile_end);

// The inverse, one row: row `row` of the packed matrix back in GGUF layout (row_bytes bytes).
void unpack_row(const PackedMatrix& w, int64_t row, uint8_t* raw_row);

// The scalar kernels of the prepared-x GEMMs (PreparedJob: q8.cpp, digits.cpp): for every output
// n of the job's tiles, its weight row factored (factored_row_ref: codes, and each 32-column
// block's d and m), and for every row i of x acc = row_sum(i, codes, d, m); then y[i, n] = acc
// (+ bias[n]) (+ y[i, n] if accumulating), as the SIMD kernels' epilogue gives it.
template <class Job, class RowSum>
void factored_reference(const Job& job, RowSum&& row_sum) {
  const int64_t K = job.cols, nb = job.x.nb;
  const PackedMatrix w{job.w, job.type, job.rows, K};
  const QMatrix one_row{nullptr, job.type, 1, K, K / block_elems(job.type) * block_bytes(job.type)};
  std::vector<uint8_t> raw(static_cast<size_t>(one_row.row_bytes));  // [row_bytes] GGUF row
  std::vector<float> codes(static_cast<size_t>(K)), dw(static_cast<size_t>(nb)), mw(static_cast<size_t>(nb));
  const int64_t n_end = std::min(job.tile_end * kTileRows, job.rows);
  for (int64_t n = job.tile_begin * kTileRows; n < n_end; ++n) {
    unpack_row(w, n, raw.data());
    QMatrix qm = one_row;
    qm.data = raw.data();
    factored_row_ref(qm, 0, codes.data(), dw.data(), mw.data());
    for (int64_t i = 0; i < job.x.m; ++i) {
      float acc = row_sum(i, codes.data(), dw.data(), mw.data());
      if (job.bias != nullptr) acc = acc + job.bias[n];
      float& out = job.y[i * job.ldy + n];
      out = job.accumulate ? out + acc : acc;
    }
  }
}

}  // namespace backfill
