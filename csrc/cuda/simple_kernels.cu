// Launchers of the simple kernels (simple_kernels.cuh): one warp per row,
// 4 warps per block, shared memory sized from the head dims.

#include "cuda/simple_kernels.cuh"
#include "cuda/kernels.h"

#include <cuda_runtime.h>

namespace fusedmha::cuda {
namespace {

using simple::AccOf;
using simple::kWarpsPerBlock;

template <typename T>
size_t warp_smem(size_t per_warp_elements) {
  return per_warp_elements * sizeof(typename AccOf<T>::type) * kWarpsPerBlock;
}

template <typename Kernel, typename Params>
cudaError_t launch_rows(Kernel kernel, const Params& params, int64_t rows, size_t smem,
                        cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, smem, stream>>>(params);
  return cudaGetLastError();
}

template <typename T>
cudaError_t forward_t(const AttentionParams& p, cudaStream_t stream) {
  return launch_rows(&simple::forward_kernel<T, typename AccOf<T>::type>, p, p.num_outer * p.len_q,
                     warp_smem<T>(p.dim_qk + p.dim_v), stream);
}
template <typename T>
cudaError_t backward_t(const BackwardParams& bp, cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  using A = typename AccOf<T>::type;
  const cudaError_t err = launch_rows(&simple::backward_dq_kernel<T, A>, bp, p.num_outer * p.len_q,
                                      warp_smem<T>(2 * p.dim_qk + p.dim_v), stream);
  if (err != cudaSuccess) return err;
  return launch_rows(&simple::backward_dkdv_kernel<T, A>, bp, p.num_outer * p.len_kv,
                     warp_smem<T>(2 * p.dim_qk + 2 * p.dim_v), stream);
}
template <typename T>
cudaError_t weights_t(const WeightsParams& wp, cudaStream_t stream) {
  const AttentionParams& p = wp.fwd;
  return launch_rows(&simple::weights_kernel<T, typename AccOf<T>::type>, wp,
                     p.num_outer / wp.heads_per_item * p.len_q,
                     warp_smem<T>(wp.heads_per_item * p.dim_qk), stream);
}

}  // namespace

size_t simple_smem_bytes(DType dtype, size_t per_warp_elements) {
  const size_t acc = dtype == DType::Float64 ? sizeof(double) : sizeof(float);
  return per_warp_elements * acc * kWarpsPerBlock;
}

cudaError_t simple_forward(const AttentionParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::Float64: return forward_t<double>(p, stream);
    case DType::Float16: return forward_t<__half>(p, stream);
    case DType::BFloat16: return forward_t<__nv_bfloat16>(p, stream);
    default: return forward_t<float>(p, stream);
  }
}

cudaError_t simple_backward(const BackwardParams& bp, cudaStream_t stream) {
  switch (bp.fwd.dtype) {
    case DType::Float64: return backward_t<double>(bp, stream);
    case DType::Float16: return backward_t<__half>(bp, stream);
    case DType::BFloat16: return backward_t<__nv_bfloat16>(bp, stream);
    default: return backward_t<float>(bp, stream);
  }
}

cudaError_t simple_weights(const WeightsParams& wp, cudaStream_t stream) {
  switch (wp.fwd.dtype) {
    case DType::Float64: return weights_t<double>(wp, stream);
    case DType::Float16: return weights_t<__half>(wp, stream);
    case DType::BFloat16: return weights_t<__nv_bfloat16>(wp, stream);
    default: return weights_t<float>(wp, stream);
  }
}

}  // namespace fusedmha::cuda
