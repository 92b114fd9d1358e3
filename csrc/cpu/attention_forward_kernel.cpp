// Fused attention forward on the CPU, compiled once per ISA level: the
// prefill path (ForwardKernel::run), decoding (run_decode: few query rows
// against long keys, the keys split into chunks across threads) and the
// merge of decoding's chunks (combine). The plan it runs is host code
// (cpu/plan.h); this unit only sizes the plan's scratch.
//
// One prefill work item = split.heads outer indices (one, or the heads of a
// batch index, or the batch indices of a head, that share a mask) over one
// block of query rows; a decoding item, a group of heads over one chunk of
// the keys. For each block of keys it computes the transposed scores
// Sᵀ = K·(scale·Q)ᵀ (keys × queries) with the register-blocked
// micro-kernels, folds them into a running max and sum per query (online
// softmax) and accumulates P·V into an fp32 (fp64 for double) accumulator
// that is normalised once at the end.
//
// Why Sᵀ: queries are the vector lanes, so the max/exp/sum passes of the
// softmax are plain vertical vector operations (no horizontal reductions
// per row). Q is packed once per item as transposed panels; each key block
// is read as rows (widened from half precision), or transposed once where
// the query block is long enough to repay it (kTransposedKeysRows); each
// value block is copied into column panels for the P·V micro-kernel. Extra
// memory is a few tiles per thread; nothing of size L×S exists.
//
// This file sees only the params struct and ATen's header-only Vectorized:
// no tensors, no allocation, no threading (the host wrapper does those).

#include "cpu/forward_decode.h"
#include "cpu/forward_kernel.h"

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

// The scratch of a plan: the workspace one thread carves (ForwardWorkspace),
// and decoding's partial results when its keys are split.
template <typename acc_t>
void scratch(const AttentionParams& p, WorkSplit& split) {
  Arena<acc_t> counter(nullptr);
  ForwardWorkspace<acc_t> sizing(p, split, counter);
  split.workspace_bytes = counter.bytes();
  if (split.kv_splits > 1) {
    split.partial_bytes = sizeof(acc_t) * split.items * panel_count(split) *
                          partial_rows(split, p.len_q) * (2 + sizing.dv);
  }
}

}  // namespace

KernelTraits kernel_traits() {
  KernelTraits t;
  t.float_lanes = Vectorized<float>::size();
  t.micro_rows = kMicroRows;
  t.decode_rows_float = decode_rows<float>();
  t.decode_rows_double = decode_rows<double>();
  t.codes_in_registers = kCodesInRegisters;
  return t;
}

void forward_scratch(const AttentionParams& p, WorkSplit& split) {
  p.dtype == DType::Float64 ? scratch<double>(p, split) : scratch<float>(p, split);
}

void forward_item(const AttentionParams& p, const WorkSplit& split, int64_t item,
                  void* workspace) {
  run_item_for_dtype<ForwardKernel>(p.dtype, p, split, item, workspace);
}

void forward_combine(const AttentionParams& p, const WorkSplit& split, int64_t group,
                     void* workspace) {
  with_kernel_for_dtype<ForwardKernel>(p.dtype, p, split, workspace,
                                       [&](auto& k) { k.combine(group); });
}

}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
