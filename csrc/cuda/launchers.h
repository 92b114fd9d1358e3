#pragma once

// The CUDA kernels' launchers, as the host wrappers (attention_cuda.cpp)
// call them. Each returns the launch's error (cudaSuccess when it started).

#include "common/attention_params.h"
#include "cuda/flash_config.h"

#include <cuda_runtime_api.h>

#include <cstddef>

namespace fusedmha::cuda {

// The tensor-core kernels (flash_forward.cuh, flash_backward.cuh): float16
// and bfloat16 on sm_80 and newer, head dims up to kFlashMaxHeadDim, rows
// of q/k/v (and out/grad_out) 16-byte aligned with contiguous columns.
cudaError_t flash_forward(const AttentionParams& p, cudaStream_t stream);
cudaError_t flash_backward(const BackwardParams& bp, cudaStream_t stream);

// The simple kernels (simple_kernels.cu): every dtype, head dim and layout.
cudaError_t simple_forward(const AttentionParams& p, cudaStream_t stream);
// Two passes (dQ per query row, then dK/dV per key row), no atomics, so
// dQ, dK and dV are deterministic (a mask's gradient is summed with
// atomics); writes every row of grad_q/k/v.
cudaError_t simple_backward(const BackwardParams& bp, cudaStream_t stream);
cudaError_t simple_weights(const WeightsParams& wp, cudaStream_t stream);
// Shared memory per block the simple kernels need for a call (the host
// checks it against the GPU's limit first, for a clear error).
size_t simple_forward_smem(const AttentionParams& p);
size_t simple_backward_smem(const AttentionParams& p);
size_t simple_weights_smem(const WeightsParams& wp);

}  // namespace fusedmha::cuda
