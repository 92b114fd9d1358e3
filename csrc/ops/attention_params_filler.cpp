#include "ops/attention_params_filler.h"

#include "cuda/flash_config.h"
#include "ops/attention_checks.h"
#include "ops/attention_shapes.h"
#include "ops/kv_quantization.h"
#include "ops/mask_structure.h"
#include "ops/mask_tiles.h"
#include "ops/quick_views.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace fusedmha::ops {
namespace {

// Stride of one of the last two dims (-1 or -2); a missing or size-1 dim
// broadcasts (stride 0).
int64_t broadcast_stride(c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t dim) {
  const int64_t n = static_cast<int64_t>(sizes.size());
  if (n < -dim || sizes[n + dim] == 1) return 0;
  return strides[n + dim];
}

int64_t broadcast_stride(const at::Tensor& t, int64_t dim) {
  return broadcast_stride(t.sizes(), t.strides(), dim);
}

}  // namespace

DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return DType::Float64;
    case at::kBFloat16: return DType::BFloat16;
    case at::kHalf: return DType::Float16;
    default: return DType::Float32;
  }
}

MaskKind mask_kind_of(const at::Tensor& mask, const at::Tensor& query) {
  if (mask.scalar_type() == at::kBool) return MaskKind::Bool;
  return mask.scalar_type() == query.scalar_type() ? MaskKind::Additive : MaskKind::AdditiveFloat32;
}

at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

namespace {

// Whether one query row per sequence with h = G·h_kv heads may be read as G
// rows of one item per K/V head: G > 1, and nothing tells those rows apart
// by position or head.
bool one_row_heads_pack(int64_t h, int64_t h_kv, bool is_causal, const AttentionVariants& v,
                        double dropout_p) {
  if (dropout_p > 0 || h_kv == 0 || h <= h_kv || h % h_kv != 0) return false;
  if (v.alibi_slopes.has_value() || v.sinks.has_value() || v.window_left >= 0) return false;
  // With one query row, a bottom-right diagonal is the last key: a causal mask
  // or right window around it hides nothing.
  return !(is_causal || v.window_right >= 0) || v.bottom_right;
}

// Of g query heads per K/V head, how many to pack as rows of one item: the
// most that divide g and are at most most_rows (1: none).
int64_t packed_group(int64_t g, int64_t most_rows) {
  int64_t group = std::min(g, std::max<int64_t>(most_rows, 1));
  while (g % group != 0) --group;
  return group;
}

}  // namespace

bool packs_query_heads(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const std::optional<at::Tensor>& attn_mask, bool is_causal,
                       const AttentionVariants& v, double dropout_p) {
  if (query.dim() < 3 || key.dim() < 3 || value.dim() < 3 || query.size(-2) != 1) return false;
  if (value.size(-3) != key.size(-3)) return false;
  if (!one_row_heads_pack(query.size(-3), key.size(-3), is_causal, v, dropout_p)) return false;
  // (A per-head mask (..., H, 1, S) is read as rows too: describe_packed.)
  return !attn_mask.has_value() || attn_mask->dim() < 3 || attn_mask->size(-3) == 1 ||
         attn_mask->size(-3) == query.size(-3);
}

bool packs_query_heads(const at::Tensor& query, const at::Tensor& key, const PackedBatch& batch,
                       bool is_causal, const AttentionVariants& v, double dropout_p) {
  const int64_t b = batch.cu_seqlens_q.size(0) - 1;
  const int64_t h_kv = key.size(batch.block_table.has_value() ? 2 : 1);
  if (!query.is_cpu() || query.size(0) != b || b < 1) return false;
  if (!one_row_heads_pack(query.size(1), h_kv, is_causal, v, dropout_p)) return false;
  // (one query row per sequence: cu_seqlens_q = 0, 1, .., B; read in place)
  const at::Tensor cu = batch.cu_seqlens_q.contiguous();
  const int32_t* row = cu.const_data_ptr<int32_t>();
  for (int64_t i = 0; i <= b; ++i) {
    if (row[i] != i) return false;
  }
  return true;
}

