#pragma once

// What the CUDA host wrappers (attention_cuda.cpp) hand the kernels: plain
// pointers, sizes and strides, passed by value as the kernels' argument, so
// the kernels include no torch header and nothing is copied to the device
// before a launch (which keeps them usable under CUDA graph capture).

#include "common/attention_types.h"

#include <cstdint>

namespace fusedmha::cuda {

// Outer index o (the flattened batch dims and heads of the output) split
// into its dims, innermost (heads) last.
constexpr int kMaxOuterDims = 6;

struct OuterShape {
  int dims = 0;
  int64_t size[kMaxOuterDims] = {};
};

// A (rows, cols) matrix per outer index: element (o, r, c) of the tensor is
// data[offset(o) + r * row_stride + c * col_stride]. A dim the tensor
// broadcasts has stride 0; a dim with fewer entries than the output (GQA
// heads) maps index i to i / divisor.
struct Matrix {
  const void* data = nullptr;
  int64_t outer_stride[kMaxOuterDims] = {};
  int64_t divisor[kMaxOuterDims] = {};
  int64_t row_stride = 0;
  int64_t col_stride = 1;
};

#if defined(__CUDACC__)
#define FUSEDMHA_HD __host__ __device__ __forceinline__
#else
#define FUSEDMHA_HD inline
#endif

FUSEDMHA_HD int64_t outer_offset(const OuterShape& shape, const Matrix& m, int64_t o) {
  int64_t offset = 0;
  for (int d = shape.dims - 1; d >= 0; --d) {
    const int64_t i = o % shape.size[d];
    o /= shape.size[d];
    offset += (i / m.divisor[d]) * m.outer_stride[d];
  }
  return offset;
}

// The dropout stream's (seed, offset): given by value, or, under CUDA graph
// capture, read from the generator's device memory when the kernel runs
// (PyTorch's graph-safe Philox state, mirrored here without its headers).
struct RngSource {
  uint64_t seed = 0;
  uint64_t offset = 0;
  const int64_t* seed_ptr = nullptr;    // when captured
  const int64_t* offset_ptr = nullptr;  // when captured: + offset
};

struct AttentionParams {
  DType dtype = DType::Float32;
  OuterShape outer;
  int64_t num_outer = 0;  // product of outer.size
  int64_t len_q = 0;
  int64_t len_kv = 0;
  int64_t dim_qk = 0;
  int64_t dim_v = 0;

  Matrix q, k, v;
  MaskKind mask_kind = MaskKind::None;
  Matrix mask;

  double scale = 1.0;
  bool is_causal = false;  // top-left aligned: row i sees keys 0..i

  // Dropout on the normalised probabilities, the stream of common/philox.h.
  double dropout_p = 0.0;
  uint32_t dropout_threshold = 0;
  RngSource rng;
  int64_t* rng_state_out = nullptr;  // the forward writes (seed, offset) here, (0, 0) without dropout
  // The backward and the weights pass read (seed, offset) from here (a
  // device tensor, so no host sync) when not null.
  const int64_t* rng_state_in = nullptr;

  // Forward: the output (written in the query's dtype) and the log-sum-exp,
  // dense (num_outer, len_q) in acc_t (float; double for Float64).
  Matrix out;
  void* lse = nullptr;
};

struct BackwardParams {
  AttentionParams fwd;
  Matrix out, grad_out;
  // In acc_t (float; double for Float64), dense, one matrix per outer index:
  // the host reduces the gradients over broadcast and grouped heads.
  const void* lse = nullptr;  // (num_outer, len_q), as the forward wrote it
  const void* delta = nullptr;  // (num_outer, len_q): rowsum(grad_out ∘ out)
  void* grad_q = nullptr;     // (num_outer, len_q, dim_qk), zeroed (the tensor cores sum into it)
  void* grad_k = nullptr;     // (num_outer, len_kv, dim_qk)
  void* grad_v = nullptr;     // (num_outer, len_kv, dim_v)
};

struct WeightsParams {
  AttentionParams fwd;
  const void* lse = nullptr;  // (num_outer, len_q) acc_t
  int64_t heads_per_item = 1; // > 1: average that many adjacent outer indices
  void* weights = nullptr;    // (num_outer / heads_per_item, len_q, len_kv) dtype
};

}  // namespace fusedmha::cuda
