#include "cpu/work_items.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

namespace fusedmha::cpu {

int64_t available_threads() {
  return at::in_parallel_region() ? 1 : at::get_num_threads();
}

namespace {

// The calling thread's kernel workspace, kept between calls: a fresh
// allocation per call is mmap'd and zero-filled by the kernel page by page
// (allocations this size sit near glibc's mmap threshold), which at short
// sequences cost more than the attention itself. Grows, never shrinks; a
// kernel item never calls run_items_in_parallel, so one buffer per thread
// is never used twice at once.
void* thread_workspace(size_t bytes) {
  struct Buffer {
    void* data = nullptr;
    size_t size = 0;
    ~Buffer() { std::free(data); }
  };
  thread_local Buffer buffer;
  if (bytes > buffer.size) {
    std::free(buffer.data);
    buffer.size = 0;
    // Cache-line aligned, so full-width vector accesses do not straddle lines.
    const size_t size = (bytes + 4095) / 4096 * 4096;
    buffer.data = std::aligned_alloc(64, size);
    TORCH_CHECK(buffer.data != nullptr, "fusedmha: could not allocate ", bytes,
                " bytes of kernel workspace");
    buffer.size = size;
  }
  return buffer.data;
}

}  // namespace

void run_items_in_parallel(int64_t n_items, size_t workspace_bytes,
                           const std::function<void(int64_t, void*)>& run) {
  if (n_items <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t n_threads = std::min<int64_t>(available_threads(), n_items);
  at::parallel_for(0, n_threads, 1, [&](int64_t begin, int64_t end) {
    void* workspace = thread_workspace(workspace_bytes + 64);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
        run(n_items - 1 - i, workspace);
      }
    }
  });
}

}  // namespace fusedmha::cpu