std::pair<at::Tensor, bool> start_weights(const WeightsArgs& a) {
  check_weights_inputs(kWeightsOp, a);
  at::Tensor weights = allocate_attention_weights(a.query, a.key, a.enable_gqa, a.average_heads);
  if (weights.numel() == 0) return {weights, false};
  if (attention_query_rows(kWeightsOp, a.query, a.key, a.key, a.enable_gqa) == 0 ||
      a.key.size(-2) == 0) {
    return {weights.zero_(), false};
  }
  return {weights, true};
}

AttentionCall::AttentionCall(const char* op, const at::Tensor& query, const at::Tensor& key,
                             const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                             bool is_causal, std::optional<double> scale, bool enable_gqa,
                             const AttentionVariants& variants, double dropout_p,
                             RowLayout layout, bool pack_query_heads,
                             int64_t most_packed_rows)
    : op_(op), query_(query), layout_(layout) {
  for (const c10::SymInt& s : attention_outer_shape(op, query, key, value, enable_gqa)) {
    outer_shape_.push_back(s.expect_int());
  }
  const bool pack = pack_query_heads &&
                    packs_query_heads(query, key, value, attn_mask, is_causal, variants, dropout_p);
  if (pack) {
    group_ = packed_group(query.size(-3) / key.size(-3), most_packed_rows);
    outer_shape_.back() /= group_;  // the K/V heads (or a share of each one's query heads)
  }
  set_outer_shape(op);
  AttentionParams& p = inputs_;
  p.dtype = dtype_of(query.scalar_type());
  p.len_q = query.size(-2) * group_;
  p.len_kv = key.size(-2);
  p.dim_qk = query.size(-1);
  p.dim_v = value.size(-1);
  p.q = describe_in_layout(query, true);
  p.k = describe_in_layout(key, false);
  p.v = describe_in_layout(value, false);
  set_variants(is_causal, scale, variants);
  if (attn_mask.has_value() && !use_mask_structure(*attn_mask)) {
    // (Packed heads with a mask per head: each head's mask row is a row of
    // the item's tile, as the queries are, so such a mask does not stop the
    // query heads of a K/V head from sharing one read of its K/V:
    // docs/performance.md, "Decode packing".)
    const bool per_head = attn_mask->dim() >= 3 && attn_mask->size(-3) > 1;
    p.mask = group_ > 1 && per_head ? describe_packed(*attn_mask) : describe(*attn_mask);
    p.mask_kind = mask_kind_of(*attn_mask, query);
    use_mask_tiles(*attn_mask);
  }
  if (group_ > 1) p.window_right = -1;  // (one bottom-right query row: it hides nothing)
}

