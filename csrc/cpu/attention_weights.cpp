// CPU kernel of fusedmha::attention_weights: check, allocate, fill the
// params, run the work items (one per batch index or batch·head and block
// of query rows) on the threads.

#include "cpu/isa_kernels.h"
#include "cpu/work_items.h"
#include "ops/attention_checks.h"
#include "ops/attention_params_filler.h"
#include "ops/attention_shapes.h"

#include <torch/library.h>

namespace fusedmha::cpu {
namespace {

at::Tensor attention_weights_cpu(const at::Tensor& query, const at::Tensor& key,
                                 const at::Tensor& logsumexp, const at::Tensor& rng_state,
                                 const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                 bool is_causal, std::optional<double> scale, bool enable_gqa,
                                 bool average_heads, int64_t window_left, int64_t window_right, bool bottom_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks) {
  const AttentionVariants variants{window_left, window_right, bottom_right, softcap,
                                   alibi_slopes, sinks};
  ops::check_attention_weights_inputs(ops::kWeightsOp, query, key, logsumexp, rng_state,
                                      attn_mask, dropout_p, scale, enable_gqa, variants);
  at::Tensor weights = ops::allocate_attention_weights(query, key, enable_gqa, average_heads);
  if (weights.numel() == 0) return weights;
  if (ops::attention_query_rows(ops::kWeightsOp, query, key, key, enable_gqa) == 0 ||
      key.size(-2) == 0) {
    // No query row or no key (or no head to average): no probability is
    // positive, and the work split would divide by zero.
    return weights.zero_();
  }
  // Key stands in for value: the weights never read values.
  ops::AttentionCall call(ops::kWeightsOp, query, key, key, attn_mask, is_causal, scale,
                          enable_gqa, variants, dropout_p, ops::last_dim_contiguous,
                          /*pack_query_heads=*/false);
  const WeightsParams wp = call.weights(logsumexp, rng_state, dropout_p, average_heads, weights);

  const IsaKernels kernels = selected_kernels();
  const WorkSplit split = kernels.weights_configure(wp, available_threads());
  run_items_in_parallel(split.items, split.workspace_bytes, [&](int64_t item, void* workspace) {
    kernels.weights_item(wp, split, item, workspace);
  });
  return weights;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CPU, m) {
  m.impl("attention_weights", TORCH_FN(attention_weights_cpu));
}

}  // namespace fusedmha::cpu
