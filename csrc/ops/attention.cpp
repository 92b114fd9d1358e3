// The C++ API: thin calls through the dispatcher, so that device dispatch,
// autograd, autocast and tracing apply to C++ callers exactly as to Python's.

#include <ATen/core/dispatch/Dispatcher.h>
#include <fusedmha/attention.h>
#include <torch/library.h>

#include "ops/attention_checks.h"
#include "ops/attention_shapes.h"
#include "ops/op_args.h"

namespace fusedmha {
namespace {

using OptTensor = std::optional<at::Tensor>;

// fusedmha::scaled_dot_product_attention for every backend: the forward op's
// output. Registered as CompositeImplicitAutograd, so autograd and tracing
// see attention_forward.
at::Tensor sdpa_composite(const ops::SdpaArgs& a) {
  const auto& [query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, variants] = a;
  // PyTorch's rule; the op itself applies both (MultiheadAttention uses that
  // for causal attention with a key padding mask).
  TORCH_CHECK(!(is_causal && attn_mask.has_value()), ops::kSdpaOp,
              ": an explicit attn_mask should not be set when is_causal=True");
  // PyTorch scores 3-d inputs (N, L, E) as (1, N, L, S), so it also takes a
  // 4-d mask whose first dim is 1 there: that is the same mask without it.
  // (Kept whole where the rest does not broadcast either: the error then
  // shows the shape that was passed.)
  OptTensor mask = attn_mask;
  if (mask.has_value() && query.dim() == 3 && mask->dim() == 4 && mask->sym_size(0) == 1) {
    std::vector<c10::SymInt> target =
        ops::attention_outer_shape(ops::kSdpaOp, query, key, value, enable_gqa);
    target.push_back(query.sym_size(-2));
    target.push_back(key.sym_size(-2));
    if (ops::mask_broadcasts_to(mask->sym_sizes().slice(1), target)) mask = mask->squeeze(0);
  }
  // Checked here too, so that errors name the function the user called.
  ops::check_forward_inputs(
      ops::kSdpaOp, {query, key, value, mask, dropout_p == 1.0 ? 0.0 : dropout_p, is_causal, scale,
                     enable_gqa, variants, std::nullopt});
  if (dropout_p == 1.0) {
    // Every probability dropped, as in PyTorch: zeros (with zero gradients),
    // and the same input checks. The kernels themselves take p < 1.
    return std::get<0>(attention_forward(query, key, value, mask, 0.0, is_causal, scale, enable_gqa,
                                         variants))
        .mul(0.0);
  }
  return std::get<0>(attention_forward(query, key, value, mask, dropout_p, is_causal, scale,
                                       enable_gqa, variants));
}

}  // namespace

at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& value, const OptTensor& attn_mask,
                                        double dropout_p, bool is_causal,
                                        std::optional<double> scale, bool enable_gqa,
                                        const AttentionVariants& variants) {
  static const auto op = ops::find_op<ops::SdpaArgs>();
  return ops::call_op(op, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      variants);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const OptTensor& attn_mask, double dropout_p, bool is_causal, std::optional<double> scale,
    bool enable_gqa, const AttentionVariants& variants, const OptTensor& dropout_state) {
  static const auto op = ops::find_op<ops::ForwardArgs>();
  return ops::call_op(op, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      variants, dropout_state);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const OptTensor& attn_mask, double dropout_p, bool is_causal,
    std::optional<double> scale, bool enable_gqa, const AttentionVariants& variants,
    const OptTensor& grad_logsumexp, bool grad_attn_mask) {
  static const auto op = ops::find_op<ops::BackwardArgs>();
  return ops::call_op(op, grad_out, query, key, value, out, logsumexp, rng_state, attn_mask,
                      dropout_p, is_causal, scale, enable_gqa, variants, grad_logsumexp,
                      grad_attn_mask);
}

at::Tensor attention_weights(const at::Tensor& query, const at::Tensor& key,
                             const at::Tensor& logsumexp, const at::Tensor& rng_state,
                             const OptTensor& attn_mask, double dropout_p, bool is_causal,
                             std::optional<double> scale, bool enable_gqa, bool average_heads,
                             const AttentionVariants& variants) {
  static const auto op = ops::find_op<ops::WeightsArgs>();
  return ops::call_op(op, query, key, logsumexp, rng_state, attn_mask, dropout_p, is_causal, scale,
                      enable_gqa, average_heads, variants);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, double dropout_p, bool is_causal, std::optional<double> scale,
    const AttentionVariants& variants, const OptTensor& seqused_k, const OptTensor& block_table,
    const OptTensor& k_scale, const OptTensor& v_scale) {
  static const auto op = ops::find_op<ops::VarlenForwardArgs>();
  return ops::call_op(op, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      dropout_p, is_causal, scale, variants, seqused_k, block_table, k_scale,
                      v_scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, bool is_causal,
    std::optional<double> scale, const AttentionVariants& variants, const OptTensor& seqused_k,
    const OptTensor& grad_logsumexp) {
  static const auto op = ops::find_op<ops::VarlenBackwardArgs>();
  return ops::call_op(op, grad_out, query, key, value, out, logsumexp, rng_state, cu_seqlens_q,
                      cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal, scale,
                      variants, seqused_k, grad_logsumexp);
}

std::tuple<at::Tensor, at::Tensor> attention_with_kvcache(
    const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const KVCacheStep& step,
    std::optional<double> scale, bool is_causal, const AttentionVariants& variants) {
  static const auto op = ops::find_op<ops::KVCacheArgs>();
  return op.call(q, k_cache, v_cache, step.k, step.v, step.rotary_cos, step.rotary_sin,
                 step.cache_seqlens, step.cache_batch_idx, step.cache_leftpad, step.block_table,
                 scale, is_causal, step.rotary_interleaved, variants.window_left,
                 variants.window_right, variants.softcap, variants.alibi_slopes, variants.sinks,
                 std::nullopt, step.k_scale, step.v_scale);
}

TORCH_LIBRARY_IMPL(fusedmha, CompositeImplicitAutograd, m) { FUSEDMHA_OP_IMPL(m, sdpa_composite); }

}  // namespace fusedmha
