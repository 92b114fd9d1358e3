#pragma once

// What the host wrapper (attention_forward.cpp) hands the CPU kernels: plain
// pointers, sizes and strides, no ATen types, so the kernels compile fast
// and can be read on their own.

#include "common/attention_types.h"
#include "common/philox.h"

#include <cstddef>
#include <cstdint>

namespace fusedmha::cpu {

// The (row, col) matrices of one input, one matrix per "outer" index (the
// flattened batch dims and heads of the output). The host lists the element
// offset of each outer index's matrix, which is how broadcast batch/head
// dims (stride 0), grouped-query heads and transposed layouts are all read in
// place without copies.
struct MatrixView {
  const void* data = nullptr;
  const int64_t* offsets = nullptr;  // one per outer index
  int64_t row_stride = 0;
  int64_t col_stride = 1;  // 1 for q/k/v; any value (0 too) for the mask
};

struct ForwardParams {
  DType dtype = DType::Float32;
  int64_t outer = 0;  // batch dims × heads of the output
  int64_t len_q = 0;
  int64_t len_kv = 0;
  int64_t dim_qk = 0;
  int64_t dim_v = 0;

  MatrixView q, k, v;
  MaskKind mask_kind = MaskKind::None;
  MatrixView mask;

  double scale = 1.0;
  bool is_causal = false;  // top-left aligned: row i sees keys 0..i

  // Dropout on the normalised probabilities: element (o, i, j) is kept iff
  // its number in the stream is >= dropout_threshold, and kept ones are
  // scaled by 1/(1 - dropout_p). Off when dropout_p == 0.
  double dropout_p = 0.0;
  uint32_t dropout_threshold = 0;
  DropoutStream dropout;

  void* out = nullptr;  // dtype, rows at out + out_offsets[o] + i * out_row_stride
  const int64_t* out_offsets = nullptr;
  int64_t out_row_stride = 0;
  void* lse = nullptr;  // (outer, len_q) row-major, float (double for Float64)

  int64_t num_threads = 1;  // threads sharing the items (for block sizing)
  int64_t block_q = 0;      // query rows per work item (set by forward_configure)
  int64_t block_kv = 0;     // keys per inner step (set by forward_configure)
};

// The backward reads everything the forward read plus the forward's output
// and log-sum-exp and the output's gradient. It writes the gradients in
// acc_t (float, double for Float64) for every outer index, dense:
// grad_q (outer, len_q, dim_qk), grad_k (outer, len_kv, dim_qk),
// grad_v (outer, len_kv, dim_v); the host reduces them over broadcast and
// grouped heads. Work items are (outer index, block of keys); their
// contributions to grad_q overlap and go through add_grad_q, which the host
// makes thread-safe and scales.
struct BackwardParams {
  ForwardParams fwd;  // out/lse/out_offsets of fwd are unused
  MatrixView out, grad_out;
  const void* lse = nullptr;  // (outer, len_q) acc_t
  void* grad_q = nullptr;     // accumulated through add_grad_q only
  void* grad_k = nullptr;
  void* grad_v = nullptr;
  // grad_q[o, q0 + i, :] += scale * block[i * ld, :] for i < rows.
  void (*add_grad_q)(const BackwardParams& p, int64_t o, int64_t q0, int64_t rows,
                     const void* block, int64_t ld) = nullptr;
  void* host_state = nullptr;  // for add_grad_q
};

// The attention weights pass: the probabilities softmax(scale·Q·Kᵀ + mask)
// (times the dropout factors when dropout is on) recomputed from the
// forward's log-sum-exp and written out, (outer / heads_per_item, len_q,
// len_kv) row-major in dtype. With heads_per_item = H the heads of each
// batch index are averaged into one matrix. Work items are (outer /
// heads_per_item, block of query rows), numbered like the forward's.
struct WeightsParams {
  ForwardParams fwd;          // out/out_offsets/lse of fwd are unused
  const void* lse = nullptr;  // (outer, len_q) acc_t, as the forward wrote it
  int64_t heads_per_item = 1;
  void* weights = nullptr;
};

inline int64_t num_key_blocks(const BackwardParams& p) {
  return (p.fwd.len_kv + p.fwd.block_kv - 1) / p.fwd.block_kv;
}
inline int64_t num_backward_items(const BackwardParams& p) {
  return p.fwd.outer * num_key_blocks(p);
}

// A work item is one (outer index, block of query rows), numbered
// outer-major.
inline int64_t num_query_blocks(const ForwardParams& p) {
  return (p.len_q + p.block_q - 1) / p.block_q;
}
inline int64_t num_work_items(const ForwardParams& p) {
  return p.outer * num_query_blocks(p);
}
inline int64_t num_weights_items(const WeightsParams& p) {
  return p.fwd.outer / p.heads_per_item * num_query_blocks(p.fwd);
}

}  // namespace fusedmha::cpu
