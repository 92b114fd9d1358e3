#include "ops/attention_checks.h"

#include <ATen/ExpandUtils.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>

#include <cmath>
#include <sstream>

namespace fusedmha::ops {
namespace {

constexpr const char* kOp = "fusedmha.scaled_dot_product_attention";

std::string shape_str(c10::SymIntArrayRef sizes) {
  std::ostringstream os;
  os << sizes;
  return os.str();
}

// Head count of a (..., H, rows, cols) input; a 2-D input has one head.
c10::SymInt heads_of(const at::Tensor& t) {
  return t.dim() >= 3 ? t.sym_size(-3) : c10::SymInt(1);
}

// logsumexp and rng_state as attention_forward returned them for these inputs.
void check_saved_state(const char* op, const at::Tensor& query, const at::Tensor& key,
                       const at::Tensor& value, const at::Tensor& logsumexp,
                       const at::Tensor& rng_state, bool enable_gqa) {
  TORCH_CHECK(rng_state.dim() == 1 && rng_state.sym_size(0) == 2 &&
                  rng_state.scalar_type() == at::kLong,
              op, ": expected rng_state as attention_forward returns it (int64 of shape [2]), "
              "got ", rng_state.scalar_type(), " of shape ", shape_str(rng_state.sym_sizes()));
  const at::Tensor expected_lse = std::get<1>(allocate_attention_outputs(
      query.to(at::kMeta), key.to(at::kMeta), value.to(at::kMeta), enable_gqa));
  TORCH_CHECK(logsumexp.sym_sizes() == expected_lse.sym_sizes() &&
                  logsumexp.scalar_type() == expected_lse.scalar_type() &&
                  logsumexp.device() == query.device(),
              op, ": expected logsumexp as attention_forward returns it (",
              expected_lse.scalar_type(), " of shape ", shape_str(expected_lse.sym_sizes()),
              "), got ", logsumexp.scalar_type(), " of shape ", shape_str(logsumexp.sym_sizes()));
}

}  // namespace

std::vector<c10::SymInt> attention_outer_shape(const at::Tensor& query,
                                               const at::Tensor& key,
                                               const at::Tensor& value,
                                               bool enable_gqa) {
  // Batch dims (all but the last three) broadcast like matmul's; the head
  // dim broadcasts too (size 1), or with enable_gqa key/value heads may
  // divide query heads.
  const int64_t rank = std::max({query.dim(), key.dim(), value.dim()});
  const int64_t n_batch = std::max<int64_t>(rank - 3, 0);
  std::vector<c10::SymInt> outer(n_batch + 1, c10::SymInt(1));
  for (const at::Tensor* t : {&query, &key, &value}) {
    const int64_t t_batch = std::max<int64_t>(t->dim() - 3, 0);
    for (const auto i : c10::irange(t_batch)) {
      const c10::SymInt& size = t->sym_size(i);
      c10::SymInt& dst = outer[n_batch - t_batch + i];
      if (size == 1) continue;
      TORCH_CHECK(dst == 1 || dst == size, kOp,
                  ": the batch dims of query, key and value must be broadcastable, got query ",
                  shape_str(query.sym_sizes()), ", key ", shape_str(key.sym_sizes()), ", value ",
                  shape_str(value.sym_sizes()));
      dst = size;
    }
  }
  const c10::SymInt hq = heads_of(query), hk = heads_of(key), hv = heads_of(value);
  if (enable_gqa) {
    TORCH_CHECK(hk != 0 && hv != 0, kOp,
                ": with enable_gqa=True key and value need at least one head, got ", hk, " and ",
                hv);
    TORCH_CHECK(hq % hk == 0 && hq % hv == 0, kOp,
                ": with enable_gqa=True the number of heads in key (", hk, ") and value (", hv,
                ") must divide the number of heads in query (", hq, ")");
    outer[n_batch] = hq;
  } else {
    c10::SymInt h = 1;
    for (const c10::SymInt& x : {hq, hk, hv}) {
      if (x == 1) continue;
      TORCH_CHECK(h == 1 || h == x, kOp,
                  ": query, key and value must have the same number of heads (or 1), got ", hq,
                  ", ", hk, " and ", hv, "; pass enable_gqa=True for grouped-query attention");
      h = x;
    }
    outer[n_batch] = h;
  }
  return outer;
}

void check_attention_inputs(const at::Tensor& query,
                            const at::Tensor& key,
                            const at::Tensor& value,
                            const std::optional<at::Tensor>& attn_mask,
                            double dropout_p,
                            bool is_causal,
                            std::optional<double> scale,
                            bool enable_gqa) {
  TORCH_CHECK(query.dim() >= 2 && key.dim() >= 2 && value.dim() >= 2, kOp,
              ": expected query (..., L, E), key (..., S, E) and value (..., S, Ev) to have at "
              "least 2 dims, got query.dim()=", query.dim(), ", key.dim()=", key.dim(),
              ", value.dim()=", value.dim());
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 ||
                  dtype == at::kHalf,
              kOp, ": expected query of dtype float32, float64, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(key.scalar_type() == dtype && value.scalar_type() == dtype, kOp,
              ": expected query, key and value to have the same dtype, got query.dtype=", dtype,
              ", key.dtype=", key.scalar_type(), ", value.dtype=", value.scalar_type());
  TORCH_CHECK(key.device() == query.device() && value.device() == query.device(), kOp,
              ": expected query, key and value on the same device, got query on ",
              query.device(), ", key on ", key.device(), ", value on ", value.device());
  TORCH_CHECK(key.sym_size(-1) == query.sym_size(-1), kOp,
              ": expected key's last dim (E) to equal query's, got query ",
              shape_str(query.sym_sizes()), " and key ", shape_str(key.sym_sizes()));
  TORCH_CHECK(value.sym_size(-2) == key.sym_size(-2), kOp,
              ": expected value's sequence length (dim -2) to equal key's, got key ",
              shape_str(key.sym_sizes()), " and value ", shape_str(value.sym_sizes()));
  const std::vector<c10::SymInt> outer = attention_outer_shape(query, key, value, enable_gqa);

