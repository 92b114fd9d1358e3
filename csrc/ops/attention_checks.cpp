#include "ops/attention_checks.h"

#include "ops/attention_shapes.h"
#include "ops/kv_quantization.h"
#include "ops/quick_views.h"

#include <algorithm>
#include <cmath>

namespace fusedmha::ops {
namespace {

// logsumexp and rng_state as attention_forward returned them for these inputs.
void check_saved_state(const char* op, const at::Tensor& query, const at::Tensor& key,
                       const at::Tensor& value, const at::Tensor& logsumexp,
                       const at::Tensor& rng_state, bool enable_gqa) {
  TORCH_CHECK(rng_state.dim() == 1 &&
                  (rng_state.sym_size(0) == 2 || rng_state.sym_size(0) == 4) &&
                  rng_state.scalar_type() == at::kLong,
              op, ": expected rng_state as attention_forward returns it (int64 of shape [2], "
              "or [4] with a dropout_state that has a position), got ", rng_state.scalar_type(),
              " of shape ", shape_str(rng_state.sym_sizes()));
  const at::Tensor expected_lse = std::get<1>(allocate_attention_outputs(
      query.to(at::kMeta), key.to(at::kMeta), value.to(at::kMeta), enable_gqa));
  TORCH_CHECK(logsumexp.sym_sizes() == expected_lse.sym_sizes() &&
                  logsumexp.scalar_type() == expected_lse.scalar_type() &&
                  logsumexp.device() == query.device(),
              op, ": expected logsumexp as attention_forward returns it (",
              expected_lse.scalar_type(), " of shape ", shape_str(expected_lse.sym_sizes()),
              "), got ", logsumexp.scalar_type(), " of shape ", shape_str(logsumexp.sym_sizes()));
}

// A per-head tensor (alibi_slopes, sinks): floating, on the query's device,
// its dims broadcastable to the outer shape's last `max_dims` dims (batch
// dims..., heads), the heads dim present.
void check_per_head(const char* op, const char* name, const char* expected,
                    const at::Tensor& query, const at::Tensor& t,
                    const std::vector<c10::SymInt>& outer, int64_t max_dims) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": expected ", name,
              " of a floating dtype, got ", t.scalar_type());
  TORCH_CHECK(t.device() == query.device(), op, ": expected ", name, " on the query's device (",
              query.device(), "), got ", t.device());
  bool ok = t.dim() >= 1 && t.dim() <= std::min<int64_t>(max_dims, outer.size()) &&
            t.sym_size(-1) == outer.back();
  for (int64_t i = 2; ok && i <= t.dim(); ++i) {
    ok = t.sym_size(-i) == 1 || t.sym_size(-i) == outer[outer.size() - i];
  }
  TORCH_CHECK(ok, op, ": expected ", name, " of shape ", expected, " with H = ", outer.back(),
              " query heads, got ", shape_str(t.sym_sizes()));
}

// grad_logsumexp, when given: the logsumexp's shape, dtype and device.
void check_grad_logsumexp(const char* op, const std::optional<at::Tensor>& grad_logsumexp,
                          const at::Tensor& logsumexp) {
  if (!grad_logsumexp.has_value()) return;
  const at::Tensor& g = *grad_logsumexp;
  TORCH_CHECK(g.sym_sizes() == logsumexp.sym_sizes() && g.device() == logsumexp.device() &&
                  at::isFloatingType(g.scalar_type()),
              op, ": expected grad_logsumexp of the logsumexp's shape ",
              shape_str(logsumexp.sym_sizes()), " on ", logsumexp.device(), ", got ",
              g.scalar_type(), " of shape ", shape_str(g.sym_sizes()), " on ", g.device());
}

}  // namespace

void check_variants(const char* op, const at::Tensor& query,
                    const std::vector<c10::SymInt>& outer, const AttentionVariants& v) {
  TORCH_CHECK(v.window_left >= -1 && v.window_right >= -1, op,
              ": window sizes must be >= -1 (-1 = unbounded), got (", v.window_left, ", ",
              v.window_right, ")");
  TORCH_CHECK(std::isfinite(v.softcap) && v.softcap >= 0.0, op,
              ": softcap must be a finite number >= 0 (0 = off), got ", v.softcap);
  if (v.alibi_slopes.has_value()) {
    check_per_head(op, "alibi_slopes", "(H) or (B, H)", query, *v.alibi_slopes, outer, 2);
  }
  if (v.sinks.has_value()) check_per_head(op, "sinks", "(H)", query, *v.sinks, outer, 1);
}

