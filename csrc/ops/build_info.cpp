#include <fusedmha/build_info.h>

#include "cpu/isa.h"

namespace fusedmha {

BuildInfo build_info() {
  BuildInfo info;
  info.version = FUSEDMHA_VERSION;
  info.torch_version = FUSEDMHA_TORCH_VERSION;
  info.cpu_isas = cpu::compiled_isas();
  info.cpu_isa_in_use = cpu::isa_name(cpu::selected_isa());
  info.cuda = FUSEDMHA_WITH_CUDA != 0;
  return info;
}

}  // namespace fusedmha
