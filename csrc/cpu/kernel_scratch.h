#pragma once

// A work item's scratch memory (Arena) and the dispatch from a call's dtype
// to a kernel template instance.
//
// Included only by the per-ISA kernel units (compiled once per level with
// -DCPU_CAPABILITY=<LEVEL>, see cpu/isa_kernels.h): everything here lives in
// an anonymous namespace inside fusedmha::cpu::<LEVEL>, so each level has its
// own private copy.

#include <cstddef>

#include "cpu/isa_kernels.h"
#include "cpu/simd.h"

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

// Carves a thread's scratch memory into arrays; with a null base it only
// counts, so the same code sizes the workspace and lays it out.
template <typename acc_t>
class Arena {
 public:
  explicit Arena(void* base) : base_(static_cast<acc_t*>(base)) {}
  acc_t* take(int64_t count) {
    acc_t* at = base_ ? base_ + used_ : nullptr;
    used_ += round_up(count, 64 / sizeof(acc_t));  // each array on its own cache lines
    return at;
  }
  size_t bytes() const { return sizeof(acc_t) * used_; }

 private:
  acc_t* base_;
  int64_t used_ = 0;
};

// The bytes of scratch one thread needs for a plan: Workspace<acc_t> laid
// out on a counting arena (the same code lays out the real one).
template <template <typename> class Workspace, typename Params>
size_t workspace_bytes(DType dtype, const Params& p, const WorkSplit& split) {
  auto size = [&](auto acc) {
    using acc_t = decltype(acc);
    Arena<acc_t> counter(nullptr);
    Workspace<acc_t> sizing(p, split, counter);
    return counter.bytes();
  };
  return dtype == DType::Float64 ? size(double{}) : size(float{});
}

// Calls work(kernel) with a Kernel<scalar_t, acc_t> for dtype, its scratch
// carved from workspace.
template <template <typename, typename> class Kernel, typename Params, typename Work>
void with_kernel_for_dtype(DType dtype, const Params& p, const WorkSplit& split, void* workspace,
                           const Work& work) {
  auto run = [&](auto scalar) {
    using scalar_t = decltype(scalar);
    using acc_t = typename AccType<scalar_t>::type;
    Kernel<scalar_t, acc_t> kernel(p, split, Arena<acc_t>(workspace));
    work(kernel);
  };
  switch (dtype) {
    case DType::Float32:
      return run(float{});
    case DType::Float64:
      return run(double{});
    case DType::BFloat16:
      return run(c10::BFloat16{});
    case DType::Float16:
      return run(c10::Half{});
  }
}

// Runs work item `item` with Kernel<scalar_t, acc_t> for dtype.
template <template <typename, typename> class Kernel, typename Params>
void run_item_for_dtype(DType dtype, const Params& p, const WorkSplit& split, int64_t item,
                        void* workspace) {
  with_kernel_for_dtype<Kernel>(dtype, p, split, workspace, [&](auto& k) { k.run(item); });
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
