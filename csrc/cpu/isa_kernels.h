#pragma once

// The CPU kernels' entry points, one set per ISA level. Each
// csrc/cpu/*_kernel.cpp is compiled once per level with
// -DCPU_CAPABILITY=<LEVEL>, which puts its functions in namespace
// fusedmha::cpu::<LEVEL>; selected_kernels() picks the level's set at run
// time (isa.h). The kernels read the params of common/attention_params.h
// and nothing of ATen's tensors.

#include "common/attention_params.h"

#include <cstddef>
#include <cstdint>

namespace fusedmha::cpu {

// How a kernel splits a call into work items, as its configure function
// chose for the ISA level and the thread count: block sizes, the number of
// items, and the scratch memory one thread needs.
struct WorkSplit {
  int64_t block_q = 0;   // query rows per block
  int64_t block_kv = 0;  // keys per block
  int64_t items = 0;
  size_t workspace_bytes = 0;
  // Threads sharing the items: they are handed out in descending order, so
  // a thread's next item is about this many below its current one.
  int64_t threads = 1;
  // Decoding (the forward with few query rows and long keys): one item is
  // `heads` consecutive outer indices over one of kv_splits chunks of the
  // keys. With kv_splits > 1 the items write partial results into the
  // host's `partials` (partial_bytes), and forward_combine merges each
  // group's by log-sum-exp.
  bool decode = false;
  int64_t heads = 1;
  // Decoding several query rows per head (L > 1): the rows of `merged`
  // consecutive heads that read the same K/V rows, L each, are the rows of
  // one score tile (a "panel"), as if they were one head's.
  int64_t merged = 1;
  // Decoding more query rows per head than one score tile takes (chunked
  // prefill, long drafts): each head's rows in row_splits panels.
  int64_t row_splits = 1;
  int64_t kv_splits = 1;
  size_t partial_bytes = 0;
  void* partials = nullptr;
};

#define FUSEDMHA_DECLARE_CPU_KERNELS(LEVEL)                                                \
  namespace LEVEL {                                                                        \
  /* One item = one (outer index, block of query rows). */                                 \
  WorkSplit forward_configure(const AttentionParams& p, int64_t threads);                  \
  void forward_item(const AttentionParams& p, const WorkSplit& s, int64_t item,            \
                    void* workspace);                                                      \
  /* Decoding with split keys: merges group g's partial results into out and lse. */       \
  void forward_combine(const AttentionParams& p, const WorkSplit& s, int64_t group,        \
                       void* workspace);                                                   \
  /* The most query rows of one decoding score tile (float64: of a float64 call). */       \
  int64_t forward_decode_rows(bool float64);                                               \
  /* One item = one (outer index, set of key blocks); also sets bp.grad_q_splits. */       \
  WorkSplit backward_configure(BackwardParams& bp, int64_t threads);                       \
  void backward_item(const BackwardParams& bp, const WorkSplit& s, int64_t item,           \
                     void* workspace);                                                     \
  /* One item = one (outer index / heads_per_item, block of query rows). */                \
  WorkSplit weights_configure(const WeightsParams& wp, int64_t threads);                   \
  void weights_item(const WeightsParams& wp, const WorkSplit& s, int64_t item,             \
                    void* workspace);                                                      \
  /* Runs `iterations` rounds of register-only fp32 FMA chains; returns the flops. */      \
  double fma_chains(int64_t iterations);                                                   \
  }

FUSEDMHA_DECLARE_CPU_KERNELS(DEFAULT)
FUSEDMHA_DECLARE_CPU_KERNELS(AVX2)
FUSEDMHA_DECLARE_CPU_KERNELS(AVX512)

#undef FUSEDMHA_DECLARE_CPU_KERNELS

// The kernels of one ISA level.
struct IsaKernels {
  WorkSplit (*forward_configure)(const AttentionParams&, int64_t);
  void (*forward_item)(const AttentionParams&, const WorkSplit&, int64_t, void*);
  void (*forward_combine)(const AttentionParams&, const WorkSplit&, int64_t, void*);
  int64_t (*forward_decode_rows)(bool);
  WorkSplit (*backward_configure)(BackwardParams&, int64_t);
  void (*backward_item)(const BackwardParams&, const WorkSplit&, int64_t, void*);
  WorkSplit (*weights_configure)(const WeightsParams&, int64_t);
  void (*weights_item)(const WeightsParams&, const WorkSplit&, int64_t, void*);
  double (*fma_chains)(int64_t);
};

// The kernels of the ISA level selected now (see isa.h).
IsaKernels selected_kernels();

// This CPU's L2 cache per core, in bytes (1 MiB where the system does not
// say), read once: the forward kernel sizes its query blocks by it.
int64_t l2_cache_bytes();
// Its L1 data cache per core (32 KiB where the system does not say): the
// forward kernel sizes decoding's key blocks by it.
int64_t l1d_cache_bytes();

}  // namespace fusedmha::cpu
