// Autograd for fusedmha::attention_forward, registered once, in C++, so C++
// callers get the same graph as Python's. The fused backward kernel does not
// exist yet: until it does, backward raises instead of returning anything.

#include <fusedmha/attention.h>

#include <torch/autograd.h>
#include <torch/library.h>

namespace fusedmha::ops {
namespace {

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& query, const at::Tensor& key,
                                                const at::Tensor& value,
                                                const std::optional<at::Tensor>& attn_mask,
                                                double dropout_p, bool is_causal,
                                                std::optional<double> scale, bool enable_gqa) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = fusedmha::attention_forward(query, key, value, attn_mask, dropout_p,
                                                  is_causal, scale, enable_gqa);
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    TORCH_CHECK(false,
                "fusedmha.scaled_dot_product_attention: backward is not implemented yet (the "
                "fused backward kernel comes with the training support); use "
                "torch.nn.functional.scaled_dot_product_attention to train for now");
  }
};

std::tuple<at::Tensor, at::Tensor> attention_forward_autograd(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
    std::optional<double> scale, bool enable_gqa) {
  auto outputs = AttentionFunction::apply(query, key, value, attn_mask, dropout_p, is_causal,
                                          scale, enable_gqa);
  return {outputs[0], outputs[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, Autograd, m) {
  m.impl("attention_forward", TORCH_FN(attention_forward_autograd));
}

}  // namespace fusedmha::ops
