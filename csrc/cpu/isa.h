#pragma once

// Run-time choice of the ISA level the CPU kernels run at.

#include <string>
#include <vector>

namespace fusedmha::cpu {

enum class IsaLevel { Default = 0, Avx2 = 1, Avx512 = 2 };

// The level to run at now: ATen's own choice (so ATEN_CPU_CAPABILITY is
// honoured), unless FUSEDMHA_CPU_ISA=default|avx2|avx512 forces one; forcing
// a level this CPU or this build lacks raises an error naming both. Read on
// every call, so tests can switch levels within one process.
IsaLevel selected_isa();

const char* isa_name(IsaLevel level);

// The levels compiled into this build, lowest first.
std::vector<std::string> compiled_isas();

}  // namespace fusedmha::cpu
