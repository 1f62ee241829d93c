// Paged attention of one step on the CPU: the step's sequences cut into tiles (a decode is one
// tile; a prompt chunk one tile per attention_tile_queries(G) tokens, per KV head; a small tile
// over a long context one per key partition), run over torch's intra-op pool with dynamic
// scheduling. Shared by the fused decoder and its own binding.
#include "attention_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "qgemm.h"
#include "team.h"

namespace backfill {

const DecoderKernels& elementwise_kernels() {
  const char* isa = active_isa();
  if (std::strcmp(isa, "avx512") == 0) return decoder_kernels_avx512();
  if (std::strcmp(isa, "avx2") == 0) return decoder_kernels_avx2();
  return decoder_kernels_sse();
}

void argmax_each_row(const float* x, int64_t rows, int64_t cols, int64_t* out) {
  const DecoderKernels& kernels = elementwise_kernels();
  // NOTE: a row is ~10 us; below 16 rows a second thread costs more than it saves.
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = kernels.argmax(x + r * cols, cols);
  });
}

// On a 2-core Sapphire Rapids Xeon (session 65, in-process A/B): 32 decodes over 128 keys, a
// step's attention 7.87 -> 7.55 ms (the same with 256 or 1,024), 8 over 1,024 16.5 -> 15.6, 16
// over 512 17.0 -> 16.6, one over 4,000 the same; the same rule for the next key tile's chunks
// that P . V prefetches made it slower (7.7 -> 8.0 ms): those go out a few at a time.
int64_t kv_prefetch_page_head() {
  static const int64_t bytes = [] {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_is("intel")) return int64_t{512};
#endif
    return int64_t{0};
  }();
  return bytes;
}

const DecoderKernels& attention_kernels(int64_t head_dim) {
  TORCH_CHECK(head_dim % 4 == 0, "the CPU attention kernels need head_dim % 4 == 0, got ", head_dim);
  const DecoderKernels& best = elementwise_kernels();
  if (head_dim % best.lanes == 0) return best;
  if (best.lanes > 8 && head_dim % 8 == 0) return decoder_kernels_avx2();  // the CPU has AVX-512, so AVX2 too
  return decoder_kernels_sse();
}

// Query tiles of at most this many rows (tokens x G) whose keys span several partitions are cut
// into one tile per partition: a decode or a short chunk over a long context then spreads over
// every thread even at batch 1. A choice of work split only: the rows' arithmetic is the same
// cut or not (see fused_kernels.h), so any policy keeps the invariant.
constexpr int64_t kSplitMaxRows = 128;
// A step with less attention work than both of these runs on the calling thread: waking the
// pool would cost about as much as it saves. The FLOPs: rows x keys visited, summed over the
// tiles (~20 us). The bytes: K and V rows read (a decode's G rows share each one, so at a few
// rows a tile the reads bound it: 8 decodes over 128 keys are ~9k row-keys but 2.4 MB of K/V
// per layer, ~0.25 ms on one thread, half that on two).
constexpr int64_t kMinParallelWork = 16384;
constexpr int64_t kMinParallelKvBytes = 65536;

