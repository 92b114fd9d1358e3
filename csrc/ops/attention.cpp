// The C++ API: thin calls through the dispatcher, so that device dispatch,
// autograd, autocast and tracing apply to C++ callers exactly as to Python's.

#include <fusedmha/attention.h>

#include "ops/attention_checks.h"
#include "ops/attention_shapes.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace fusedmha {
namespace {

using OptTensor = std::optional<at::Tensor>;

// The variants as the schemas list them (after enable_gqa / average_heads).
#define FUSEDMHA_VARIANT_TYPES int64_t, int64_t, bool, double, const OptTensor&, const OptTensor&
#define FUSEDMHA_VARIANT_ARGS(v) \
  (v).window_left, (v).window_right, (v).bottom_right, (v).softcap, (v).alibi_slopes, (v).sinks

using ForwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, double, bool,
    std::optional<double>, bool, FUSEDMHA_VARIANT_TYPES, const OptTensor&);
using BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, double, bool,
    std::optional<double>, bool, FUSEDMHA_VARIANT_TYPES, const OptTensor&);
using WeightsSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, const OptTensor&, double, bool,
                                    std::optional<double>, bool, bool, FUSEDMHA_VARIANT_TYPES);
using SdpaSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const OptTensor&, double, bool, std::optional<double>, bool,
                                 FUSEDMHA_VARIANT_TYPES);
using VarlenForwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, int64_t, int64_t, double, bool, std::optional<double>,
    FUSEDMHA_VARIANT_TYPES, const OptTensor&, const OptTensor&);
using VarlenBackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, int64_t, int64_t, double, bool, std::optional<double>,
    FUSEDMHA_VARIANT_TYPES, const OptTensor&, const OptTensor&);

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// fusedmha::scaled_dot_product_attention for every backend: the forward op's
// output. Registered as CompositeImplicitAutograd, so autograd and tracing
// see attention_forward.
at::Tensor sdpa_composite(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const OptTensor& attn_mask, double dropout_p, bool is_causal,
                          std::optional<double> scale, bool enable_gqa, int64_t window_left,
                          int64_t window_right, bool bottom_right, double softcap,
                          const OptTensor& alibi_slopes, const OptTensor& sinks) {
  // PyTorch's rule; the op itself applies both (MultiheadAttention uses that
  // for causal attention with a key padding mask).
  TORCH_CHECK(!(is_causal && attn_mask.has_value()), ops::kSdpaOp,
              ": an explicit attn_mask should not be set when is_causal=True");
  const AttentionVariants variants{window_left, window_right, bottom_right, softcap,
                                   alibi_slopes, sinks};
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
  ops::check_attention_inputs(ops::kSdpaOp, query, key, value, mask,
                              dropout_p == 1.0 ? 0.0 : dropout_p, scale, enable_gqa, variants);
  if (dropout_p == 1.0) {
    // Every probability dropped, as in PyTorch: zeros (with zero gradients),
    // and the same input checks. The kernels themselves take p < 1.
    return std::get<0>(attention_forward(query, key, value, mask, 0.0, is_causal, scale,
                                         enable_gqa, variants))
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
  static const auto op = find_op<SdpaSignature>("fusedmha::scaled_dot_product_attention");
  return op.call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                 FUSEDMHA_VARIANT_ARGS(variants));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const OptTensor& attn_mask, double dropout_p, bool is_causal, std::optional<double> scale,
    bool enable_gqa, const AttentionVariants& variants, const OptTensor& dropout_state) {
  static const auto op = find_op<ForwardSignature>("fusedmha::attention_forward");
  return op.call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                 FUSEDMHA_VARIANT_ARGS(variants), dropout_state);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const OptTensor& attn_mask, double dropout_p, bool is_causal,
    std::optional<double> scale, bool enable_gqa, const AttentionVariants& variants,
    const OptTensor& grad_logsumexp) {
  static const auto op = find_op<BackwardSignature>("fusedmha::attention_backward");
  return op.call(grad_out, query, key, value, out, logsumexp, rng_state, attn_mask, dropout_p,
                 is_causal, scale, enable_gqa, FUSEDMHA_VARIANT_ARGS(variants), grad_logsumexp);
}

at::Tensor attention_weights(const at::Tensor& query, const at::Tensor& key,
                             const at::Tensor& logsumexp, const at::Tensor& rng_state,
                             const OptTensor& attn_mask, double dropout_p, bool is_causal,
                             std::optional<double> scale, bool enable_gqa, bool average_heads,
                             const AttentionVariants& variants) {
  static const auto op = find_op<WeightsSignature>("fusedmha::attention_weights");
  return op.call(query, key, logsumexp, rng_state, attn_mask, dropout_p, is_causal, scale,
                 enable_gqa, average_heads, FUSEDMHA_VARIANT_ARGS(variants));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, double dropout_p, bool is_causal, std::optional<double> scale,
    const AttentionVariants& variants, const OptTensor& seqused_k, const OptTensor& block_table) {
  static const auto op = find_op<VarlenForwardSignature>("fusedmha::varlen_attention_forward");
  return op.call(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 dropout_p, is_causal, scale, FUSEDMHA_VARIANT_ARGS(variants), seqused_k,
                 block_table);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, bool is_causal,
    std::optional<double> scale, const AttentionVariants& variants, const OptTensor& seqused_k,
    const OptTensor& grad_logsumexp) {
  static const auto op = find_op<VarlenBackwardSignature>("fusedmha::varlen_attention_backward");
  return op.call(grad_out, query, key, value, out, logsumexp, rng_state, cu_seqlens_q,
                 cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal, scale,
                 FUSEDMHA_VARIANT_ARGS(variants), seqused_k, grad_logsumexp);
}

std::tuple<at::Tensor, at::Tensor> attention_with_kvcache(const at::Tensor& q, at::Tensor& k_cache,
                                                          at::Tensor& v_cache,
                                                          const KVCacheStep& step,
                                                          std::optional<double> scale,
                                                          bool is_causal,
                                                          const AttentionVariants& variants) {
  using Signature = std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, at::Tensor&, at::Tensor&, const OptTensor&, const OptTensor&,
      const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
      const OptTensor&, std::optional<double>, bool, bool, int64_t, int64_t, double,
      const OptTensor&, const OptTensor&, std::optional<c10::SymInt>);
  static const auto op = find_op<Signature>("fusedmha::attention_with_kvcache");
  return op.call(q, k_cache, v_cache, step.k, step.v, step.rotary_cos, step.rotary_sin,
                 step.cache_seqlens, step.cache_batch_idx, step.cache_leftpad, step.block_table,
                 scale, is_causal, step.rotary_interleaved, variants.window_left,
                 variants.window_right, variants.softcap, variants.alibi_slopes, variants.sinks,
                 std::nullopt);
}

TORCH_LIBRARY_IMPL(fusedmha, CompositeImplicitAutograd, m) {
  m.impl("scaled_dot_product_attention", TORCH_FN(sdpa_composite));
}

}  // namespace fusedmha
