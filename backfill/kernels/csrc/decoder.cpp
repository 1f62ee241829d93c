// The fused decoder step: one Python -> C++ call runs every layer of a Llama-family decoder for
// all T tokens of an engine step (decodes and prompt chunks mixed), reading the weights through
// the packed linear kernels (qgemm.h), and writes the step's K/V into the paged caches.
// Registered on the module by bindings.cpp (register_decoder).
//
// Per layer, over the whole step (x is the residual stream [T, hidden], kept in place):
//   xn = rms_norm(x) ; qkv = xn @ Wqkv^T (+ b) ; rope(q, k) + write k, v to the caches (one pass)
//   attn = paged attention ; x += attn @ Wo^T (packed_gemm accumulates into x)
//   xn = rms_norm(x) ; gu = xn @ Wgu^T ; act = silu(gate) * up ; x += act @ Wdown^T
// Every per-row operation runs in a fixed order that depends on that row alone, attention's
// included (its arithmetic per query row is fixed by absolute positions, see fused_kernels.h):
// a sequence's results never depend on its companions, on the thread count, or on how its
// tokens were cut into steps (the linear kernels guarantee the same for their rows).
//
// Threads: a step of many short queries (decodes) is cut into row shards, runs of whole
// sequences, one per thread, each taken through every layer by its thread alone (the threads
// meet once a step; weights are read by each, from the shared L3 or memory, which at these
// batch sizes has the bandwidth to spare). Other steps run each operation over all the threads,
// as one team (team.h): one fork and join a step, a barrier where an operation reads another
// thread's output.
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_cpu.h"
#include "q8.h"
#include "qgemm.h"
#include "team.h"

namespace backfill {
namespace {

namespace py = pybind11;
using Clock = std::chrono::steady_clock;
// (packed uint8 tensor from repack(), ggml type id, rows, cols)
using SegmentArg = std::tuple<torch::Tensor, int64_t, int64_t, int64_t>;
using KVCache = std::tuple<torch::Tensor, torch::Tensor>;

// A KV cache tensor's element type as the attention kernels name it (none: not one they read).
std::optional<KvElement> kv_element_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return KvElement::kF32;
    case torch::kBFloat16: return KvElement::kBf16;
    case torch::kHalf: return KvElement::kF16;
    case torch::kFloat8_e4m3fn: return KvElement::kF8E4M3;
    case torch::kFloat8_e5m2: return KvElement::kF8E5M2;
    default: return std::nullopt;
  }
}

// A value as a cache element (see rope_and_write_kv).
template <typename CacheT>
CacheT to_cache(float x) {
  if constexpr (std::is_same_v<CacheT, c10::Half>) return c10::Half(std::clamp(x, -65504.0f, 65504.0f));
  else if constexpr (std::is_same_v<CacheT, c10::Float8_e4m3fn>) return c10::Float8_e4m3fn(std::clamp(x, -448.0f, 448.0f));
  else if constexpr (std::is_same_v<CacheT, c10::Float8_e5m2>) return c10::Float8_e5m2(std::clamp(x, -57344.0f, 57344.0f));
  else return static_cast<CacheT>(x);
}

const float* fp32_data(const torch::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == numel,
              what, " must be a contiguous fp32 CPU tensor of ", numel, " elements");
  return t.data_ptr<float>();
}

const int64_t* int64_data(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kInt64 && t.is_contiguous(), what,
              " must be a contiguous int64 CPU tensor");
  return t.data_ptr<int64_t>();
}

// A linear layer y[:, 0:rows] = x @ W^T (+ bias), W stored as row segments of possibly
// different types (e.g. fused qkv from Q4_K q/k and Q6_K v), each writing its own columns of y.
struct Linear {
  struct Segment {
    torch::Tensor data;  // keeps the packed bytes alive
    PackedMatrix matrix;
    int64_t row_offset;
  };
  std::vector<Segment> segments;
  torch::Tensor bias;  // [rows] fp32 or undefined
  int64_t rows = 0;
  int64_t cols = 0;

  int64_t bytes() const {
    int64_t n = 0;
    for (const Segment& s : segments) n += s.data.numel();
    return n;
  }

  // side: memory to prefetch as it runs (see packed_gemm), given to the first segment. team:
  // this thread's share of every segment (no barrier, see packed_gemm).
  void run(const float* x, int64_t m, int64_t ldx, float* y, int64_t ldy, bool accumulate,
           const SidePrefetch* side = nullptr, const Team* team = nullptr) const {
    const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
    for (const Segment& s : segments) {
      packed_gemm(x, m, ldx, s.matrix, b == nullptr ? nullptr : b + s.row_offset, y + s.row_offset, ldy, accumulate,
                  &s == &segments.front() ? side : nullptr, team);
    }
  }
};

Linear make_linear(const std::vector<SegmentArg>& segments, const c10::optional<torch::Tensor>& bias, int64_t rows,
                   int64_t cols, const char* what) {
  Linear lin;
  lin.rows = rows;
  lin.cols = cols;
  int64_t offset = 0;
  for (const SegmentArg& arg : segments) {
    const torch::Tensor& data = std::get<0>(arg);
    const QType type = static_cast<QType>(std::get<1>(arg));
    const int64_t seg_rows = std::get<2>(arg), seg_cols = std::get<3>(arg);
    TORCH_CHECK(block_elems(type) > 0 && seg_cols == cols && cols % block_elems(type) == 0, what,
                ": segment of type ", std::get<1>(arg), " with ", seg_cols, " columns, expected ", cols);
    TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == torch::kUInt8 && data.is_contiguous() &&
                    data.numel() == packed_bytes(type, seg_rows, seg_cols),
                what, ": packed segment must be the contiguous uint8 tensor repack() returned");
    lin.segments.push_back({data, PackedMatrix{data.data_ptr<uint8_t>(), type, seg_rows, seg_cols}, offset});
    offset += seg_rows;
  }
  TORCH_CHECK(offset == rows, what, ": segments hold ", offset, " rows, expected ", rows);
  if (bias.has_value() && bias->defined()) {
    fp32_data(*bias, rows, "bias");
    lin.bias = *bias;
  }
  return lin;
}

struct Layer {
  torch::Tensor input_norm;  // [hidden]
  torch::Tensor post_norm;   // [hidden]
  Linear qkv;                // [(H + 2 Hkv) * D, hidden]
  Linear o_proj;             // [hidden, H * D]
  Linear gate_up;            // [2 * intermediate, hidden]
  Linear down;               // [hidden, intermediate]
};

// Grow-only scratch: a step larger than any before reallocates (rounded up, so growing
// prompt chunks do not reallocate every step); others reuse the memory without page faults.
float* ensure(std::vector<float>& buf, int64_t numel) {
  if (static_cast<int64_t>(buf.size()) < numel) buf.resize(static_cast<size_t>(numel + numel / 4));
  return buf.data();
}

