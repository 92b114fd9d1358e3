#pragma once

// How a CPU call is split into work items: block sizes, heads per item,
// decoding's panels and key chunks. Host code, compiled once (not per ISA
// level): it reads the call's params, the selected level's KernelTraits and
// the CPU's cache sizes, and nothing else, so each plan can be unit-tested
// for any level and cache on any machine (tests/cpp/test_plans.cpp). The
// kernels then size their scratch for the plan (IsaKernels::*_scratch).
// docs/performance.md, "Work split and block sizes", says why each size.

#include <cstdint>

#include "common/attention_params.h"
#include "cpu/work_split.h"

namespace fusedmha::cpu {

// What the planner needs to know of an ISA level's kernels.
struct KernelTraits {
  int64_t float_lanes = 8;  // floats in one vector register
  int64_t micro_rows = 4;   // rows of the GEMM micro-kernels
  // The most query rows of one decoding score tile, for float (and half
  // precision) calls and for float64 ones.
  int64_t decode_rows_float = 8;
  int64_t decode_rows_double = 8;
  // Whether decoding reads 8-bit codes and 16-bit K/V rows in registers
  // (cpu/decode_codes.h), with float accumulators.
  bool codes_in_registers = false;

  // Two vectors: the micro-kernels' column width, the granule of query
  // blocks and padded head dims.
  int64_t panel_width(bool float64) const { return float64 ? float_lanes : 2 * float_lanes; }
  int64_t decode_rows(bool float64) const {
    return float64 ? decode_rows_double : decode_rows_float;
  }
};

// A core's data caches, in bytes.
struct CacheSizes {
  int64_t l1d = 32 << 10;
  int64_t l2 = 1 << 20;
};

// This CPU's, read once (the defaults where the system does not say).
CacheSizes this_cpu_caches();

// Decoding splits a sequence's keys into chunks of at least this many (a
// split costs a merge pass); the kernel rounds each chunk to whole blocks.
// (Not inline: a constant of internal linkage defines no symbol the per-ISA
// objects could share with baseline code, cmake/CheckNoSharedSymbols.cmake.)
constexpr int64_t kMinChunkKeys = 256;

// The forward's work split: one item = split.heads outer indices over one
// block of query rows, or for decoding (split.decode) a group of heads over
// one chunk of the keys. Scratch sizes are left to the kernels.
WorkSplit plan_forward(const AttentionParams& p, const KernelTraits& isa, const CacheSizes& caches,
                       int64_t threads);

// The backward's: one item = split.members outer indices (those sharing a
// mask gradient's memory, else one) over one set of key blocks; sets
// bp.grad_q_splits (the sets per outer index, each with a dQ slice).
WorkSplit plan_backward(BackwardParams& bp, const KernelTraits& isa, int64_t threads);

// The weights pass's: one item = heads_per_item outer indices over one
// block of query rows.
WorkSplit plan_weights(const WeightsParams& wp, const KernelTraits& isa, int64_t threads);

}  // namespace fusedmha::cpu
