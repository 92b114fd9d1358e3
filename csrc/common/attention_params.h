#pragma once

// One description of an attention call, read by the CPU and the CUDA
// kernels alike: plain pointers, sizes and strides, no ATen types, so the
// kernels compile fast, can be read on their own, and (on CUDA) take it by
// value as their argument with nothing copied to the device first.
//
// There is one struct per pass (forward, backward, weights); the host fills
// them in one place (ops/attention_params_filler.h). A new parameter of the
// call is one field here, one line in the filler, and the kernels that
// read it.

#include "common/attention_types.h"
#include "common/philox.h"

#include <cstdint>

namespace fusedmha {

// The output's outer dims: its batch dims and heads, innermost (heads)
// last. Outer index o is the flattened position in these dims.
constexpr int kMaxOuterDims = 8;  // (Matrix::divisor's initialiser lists 8 ones)

struct OuterShape {
  int dims = 0;
  int64_t size[kMaxOuterDims] = {};
};

// A tensor read as one (rows, cols) matrix per outer index: element
// (o, r, c) is data[outer_offset(shape, m, o) + r * row_stride + c *
// col_stride]. A dim the tensor broadcasts has stride 0; a dim with fewer
// entries than the output's (grouped-query heads) maps index i to i /
// divisor. Transposed layouts (the (B, L, H, E) projection viewed as
// (B, H, L, E)) are just other strides, so every input is read in place.
struct Matrix {
  void* data = nullptr;  // const for inputs; the kernels write only outputs
  int64_t outer_stride[kMaxOuterDims] = {};
  int64_t divisor[kMaxOuterDims] = {1, 1, 1, 1, 1, 1, 1, 1};
  int64_t row_stride = 0;
  int64_t col_stride = 1;  // 1 for q/k/v/out; any value (0 too) for a mask
};

FUSEDMHA_HOST_DEVICE int64_t outer_offset(const OuterShape& shape, const Matrix& m, int64_t o) {
  int64_t offset = 0;
  for (int d = shape.dims - 1; d >= 0; --d) {
    const int64_t i = o % shape.size[d];
    o /= shape.size[d];
    offset += (i / m.divisor[d]) * m.outer_stride[d];
  }
  return offset;
}

// Where matrix o of m starts, as T.
template <typename T>
FUSEDMHA_HOST_DEVICE T* matrix_start(const OuterShape& shape, const Matrix& m, int64_t o) {
  return static_cast<T*>(m.data) + outer_offset(shape, m, o);
}

// Dropout on the normalised probabilities, with the stream of
// common/philox.h: element (o, i, j) is kept iff its number is >=
// threshold, and kept ones are scaled by 1/(1 - p). Off when p == 0.
struct DropoutParams {
  double p = 0.0;
  uint32_t threshold = 0;
  // The stream's (seed, offset), by value (the CPU, and CUDA outside graph
  // capture)...
  uint64_t seed = 0;
  uint64_t offset = 0;
  // ...or, when these are set, read where the kernel runs: under CUDA graph
  // capture from the generator's device memory (*offset_ptr + offset)...
  const int64_t* seed_ptr = nullptr;
  const int64_t* offset_ptr = nullptr;
  // ...or, in the backward and weights passes on CUDA, from the rng_state
  // tensor the forward returned (a device tensor: no host sync).
  const int64_t* state_in = nullptr;
  // The CUDA forward writes (seed, offset) here, (0, 0) without dropout.
  int64_t* state_out = nullptr;

  FUSEDMHA_HOST_DEVICE bool on() const { return p > 0.0; }
  // The stream when it is given by value (the CPU kernels).
  FUSEDMHA_HOST_DEVICE DropoutStream stream() const { return {seed, offset}; }
};

// The forward pass; the backward and weights passes read it too (with
// out and lse then being what the forward wrote).
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

  DropoutParams dropout;

  // The output (query's dtype) and the log-sum-exp of each row's scores,
  // dense (num_outer, len_q) in acc_t (float; double for Float64).
  Matrix out;
  void* lse = nullptr;
};

// The backward pass: gradients in acc_t, dense, one matrix per outer
// index (the host sums them over broadcast and grouped heads):
// grad_k (num_outer, len_kv, dim_qk), grad_v (num_outer, len_kv, dim_v).
// grad_q is (grad_q_splits, num_outer, len_q, dim_qk), zeroed: the keys
// are split into grad_q_splits interleaved sets of key blocks, each set
// summing its share of dQ into its own slice (no two writers ever share
// memory, so no locks and no atomics on the CPU), and the host adds the
// slices. The tensor-core CUDA kernel uses one slice and atomics.
struct BackwardParams {
  AttentionParams fwd;  // fwd.out and fwd.lse: what the forward returned
  Matrix grad_out;
  // rowsum(grad_out ∘ out) per row, (num_outer, len_q) acc_t; the CUDA
  // host computes it; null on the CPU, whose kernels compute it per block.
  const void* delta = nullptr;
  void* grad_q = nullptr;
  int64_t grad_q_splits = 1;
  void* grad_k = nullptr;
  void* grad_v = nullptr;
};

// The attention weights pass: the probabilities of the forward call
// (dropout applied), recomputed from fwd.lse and written dense,
// (num_outer / heads_per_item, len_q, len_kv) in dtype; heads_per_item > 1
// averages that many adjacent outer indices (the heads of a batch index).
struct WeightsParams {
  AttentionParams fwd;
  int64_t heads_per_item = 1;
  void* weights = nullptr;
};

}  // namespace fusedmha
