// CPU kernel of fusedmha::attention_forward: checks the tensors, describes
// them to the ISA-specific kernels, allocates the outputs and shares the work
// items among the threads.

#include "cpu/launch.h"
#include "ops/attention_checks.h"

#include <torch/library.h>

namespace fusedmha::cpu {
namespace {

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(const at::Tensor& query,
                                                         const at::Tensor& key,
                                                         const at::Tensor& value,
                                                         const std::optional<at::Tensor>& attn_mask,
                                                         double dropout_p,
                                                         bool is_causal,
                                                         std::optional<double> scale,
                                                         bool enable_gqa) {
  ops::check_attention_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa);
  auto [out, lse] = ops::allocate_attention_outputs(query, key, value, enable_gqa);
  AttentionInputs inputs(query, key, value, attn_mask, is_causal, scale, enable_gqa);
  ForwardParams& p = inputs.params;
  const MatrixView out_view = inputs.view(out);
  p.out = out.mutable_data_ptr();
  p.out_offsets = out_view.offsets;
  p.out_row_stride = out.stride(-2);
  p.lse = lse.mutable_data_ptr();

  const IsaKernels kernels = selected_kernels();
  const size_t workspace_bytes = kernels.forward_configure(p);
  run_items_in_parallel(num_work_items(p), workspace_bytes, [&](int64_t item, void* workspace) {
    kernels.forward_items(p, item, item + 1, workspace);
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CPU, m) {
  m.impl("attention_forward", TORCH_FN(attention_forward_cpu));
}

}  // namespace fusedmha::cpu
