// A team: every thread of torch's intra-op pool taking one engine step through its operations
// together, each operation cut by thread index as at::parallel_for would cut it, the threads
// meeting at a barrier where one operation needs another's output. One fork and join for the
// whole step, where at::parallel_for costs one per operation: on 2 threads of an EPYC a few
// microseconds each, ~120 a small decode step (4 linears a layer and the attention).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace backfill {

// One cache line into L2 (prefetcht1). A loop of nothing but __builtin_prefetch is one GCC may
// delete whole (it has no effect the language sees): the asm is volatile.
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Thrown by a team's sync() in the threads still waiting once another has failed (the failure
// itself is what run_team rethrows).
struct TeamAborted {};

// A reusable barrier for the threads of one parallel region: a generation count that the last
// thread to arrive advances. Waiters spin (a wait lasts the imbalance of one operation, a few
// microseconds), then yield their core, for a neighbour's thread on a loaded machine. A waiter
// given memory it reads next (ahead: [begin, end), advanced as it goes) prefetches it into L2 a
// line a spin meanwhile: a thread's wait is the other's work, and while one core computes alone
// the memory bus has room for the other's reads.
class TeamBarrier {
 public:
  void set_size(int64_t size) { size_.store(size, std::memory_order_relaxed); }
  void fail() { failed_.store(true, std::memory_order_relaxed); }

  // Returns `ahead` past the lines it prefetched.
  const uint8_t* wait(const uint8_t* ahead = nullptr, const uint8_t* ahead_end = nullptr) {
    const int64_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == size_.load(std::memory_order_relaxed)) {
      arrived_.store(0, std::memory_order_relaxed);  // before the release below: the next wait sees it
      generation_.store(generation + 1, std::memory_order_release);
      return ahead;
    }
    for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (failed_.load(std::memory_order_relaxed)) throw TeamAborted{};
      if (ahead < ahead_end) {
        prefetch_line(ahead);
        ahead += 64;
      } else if (spins < kSpins) {
#if defined(__x86_64__) || defined(__i386__)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
    return ahead;
  }

 private:
  static constexpr int64_t kSpins = 1 << 14;  // ~0.5-1 ms of pause instructions

 public:
  // Work one thread prepares for all (packed_gemm's digit-form x, qgemm.cpp): each thread's part
  // of call c lies at parts[c % 2][index] (its own memory, written before the sync that publishes
  // it; the other slot is its call c - 1's, which the others may still be reading), and calls[index]
  // counts its calls. kMaxParts threads at most (larger teams do not share).
  static constexpr int64_t kMaxParts = 256;
  const uint8_t* parts[2][kMaxParts] = {};
  int64_t calls[kMaxParts] = {};

 private:
  alignas(64) std::atomic<int64_t> arrived_{0};
  alignas(64) std::atomic<int64_t> generation_{0};
  std::atomic<int64_t> size_{1};
  std::atomic<bool> failed_{false};
};

// One thread's view of its team.
struct Team {
  int64_t index;  // 0 .. size - 1; 0 is the thread that called run_team
  int64_t size;
  TeamBarrier* barrier;

  // Waits until every thread of the team has called sync() as often as this one; prefetching
  // [ahead, ahead_end) meanwhile where given (see TeamBarrier): returns ahead past what it did.
  const uint8_t* sync(const uint8_t* ahead = nullptr, const uint8_t* ahead_end = nullptr) const {
    return barrier->wait(ahead, ahead_end);
  }

  // This thread's share [begin, end) of [0, n), cut as at::parallel_for cuts it (OpenMP backend):
  // all of it on thread 0 where n <= grain, else min(size, ceil(n / grain)) equal chunks.
  std::pair<int64_t, int64_t> share(int64_t n, int64_t grain) const {
    if (n <= 0) return {0, 0};
    if (n <= grain || size == 1) return index == 0 ? std::make_pair(int64_t{0}, n) : std::make_pair(n, n);
    const int64_t chunks = grain > 0 ? std::min(size, (n + grain - 1) / grain) : size;
    const int64_t chunk = (n + chunks - 1) / chunks;
    const int64_t begin = std::min(n, index * chunk);
    return {begin, std::min(n, begin + chunk)};
  }
};

// f(begin, end) over [0, n): with a team, this thread's share only (no barrier: the caller
// syncs where a later operation reads the output); without one, over torch's pool.
template <typename F>
void for_share(const Team* team, int64_t n, int64_t grain, const F& f) {
  if (team == nullptr) {
    at::parallel_for(0, n, grain, f);
    return;
  }
  const auto [begin, end] = team->share(n, grain);
  if (begin < end) f(begin, end);
}

// The most threads a team can have (what buffers kept per thread must be sized for): OpenMP's
// bound on a region's threads; 1 without OpenMP.
inline int64_t team_max_size() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Runs body(team) on every thread of torch's intra-op pool at once (the caller's thread as
// index 0) and returns when all have; rethrows the first exception any thread threw (the
// others then stop at their next sync()). Inside, at::parallel_for runs inline.
template <typename F>
void run_team(const F& body) {
  TeamBarrier barrier;
  std::exception_ptr error;
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
  // NOTE: no num_threads clause, as at::parallel_for (torch issue #32008): the pool's size is
  // what torch.set_num_threads set.
#pragma omp parallel
  {
#ifdef _OPENMP
    const Team team{omp_get_thread_num(), omp_get_num_threads(), &barrier};
#else
    const Team team{0, 1, &barrier};
#endif
    barrier.set_size(team.size);  // every thread stores the same value before its first wait
    try {
      at::internal::ThreadIdGuard tid_guard(static_cast<int>(team.index));
      c10::ParallelGuard guard(true);
      body(team);
    } catch (const TeamAborted&) {
    } catch (...) {
      if (!failed.test_and_set()) error = std::current_exception();
      barrier.fail();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace backfill
