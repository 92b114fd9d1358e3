// CUDA kernels of fusedmha::attention_forward, attention_backward and
// attention_weights: the same checks and output allocation as the CPU
// kernels (ops/attention_checks.h), then the tensors described to the
// kernels (cuda/cuda_params.h) and a launch on the current stream.
//
// Half-precision calls take the tensor-core kernels when the GPU and the
// shapes allow it (sm_80+, head dims <= 256, shared memory), else, like
// float32 and float64, the simple kernels. Nothing here synchronises with
// the GPU or copies host data to it, so calls can be captured in CUDA graphs.

#include "common/philox.h"
#include "cuda/flash_config.h"
#include "cuda/kernels.h"
#include "ops/attention_checks.h"
#include "ops/kernel_inputs.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

namespace fusedmha::cuda {
namespace {

using ops::broadcast_stride;
using ops::last_dim_contiguous;

// t's (rows, cols) matrices, indexed by the output's outer dims (batch dims
// and heads): dims t lacks or has as size 1 broadcast, a head count that
// divides the output's is grouped-query (head h reads h / (H / H_t)).
Matrix matrix_of(const at::Tensor& t, const OuterShape& outer) {
  Matrix m;
  m.data = t.const_data_ptr();
  const int n = outer.dims;
  for (int d = 0; d < n; ++d) {
    const int64_t td = t.dim() - 2 - (n - d);
    m.divisor[d] = 1;
    if (td >= 0 && t.size(td) != 1) {
      m.outer_stride[d] = t.stride(td);
      m.divisor[d] = t.size(td) == 0 ? 1 : outer.size[d] / t.size(td);  // (0: nothing to read)
    }
  }
  m.row_stride = broadcast_stride(t, -2);
  m.col_stride = broadcast_stride(t, -1);
  return m;
}

// The tensor-core kernels load rows with 16-byte copies: contiguous
// columns, 16-byte aligned rows. Anything else is copied once into rows
// padded to a multiple of 8 elements.
at::Tensor rows_16_byte_aligned(const at::Tensor& t) {
  bool ok = (t.size(-1) <= 1 || t.stride(-1) == 1) &&
            reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
  for (int64_t d = 0; ok && d < t.dim() - 1; ++d) ok = t.size(d) <= 1 || t.stride(d) % 8 == 0;
  if (ok) return t;
  std::vector<int64_t> padded(t.sizes().begin(), t.sizes().end());
  padded.back() = (padded.back() + 7) / 8 * 8;
  at::Tensor copy = at::empty(padded, t.options()).narrow(-1, 0, t.size(-1));
  copy.copy_(t);
  return copy;
}

enum class Pass { Forward, Backward, Weights };

// The attention call described for the kernels; owns any copies it made.
// The weights pass always takes the simple kernel: it writes the whole
// (L, S) matrix, so it is memory bound either way.
struct CudaAttention {
  at::Tensor query, key, value;
  AttentionParams params;
  bool flash = false;

  CudaAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const std::optional<at::Tensor>& attn_mask, bool is_causal,
                std::optional<double> scale, bool enable_gqa, Pass pass) {
    AttentionParams& p = params;
    p.dtype = ops::dtype_of(q.scalar_type());
    const std::vector<c10::SymInt> outer = ops::attention_outer_shape(q, k, v, enable_gqa);
    TORCH_CHECK(outer.size() <= static_cast<size_t>(kMaxOuterDims),
                "fusedmha.scaled_dot_product_attention (CUDA): at most ", kMaxOuterDims - 1,
                " batch dims are supported, got ", outer.size() - 1);
    p.outer.dims = static_cast<int>(outer.size());
    p.num_outer = 1;
    for (size_t d = 0; d < outer.size(); ++d) {
      p.outer.size[d] = outer[d].expect_int();
      p.num_outer *= p.outer.size[d];
    }
    p.len_q = q.size(-2);
    p.len_kv = k.size(-2);
    p.dim_qk = q.size(-1);
    p.dim_v = v.size(-1);
    flash = pass != Pass::Weights && use_flash(q, pass == Pass::Backward);
    const auto prepare = flash ? rows_16_byte_aligned : last_dim_contiguous;
    query = prepare(q);
    key = prepare(k);
    value = prepare(v);
    p.q = matrix_of(query, p.outer);
    p.k = matrix_of(key, p.outer);
    p.v = matrix_of(value, p.outer);
    if (attn_mask.has_value()) {
      const at::Tensor& mask = *attn_mask;
      p.mask = matrix_of(mask, p.outer);
      p.mask_kind = ops::mask_kind_of(mask, q);
    }
    // With no query/key dims every score is 0, whatever the (then
    // infinite) default scale says.
    p.scale = p.dim_qk == 0 ? 0.0 : ops::attention_scale(q, scale);
    p.is_causal = is_causal;
    // One CTA per 64 rows (tensor cores) or warp of 4 rows (simple kernels).
    TORCH_CHECK(p.num_outer * std::max(p.len_q, p.len_kv) / 4 < (int64_t(1) << 31),
                "fusedmha (CUDA): batch x heads x sequence length = ", p.num_outer, " x ",
                std::max(p.len_q, p.len_kv), " is too large for one kernel launch");
  }

