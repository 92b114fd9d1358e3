// fusedmha::MultiheadAttention: checks, projections and head layout around
// the op shared with python/fusedmha/modules.py
// (modules/multihead_attention_core.h: masks, extra keys, fused attention).

#include "modules/multihead_attention_core.h"

#include <fusedmha/multihead_attention.h>

#include <torch/nn/init.h>
#include <torch/nn/functional/linear.h>

#include <ostream>

namespace fusedmha {
namespace {

using torch::Tensor;
namespace F = torch::nn::functional;

constexpr const char* kModule = "fusedmha::MultiheadAttention";

void check_mask_dtype(const Tensor& mask, const char* name) {
  TORCH_CHECK(!mask.defined() || mask.scalar_type() == torch::kBool || mask.is_floating_point(),
              kModule, ": only bool and floating types of ", name, " are supported, got ",
              mask.scalar_type());
}

std::optional<Tensor> optional(const Tensor& t) {
  return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
}

// A projection (L, N, parts*E) or (N, L, parts*E) viewed as (parts, N, H, L, D).
Tensor split_heads(const Tensor& x, int64_t parts, int64_t heads, int64_t head_dim,
                   bool seq_first) {
  const Tensor split = x.unflatten(-1, {parts, heads, head_dim});
  return seq_first ? split.permute({2, 1, 3, 0, 4}) : split.permute({2, 0, 3, 1, 4});
}

Tensor slice_rows(const Tensor& t, int64_t begin, int64_t end) {
  return t.defined() ? t.slice(0, begin, end) : t;
}

}  // namespace

MultiheadAttentionImpl::MultiheadAttentionImpl(const MultiheadAttentionOptions& options_)
    : options(options_) {
  reset();
}

void MultiheadAttentionImpl::reset() {
  const int64_t E = options.embed_dim(), H = options.num_heads();
  TORCH_CHECK(E > 0 && H > 0, kModule, ": embed_dim and num_heads must be greater than 0, got ",
              "embed_dim=", E, " and num_heads=", H);
  TORCH_CHECK(E % H == 0, kModule, ": embed_dim must be divisible by num_heads, got embed_dim=",
              E, " and num_heads=", H);
  TORCH_CHECK(options.kdim() > 0 && options.vdim() > 0, kModule,
              ": kdim and vdim must be greater than 0, got ", options.kdim(), " and ",
              options.vdim());
  TORCH_CHECK(options.dropout() >= 0.0 && options.dropout() <= 1.0, kModule,
              ": dropout must be in [0, 1], got ", options.dropout());
  _qkv_same_embed_dim = options.kdim() == E && options.vdim() == E;
  head_dim = E / H;
  // torch::nn::MultiheadAttention's names, order and initialisation.
  if (!_qkv_same_embed_dim) {
    q_proj_weight = register_parameter("q_proj_weight", torch::empty({E, E}));
    k_proj_weight = register_parameter("k_proj_weight", torch::empty({E, options.kdim()}));
    v_proj_weight = register_parameter("v_proj_weight", torch::empty({E, options.vdim()}));
    register_parameter("in_proj_weight", {}, /*requires_grad=*/false);
  } else {
    in_proj_weight = register_parameter("in_proj_weight", torch::empty({3 * E, E}));
    register_parameter("q_proj_weight", {}, /*requires_grad=*/false);
    register_parameter("k_proj_weight", {}, /*requires_grad=*/false);
    register_parameter("v_proj_weight", {}, /*requires_grad=*/false);
  }
  if (options.bias()) {
    in_proj_bias = register_parameter("in_proj_bias", torch::empty(3 * E));
  } else {
    register_parameter("in_proj_bias", {}, /*requires_grad=*/false);
  }
  out_proj = register_module(
      "out_proj", torch::nn::Linear(torch::nn::LinearOptions(E, E).bias(options.bias())));
  if (options.add_bias_kv()) {
    bias_k = register_parameter("bias_k", torch::empty({1, 1, E}));
    bias_v = register_parameter("bias_v", torch::empty({1, 1, E}));
  } else {
    bias_k = Tensor();
    bias_v = Tensor();
  }
  _reset_parameters();
}

void MultiheadAttentionImpl::_reset_parameters() {
  namespace init = torch::nn::init;
  if (_qkv_same_embed_dim) {
    init::xavier_uniform_(in_proj_weight);
  } else {
    init::xavier_uniform_(q_proj_weight);
    init::xavier_uniform_(k_proj_weight);
    init::xavier_uniform_(v_proj_weight);
  }
  if (in_proj_bias.defined()) {
    init::constant_(in_proj_bias, 0.);
    init::constant_(out_proj->bias, 0.);
  }
  if (bias_k.defined()) init::xavier_normal_(bias_k);
  if (bias_v.defined()) init::xavier_normal_(bias_v);
}

void MultiheadAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "fusedmha::MultiheadAttention(embed_dim=" << options.embed_dim()
         << ", num_heads=" << options.num_heads() << ", dropout=" << options.dropout()
         << ", bias=" << options.bias() << ", kdim=" << options.kdim()
         << ", vdim=" << options.vdim() << ", batch_first=" << options.batch_first() << ")";
}