AttentionCall::AttentionCall(const char* op, const at::Tensor& query, const at::Tensor& key,
                             const at::Tensor& value, const PackedBatch& batch, bool is_causal,
                             std::optional<double> scale, const AttentionVariants& variants,
                             double dropout_p, RowLayout layout, int64_t most_packed_rows)
    : op_(op), query_(query), layout_(layout), packed_batch_(true) {
  outer_shape_ = {batch.cu_seqlens_q.size(0) - 1, query.size(1)};
  if (packs_query_heads(query, key, batch, is_causal, variants, dropout_p)) {
    group_ = packed_group(query.size(1) / key.size(batch.block_table.has_value() ? 2 : 1),
                          most_packed_rows);
    outer_shape_.back() /= group_;  // the K/V heads (or a share of each one's query heads)
  }
  set_outer_shape(op);
  AttentionParams& p = inputs_;
  p.dtype = dtype_of(query.scalar_type());
  // Items cover the longest sequence (no longer than all the rows); decoding
  // with packed heads, the G query heads of a K/V head are its rows.
  p.len_q = group_ > 1 ? group_ : std::min(batch.max_seqlen_q, query.size(0));
  p.dim_qk = query.size(-1);
  p.dim_v = value.size(-1);
  p.q = describe_in_layout(query, true);
  if (batch.block_table.has_value()) {
    // (num_pages, page_size, H_kv, E): the rows of one page, pages apart.
    const at::Tensor& table = *batch.block_table;
    p.len_kv = std::min(batch.max_seqlen_k, table.size(1) * key.size(1));
    p.pages.table = table.const_data_ptr<int32_t>();
    p.pages.table_stride = table.stride(0);
    p.pages.size = key.size(1);
    const at::Tensor k = layout_(key), v = layout_(value);
    kept_.insert(kept_.end(), {k, v});
    if (k.size(0) > 0) {  // (no pages: every sequence is empty, nothing is read)
      p.k = describe_rows(quick_first(k), false);
      p.v = describe_rows(quick_first(v), false);
    }
    p.k.data = const_cast<void*>(k.const_data_ptr());
    p.v.data = const_cast<void*>(v.const_data_ptr());
    p.pages.page_stride_k = k.stride(0);
    p.pages.page_stride_v = v.stride(0);
  } else {
    p.len_kv = std::min(batch.max_seqlen_k, key.size(0));
    p.k = describe_in_layout(key, false);
    p.v = describe_in_layout(value, false);
  }
  if (batch.k_scale.has_value()) {
    // Quantized K/V: each scale tensor (k's and v's shape without the last
    // dim) read as one-column rows laid out as k's and v's, pages alike.
    p.kv_storage = kv_storage_of(key.scalar_type());
    const bool paged = batch.block_table.has_value();
    auto describe_scales = [&](const at::Tensor& s) {
      const at::Tensor column = s.unsqueeze(-1);
      Matrix m;  // (no pages: nothing is read)
      if (!paged || s.size(0) > 0) {
        m = describe_rows(paged ? quick_first(column) : column, false);
      }
      m.data = const_cast<void*>(s.const_data_ptr());
      return m;
    };
    p.k_scale = describe_scales(*batch.k_scale);
    p.v_scale = describe_scales(*batch.v_scale);
    if (paged) {
      p.pages.page_stride_k_scale = batch.k_scale->stride(0);
      p.pages.page_stride_v_scale = batch.v_scale->stride(0);
    }
  }
  // (Packed heads: sequence b's query row is row b, a batch dim of its own.)
  if (group_ == 1) p.seq.cu_q = batch.cu_seqlens_q.const_data_ptr<int32_t>();
  p.seq.cu_k = batch.cu_seqlens_k.const_data_ptr<int32_t>();
  if (batch.seqused_k.has_value()) p.seq.used_k = batch.seqused_k->const_data_ptr<int32_t>();
  p.seq.heads = outer_shape_[1];
  key_rows_ = key.size(0);
  set_variants(is_causal, scale, variants);
  if (group_ > 1) p.window_right = -1;  // (one bottom-right query row: it hides nothing)
}

void AttentionCall::set_outer_shape(const char* op) {
  // Outer dims of size 1 take no part in the kernels' indexing.
  AttentionParams& p = inputs_;
  p.num_outer = 1;
  for (const int64_t size : outer_shape_) {
    p.num_outer *= size;
    if (size == 1) continue;
    TORCH_CHECK(p.outer.dims < kMaxOuterDims, op, ": at most ", kMaxOuterDims,
                " batch and head dims of size > 1 are supported, got the attention shape ",
                c10::IntArrayRef(outer_shape_));
    p.outer.size[p.outer.dims++] = size;
  }
}

void AttentionCall::set_variants(bool is_causal, std::optional<double> scale,
                                 const AttentionVariants& variants) {
  AttentionParams& p = inputs_;
  p.scale = attention_scale(query_, scale);
  p.softcap = variants.softcap;
  p.bottom_right = variants.bottom_right;
  p.diagonal_offset = variants.bottom_right ? p.len_kv - p.len_q : 0;
  p.window_left = variants.window_left;
  p.window_right = is_causal ? 0 : variants.window_right;  // causal: nothing right of the diagonal
  if (variants.alibi_slopes.has_value()) p.alibi_slopes = describe_per_head(*variants.alibi_slopes);
  if (variants.sinks.has_value()) p.sinks = describe_per_head(*variants.sinks);
}

