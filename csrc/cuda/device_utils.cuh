#pragma once

// Small device building blocks shared by the CUDA kernels: element types,
// the per-element mask/causal/dropout rule, and the tensor-core primitives
// (cp.async, ldmatrix, mma.sync m16n8k16) on swizzled shared-memory tiles.
//
// With FUSEDMHA_CUDA_EMULATION the same kernel code compiles as host C++
// and runs on the CPU (cuda/emulation.h: one fiber per GPU thread, the warp
// primitives computed from their PTX definitions), which is how the tests
// run these kernels on machines without a GPU.

#if defined(FUSEDMHA_CUDA_EMULATION)
#include "cuda/emulation.h"
#endif

#include "common/philox.h"
#include "common/attention_params.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace fusedmha::cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// ---- element types --------------------------------------------------------

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}
template <>
__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T, typename A>
__device__ __forceinline__ T from_acc(A x) {
  return static_cast<T>(x);
}
template <>
__device__ __forceinline__ __half from_acc(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc(float x) {
  return __float2bfloat16_rn(x);
}

// Two floats as one 32-bit register of two 16-bit elements (low = a).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// ---- the attention rule, shared by every kernel ---------------------------

// What attn_mask says of element (o, i, j): the term added to the score,
// -inf where a bool mask forbids it (added, as the CPU kernels do, so a NaN
// score stays NaN), in A (float; double for the float64 kernels).
// `mask_base` is the mask's element offset for o. Causality is not a mask:
// the kernels set causally hidden scores to -inf themselves (assigned, so
// whatever a hidden key holds cannot reach the row).
template <typename A = float>
__device__ __forceinline__ A mask_term(const AttentionParams& p, int64_t mask_base, int64_t i,
                                       int64_t j) {
  const int64_t at = mask_base + i * p.mask.row_stride + j * p.mask.col_stride;
  switch (p.mask_kind) {
    case MaskKind::Bool:
      return static_cast<const bool*>(p.mask.data)[at] ? A(0) : A(-INFINITY);
    case MaskKind::Additive:
      switch (p.dtype) {
        case DType::Float16: return __half2float(static_cast<const __half*>(p.mask.data)[at]);
        case DType::BFloat16:
          return __bfloat162float(static_cast<const __nv_bfloat16*>(p.mask.data)[at]);
        case DType::Float64: return static_cast<A>(static_cast<const double*>(p.mask.data)[at]);
        default: return static_cast<const float*>(p.mask.data)[at];
      }
    case MaskKind::AdditiveFloat32: return static_cast<const float*>(p.mask.data)[at];
    default: return A(0);
  }
}

__device__ __forceinline__ float tanh_acc(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_acc(double x) { return tanh(x); }

// Score (i, j) after the pipeline's softcap and ALiBi, from s = scale·q·k
// (natural-log domain); with softcap, *dcap gets d(capped)/ds = 1 − tanh²
// when dcap is given. The band and the mask are the caller's.
template <typename A>
__device__ __forceinline__ A transformed_score(const AttentionParams& p, A s, A slope, int64_t i,
                                               int64_t j, A* dcap = nullptr) {
  if (p.softcap > 0.0) {
    const A c = static_cast<A>(p.softcap);
    const A t = tanh_acc(s / c);
    s = c * t;
    if (dcap != nullptr) *dcap = A(1) - t * t;
  }
  if (slope != A(0)) {
    const int64_t d = i + p.diagonal_offset - j;
    s -= slope * static_cast<A>(d < 0 ? -d : d);
  }
  return s;
}

// The dropout stream of this call: the forward draws it, the backward and
// the weights pass read it back from rng_state (a device tensor).
__device__ __forceinline__ DropoutStream dropout_stream(const AttentionParams& p) {
  const int64_t row = p.dropout.row_offset, col4 = p.dropout.col_offset / 4;
  if (p.dropout.state_in != nullptr) {
    return {static_cast<uint64_t>(p.dropout.state_in[0]),
            static_cast<uint64_t>(p.dropout.state_in[1]), row, col4};
  }
  if (p.dropout.seed_ptr != nullptr) {
    return {static_cast<uint64_t>(*p.dropout.seed_ptr),
            static_cast<uint64_t>(*p.dropout.offset_ptr) + p.dropout.offset, row, col4};
  }
  return {p.dropout.seed, p.dropout.offset, row, col4};
}

// Word `index` (0..3, known only at run time) of a Philox block, by
// selects: a run-time index into the array would put it in local memory.
__device__ __forceinline__ uint32_t philox_word(const Philox4x32& block, int index) {
  return index == 0 ? block.v[0] : index == 1 ? block.v[1] : index == 2 ? block.v[2] : block.v[3];
}

// Element (o, i, j) survives dropout.
__device__ __forceinline__ bool dropout_keeps(const DropoutStream& s, uint32_t threshold, int64_t o,
                                              int64_t i, int64_t j) {
  return s.block(o, i, j >> 2).v[j & 3] >= threshold;
}

// ---- tensor-core primitives (sm_80+) ---------------------------------------

#if !defined(FUSEDMHA_CUDA_EMULATION)
// The block's dynamic shared memory (the launch's third argument).
__device__ __forceinline__ unsigned char* dynamic_smem() {
  extern __shared__ __align__(128) unsigned char fusedmha_dynamic_smem[];
  return fusedmha_dynamic_smem;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; bytes past src_bytes (0..16)
// are zero-filled, so padding rows/columns read as 0.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// d += a·b for one m16n8k16 tile, fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#else
using emulation::cp_async_16;
using emulation::cp_async_commit;
using emulation::cp_async_wait;
using emulation::dynamic_smem;
using emulation::ldmatrix_x4;
using emulation::ldmatrix_x4_trans;
using emulation::mma_16816;
#endif

// A shared-memory tile of kRows x kCols 16-bit elements, row-major in
// 16-byte chunks, chunk c of row r stored at chunk c ^ (r % 8): the 8 rows
// an ldmatrix reads (8 consecutive rows, same logical chunk) then fall in 8
// different bank groups. kCols is a multiple of 64.
template <typename T, int kRows, int kCols>
struct SwizzledTile {
  static_assert(kCols % 64 == 0, "swizzled tiles are at least 64 elements wide");
  static constexpr int kChunks = kCols / 8;
  static constexpr int kElements = kRows * kCols;

  T* data;

  __device__ __forceinline__ T* at(int row, int col) const {
    const int chunk = (col >> 3) ^ (row & 7);
    return data + row * kCols + chunk * 8 + (col & 7);
  }

  // Rows [0, kRows) and columns [0, kCols) from global memory (row r at
  // src + r * row_stride, contiguous columns), zero beyond rows/cols.
  // Everything must be 16-byte aligned (the host pads otherwise).
  template <int kThreads>
  __device__ __forceinline__ void load_async(const T* src, int64_t row_stride, int rows, int cols,
                                             int tid) const {
    constexpr int kTotal = kRows * kChunks;
    static_assert(kTotal % kThreads == 0, "tile chunks must divide among the threads");
#pragma unroll
    for (int k = 0; k < kTotal / kThreads; ++k) {
      const int idx = tid + k * kThreads;
      const int r = idx / kChunks, c = (idx % kChunks) * 8;
      const bool valid = r < rows && c < cols;
      const int bytes = valid ? min(16, (cols - c) * 2) : 0;
      const T* from = valid ? src + r * row_stride + c : src;
      cp_async_16(at(r, c), from, bytes);
    }
  }

  // A fragment (m16 x k16, row-major) of rows m0.., columns k0.. .
  __device__ __forceinline__ void load_a(uint32_t (&a)[4], int m0, int k0, int lane) const {
    const int mi = lane >> 3, r = lane & 7;
    ldmatrix_x4(a, at(m0 + r + 8 * (mi & 1), k0 + 8 * (mi >> 1)));
  }
  // A fragment of the transpose: the tile holds A as [k][m].
  __device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], int m0, int k0, int lane) const {
    const int mi = lane >> 3, r = lane & 7;
    ldmatrix_x4_trans(a, at(k0 + r + 8 * (mi >> 1), m0 + 8 * (mi & 1)));
  }
  // B fragments (k16 x n8) of two n-tiles n0.. and n0+8.. where the tile
  // holds B as [n][k] (Kᵀ as a B operand): b[0..1] first, b[2..3] second.
  __device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], int n0, int k0, int lane) const {
    const int mi = lane >> 3, r = lane & 7;
    ldmatrix_x4(b, at(n0 + r + 8 * (mi >> 1), k0 + 8 * (mi & 1)));
  }
  // The same where the tile holds B as [k][n] (V as a B operand).
  __device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], int n0, int k0, int lane) const {
    const int mi = lane >> 3, r = lane & 7;
    ldmatrix_x4_trans(b, at(k0 + r + 8 * (mi & 1), n0 + 8 * (mi >> 1)));
  }
};

