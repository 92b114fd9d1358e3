#pragma once

#include <fusedmha/macros.h>

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
// the ISA level the CPU kernels run at, on every intra-op thread at once,
// timed for about `seconds`. The yardstick the benchmarks report against.
FUSEDMHA_API double cpu_fma_peak_gflops(double seconds = 0.25);

}  // namespace fusedmha