void AttentionPlan::build(const StepMeta& meta, const AttentionShape& shape, int64_t num_blocks) {
  tiles.clear();
  splits.clear();
  unit_start.clear();
  max_rows = 0;
  int64_t num_partial_floats = 0;
  // Tiles as built, unit after unit (a unit: the same queries and keys on every KV head), with
  // the offset in `partials` of each cut tile's state (-1: not cut); sorted into `tiles` below.
  std::vector<AttentionTile> built;
  std::vector<int64_t> built_partial;
  std::vector<int64_t> built_start;
  const int64_t num_seqs = meta.num_seqs, part_keys = kAttentionPartitionKeys, num_heads = shape.num_kv_heads;
  TORCH_CHECK(meta.query_start[0] == 0, "query_start[0] must be 0");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_begin = meta.query_start[s], num_q = meta.query_start[s + 1] - q_begin;
    const int64_t seq_len = meta.seq_lens[s];
    const int64_t seq = meta.first_seq + s;  // the step's index, for errors
    TORCH_CHECK(num_q >= 1 && seq_len >= num_q, "sequence ", seq, ": query length ", num_q, ", seq_len ", seq_len);
    const int64_t blocks_needed = (seq_len + shape.block_size - 1) / shape.block_size;
    TORCH_CHECK(blocks_needed <= meta.max_blocks, "sequence ", seq, ": block table too short for ", seq_len, " tokens");
    const int64_t* table = meta.block_tables + s * meta.max_blocks;
    for (int64_t b = 0; b < blocks_needed; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "sequence ", seq, ": block id ", table[b], " out of range");
    const int64_t pos0 = seq_len - num_q, tile_queries = attention_tile_queries(shape.group);
    for (int64_t i = 0; i < num_q; i += tile_queries) {
      const int64_t n = std::min(tile_queries, num_q - i), pos = pos0 + i, end = pos + n;
      // keys [first_key, end): from the window's start of the tile's first query
      const int64_t first_key = shape.window > 0 ? std::max<int64_t>(0, pos - shape.window + 1) : 0;
      const int64_t num_parts = (end - 1) / part_keys - first_key / part_keys + 1;
      const int64_t rows = n * shape.group, partial_floats = rows * (shape.head_dim + 2);
      max_rows = std::max(max_rows, rows);
      if (num_parts == 1 || rows > kSplitMaxRows) {
        built_start.push_back(static_cast<int64_t>(built.size()));
        for (int64_t h = 0; h < num_heads; ++h) {
          built.push_back({q_begin + i, pos, n, h, table, first_key, end, nullptr, -1});
          built_partial.push_back(-1);
        }
        continue;
      }
      // one split per KV head, its partitions' states [num_parts, rows, D + 2] in a row
      const int64_t first_split = static_cast<int64_t>(splits.size());
      for (int64_t h = 0; h < num_heads; ++h) {
        const AttentionTile whole{q_begin + i, pos, n, h, table, first_key, end, nullptr, -1};
        splits.push_back({whole, num_partial_floats, num_parts, num_parts});
        num_partial_floats += num_parts * partial_floats;
      }
      for (int64_t part = 0; part < num_parts; ++part) {
        const int64_t begin = std::max(first_key, (first_key / part_keys + part) * part_keys);
        const int64_t stop = std::min(end, (first_key / part_keys + part + 1) * part_keys);
        built_start.push_back(static_cast<int64_t>(built.size()));
        for (int64_t h = 0; h < num_heads; ++h) {
          const Split& split = splits[static_cast<size_t>(first_split + h)];
          built.push_back({q_begin + i, pos, n, h, table, begin, stop, nullptr, first_split + h});
          built_partial.push_back(split.first_partial + part * partial_floats);
        }
      }
    }
  }
  TORCH_CHECK(meta.query_start[num_seqs] == meta.num_tokens, "query_start[-1] must equal the number of tokens");
  if (static_cast<int64_t>(partials.size()) < num_partial_floats) partials.resize(static_cast<size_t>(num_partial_floats));
  // Longest units first, so that the dynamic schedule ends with small ones (order never
  // changes a tile's arithmetic). A unit's tiles all cost the same.
  auto span = [](const AttentionTile& t) { return std::min(t.key_end, t.pos + t.num_q) - t.key_begin; };
  auto cost = [&](const AttentionTile& t) {
    return t.num_q * shape.group * (shape.window > 0 ? std::min(span(t), shape.window + t.num_q) : span(t));
  };
  const int64_t num_units = static_cast<int64_t>(built_start.size());
  built_start.push_back(static_cast<int64_t>(built.size()));
  std::vector<int64_t> order(static_cast<size_t>(num_units));
  for (int64_t u = 0; u < num_units; ++u) order[static_cast<size_t>(u)] = u;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return cost(built[static_cast<size_t>(built_start[a])]) > cost(built[static_cast<size_t>(built_start[b])]);
  });
  tiles.reserve(built.size());
  total_work = 0;
  total_kv_bytes = 0;
  for (const int64_t u : order) {
    unit_start.push_back(static_cast<int64_t>(tiles.size()));
    for (int64_t i = built_start[u]; i < built_start[u + 1]; ++i) {
      AttentionTile t = built[static_cast<size_t>(i)];
      const int64_t offset = built_partial[static_cast<size_t>(i)];
      if (offset >= 0) t.partial = partials.data() + offset;
      tiles.push_back(t);
      total_work += cost(t);
      total_kv_bytes += 2 * span(t) * shape.head_dim * kv_element_bytes(shape);
    }
  }
  unit_start.push_back(static_cast<int64_t>(tiles.size()));
  // A unit's tiles read the same blocks (a block holds every KV head's panel), so its first tile
  // names them; prompt tiles of one sequence share their first blocks: each is kept once.
  prefetch_blocks.clear();
  const int64_t block_kv_bytes = 2 * shape.block_size * shape.num_kv_heads * shape.head_dim * kv_element_bytes(shape);
  const int64_t max_blocks = prefetch_budget / block_kv_bytes;
  if (max_blocks > 0) {
    std::vector<bool> seen(static_cast<size_t>(num_blocks), false);
    for (int64_t u = 0; u < num_units && static_cast<int64_t>(prefetch_blocks.size()) < max_blocks; ++u) {
      const AttentionTile& t = tiles[static_cast<size_t>(unit_start[static_cast<size_t>(u)])];
      const int64_t last_key = std::min(t.key_end, t.pos + t.num_q) - 1;
      for (int64_t b = t.key_begin / shape.block_size; b <= last_key / shape.block_size; ++b) {
        const int64_t id = t.block_table[b];
        if (seen[static_cast<size_t>(id)]) continue;
        seen[static_cast<size_t>(id)] = true;
        prefetch_blocks.push_back(id);
        if (static_cast<int64_t>(prefetch_blocks.size()) == max_blocks) break;
      }
    }
  }
}