void check_dropout_state(const char* op, const std::optional<at::Tensor>& dropout_state) {
  if (!dropout_state.has_value()) return;
  const at::Tensor& s = *dropout_state;
  TORCH_CHECK(s.dim() == 1 && (s.sym_size(0) == 2 || s.sym_size(0) == 4) &&
                  s.scalar_type() == at::kLong,
              op, ": expected dropout_state int64 [seed, offset] or [seed, offset, row, column], "
              "got ", s.scalar_type(), " of shape ", shape_str(s.sym_sizes()));
}

void check_dropout_position(const char* op, int64_t row, int64_t column) {
  TORCH_CHECK(row >= 0 && column >= 0 && column % 4 == 0, op,
              ": expected dropout_state's row >= 0 and column a multiple of 4 (>= 0), got row ",
              row, " and column ", column);
}

at::Tensor returned_rng_state(const at::Tensor& drawn,
                              const std::optional<at::Tensor>& dropout_state) {
  if (!dropout_state.has_value()) return drawn;
  return dropout_state->to(drawn.device(), /*non_blocking=*/false, /*copy=*/true);
}

bool mask_broadcasts_to(c10::SymIntArrayRef mask, c10::SymIntArrayRef target) {
  if (mask.size() > target.size()) return false;
  for (size_t i = 1; i <= mask.size(); ++i) {
    const c10::SymInt& m = mask[mask.size() - i];
    if (!(m == 1 || m == target[target.size() - i])) return false;
  }
  return true;
}

// query (..., L, E), key (..., S, E), value (..., S, Ev): dtypes, devices,
// matching dims, broadcastable batch/head dims (or GQA), attn_mask dtype and
// shape, dropout_p in [0, 1), scale finite and >= 0, and the variants.
static void check_attention_inputs(const char* op,
                            const at::Tensor& query,
                            const at::Tensor& key,
                            const at::Tensor& value,
                            const std::optional<at::Tensor>& attn_mask,
                            double dropout_p,
                            std::optional<double> scale,
                            bool enable_gqa,
                            const AttentionVariants& variants,
                            bool quantized_kv = false) {
  TORCH_CHECK(query.dim() >= 2 && key.dim() >= 2 && value.dim() >= 2, op,
              ": expected query (..., L, E), key (..., S, E) and value (..., S, Ev) to have at "
              "least 2 dims, got query.dim()=", query.dim(), ", key.dim()=", key.dim(),
              ", value.dim()=", value.dim());
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 ||
                  dtype == at::kHalf,
              op, ": expected query of dtype float32, float64, bfloat16 or float16, got ", dtype);
  // (Quantized codes: check_quantized_kv.)
  TORCH_CHECK(quantized_kv || (key.scalar_type() == dtype && value.scalar_type() == dtype), op,
              ": expected query, key and value to have the same dtype, got query.dtype=", dtype,
              ", key.dtype=", key.scalar_type(), ", value.dtype=", value.scalar_type());
  TORCH_CHECK(key.device() == query.device() && value.device() == query.device(), op,
              ": expected query, key and value on the same device, got query on ",
              query.device(), ", key on ", key.device(), ", value on ", value.device());
  TORCH_CHECK(key.sym_size(-1) == query.sym_size(-1), op,
              ": expected key's last dim (E) to equal query's, got query ",
              shape_str(query.sym_sizes()), " and key ", shape_str(key.sym_sizes()));
  TORCH_CHECK(value.sym_size(-2) == key.sym_size(-2), op,
              ": expected value's sequence length (dim -2) to equal key's, got key ",
              shape_str(key.sym_sizes()), " and value ", shape_str(value.sym_sizes()));
  const std::vector<c10::SymInt> outer = attention_outer_shape(op, query, key, value, enable_gqa);

  if (attn_mask.has_value()) {
    const at::Tensor& mask = *attn_mask;
    const auto mdtype = mask.scalar_type();
    TORCH_CHECK(mdtype == at::kBool || mdtype == at::kFloat || mdtype == dtype, op,
                ": expected attn_mask of dtype bool, float32 or the query's dtype (", dtype,
                "), got ", mdtype);
    TORCH_CHECK(mask.device() == query.device(), op,
                ": expected attn_mask on the query's device (", query.device(), "), got ",
                mask.device());
    std::vector<c10::SymInt> target = outer;
    target.push_back(query.sym_size(-2));
    target.push_back(key.sym_size(-2));
    TORCH_CHECK(mask_broadcasts_to(mask.sym_sizes(), target), op, ": attn_mask of shape ",
                shape_str(mask.sym_sizes()), " is not broadcastable to the attention shape (..., H, L, S) = ",
                shape_str(target));
  }
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op,
              ": dropout_p must be in [0, 1), got ", dropout_p);
  if (scale.has_value()) {
    TORCH_CHECK(std::isfinite(*scale) && *scale >= 0.0, op,
                ": scale must be a finite number >= 0, got ", *scale);
  }
  check_variants(op, query, outer, variants);
}

