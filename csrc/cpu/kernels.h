#pragma once

// The per-ISA entry points of the CPU kernels. Each csrc/cpu/*_kernel.cpp is
// compiled once per ISA level with -DCPU_CAPABILITY=<LEVEL>, which puts its
// functions in namespace fusedmha::cpu::<LEVEL>; isa.cpp picks one at run time.

#include "cpu/attention_params.h"

namespace fusedmha::cpu {

#define FUSEDMHA_DECLARE_CPU_KERNELS(LEVEL)                                    \
  namespace LEVEL {                                                            \
  /* Sets the block sizes this level works best with; returns the bytes of */ \
  /* scratch memory one thread needs. */                                       \
  size_t forward_configure(ForwardParams& params);                             \
  /* Computes work items [begin, end) (see num_work_items). */                \
  void forward_items(const ForwardParams& params, int64_t begin, int64_t end, \
                     void* workspace);                                         \
  size_t backward_configure(BackwardParams& params);                           \
  /* Computes backward work items [begin, end) (see num_backward_items). */   \
  void backward_items(const BackwardParams& params, int64_t begin,            \
                      int64_t end, void* workspace);                           \
  size_t weights_configure(WeightsParams& params);                             \
  /* Computes weights work items [begin, end) (see num_weights_items). */     \
  void weights_items(const WeightsParams& params, int64_t begin, int64_t end, \
                     void* workspace);                                         \
  }

FUSEDMHA_DECLARE_CPU_KERNELS(DEFAULT)
FUSEDMHA_DECLARE_CPU_KERNELS(AVX2)
FUSEDMHA_DECLARE_CPU_KERNELS(AVX512)

#undef FUSEDMHA_DECLARE_CPU_KERNELS

}  // namespace fusedmha::cpu
