// CPU kernel of fusedmha::attention_weights: describes the tensors to the
// ISA-specific weights kernels and runs one work item per (batch index or
// batch·head, block of query rows) on the threads.

#include "cpu/launch.h"
#include "ops/attention_checks.h"

#include <torch/library.h>

namespace fusedmha::cpu {
namespace {

at::Tensor attention_weights_cpu(const at::Tensor& query, const at::Tensor& key,
                                 const at::Tensor& logsumexp, const at::Tensor& rng_state,
                                 const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                 bool is_causal, std::optional<double> scale, bool enable_gqa,
                                 bool average_heads) {
  ops::check_attention_weights_inputs(query, key, logsumexp, rng_state, attn_mask, dropout_p,
                                      is_causal, scale, enable_gqa);
  at::Tensor weights = ops::allocate_attention_weights(query, key, enable_gqa, average_heads);
  if (weights.numel() == 0) return weights;
  // Key stands in for value: the weights never read values.
  AttentionInputs inputs(query, key, key, attn_mask, is_causal, scale, enable_gqa);
  const at::Tensor lse = logsumexp.contiguous();

  WeightsParams wp;
  wp.fwd = inputs.params;
  replay_dropout(wp.fwd, rng_state, dropout_p);
  wp.lse = lse.const_data_ptr();
  wp.heads_per_item = average_heads ? inputs.outer_shape.back() : 1;
  wp.weights = weights.mutable_data_ptr();

  const IsaKernels kernels = selected_kernels();
  const size_t workspace_bytes = kernels.weights_configure(wp);
  run_items_in_parallel(num_weights_items(wp), workspace_bytes, [&](int64_t item, void* workspace) {
    kernels.weights_items(wp, item, item + 1, workspace);
  });
  return weights;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CPU, m) {
  m.impl("attention_weights", TORCH_FN(attention_weights_cpu));
}

}  // namespace fusedmha::cpu
