#pragma once

// Input validation of the fusedmha ops, shared by every backend (CPU, CUDA,
// Meta) so that they accept the same inputs and raise the same errors.
// Each check raises c10::Error (RuntimeError in Python) whose message starts
// with the op it is given (the entry point the user called) and names the
// bad argument. Works on symbolic sizes, so the Meta kernels run it under
// torch.compile.

#include <fusedmha/attention.h>

#include <ATen/core/Tensor.h>

#include <optional>

namespace fusedmha::ops {

// The ops' names, as error messages start.
inline constexpr const char* kForwardOp = "fusedmha.attention_forward";
inline constexpr const char* kBackwardOp = "fusedmha.attention_backward";
inline constexpr const char* kWeightsOp = "fusedmha.attention_weights";
inline constexpr const char* kSdpaOp = "fusedmha.scaled_dot_product_attention";

// query (..., L, E), key (..., S, E), value (..., S, Ev): dtypes, devices,
// matching dims, broadcastable batch/head dims (or GQA), attn_mask dtype and
// shape, dropout_p in [0, 1), scale finite and >= 0, and the variants: window
// bounds >= -1, softcap finite and >= 0, alibi_slopes (H) or (B, H) and sinks
// (H), floating, on the query's device.
void check_attention_inputs(const char* op,
                            const at::Tensor& query,
                            const at::Tensor& key,
                            const at::Tensor& value,
                            const std::optional<at::Tensor>& attn_mask,
                            double dropout_p,
                            std::optional<double> scale,
                            bool enable_gqa,
                            const AttentionVariants& variants);

// check_attention_inputs, plus: grad_out and out of the forward output's
// shape and the query's dtype, logsumexp and rng_state as attention_forward
// returned them, and grad_logsumexp (when given) of the logsumexp's shape.
void check_attention_backward_inputs(const char* op,
                                     const at::Tensor& grad_out,
                                     const at::Tensor& query,
                                     const at::Tensor& key,
                                     const at::Tensor& value,
                                     const at::Tensor& out,
                                     const at::Tensor& logsumexp,
                                     const at::Tensor& rng_state,
                                     const std::optional<at::Tensor>& attn_mask,
                                     double dropout_p,
                                     std::optional<double> scale,
                                     bool enable_gqa,
                                     const AttentionVariants& variants,
                                     const std::optional<at::Tensor>& grad_logsumexp);

// For the weights pass: check_attention_inputs (key standing in for value),
// plus logsumexp and rng_state as attention_forward returned them.
void check_attention_weights_inputs(const char* op,
                                    const at::Tensor& query,
                                    const at::Tensor& key,
                                    const at::Tensor& logsumexp,
                                    const at::Tensor& rng_state,
                                    const std::optional<at::Tensor>& attn_mask,
                                    double dropout_p,
                                    std::optional<double> scale,
                                    bool enable_gqa,
                                    const AttentionVariants& variants);

}  // namespace fusedmha::ops
