// Picks the tensor-core kernel instance (dtype, head-dim group) for a call.
// The instances are compiled one per file, so that they build in parallel:
// cmake/FusedMHASources.cmake writes them into the build tree
// (cuda_instances/) from csrc/cuda/flash_instance.cu.in, and this file only
// references them.

#include "cuda/flash_config.h"
#include "cuda/launchers.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fusedmha::cuda {

// Defined (and explicitly instantiated) in the generated instance files.
template <typename T, int D>
cudaError_t run_flash_forward(const AttentionParams& p, cudaStream_t stream);
template <typename T, int D>
cudaError_t run_flash_backward(const BackwardParams& bp, cudaStream_t stream);

namespace {

int head_dim_group(const AttentionParams& p) { return flash_head_dim_group(p.dim_qk, p.dim_v); }

template <typename T>
cudaError_t forward_t(const AttentionParams& p, cudaStream_t stream) {
  switch (head_dim_group(p)) {
    case 64: return run_flash_forward<T, 64>(p, stream);
    case 128: return run_flash_forward<T, 128>(p, stream);
    default: return run_flash_forward<T, 256>(p, stream);
  }
}

template <typename T>
cudaError_t backward_t(const BackwardParams& bp, cudaStream_t stream) {
  switch (head_dim_group(bp.fwd)) {
    case 64: return run_flash_backward<T, 64>(bp, stream);
    case 128: return run_flash_backward<T, 128>(bp, stream);
    default: return run_flash_backward<T, 256>(bp, stream);
  }
}

}  // namespace

cudaError_t flash_forward(const AttentionParams& p, cudaStream_t stream) {
  return p.dtype == DType::BFloat16 ? forward_t<__nv_bfloat16>(p, stream)
                                    : forward_t<__half>(p, stream);
}

cudaError_t flash_backward(const BackwardParams& bp, cudaStream_t stream) {
  return bp.fwd.dtype == DType::BFloat16 ? backward_t<__nv_bfloat16>(bp, stream)
                                         : backward_t<__half>(bp, stream);
}

}  // namespace fusedmha::cuda
