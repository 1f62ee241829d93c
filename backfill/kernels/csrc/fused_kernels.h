// The decoder step's non-GEMM kernels (attention over the paged KV cache, RMSNorm, SiLU*mul),
// written once in fused_kernels_impl.h over a SIMD width W and compiled per instruction set
// (fused_kernels_avx512.cpp, fused_kernels_avx2.cpp, fused_kernels_sse.cpp). Like isa.h,
// this header includes no torch or STL headers: see isa.h for the ODR reason.
#pragma once

#include <cstdint>

namespace backfill {

// The 16-bit K/V cache elements (`kv_cache_dtype`), each read back exactly as an fp32. Bf16:
// the high half of an fp32's bits (bits << 16). F16: IEEE binary16 (11-bit significands, finite
// up to 65,504: the decoder clamps what it writes). Both written rounded to nearest even (as
// torch's .to()).
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
// The 8-bit ones (OCP FP8, as torch's float8_e4m3fn / float8_e5m2), also read back exactly. E4M3:
// 3-bit significands, finite up to 448 (no infinities; 0x7f / 0xff are NaN); E5M2: 2-bit
// significands, finite up to 57,344 (the top byte of an IEEE half). Written rounded to nearest
// even and clamped to the largest finite value (c10's conversion gives a NaN or an infinity
// past it), as the fp16 cache is.
struct F8E4M3 {
  uint8_t bits;
};
struct F8E5M2 {
  uint8_t bits;
};
enum class KvElement : int8_t { kF32, kBf16, kF16, kF8E4M3, kF8E5M2 };

// Geometry of one layer's attention; query head h reads KV head h / group. The caches
// (contiguous, fp32, bf16, fp16 or fp8 elements: kv_element) hold one panel of block_size x head_dim
// elements per block and KV head:
//   K: [num_blocks, num_kv_heads, head_dim, block_size] (K^T per panel: a decode's scores read
//      a register of consecutive keys for one d as it is, no transposition);
//   V: [num_blocks, num_kv_heads, block_size, head_dim] (a key's V row, read as it is by P . V).
// A panel is contiguous (a stream for the prefetchers), a block all of its panels.
// CpuDecoder.kv_cache_shapes / kv_rows (cpu_decoder.py) give them from Python.
struct AttentionShape {
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t group;  // query heads per KV head
  int64_t block_size;
  float scale;     // softmax scale applied to q.k
  int64_t window;  // sliding window (a query at p sees p - window + 1 .. p); 0: none
  // The caches' element type. The kernels widen a 16- or 8-bit one to fp32 as they read it (exactly),
  // so a row's output is what fp32 caches holding the same (rounded) values give.
  KvElement kv_element = KvElement::kF32;
};
// Bytes of one K or V cache element.
static constexpr int64_t kv_element_bytes(const AttentionShape& s) {
  return s.kv_element == KvElement::kF32 ? 4 : s.kv_element == KvElement::kBf16 || s.kv_element == KvElement::kF16 ? 2 : 1;
}

// One unit of attention work: up to attention_tile_queries(group) consecutive query tokens of one
// sequence against one KV head (all `group` query heads of it), over the keys the queries see
// within [key_begin, key_end). A tile may be cut into its key partitions (see
// kAttentionPartitionKeys), each writing its rows' per-partition state to `partial`, folded
// afterwards by attention_combine in position order.
struct AttentionTile {
  int64_t token;  // flat-batch row of the first query
  int64_t pos;    // its position in the sequence (the rows after it are pos + 1, pos + 2, ...)
  int64_t num_q;  // query tokens in the tile
  int64_t kv_head;
  const int64_t* block_table;  // the sequence's block ids (covers positions 0 .. pos + num_q - 1)
  int64_t key_begin;  // first key position visited (0: from the start, or the window's start)
  int64_t key_end;    // one past the last key position visited (pos + num_q: up to the causal limit)
  // null: write the normalized output rows. Else rows x (D + 2) floats (row r = i * G + g): the
  // row's unnormalized output [D], then its max and sum over [key_begin, key_end), which must
  // lie within one partition.
  float* partial;
  int64_t split;  // partition tiles: the caller's index of the tile they were cut from; else -1
};

// THE INVARIANT: a query row's output is a function of (its q, its position, its window, the
// cached K/V) alone: bit-identical whether it arrives as a decode, inside a prompt chunk of any
// length and offset, alone or batched, on any thread count (for a given kernel table; each ISA
// has its own bits). Every row runs one fixed sequence of IEEE operations, over a key structure
// fixed by absolute positions:
//   - key tiles [64 k, 64 k + 64): each score q . k one fma chain over d = 0 .. D - 1; one
//     online-softmax update (tile max, exp, a fixed summation tree over the tile's 64 slots,
//     rescale); then O += P . V, one fma chain per output element over the keys in order;
//   - partitions [256 m, 256 m + 256): each starts a fresh softmax state; the states are folded
//     in position order (fold_row) and the fold normalized at the end.
// Keys a row does not see (causal, window, or another row's range) get p = 0: their terms add
// exact zeros, so a row visiting more keys than it sees (a chunk's other rows need them)
// computes what it computes alone. The one trace is the sign of an all-zero output element,
// canonicalized to +0 when rows are written. Tiles put rows across SIMD lanes (chunks) or keys
// across lanes (decodes): both run those operations per row and key, lane by lane (see
// "Two layouts, one arithmetic" in fused_kernels_impl.h).
// Partitions also let a long decode (or short chunk) spread over threads: cutting a tile at
// partition boundaries changes only where the fold runs, never its operands.
constexpr int64_t kAttentionPartitionKeys = 256;

// Query tokens per tile: a prompt chunk is cut into tiles of this many tokens (how a chunk is
// cut never changes a row's arithmetic; see above). Up to 128 tokens x G heads share each K/V
// tile read, capped at ~512 rows so a tile's scratch stays in L2.
constexpr int64_t kAttentionTileQueries = 128;
constexpr int64_t kAttentionTileRows = 512;
// NOTE: static (internal linkage): an inline function here would be compiled per ISA unit and
// the linker could keep the AVX-512 copy for every caller (see isa.h).
static constexpr int64_t attention_tile_queries(int64_t group) {
  const int64_t by_rows = kAttentionTileRows / group;
  return by_rows < 1 ? 1 : by_rows < kAttentionTileQueries ? by_rows : kAttentionTileQueries;
}
// Keys per inner tile: one online-softmax update (max, exp, rescale) per row per 64 keys.
constexpr int64_t kAttentionTileKeys = 64;
// Of the K/V that a tile prefetches for its first key tile (and the keys beside the next one's
// that P . V does not take), only the chunks within this many bytes of a 4 KB page's start (0:
// all): on Intel cores 512 (attention_cpu.cpp), each page's first lines, from which the L2's
// streamer fetches the rest without holding the core's few line fill buffers, as every line's
// prefetch did, all at a tile's start. Elsewhere all (measured on Zen 4 / 5 EPYCs, where the
// prefetches made decode attention from memory ~1.4x faster).
int64_t kv_prefetch_page_head();
static_assert(kAttentionPartitionKeys % kAttentionTileKeys == 0, "a partition is whole key tiles");

struct DecoderKernels {
  const char* name;
  int64_t lanes;  // SIMD width W in floats; attention_tile needs head_dim % lanes == 0
  // floats of per-thread scratch attention_tile needs for tiles of up to max_rows rows (query
  // tokens x G; at most attention_tile_queries(G) * G)
  int64_t (*attention_scratch)(const AttentionShape& shape, int64_t max_rows);
  // out rows (token .. token + num_q) x heads of kv_head = softmax(q k^T * scale) v, causal
  // (and windowed) by position. q: row t at q + t * ldq, heads [H][D]; out likewise with ldo.
  // The caches' elements: float, Bf16 or F16 as shape.kv_element says.
  void (*attention_tile)(const AttentionShape& shape, const AttentionTile& tile, const float* q, int64_t ldq,
                         const void* k_cache, const void* v_cache, float* out, int64_t ldo, float* scratch);
  // The out rows of a tile cut into `num_parts` partition tiles, from their partials
  // [num_parts, rows, D + 2] (in position order): the same fold and normalization as an uncut
  // tile runs.
  void (*attention_combine)(const AttentionShape& shape, const AttentionTile& tile, const float* partials,
                            int64_t num_parts, float* out, int64_t ldo);
  // y[n] = x[n] / sqrt(mean(x^2) + eps) * w[n] (statistics in fp32, fixed summation order)
  void (*rms_norm)(const float* x, const float* w, float eps, int64_t n, float* y);
  // y[n] = silu(gate[n]) * up[n]
  void (*silu_mul)(const float* gate, const float* up, int64_t n, float* y);
  // The index of the first maximum of x[0 .. n) (n >= 1, n < 2^31), a NaN counting as the
  // maximum: torch.argmax's answer, in one vectorized pass (greedy sampling).
  int64_t (*argmax)(const float* x, int64_t n);
  // rounds x fma_chains independent vector FMAs from registers (W lanes each): the machine's
  // fp32 peak, timed by the caller on every thread (the roofline's compute ceiling)
  float (*fma_loop)(int64_t rounds);
  int64_t fma_chains;
};

// One table per variant; the dispatcher (decoder.cpp) picks by the CPU and head_dim.
const DecoderKernels& decoder_kernels_avx512();  // W = 16
const DecoderKernels& decoder_kernels_avx2();    // W = 8
const DecoderKernels& decoder_kernels_sse();     // W = 4 (x86-64 baseline: SSE2)

}  // namespace backfill
