// The fp32 FMA peak of one core at this ISA level (compiled once per level):
// independent chains of fused multiply-adds held in registers, no memory
// traffic, nothing else. Benchmarks report their GFLOP/s against it.

#include "cpu/isa_kernels.h"

#include <ATen/cpu/vec/vec.h>

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {

double fma_chains(int64_t iterations) {
  using Vec = at::vec::Vectorized<float>;
  // More independent chains than FMA latency × FMA ports (4 × 2 on current
  // x86 cores), so the ports, not the latency, set the pace.
  constexpr int kChains = 12;
  Vec acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = Vec(1e-3f * static_cast<float>(c));
  const Vec a(0.999999f), b(1e-7f);
  for (int64_t n = 0; n < iterations; ++n) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = at::vec::fmadd(acc[c], a, b);
  }
  // The result is used, so the chains cannot be optimised away.
  float sum = 0;
  for (int c = 0; c < kChains; ++c) {
    alignas(64) float lanes[Vec::size()];
    acc[c].store(lanes);
    sum += lanes[0];
  }
  volatile float keep = sum;
  (void)keep;
  return 2.0 * static_cast<double>(iterations) * kChains * Vec::size();
}

}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
