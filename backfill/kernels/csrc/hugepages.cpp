// Zeroed buffers on transparent huge pages, see hugepages.h.
//
// Why: a step sweeps ~100 MB of packed weights and, at batch 32 over 128-token contexts,
// ~200 MB of K/V scattered over the cache's blocks; on 4 KiB pages that is ~75k pages a step,
// far more than the TLBs hold, so the kernels' (and their software prefetches') accesses keep
// missing the TLB. On a Zen 5 EPYC the batch-32 decode step ran 4-6% faster with its K/V on
// 2 MiB pages (BENCHMARKS.md, session 37).
#include "hugepages.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace backfill {

namespace {
constexpr int64_t kHugePage = int64_t{2} << 20;

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }
}  // namespace

bool hugepages_enabled() {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const char* env = std::getenv("BACKFILL_HUGEPAGES");
  return env == nullptr || std::strcmp(env, "0") != 0;
#else
  return false;
#endif
}

torch::Tensor zeros_hugepages(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "zeros_hugepages: negative size ", nbytes);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (nbytes > 0 && hugepages_enabled()) {
    // a huge page more than needed, so that the buffer can start on a 2 MiB boundary
    const size_t length = static_cast<size_t>(round_up(nbytes, kHugePage) + kHugePage);
    void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {
      const int64_t address = static_cast<int64_t>(reinterpret_cast<uintptr_t>(base));
      char* data = reinterpret_cast<char*>(static_cast<uintptr_t>(round_up(address, kHugePage)));
      madvise(data, static_cast<size_t>(round_up(nbytes, kHugePage)), MADV_HUGEPAGE);  // advice: failure is harmless
      // fault every page in now (the kernel zeroes them), as torch::zeros would touch them
      const int64_t page = std::max<int64_t>(4096, sysconf(_SC_PAGESIZE));
      for (int64_t off = 0; off < nbytes; off += page) data[off] = 0;
      return torch::from_blob(
          data, {nbytes}, [base, length](void*) { munmap(base, length); },
          torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCPU));
    }
  }
#endif
  return torch::zeros({nbytes}, torch::kUInt8);
}

}  // namespace backfill
