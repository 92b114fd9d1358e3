#pragma once

// The CPU kernels' entry points, one set per ISA level (the planning is
// host code: cpu/plan.h). Each
// csrc/cpu/*_kernel.cpp is compiled once per level with
// -DCPU_CAPABILITY=<LEVEL>, which puts its functions in namespace
// fusedmha::cpu::<LEVEL>; selected_kernels() picks the level's set at run
// time (isa.h). The kernels read the params of common/attention_params.h
// and nothing of ATen's tensors.

#include <cstddef>
#include <cstdint>

#include "common/attention_params.h"
#include "cpu/plan.h"
#include "cpu/work_split.h"

namespace fusedmha::cpu {

#define FUSEDMHA_DECLARE_CPU_KERNELS(LEVEL)                                                        \
  namespace LEVEL {                                                                                \
  /* What the planner (cpu/plan.h) needs to know of this level's kernels. */                       \
  KernelTraits kernel_traits();                                                                    \
  /* The scratch a plan needs: s.workspace_bytes per thread (and the forward's */                  \
  /* s.partial_bytes for decoding's split keys). */                                                \
  void forward_scratch(const AttentionParams& p, WorkSplit& s);                                    \
  void backward_scratch(const BackwardParams& bp, WorkSplit& s);                                   \
  void weights_scratch(const WeightsParams& wp, WorkSplit& s);                                     \
  /* Runs work item `item` of the plan s. */                                                       \
  void forward_item(const AttentionParams& p, const WorkSplit& s, int64_t item, void* workspace);  \
  void backward_item(const BackwardParams& bp, const WorkSplit& s, int64_t item, void* workspace); \
  void weights_item(const WeightsParams& wp, const WorkSplit& s, int64_t item, void* workspace);   \
  /* Decoding with split keys: merges group g's partial results into out and lse. */               \
  void forward_combine(const AttentionParams& p, const WorkSplit& s, int64_t group,                \
                       void* workspace);                                                           \
  /* Runs `iterations` rounds of register-only fp32 FMA chains; returns the flops. */              \
  double fma_chains(int64_t iterations);                                                           \
  }

FUSEDMHA_DECLARE_CPU_KERNELS(DEFAULT)
FUSEDMHA_DECLARE_CPU_KERNELS(AVX2)
FUSEDMHA_DECLARE_CPU_KERNELS(AVX512)

#undef FUSEDMHA_DECLARE_CPU_KERNELS

// The kernels of one ISA level.
struct IsaKernels {
  KernelTraits traits;
  void (*forward_scratch)(const AttentionParams&, WorkSplit&);
  void (*backward_scratch)(const BackwardParams&, WorkSplit&);
  void (*weights_scratch)(const WeightsParams&, WorkSplit&);
  void (*forward_item)(const AttentionParams&, const WorkSplit&, int64_t, void*);
  void (*backward_item)(const BackwardParams&, const WorkSplit&, int64_t, void*);
  void (*weights_item)(const WeightsParams&, const WorkSplit&, int64_t, void*);
  void (*forward_combine)(const AttentionParams&, const WorkSplit&, int64_t, void*);
  double (*fma_chains)(int64_t);

  // The plans of the passes on this CPU (cpu/plan.h), with their scratch.
  WorkSplit forward_split(const AttentionParams& p, int64_t threads) const;
  WorkSplit backward_split(BackwardParams& bp, int64_t threads) const;
  WorkSplit weights_split(const WeightsParams& wp, int64_t threads) const;
};

// The kernels of the ISA level selected now (see isa.h).
IsaKernels selected_kernels();

}  // namespace fusedmha::cpu
