// Meta (shape-only) kernels of the fusedmha ops: fake tensors,
// torch.compile and torch.export run this. It shares the checks and the
// output allocation with the real kernels, so shapes, strides and errors
// agree; sizes stay symbolic.

#include "ops/attention_checks.h"
#include "ops/attention_shapes.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace fusedmha::ops {
namespace {

using OptTensor = std::optional<at::Tensor>;

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_meta(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const OptTensor& attn_mask, double dropout_p, bool is_causal, std::optional<double> scale,
    bool enable_gqa, int64_t window_left, int64_t window_right, bool bottom_right,
    double softcap, const OptTensor& alibi_slopes, const OptTensor& sinks,
    const OptTensor& dropout_state) {
  check_attention_inputs(kForwardOp, query, key, value, attn_mask, dropout_p, scale, enable_gqa,
                         {window_left, window_right, bottom_right, softcap, alibi_slopes, sinks});
  check_dropout_state(kForwardOp, dropout_state);
  auto outputs = allocate_attention_outputs(query, key, value, enable_gqa);
  return {std::get<0>(outputs), std::get<1>(outputs),
          returned_rng_state(std::get<2>(outputs), dropout_state)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const OptTensor& attn_mask, double dropout_p, bool is_causal,
    std::optional<double> scale, bool enable_gqa, int64_t window_left, int64_t window_right,
    bool bottom_right, double softcap, const OptTensor& alibi_slopes, const OptTensor& sinks,
    const OptTensor& grad_logsumexp) {
  check_attention_backward_inputs(
      kBackwardOp, grad_out, query, key, value, out, logsumexp, rng_state, attn_mask, dropout_p,
      scale, enable_gqa, {window_left, window_right, bottom_right, softcap, alibi_slopes, sinks},
      grad_logsumexp);
  // Contiguous, in the inputs' shapes and dtypes, as the real kernels return them.
  return {at::empty_symint(query.sym_sizes(), query.options()),
          at::empty_symint(key.sym_sizes(), key.options()),
          at::empty_symint(value.sym_sizes(), value.options())};
}

at::Tensor attention_weights_meta(const at::Tensor& query, const at::Tensor& key,
                                  const at::Tensor& logsumexp, const at::Tensor& rng_state,
                                  const OptTensor& attn_mask, double dropout_p, bool is_causal,
                                  std::optional<double> scale, bool enable_gqa,
                                  bool average_heads, int64_t window_left, int64_t window_right,
                                  bool bottom_right, double softcap,
                                  const OptTensor& alibi_slopes, const OptTensor& sinks) {
  check_attention_weights_inputs(
      kWeightsOp, query, key, logsumexp, rng_state, attn_mask, dropout_p, scale, enable_gqa,
      {window_left, window_right, bottom_right, softcap, alibi_slopes, sinks});
  return allocate_attention_weights(query, key, enable_gqa, average_heads);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_forward_meta(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, double dropout_p, bool is_causal, std::optional<double> scale,
    int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
    const OptTensor& alibi_slopes, const OptTensor& sinks, const OptTensor& seqused_k,
    const OptTensor& block_table) {
  check_varlen_inputs(kVarlenForwardOp, query, key, value,
                      {cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                       block_table},
                      dropout_p, scale,
                      {window_left, window_right, bottom_right, softcap, alibi_slopes, sinks});
  return allocate_varlen_outputs(query, value);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, bool is_causal,
    std::optional<double> scale, int64_t window_left, int64_t window_right, bool bottom_right,
    double softcap, const OptTensor& alibi_slopes, const OptTensor& sinks,
    const OptTensor& seqused_k, const OptTensor& grad_logsumexp) {
  check_varlen_backward_inputs(
      kVarlenBackwardOp, grad_out, query, key, value, out, logsumexp, rng_state,
      {cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k}, dropout_p, scale,
      {window_left, window_right, bottom_right, softcap, alibi_slopes, sinks}, grad_logsumexp);
  return {at::empty_symint(query.sym_sizes(), query.options()),
          at::empty_symint(key.sym_sizes(), key.options()),
          at::empty_symint(value.sym_sizes(), value.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, Meta, m) {
  m.impl("varlen_attention_forward", TORCH_FN(varlen_attention_forward_meta));
  m.impl("varlen_attention_backward", TORCH_FN(varlen_attention_backward_meta));
  m.impl("attention_forward", TORCH_FN(attention_forward_meta));
  m.impl("attention_backward", TORCH_FN(attention_backward_meta));
  m.impl("attention_weights", TORCH_FN(attention_weights_meta));
}

}  // namespace fusedmha::ops
