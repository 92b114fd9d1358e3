// fusedmha::_multihead_attention_core: what the two MultiheadAttention front
// doors (python/fusedmha/modules.py and csrc/modules/multihead_attention.cpp)
// do between their input projections and their output projection, written
// once: the mask rule, the extra keys (bias_k/bias_v, add_zero_attn), the
// causal hint, dropout 1, and the fused attention and weights calls.
//
// Registered as CompositeImplicitAutograd: autograd, torch.compile and
// torch.export see the attention ops it calls. Sizes are read as SymInts so
// it also runs with symbolic shapes.

#include "modules/multihead_attention_core.h"

#include <fusedmha/attention.h>

#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/TensorOperators.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include <limits>

namespace fusedmha {
namespace {

using at::Tensor;

constexpr const char* kModule = "fusedmha.MultiheadAttention";

// A mask lives on the query's device. A float mask is added to the query's
// scores: one of lower precision is widened (on every path, as PyTorch's
// fast path does), one of higher precision (float64 for a float32 query) is
// an error. Checked here, so that errors name the module the user called.
void check_module_mask(const std::optional<Tensor>& mask, const char* name, const Tensor& query) {
  if (!mask.has_value()) return;
  TORCH_CHECK(mask->device() == query.device(), kModule, ": expected ", name,
              " on the query's device (", query.device(), "), got ", mask->device());
  if (mask->scalar_type() == at::kBool) return;
  TORCH_CHECK(at::isFloatingType(mask->scalar_type()), kModule, ": expected ", name,
              " of dtype bool or floating point, got ", mask->scalar_type());
  const at::ScalarType query_dtype = query.scalar_type();
  TORCH_CHECK(c10::promoteTypes(mask->scalar_type(), query_dtype) == query_dtype, kModule,
              ": expected a float ", name, " of the query's dtype (", query_dtype,
              ") or lower precision, got ", mask->scalar_type());
}

// mask with `extra` more keys that every query may attend to (zeros: false
// for bool, 0.0 for float).
std::optional<Tensor> pad_keys(const std::optional<Tensor>& mask, int64_t extra) {
  if (!mask.has_value() || extra == 0) return mask;
  return at::constant_pad_nd(*mask, {0, extra}, 0);
}

// A module mask (bool true = masked) as a float term added to the scores,
// in dtype, or left in float32 for a half-precision dtype (the op takes
// both, and float32 keeps more of the mask).
Tensor additive(const Tensor& mask, at::ScalarType dtype) {
  if (mask.scalar_type() == at::kBool) {
    return at::zeros_symint(mask.sym_sizes(), mask.options().dtype(dtype))
        .masked_fill_(mask, -std::numeric_limits<double>::infinity());
  }
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  return mask.scalar_type() == dtype || (half && mask.scalar_type() == at::kFloat) ? mask
                                                                                   : mask.to(dtype);
}

// The module's masks (bool true = masked, float added) as the one mask the
// op takes (bool true = may attend, float added); a merged tensor is built
// only when both are given.
std::optional<Tensor> op_mask(const std::optional<Tensor>& attn_mask,
                              const std::optional<Tensor>& key_padding_mask,
                              at::ScalarType dtype) {
  if (!attn_mask.has_value() || !key_padding_mask.has_value()) {
    const std::optional<Tensor>& mask = attn_mask.has_value() ? attn_mask : key_padding_mask;
    if (!mask.has_value()) return std::nullopt;
    return mask->scalar_type() == at::kBool ? mask->logical_not() : additive(*mask, dtype);
  }
  if (attn_mask->scalar_type() == at::kBool && key_padding_mask->scalar_type() == at::kBool) {
    return attn_mask->logical_or(*key_padding_mask).logical_not();
  }
  return additive(*attn_mask, dtype) + additive(*key_padding_mask, dtype);
}

// k (or v) with one more key per (batch, head) at the end: row of shape
// (1, 1, H * D) split into heads, or zeros when row is null.
Tensor append_key(const Tensor& x, const std::optional<Tensor>& row) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape[2] = 1;
  Tensor extra = row.has_value()
                     ? row->view_symint({1, shape[1], 1, shape[3]}).expand_symint(shape)
                     : at::zeros_symint(shape, x.options());
  return at::cat({x, extra}, 2);
}

}  // namespace

std::tuple<Tensor, Tensor> multihead_attention_core(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& attn_mask,
    const std::optional<Tensor>& key_padding_mask, const std::optional<Tensor>& bias_k,
    const std::optional<Tensor>& bias_v, bool add_zero_attn, double dropout_p,
    bool need_weights, bool average_attn_weights, bool is_causal) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, kModule,
              ": expected projected q, k, v of shape (N, H, L, D), got ", q.dim(), "-D, ",
              k.dim(), "-D and ", v.dim(), "-D");
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), kModule,
              ": expected the projected query, key and value on one device, got ", q.device(),
              ", ", k.device(), " and ", v.device());
  TORCH_CHECK(bias_k.has_value() == bias_v.has_value(), kModule,
              ": bias_k and bias_v come together");
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, kModule, ": dropout must be in [0, 1], got ",
              dropout_p);
  check_module_mask(attn_mask, "attn_mask", q);
  check_module_mask(key_padding_mask, "key_padding_mask", q);

  std::optional<Tensor> mask = attn_mask, padding = key_padding_mask;
  Tensor keys = k, values = v;
  // Extra keys: the learnt bias_k/bias_v, then a zero key; every query
  // sees them.
  const int64_t extra_keys = int64_t(bias_k.has_value()) + int64_t(add_zero_attn);
  if (is_causal && extra_keys > 0) {
    // Top-left causal masking would hide the appended keys from the first
    // queries: the causal mask becomes an explicit one.
    if (!mask.has_value()) {
      const c10::SymInt L = q.sym_size(2), S = k.sym_size(2);
      mask = at::ones_symint({L, S}, q.options().dtype(at::kBool)).triu(1).view_symint({1, 1, L, S});
    }
    is_causal = false;
  } else if (is_causal) {
    mask = std::nullopt;  // the hint: attn_mask is the causal mask, not read
  }
  if (bias_k.has_value()) {
    keys = append_key(keys, bias_k);
    values = append_key(values, bias_v);
  }
  if (add_zero_attn) {
    keys = append_key(keys, std::nullopt);
    values = append_key(values, std::nullopt);
  }
  const std::optional<Tensor> merged =
      op_mask(pad_keys(mask, extra_keys), pad_keys(padding, extra_keys), q.scalar_type());

  // Dropout 1 drops every probability, as F.dropout does (the kernels take p < 1).
  const bool drop_all = dropout_p == 1.0;
  const double p = drop_all ? 0.0 : dropout_p;
  auto [out, lse, rng_state] = attention_forward(q, keys, values, merged, p, is_causal);
  Tensor weights;
  if (need_weights) {
    weights = attention_weights(q, keys, lse, rng_state, merged, p, is_causal, std::nullopt,
                                false, average_attn_weights);
  } else {
    weights = at::empty({0}, q.options());
  }
  if (drop_all) {
    out = out.mul(0.0);
    weights = weights.mul(0.0);
  }
  return {out, weights};
}

TORCH_LIBRARY_IMPL(fusedmha, CompositeImplicitAutograd, m) {
  m.impl("_multihead_attention_core", TORCH_FN(multihead_attention_core));
}

}  // namespace fusedmha
