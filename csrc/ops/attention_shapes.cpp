#include "ops/attention_shapes.h"
#include "ops/quick_views.h"

#include <ATen/ExpandUtils.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/irange.h>

#include <cmath>
#include <limits>
#include <sstream>

namespace fusedmha::ops {
namespace {

// Head count of a (..., H, rows, cols) input; a 2-D input has one head.
c10::SymInt heads_of(const at::Tensor& t) {
  return t.dim() >= 3 ? t.sym_size(-3) : c10::SymInt(1);
}

}  // namespace

std::string shape_str(c10::SymIntArrayRef sizes) {
  std::ostringstream os;
  os << sizes;
  return os.str();
}

std::vector<c10::SymInt> attention_outer_shape(const char* op,
                                               const at::Tensor& query,
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
      TORCH_CHECK(dst == 1 || dst == size, op,
                  ": the batch dims of query, key and value must be broadcastable, got query ",
                  shape_str(query.sym_sizes()), ", key ", shape_str(key.sym_sizes()), ", value ",
                  shape_str(value.sym_sizes()));
      dst = size;
    }
  }
  const c10::SymInt hq = heads_of(query), hk = heads_of(key), hv = heads_of(value);
  if (enable_gqa) {
    TORCH_CHECK(hk != 0 && hv != 0, op,
                ": with enable_gqa=True key and value need at least one head, got ", hk, " and ",
                hv);
    TORCH_CHECK(hq % hk == 0 && hq % hv == 0, op,
                ": with enable_gqa=True the number of heads in key (", hk, ") and value (", hv,
                ") must divide the number of heads in query (", hq, ")");
    outer[n_batch] = hq;
  } else {
    c10::SymInt h = 1;
    for (const c10::SymInt& x : {hq, hk, hv}) {
      if (x == 1) continue;
      TORCH_CHECK(h == 1 || h == x, op,
                  ": query, key and value must have the same number of heads (or 1), got ", hq,
                  ", ", hk, " and ", hv, "; pass enable_gqa=True for grouped-query attention");
      h = x;
    }
    outer[n_batch] = h;
  }
  return outer;
}

int64_t attention_query_rows(const char* op, const at::Tensor& query, const at::Tensor& key,
                             const at::Tensor& value, bool enable_gqa) {
  int64_t rows = query.size(-2);
  for (const c10::SymInt& size : attention_outer_shape(op, query, key, value, enable_gqa)) {
    rows *= size.expect_int();
  }
  return rows;
}

at::Tensor allocate_attention_weights(const at::Tensor& query,
                                      const at::Tensor& key,
                                      bool enable_gqa,
                                      bool average_heads) {
  std::vector<c10::SymInt> shape = attention_outer_shape("fusedmha", query, key, key, enable_gqa);
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
  std::vector<c10::SymInt> outer = attention_outer_shape("fusedmha", query, key, value, enable_gqa);
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
    // (quick: the transposed tensor is the storage's only owner once returned)
    const at::Tensor memory = at::empty_symint(physical, query.options());
    out = quick_transpose(memory, memory.dim() - 2, memory.dim() - 3);
  } else {
    std::vector<c10::SymInt> out_shape = lse_shape;
    out_shape.push_back(dim_v);
    out = at::empty_symint(out_shape, query.options());
  }
  at::Tensor rng_state = at::empty({2}, query.options().dtype(at::kLong));
  return {out, lse, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_varlen_outputs(
    const at::Tensor& query, const at::Tensor& value, std::optional<int64_t> written_rows) {
  const auto lse_dtype = query.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto options = query.options();
  if (written_rows.has_value()) {
    at::Tensor out = at::empty({query.size(0), query.size(1), value.size(-1)}, options);
    at::Tensor lse = at::empty({query.size(1), query.size(0)}, options.dtype(lse_dtype));
    // (Only where rows are left: each op adds to a decoding step's fixed
    // cost from cold caches, docs/performance.md, "A decoding call's fixed
    // cost". The kernel that writes the rows writes rng_state too.)
    if (*written_rows < query.size(0)) {
      out.narrow(0, *written_rows, query.size(0) - *written_rows).zero_();
      lse.narrow(1, *written_rows, query.size(0) - *written_rows)
          .fill_(std::numeric_limits<double>::infinity());
    }
    return {out, lse, at::empty({2}, options.dtype(at::kLong))};
  }
  at::Tensor out = at::zeros_symint({query.sym_size(0), query.sym_size(1), value.sym_size(-1)},
                                    options);
  at::Tensor lse = at::full_symint({query.sym_size(1), query.sym_size(0)},
                                   std::numeric_limits<double>::infinity(),
                                   options.dtype(lse_dtype));
  at::Tensor rng_state = at::zeros({2}, options.dtype(at::kLong));
  return {out, lse, rng_state};
}

namespace {

// The mask's sizes with its expanded dims (stride 0, size > 1) as 1, and
// how many elements each summed element stands for.
std::pair<std::vector<c10::SymInt>, c10::SymInt> mask_sum_shape(const at::Tensor& mask) {
  std::vector<c10::SymInt> sizes(mask.sym_sizes().begin(), mask.sym_sizes().end());
  c10::SymInt shared = 1;
  for (int64_t d = 0; d < mask.dim(); ++d) {
    if (mask.sym_stride(d) == 0 && sizes[d] != 1) shared *= sizes[d], sizes[d] = 1;
  }
  return {sizes, shared};
}

}  // namespace

std::vector<c10::SymInt> mask_gradient_sums_shape(const at::Tensor& mask) {
  return mask_sum_shape(mask).first;
}

at::Tensor allocate_mask_gradient_sums(const at::Tensor& mask, at::ScalarType dtype) {
  return at::zeros_symint(mask_sum_shape(mask).first, mask.options().dtype(dtype));
}

double mask_gradient_scale(const at::Tensor& mask) {
  return 1.0 / static_cast<double>(mask_sum_shape(mask).second.expect_int());
}

at::Tensor scaled_mask_gradient_sums(const at::Tensor& sums, const at::Tensor& mask) {
  const c10::SymInt shared = mask_sum_shape(mask).second;
  return shared == 1 ? sums : sums.div(c10::Scalar(shared));
}

at::Tensor mask_gradient(const at::Tensor& mask, const std::optional<at::Tensor>& sums) {
  at::Tensor grad =
      sums.has_value() ? *sums : at::empty_symint(mask_sum_shape(mask).first, mask.options());
  return grad.to(mask.scalar_type()).expand_symint(mask.sym_sizes());
}

double attention_scale(const at::Tensor& query, std::optional<double> scale) {
  if (scale.has_value()) return *scale;
  const int64_t dim = query.size(-1);
  return dim == 0 ? 0.0 : 1.0 / std::sqrt(static_cast<double>(dim));
}

}  // namespace fusedmha::ops
