#pragma once

// Input validation and output allocation for fusedmha::attention_forward,
// shared by every kernel (CPU, Meta, later CUDA) so that they accept the
// same inputs, raise the same errors and return the same shapes and strides.
// Works on symbolic sizes, so the Meta kernel runs it under torch.compile.

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

namespace fusedmha::ops {

// Raises c10::Error (RuntimeError in Python) naming the bad argument.
void check_attention_inputs(const at::Tensor& query,
                            const at::Tensor& key,
                            const at::Tensor& value,
                            const std::optional<at::Tensor>& attn_mask,
                            double dropout_p,
                            bool is_causal,
                            std::optional<double> scale,
                            bool enable_gqa);

// check_attention_inputs, plus: grad_out and out of the forward output's
// shape and the query's dtype, logsumexp and rng_state as attention_forward
// returned them.
void check_attention_backward_inputs(const at::Tensor& grad_out,
                                     const at::Tensor& query,
                                     const at::Tensor& key,
                                     const at::Tensor& value,
                                     const at::Tensor& out,
                                     const at::Tensor& logsumexp,
                                     const at::Tensor& rng_state,
                                     const std::optional<at::Tensor>& attn_mask,
                                     double dropout_p,
                                     bool is_causal,
                                     std::optional<double> scale,
                                     bool enable_gqa);

// For fusedmha::attention_weights: check_attention_inputs (key standing in
// for value), plus logsumexp and rng_state as attention_forward returned them.
void check_attention_weights_inputs(const at::Tensor& query,
                                    const at::Tensor& key,
                                    const at::Tensor& logsumexp,
                                    const at::Tensor& rng_state,
                                    const std::optional<at::Tensor>& attn_mask,
                                    double dropout_p,
                                    bool is_causal,
                                    std::optional<double> scale,
                                    bool enable_gqa);

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

// Output (..., H, L, Ev) in the query's layout, as PyTorch's SDPA returns it, and the
// log-sum-exp (..., H, L), float32 (float64 for float64 inputs).
// Output, log-sum-exp and the dropout rng state (int64 [seed, offset]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_attention_outputs(const at::Tensor& query,
                                                              const at::Tensor& key,
                                                              const at::Tensor& value,
                                                              bool enable_gqa);

// The broadcast shape of everything before (L, E): batch dims..., heads.
// Batch and head dims broadcast like matmul's (size 1 stretches); with
// enable_gqa the key/value head counts may instead divide the query's.
std::vector<c10::SymInt> attention_outer_shape(const at::Tensor& query,
                                               const at::Tensor& key,
                                               const at::Tensor& value,
                                               bool enable_gqa);

// scale, or 1/sqrt(E) when it is not given.
double attention_scale(const at::Tensor& query, std::optional<double> scale);

}  // namespace fusedmha::ops