bool AttentionCall::use_mask_structure(const at::Tensor& mask) {
  AttentionParams& p = inputs_;
  // Key spans are a field of the CPU kernels only (uses_cpu_only_fields).
  if (!query_.is_cpu()) return false;
  // (An empty call has no rows to scan, and no batch to split spans by.)
  if (p.num_outer == 0 || p.len_q == 0 || p.len_kv == 0) return false;
  // A band from the mask only where the call has none, and nothing else
  // reads the diagonal (ALiBi's distances); packed heads are one query row.
  const bool with_band = !has_band(p) && !p.alibi_slopes.data && group_ == 1;
  const std::optional<MaskStructure> s = find_mask_structure(
      mask, outer_shape_, p.len_q, p.len_kv, with_band, /*lowest_hides=*/!has_band(p));
  if (!s) return false;
  const int64_t batches = static_cast<int64_t>(s->spans.size()) / 2;
  TORCH_INTERNAL_ASSERT(batches > 0, "find_mask_structure: a span per batch index, at least one");
  at::Tensor spans = at::empty({2 * batches}, mask.options().dtype(at::kLong));
  std::copy(s->spans.begin(), s->spans.end(), spans.mutable_data_ptr<int64_t>());
  kept_.push_back(spans);
  p.key_spans = kept_.back().const_data_ptr<int64_t>();
  // (Outer indices per batch index; one span: every outer index's.)
  p.key_spans_group = std::max<int64_t>(p.num_outer / batches, 1);
  if (s->diagonal) {
    // (bottom_right would recompute the diagonal for packed sequences.)
    p.diagonal_offset = *s->diagonal, p.window_right = 0, p.bottom_right = false;
  }
  if (s->window_left) p.window_left = *s->window_left;
  return true;
}

void AttentionCall::use_mask_tiles(const at::Tensor& mask) {
  AttentionParams& p = inputs_;
  // (Packed query heads read a mask's rows as rows of other heads.)
  if (group_ > 1 || p.num_outer == 0) return;
  // On other devices only for CUDA's tensor-core kernels, the ones that read
  // the tiles there: 16-bit inputs, head dims up to kFlashMaxHeadDim.
  const bool half = query_.scalar_type() == at::kHalf || query_.scalar_type() == at::kBFloat16;
  const bool flash_dims = std::max(p.dim_qk, p.dim_v) <= cuda::kFlashMaxHeadDim;
  if (!query_.is_cpu() && !(half && flash_dims)) return;
  std::optional<MaskTiles> t = find_mask_tiles(mask, p.len_q, p.len_kv);
  if (!t || !t->any_uniform) return;
  if (t->all_visible && p.mask_kind == MaskKind::Bool) {
    p.mask = Matrix{}, p.mask_kind = MaskKind::None;
    return;
  }
  kept_.push_back(t->states);
  p.mask_tiles = describe(kept_.back());
}

Matrix AttentionCall::describe_packed(const at::Tensor& t, bool as_column) const {
  // (..., H, 1, cols) read as (..., H_kv, G, cols), or with as_column t
  // (..., H, 1) as (..., H_kv, G, 1): sizes and strides only. (As views,
  // the tensors made per call each went through the dispatcher, a
  // noticeable part of a decoding step from cold caches:
  // docs/performance.md, "A decoding call's fixed cost".)
  c10::SmallVector<int64_t, 8> sizes(t.sizes().begin(), t.sizes().end());
  c10::SmallVector<int64_t, 8> strides(t.strides().begin(), t.strides().end());
  if (as_column) sizes.push_back(1), strides.push_back(1);
  if (group_ > 1) {
    const size_t n = sizes.size();  // (n >= 3: packed heads need a head dim)
    const int64_t heads = sizes[n - 3], head_stride = strides[n - 3];
    sizes[n - 3] = heads / group_, strides[n - 3] = head_stride * group_;
    sizes[n - 2] = group_, strides[n - 2] = head_stride;
  }
  return describe(t.const_data_ptr(), sizes, strides);
}