  // A tensor of the output's shape (out, grad_out) for the kernels.
  Matrix output_like(at::Tensor& t) {
    if (flash) t = rows_16_byte_aligned(t);
    else t = last_dim_contiguous(t);
    return matrix_of(t, params.outer);
  }

  void replay_dropout(const at::Tensor& rng_state, double dropout_p) {
    if (dropout_p <= 0) return;
    params.dropout_p = dropout_p;
    params.dropout_threshold = dropout_threshold(dropout_p);
    params.rng_state_in = rng_state.const_data_ptr<int64_t>();
  }

 private:
  bool use_flash(const at::Tensor& q, bool backward) const {
    const AttentionParams& p = params;
    if (p.dtype != DType::Float16 && p.dtype != DType::BFloat16) return false;
    if (std::max(p.dim_qk, p.dim_v) > kFlashMaxHeadDim || p.dim_qk == 0 || p.dim_v == 0) {
      return false;
    }
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(q.device().index());
    if (prop->major < 8) return false;
    const int d = flash_head_dim_group(p.dim_qk, p.dim_v);
    const size_t smem = backward ? flash_bwd::smem_bytes(d) : flash_fwd::smem_bytes(d);
    return smem <= prop->sharedMemPerBlockOptin;
  }
};

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "fusedmha: launching the CUDA ", what, " kernel failed: ",
              cudaGetErrorString(err));
}

