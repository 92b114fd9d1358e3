#pragma once

#include <fusedmha/macros.h>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace fusedmha {

// Same signature and meaning as at::scaled_dot_product_attention:
// query (..., H, L, E), key (..., H_kv, S, E), value (..., H_kv, S, Ev);
// attn_mask bool (true = may attend) or float (added to the scores),
// broadcastable to (..., H, L, S); is_causal is top-left aligned; scale
// defaults to 1/sqrt(E); enable_gqa lets H be a multiple of H_kv.
// A query row whose keys are all masked gets output 0, never NaN.
// Goes through the dispatcher (op fusedmha::scaled_dot_product_attention).
FUSEDMHA_API at::Tensor scaled_dot_product_attention(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask = std::nullopt,
    double dropout_p = 0.0,
    bool is_causal = false,
    std::optional<double> scale = std::nullopt,
    bool enable_gqa = false);

// The forward op itself (fusedmha::attention_forward): returns the output,
// the per-row log-sum-exp of the scaled, masked scores, shape (..., H, L),
// float32 (float64 for float64 inputs; +inf for rows with no key to attend
// to), and the dropout rng state, int64 [seed, offset] (drawn from the
// default generator of the query's device when dropout_p > 0, so
// torch::manual_seed makes runs repeatable).
FUSEDMHA_API std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask = std::nullopt,
    double dropout_p = 0.0,
    bool is_causal = false,
    std::optional<double> scale = std::nullopt,
    bool enable_gqa = false);

// The backward op (fusedmha::attention_backward): gradients with respect to
// query, key and value, given the gradient of the output and what
// attention_forward returned. Autograd calls it; it is public for tests and
// for custom autograd code.
FUSEDMHA_API std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out,
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& out,
    const at::Tensor& logsumexp,
    const at::Tensor& rng_state,
    const std::optional<at::Tensor>& attn_mask = std::nullopt,
    double dropout_p = 0.0,
    bool is_causal = false,
    std::optional<double> scale = std::nullopt,
    bool enable_gqa = false);

// The attention weights of a forward call (fusedmha::attention_weights):
// softmax(scale·Q·Kᵀ + mask) recomputed from the logsumexp and rng_state
// attention_forward returned, with the same dropout applied (pass the same
// attn_mask, dropout_p, is_causal, scale and enable_gqa). Shape
// (..., H, L, S), or (..., L, S) averaged over heads; query's dtype; rows
// with no key to attend to are 0. Differentiable with respect to query and
// key.
FUSEDMHA_API at::Tensor attention_weights(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& logsumexp,
    const at::Tensor& rng_state,
    const std::optional<at::Tensor>& attn_mask = std::nullopt,
    double dropout_p = 0.0,
    bool is_causal = false,
    std::optional<double> scale = std::nullopt,
    bool enable_gqa = false,
    bool average_heads = false);

}  // namespace fusedmha
