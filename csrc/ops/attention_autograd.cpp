// Autograd for fusedmha::attention_forward, registered once, in C++, so C++
// callers train exactly like Python ones. The backward is its own op
// (fusedmha::attention_backward) with its own kernels.

#include <fusedmha/attention.h>

#include <torch/autograd.h>
#include <torch/library.h>

namespace fusedmha::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& query,
                               const at::Tensor& key, const at::Tensor& value,
                               const std::optional<at::Tensor>& attn_mask, double dropout_p,
                               bool is_causal, std::optional<double> scale, bool enable_gqa) {
    TORCH_CHECK(!attn_mask.has_value() || !attn_mask->requires_grad(),
                "fusedmha.scaled_dot_product_attention: gradients with respect to a float "
                "attn_mask are not supported; pass attn_mask.detach()");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse, rng_state] = fusedmha::attention_forward(query, key, value, attn_mask,
                                                             dropout_p, is_causal, scale,
                                                             enable_gqa);
    ctx->mark_non_differentiable({lse, rng_state});
    ctx->save_for_backward({query, key, value, out, lse, rng_state});
    ctx->saved_data["attn_mask"] = attn_mask.has_value() ? c10::IValue(*attn_mask) : c10::IValue();
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale.has_value() ? c10::IValue(*scale) : c10::IValue();
    ctx->saved_data["enable_gqa"] = enable_gqa;
    return {out, lse, rng_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& out = saved[3];
    const at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const c10::IValue& mask = ctx->saved_data["attn_mask"];
    const c10::IValue& scale = ctx->saved_data["scale"];
    auto [dq, dk, dv] = fusedmha::attention_backward(
        grad_out, saved[0], saved[1], saved[2], out, saved[4], saved[5],
        mask.isNone() ? std::nullopt : std::optional<at::Tensor>(mask.toTensor()),
        ctx->saved_data["dropout_p"].toDouble(), ctx->saved_data["is_causal"].toBool(),
        scale.isNone() ? std::nullopt : std::optional<double>(scale.toDouble()),
        ctx->saved_data["enable_gqa"].toBool());
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The backward op is differentiable only in name: with create_graph=True its
// outputs carry a node that refuses a second backward with a clear message.
class AttentionBackwardFunction : public torch::autograd::Function<AttentionBackwardFunction> {
 public:
  static variable_list forward(AutogradContext*, const at::Tensor& grad_out,
                               const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const at::Tensor& out,
                               const at::Tensor& logsumexp, const at::Tensor& rng_state,
                               const std::optional<at::Tensor>& attn_mask, double dropout_p,
                               bool is_causal, std::optional<double> scale, bool enable_gqa) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dq, dk, dv] = fusedmha::attention_backward(grad_out, query, key, value, out, logsumexp,
                                                     rng_state, attn_mask, dropout_p, is_causal,
                                                     scale, enable_gqa);
    return {dq, dk, dv};
  }

  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false,
                "fusedmha.scaled_dot_product_attention: double backward (differentiating its "
                "gradients again) is not supported");
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_autograd(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const std::optional<at::Tensor>& attn_mask, double dropout_p,
    bool is_causal, std::optional<double> scale, bool enable_gqa) {
  auto grads = AttentionBackwardFunction::apply(grad_out, query, key, value, out, logsumexp,
                                                rng_state, attn_mask, dropout_p, is_causal, scale,
                                                enable_gqa);
  return {grads[0], grads[1], grads[2]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_autograd(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
    std::optional<double> scale, bool enable_gqa) {
  auto outputs = AttentionFunction::apply(query, key, value, attn_mask, dropout_p, is_causal,
                                          scale, enable_gqa);
  return {outputs[0], outputs[1], outputs[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, Autograd, m) {
  m.impl("attention_forward", TORCH_FN(attention_forward_autograd));
  m.impl("attention_backward", TORCH_FN(attention_backward_autograd));
}

}  // namespace fusedmha::ops