std::tuple<Tensor, Tensor, Tensor> MultiheadAttentionImpl::project(const Tensor& query,
                                                                   const Tensor& key,
                                                                   const Tensor& value,
                                                                   bool seq_first) const {
  const int64_t E = options.embed_dim(), H = options.num_heads();
  auto heads = [&](const Tensor& x, int64_t parts) {
    return split_heads(x, parts, H, head_dim, seq_first);
  };
  const Tensor& b = in_proj_bias;
  if (_qkv_same_embed_dim) {
    const Tensor& w = in_proj_weight;
    if (query.is_same(key) && key.is_same(value)) {
      // Self-attention: one packed matmul.
      const Tensor qkv = heads(F::linear(query, w, b), 3);
      return {qkv[0], qkv[1], qkv[2]};
    }
    if (key.is_same(value)) {
      const Tensor kv = heads(F::linear(key, w.slice(0, E), slice_rows(b, E, 3 * E)), 2);
      return {heads(F::linear(query, w.slice(0, 0, E), slice_rows(b, 0, E)), 1)[0], kv[0], kv[1]};
    }
  }
  const Tensor w_q = _qkv_same_embed_dim ? in_proj_weight.slice(0, 0, E) : q_proj_weight;
  const Tensor w_k = _qkv_same_embed_dim ? in_proj_weight.slice(0, E, 2 * E) : k_proj_weight;
  const Tensor w_v = _qkv_same_embed_dim ? in_proj_weight.slice(0, 2 * E) : v_proj_weight;
  return {heads(F::linear(query, w_q, slice_rows(b, 0, E)), 1)[0],
          heads(F::linear(key, w_k, slice_rows(b, E, 2 * E)), 1)[0],
          heads(F::linear(value, w_v, slice_rows(b, 2 * E, 3 * E)), 1)[0]};
}

std::tuple<Tensor, Tensor> MultiheadAttentionImpl::forward(
    const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& key_padding_mask,
    bool need_weights, const Tensor& attn_mask, bool average_attn_weights, bool is_causal) {
  check_inputs(query, key, value, key_padding_mask, attn_mask);
  const bool batched = query.dim() == 3;
  // Inputs stay in their own layout: (L, N, E), or (N, L, E) with batch_first.
  const bool seq_first = !(options.batch_first() && batched);
  Tensor q_in = query, k_in = key, v_in = value, padding = key_padding_mask;
  if (!batched) {
    q_in = query.unsqueeze(1);
    k_in = key.is_same(query) ? q_in : key.unsqueeze(1);
    v_in = value.is_same(key) ? k_in : value.unsqueeze(1);
    if (padding.defined()) padding = padding.unsqueeze(0);
  }
  check_batched_shapes(q_in, k_in, v_in, seq_first, query, key, value);
  auto [q, k, v] = project(q_in, k_in, v_in, seq_first);
  const auto [mask_view, padding_view] = mask_views(attn_mask, padding, q_in, k_in, seq_first,
                                                    batched, key_padding_mask);

  const double dropout_p = is_training() ? options.dropout() : 0.0;
  auto [out, weights] = multihead_attention_core(
      q, k, v, mask_view, padding_view, optional(bias_k), optional(bias_v),
      options.add_zero_attn(), dropout_p, need_weights, average_attn_weights, is_causal);
  if (!need_weights) weights = Tensor();
  if (weights.defined() && !batched) weights = weights.squeeze(0);
  // out (N, H, L, D) follows q's layout: (N, L, H, D) or (L, N, H, D) memory.
  out = (seq_first ? out.permute({2, 0, 1, 3}) : out.transpose(1, 2)).flatten(2);
  out = out_proj->forward(out);
  if (!batched) out = out.squeeze(1);
  return std::make_tuple(out, weights);
}