// Warp-wide accumulation into a 16 x (16·kPairs) fp32 tile held as
// kPairs·2 m16n8 accumulators: acc += A(rows m0.., k) · B(k, cols n0..),
// k over [0, kSteps·16). A and B come from shared tiles in the given
// layouts (kATrans: A stored [k][m]; kBKn: B stored [k][n], else [n][k]).
template <bool kATrans, bool kBKn, int kSteps, int kPairs, typename T, typename TileA,
          typename TileB>
__device__ __forceinline__ void warp_mma(float (&acc)[2 * kPairs][4], const TileA& a_tile, int m0,
                                         int a_k0, const TileB& b_tile, int n0, int b_k0,
                                         int lane) {
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    uint32_t a[4];
    if constexpr (kATrans) {
      a_tile.load_a_trans(a, m0, a_k0 + ks * 16, lane);
    } else {
      a_tile.load_a(a, m0, a_k0 + ks * 16, lane);
    }
#pragma unroll
    for (int np = 0; np < kPairs; ++np) {
      uint32_t b[4];
      if constexpr (kBKn) {
        b_tile.load_b_kn(b, n0 + np * 16, b_k0 + ks * 16, lane);
      } else {
        b_tile.load_b_nk(b, n0 + np * 16, b_k0 + ks * 16, lane);
      }
      mma_16816<T>(acc[2 * np], a, b[0], b[1]);
      mma_16816<T>(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

}  // namespace fusedmha::cuda