void check_backward_inputs(const char* op, const BackwardArgs& a) {
  const auto& [grad_out, query, key, value, out, logsumexp, rng_state, attn_mask, dropout_p,
               is_causal, scale, enable_gqa, variants, grad_logsumexp, grad_attn_mask] = a;
  check_attention_inputs(op, query, key, value, attn_mask, dropout_p, scale, enable_gqa,
                         variants);
  TORCH_CHECK(!grad_attn_mask || (attn_mask.has_value() && attn_mask->scalar_type() != at::kBool),
              op, ": grad_attn_mask=True needs a float attn_mask, got ",
              attn_mask.has_value() ? "a bool one" : "none");
  check_saved_state(op, query, key, value, logsumexp, rng_state, enable_gqa);
  check_grad_logsumexp(op, grad_logsumexp, logsumexp);
  const at::Tensor expected_out = std::get<0>(allocate_attention_outputs(
      query.to(at::kMeta), key.to(at::kMeta), value.to(at::kMeta), enable_gqa));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"grad_out", &grad_out},
                                {"out", &out}}) {
    TORCH_CHECK(t->sym_sizes() == expected_out.sym_sizes(), op, ": expected ", name,
                " of the forward output's shape ", shape_str(expected_out.sym_sizes()), ", got ",
                shape_str(t->sym_sizes()));
    TORCH_CHECK(t->scalar_type() == query.scalar_type() && t->device() == query.device(), op,
                ": expected ", name, " of dtype ", query.scalar_type(), " on ", query.device(),
                ", got ", t->scalar_type(), " on ", t->device());
  }
}


void check_weights_inputs(const char* op, const WeightsArgs& a) {
  const auto& [query, key, logsumexp, rng_state, attn_mask, dropout_p, is_causal, scale,
               enable_gqa, average_heads, variants] = a;
  check_attention_inputs(op, query, key, key, attn_mask, dropout_p, scale, enable_gqa, variants);
  check_saved_state(op, query, key, key, logsumexp, rng_state, enable_gqa);
}

namespace {

// An int32 vector of n entries on the query's device (cu_seqlens, seqused_k).
void check_lengths_tensor(const char* op, const char* name, const at::Tensor& t,
                          const c10::SymInt& n, const char* expected, const at::Tensor& query) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == 1 && t.sym_size(0) == n, op,
              ": expected ", name, " of dtype int32 and shape ", expected, " = [", n, "], got ",
              t.scalar_type(), " of shape ", shape_str(t.sym_sizes()));
  TORCH_CHECK(t.device() == query.device(), op, ": expected ", name,
              " on the query's device (", query.device(), "), got ", t.device());
}

}  // namespace

