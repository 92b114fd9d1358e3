// fusedmha::cpu_fma_peak_gflops: the fp32 FMA peak of this machine at the ISA
// level in use, on every intra-op thread at once: what a kernel's GFLOP/s is
// measured against (the benchmarks print "% of peak").

#include <fusedmha/build_info.h>

#include "cpu/isa_kernels.h"
#include "cpu/work_items.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>

namespace fusedmha {

double cpu_fma_peak_gflops(double seconds) {
  using Clock = std::chrono::steady_clock;
  const auto fma_chains = cpu::selected_kernels().fma_chains;
  // Rounds that take about `seconds` on one core (calibrated, then doubled
  // until long enough to time).
  int64_t rounds = 1 << 16;
  for (;;) {
    const auto start = Clock::now();
    fma_chains(rounds);
    const double t = std::chrono::duration<double>(Clock::now() - start).count();
    if (t > 0.02) {
      rounds = std::max<int64_t>(1, static_cast<int64_t>(rounds * seconds / t));
      break;
    }
    rounds *= 2;
  }
  // Every thread at once: the peak the kernels' threads share.
  const int64_t threads = cpu::available_threads();
  std::atomic<double> flops{0.0};
  const auto start = Clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const double f = fma_chains(rounds);
      double seen = flops.load();
      while (!flops.compare_exchange_weak(seen, seen + f)) {
      }
    }
  });
  const double t = std::chrono::duration<double>(Clock::now() - start).count();
  return flops.load() / t / 1e9;
}

}  // namespace fusedmha
