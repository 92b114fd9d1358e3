// fusedmha::merge_attention: partial attention results over disjoint sets of
// keys, combined by their log-sum-exp into the result over all of them. It is
// how split keys (split-KV decoding) and ring steps across processes add up.
// Composed of ATen ops (CompositeImplicitAutograd): differentiable, traceable.

#include <fusedmha/attention.h>

#include <ATen/ops/logsumexp.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <limits>

namespace fusedmha {
namespace {

std::tuple<at::Tensor, at::Tensor> merge_attention_composite(at::TensorList outputs,
                                                             at::TensorList lses) {
  TORCH_CHECK(!outputs.empty() && outputs.size() == lses.size(),
              "fusedmha.merge_attention: expected as many outputs as lses (at least one), got ",
              outputs.size(), " and ", lses.size());
  for (size_t n = 0; n < outputs.size(); ++n) {
    const at::Tensor &out = outputs[n], &lse = lses[n];
    TORCH_CHECK(out.dim() == 4 && lse.dim() == 3 && out.sizes() == outputs[0].sizes() &&
                    lse.sizes() == lses[0].sizes() && lse.size(0) == out.size(0) &&
                    lse.size(1) == out.size(2) && lse.size(2) == out.size(1),
                "fusedmha.merge_attention: expected outputs (B, L, H, E) and lses (B, H, L) "
                "of one shape each, as flash_attn_func(..., return_attn_probs=True) returns "
                "them; got output ", out.sizes(), " and lse ", lse.sizes(), " at index ", n);
    TORCH_CHECK(at::isFloatingType(lse.scalar_type()) && lse.device() == out.device(),
                "fusedmha.merge_attention: expected floating lses on the outputs' device");
  }
  const double inf = std::numeric_limits<double>::infinity();
  // A partial with no key for a row has lse +inf (the kernels' convention):
  // it weighs nothing, as -inf would.
  const auto acc = outputs[0].scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor lse = at::stack(lses).to(acc);  // (P, B, H, L)
  lse = at::where(lse == inf, -inf, lse);
  const at::Tensor total = at::logsumexp(lse, 0);  // (B, H, L)
  // A row no partial saw: every weight 0 (not exp(-inf + inf) = NaN).
  const at::Tensor seen = total > -inf;
  const at::Tensor weights = at::where(seen, (lse - total).exp(), 0.0);  // (P, B, H, L)
  const at::Tensor out = (at::stack(outputs).to(weights.scalar_type()) *
                          weights.permute({0, 1, 3, 2}).unsqueeze(-1))
                             .sum(0)
                             .to(outputs[0].scalar_type());
  return {out, at::where(seen, total, inf)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> merge_attention(at::TensorList outputs, at::TensorList lses) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fusedmha::merge_attention", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(at::TensorList, at::TensorList)>();
  return op.call(outputs, lses);
}

TORCH_LIBRARY_IMPL(fusedmha, CompositeImplicitAutograd, m) {
  m.impl("merge_attention", TORCH_FN(merge_attention_composite));
}

}  // namespace fusedmha