  if (attn_mask.has_value()) {
    const at::Tensor& mask = *attn_mask;
    const auto mdtype = mask.scalar_type();
    TORCH_CHECK(mdtype == at::kBool || mdtype == at::kFloat || mdtype == dtype, kOp,
                ": expected attn_mask of dtype bool, float32 or the query's dtype (", dtype,
                "), got ", mdtype);
    TORCH_CHECK(mask.device() == query.device(), kOp,
                ": expected attn_mask on the query's device (", query.device(), "), got ",
                mask.device());
    std::vector<c10::SymInt> target = outer;
    target.push_back(query.sym_size(-2));
    target.push_back(key.sym_size(-2));
    bool ok = mask.dim() <= static_cast<int64_t>(target.size());
    for (int64_t i = 1; ok && i <= mask.dim(); ++i) {
      const c10::SymInt& m = mask.sym_size(-i);
      ok = m == 1 || m == target[target.size() - i];
    }
    TORCH_CHECK(ok, kOp, ": attn_mask of shape ", shape_str(mask.sym_sizes()),
                " is not broadcastable to the attention shape (..., H, L, S) = ",
                shape_str(target));
  }
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, kOp,
              ": dropout_p must be in [0, 1), got ", dropout_p);
  if (scale.has_value()) {
    TORCH_CHECK(std::isfinite(*scale) && *scale >= 0.0, kOp,
                ": scale must be a finite number >= 0, got ", *scale);
  }
}

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
                                     bool enable_gqa) {
  constexpr const char* kBwd = "fusedmha.attention_backward";
  check_attention_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
  check_saved_state(kBwd, query, key, value, logsumexp, rng_state, enable_gqa);
  const at::Tensor expected_out = std::get<0>(allocate_attention_outputs(
      query.to(at::kMeta), key.to(at::kMeta), value.to(at::kMeta), enable_gqa));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"grad_out", &grad_out},
                                {"out", &out}}) {
    TORCH_CHECK(t->sym_sizes() == expected_out.sym_sizes(), kBwd, ": expected ", name,
                " of the forward output's shape ", shape_str(expected_out.sym_sizes()), ", got ",
                shape_str(t->sym_sizes()));
    TORCH_CHECK(t->scalar_type() == query.scalar_type() && t->device() == query.device(), kBwd,
                ": expected ", name, " of dtype ", query.scalar_type(), " on ", query.device(),
                ", got ", t->scalar_type(), " on ", t->device());
  }
}

