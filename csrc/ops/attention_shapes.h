#pragma once

// The shapes of an attention call: the outer (batch dims, heads) shape, the
// outputs every backend allocates (CPU, CUDA and Meta alike, so shapes and
// strides agree), gradients summed back into their inputs' shapes, and the
// default scale. Works on symbolic sizes where the Meta kernels need it.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace fusedmha::ops {

// "[2, 8, 128, 64]": sizes as error messages print them.
std::string shape_str(c10::SymIntArrayRef sizes);

// The broadcast shape of everything before (L, E): batch dims..., heads.
// Batch and head dims broadcast like matmul's (size 1 stretches); with
// enable_gqa the key/value head counts may instead divide the query's.
// Raises, naming op, when they do not.
std::vector<c10::SymInt> attention_outer_shape(const char* op,
                                               const at::Tensor& query,
                                               const at::Tensor& key,
                                               const at::Tensor& value,
                                               bool enable_gqa);

// The query rows of a call: the outer shape's size times L (0 for an empty
// batch, head or query dim, where there is nothing to compute).
int64_t attention_query_rows(const char* op, const at::Tensor& query, const at::Tensor& key,
                             const at::Tensor& value, bool enable_gqa);

// Output (..., H, L, Ev) in the query's layout, as PyTorch's SDPA returns it, the
// log-sum-exp (..., H, L), float32 (float64 for float64 inputs), and the
// dropout rng state (int64 [seed, offset]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_attention_outputs(const at::Tensor& query,
                                                                          const at::Tensor& key,
                                                                          const at::Tensor& value,
                                                                          bool enable_gqa);

// The outputs of a packed batch (ops/packed_batch.h): output (total_q, H,
// Ev), log-sum-exp (H, total_q) as FlashAttention returns it, and the
// dropout rng state. Rows no sequence covers get output 0 and lse +inf (no
// keys): all rows, or, when the kernel is known to write the first
// written_rows (cu_seqlens_q[-1], read on the host), only the rest, and
// the rng state is left for that kernel to write.
std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_varlen_outputs(
    const at::Tensor& query, const at::Tensor& value,
    std::optional<int64_t> written_rows = std::nullopt);

// The attention weights (..., H, L, S), or (..., L, S) averaged over heads,
// contiguous, in the query's dtype.
at::Tensor allocate_attention_weights(const at::Tensor& query,
                                      const at::Tensor& key,
                                      bool enable_gqa,
                                      bool average_heads);

// A gradient computed per output head (outer..., rows, cols), summed into
// the shape of the input it belongs to (GQA groups, broadcast batch/head
// dims) and cast to its dtype.
at::Tensor reduce_to_input(at::Tensor grad, const at::Tensor& input);

// The gradient of a float mask as the kernels sum it: zeros in dtype, of
// the mask's shape except along the dims it was expanded in (stride 0,
// size > 1), which are 1: the kernels read those as broadcast and sum over
// them, as over the dims the mask is broadcast along.
at::Tensor allocate_mask_gradient_sums(const at::Tensor& mask, at::ScalarType dtype);
// That shape.
std::vector<c10::SymInt> mask_gradient_sums_shape(const at::Tensor& mask);
// What the sums are scaled by: 1 / the number of elements each one stands
// for along the expanded dims. Those elements share memory, and each holds
// the sum divided by their count, so that summing them (the expand's
// backward) gives the sum, as PyTorch's as_strided backward treats
// overlapping memory.
double mask_gradient_scale(const at::Tensor& mask);
// sums (summed with ATen ops) scaled so: the same with symbolic sizes (a
// compiled graph's), where mask_gradient_scale needs concrete ones.
at::Tensor scaled_mask_gradient_sums(const at::Tensor& sums, const at::Tensor& mask);

// Those scaled sums as the mask's gradient (attention_backward's
// grad_attn_mask): in the mask's dtype and shape. Without sums (a Meta
// call), an empty tensor of that shape and those strides.
at::Tensor mask_gradient(const at::Tensor& mask, const std::optional<at::Tensor>& sums);

// The scale of the scores: scale, or 1/sqrt(E) when it is not given. With
// E = 0 every score is 0 whatever the scale, so the (then infinite)
// default is taken as 0.
double attention_scale(const at::Tensor& query, std::optional<double> scale);

}  // namespace fusedmha::ops
