#include "cpu/work_items.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>

namespace fusedmha::cpu {

int64_t available_threads() {
  return at::in_parallel_region() ? 1 : at::get_num_threads();
}

void run_items_in_parallel(int64_t n_items, size_t workspace_bytes,
                           const std::function<void(int64_t, void*)>& run) {
  if (n_items <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t n_threads = std::min<int64_t>(available_threads(), n_items);
  at::parallel_for(0, n_threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      // Cache-line aligned, so full-width vector accesses do not straddle lines.
      const std::unique_ptr<void, decltype(&std::free)> workspace(
          std::aligned_alloc(64, (workspace_bytes + 63) / 64 * 64 + 64), &std::free);
      TORCH_CHECK(workspace != nullptr, "fusedmha: could not allocate ", workspace_bytes,
                  " bytes of kernel workspace");
      for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
        run(n_items - 1 - i, workspace.get());
      }
    }
  });
}

}  // namespace fusedmha::cpu
