// CPU kernel of fusedmha::attention_forward: checks the tensors, describes
// them to the ISA-specific kernels as plain pointers/offsets/strides,
// allocates the outputs and shares the work items among the threads.

#include "cpu/attention_params.h"
#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "ops/attention_checks.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <vector>

namespace fusedmha::cpu {
namespace {

struct IsaKernels {
  size_t (*configure)(ForwardParams&);
  void (*items)(const ForwardParams&, int64_t, int64_t, void*);
};

IsaKernels kernels_for(IsaLevel level) {
  switch (level) {
#if FUSEDMHA_CPU_X86
    case IsaLevel::Avx512: return {AVX512::forward_configure, AVX512::forward_items};
    case IsaLevel::Avx2: return {AVX2::forward_configure, AVX2::forward_items};
#endif
    default: return {DEFAULT::forward_configure, DEFAULT::forward_items};
  }
}

DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return DType::Float64;
    case at::kBFloat16: return DType::BFloat16;
    case at::kHalf: return DType::Float16;
    default: return DType::Float32;
  }
}

// Element offset of the (rows, cols) matrix that each outer index (batch
// dims..., head of the output) reads in t, whose dims are (..., H_t, rows,
// cols) or just (rows, cols). Dims t lacks or has as size 1 broadcast; a
// head count that divides the output's maps head h to h / (H / H_t) (GQA).
std::vector<int64_t> outer_offsets(const at::Tensor& t, c10::IntArrayRef outer) {
  const int64_t n = static_cast<int64_t>(outer.size());
  std::vector<int64_t> size(n, 1), stride(n, 0);
  for (int64_t d = 0; d < n; ++d) {
    const int64_t td = t.dim() - 2 - (n - d);  // t's dim aligned with outer dim d
    if (td >= 0 && t.size(td) != 1) {
      size[d] = t.size(td);
      stride[d] = t.stride(td);
    }
  }
  int64_t total = 1;
  for (const int64_t s : outer) total *= s;
  std::vector<int64_t> offsets(total);
  std::vector<int64_t> index(n, 0);
  for (int64_t o = 0; o < total; ++o) {
    int64_t off = 0;
    for (int64_t d = 0; d < n; ++d) {
      if (size[d] == 1) continue;
      const int64_t group = outer[d] / size[d];  // 1 unless GQA heads
      off += (index[d] / group) * stride[d];
    }
    offsets[o] = off;
    for (int64_t d = n - 1; d >= 0 && ++index[d] == outer[d]; --d) index[d] = 0;
  }
  return offsets;
}

// Row/col strides of the last two dims; a size-1 dim broadcasts (stride 0).
int64_t broadcast_stride(const at::Tensor& t, int64_t dim) {
  if (t.dim() < -dim || t.size(dim) == 1) return 0;
  return t.stride(dim);
}

at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(const at::Tensor& query_in,
                                                         const at::Tensor& key_in,
                                                         const at::Tensor& value_in,
                                                         const std::optional<at::Tensor>& attn_mask,
                                                         double dropout_p,
                                                         bool is_causal,
                                                         std::optional<double> scale,
                                                         bool enable_gqa) {
  ops::check_attention_inputs(query_in, key_in, value_in, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa);
  auto [out, lse] = ops::allocate_attention_outputs(query_in, key_in, value_in, enable_gqa);
  const at::Tensor query = last_dim_contiguous(query_in);
  const at::Tensor key = last_dim_contiguous(key_in);
  const at::Tensor value = last_dim_contiguous(value_in);

  std::vector<int64_t> outer;
  for (const c10::SymInt& s : ops::attention_outer_shape(query, key, value, enable_gqa)) {
    outer.push_back(s.expect_int());
  }
  const std::vector<int64_t> q_off = outer_offsets(query, outer);
  const std::vector<int64_t> k_off = outer_offsets(key, outer);
  const std::vector<int64_t> v_off = outer_offsets(value, outer);
  const std::vector<int64_t> o_off = outer_offsets(out, outer);

  ForwardParams p;
  p.dtype = dtype_of(query.scalar_type());
  p.outer = static_cast<int64_t>(q_off.size());
  p.len_q = query.size(-2);
  p.len_kv = key.size(-2);
  p.dim_qk = query.size(-1);
  p.dim_v = value.size(-1);
  p.q = {query.const_data_ptr(), q_off.data(), query.stride(-2), 1};
  p.k = {key.const_data_ptr(), k_off.data(), key.stride(-2), 1};
  p.v = {value.const_data_ptr(), v_off.data(), value.stride(-2), 1};
  std::vector<int64_t> m_off;
  if (attn_mask.has_value()) {
    const at::Tensor& mask = *attn_mask;
    m_off = outer_offsets(mask, outer);
    p.mask = {mask.const_data_ptr(), m_off.data(), broadcast_stride(mask, -2),
              broadcast_stride(mask, -1)};
    p.mask_kind = mask.scalar_type() == at::kBool             ? MaskKind::Bool
                  : mask.scalar_type() == query.scalar_type() ? MaskKind::Additive
                                                              : MaskKind::AdditiveFloat32;
  }
  p.scale = ops::attention_scale(query, scale);
  p.is_causal = is_causal;
  p.out = out.mutable_data_ptr();
  p.out_offsets = o_off.data();
  p.out_row_stride = out.stride(-2);
  p.lse = lse.mutable_data_ptr();

  p.num_threads = at::in_parallel_region() ? 1 : at::get_num_threads();

  const IsaKernels kernels = kernels_for(selected_isa());
  const size_t workspace_bytes = kernels.configure(p);
  const int64_t n_items = num_work_items(p);
  if (n_items == 0) return {out, lse};

  // Items are handed out one at a time from a shared counter, costliest
  // first (the last query blocks of a causal row see the most keys), so the
  // threads finish together even when items differ in cost.
  std::atomic<int64_t> next{0};
  const int64_t n_threads = std::min<int64_t>(p.num_threads, n_items);
  at::parallel_for(0, n_threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      // Cache-line aligned, so that full-width vector accesses do not
      // straddle lines.
      const std::unique_ptr<void, decltype(&std::free)> workspace(
          std::aligned_alloc(64, (workspace_bytes + 63) / 64 * 64 + 64), &std::free);
      TORCH_CHECK(workspace != nullptr, "fusedmha: could not allocate ", workspace_bytes,
                  " bytes of kernel workspace");
      for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
        const int64_t item = n_items - 1 - i;
        kernels.items(p, item, item + 1, workspace.get());
      }
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CPU, m) {
  m.impl("attention_forward", TORCH_FN(attention_forward_cpu));
}

}  // namespace fusedmha::cpu
