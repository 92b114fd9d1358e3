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

// A buffer of at least `bytes`, kept by the calling thread between calls:
// grows, never shrinks. (Cache-line aligned, so full-width vector accesses
// do not straddle lines.)
class KeptBuffer {
 public:
  ~KeptBuffer() { std::free(data_); }
  void* at_least(size_t bytes, const char* what) {
    if (bytes > size_) {
      std::free(data_);
      size_ = 0;
      const size_t size = (bytes + 4095) / 4096 * 4096;
      data_ = std::aligned_alloc(64, size);
      TORCH_CHECK(data_ != nullptr, "fusedmha: could not allocate ", bytes, " bytes of ", what);
      size_ = size;
    }
    return data_;
  }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// The calling thread's kernel workspace, kept between calls: a fresh
// allocation per call is mmap'd and zero-filled by the kernel page by page
// (allocations this size sit near glibc's mmap threshold), which at short
// sequences cost more than the attention itself (docs/performance.md, "The
// arena and kept workspaces"). A kernel item never calls
// run_items_in_parallel, so one buffer per thread is never used twice at
// once.
void* thread_workspace(size_t bytes) {
  thread_local KeptBuffer buffer;
  return buffer.at_least(bytes, "kernel workspace");
}

}  // namespace

void* call_scratch(size_t bytes) {
  thread_local KeptBuffer buffer;  // (not thread_workspace's: item 0 may run here)
  return buffer.at_least(bytes, "kernel scratch");
}

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