// Quantized key and value: codes of one 8-bit dtype, and float32 scales of
// their shapes without the last dim, on the query's device.
static void check_quantized_kv(const char* op, const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const PackedBatch& batch) {
  TORCH_CHECK(batch.k_scale.has_value() && batch.v_scale.has_value(), op,
              ": pass k_scale and v_scale together (a quantized key and value)");
  TORCH_CHECK(key.dim() >= 1 && value.dim() >= 1, op,
              ": expected key and value of at least one dim, got ", key.dim(), " and ", value.dim());
  TORCH_CHECK(kv_storage_of(key.scalar_type()) != KVStorage::Dense &&
                  value.scalar_type() == key.scalar_type(),
              op, ": with k_scale and v_scale, expected key and value of one quantized dtype "
              "(int8, float8_e4m3fn or float8_e5m2), got ", key.scalar_type(), " and ",
              value.scalar_type());
  for (const auto& [name, s, t] :
       {std::make_tuple("k_scale", &*batch.k_scale, &key),
        std::make_tuple("v_scale", &*batch.v_scale, &value)}) {
    const c10::SymIntArrayRef rows = t->sym_sizes().slice(0, t->dim() - 1);
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->sym_sizes() == rows &&
                    s->device() == query.device(),
                op, ": expected ", name, " of dtype float32 and shape ", shape_str(rows),
                " (one scale per row and head) on the query's device (", query.device(),
                "), got ", s->scalar_type(), " of shape ", shape_str(s->sym_sizes()), " on ",
                s->device());
  }
}

// A packed batch's tensors, as check_varlen_forward_inputs says.
static void check_packed_inputs(const char* op, const at::Tensor& query, const at::Tensor& key,
                         const at::Tensor& value, const PackedBatch& batch, double dropout_p,
                         std::optional<double> scale, const AttentionVariants& variants,
                         bool quantized_kv = false) {
  if (batch.k_scale.has_value() || batch.v_scale.has_value()) {
    check_quantized_kv(op, query, key, value, batch);
    PackedBatch codes = batch;
    codes.k_scale.reset(), codes.v_scale.reset();
    return check_packed_inputs(op, query, key, value, codes, dropout_p, scale, variants,
                               /*quantized_kv=*/true);
  }
  if (batch.block_table.has_value()) {
    // A paged cache: checked as the packed rows of its pages, plus the table.
    TORCH_CHECK(key.dim() == 4 && value.dim() == 4 && key.sym_size(0) == value.sym_size(0) &&
                    key.sym_size(1) == value.sym_size(1),
                op, ": with block_table, expected key and value as paged caches (num_pages, "
                "page_size, H_kv, E), got key ", shape_str(key.sym_sizes()), " and value ",
                shape_str(value.sym_sizes()));
    TORCH_CHECK(key.sym_size(1) > 0, op, ": expected pages of at least one row, got key ",
                shape_str(key.sym_sizes()));
    const at::Tensor& table = *batch.block_table;
    TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 2 &&
                    table.sym_size(0) == batch.cu_seqlens_q.sym_size(0) - 1,
                op, ": expected block_table of dtype int32 and shape (B, pages per sequence), "
                "B = ", batch.cu_seqlens_q.sym_size(0) - 1, ", got ", table.scalar_type(),
                " of shape ", shape_str(table.sym_sizes()));
    TORCH_CHECK(table.device() == query.device(), op,
                ": expected block_table on the query's device (", query.device(), "), got ",
                table.device());
    PackedBatch rows = batch;
    rows.block_table.reset();
    return check_packed_inputs(op, query, quick_flatten_01(key), quick_flatten_01(value), rows,
                               dropout_p, scale, variants, quantized_kv);
  }
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, op,
              ": expected a packed batch: query (total_q, H, E), key (total_k, H_kv, E) and "
              "value (total_k, H_kv, Ev), got query ", shape_str(query.sym_sizes()), ", key ",
              shape_str(key.sym_sizes()), " and value ", shape_str(value.sym_sizes()));
  const c10::SymInt h = query.sym_size(1), h_kv = key.sym_size(1);
  TORCH_CHECK(value.sym_size(1) == h_kv && value.sym_size(0) == key.sym_size(0), op,
              ": expected value (total_k, H_kv, Ev) with key's total_k and H_kv, got key ",
              shape_str(key.sym_sizes()), " and value ", shape_str(value.sym_sizes()));
  TORCH_CHECK(h_kv > 0 && h % h_kv == 0, op,
              ": expected query's heads to be a multiple of key's (grouped-query attention), got ",
              h, " and ", h_kv);
  // Dtypes, devices, head dims, dropout, scale and the variants as for one
  // sequence: (H, total, E) views of the same tensors.
  check_attention_inputs(op, quick_transpose(query, 0, 1), quick_transpose(key, 0, 1),
                         quick_transpose(value, 0, 1),
                         std::nullopt, dropout_p, scale, /*enable_gqa=*/true, AttentionVariants{
                             variants.window_left, variants.window_right, variants.bottom_right,
                             variants.softcap, std::nullopt, variants.sinks}, quantized_kv);
  const c10::SymInt b = batch.cu_seqlens_q.dim() == 1 ? batch.cu_seqlens_q.sym_size(0) - 1 : -1;
  TORCH_CHECK(b >= 0, op, ": expected cu_seqlens_q of shape (B + 1), got ",
              shape_str(batch.cu_seqlens_q.sym_sizes()));
  check_lengths_tensor(op, "cu_seqlens_q", batch.cu_seqlens_q, b + 1, "(B + 1)", query);
  check_lengths_tensor(op, "cu_seqlens_k", batch.cu_seqlens_k, b + 1, "(B + 1)", query);
  if (batch.seqused_k.has_value()) {
    check_lengths_tensor(op, "seqused_k", *batch.seqused_k, b, "(B)", query);
  }
  TORCH_CHECK(batch.max_seqlen_q >= 0 && batch.max_seqlen_k >= 0, op,
              ": expected max_seqlen_q and max_seqlen_k >= 0, got ", batch.max_seqlen_q, " and ",
              batch.max_seqlen_k);
  if (variants.alibi_slopes.has_value()) {
    // Per head, or per sequence and head: checked as for (B, H, L, E).
    check_variants(op, query, {b, h},
                   AttentionVariants{-1, -1, false, 0.0, variants.alibi_slopes, std::nullopt});
  }
}