void AttentionPlan::run(const DecoderKernels& kernels, const AttentionShape& shape, const float* q, int64_t ldq,
                        const void* k_cache, const void* v_cache, float* out, int64_t ldo, const Team* team) {
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  const int64_t num_units = static_cast<int64_t>(unit_start.size()) - 1;
  const int64_t threads = team != nullptr ? team->size : at::get_num_threads();
  const bool parallel = total_work >= kMinParallelWork || total_kv_bytes >= kMinParallelKvBytes;
  // Work items: whole units when there are enough to keep every thread busy (a worker then
  // reads all KV heads of the same tokens, whose panels share each block's pages), single
  // tiles otherwise.
  const bool by_unit = num_units >= 2 * threads;
  const int64_t num_items = by_unit ? num_units : num_tiles;
  const int64_t num_workers = parallel ? std::max<int64_t>(1, std::min<int64_t>(threads, num_items)) : 1;
  const int64_t per_worker = kernels.attention_scratch(shape, max_rows);
  if (team == nullptr || team->index == 0) {
    if (static_cast<int64_t>(scratch.size()) < num_workers * per_worker)
      scratch.resize(static_cast<size_t>(num_workers * per_worker));
    for (Split& split : splits) split.pending = split.num_parts;
    __atomic_store_n(&next_item, 0, __ATOMIC_RELAXED);
  }
  if (team != nullptr) team->sync();  // the scratch, counts and counter above, for every worker
  // Each worker takes items off a shared counter until none are left. A cut tile's rows are
  // combined by the worker that finishes its last partition (the acq_rel count makes the other
  // workers' partials visible to it): no second pass over the pool.
  auto work = [&](int64_t w) {
    float* mine = scratch.data() + w * per_worker;
    for (int64_t item = __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED); item < num_items;
         item = __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED)) {
      const int64_t first = by_unit ? unit_start[static_cast<size_t>(item)] : item;
      const int64_t last = by_unit ? unit_start[static_cast<size_t>(item) + 1] : item + 1;
      for (int64_t i = first; i < last; ++i) {
        const AttentionTile& tile = tiles[static_cast<size_t>(i)];
        kernels.attention_tile(shape, tile, q, ldq, k_cache, v_cache, out, ldo, mine);
        if (tile.split < 0) continue;
        Split& split = splits[static_cast<size_t>(tile.split)];
        if (__atomic_sub_fetch(&split.pending, 1, __ATOMIC_ACQ_REL) == 0)
          kernels.attention_combine(shape, split.tile, partials.data() + split.first_partial, split.num_parts,
                                    out, ldo);
      }
    }
  };
  if (team != nullptr) {
    if (team->index < num_workers) work(team->index);
    return;
  }
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) work(w);
  });
}

}  // namespace backfill