Matrix AttentionCall::describe_per_head(const at::Tensor& t) {
  // (..., H) read as (..., H, 1, 1): one "matrix" of one element per head.
  kept_.push_back(t.to(at::kDouble).contiguous());
  std::vector<int64_t> shape(kept_.back().sizes().begin(), kept_.back().sizes().end());
  shape.insert(shape.end(), {1, 1});
  return describe(kept_.back().view(shape));
}

Matrix AttentionCall::describe(const at::Tensor& t) const {
  return describe(t.const_data_ptr(), t.sizes(), t.strides());
}

Matrix AttentionCall::describe(const void* data, c10::IntArrayRef sizes,
                               c10::IntArrayRef strides) const {
  Matrix m;
  m.data = const_cast<void*>(data);
  const int64_t dims = static_cast<int64_t>(sizes.size());
  const int64_t n = static_cast<int64_t>(outer_shape_.size());
  int c = 0;  // the kernels' outer dim
  for (int64_t d = 0; d < n; ++d) {
    const int64_t size = outer_shape_[d];
    if (size == 1) continue;
    const int64_t td = dims - 2 - (n - d);  // the dim aligned with outer dim d
    m.divisor[c] = 1;
    if (td >= 0 && sizes[td] != 1) {
      m.outer_stride[c] = strides[td];
      // A head count that divides the output's is grouped-query: head h
      // reads h / (H / H_t). (Size 0: nothing is read.)
      m.divisor[c] = sizes[td] == 0 ? 1 : size / sizes[td];
    }
    ++c;
  }
  m.row_stride = broadcast_stride(sizes, strides, -2);
  m.col_stride = broadcast_stride(sizes, strides, -1);
  return m;
}

Matrix AttentionCall::describe_rows(const at::Tensor& t, bool query_rows) const {
  if (!packed_batch_) return query_rows ? describe_packed(t) : describe(t);
  // t (rows, heads, cols): the outer dims are (sequences, heads); a
  // sequence's rows are found through the params' Sequences, so the
  // sequence dim has stride 0. With packed query heads (one query row per
  // sequence), query-side rows are instead the G heads of a K/V head, and
  // row b is sequence b.
  const bool heads_as_rows = query_rows && group_ > 1;
  Matrix m;
  m.data = const_cast<void*>(t.const_data_ptr());
  int c = 0;
  if (outer_shape_[0] != 1) {
    if (heads_as_rows) m.outer_stride[c] = t.stride(0);
    ++c;
  }
  const int64_t heads = outer_shape_[1];
  if (heads != 1) {
    if (heads_as_rows) {
      m.outer_stride[c] = t.stride(1) * group_;
    } else if (t.size(1) != 1) {
      m.outer_stride[c] = t.stride(1);
      m.divisor[c] = heads / t.size(1);  // grouped-query heads
    }
    ++c;
  }
  m.row_stride = heads_as_rows ? t.stride(1) : t.stride(0);
  m.col_stride = broadcast_stride(t, -1);
  return m;
}

Matrix AttentionCall::describe_in_layout(const at::Tensor& t, bool query_rows) {
  const at::Tensor laid_out = layout_(t);
  if (!laid_out.is_same(t)) kept_.push_back(laid_out);
  return describe_rows(laid_out, query_rows);
}

