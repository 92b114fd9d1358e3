// CUDA kernels of fusedmha::attention_forward, attention_backward,
// attention_weights and the varlen forward and backward: the same checks,
// allocation and params filler as the CPU kernels (ops/), then a launch on
// the current stream.
//
// Half-precision calls take the tensor-core kernels when the GPU and the
// shapes allow it (sm_80+, head dims <= 256, shared memory), else, like
// float32 and float64, the simple kernels. Nothing here synchronises with
// the GPU or copies host data to it, so calls can be captured in CUDA graphs,
// except where a dropout stream is given rather than drawn (dropout_state,
// or the rng_state the backward and the weights pass replay): a 4-element
// one's row and column are read on the host, and one on the CPU is copied
// to the device (AttentionCall::replay_dropout).
//
// Each wrapper takes its op's record (ops/op_args.h) and shares the checks
// and params filler with its CPU twin (csrc/cpu/attention_*.cpp); what
// differs is the row layout and the launch. The launchers refuse params
// with fields only the CPU kernels read (uses_cpu_only_fields).

#include <ATen/Context.h>
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

#include "common/philox.h"
#include "cuda/flash_config.h"
#include "cuda/launchers.h"
#include "ops/attention_checks.h"
#include "ops/attention_params_filler.h"
#include "ops/attention_shapes.h"

namespace fusedmha::cuda {
namespace {

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

// Whether the tensor-core kernels take this call: half precision on sm_80+,
// head dims they are built for, and their shared memory fits.
bool use_tensor_cores(const at::Tensor& query, const at::Tensor& value, bool backward) {
  const auto dtype = query.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16) return false;
  const int64_t dim_qk = query.size(-1), dim_v = value.size(-1);
  if (std::max(dim_qk, dim_v) > kFlashMaxHeadDim || dim_qk == 0 || dim_v == 0) return false;
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(query.device().index());
  if (prop->major < 8) return false;
  const int d = flash_head_dim_group(dim_qk, dim_v);
  const size_t smem = backward ? flash_bwd::smem_bytes(d) : flash_fwd::smem_bytes(d);
  return smem <= prop->sharedMemPerBlockOptin;
}

// The tensor-core backward sums dQ with atomics, in an order that varies
// from run to run; under torch.use_deterministic_algorithms(True) the
// backward takes the simple kernels, which write each gradient row once.
bool use_tensor_cores_in_backward(const at::Tensor& query, const at::Tensor& value) {
  return !at::globalContext().deterministicAlgorithms() &&
         use_tensor_cores(query, value, /*backward=*/true);
}

ops::RowLayout row_layout(bool tensor_cores) {
  return tensor_cores ? rows_16_byte_aligned : ops::last_dim_contiguous;
}

// One CTA per 64 rows (tensor cores) or warp of 4 rows (simple kernels).
void check_launch_size(const AttentionParams& p) {
  TORCH_CHECK(p.num_outer * std::max(p.len_q, p.len_kv) / 4 < (int64_t(1) << 31),
              "fusedmha (CUDA): batch x heads x sequence length = ", p.num_outer, " x ",
              std::max(p.len_q, p.len_kv), " is too large for one kernel launch");
}

// The dropout stream of a forward call, from the CUDA generator; under
// graph capture the kernel reads (seed, offset) on the device, so nothing
// here waits for the GPU.
DropoutParams draw_dropout(double dropout_p) {
  DropoutParams d;
  if (dropout_p <= 0) return d;
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator());
  at::PhiloxCudaState state;
  {
    const std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(4);
  }
  if (state.captured_) {
    d.seed_ptr = state.seed_.ptr;
    d.offset_ptr = state.offset_.ptr;
    d.offset = state.offset_intragraph_;
  } else {
    d.seed = state.seed_.val;
    d.offset = state.offset_.val;
  }
  d.p = dropout_p;
  d.threshold = dropout_threshold(dropout_p);
  return d;
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "fusedmha: launching the CUDA ", what,
              " kernel failed: ", cudaGetErrorString(err));
}