// The most bytes of one layer's K/V worth prefetching ahead of its attention: a quarter of the L3
// cache (this core's slice: sysfs, not sysconf, which on an EPYC reports every CCD's L3
// together), at most 16 MB; 8 MB where unknown. On Intel cores 1 MB: there a software prefetch
// holds one of the core's few line fill buffers until its line arrives, and the MLP's GEMMs wait
// for them. On a 2-core Xeon with AVX-512 and AMX (session 61, one process, interleaved) 32
// decodes at 400 tokens of context stepped in 58.8 ms with 1 MB a shard against 64.3 with the
// ~5.4 MB the MLP's idle bus allowed (linears 34.3 -> 28.6 ms, attention ~1 ms slower) and 58.9
// with none; 16 decodes 5% faster, 8 the same; 64 mixed requests served ~4.5% faster. On the
// Zen 4 / 5 EPYCs it was measured on, more K/V prefetched was better up to all of it.
int64_t default_kv_prefetch_cap() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_is("intel")) return int64_t{1} << 20;
#endif
  int64_t l3 = 0;
  if (FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r")) {
    long kb = 0;
    char unit = 0;
    if (std::fscanf(f, "%ld%c", &kb, &unit) >= 1) l3 = kb * (unit == 'M' ? 1024 * 1024 : 1024);
    std::fclose(f);
  }
  return l3 > 0 ? std::min<int64_t>(l3 / 4, int64_t{16} << 20) : int64_t{8} << 20;
}

// FLOPs a CPU runs in the time it reads one byte from memory, a high estimate (a 2-core Zen 5
// EPYC: ~490 GFLOP/s over ~40 GB/s, 12; an Ice Lake Xeon ~10): an MLP of T rows leaves the
// memory bus idle for about 2 T P / 12 - W bytes' worth of reads (P weights, W their bytes).
constexpr int64_t kFlopsPerByte = 12;

// Row shards (FusedDecoder::plan_shards): at least this many tokens a shard (and 2 per shard
// as many shards there are: each shard reads and dequantizes every weight, from the shared L3
// at best, from memory at worst, and a shard of a few rows brings in little of its attention's
// K/V under its MLP, see plan_attention; on 2 threads of a Zen 5 EPYC 8 decodes ran ~6% faster
// unsharded, 10 ~2%, and 12 ~2% faster sharded; on its AVX2 kernels 8-16 were even), no sequence
// with more query tokens than this (a prompt chunk's rows are better split by columns, over the
// threads one operation at a time).
constexpr int64_t kShardMinRows = 6;
// The same where the MLP runs in the digit form (digits.h), whose vector dots prepare x per thread
// (a team's threads each all the rows): on a 2-core Sapphire Rapids Xeon 8 decodes ran 6% faster
// in two shards, 10 3% (the FMA kernels: 8 4% slower, 10 4% faster).
constexpr int64_t kDigitShardMinRows = 4;
constexpr int64_t kShardMaxQueries = 16;
// Steps of at most this many tokens prefetch the cache lines of their K/V writes (prefetch_kv_slots).
constexpr int64_t kPrefetchKvSlotsMaxTokens = 4;
// The most of its share of the next linear's weights a thread prefetches while it waits at a
// barrier (run_shard): a few microseconds' worth, well inside L2.
constexpr int64_t kWaitPrefetchBytes = 256 * 1024;
// Tokens a RoPE + K/V write call is worth a thread for over torch's pool (a fork); a team's
// threads split any two (a decode's write costs ~0.6-1.4 us a token a layer: on one thread of
// two, batch 8 ran 2% slower, batches 2 and 4 0.6%).
constexpr int64_t kRopeGrain = 32;
inline int64_t rope_grain(const Team* team) { return team != nullptr ? 1 : kRopeGrain; }
// Rows an RMSNorm or SiLU-mul call is worth a thread for.
constexpr int64_t kNormGrain = 64, kSiluGrain = 16;

class FusedDecoder {
 public:
  FusedDecoder(int64_t vocab_size, int64_t hidden, int64_t intermediate, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, double eps)
      : vocab_(vocab_size), hidden_(hidden), intermediate_(intermediate), num_heads_(num_heads),
        num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(static_cast<float>(eps)),
        elementwise_(elementwise_kernels()), attention_(attention_kernels(head_dim)) {
    TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  }

  void set_embedding(const SegmentArg& table) {
    embedding_ = make_linear({table}, c10::nullopt, vocab_, hidden_, "embedding");
  }
  void set_lm_head(const std::vector<SegmentArg>& head) {
    lm_head_ = make_linear(head, c10::nullopt, vocab_, hidden_, "lm_head");
    mark_q8(lm_head_);
  }
  void set_final_norm(const torch::Tensor& weight) {
    fp32_data(weight, hidden_, "norm weight");
    final_norm_ = weight;
  }
  void add_layer(const torch::Tensor& input_norm, const torch::Tensor& post_norm, const std::vector<SegmentArg>& qkv,
                 const c10::optional<torch::Tensor>& qkv_bias, const std::vector<SegmentArg>& o_proj,
                 const std::vector<SegmentArg>& gate_up, const std::vector<SegmentArg>& down) {
    fp32_data(input_norm, hidden_, "input_layernorm weight");
    fp32_data(post_norm, hidden_, "post_attention_layernorm weight");
    layers_.push_back({input_norm, post_norm,
                       make_linear(qkv, qkv_bias, (num_heads_ + 2 * num_kv_heads_) * head_dim_, hidden_, "qkv_proj"),
                       make_linear(o_proj, c10::nullopt, hidden_, num_heads_ * head_dim_, "o_proj"),
                       make_linear(gate_up, c10::nullopt, 2 * intermediate_, hidden_, "gate_up_proj"),
                       make_linear(down, c10::nullopt, hidden_, intermediate_, "down_proj")});
    Layer& l = layers_.back();
    for (Linear* lin : {&l.qkv, &l.o_proj, &l.gate_up, &l.down}) {
      layer_weights_ += lin->rows * lin->cols;
      mark_q8(*lin);
    }
  }

  // Opt-in: the linears (the LM head too) of the types q8.h computes take x quantized to int8;
  // the embedding lookup stays exact. Not for use mid-step.
  bool q8_activations() const { return q8_activations_; }
  void set_q8_activations(bool on) {
    q8_activations_ = on;
    for (Layer& l : layers_)
      for (Linear* lin : {&l.qkv, &l.o_proj, &l.gate_up, &l.down}) mark_q8(*lin);
    mark_q8(lm_head_);
  }
  // Row segments (of the layers' linears and the LM head) the int8 path applies to: those of the
  // types q8_activation_type names, whether or not it is on.
  int64_t q8_matrices() const {
    int64_t n = 0;
    const auto count = [&n](const Linear& lin) {
      for (const Linear::Segment& s : lin.segments) n += q8_activation_type(s.matrix.type) ? 1 : 0;
    };
    for (const Layer& l : layers_)
      for (const Linear* lin : {&l.qkv, &l.o_proj, &l.gate_up, &l.down}) count(*lin);
    count(lm_head_);
    return n;
  }

