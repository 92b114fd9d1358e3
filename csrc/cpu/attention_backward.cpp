// CPU kernels of fusedmha::attention_backward and
// varlen_attention_backward: check, fill the params, plan how
// to split the keys (cpu/plan.h), allocate the per-head
// gradients, run the work items on the threads, then sum the gradients
// into the inputs' shapes (dQ slices, GQA groups, broadcast dims; the
// mask's gradient is summed into its shape by the kernels themselves).

#include <torch/library.h>

#include "cpu/isa_kernels.h"
#include "cpu/work_items.h"
#include "ops/attention_checks.h"
#include "ops/attention_params_filler.h"

namespace fusedmha::cpu {
namespace {

// Runs the backward pass bp of call on the intra-op threads; the gradients
// per output head.
ops::DenseGradients run_backward(const ops::AttentionCall& call, BackwardParams bp) {
  const AttentionParams& p = bp.fwd;
  if (p.num_outer == 0 || p.len_q == 0 || p.len_kv == 0) {
    // No query row or no key: every gradient is 0 (dQ is allocated as
    // zeros), and the work split would divide by zero.
    const ops::DenseGradients grads = call.allocate_gradients(bp);
    grads.k.zero_();
    grads.v.zero_();
    return grads;
  }
  const IsaKernels kernels = selected_kernels();
  // (The split sets bp.grad_q_splits, which the gradients are allocated by.)
  const WorkSplit split = kernels.backward_split(bp, available_threads());
  const ops::DenseGradients grads = call.allocate_gradients(bp);
  run_items_in_parallel(split.items, split.workspace_bytes, [&](int64_t item, void* workspace) {
    kernels.backward_item(bp, split, item, workspace);
  });
  return grads;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const ops::BackwardArgs& a) {
  ops::check_backward_inputs(ops::kBackwardOp, a);
  ops::AttentionCall call(ops::kBackwardOp, a);
  return run_backward(call, call.backward(a, ops::AttentionCall::MaskSums::kMaskDtype))
      .reduced_to(a.query, a.key, a.value, a.attn_mask);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_cpu(
    const ops::VarlenBackwardArgs& a) {
  ops::check_varlen_backward_inputs(ops::kVarlenBackwardOp, a);
  const ops::PackedBatch batch = ops::packed_batch(a);
  ops::check_packed_batch_values(ops::kVarlenBackwardOp, batch, a.query.size(0), a.key);
  ops::AttentionCall call(ops::kVarlenBackwardOp, a, batch);
  return run_backward(call, call.backward(a.grad_out, a.out, a.logsumexp, a.rng_state, a.dropout_p,
                                          a.grad_logsumexp))
      .reduced_to(a.query, a.key, a.value);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CPU, m) {
  FUSEDMHA_OP_IMPL(m, attention_backward_cpu);
  FUSEDMHA_OP_IMPL(m, varlen_attention_backward_cpu);
}

}  // namespace fusedmha::cpu