// Shared memory the simple kernels need, checked before they are chosen.
void check_simple_smem(const at::Tensor& q, size_t need, const char* what) {
  const size_t have = at::cuda::getDeviceProperties(q.device().index())->sharedMemPerBlockOptin;
  TORCH_CHECK(need <= have, "fusedmha (CUDA ", what, "): head dims this large (query/key ",
              q.size(-1), ", times the heads averaged for average_attn_weights) need ", need,
              " bytes of shared memory per block for the row accumulators, this GPU has ", have);
}

// The CUDA kernels read none of the params' CPU-only fields: a params
// struct that sets one was filled for the wrong backend.
template <typename Params>
void check_for_cuda(const Params& params, const char* what) {
  TORCH_INTERNAL_ASSERT(!uses_cpu_only_fields(params), "fusedmha (CUDA ", what,
                        "): params set fields only the CPU kernels read");
}

void launch_forward(const at::Tensor& query, const AttentionParams& p, bool tensor_cores) {
  check_for_cuda(p, "forward");
  TORCH_INTERNAL_ASSERT(!tensor_cores || p.kv_storage == KVStorage::Dense,
                        "fusedmha (CUDA forward): quantized K/V take the simple kernels");
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (tensor_cores) {
    check_launch(flash_forward(p, stream), "forward (tensor cores)");
  } else {
    check_simple_smem(query, simple_forward_smem(p), "forward");
    check_launch(simple_forward(p, stream), "forward");
  }
}