  // Runs every layer over the step's T tokens, writing their K/V into `kv_caches`; returns the
  // final-normed hidden states [T, hidden] (or only `rows` [R] int64 of them: [R, hidden]).
  // input_ids, positions, slot_mapping: [T] int64; cos, signed_sin: [P, D] fp32 RoPE tables
  // by position; block_tables [S, max_blocks], seq_lens [S], query_start [S + 1] int64 (as
  // AttentionMetadata); window: sliding window or 0. Every index is checked before use.
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& positions, const torch::Tensor& cos,
                        const torch::Tensor& signed_sin,
                        const std::vector<KVCache>& kv_caches, const torch::Tensor& slot_mapping,
                        const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                        const torch::Tensor& query_start, int64_t window, const c10::optional<torch::Tensor>& rows) {
    std::lock_guard<std::mutex> guard(mutex_);  // the scratch buffers serve one step at a time
    run_layers(input_ids, positions, cos, signed_sin, kv_caches, slot_mapping, block_tables, seq_lens, query_start,
               window);
    const int64_t num_tokens = input_ids.numel();
    const int64_t* index = nullptr;
    int64_t num_out = num_tokens;
    if (rows.has_value() && rows->defined()) {
      index = int64_data(*rows, "rows");
      num_out = rows->numel();
      for (int64_t i = 0; i < num_out; ++i)
        TORCH_CHECK(index[i] >= 0 && index[i] < num_tokens, "rows: index ", index[i], " out of range");
    }
    torch::Tensor out = torch::empty({num_out, hidden_}, torch::kFloat32);  // [R, hidden]
    final_norm(index, num_out, out.data_ptr<float>());
    return out;
  }

  // The KV caches `decode` runs on, one (k_cache, v_cache) pair per layer (checked here, once).
  void bind_kv_caches(const std::vector<KVCache>& kv_caches) {
    std::lock_guard<std::mutex> guard(mutex_);
    check_kv_caches(kv_caches);
    bound_caches_ = kv_caches;
  }

  // A step of decodes (one token a sequence) on the bound caches, from plain lists: sequence i's
  // token ids[i] at position positions[i] (its seq_len positions[i] + 1), its block table
  // block_tables[i] (covering that position: its K/V go into the position's slot); cos,
  // signed_sin and window as forward. Every row samples: returns logits [S, vocab] fp32, or with
  // `greedy` each row's argmax (as torch.argmax: the first maximum) and no logits. The same
  // arithmetic as forward + logits; what it saves is the Python of a step: no tensor is built to
  // call it, and the tables are padded and the slots found here.
  std::tuple<torch::Tensor, std::vector<int64_t>> decode(const std::vector<int64_t>& ids,
                                                         const std::vector<int64_t>& positions,
                                                         const std::vector<std::vector<int64_t>>& block_tables,
                                                         const torch::Tensor& cos, const torch::Tensor& signed_sin,
                                                         int64_t window, bool greedy) {
    std::lock_guard<std::mutex> guard(mutex_);
    const int64_t num_seqs = static_cast<int64_t>(ids.size());
    TORCH_CHECK(!bound_caches_.empty(), "decode needs bind_kv_caches first");
    TORCH_CHECK(num_seqs > 0 && static_cast<int64_t>(positions.size()) == num_seqs &&
                    static_cast<int64_t>(block_tables.size()) == num_seqs,
                "decode: ids, positions and block tables one per sequence");
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == head_dim_, "cos must be [P, head_dim]");
    const int64_t num_blocks = std::get<0>(bound_caches_[0]).size(0), block_size = std::get<0>(bound_caches_[0]).size(3);
    int64_t max_blocks = 1;
    for (const std::vector<int64_t>& table : block_tables)
      max_blocks = std::max(max_blocks, static_cast<int64_t>(table.size()));
    decode_tables_.assign(static_cast<size_t>(num_seqs * max_blocks), 0);  // [S, max_blocks], 0-padded
    decode_slots_.resize(static_cast<size_t>(num_seqs));
    decode_seq_lens_.resize(static_cast<size_t>(num_seqs));
    decode_query_start_.resize(static_cast<size_t>(num_seqs + 1));
    for (int64_t i = 0; i < num_seqs; ++i) {
      const std::vector<int64_t>& table = block_tables[static_cast<size_t>(i)];
      const int64_t pos = positions[static_cast<size_t>(i)];
      TORCH_CHECK(pos >= 0 && pos / block_size < static_cast<int64_t>(table.size()), "position ", pos,
                  " past its block table (", table.size(), " blocks of ", block_size, ")");
      const int64_t block = table[static_cast<size_t>(pos / block_size)];  // (the plan checks the others)
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", i, ": block id ", block, " out of range");
      std::copy(table.begin(), table.end(), decode_tables_.begin() + i * max_blocks);
      decode_slots_[static_cast<size_t>(i)] = block * block_size + pos % block_size;
      decode_seq_lens_[static_cast<size_t>(i)] = pos + 1;
    }
    for (int64_t i = 0; i <= num_seqs; ++i) decode_query_start_[static_cast<size_t>(i)] = i;
    const StepMeta meta{num_seqs, num_seqs, decode_query_start_.data(), decode_seq_lens_.data(), decode_tables_.data(),
                        max_blocks};
    run_step({num_seqs, ids.data(), positions.data(), decode_slots_.data(), meta, fp32_data(cos, cos.numel(), "cos"),
              fp32_data(signed_sin, cos.numel(), "signed_sin"), cos.size(0), window, &bound_caches_});
    float* hidden = ensure(decode_hidden_, num_seqs * hidden_);  // [S, hidden]
    final_norm(nullptr, num_seqs, hidden);
    torch::Tensor logits;
    float* out;
    if (greedy) {
      out = ensure(decode_logits_, num_seqs * vocab_);  // [S, vocab], read here only
    } else {
      logits = torch::empty({num_seqs, vocab_}, torch::kFloat32);
      out = logits.data_ptr<float>();
    }
    run_lm_head(hidden, num_seqs, hidden_, out);
    std::vector<int64_t> tokens;
    if (greedy) {
      tokens.resize(static_cast<size_t>(num_seqs));
      argmax_each_row(out, num_seqs, vocab_, tokens.data());
    }
    return {logits, tokens};
  }

  // hidden [S, hidden] fp32 (rows already selected) -> logits [S, vocab] fp32.
  torch::Tensor logits(const torch::Tensor& hidden) {
    TORCH_CHECK(hidden.device().is_cpu() && hidden.scalar_type() == torch::kFloat32 && hidden.dim() == 2 &&
                    hidden.size(1) == hidden_ && hidden.stride(1) == 1,
                "hidden must be [S, ", hidden_, "] fp32 with unit inner stride");
    torch::Tensor out = torch::empty({hidden.size(0), vocab_}, torch::kFloat32);  // [S, vocab]
    if (hidden.size(0) > 0)
      run_lm_head(hidden.data_ptr<float>(), hidden.size(0), hidden.stride(0), out.data_ptr<float>());
    return out;
  }

  // Bytes of a layer's K/V the step may prefetch while the layer before runs its o_proj and MLP
  // (at most; 0: none). Benchmarks and tests compare with and without; it never changes a result.
  void set_kv_prefetch_cap(int64_t bytes) { kv_prefetch_cap_ = std::max<int64_t>(0, bytes); }
  int64_t kv_prefetch_cap() const { return kv_prefetch_cap_; }
  // KV blocks the last step prefetched for each layer after the first.
  int64_t last_kv_prefetch_blocks() const {
    int64_t n = 0;
    for (int64_t i = 0; i < last_shards_; ++i)
      n += static_cast<int64_t>(shards_[static_cast<size_t>(i)].plan.prefetch_blocks.size());
    return n;
  }
  // Whether a step that is not cut into row shards runs as one team (team.h), the default, or
  // each operation over torch's pool. Tests and benchmarks compare them; it never changes a result.
  void set_team_steps(bool on) { team_steps_ = on; }
  bool team_steps() const { return team_steps_; }
  // Row shards: -1 (auto, the default) one per thread when the step suits them (see
  // plan_shards), 0 never, 1 whenever the step has a sequence per thread. Tests and benchmarks
  // compare them; it never changes a result.
  void set_row_shards(int64_t mode) { row_shards_ = mode < 0 ? -1 : mode > 0 ? 1 : 0; }
  int64_t row_shards() const { return row_shards_; }
  // Shards the last step ran in (1: the whole step, its operations over the threads).
  int64_t last_shards() const { return last_shards_; }

  void set_profile(bool on) {
    profile_ = on;
    linear_s_ = attention_s_ = other_s_ = 0.0;
  }
  // Seconds spent in the linears (LM head included), attention, and everything else since
  // set_profile(true).
  std::tuple<double, double, double> profile() const { return {linear_s_, attention_s_, other_s_}; }
  std::string kernels() const { return std::string(elementwise_.name) + "/" + attention_.name; }

 private:
  // Marks lin's row segments for int8 activations as q8_activations_ says (each segment's own
  // type decides whether they apply, see packed_gemm).
  void mark_q8(Linear& lin) const {
    for (Linear::Segment& s : lin.segments) s.matrix.q8_activations = q8_activations_;
  }

  // logits out [n, vocab] of the normed rows hidden [n, hidden] (row stride ld), timed as a linear.
  void run_lm_head(const float* hidden, int64_t n, int64_t ld, float* out) {
    const auto start = Clock::now();
    lm_head_.run(hidden, n, ld, out, vocab_, false);
    if (profile_) linear_s_ += seconds_since(start);
  }

  // The final RMSNorm of the last step's rows index[0 .. n) (null: rows 0 .. n) into out [n, hidden].
  void final_norm(const int64_t* index, int64_t n, float* out) {
    const float* x = x_.data();
    const float* w = final_norm_.data_ptr<float>();
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        elementwise_.rms_norm(x + (index == nullptr ? i : index[i]) * hidden_, w, eps_, hidden_, out + i * hidden_);
    });
  }

  static double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
  }

  // One step's inputs as raw arrays (from tensors: run_layers; from lists: decode).
  struct StepInputs {
    int64_t num_tokens;
    const int64_t* ids;    // [T]
    const int64_t* pos;    // [T]
    const int64_t* slots;  // [T]
    StepMeta meta;
    const float* cos;  // [P, D]
    const float* sin;  // [P, D]
    int64_t rope_positions;  // P
    int64_t window;
    const std::vector<KVCache>* kv_caches;  // checked (check_kv_caches)
  };

  void run_layers(const torch::Tensor& input_ids, const torch::Tensor& positions, const torch::Tensor& cos,
                  const torch::Tensor& signed_sin,
                  const std::vector<KVCache>& kv_caches, const torch::Tensor& slot_mapping,
                  const torch::Tensor& block_tables, const torch::Tensor& seq_lens, const torch::Tensor& query_start,
                  int64_t window) {
    const int64_t num_tokens = input_ids.numel();
    TORCH_CHECK(positions.numel() == num_tokens && slot_mapping.numel() == num_tokens,
                "positions and slot_mapping must hold one value per token");
    TORCH_CHECK(block_tables.dim() == 2, "block_tables must be [S, max_blocks]");
    TORCH_CHECK(query_start.numel() == seq_lens.numel() + 1 && block_tables.size(0) == seq_lens.numel(),
                "query_start must be [S + 1] and block_tables [S, max_blocks]");
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == head_dim_, "cos must be [P, head_dim]");
    check_kv_caches(kv_caches);
    const StepMeta meta{num_tokens, seq_lens.numel(), int64_data(query_start, "query_start"),
                        int64_data(seq_lens, "seq_lens"), int64_data(block_tables, "block_tables"),
                        block_tables.size(1)};
    run_step({num_tokens, int64_data(input_ids, "input_ids"), int64_data(positions, "positions"),
              int64_data(slot_mapping, "slot_mapping"), meta, fp32_data(cos, cos.numel(), "cos"),
              fp32_data(signed_sin, cos.numel(), "signed_sin"), cos.size(0), window, &kv_caches});
  }

  // Every KV cache shaped as the decoder needs (K [num_blocks, Hkv, D, bs], V [num_blocks, Hkv,
  // bs, D], contiguous fp32, bf16, fp16 or fp8 on the CPU, all of one dtype), one pair per layer.
  void check_kv_caches(const std::vector<KVCache>& kv_caches) const {
    TORCH_CHECK(!layers_.empty(), "decoder weights are incomplete");
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one (k_cache, v_cache) pair per layer");
    const torch::Tensor& k0 = std::get<0>(kv_caches[0]);
    TORCH_CHECK(k0.dim() == 4 && k0.size(1) == num_kv_heads_ && k0.size(2) == head_dim_ && k0.size(3) > 0,
                "K caches must be [num_blocks, num_kv_heads, head_dim, block_size]");
    const int64_t num_blocks = k0.size(0), block_size = k0.size(3);
    for (const KVCache& kv : kv_caches) {
      const torch::Tensor &k = std::get<0>(kv), &v = std::get<1>(kv);
      TORCH_CHECK(k.sizes() == k0.sizes() && v.dim() == 4 && v.size(0) == num_blocks && v.size(1) == num_kv_heads_ &&
                      v.size(2) == block_size && v.size(3) == head_dim_,
                  "every K cache must be shaped like the first, every V cache [num_blocks, num_kv_heads, "
                  "block_size, head_dim]");
      for (const torch::Tensor& c : {k, v})
        TORCH_CHECK(kv_element_of(c) && c.scalar_type() == k0.scalar_type() && c.is_contiguous() &&
                        c.device().is_cpu(),
                    "every KV cache must be a contiguous CPU tensor, all of one element type: fp32, bf16, fp16, fp8 e4m3fn or fp8 e5m2");
    }
  }

  // The step itself: every index checked, then every layer.
  void run_step(const StepInputs& in) {
    TORCH_CHECK(!layers_.empty() && embedding_.rows > 0 && final_norm_.defined(), "decoder weights are incomplete");
    const int64_t num_tokens = in.num_tokens;
    TORCH_CHECK(num_tokens > 0, "a step needs at least one token");
    const int64_t *ids = in.ids, *pos = in.pos, *slots = in.slots;
    const float *cos_p = in.cos, *sin_p = in.sin;
    for (int64_t i = 0; i < num_tokens; ++i)
      TORCH_CHECK(ids[i] >= 0 && ids[i] < vocab_, "input id ", ids[i], " out of range");
    for (int64_t i = 0; i < num_tokens; ++i)
      TORCH_CHECK(pos[i] >= 0 && pos[i] < in.rope_positions, "position ", pos[i], " outside the RoPE table");
    const StepMeta& meta = in.meta;
    TORCH_CHECK(meta.query_start[0] == 0 && meta.query_start[meta.num_seqs] == num_tokens,
                "query_start must run from 0 to the number of tokens");
    for (int64_t s = 0; s < meta.num_seqs; ++s)  // what cutting into shards needs (the plans check the rest)
      TORCH_CHECK(meta.query_start[s + 1] > meta.query_start[s], "sequence ", s, ": query length ",
                  meta.query_start[s + 1] - meta.query_start[s]);
    const std::vector<KVCache>& kv_caches = *in.kv_caches;
    const torch::Tensor& k0 = std::get<0>(kv_caches[0]);
    const int64_t num_blocks = k0.size(0), block_size = k0.size(3);
    for (int64_t i = 0; i < num_tokens; ++i)
      TORCH_CHECK(slots[i] >= 0 && slots[i] < num_blocks * block_size, "slot ", slots[i], " out of range");
    const int64_t window = in.window;
    const AttentionShape shape{num_kv_heads_, head_dim_, num_heads_ / num_kv_heads_, block_size,
                               1.0f / std::sqrt(static_cast<float>(head_dim_)), window > 0 ? window : 0,
                               *kv_element_of(k0)};
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const int64_t qkv_cols = q_size + 2 * kv_size;
    const int64_t num_shards = plan_shards(meta);
    const bool as_team = num_shards == 1 && team_steps_ && at::get_num_threads() > 1 && !at::in_parallel_region();
    // a team's threads each keep their own normed rows and activations where they compute them
    // whole (see run_shard)
    const int64_t copies = as_team ? team_max_size() : 1;
    const StepBuffers buf{num_tokens,
                          ids,
                          pos,
                          cos_p,
                          sin_p,
                          slots,
                          &kv_caches,
                          shape,
                          ensure(x_, num_tokens * hidden_),                    // [T, hidden] residual stream
                          ensure(xn_, copies * num_tokens * hidden_),          // [copies, T, hidden] normed
                          ensure(qkv_, num_tokens * qkv_cols),                 // [T, (H + 2 Hkv) * D]
                          ensure(attn_, num_tokens * q_size),                  // [T, H * D]
                          ensure(gate_up_, num_tokens * 2 * intermediate_),    // [T, 2 * intermediate]
                          ensure(act_, copies * num_tokens * intermediate_)};  // [copies, T, intermediate]
    // Every shard's attention plan (it checks its sequences' lengths and block tables) before
    // any shard runs: a bad step is refused whole, no cache written.
    for (int64_t i = 0; i < num_shards; ++i) plan_attention(shards_[static_cast<size_t>(i)], meta, shape, num_blocks);
    if (as_team) {
      // The threads as one team through every operation (team.h): one fork and join a step.
      run_team([&](const Team& team) { run_shard(shards_[0], buf, team.index == 0, &team); });
    } else if (num_shards == 1) {
      run_shard(shards_[0], buf, true, nullptr);
    } else {
      // One thread per shard, each through every layer on its own rows: no fork or join per
      // operation (the kernels' own at::parallel_for calls run inline on the shard's thread).
      at::parallel_for(0, num_shards, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) run_shard(shards_[static_cast<size_t>(i)], buf, i == 0, nullptr);
      });
    }
    if (profile_) {  // the first shard's time (a shard's operations end together with the others')
      linear_s_ += shards_[0].linear_s;
      attention_s_ += shards_[0].attention_s;
      other_s_ += shards_[0].other_s;
    }
  }

  // What every shard of a step reads and writes (the buffers: rows [T, ...], a shard its own).
  struct StepBuffers {
    int64_t num_tokens;
    const int64_t* ids;
    const int64_t* pos;
    const float* cos;
    const float* sin;
    const int64_t* slots;
    const std::vector<KVCache>* kv_caches;
    AttentionShape shape;
    float *x, *xn, *qkv, *attn, *gate_up, *act;
  };

  // A run of the step's sequences [seq_begin, seq_end) and their tokens [token_begin, token_end),
  // taken through every layer by one thread (or the whole step by all of them).
  struct Shard {
    int64_t seq_begin = 0, seq_end = 0, token_begin = 0, token_end = 0;
    std::vector<int64_t> query_start;       // [seqs + 1], from 0 at token_begin
    AttentionPlan plan;                     // the shard's tiles (and its K/V prefetch)
    std::vector<const char*> side_spans;    // the next layer's K/V blocks to prefetch (kv_spans)
    double linear_s = 0.0, attention_s = 0.0, other_s = 0.0;
  };

  // Cuts the step's sequences into shards_[0 : n) and returns n: one shard per thread when the
  // step is many short queries (decodes, chunks of a few tokens) that split evenly, else one,
  // the whole step (its operations then split over the threads one by one). The cut never
  // changes a result: every row's arithmetic is its own.
  int64_t plan_shards(const StepMeta& meta) {
    const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
    const int64_t n = row_shards_ == 0 ? 1 : std::min<int64_t>(threads, meta.num_seqs);
    // A sequence's cost: its tokens' linears (2 FLOPs a weight) and its attention, (query
    // heads x keys) x 4 D FLOPs a layer, which run ~6x slower a FLOP (Zen 5: 40 against 250
    // GFLOP/s a core at 32 decodes over 128 keys).
    const int64_t row_cost = 2 * layer_weights_;
    const int64_t key_cost = 24 * head_dim_ * num_heads_ * static_cast<int64_t>(layers_.size());
    std::vector<int64_t>& cost = shard_cost_;
    cost.resize(static_cast<size_t>(meta.num_seqs));
    int64_t total = 0, longest_query = 0;
    for (int64_t s = 0; s < meta.num_seqs; ++s) {
      const int64_t num_q = meta.query_start[s + 1] - meta.query_start[s];
      cost[static_cast<size_t>(s)] = num_q * row_cost + num_q * meta.seq_lens[s] * key_cost;
      total += cost[static_cast<size_t>(s)];
      longest_query = std::max(longest_query, num_q);
    }
    // contiguous runs of sequences, shard i ending where the running cost passes (i + 1) / n of
    // the total (each keeps at least one sequence)
    std::vector<int64_t>& ends = shard_ends_;
    ends.assign(static_cast<size_t>(n), meta.num_seqs);
    int64_t most = 0;
    for (int64_t i = 0, s = 0, done = 0; i < n; ++i) {
      const int64_t first = s, target = total / n * (i + 1);
      int64_t mine = 0;
      while (s < meta.num_seqs - (n - 1 - i) &&
             (s == first || i + 1 == n || 2 * done + cost[static_cast<size_t>(s)] <= 2 * target)) {
        done += cost[static_cast<size_t>(s)];
        mine += cost[static_cast<size_t>(s++)];
      }
      ends[static_cast<size_t>(i)] = s;
      most = std::max(most, mine);
    }
    // every shard reads all the weights: more shards need more rows each to pay for the reads
    // (where the MLP runs on the AMX tile unit from amx_group_rows rows, a step of a whole group of
    // 16 or more runs as one team rather than in shards too small for the tile unit, whose vector
    // dots run about as fast as the FMA kernels: a 2-core Sapphire Rapids Xeon at batch 16, 19.3 ms
    // a step as a team against 19.5 in two shards of 8, at 20 24.9 against 25.4; at 8 and 12, where
    // a team's tile unit gains little, shards ran 4-7% faster)
    const PackedMatrix* mlp = layers_.empty() ? nullptr : &layers_[0].gate_up.segments.front().matrix;
    const int64_t amx_rows = mlp == nullptr ? 0 : amx_group_rows(*mlp);
    const int64_t shard_rows = mlp != nullptr && digit_form_runs(*mlp) ? kDigitShardMinRows : kShardMinRows;
    const int64_t min_rows = std::max({shard_rows, 2 * n, meta.num_tokens >= 16 ? amx_rows : 0});
    const bool shard = n > 1 && (row_shards_ > 0 || (meta.num_tokens >= n * min_rows &&
                                                     longest_query <= kShardMaxQueries && 4 * most * n <= 5 * total));
    const int64_t num_shards = shard ? n : 1;
    if (!shard) ends[0] = meta.num_seqs;
    if (static_cast<int64_t>(shards_.size()) < num_shards) shards_.resize(static_cast<size_t>(num_shards));
    for (int64_t i = 0, s = 0; i < num_shards; ++i) {
      Shard& sh = shards_[static_cast<size_t>(i)];
      sh.seq_begin = s;
      sh.seq_end = s = ends[static_cast<size_t>(i)];
      sh.token_begin = meta.query_start[sh.seq_begin];
      sh.token_end = meta.query_start[sh.seq_end];
      sh.query_start.resize(static_cast<size_t>(sh.seq_end - sh.seq_begin + 1));
      for (int64_t j = sh.seq_begin; j <= sh.seq_end; ++j)
        sh.query_start[static_cast<size_t>(j - sh.seq_begin)] = meta.query_start[j] - sh.token_begin;
    }
    last_shards_ = num_shards;
    return num_shards;
  }

  // The shard's attention plan over its sequences, with the K/V prefetch budget of its rows:
  // only the K/V the MLP's idle memory bus can bring in (none where the weights' own reads fill
  // it: a few rows, whose GEMM is memory-bound; there the prefetch would slow the weights more
  // than it speeds attention).
  void plan_attention(Shard& sh, const StepMeta& step, const AttentionShape& shape, int64_t num_blocks) {
    const int64_t num_tokens = sh.token_end - sh.token_begin;
    const StepMeta meta{num_tokens,
                        sh.seq_end - sh.seq_begin,
                        sh.query_start.data(),
                        step.seq_lens + sh.seq_begin,
                        step.block_tables + sh.seq_begin * step.max_blocks,
                        step.max_blocks,
                        sh.seq_begin};
    const Layer& l0 = layers_.front();
    const int64_t mlp_weights = l0.gate_up.rows * l0.gate_up.cols + l0.down.rows * l0.down.cols;
    const int64_t idle_bytes = 2 * num_tokens * mlp_weights / kFlopsPerByte - (l0.gate_up.bytes() + l0.down.bytes());
    sh.plan.prefetch_budget = std::max<int64_t>(0, std::min(idle_bytes, kv_prefetch_cap_));
    sh.plan.build(meta, shape, num_blocks);
  }

  // Every layer over the shard's tokens (its plan built). `timed`: this thread keeps the profile's
  // laps. `team`: called by every thread of a team, each operation cut between them, a barrier
  // after each (the next reads its output); without one, each operation over torch's pool.
  void run_shard(Shard& sh, const StepBuffers& b, bool timed, const Team* team) {
    const int64_t t0 = sh.token_begin, num_tokens = sh.token_end - sh.token_begin;
    const AttentionShape& shape = b.shape;
    const std::vector<KVCache>& kv_caches = *b.kv_caches;
    const int64_t block_size = shape.block_size;
    AttentionPlan& plan = sh.plan;  // built by plan_attention (run keeps its scratch)

    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const int64_t qkv_cols = q_size + 2 * kv_size;
    float* x = b.x + t0 * hidden_;
    // An operation too small to cut (rows <= its grain: one thread would run it while the others
    // wait) runs whole on every thread of a team, into the thread's own copy of its output
    // (team_max_size() of them): no barrier before the next operation reads it.
    const Team solo{0, 1, nullptr};
    const bool own_xn = team != nullptr && num_tokens <= kNormGrain;
    const bool own_act = team != nullptr && num_tokens <= kSiluGrain;
    const Team* norm_team = own_xn ? &solo : team;
    const Team* silu_team = own_act ? &solo : team;
    float* xn = b.xn + ((own_xn ? team->index * b.num_tokens : 0) + t0) * hidden_;
    float* qkv = b.qkv + t0 * qkv_cols;
    float* attn = b.attn + t0 * q_size;
    float* gate_up = b.gate_up + t0 * 2 * intermediate_;
    float* act = b.act + ((own_act ? team->index * b.num_tokens : 0) + t0) * intermediate_;

    if (timed) sh.linear_s = sh.attention_s = sh.other_s = 0.0;
    const bool profile = profile_ && timed;
    auto start = Clock::now();
    // A thread waiting at a barrier prefetches its share of the next linear's weights into L2
    // (TeamBarrier), from where its last wait left off, up to kWaitPrefetchBytes of it: the
    // batch-1 step ~1-2% faster on a Zen 4 EPYC (2 threads), batch 8 ~2%.
    const uint8_t *ahead = nullptr, *ahead_end = nullptr;
    auto next_linear = [&](const Linear& lin) {
      if (team == nullptr) return;
      packed_gemm_share(lin.segments.front().matrix, num_tokens, *team, &ahead, &ahead_end);
      ahead_end = std::min(ahead_end, ahead + kWaitPrefetchBytes);
    };
    // after each operation: the barrier (`sync`: the next operation reads this one's output
    // from other threads), then the profile's lap
    auto lap = [&](double& bucket, bool sync = true) {
      if (team != nullptr && sync) ahead = team->sync(ahead, ahead_end);
      if (!profile) return;
      const auto now = Clock::now();
      bucket += std::chrono::duration<double>(now - start).count();
      start = now;
    };
    packed_dequantize_rows(embedding_.segments[0].matrix, b.ids + t0, num_tokens, x, hidden_, team);  // [T, hidden]
    next_linear(layers_.front().qkv);
    lap(sh.other_s);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      void* k_cache = std::get<0>(kv_caches[l]).data_ptr();  // [blocks, Hkv, D, bs]
      void* v_cache = std::get<1>(kv_caches[l]).data_ptr();  // [blocks, Hkv, bs, D]
      if (num_tokens <= kPrefetchKvSlotsMaxTokens)
        prefetch_kv_slots(b.slots + t0, num_tokens, shape, k_cache, v_cache, team);
      norm_rows(x, layer.input_norm.data_ptr<float>(), num_tokens, xn, norm_team);
      lap(sh.other_s, !own_xn);
      layer.qkv.run(xn, num_tokens, hidden_, qkv, qkv_cols, false, nullptr, team);
      next_linear(layer.o_proj);
      lap(sh.linear_s);
      rope_and_write_kv(qkv, qkv_cols, b.pos + t0, b.cos, b.sin, b.slots + t0, num_tokens, shape, k_cache, v_cache,
                        team);
      lap(sh.other_s, false);  // plan.run syncs a team before its first read
      // While o_proj and the MLP compute, the next layer's K/V (the share the budget above allows)
      // comes from memory; its attention then reads it from the caches. The lines are split
      // 15 / 35 / 50% between o_proj, gate_up and down: gate_up, whose output streams through
      // L2, slows most under them (Zen 5, batch 32: its linears 0.6-1 ms faster than 0 / 67 / 33).
      // The spans are listed by one thread, for all (the barrier after attention publishes them).
      const bool prefetch_next = l + 1 < layers_.size() && !plan.prefetch_blocks.empty();
      if (prefetch_next && (team == nullptr || team->index == 0))
        kv_spans(plan, std::get<0>(kv_caches[l + 1]).data_ptr(), std::get<1>(kv_caches[l + 1]).data_ptr(),
                 shape, sh.side_spans);
      plan.run(attention_, shape, qkv, qkv_cols, k_cache, v_cache, attn, q_size, team);
      lap(sh.attention_s);
      SidePrefetch side_o{nullptr, 0, 0}, side_gu{nullptr, 0, 0}, side_down{nullptr, 0, 0};
      if (prefetch_next) {
        const int64_t n = static_cast<int64_t>(sh.side_spans.size());
        const int64_t span_lines = block_size * num_kv_heads_ * head_dim_ * kv_element_bytes(shape) / 64;
        side_o = {sh.side_spans.data(), 15 * n / 100, span_lines};
        side_gu = {side_o.spans + side_o.num_spans, 35 * n / 100, span_lines};
        side_down = {side_gu.spans + side_gu.num_spans, n - side_o.num_spans - side_gu.num_spans, span_lines};
      }
      layer.o_proj.run(attn, num_tokens, q_size, x, hidden_, true, &side_o, team);  // x += attn @ Wo^T
      next_linear(layer.gate_up);
      lap(sh.linear_s);
      norm_rows(x, layer.post_norm.data_ptr<float>(), num_tokens, xn, norm_team);
      lap(sh.other_s, !own_xn);
      layer.gate_up.run(xn, num_tokens, hidden_, gate_up, 2 * intermediate_, false, &side_gu, team);
      next_linear(layer.down);
      lap(sh.linear_s);
      for_share(silu_team, num_tokens, kSiluGrain, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const float* row = gate_up + t * 2 * intermediate_;  // [gate | up]
          elementwise_.silu_mul(row, row + intermediate_, intermediate_, act + t * intermediate_);
        }
      });
      lap(sh.other_s, !own_act);
      layer.down.run(act, num_tokens, intermediate_, x, hidden_, true, &side_down, team);  // x += act @ Wdown^T
      if (l + 1 < layers_.size()) next_linear(layers_[l + 1].qkv);
      lap(sh.linear_s);
    }
  }

  // The cache lines rope_and_write_kv will write for these tokens (this thread's share of them, cut
  // as it cuts them), prefetched into L2 as the layer starts: a K value lands on a line of its own
  // (a column of the [D, block_size] panel), so a token's K write touches D lines a KV head,
  // which, missed one store at a time, held a decode's RoPE and write ~1.4 us a layer on a Zen 4
  // EPYC, ~0.7 us with them prefetched (its attention reads them next anyway).
  void prefetch_kv_slots(const int64_t* slots, int64_t num_tokens, const AttentionShape& shape, const void* k_cache,
                         const void* v_cache, const Team* team) const {
    const int64_t elem = kv_element_bytes(shape), bs = shape.block_size;
    for_share(team, num_tokens, rope_grain(team), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < num_kv_heads_; ++h) {
          const auto [k_off, v_off] = kv_slot_offsets(slots[t], h, bs);
          const char* k = static_cast<const char*>(k_cache) + k_off * elem;
          const char* v = static_cast<const char*>(v_cache) + v_off * elem;
          for (int64_t d = 0; d < head_dim_; ++d) prefetch_line(k + d * bs * elem);
          for (int64_t off = 0; off < head_dim_ * elem; off += 64) prefetch_line(v + off);
        }
      }
    });
  }

  // The elements (from a layer's cache start) of slot `slot`'s K and V of KV head h: its column
  // (slot % block_size, element stride block_size) of the head's [D, block_size] K panel in block
  // slot / block_size, and its row (D contiguous elements) of the [block_size, D] V panel.
  std::pair<int64_t, int64_t> kv_slot_offsets(int64_t slot, int64_t h, int64_t block_size) const {
    const int64_t panel = (slot / block_size * num_kv_heads_ + h) * block_size * head_dim_;
    const int64_t in_block = slot % block_size;
    return {panel + in_block, panel + in_block * head_dim_};
  }

  // spans = the K and V blocks of plan.prefetch_blocks in these caches, in that order.
  void kv_spans(const AttentionPlan& plan, const void* k_cache, const void* v_cache, const AttentionShape& shape,
                std::vector<const char*>& spans) const {
    const int64_t block_bytes = shape.block_size * num_kv_heads_ * head_dim_ * kv_element_bytes(shape);
    spans.clear();
    for (const int64_t id : plan.prefetch_blocks) {
      spans.push_back(static_cast<const char*>(k_cache) + id * block_bytes);
      spans.push_back(static_cast<const char*>(v_cache) + id * block_bytes);
    }
  }

  void norm_rows(const float* x, const float* weight, int64_t num_tokens, float* y, const Team* team) const {
    for_share(team, num_tokens, kNormGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) elementwise_.rms_norm(x + t * hidden_, weight, eps_, hidden_, y + t * hidden_);
    });
  }

  // Rotate-half RoPE of q and k in place, x * cos + roll(x, D/2) * signed_sin (two roundings
  // per term, as apply_rope), then k and v of each token into its cache slot: per KV head, k
  // as column slot % block_size of the K panel [D, block_size], v as row slot % block_size of
  // the V panel [block_size, D] (see AttentionShape). 16- and 8-bit caches get each value rounded
  // to nearest even (c10's BFloat16 / Half / Float8_* rounding, as torch's .to()); fp16 and fp8
  // ones clamped to their largest finite value first (+-65,504, 448, 57,344), so that a large K
  // or V is that value, not an infinity or (E4M3) a NaN.
  void rope_and_write_kv(float* qkv, int64_t ld, const int64_t* positions, const float* cos, const float* sin,
                         const int64_t* slots, int64_t num_tokens, const AttentionShape& shape, void* k_cache,
                         void* v_cache, const Team* team) const {
    switch (shape.kv_element) {
      case KvElement::kBf16:
        return rope_and_write_kv(qkv, ld, positions, cos, sin, slots, num_tokens, shape.block_size,
                                 static_cast<c10::BFloat16*>(k_cache), static_cast<c10::BFloat16*>(v_cache), team);
      case KvElement::kF16:
        return rope_and_write_kv(qkv, ld, positions, cos, sin, slots, num_tokens, shape.block_size,
                                 static_cast<c10::Half*>(k_cache), static_cast<c10::Half*>(v_cache), team);
      case KvElement::kF8E4M3:
        return rope_and_write_kv(qkv, ld, positions, cos, sin, slots, num_tokens, shape.block_size,
                                 static_cast<c10::Float8_e4m3fn*>(k_cache), static_cast<c10::Float8_e4m3fn*>(v_cache),
                                 team);
      case KvElement::kF8E5M2:
        return rope_and_write_kv(qkv, ld, positions, cos, sin, slots, num_tokens, shape.block_size,
                                 static_cast<c10::Float8_e5m2*>(k_cache), static_cast<c10::Float8_e5m2*>(v_cache), team);
      case KvElement::kF32: break;
    }
    rope_and_write_kv(qkv, ld, positions, cos, sin, slots, num_tokens, shape.block_size, static_cast<float*>(k_cache),
                      static_cast<float*>(v_cache), team);
  }
  template <typename CacheT>
  void rope_and_write_kv(float* qkv, int64_t ld, const int64_t* positions, const float* cos, const float* sin,
                         const int64_t* slots, int64_t num_tokens, int64_t block_size, CacheT* k_cache,
                         CacheT* v_cache, const Team* team) const {
    const int64_t d_len = head_dim_, half = head_dim_ / 2;
    for_share(team, num_tokens, rope_grain(team), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        float* row = qkv + t * ld;  // [q heads | k heads | v heads], each [D]
        const float* c = cos + positions[t] * d_len;
        const float* s = sin + positions[t] * d_len;
        for (int64_t h = 0; h < num_heads_ + num_kv_heads_; ++h) {
          float* v = row + h * d_len;
          for (int64_t d = 0; d < half; ++d) {
            const float a = v[d], b = v[d + half];
            const float lo = a * c[d], hi = b * c[d + half];
            const float lo_rot = b * s[d], hi_rot = a * s[d + half];
            v[d] = lo + lo_rot;
            v[d + half] = hi + hi_rot;
          }
        }
        const float* k = row + num_heads_ * d_len;  // [Hkv, D]
        const float* v = k + num_kv_heads_ * d_len;  // [Hkv, D]
        for (int64_t h = 0; h < num_kv_heads_; ++h) {
          const auto [k_off, v_off] = kv_slot_offsets(slots[t], h, block_size);
          CacheT* k_panel = k_cache + k_off;
          CacheT* v_row = v_cache + v_off;
          for (int64_t d = 0; d < d_len; ++d) k_panel[d * block_size] = to_cache<CacheT>(k[h * d_len + d]);
          for (int64_t d = 0; d < d_len; ++d) v_row[d] = to_cache<CacheT>(v[h * d_len + d]);
        }
      }
    });
  }

  const int64_t vocab_, hidden_, intermediate_, num_heads_, num_kv_heads_, head_dim_;
  const float eps_;
  const DecoderKernels& elementwise_;
  const DecoderKernels& attention_;
  Linear embedding_;  // [vocab, hidden], read by row
  Linear lm_head_;    // [vocab, hidden]
  torch::Tensor final_norm_;  // [hidden]
  std::vector<Layer> layers_;

  std::mutex mutex_;
  std::vector<Shard> shards_;  // the last step's shards_[0 : last_shards_) (kept: their buffers)
  int64_t last_shards_ = 0;
  std::vector<int64_t> shard_cost_, shard_ends_;  // plan_shards' scratch
  int64_t layer_weights_ = 0;                     // weights of every layer's linears (the LM head not)
  bool q8_activations_ = false;                   // (set_q8_activations)
  int64_t row_shards_ = -1;
  bool team_steps_ = true;
  int64_t kv_prefetch_cap_ = default_kv_prefetch_cap();
  std::vector<float> x_, xn_, qkv_, attn_, gate_up_, act_;  // scratch, see run_step
  std::vector<KVCache> bound_caches_;                             // decode's (bind_kv_caches)
  std::vector<int64_t> decode_seq_lens_, decode_query_start_;     // decode's metadata
  std::vector<int64_t> decode_tables_, decode_slots_;             // decode's [S, max_blocks] tables, slots
  std::vector<float> decode_hidden_, decode_logits_;              // decode's [S, hidden], greedy [S, vocab]
  bool profile_ = false;
  double linear_s_ = 0.0, attention_s_ = 0.0, other_s_ = 0.0;
};

