#pragma once

// The plan of a CPU call's work (cpu/plan.h chooses it), as the kernels read it.

#include <cstddef>
#include <cstdint>

namespace fusedmha::cpu {

// How a kernel splits a call into work items, as the planner
// (cpu/plan.h) chose it for the ISA level and the thread count, and the
// kernels' scratch sizes for it: block sizes, the number of
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
  // The backward: outer indices per item, those whose mask gradients share
  // memory (outer_of_member), taken one after another by one thread.
  int64_t members = 1;
  size_t partial_bytes = 0;
  void* partials = nullptr;
};

}  // namespace fusedmha::cpu
