// Meta (shape-only) kernels of the fusedmha ops: fake tensors,
// torch.compile and torch.export run this. It shares the checks and the
// output allocation with the real kernels, so shapes, strides and errors
// agree; sizes stay symbolic.

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops/attention_checks.h"
#include "ops/attention_shapes.h"

namespace fusedmha::ops {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_meta(const ForwardArgs& a) {
  check_forward_inputs(kForwardOp, a);
  auto [out, lse, rng_state] = allocate_attention_outputs(a.query, a.key, a.value, a.enable_gqa);
  return {out, lse, returned_rng_state(rng_state, a.dropout_state)};
}

// Contiguous, in the inputs' shapes and dtypes, as the real kernels return them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gradients_like(const at::Tensor& query,
                                                              const at::Tensor& key,
                                                              const at::Tensor& value) {
  return {at::empty_symint(query.sym_sizes(), query.options()),
          at::empty_symint(key.sym_sizes(), key.options()),
          at::empty_symint(value.sym_sizes(), value.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_meta(
    const BackwardArgs& a) {
  check_backward_inputs(kBackwardOp, a);
  auto [dq, dk, dv] = gradients_like(a.query, a.key, a.value);
  at::Tensor dmask = a.grad_attn_mask ? mask_gradient(*a.attn_mask, std::nullopt)
                                      : at::empty({0}, a.query.options());
  return {dq, dk, dv, dmask};
}

at::Tensor attention_weights_meta(const WeightsArgs& a) {
  check_weights_inputs(kWeightsOp, a);
  return allocate_attention_weights(a.query, a.key, a.enable_gqa, a.average_heads);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_forward_meta(
    const VarlenForwardArgs& a) {
  check_varlen_forward_inputs(kVarlenForwardOp, a);
  return allocate_varlen_outputs(a.query, a.value);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_meta(
    const VarlenBackwardArgs& a) {
  check_varlen_backward_inputs(kVarlenBackwardOp, a);
  return gradients_like(a.query, a.key, a.value);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, Meta, m) {
  FUSEDMHA_OP_IMPL(m, attention_forward_meta);
  FUSEDMHA_OP_IMPL(m, attention_backward_meta);
  FUSEDMHA_OP_IMPL(m, attention_weights_meta);
  FUSEDMHA_OP_IMPL(m, varlen_attention_forward_meta);
  FUSEDMHA_OP_IMPL(m, varlen_attention_backward_meta);
}

}  // namespace fusedmha::ops
