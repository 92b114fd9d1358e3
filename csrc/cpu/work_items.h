#pragma once

// Sharing a kernel's work items among the intra-op threads.

#include <cstddef>
#include <cstdint>
#include <functional>

namespace fusedmha::cpu {

// Threads run_items_in_parallel will use (1 inside a parallel region).
int64_t available_threads();

// Memory the work items of one call share (such as decoding's partial
// results, merged after them), 64-byte aligned: the calling thread's, kept
// between calls and valid until this thread's next call_scratch (no kernel
// item calls it). (An allocation per call was a noticeable part of a
// decoding step from cold caches: docs/performance.md, "The arena and kept
// workspaces".)
void* call_scratch(size_t bytes);

// Runs items [0, n_items) on the intra-op threads, each thread with its own
// workspace of workspace_bytes (64-byte aligned). Items are handed out one at
// a time, costliest (highest index) first, so threads finish together even
// when items differ in cost.
void run_items_in_parallel(int64_t n_items, size_t workspace_bytes,
                           const std::function<void(int64_t item, void* workspace)>& run);

}  // namespace fusedmha::cpu
