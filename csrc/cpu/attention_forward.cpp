// CPU kernel of fusedmha::attention_forward: checks the tensors, describes
// them to the ISA-specific kernels, allocates the outputs and shares the work
// items among the threads.

#include "cpu/launch.h"
#include "ops/attention_checks.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/DistributionsHelper.h>
#include <torch/library.h>

#include <mutex>

namespace fusedmha::cpu {
namespace {

// (seed, offset) of a call's dropout stream, drawn from the default CPU
// generator: torch.manual_seed makes runs repeatable, and two calls differ.
std::pair<uint64_t, uint64_t> draw_dropout_seed() {
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
      std::nullopt, at::detail::getDefaultCPUGenerator());
  const std::lock_guard<std::mutex> lock(gen->mutex_);
  const uint64_t seed = gen->random64();
  return {seed, gen->random64()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_cpu(const at::Tensor& query,
                                                         const at::Tensor& key,
                                                         const at::Tensor& value,
                                                         const std::optional<at::Tensor>& attn_mask,
                                                         double dropout_p,
                                                         bool is_causal,
                                                         std::optional<double> scale,
                                                         bool enable_gqa) {
  ops::check_attention_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa);
  auto [out, lse, rng_state] = ops::allocate_attention_outputs(query, key, value, enable_gqa);
  AttentionInputs inputs(query, key, value, attn_mask, is_causal, scale, enable_gqa);
  ForwardParams& p = inputs.params;
  const MatrixView out_view = inputs.view(out);
  p.out = out.mutable_data_ptr();
  p.out_offsets = out_view.offsets;
  p.out_row_stride = out.stride(-2);
  p.lse = lse.mutable_data_ptr();
  p.dropout_p = dropout_p;
  if (dropout_p > 0) {
    std::tie(p.dropout.seed, p.dropout.offset) = draw_dropout_seed();
    p.dropout_threshold = dropout_threshold(dropout_p);
  }
  rng_state[0] = static_cast<int64_t>(p.dropout.seed);
  rng_state[1] = static_cast<int64_t>(p.dropout.offset);

  const IsaKernels kernels = selected_kernels();
  const size_t workspace_bytes = kernels.forward_configure(p);
  run_items_in_parallel(num_work_items(p), workspace_bytes, [&](int64_t item, void* workspace) {
    kernels.forward_items(p, item, item + 1, workspace);
  });
  return {out, lse, rng_state};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CPU, m) {
  m.impl("attention_forward", TORCH_FN(attention_forward_cpu));
}

}  // namespace fusedmha::cpu
