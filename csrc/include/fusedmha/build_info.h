#pragma once

#include <fusedmha/macros.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fusedmha {

struct BuildInfo {
  std::string version;                   // fusedmha's version
  std::string torch_version;             // the torch it was compiled against
  std::vector<std::string> cpu_isas;     // ISA levels compiled: "default", "avx2", "avx512"
  std::string cpu_isa_in_use;            // the level the CPU kernels run at now
  bool cuda;                             // CUDA kernels compiled in
};

FUSEDMHA_API BuildInfo build_info();

// The fp32 FMA peak of this machine in GFLOP/s: register-only FMA chains at
// the ISA level the CPU kernels run at, on every intra-op thread at once, the
// fastest of five rounds that take about `seconds` together. The yardstick
// the benchmarks report against.
FUSEDMHA_API double cpu_fma_peak_gflops(double seconds = 0.25);

// One pass of plain vector loads over `bytes` at `data`, split among every
// intra-op thread; returns the sum of the floats read (so that nothing is
// left out). Timed over a buffer far larger than the caches, the memory's
// read bandwidth: the yardstick of the memory-bound benchmarks.
FUSEDMHA_API float cpu_memory_read(const void* data, int64_t bytes);

}  // namespace fusedmha
