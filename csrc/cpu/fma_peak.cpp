// fusedmha::cpu_fma_peak_gflops: the fp32 FMA peak of this machine at the ISA
// level in use, on every intra-op thread at once: what a kernel's GFLOP/s is
// measured against (the benchmarks print "% of peak").
//
// A peak is the best the cores do, so the probe times several short rounds
// and keeps the fastest: on a shared machine a thread of a round is now and
// then descheduled or starts late, and one long timing of the whole
// parallel region then reads well below what the same chains reach
// (benchmarks/probe_check.py holds the probe against an independent loop).
// Each round starts and ends at a barrier of every thread, after an untimed
// round that wakes the threads and brings the clocks up.

#include <fusedmha/build_info.h>

#include "cpu/isa_kernels.h"
#include "cpu/work_items.h"

#include <omp.h>

#include <algorithm>
#include <chrono>

namespace fusedmha {
namespace {

// Timed rounds per reading, the fastest kept.
constexpr int kRounds = 5;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

double cpu_fma_peak_gflops(double seconds) {
  const auto fma_chains = cpu::selected_kernels().fma_chains;
  // Iterations that take about seconds / kRounds on one core (calibrated,
  // doubling until long enough to time).
  int64_t iterations = 1 << 14;
  for (;;) {
    const double start = now();
    fma_chains(iterations);
    const double t = now() - start;
    if (t > 0.005) {
      iterations = std::max<int64_t>(1, static_cast<int64_t>(iterations * seconds / kRounds / t));
      break;
    }
    iterations *= 2;
  }
  const int threads = static_cast<int>(cpu::available_threads());
  double best = 0;
#pragma omp parallel num_threads(threads)
  {
    fma_chains(std::max<int64_t>(iterations / 4, 1));  // (untimed: threads awake, clocks up)
    double flops = 0, start = 0;
    for (int round = 0; round < kRounds; ++round) {
#pragma omp barrier
#pragma omp master
      start = now();
      flops = fma_chains(iterations);
#pragma omp barrier
#pragma omp master
      best = std::max(best, flops * omp_get_num_threads() / (now() - start));
    }
  }
  return best / 1e9;
}

}  // namespace fusedmha