void check_attention_weights_inputs(const at::Tensor& query,
                                    const at::Tensor& key,
                                    const at::Tensor& logsumexp,
                                    const at::Tensor& rng_state,
                                    const std::optional<at::Tensor>& attn_mask,
                                    double dropout_p,
                                    bool is_causal,
                                    std::optional<double> scale,
                                    bool enable_gqa) {
  check_attention_inputs(query, key, key, attn_mask, dropout_p, is_causal, scale, enable_gqa);
  check_saved_state("fusedmha.attention_weights", query, key, key, logsumexp, rng_state,
                    enable_gqa);
}

at::Tensor allocate_attention_weights(const at::Tensor& query,
                                      const at::Tensor& key,
                                      bool enable_gqa,
                                      bool average_heads) {
  std::vector<c10::SymInt> shape = attention_outer_shape(query, key, key, enable_gqa);
  if (average_heads || std::max(query.dim(), key.dim()) == 2) shape.pop_back();
  shape.push_back(query.sym_size(-2));
  shape.push_back(key.sym_size(-2));
  return at::empty_symint(shape, query.options());
}

at::Tensor reduce_to_input(at::Tensor grad, const at::Tensor& input) {
  if (input.dim() >= 3) {
    // Query heads that share one key/value head (GQA) are adjacent.
    const int64_t h_in = input.size(-3), h_out = grad.size(-3);
    if (h_in != 1 && h_in != h_out) {
      std::vector<int64_t> grouped(grad.sizes().begin(), grad.sizes().end() - 3);
      grouped.insert(grouped.end(), {h_in, h_out / h_in, grad.size(-2), grad.size(-1)});
      grad = grad.view(grouped).sum(-3);
    }
  }
  return at::sum_to(grad, input.sizes()).to(input.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_attention_outputs(const at::Tensor& query,
                                                              const at::Tensor& key,
                                                              const at::Tensor& value,
                                                              bool enable_gqa) {
  std::vector<c10::SymInt> outer = attention_outer_shape(query, key, value, enable_gqa);
  const c10::SymInt len_q = query.sym_size(-2);
  const c10::SymInt dim_v = value.sym_size(-1);
  const int64_t rank = std::max({query.dim(), key.dim(), value.dim()});
  const auto lse_dtype = query.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;

  std::vector<c10::SymInt> lse_shape = outer;
  lse_shape.push_back(len_q);
  if (rank == 2) lse_shape.erase(lse_shape.begin());  // no head dim
  at::Tensor lse = at::empty_symint(lse_shape, query.options().dtype(lse_dtype));

  // Like PyTorch's SDPA, the output follows the query's layout: (..., L, H,
  // Ev) memory when the query's heads are interleaved within its rows (the
  // (B, L, H, E) projection viewed as (B, H, L, E)), else contiguous.
  at::Tensor out;
  if (rank >= 3 && query.dim() >= 3 && query.sym_stride(-3) < query.sym_stride(-2)) {
    std::vector<c10::SymInt> physical(outer.begin(), outer.end() - 1);
    physical.push_back(len_q);
    physical.push_back(outer.back());
    physical.push_back(dim_v);
    out = at::empty_symint(physical, query.options()).transpose(-2, -3);
  } else {
    std::vector<c10::SymInt> out_shape = lse_shape;
    out_shape.push_back(dim_v);
    out = at::empty_symint(out_shape, query.options());
  }
  at::Tensor rng_state = at::empty({2}, query.options().dtype(at::kLong));
  return {out, lse, rng_state};
}

double attention_scale(const at::Tensor& query, std::optional<double> scale) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(query.size(-1)));
}

}  // namespace fusedmha::ops
