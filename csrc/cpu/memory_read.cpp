// fusedmha::cpu_memory_read: one pass of plain vector loads over a buffer,
// split among every intra-op thread: the benchmarks time it beside the
// memory-bound calls it is the yardstick for (benchmarks/common.py's
// MemoryRead), and benchmarks/probe_check.py holds it against an
// independent streaming read.
//
// Nothing but the loads and the adds that consume them, eight independent
// sums a thread so that the adds never wait on each other; each thread's
// share is one contiguous range, read front to back, which the hardware
// prefetchers follow.

#include <fusedmha/build_info.h>

#include "cpu/work_items.h"

#include <omp.h>

#include <cstring>

namespace fusedmha {

float cpu_memory_read(const void* data, int64_t bytes) {
  // 16-byte vectors in the compiler's own notation: plain loads and adds at
  // the baseline ISA (the generic at::vec type compiles to lane-by-lane code
  // here), which are enough to keep a core's memory requests in flight.
  using V = float __attribute__((vector_size(16)));
  constexpr int64_t kSums = 8, kStep = kSums * static_cast<int64_t>(sizeof(V));  // bytes a step
  const char* base = static_cast<const char*>(data);
  const int64_t steps = bytes / kStep;
  const int threads = static_cast<int>(cpu::available_threads());
  float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int64_t parts = omp_get_num_threads(), t = omp_get_thread_num();
    V sum[kSums] = {};
    for (int64_t i = steps * t / parts, end = steps * (t + 1) / parts; i < end; ++i) {
      const char* at = base + i * kStep;
      for (int64_t k = 0; k < kSums; ++k) {  // (unrolled: kSums independent sums)
        V x;
        std::memcpy(&x, at + k * static_cast<int64_t>(sizeof(V)), sizeof(V));
        sum[k] += x;
      }
    }
    for (int64_t k = 1; k < kSums; ++k) sum[0] += sum[k];
    for (int lane = 0; lane < 4; ++lane) total += sum[0][lane];
  }
  return total;
}

}  // namespace fusedmha