Matrix AttentionCall::describe_lse(const at::Tensor& lse) {
  TORCH_INTERNAL_ASSERT(lse.is_contiguous());
  // (..., H, L) as (..., H, L, 1); (H, total_q) as (total_q, H, 1).
  if (packed_batch_) {
    return describe_rows(views_quickly(lse) ? strided_view(lse, {lse.size(1), lse.size(0), 1},
                                                           {lse.stride(1), lse.stride(0), 1})
                                            : lse.t().unsqueeze(-1),
                         true);
  }
  Matrix m = describe_packed(lse, /*as_column=*/true);
  m.row_stride = 1;  // (a single row may have been read as broadcast)
  return m;
}

DropoutParams AttentionCall::replay_dropout(const at::Tensor& rng_state, double dropout_p) {
  DropoutParams d;
  if (dropout_p <= 0) return d;
  d.p = dropout_p;
  d.threshold = dropout_threshold(dropout_p);
  if (rng_state.numel() == 4) {  // a part of a longer sequence: where it starts
    const at::Tensor position = rng_state.narrow(0, 2, 2).cpu();
    d.row_offset = position[0].item<int64_t>();
    d.col_offset = position[1].item<int64_t>();
    check_dropout_position(op_, d.row_offset, d.col_offset);
  }
  if (query_.is_cpu()) {
    const at::Tensor state = rng_state.cpu();
    d.seed = static_cast<uint64_t>(state[0].item<int64_t>());
    d.offset = static_cast<uint64_t>(state[1].item<int64_t>());
  } else {
    // (seed, offset) read where the kernel runs, so the host does not wait
    // for the device for them (a state on the CPU is copied there). The row
    // and column of a 4-element state, read above, are host values.
    kept_.push_back(rng_state.to(query_.device()));
    d.state_in = kept_.back().const_data_ptr<int64_t>();
  }
  return d;
}

AttentionParams AttentionCall::forward(const at::Tensor& out, const at::Tensor& lse) {
  AttentionParams p = inputs_;
  p.out = describe_rows(out, true);
  p.lse = describe_lse(lse);
  return p;
}

BackwardParams AttentionCall::backward(const at::Tensor& grad_out, const at::Tensor& out,
                                       const at::Tensor& logsumexp, const at::Tensor& rng_state,
                                       double dropout_p,
                                       const std::optional<at::Tensor>& grad_logsumexp,
                                       const std::optional<at::Tensor>& grad_mask,
                                       MaskSums mask_sums) {
  BackwardParams bp;
  bp.fwd = inputs_;
  bp.fwd.out = describe_in_layout(out, true);
  kept_.push_back(logsumexp.contiguous());
  bp.fwd.lse = describe_lse(kept_.back());
  bp.fwd.dropout = replay_dropout(rng_state, dropout_p);
  bp.grad_out = describe_in_layout(grad_out, true);
  if (grad_logsumexp.has_value()) {
    kept_.push_back(grad_logsumexp->to(logsumexp.scalar_type()).contiguous());
    bp.grad_lse = describe_lse(kept_.back());
  }
  if (grad_mask.has_value()) {
    // Allocated here, not with the other gradients: the backend's plan
    // reads which outer indices share its elements. Read like the mask
    // (its expanded dims now of size 1: broadcast).
    const at::ScalarType acc = query_.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    mask_sums_ = allocate_mask_gradient_sums(
        *grad_mask, mask_sums == MaskSums::kMaskDtype ? grad_mask->scalar_type() : acc);
    bp.grad_mask_float32 = mask_sums_->scalar_type() == at::kFloat;
    bp.grad_mask_scale = mask_gradient_scale(*grad_mask);
    const bool per_head = mask_sums_->dim() >= 3 && mask_sums_->size(-3) > 1;
    bp.grad_mask = group_ > 1 && per_head ? describe_packed(*mask_sums_) : describe(*mask_sums_);
  }
  return bp;
}