// Shared memory the simple kernels need, checked before they are chosen.
void check_simple_smem(const at::Tensor& q, size_t need, const char* what) {
  const size_t have = at::cuda::getDeviceProperties(q.device().index())->sharedMemPerBlockOptin;
  TORCH_CHECK(need <= have, "fusedmha (CUDA ", what, "): head dims this large (query/key ",
              q.size(-1), ", times the heads averaged for average_attn_weights) need ", need,
              " bytes of shared memory per block for the row accumulators, this GPU has ", have);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_cuda(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
    std::optional<double> scale, bool enable_gqa) {
  ops::check_attention_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa);
  const c10::cuda::CUDAGuard guard(query.device());
  auto [out, lse, rng_state] = ops::allocate_attention_outputs(query, key, value, enable_gqa);
  CudaAttention call(query, key, value, attn_mask, is_causal, scale, enable_gqa, Pass::Forward);
  AttentionParams& p = call.params;
  const bool empty = p.num_outer * p.len_q == 0;
  if (dropout_p > 0 && !empty) {
    // The kernel writes (seed, offset) into rng_state, read on the device
    // under graph capture: nothing here waits for the GPU.
    auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
        std::nullopt, at::cuda::detail::getDefaultCUDAGenerator());
    at::PhiloxCudaState state;
    {
      const std::lock_guard<std::mutex> lock(gen->mutex_);
      state = gen->philox_cuda_state(4);
    }
    if (state.captured_) {
      p.rng.seed_ptr = state.seed_.ptr;
      p.rng.offset_ptr = state.offset_.ptr;
      p.rng.offset = state.offset_intragraph_;
    } else {
      p.rng.seed = state.seed_.val;
      p.rng.offset = state.offset_.val;
    }
    p.dropout_p = dropout_p;
    p.dropout_threshold = dropout_threshold(dropout_p);
  }
  if (empty) {
    rng_state.zero_();  // (no kernel runs to write it)
  } else {
    p.rng_state_out = rng_state.mutable_data_ptr<int64_t>();
  }
  p.out = matrix_of(out, p.outer);
  p.lse = lse.mutable_data_ptr();
  if (empty) return {out, lse, rng_state};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (call.flash) {
    check_launch(flash_forward(p, stream), "forward (tensor cores)");
  } else {
    check_simple_smem(query, simple_forward_smem(p), "forward");
    check_launch(simple_forward(p, stream), "forward");
  }
  return {out, lse, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const std::optional<at::Tensor>& attn_mask, double dropout_p,
    bool is_causal, std::optional<double> scale, bool enable_gqa) {
  ops::check_attention_backward_inputs(grad_out, query, key, value, out, logsumexp, rng_state,
                                       attn_mask, dropout_p, is_causal, scale, enable_gqa);
  const c10::cuda::CUDAGuard guard(query.device());
  CudaAttention call(query, key, value, attn_mask, is_causal, scale, enable_gqa, Pass::Backward);
  const at::Tensor rng = rng_state.to(query.device());
  call.replay_dropout(rng, dropout_p);

  BackwardParams bp;
  bp.fwd = call.params;
  const AttentionParams& p = bp.fwd;
  at::Tensor grad_out_k = grad_out;
  bp.grad_out = call.output_like(grad_out_k);
  const at::Tensor lse = logsumexp.contiguous();
  bp.lse = lse.const_data_ptr();
  // D = rowsum(dO ∘ O), in the accumulation dtype.
  const auto acc = lse.scalar_type();
  const at::Tensor delta = grad_out.to(acc).mul(out.to(acc)).sum(-1).contiguous();
  bp.delta = delta.const_data_ptr();

  std::vector<int64_t> shape(p.outer.size, p.outer.size + p.outer.dims);
  shape.insert(shape.end(), {p.len_q, p.dim_qk});
  const auto acc_options = query.options().dtype(acc);
  // The tensor-core backward sums dQ into grad_q with atomics (zeroed
  // first); both backwards write every row of grad_k and grad_v.
  at::Tensor grad_q = at::zeros(shape, acc_options);
  shape.end()[-2] = p.len_kv;
  at::Tensor grad_k = at::empty(shape, acc_options);
  shape.back() = p.dim_v;
  at::Tensor grad_v = at::empty(shape, acc_options);
  bp.grad_q = grad_q.mutable_data_ptr();
  bp.grad_k = grad_k.mutable_data_ptr();
  bp.grad_v = grad_v.mutable_data_ptr();

  if (p.num_outer * p.len_kv > 0 && p.len_q > 0) {
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    if (call.flash) {
      check_launch(flash_backward(bp, stream), "backward (tensor cores)");
    } else {
      check_simple_smem(query, simple_backward_smem(p), "backward");
      check_launch(simple_backward(bp, stream), "backward");
    }
  } else {
    grad_k.zero_();
    grad_v.zero_();
  }
  return {ops::reduce_to_input(grad_q, query), ops::reduce_to_input(grad_k, key),
          ops::reduce_to_input(grad_v, value)};
}

at::Tensor attention_weights_cuda(const at::Tensor& query, const at::Tensor& key,
                                  const at::Tensor& logsumexp, const at::Tensor& rng_state,
                                  const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                  bool is_causal, std::optional<double> scale, bool enable_gqa,
                                  bool average_heads) {
  ops::check_attention_weights_inputs(query, key, logsumexp, rng_state, attn_mask, dropout_p,
                                      is_causal, scale, enable_gqa);
  const c10::cuda::CUDAGuard guard(query.device());
  at::Tensor weights = ops::allocate_attention_weights(query, key, enable_gqa, average_heads);
  if (weights.numel() == 0) return weights;
  // Key stands in for value: the weights never read values.
  CudaAttention call(query, key, key, attn_mask, is_causal, scale, enable_gqa, Pass::Weights);
  const at::Tensor rng = rng_state.to(query.device());
  call.replay_dropout(rng, dropout_p);
  const at::Tensor lse = logsumexp.contiguous();

  WeightsParams wp;
  wp.fwd = call.params;
  wp.lse = lse.const_data_ptr();
  wp.heads_per_item = average_heads ? wp.fwd.outer.size[wp.fwd.outer.dims - 1] : 1;
  wp.weights = weights.mutable_data_ptr();
  check_simple_smem(query, simple_weights_smem(wp), "attention weights");
  check_launch(simple_weights(wp, at::cuda::getCurrentCUDAStream()), "attention weights");
  return weights;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CUDA, m) {
  m.impl("attention_forward", TORCH_FN(attention_forward_cuda));
  m.impl("attention_backward", TORCH_FN(attention_backward_cuda));
  m.impl("attention_weights", TORCH_FN(attention_weights_cuda));
}

}  // namespace fusedmha::cuda