// Standalone paged attention (tests, benchmarks): q [T, H, D] -> out [T, H, D], the caches
// (K [blocks, Hkv, D, bs], V [blocks, Hkv, bs, D]: see AttentionShape; both of one dtype: fp32, bf16, fp16 or fp8)
// already holding this step's K/V. Same kernels and tiling as the decoder step.
torch::Tensor paged_attention_cpu(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                  const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                                  const torch::Tensor& query_start, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q [T, H, D], caches 4-D");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(3);
  TORCH_CHECK(k_cache.size(2) == head_dim && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && block_size > 0 &&
                  v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == num_kv_heads &&
                  v_cache.size(2) == block_size && v_cache.size(3) == head_dim,
              "caches must be K [num_blocks, num_kv_heads, head_dim, block_size] and V [num_blocks, num_kv_heads, "
              "block_size, head_dim] for q [T, H, head_dim]");
  fp32_data(q, q.numel(), "q");
  const std::optional<KvElement> element = kv_element_of(k_cache);
  for (const torch::Tensor& c : {k_cache, v_cache})
    TORCH_CHECK(element && c.device().is_cpu() && c.is_contiguous() && c.scalar_type() == k_cache.scalar_type(),
                "the caches must be contiguous CPU tensors of one element type: fp32, bf16, fp16, fp8 e4m3fn or fp8 e5m2");
  const StepMeta meta{num_tokens, seq_lens.numel(), int64_data(query_start, "query_start"),
                      int64_data(seq_lens, "seq_lens"), int64_data(block_tables, "block_tables"),
                      block_tables.size(1)};
  TORCH_CHECK(query_start.numel() == meta.num_seqs + 1 && block_tables.size(0) == meta.num_seqs, "bad metadata");
  const AttentionShape shape{num_kv_heads, head_dim, num_heads / num_kv_heads, block_size,
                             static_cast<float>(scale), window > 0 ? window : 0, *element};
  AttentionPlan plan;
  plan.build(meta, shape, k_cache.size(0));
  torch::Tensor out = torch::empty_like(q);  // [T, H, D]
  plan.run(attention_kernels(head_dim), shape, q.data_ptr<float>(), num_heads * head_dim,
           k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr<float>(), num_heads * head_dim);
  return out;
}

}  // namespace