void check_varlen_backward_inputs(const char* op, const VarlenBackwardArgs& a) {
  const auto& [grad_out, query, key, value, out, logsumexp, rng_state, cu_seqlens_q,
               cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal, scale, variants,
               seqused_k, grad_logsumexp] = a;
  check_packed_inputs(op, query, key, value, packed_batch(a), dropout_p, scale, variants);
  TORCH_CHECK(rng_state.dim() == 1 && rng_state.sym_size(0) == 2 &&
                  rng_state.scalar_type() == at::kLong,
              op, ": expected rng_state as varlen_attention_forward returns it (int64 of shape "
              "[2]), got ", rng_state.scalar_type(), " of shape ", shape_str(rng_state.sym_sizes()));
  const auto lse_dtype = query.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const std::vector<c10::SymInt> lse_shape{query.sym_size(1), query.sym_size(0)};
  TORCH_CHECK(logsumexp.sym_sizes() == c10::SymIntArrayRef(lse_shape) &&
                  logsumexp.scalar_type() == lse_dtype && logsumexp.device() == query.device(),
              op, ": expected logsumexp as varlen_attention_forward returns it (", lse_dtype,
              " of shape (H, total_q) = ", shape_str(lse_shape), "), got ",
              logsumexp.scalar_type(), " of shape ", shape_str(logsumexp.sym_sizes()));
  check_grad_logsumexp(op, grad_logsumexp, logsumexp);
  const std::vector<c10::SymInt> out_shape{query.sym_size(0), query.sym_size(1),
                                           value.sym_size(-1)};
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"grad_out", &grad_out},
                                {"out", &out}}) {
    TORCH_CHECK(t->sym_sizes() == c10::SymIntArrayRef(out_shape), op, ": expected ", name,
                " of the forward output's shape (total_q, H, Ev) = ", shape_str(out_shape),
                ", got ", shape_str(t->sym_sizes()));
    TORCH_CHECK(t->scalar_type() == query.scalar_type() && t->device() == query.device(), op,
                ": expected ", name, " of dtype ", query.scalar_type(), " on ", query.device(),
                ", got ", t->scalar_type(), " on ", t->device());
  }
}

void check_forward_inputs(const char* op, const ForwardArgs& a) {
  check_attention_inputs(op, a.query, a.key, a.value, a.attn_mask, a.dropout_p, a.scale,
                         a.enable_gqa, a.variants);
  check_dropout_state(op, a.dropout_state);
}

PackedBatch packed_batch(const VarlenForwardArgs& a) {
  return {a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k, a.seqused_k,
          a.block_table, a.k_scale, a.v_scale};
}