void launch_backward(const at::Tensor& query, const BackwardParams& bp, bool tensor_cores) {
  check_for_cuda(bp, "backward");
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (tensor_cores) {
    check_launch(flash_backward(bp, stream), "backward (tensor cores)");
  } else {
    check_simple_smem(query, simple_backward_smem(bp.fwd), "backward");
    check_launch(simple_backward(bp, stream), "backward");
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_cuda(const ops::ForwardArgs& a) {
  ops::check_forward_inputs(ops::kForwardOp, a);
  const c10::cuda::CUDAGuard guard(a.query.device());
  auto [out, lse, rng_state] =
      ops::allocate_attention_outputs(a.query, a.key, a.value, a.enable_gqa);
  const bool tensor_cores = use_tensor_cores(a.query, a.value, /*backward=*/false);
  ops::AttentionCall call(ops::kForwardOp, a, row_layout(tensor_cores));
  AttentionParams p = call.forward(out, lse);
  check_launch_size(p);
  if (a.dropout_state.has_value()) {  // a given stream (read on the device), returned as is
    rng_state = ops::returned_rng_state(rng_state, a.dropout_state);
    if (p.num_outer * p.len_q == 0) return {out, lse, rng_state};
    p.dropout = call.replay_dropout(rng_state, a.dropout_p);
  } else {
    if (p.num_outer * p.len_q == 0) return {out, lse, rng_state.zero_()};  // (no kernel writes it)
    p.dropout = draw_dropout(a.dropout_p);
    p.dropout.state_out = rng_state.mutable_data_ptr<int64_t>();
  }
  launch_forward(a.query, p, tensor_cores);
  return {out, lse, rng_state};
}

// The backward's launch for call's params bp: D computed with ATen ops, dQ
// one slice (the tensor-core backward sums into it with atomics, the simple
// one writes each row once), dK and dV zeroed where no kernel runs.
ops::DenseGradients run_backward(ops::AttentionCall& call, BackwardParams bp,
                                 const at::Tensor& grad_out, const at::Tensor& out,
                                 const std::optional<at::Tensor>& grad_logsumexp,
                                 const at::Tensor& query, bool tensor_cores) {
  check_launch_size(bp.fwd);
  call.compute_delta(bp, grad_out, out, grad_logsumexp);
  const ops::DenseGradients grads = call.allocate_gradients(bp);
  if (bp.fwd.num_outer * bp.fwd.len_kv > 0 && bp.fwd.len_q > 0) {
    launch_backward(query, bp, tensor_cores);
  } else {
    grads.k.zero_();
    grads.v.zero_();
  }
  return grads;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const ops::BackwardArgs& a) {
  ops::check_backward_inputs(ops::kBackwardOp, a);
  const c10::cuda::CUDAGuard guard(a.query.device());
  const bool tensor_cores = use_tensor_cores_in_backward(a.query, a.value);
  ops::AttentionCall call(ops::kBackwardOp, a, row_layout(tensor_cores));
  // (grad_logsumexp goes into D, which the CUDA host computes.)
  if (a.grad_attn_mask) {
    // (Both backward kernels sum it with atomics.)
    at::globalContext().alertNotDeterministic(
        "fusedmha.attention_backward with grad_attn_mask=True on CUDA");
  }
  const BackwardParams bp =
      call.backward(a.grad_out, a.out, a.logsumexp, a.rng_state, a.dropout_p, std::nullopt,
                    a.grad_attn_mask ? a.attn_mask : std::nullopt);
  return run_backward(call, bp, a.grad_out, a.out, a.grad_logsumexp, a.query, tensor_cores)
      .reduced_to(a.query, a.key, a.value, a.attn_mask);
}

// A packed batch's lengths are not read on the host (that would wait for
// the GPU): the kernels trust max_seqlen_q/k to bound them, as
// FlashAttention's do.
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_forward_cuda(
    const ops::VarlenForwardArgs& a) {
  ops::check_varlen_forward_inputs(ops::kVarlenForwardOp, a);
  const c10::cuda::CUDAGuard guard(a.query.device());
  auto [out, lse, rng_state] = ops::allocate_varlen_outputs(a.query, a.value);
  // (Paged caches take the simple kernels, which find every key row through
  // the block table; the tensor-core tiles load rows from one base. So do
  // quantized K/V, whose codes the simple kernels read.)
  const bool tensor_cores = use_tensor_cores(a.query, a.value, /*backward=*/false) &&
                            !a.block_table.has_value() && !a.k_scale.has_value();
  ops::AttentionCall call(ops::kVarlenForwardOp, a, ops::packed_batch(a), row_layout(tensor_cores));
  AttentionParams p = call.forward(out, lse);
  check_launch_size(p);
  if (p.num_outer * p.len_q == 0) return {out, lse, rng_state};
  p.dropout = draw_dropout(a.dropout_p);
  p.dropout.state_out = rng_state.mutable_data_ptr<int64_t>();
  launch_forward(a.query, p, tensor_cores);
  return {out, lse, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_cuda(
    const ops::VarlenBackwardArgs& a) {
  ops::check_varlen_backward_inputs(ops::kVarlenBackwardOp, a);
  const c10::cuda::CUDAGuard guard(a.query.device());
  const bool tensor_cores = use_tensor_cores_in_backward(a.query, a.value);
  ops::AttentionCall call(ops::kVarlenBackwardOp, a, ops::packed_batch(a),
                          row_layout(tensor_cores));
  const BackwardParams bp = call.backward(a.grad_out, a.out, a.logsumexp, a.rng_state, a.dropout_p);
  return run_backward(call, bp, a.grad_out, a.out, a.grad_logsumexp, a.query, tensor_cores)
      .reduced_to(a.query, a.key, a.value);
}

// The weights pass always takes the simple kernel: it writes the whole
// (L, S) matrix, so it is memory bound either way.
at::Tensor attention_weights_cuda(const ops::WeightsArgs& a) {
  const c10::cuda::CUDAGuard guard(a.query.device());
  auto [weights, positive] = ops::start_weights(a);
  if (!positive) return weights;  // (and no kernel would write them: an empty grid)
  ops::AttentionCall call(ops::kWeightsOp, a);
  const WeightsParams wp =
      call.weights(a.logsumexp, a.rng_state, a.dropout_p, a.average_heads, weights);
  check_launch_size(wp.fwd);
  check_for_cuda(wp.fwd, "attention weights");
  check_simple_smem(a.query, simple_weights_smem(wp), "attention weights");
  check_launch(simple_weights(wp, at::cuda::getCurrentCUDAStream()), "attention weights");
  return weights;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CUDA, m) {
  FUSEDMHA_OP_IMPL(m, attention_forward_cuda);
  FUSEDMHA_OP_IMPL(m, attention_backward_cuda);
  FUSEDMHA_OP_IMPL(m, attention_weights_cuda);
  FUSEDMHA_OP_IMPL(m, varlen_attention_forward_cuda);
  FUSEDMHA_OP_IMPL(m, varlen_attention_backward_cuda);
}

}  // namespace fusedmha::cuda
