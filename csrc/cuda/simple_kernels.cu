// Launchers of the simple kernels (simple_kernels.cuh): one warp per row,
// 4 warps per block, shared memory sized from the head dims.

#include "cuda/launchers.h"
#include "cuda/launch.cuh"
#include "cuda/simple_kernels.cuh"

#include <cuda_runtime.h>

namespace fusedmha::cuda {
namespace {

using simple::AccOf;
using simple::kWarpsPerBlock;

// Shared memory of a block: per warp, the row's accumulators (acc_t).
size_t warp_accumulators(DType dtype, int64_t per_warp) {
  const size_t acc = dtype == DType::Float64 ? sizeof(double) : sizeof(float);
  return size_t(per_warp) * acc * kWarpsPerBlock;
}
// Per warp: q and o (forward); q, dq, dO (dQ pass); k, dk, v, dv (dK/dV pass);
// q of each averaged head (weights).
size_t forward_smem(const AttentionParams& p) { return warp_accumulators(p.dtype, p.dim_qk + p.dim_v); }
size_t dq_smem(const AttentionParams& p) { return warp_accumulators(p.dtype, 2 * p.dim_qk + p.dim_v); }
size_t dkdv_smem(const AttentionParams& p) {
  return warp_accumulators(p.dtype, 2 * p.dim_qk + 2 * p.dim_v);
}

template <typename Params>
cudaError_t launch_rows(void (*kernel)(Params), const Params& params, int64_t rows, size_t smem,
                        cudaStream_t stream) {
  return launch_blocks(kernel, (rows + kWarpsPerBlock - 1) / kWarpsPerBlock, kWarpsPerBlock * 32,
                       smem, stream, params);
}

// Calls f with a value of the element type of dtype.
template <typename F>
cudaError_t with_element_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float64: return f(double{});
    case DType::Float16: return f(__half{});
    case DType::BFloat16: return f(__nv_bfloat16{});
    default: return f(float{});
  }
}

}  // namespace

size_t simple_forward_smem(const AttentionParams& p) { return forward_smem(p); }
size_t simple_backward_smem(const AttentionParams& p) { return dkdv_smem(p); }  // the larger pass
size_t simple_weights_smem(const WeightsParams& wp) {
  return warp_accumulators(wp.fwd.dtype, wp.heads_per_item * wp.fwd.dim_qk);
}

cudaError_t simple_forward(const AttentionParams& p, cudaStream_t stream) {
  return with_element_type(p.dtype, [&](auto t) {
    using T = decltype(t);
    return launch_rows(&simple::forward_kernel<T, typename AccOf<T>::type>, p,
                       p.num_outer * p.len_q, forward_smem(p), stream);
  });
}

cudaError_t simple_backward(const BackwardParams& bp, cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  return with_element_type(p.dtype, [&](auto t) {
    using T = decltype(t);
    using A = typename AccOf<T>::type;
    const cudaError_t err = launch_rows(&simple::backward_dq_kernel<T, A>, bp,
                                        p.num_outer * p.len_q, dq_smem(p), stream);
    if (err != cudaSuccess) return err;
    return launch_rows(&simple::backward_dkdv_kernel<T, A>, bp, p.num_outer * p.len_kv,
                       dkdv_smem(p), stream);
  });
}

cudaError_t simple_weights(const WeightsParams& wp, cudaStream_t stream) {
  const AttentionParams& p = wp.fwd;
  return with_element_type(p.dtype, [&](auto t) {
    using T = decltype(t);
    return launch_rows(&simple::weights_kernel<T, typename AccOf<T>::type>, wp,
                       p.num_outer / wp.heads_per_item * p.len_q, simple_weights_smem(wp), stream);
  });
}

}  // namespace fusedmha::cuda
