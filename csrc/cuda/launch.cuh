#pragma once

// One launch path for every kernel: opt in to more than 48 KiB of dynamic
// shared memory when asked for, skip empty grids, report the launch error.

#include <cuda_runtime.h>

#include <cstdint>

namespace fusedmha::cuda {

template <typename Params>
cudaError_t launch_blocks(void (*kernel)(Params), int64_t blocks, int threads, size_t smem,
                          cudaStream_t stream, const Params& params) {
  if (blocks == 0) return cudaSuccess;
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace fusedmha::cuda
