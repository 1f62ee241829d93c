// Paged attention of a whole step (torch side: threads, checks); the math is in fused_kernels.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

#include "fused_kernels.h"

namespace backfill {

struct Team;  // team.h

// The kernels table for norms and SiLU (the best the CPU runs) and for attention (the widest
// whose SIMD width divides head_dim; head_dim % 4 == 0 is required).
const DecoderKernels& elementwise_kernels();
const DecoderKernels& attention_kernels(int64_t head_dim);
// out[r] = the index of row r's first maximum in x [rows, cols] (torch.argmax; NaN is the
// maximum), over torch's threads from 16 rows on.
void argmax_each_row(const float* x, int64_t rows, int64_t cols, int64_t* out);

// One step's sequences, as raw views of AttentionMetadata's int64 tensors.
struct StepMeta {
  int64_t num_tokens;           // T
  int64_t num_seqs;             // S
  const int64_t* query_start;   // [S + 1]
  const int64_t* seq_lens;      // [S], tokens in the cache after this step
  const int64_t* block_tables;  // [S, max_blocks]
  int64_t max_blocks;
  int64_t first_seq = 0;        // the step's index of sequence 0 here (a row shard's), for errors
};

// The step's attention work list, built once per step (checked against the cache size) and
// run once per layer. Holds the per-worker scratch between steps.
struct AttentionPlan {
  // A tile cut at partition boundaries (kAttentionPartitionKeys) into `num_parts` tiles whose
  // partials are folded in position order once all have run.
  struct Split {
    AttentionTile tile;     // the uncut tile (token, num_q, kv_head: where its rows go)
    int64_t first_partial;  // offset in `partials` of its first partition's [rows, D + 2] floats
    int64_t num_parts;
    int64_t pending;        // partitions not yet run this layer (__atomic_* only): the last one combines
  };
  std::vector<AttentionTile> tiles;  // unit after unit, the longest units first
  std::vector<int64_t> unit_start;   // [units + 1]: a unit's tiles are tiles[unit_start[u] : unit_start[u + 1]]
  std::vector<Split> splits;
  std::vector<float> partials;  // per split: [num_parts, rows, D + 2]
  std::vector<float> scratch;   // [workers, attention_scratch(shape, max_rows)]
  int64_t max_rows = 0;         // the most rows (query tokens x G) of any tile
  int64_t total_work = 0;       // rows x keys visited, summed over the tiles
  int64_t total_kv_bytes = 0;   // K and V bytes the tiles read (a window may read less)
  // The KV block ids the tiles read, each once, in the order the workers take them, up to
  // `prefetch_budget` bytes of K and V (0: none): what a caller may prefetch for a layer.
  int64_t prefetch_budget = 0;
  std::vector<int64_t> prefetch_blocks;
  int64_t next_item = 0;  // run's work counter (__atomic_* only)

  void build(const StepMeta& meta, const AttentionShape& shape, int64_t num_blocks);
  // out[t, h, :] for every token t and query head h (q, out: [T, H * D] rows of stride ldq, ldo).
  // The caches' elements as shape.kv_element says. `team` (optional): run by every
  // thread of a team, each a worker; returns without a final barrier (the caller syncs before
  // reading out).
  void run(const DecoderKernels& kernels, const AttentionShape& shape, const float* q, int64_t ldq,
           const void* k_cache, const void* v_cache, float* out, int64_t ldo, const Team* team = nullptr);
};

}  // namespace backfill
