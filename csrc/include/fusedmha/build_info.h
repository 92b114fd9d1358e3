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

}  // namespace fusedmha
