#include "cpu/isa.h"

#include "cpu/isa_kernels.h"

#include <ATen/Version.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <string>

#include <unistd.h>

namespace fusedmha::cpu {
namespace {

// The widest level this build compiled (CMake's FUSEDMHA_CPU_ISA_MAX; the
// levels below it are compiled too).
constexpr IsaLevel kHighestCompiled = static_cast<IsaLevel>(FUSEDMHA_CPU_ISA_HIGHEST);

IsaLevel highest_supported_by_cpu() {
#if FUSEDMHA_CPU_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return IsaLevel::Avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return IsaLevel::Avx2;
  }
#endif
  return IsaLevel::Default;
}

IsaLevel aten_choice() {
  const std::string cap = at::get_cpu_capability();
  if (cap.find("AVX512") != std::string::npos) return IsaLevel::Avx512;
  if (cap.find("AVX2") != std::string::npos) return IsaLevel::Avx2;
  return IsaLevel::Default;
}

}  // namespace

const char* isa_name(IsaLevel level) {
  switch (level) {
    case IsaLevel::Avx512: return "avx512";
    case IsaLevel::Avx2: return "avx2";
    case IsaLevel::Default: break;
  }
  return "default";
}

std::vector<std::string> compiled_isas() {
  std::vector<std::string> names;
  for (int l = 0; l <= static_cast<int>(kHighestCompiled); ++l) {
    names.emplace_back(isa_name(static_cast<IsaLevel>(l)));
  }
  return names;
}

IsaLevel selected_isa() {
  static const IsaLevel cpu_level = highest_supported_by_cpu();
  static const IsaLevel automatic = std::min({aten_choice(), cpu_level, kHighestCompiled});
  const char* env = std::getenv("FUSEDMHA_CPU_ISA");
  if (env == nullptr || *env == '\0') return automatic;
  std::string wanted(env);
  std::transform(wanted.begin(), wanted.end(), wanted.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (int l = 0; l <= static_cast<int>(IsaLevel::Avx512); ++l) {
    const auto level = static_cast<IsaLevel>(l);
    if (wanted != isa_name(level)) continue;
    TORCH_CHECK(level <= kHighestCompiled, "FUSEDMHA_CPU_ISA=", env,
                ": this build of fusedmha was not compiled for that level (compiled up to ",
                isa_name(kHighestCompiled), ")");
    TORCH_CHECK(level <= cpu_level, "FUSEDMHA_CPU_ISA=", env,
                ": this CPU does not support that level (it supports up to ",
                isa_name(cpu_level), ")");
    return level;
  }
  TORCH_CHECK(false, "FUSEDMHA_CPU_ISA=", env,
              ": expected one of default, avx2, avx512 (or unset for automatic)");
}

IsaKernels selected_kernels() {
#define FUSEDMHA_KERNELS(LEVEL)                                                             \
  IsaKernels {                                                                              \
    LEVEL::kernel_traits(), LEVEL::forward_scratch, LEVEL::backward_scratch,                \
        LEVEL::weights_scratch, LEVEL::forward_item, LEVEL::backward_item, LEVEL::weights_item, \
        LEVEL::forward_combine, LEVEL::fma_chains                                           \
  }
  switch (selected_isa()) {
#if FUSEDMHA_CPU_ISA_HIGHEST >= 2
    case IsaLevel::Avx512: return FUSEDMHA_KERNELS(AVX512);
#endif
#if FUSEDMHA_CPU_ISA_HIGHEST >= 1
    case IsaLevel::Avx2: return FUSEDMHA_KERNELS(AVX2);
#endif
    default: return FUSEDMHA_KERNELS(DEFAULT);
  }
#undef FUSEDMHA_KERNELS
}

namespace {

// A data cache's size per core: glibc's sysconf, else sysfs (Linux without
// glibc's cache sysconf: e.g. "512K" in cpu0/cache/<index>/size), else
// fallback.
int64_t cache_bytes(long sysconf_size, const char* sysfs_index, int64_t fallback) {
  if (sysconf_size > 0) return static_cast<int64_t>(sysconf_size);
  std::ifstream file(std::string("/sys/devices/system/cpu/cpu0/cache/") + sysfs_index + "/size");
  int64_t kib = 0;
  std::string unit;
  if (file >> kib >> unit && kib > 0 && unit == "K") return kib * 1024;
  return fallback;
}

}  // namespace

CacheSizes this_cpu_caches() {
#if defined(_SC_LEVEL1_DCACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
  static const CacheSizes sizes{cache_bytes(sysconf(_SC_LEVEL1_DCACHE_SIZE), "index0", 32 << 10),
                                cache_bytes(sysconf(_SC_LEVEL2_CACHE_SIZE), "index2", 1 << 20)};
#else
  static const CacheSizes sizes{cache_bytes(0, "index0", 32 << 10),
                                cache_bytes(0, "index2", 1 << 20)};
#endif
  return sizes;
}

WorkSplit IsaKernels::forward_split(const AttentionParams& p, int64_t threads) const {
  WorkSplit split = plan_forward(p, traits, this_cpu_caches(), threads);
  forward_scratch(p, split);
  return split;
}

WorkSplit IsaKernels::backward_split(BackwardParams& bp, int64_t threads) const {
  WorkSplit split = plan_backward(bp, traits, threads);
  backward_scratch(bp, split);
  return split;
}

WorkSplit IsaKernels::weights_split(const WeightsParams& wp, int64_t threads) const {
  WorkSplit split = plan_weights(wp, traits, threads);
  weights_scratch(wp, split);
  return split;
}

}  // namespace fusedmha::cpu