void register_decoder(pybind11::module& m) {
  using py::arg;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<FusedDecoder>(m, "FusedDecoder", "the whole decoder stack of one engine step in one call")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double>(), arg("vocab_size"),
           arg("hidden_size"), arg("intermediate_size"), arg("num_heads"), arg("num_kv_heads"), arg("head_dim"),
           arg("rms_norm_eps"))
      .def("set_embedding", &FusedDecoder::set_embedding, arg("table"))
      .def("set_lm_head", &FusedDecoder::set_lm_head, arg("segments"))
      .def("set_final_norm", &FusedDecoder::set_final_norm, arg("weight"))
      .def("add_layer", &FusedDecoder::add_layer, arg("input_norm"), arg("post_norm"), arg("qkv"), arg("qkv_bias"),
           arg("o_proj"), arg("gate_up"), arg("down"))
      .def("forward", &FusedDecoder::forward, nogil, arg("input_ids"), arg("positions"), arg("cos"), arg("signed_sin"),
           arg("kv_caches"), arg("slot_mapping"), arg("block_tables"), arg("seq_lens"), arg("query_start"),
           arg("window"), arg("rows") = py::none())
      .def("logits", &FusedDecoder::logits, nogil, arg("hidden"))
      .def("bind_kv_caches", &FusedDecoder::bind_kv_caches, nogil, arg("kv_caches"))
      .def("decode", &FusedDecoder::decode, nogil, arg("ids"), arg("positions"), arg("block_tables"), arg("cos"),
           arg("signed_sin"), arg("window"), arg("greedy"))
      .def("set_profile", &FusedDecoder::set_profile, arg("on"))
      .def_property("kv_prefetch_cap", &FusedDecoder::kv_prefetch_cap, &FusedDecoder::set_kv_prefetch_cap)
      .def_property_readonly("last_kv_prefetch_blocks", &FusedDecoder::last_kv_prefetch_blocks)
      .def_property("row_shards", &FusedDecoder::row_shards, &FusedDecoder::set_row_shards)
      .def_property_readonly("last_shards", &FusedDecoder::last_shards)
      .def_property("team_steps", &FusedDecoder::team_steps, &FusedDecoder::set_team_steps)
      .def_property("q8_activations", &FusedDecoder::q8_activations, &FusedDecoder::set_q8_activations)
      .def_property_readonly("q8_matrices", &FusedDecoder::q8_matrices)
      .def("profile", &FusedDecoder::profile)
      .def("kernels", &FusedDecoder::kernels);
  m.def("paged_attention", &paged_attention_cpu, nogil, "paged attention of one step (fused decoder's kernels)",
        arg("q"), arg("k_cache"), arg("v_cache"), arg("block_tables"), arg("seq_lens"), arg("query_start"),
        arg("scale"), arg("window") = 0);
}

}  // namespace backfill
