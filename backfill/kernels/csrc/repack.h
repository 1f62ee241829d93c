// GGUF rows <-> the packed tile layout (packed.h), single-threaded pieces; qgemm.cpp threads them.
#pragma once

#include "packed.h"
#include "qgemm.h"

namespace backfill {

// Tiles [tile_begin, tile_end) of packed(raw) into `out` (the whole packed buffer). Rows past
// raw.rows (the padding of the last tile) are written as all-zero bytes.
void repack_tiles(const QMatrix& raw, uint8_t* out, int64_t tile_begin, int64_t tile_end);

// The inverse, one row: row `row` of the packed matrix back in GGUF layout (row_bytes bytes).
void unpack_row(const PackedMatrix& w, int64_t row, uint8_t* raw_row);

}  // namespace backfill
