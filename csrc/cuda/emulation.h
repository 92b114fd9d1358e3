#pragma once

// Private test hook, not part of the library's build: included by
// device_utils.cuh only under FUSEDMHA_CUDA_EMULATION, which only the tests
// define. CPU emulation of the CUDA features the kernels use, so that the kernels'
// own code (compiled as host C++ with FUSEDMHA_CUDA_EMULATION) runs and is
// tested on machines without a GPU. Each GPU thread of a block is a fiber;
// the fibers of a block run on one CPU thread, switching at barriers, so
// __syncthreads, __syncwarp and the warp-collective primitives (shuffles,
// ldmatrix, mma.sync) behave as on the GPU: every lane delivers its operand,
// then every lane takes its share of the result, computed from the PTX ISA's
// definition of the fragment layouts. cp.async copies synchronously.
//
// Implemented in tests/cpp/cuda_emulation.cpp; tests/cpp/test_cuda_emulated.cpp
// runs the kernels with it.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

namespace fusedmha::cuda::emulation {

struct Index3 {
  unsigned x = 0, y = 0, z = 0;
};

// The running fiber's thread index and its block's index.
Index3 thread_index();
Index3 block_index();

// Runs body once per thread of `blocks` blocks of `threads` threads (a
// multiple of 32), each block with `smem_bytes` of shared memory, blocks in
// order. Kernel code reaches the block's shared memory via dynamic_smem().
void launch(unsigned blocks, unsigned threads, size_t smem_bytes, const std::function<void()>& body);

unsigned char* dynamic_smem();
void syncthreads();
void syncwarp();
uint32_t shfl_xor_u32(uint32_t value, int lane_mask);
uint64_t shfl_xor_u64(uint64_t value, int lane_mask);
uint64_t shfl_idx_u64(uint64_t value, int src_lane);

void cp_async_16(void* dst, const void* src, int src_bytes);
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}

void ldmatrix_x4(uint32_t (&r)[4], const void* p);
void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p);

// d += a·b, m16n8k16, fp32 accumulators, a/b of 16-bit type T.
void mma_16816_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
void mma_16816_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    mma_16816_f16(d, a, b0, b1);
  } else {
    mma_16816_bf16(d, a, b0, b1);
  }
}

// Every lane gets src_lane's value.
template <typename T>
inline T shfl_idx(T value, int src_lane) {
  static_assert(sizeof(T) <= 8, "up to 64-bit shuffles");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = shfl_idx_u64(bits, src_lane);
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

template <typename T>
inline T shfl_xor(T value, int lane_mask) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "32- or 64-bit shuffles only");
  if constexpr (sizeof(T) == 4) {
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    bits = shfl_xor_u32(bits, lane_mask);
    std::memcpy(&value, &bits, 4);
  } else {
    uint64_t bits;
    std::memcpy(&bits, &value, 8);
    bits = shfl_xor_u64(bits, lane_mask);
    std::memcpy(&value, &bits, 8);
  }
  return value;
}

}  // namespace fusedmha::cuda::emulation

// The CUDA built-ins the kernels use, in terms of the emulation.
#define threadIdx (::fusedmha::cuda::emulation::thread_index())
#define blockIdx (::fusedmha::cuda::emulation::block_index())

inline void __syncthreads() { ::fusedmha::cuda::emulation::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::fusedmha::cuda::emulation::syncwarp(); }
template <typename T>
inline T __shfl_xor_sync(unsigned, T value, int lane_mask) {
  return ::fusedmha::cuda::emulation::shfl_xor(value, lane_mask);
}
template <typename T>
inline T __shfl_sync(unsigned, T value, int src_lane) {
  return ::fusedmha::cuda::emulation::shfl_idx(value, src_lane);
}
// Fibers of a block never run at the same time: a plain add is atomic.
template <typename T>
inline T atomicAdd(T* address, T value) {
  const T old = *address;
  *address = old + value;
  return old;
}
using std::isnan;
using std::min;