DenseGradients AttentionCall::allocate_gradients(BackwardParams& bp) const {
  const auto acc = query_.options().dtype(query_.scalar_type() == at::kDouble ? at::kDouble
                                                                              : at::kFloat);
  const AttentionParams& p = bp.fwd;
  DenseGradients g;
  if (packed_batch_) {
    // Rows no sequence covers get no gradient: zeroed, like the rest.
    const int64_t heads = outer_shape_[1];
    g.packed_batch = true;
    g.q = at::zeros({bp.grad_q_splits, query_.size(0), query_.size(1), p.dim_qk}, acc);
    g.k = at::zeros({key_rows_, heads, p.dim_qk}, acc);
    g.v = at::zeros({key_rows_, heads, p.dim_v}, acc);
  } else {
    std::vector<int64_t> shape = outer_shape_;
    shape.insert(shape.begin(), bp.grad_q_splits);
    shape.insert(shape.end(), {p.len_q, p.dim_qk});
    if (group_ > 1) {
      // Packed query heads: the same memory as (splits, ..., H, 1, E).
      std::vector<int64_t> unpacked = shape;
      unpacked.end()[-3] *= group_;
      unpacked.end()[-2] = 1;
      g.q = at::zeros(unpacked, acc);
    } else {
      g.q = at::zeros(shape, acc);
    }
    shape.erase(shape.begin());
    shape.end()[-2] = p.len_kv;
    g.k = at::empty(shape, acc);
    shape.back() = p.dim_v;
    g.v = at::empty(shape, acc);
  }
  bp.grad_q = describe_rows(g.q.select(0, 0), true);
  bp.grad_q_split_stride = g.q.stride(0);
  bp.grad_k = describe_rows(g.k, false);
  bp.grad_v = describe_rows(g.v, false);
  g.mask_sums = mask_sums_;
  return g;
}

void AttentionCall::compute_delta(BackwardParams& bp, const at::Tensor& grad_out,
                                  const at::Tensor& out,
                                  const std::optional<at::Tensor>& grad_logsumexp) {
  const auto acc = query_.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // (..., H, L), or (total_q, H) for a packed batch.
  at::Tensor delta = grad_out.to(acc).mul(out.to(acc)).sum(-1);
  if (packed_batch_) delta = delta.t();  // (H, total_q), as the lse
  if (grad_logsumexp.has_value()) delta = delta.sub(grad_logsumexp->to(acc));
  kept_.push_back(delta.contiguous());
  bp.delta = describe_lse(kept_.back());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> DenseGradients::reduced_to(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) const {
  const at::Tensor dq = q.size(0) == 1 ? q.select(0, 0) : q.sum(0);
  if (packed_batch) {
    // (rows, H, cols) per query head, summed over each K/V head's group.
    auto per_kv_head = [](const at::Tensor& g, const at::Tensor& input) {
      const int64_t h = g.size(1), h_kv = input.size(1);
      const at::Tensor summed = h == h_kv ? g : g.unflatten(1, {h_kv, h / h_kv}).sum(2);
      return summed.to(input.scalar_type());
    };
    return {dq.to(query.scalar_type()), per_kv_head(k, key), per_kv_head(v, value)};
  }
  return {reduce_to_input(dq, query), reduce_to_input(k, key), reduce_to_input(v, value)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> DenseGradients::reduced_to(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask) const {
  auto [dq, dk, dv] = reduced_to(query, key, value);
  at::Tensor dmask = mask_sums.has_value() ? mask_gradient(*attn_mask, mask_sums)
                                           : at::empty({0}, query.options());
  return {dq, dk, dv, dmask};
}

WeightsParams AttentionCall::weights(const at::Tensor& logsumexp, const at::Tensor& rng_state,
                                     double dropout_p, bool average_heads,
                                     const at::Tensor& weights) {
  WeightsParams wp;
  wp.fwd = inputs_;
  kept_.push_back(logsumexp.contiguous());
  wp.fwd.lse = describe_lse(kept_.back());
  wp.fwd.dropout = replay_dropout(rng_state, dropout_p);
  wp.heads_per_item = average_heads ? std::max<int64_t>(outer_shape_.back(), 1) : 1;
  wp.weights = weights.mutable_data_ptr();
  return wp;
}

}  // namespace fusedmha::ops