PackedBatch packed_batch(const VarlenBackwardArgs& a) {
  return {a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k, a.seqused_k};
}

void check_varlen_forward_inputs(const char* op, const VarlenForwardArgs& a) {
  check_packed_inputs(op, a.query, a.key, a.value, packed_batch(a), a.dropout_p, a.scale,
                      a.variants);
}

std::pair<int64_t, int64_t> check_packed_batch_values(const char* op, const PackedBatch& batch,
                                                      int64_t total_q, const at::Tensor& key) {
  // Read in place and checked in plain loops: a chain of ATen reductions
  // and .item()s is an op dispatched each, tens of them per decoding step
  // (docs/performance.md, "A decoding call's fixed cost"). (int32 on the
  // CPU: check_varlen_inputs.)
  const bool paged = batch.block_table.has_value();
  // Rows of k and v a sequence may reach: all of them, or with pages, as
  // many as its table row holds.
  const int64_t total_k = paged ? batch.block_table->size(1) * key.size(1) : key.size(0);
  if (paged) {
    const at::Tensor table = batch.block_table->contiguous();
    const int32_t* page = table.const_data_ptr<int32_t>();
    TORCH_CHECK(std::all_of(page, page + table.numel(),
                            [&](int32_t x) { return x >= 0 && x < key.size(0); }),
                op, ": block_table entries must be page indices in [0, ", key.size(0), ")");
  }
  const int64_t sequences = batch.cu_seqlens_q.size(0) - 1;
  const at::Tensor cu_k = batch.cu_seqlens_k.contiguous();
  const at::Tensor used_k = batch.seqused_k.has_value() ? batch.seqused_k->contiguous() : cu_k;
  const int32_t* used = batch.seqused_k.has_value() ? used_k.const_data_ptr<int32_t>() : nullptr;
  if (used) {
    const int32_t* cu = cu_k.const_data_ptr<int32_t>();
    for (int64_t b = 0; b < sequences; ++b) {
      TORCH_CHECK(used[b] >= 0 && (paged || used[b] <= int64_t{cu[b + 1]} - cu[b]), op,
                  ": seqused_k must be >= 0 and at most each sequence's keys in cu_seqlens_k");
    }
  }
  int64_t longest_q = 0, longest_k = 0;
  using Lengths = std::tuple<const char*, const char*, const at::Tensor*, int64_t, int64_t>;
  for (const auto& [name, max_name, cu_t, total, max_len] :
       {Lengths{"cu_seqlens_q", "max_seqlen_q", &batch.cu_seqlens_q, total_q, batch.max_seqlen_q},
        Lengths{"cu_seqlens_k", "max_seqlen_k", &batch.cu_seqlens_k, total_k,
                batch.max_seqlen_k}}) {
    const bool keys = cu_t == &batch.cu_seqlens_k;
    const at::Tensor values = cu_t->contiguous();
    const int32_t* cu = values.const_data_ptr<int32_t>();
    const int64_t first = cu[0], last = cu[sequences];
    // (With pages, cu_seqlens_k only gives lengths; each is bounded below.)
    TORCH_CHECK((paged && keys) || (first >= 0 && last <= total), op, ": ", name,
                " must lie within the ", total, " rows of the packed tensors, got ", first,
                " .. ", last);
    int64_t longest = 0;
    for (int64_t b = 0; b < sequences; ++b) {
      const int64_t length = int64_t{cu[b + 1]} - cu[b];
      TORCH_CHECK(length >= 0, op, ": ", name,
                  " must be non-decreasing (cumulative sequence lengths)");
      // (With seqused_k, a sequence's keys are those it uses.)
      longest = std::max<int64_t>(longest, keys && used ? used[b] : length);
    }
    TORCH_CHECK(!paged || !keys || longest <= total, op, ": a sequence of ", longest,
                " keys does not fit the ", total, " rows its block_table row holds");
    TORCH_CHECK(longest <= max_len, op, ": ", max_name, " = ", max_len,
                " is smaller than the longest sequence in ", name, " (", longest, ")");
    (keys ? longest_k : longest_q) = longest;
  }
  return {longest_q, longest_k};
}

}  // namespace fusedmha::ops
