#include "cpu/launch.h"

#include "cpu/isa.h"
#include "ops/attention_checks.h"
#include "ops/kernel_inputs.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <memory>

namespace fusedmha::cpu {

IsaKernels selected_kernels() {
#define FUSEDMHA_KERNELS(LEVEL)                                                    \
  IsaKernels {                                                                     \
    LEVEL::forward_configure, LEVEL::forward_items, LEVEL::backward_configure,     \
        LEVEL::backward_items, LEVEL::weights_configure, LEVEL::weights_items      \
  }
  switch (selected_isa()) {
#if FUSEDMHA_CPU_X86
    case IsaLevel::Avx512: return FUSEDMHA_KERNELS(AVX512);
    case IsaLevel::Avx2: return FUSEDMHA_KERNELS(AVX2);
#endif
    default: return FUSEDMHA_KERNELS(DEFAULT);
  }
#undef FUSEDMHA_KERNELS
}

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

AttentionInputs::AttentionInputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const std::optional<at::Tensor>& attn_mask, bool is_causal,
                                 std::optional<double> scale, bool enable_gqa)
    : query(ops::last_dim_contiguous(q)), key(ops::last_dim_contiguous(k)), value(ops::last_dim_contiguous(v)) {
  for (const c10::SymInt& s : ops::attention_outer_shape(query, key, value, enable_gqa)) {
    outer_shape.push_back(s.expect_int());
  }
  ForwardParams& p = params;
  p.dtype = ops::dtype_of(query.scalar_type());
  p.len_q = query.size(-2);
  p.len_kv = key.size(-2);
  p.dim_qk = query.size(-1);
  p.dim_v = value.size(-1);
  p.q = view(query);
  p.k = view(key);
  p.v = view(value);
  p.outer = static_cast<int64_t>(offsets_.front().size());
  if (attn_mask.has_value()) {
    const at::Tensor& mask = *attn_mask;
    p.mask = view(mask);
    p.mask.row_stride = ops::broadcast_stride(mask, -2);
    p.mask.col_stride = ops::broadcast_stride(mask, -1);
    p.mask_kind = ops::mask_kind_of(mask, query);
  }
  p.scale = ops::attention_scale(query, scale);
  p.is_causal = is_causal;
  p.num_threads = available_threads();
}

MatrixView AttentionInputs::view(const at::Tensor& t) {
  offsets_.push_back(outer_offsets(t, outer_shape));
  return {t.const_data_ptr(), offsets_.back().data(), ops::broadcast_stride(t, -2), 1};
}

void replay_dropout(ForwardParams& p, const at::Tensor& rng_state, double dropout_p) {
  if (dropout_p <= 0) return;
  const at::Tensor state = rng_state.cpu();
  p.dropout_p = dropout_p;
  p.dropout_threshold = dropout_threshold(dropout_p);
  p.dropout.seed = static_cast<uint64_t>(state[0].item<int64_t>());
  p.dropout.offset = static_cast<uint64_t>(state[1].item<int64_t>());
}

int64_t available_threads() {
  return at::in_parallel_region() ? 1 : at::get_num_threads();
}

void run_items_in_parallel(int64_t n_items, size_t workspace_bytes,
                           const std::function<void(int64_t, void*)>& run) {
  if (n_items <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t n_threads = std::min<int64_t>(available_threads(), n_items);
  at::parallel_for(0, n_threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      // Cache-line aligned, so full-width vector accesses do not straddle lines.
      const std::unique_ptr<void, decltype(&std::free)> workspace(
          std::aligned_alloc(64, (workspace_bytes + 63) / 64 * 64 + 64), &std::free);
      TORCH_CHECK(workspace != nullptr, "fusedmha: could not allocate ", workspace_bytes,
                  " bytes of kernel workspace");
      for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
        run(n_items - 1 - i, workspace.get());
      }
    }
  });
}

}  // namespace fusedmha::cpu
