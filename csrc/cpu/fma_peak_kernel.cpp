// The fp32 FMA peak of one core at this ISA level (compiled once per level):
// independent chains of vector arithmetic held in registers, no memory
// traffic, nothing else. Benchmarks report their GFLOP/s against it.

#include "cpu/isa_kernels.h"

#include <ATen/cpu/vec/vec.h>

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;

// Lanes that differ from each other, so that no lane's work can be shared
// with another's (a compiler may compute equal halves of a vector once).
Vec distinct_lanes(float first) {
  return Vec::arange(first, 1e-3f);
}

// The chains' values, so that the loops cannot be optimised away.
float sum_of(const Vec* chains, int n) {
  float sum = 0;
  for (int c = 0; c < n; ++c) {
    alignas(64) float lanes[Vec::size()];
    chains[c].store(lanes);
    for (float x : lanes) sum += x;
  }
  return sum;
}

}  // namespace

double fma_chains(int64_t iterations) {
#if defined(CPU_CAPABILITY_DEFAULT)
  // The baseline (SSE2 on x86-64) has no FMA instruction: multiplies and
  // adds, in pipes of their own, as separate chains of each (a multiply
  // feeding an add in one chain would wait on both latencies). Three of
  // each, in two registers apiece, fill the 16 vector registers with their
  // operands; 1 flop a lane.
  constexpr int kChains = 6;
  Vec acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = distinct_lanes(1.0f + 0.1f * static_cast<float>(c));
  volatile float one = 1.0f;  // (opaque: x · 1 is not folded away, and never underflows)
  const Vec m(one), b(1e-7f);
  for (int64_t n = 0; n < iterations; ++n) {
#pragma GCC unroll 6
    for (int c = 0; c < kChains; c += 2) {
      acc[c] = acc[c] * m;
      acc[c + 1] = acc[c + 1] + b;
    }
  }
  constexpr double kFlopsPerLane = 1.0;
#else
  // More independent FMA chains than FMA latency × FMA ports (4 × 2 on
  // current x86 cores), so the ports, not the latency, set the pace.
  constexpr int kChains = 12;
  Vec acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = distinct_lanes(1e-3f * static_cast<float>(c));
  const Vec a(0.999999f), b(1e-7f);
  for (int64_t n = 0; n < iterations; ++n) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = at::vec::fmadd(acc[c], a, b);
  }
  constexpr double kFlopsPerLane = 2.0;
#endif
  volatile float keep = sum_of(acc, kChains);
  (void)keep;
  return kFlopsPerLane * static_cast<double>(iterations) * kChains * Vec::size();
}

}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
