#pragma once

// The part of MultiheadAttention's forward between the input and output
// projections, shared by the Python and C++ modules (the op
// fusedmha::_multihead_attention_core).

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace fusedmha {

// q (N, H, L, D), k (N, H, S, D), v (N, H, S, Dv): the projections, any
// strides. attn_mask viewed as (1, 1, L, S) or (N, H, L, S) and
// key_padding_mask as (N, 1, 1, S), in the module's meaning (bool true =
// masked, float added; a float mask of lower precision than q is widened).
// bias_k, bias_v (1, 1, H * D) append a learnt key and value, add_zero_attn
// a zero one. is_causal: attn_mask, if given, is the causal mask and is not
// read. dropout_p in [0, 1]. Returns the output (N, H, L, Dv) in q's layout
// and the weights ((N, L, S) averaged over heads, or (N, H, L, S)) when
// need_weights, else an empty tensor.
std::tuple<at::Tensor, at::Tensor> multihead_attention_core(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& bias_k, const std::optional<at::Tensor>& bias_v,
    bool add_zero_attn, double dropout_p, bool need_weights, bool average_attn_weights,
    bool is_causal);

}  // namespace fusedmha
