// Zeroed CPU buffers on transparent huge pages (Linux), for the memory every step sweeps: the
// packed weights and the KV caches.
#pragma once

#include <torch/extension.h>

namespace backfill {

// A zeroed uint8 CPU tensor of `nbytes`, its pages already faulted in. On Linux (unless
// BACKFILL_HUGEPAGES=0) an anonymous mapping 2 MiB-aligned and advised MADV_HUGEPAGE, so the
// kernel backs it with 2 MiB pages where it can (THP "always" or "madvise"; else 4 KiB ones,
// as any allocation); elsewhere, or if the mapping fails, torch::zeros. Freed (munmap) with
// the tensor's storage.
torch::Tensor zeros_hugepages(int64_t nbytes);

// Whether zeros_hugepages maps and advises (the platform has it, BACKFILL_HUGEPAGES is not 0).
bool hugepages_enabled();

}  // namespace backfill
