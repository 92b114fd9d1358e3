// The C++ API: thin calls through the dispatcher, so that device dispatch,
// autograd, autocast and tracing apply to C++ callers exactly as to Python's.

#include <fusedmha/attention.h>

#include "ops/attention_checks.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace fusedmha {
namespace {

using ForwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    double, bool, std::optional<double>, bool);
using SdpaSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const std::optional<at::Tensor>&, double, bool,
                                 std::optional<double>, bool);

const c10::TypedOperatorHandle<ForwardSignature>& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("fusedmha::attention_forward", "")
                              .typed<ForwardSignature>();
  return op;
}

using BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    double, bool, std::optional<double>, bool);

const c10::TypedOperatorHandle<BackwardSignature>& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fusedmha::attention_backward", "")
                             .typed<BackwardSignature>();
  return op;
}

using WeightsSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, const std::optional<at::Tensor>&, double,
                                    bool, std::optional<double>, bool, bool);

const c10::TypedOperatorHandle<WeightsSignature>& weights_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fusedmha::attention_weights", "")
                             .typed<WeightsSignature>();
  return op;
}

const c10::TypedOperatorHandle<SdpaSignature>& sdpa_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fusedmha::scaled_dot_product_attention", "")
                             .typed<SdpaSignature>();
  return op;
}

// fusedmha::scaled_dot_product_attention for every backend: the forward op's
// output. Registered as CompositeImplicitAutograd, so autograd and tracing
// see attention_forward.
at::Tensor sdpa_composite(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const std::optional<at::Tensor>& attn_mask, double dropout_p,
                          bool is_causal, std::optional<double> scale, bool enable_gqa) {
  // PyTorch's rule; the op itself applies both (MultiheadAttention uses that
  // for causal attention with a key padding mask).
  TORCH_CHECK(!(is_causal && attn_mask.has_value()), ops::kSdpaOp,
              ": an explicit attn_mask should not be set when is_causal=True");
  // Checked here too, so that errors name the function the user called.
  ops::check_attention_inputs(ops::kSdpaOp, query, key, value, attn_mask,
                              dropout_p == 1.0 ? 0.0 : dropout_p, scale, enable_gqa);
  if (dropout_p == 1.0) {
    // Every probability dropped, as in PyTorch: zeros (with zero gradients),
    // and the same input checks. The kernels themselves take p < 1.
    return std::get<0>(forward_op().call(query, key, value, attn_mask, 0.0, is_causal, scale,
                                         enable_gqa))
        .mul(0.0);
  }
  return std::get<0>(forward_op().call(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                       enable_gqa));
}

}  // namespace

at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& value,
                                        const std::optional<at::Tensor>& attn_mask,
                                        double dropout_p, bool is_causal,
                                        std::optional<double> scale, bool enable_gqa) {
  return sdpa_op().call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward(const at::Tensor& query,
                                                     const at::Tensor& key,
                                                     const at::Tensor& value,
                                                     const std::optional<at::Tensor>& attn_mask,
                                                     double dropout_p, bool is_causal,
                                                     std::optional<double> scale,
                                                     bool enable_gqa) {
  return forward_op().call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const std::optional<at::Tensor>& attn_mask, double dropout_p,
    bool is_causal, std::optional<double> scale, bool enable_gqa) {
  return backward_op().call(grad_out, query, key, value, out, logsumexp, rng_state, attn_mask,
                            dropout_p, is_causal, scale, enable_gqa);
}

at::Tensor attention_weights(const at::Tensor& query, const at::Tensor& key,
                             const at::Tensor& logsumexp, const at::Tensor& rng_state,
                             const std::optional<at::Tensor>& attn_mask, double dropout_p,
                             bool is_causal, std::optional<double> scale, bool enable_gqa,
                             bool average_heads) {
  return weights_op().call(query, key, logsumexp, rng_state, attn_mask, dropout_p, is_causal,
                           scale, enable_gqa, average_heads);
}

TORCH_LIBRARY_IMPL(fusedmha, CompositeImplicitAutograd, m) {
  m.impl("scaled_dot_product_attention", TORCH_FN(sdpa_composite));
}

}  // namespace fusedmha
