#pragma once

// fusedmha::MultiheadAttention: torch::nn::MultiheadAttention's module, on
// the fused attention op.

#include <fusedmha/macros.h>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/container/any_value.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <optional>
#include <tuple>

namespace fusedmha {

// torch::nn::MultiheadAttentionOptions, plus batch_first.
struct FUSEDMHA_API MultiheadAttentionOptions {
  MultiheadAttentionOptions(int64_t embed_dim, int64_t num_heads)
      : embed_dim_(embed_dim), num_heads_(num_heads), kdim_(embed_dim), vdim_(embed_dim) {}

  // Total dimension of the model (split among the heads).
  TORCH_ARG(int64_t, embed_dim);
  // Parallel attention heads; must divide embed_dim.
  TORCH_ARG(int64_t, num_heads);
  // Dropout on the attention probabilities, in training mode only.
  TORCH_ARG(double, dropout) = 0.0;
  // Biases in the input and output projections.
  TORCH_ARG(bool, bias) = true;
  // A learnt key and value appended to every sequence.
  TORCH_ARG(bool, add_bias_kv) = false;
  // A zero key and value appended to every sequence.
  TORCH_ARG(bool, add_zero_attn) = false;
  // Features of key and value (default embed_dim).
  TORCH_ARG(int64_t, kdim);
  TORCH_ARG(int64_t, vdim);
  // Inputs and output (N, L, E) instead of (L, N, E).
  TORCH_ARG(bool, batch_first) = false;
};

// The same parameters, under the same names and in the same order, as
// torch::nn::MultiheadAttention, so torch::save of one loads into the other;
// the same forward arguments (plus is_causal) and results. Unlike it, bool
// masks (true = masked), kdim != vdim, half/bfloat16 and batch_first work,
// and a float mask of lower precision than the query is widened (one mask
// rule with the Python module: both call fusedmha::_multihead_attention_core).
// A query whose keys are all masked gets output 0 and weights 0, not NaN.
class FUSEDMHA_API MultiheadAttentionImpl : public torch::nn::Cloneable<MultiheadAttentionImpl> {
 public:
  MultiheadAttentionImpl(int64_t embed_dim, int64_t num_heads)
      : MultiheadAttentionImpl(MultiheadAttentionOptions(embed_dim, num_heads)) {}
  explicit MultiheadAttentionImpl(const MultiheadAttentionOptions& options);

  // query (L, N, E), key (S, N, kdim), value (S, N, vdim) ((N, L, E) etc.
  // with batch_first; (L, E) etc. unbatched). key_padding_mask (N, S) and
  // attn_mask (L, S) or (N * num_heads, L, S): bool (true = masked) or float
  // (added to the scores). is_causal: attn_mask, if given, is the causal
  // mask (it is then not read); without attn_mask it means the causal mask.
  // Returns the output shaped like query, and the attention weights
  // (N, L, S) averaged over heads or (N, num_heads, L, S) when need_weights,
  // else an undefined tensor.
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& query,
                                                   const torch::Tensor& key,
                                                   const torch::Tensor& value,
                                                   const torch::Tensor& key_padding_mask = {},
                                                   bool need_weights = true,
                                                   const torch::Tensor& attn_mask = {},
                                                   bool average_attn_weights = true,
                                                   bool is_causal = false);

  void reset() override;
  void _reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  MultiheadAttentionOptions options;
  bool _qkv_same_embed_dim = true;
  torch::Tensor in_proj_weight;
  torch::Tensor in_proj_bias;
  torch::Tensor bias_k;
  torch::Tensor bias_v;
  torch::nn::Linear out_proj = nullptr;
  torch::Tensor q_proj_weight;
  torch::Tensor k_proj_weight;
  torch::Tensor v_proj_weight;
  int64_t head_dim = 0;

 protected:
  FORWARD_HAS_DEFAULT_ARGS({3, torch::nn::AnyValue(torch::Tensor())},
                           {4, torch::nn::AnyValue(true)},
                           {5, torch::nn::AnyValue(torch::Tensor())},
                           {6, torch::nn::AnyValue(true)},
                           {7, torch::nn::AnyValue(false)})

 private:
  void check_inputs(const torch::Tensor& query, const torch::Tensor& key,
                    const torch::Tensor& value, const torch::Tensor& key_padding_mask,
                    const torch::Tensor& attn_mask) const;
  // Embedding dims, sequence lengths and batch sizes of the batched inputs
  // (the originals name them in errors).
  void check_batched_shapes(const torch::Tensor& q, const torch::Tensor& k,
                            const torch::Tensor& v, bool seq_first, const torch::Tensor& query,
                            const torch::Tensor& key, const torch::Tensor& value) const;
  // attn_mask as (1, 1, L, S) or (N, H, L, S) and the (batched)
  // key_padding_mask as (N, 1, 1, S), their shapes checked.
  std::tuple<std::optional<torch::Tensor>, std::optional<torch::Tensor>> mask_views(
      const torch::Tensor& attn_mask, const torch::Tensor& padding, const torch::Tensor& q,
      const torch::Tensor& k, bool seq_first, bool batched,
      const torch::Tensor& key_padding_mask) const;
  // q, k, v as (N, H, L, D) views of the projections.
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> project(const torch::Tensor& query,
                                                                  const torch::Tensor& key,
                                                                  const torch::Tensor& value,
                                                                  bool seq_first) const;
};

TORCH_MODULE(MultiheadAttention);

}  // namespace fusedmha
