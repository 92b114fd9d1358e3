// CPU kernel of fusedmha::attention_backward: describes the tensors to the
// ISA-specific kernels, runs one work item per (batch·head, key block) on
// the threads, then sums the per-head gradients into the shapes of the
// inputs (GQA groups, broadcast batch/head dims).

#include "cpu/launch.h"
#include "ops/attention_checks.h"
#include "ops/kernel_inputs.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <array>
#include <mutex>

namespace fusedmha::cpu {
namespace {

// grad_q receives the contributions of every key block; the kernels hand
// them over here, one query block at a time.
struct GradQ {
  std::array<std::mutex, 64> locks;  // striped by outer index
};

template <typename acc_t>
void add_rows(acc_t* dst, const acc_t* src, int64_t rows, int64_t ld, int64_t dim, acc_t scale) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t e = 0; e < dim; ++e) dst[i * dim + e] += scale * src[i * ld + e];
  }
}

void add_grad_q(const BackwardParams& p, int64_t o, int64_t q0, int64_t rows, const void* block,
                int64_t ld) {
  auto& state = *static_cast<GradQ*>(p.host_state);
  const std::lock_guard<std::mutex> lock(state.locks[o % state.locks.size()]);
  const int64_t E = p.fwd.dim_qk, offset = (o * p.fwd.len_q + q0) * E;
  if (p.fwd.dtype == DType::Float64) {
    add_rows(static_cast<double*>(p.grad_q) + offset, static_cast<const double*>(block), rows, ld,
             E, p.fwd.scale);
  } else {
    add_rows(static_cast<float*>(p.grad_q) + offset, static_cast<const float*>(block), rows, ld, E,
             static_cast<float>(p.fwd.scale));
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const std::optional<at::Tensor>& attn_mask, double dropout_p,
    bool is_causal, std::optional<double> scale, bool enable_gqa) {
  ops::check_attention_backward_inputs(grad_out, query, key, value, out, logsumexp, rng_state,
                                       attn_mask, dropout_p, is_causal, scale, enable_gqa);
  AttentionInputs inputs(query, key, value, attn_mask, is_causal, scale, enable_gqa);
  const at::Tensor out_c = ops::last_dim_contiguous(out);
  const at::Tensor grad_out_c = ops::last_dim_contiguous(grad_out);
  const at::Tensor lse = logsumexp.contiguous();

  BackwardParams bp;
  bp.fwd = inputs.params;
  bp.out = inputs.view(out_c);
  bp.grad_out = inputs.view(grad_out_c);
  bp.lse = lse.const_data_ptr();
  replay_dropout(bp.fwd, rng_state, dropout_p);

  const auto acc = query.options().dtype(lse.scalar_type());
  std::vector<int64_t> shape = inputs.outer_shape;
  shape.insert(shape.end(), {bp.fwd.len_q, bp.fwd.dim_qk});
  at::Tensor grad_q = at::zeros(shape, acc);
  shape.end()[-2] = bp.fwd.len_kv;
  at::Tensor grad_k = at::empty(shape, acc);
  shape.back() = bp.fwd.dim_v;
  at::Tensor grad_v = at::empty(shape, acc);
  bp.grad_q = grad_q.mutable_data_ptr();
  bp.grad_k = grad_k.mutable_data_ptr();
  bp.grad_v = grad_v.mutable_data_ptr();
  GradQ grad_q_state;
  bp.add_grad_q = &add_grad_q;
  bp.host_state = &grad_q_state;

  const IsaKernels kernels = selected_kernels();
  const size_t workspace_bytes = kernels.backward_configure(bp);
  run_items_in_parallel(num_backward_items(bp), workspace_bytes,
                        [&](int64_t item, void* workspace) {
                          kernels.backward_items(bp, item, item + 1, workspace);
                        });
  return {ops::reduce_to_input(grad_q, query), ops::reduce_to_input(grad_k, key),
          ops::reduce_to_input(grad_v, value)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CPU, m) {
  m.impl("attention_backward", TORCH_FN(attention_backward_cpu));
}

}  // namespace fusedmha::cpu