void MultiheadAttentionImpl::check_inputs(const Tensor& query, const Tensor& key,
                                          const Tensor& value, const Tensor& key_padding_mask,
                                          const Tensor& attn_mask) const {
  TORCH_CHECK(query.dim() == 2 || query.dim() == 3, kModule,
              ": expected query to be unbatched 2-D (L, E) or batched 3-D, got a ", query.dim(),
              "-D tensor");
  TORCH_CHECK(key.dim() == query.dim() && value.dim() == query.dim(), kModule, ": for a ",
              query.dim(), "-D query, expected key and value to be ", query.dim(),
              "-D too, got ", key.dim(), "-D and ", value.dim(), "-D");
  TORCH_CHECK(!key_padding_mask.defined() || key_padding_mask.dim() == query.dim() - 1, kModule,
              ": for a ", query.dim(), "-D query, expected key_padding_mask to be undefined or ",
              query.dim() - 1, "-D, got ", key_padding_mask.dim(), "-D");
  TORCH_CHECK(!attn_mask.defined() || attn_mask.dim() == 2 || attn_mask.dim() == 3, kModule,
              ": expected attn_mask to be undefined, 2-D or 3-D, got ", attn_mask.dim(), "-D");
  check_mask_dtype(key_padding_mask, "key_padding_mask");
  check_mask_dtype(attn_mask, "attn_mask");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() &&
                  query.scalar_type() == value.scalar_type(),
              kModule, ": expected query, key and value of the same dtype, got ",
              query.scalar_type(), ", ", key.scalar_type(), " and ", value.scalar_type());
}

void MultiheadAttentionImpl::check_batched_shapes(const Tensor& q, const Tensor& k,
                                                  const Tensor& v, bool seq_first,
                                                  const Tensor& query, const Tensor& key,
                                                  const Tensor& value) const {
  const int64_t seq_dim = seq_first ? 0 : 1, N = q.size(1 - seq_dim);
  TORCH_CHECK(q.size(2) == options.embed_dim(), kModule,
              ": expected query's last dim to be embed_dim=", options.embed_dim(), ", got ",
              query.sizes());
  TORCH_CHECK(k.size(2) == options.kdim() && v.size(2) == options.vdim(), kModule,
              ": expected key's last dim to be kdim=", options.kdim(),
              " and value's to be vdim=", options.vdim(), ", got key ", key.sizes(),
              " and value ", value.sizes());
  TORCH_CHECK(k.size(seq_dim) == v.size(seq_dim) && k.size(1 - seq_dim) == N &&
                  v.size(1 - seq_dim) == N,
              kModule, ": expected key and value of the same sequence length and query's batch "
              "size, got query ", query.sizes(), ", key ", key.sizes(), ", value ",
              value.sizes());
}

std::tuple<std::optional<Tensor>, std::optional<Tensor>> MultiheadAttentionImpl::mask_views(
    const Tensor& attn_mask, const Tensor& padding, const Tensor& q, const Tensor& k,
    bool seq_first, bool batched, const Tensor& key_padding_mask) const {
  const int64_t seq_dim = seq_first ? 0 : 1, H = options.num_heads();
  const int64_t L = q.size(seq_dim), N = q.size(1 - seq_dim), S = k.size(seq_dim);
  std::optional<Tensor> mask_view, padding_view;
  if (attn_mask.defined()) {
    if (attn_mask.dim() == 2) {
      TORCH_CHECK(attn_mask.size(0) == L && attn_mask.size(1) == S, kModule,
                  ": expected a 2-D attn_mask of shape (L, S) = (", L, ", ", S, "), got ",
                  attn_mask.sizes());
      mask_view = attn_mask.view({1, 1, L, S});
    } else {
      const int64_t expected = batched ? N * H : H;
      TORCH_CHECK(attn_mask.size(0) == expected && attn_mask.size(1) == L &&
                      attn_mask.size(2) == S,
                  kModule, ": expected a 3-D attn_mask of shape (", batched ? "N * " : "",
                  "num_heads, L, S) = (", expected, ", ", L, ", ", S, "), got ",
                  attn_mask.sizes());
      mask_view = attn_mask.view({N, H, L, S});
    }
  }
  if (padding.defined()) {
    TORCH_CHECK(padding.size(0) == N && padding.size(1) == S, kModule,
                ": expected key_padding_mask of shape (N, S) = (", N, ", ", S, "), got ",
                key_padding_mask.sizes());
    padding_view = padding.view({N, 1, 1, S});
  }
  return {mask_view, padding_view};
}

}  // namespace fusedmha
