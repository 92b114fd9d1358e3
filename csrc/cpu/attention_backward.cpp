// CPU kernels of fusedmha::attention_backward and
// varlen_attention_backward: check, fill the params, let
// the kernels choose how to split the keys, allocate the per-head
// gradients, run the work items on the threads, then sum the gradients
// into the inputs' shapes (dQ slices, GQA groups, broadcast dims).

#include "cpu/isa_kernels.h"
#include "cpu/work_items.h"
#include "ops/attention_checks.h"
#include "ops/attention_params_filler.h"

#include <torch/library.h>

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
  const WorkSplit split = kernels.backward_configure(bp, available_threads());
  const ops::DenseGradients grads = call.allocate_gradients(bp);
  run_items_in_parallel(split.items, split.workspace_bytes, [&](int64_t item, void* workspace) {
    kernels.backward_item(bp, split, item, workspace);
  });
  return grads;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const std::optional<at::Tensor>& attn_mask, double dropout_p,
    bool is_causal, std::optional<double> scale, bool enable_gqa, int64_t window_left, int64_t window_right, bool bottom_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& grad_logsumexp) {
  const AttentionVariants variants{window_left, window_right, bottom_right, softcap,
                                   alibi_slopes, sinks};
  ops::check_attention_backward_inputs(ops::kBackwardOp, grad_out, query, key, value, out,
                                       logsumexp, rng_state, attn_mask, dropout_p, scale,
                                       enable_gqa, variants, grad_logsumexp);
  ops::AttentionCall call(ops::kBackwardOp, query, key, value, attn_mask, is_causal, scale,
                          enable_gqa, variants, dropout_p);
  return run_backward(call,
                      call.backward(grad_out, out, logsumexp, rng_state, dropout_p, grad_logsumexp))
      .reduced_to(query, key, value);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, bool is_causal,
    std::optional<double> scale, int64_t window_left, int64_t window_right, bool bottom_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& seqused_k,
    const std::optional<at::Tensor>& grad_logsumexp) {
  const AttentionVariants variants{window_left, window_right, bottom_right, softcap,
                                   alibi_slopes, sinks};
  const ops::PackedBatch batch{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k};
  ops::check_varlen_backward_inputs(ops::kVarlenBackwardOp, grad_out, query, key, value, out,
                                    logsumexp, rng_state, batch, dropout_p, scale, variants,
                                    grad_logsumexp);
  ops::check_packed_batch_values(ops::kVarlenBackwardOp, batch, query.size(0), key);
  ops::AttentionCall call(ops::kVarlenBackwardOp, query, key, value, batch, is_causal, scale,
                          variants, dropout_p);
  return run_backward(call,
                      call.backward(grad_out, out, logsumexp, rng_state, dropout_p, grad_logsumexp))
      .reduced_to(query, key, value);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CPU, m) {
  m.impl("attention_backward", TORCH_FN(attention_backward_cpu));
  m.impl("varlen_attention_backward", TORCH_FN(varlen_attention_backward_cpu));
}

}  // namespace fusedmha::cpu
