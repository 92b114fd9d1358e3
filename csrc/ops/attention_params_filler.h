#pragma once

// Fills the kernels' params (common/attention_params.h) from checked
// tensors: one filler per pass, used by the CPU and the CUDA host wrappers
// alike, so a call is described to every backend the same way.

#include "common/attention_params.h"
#include "ops/op_args.h"
#include "ops/packed_batch.h"

#include <fusedmha/attention.h>

#include <ATen/core/Tensor.h>

#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace fusedmha::ops {

DType dtype_of(at::ScalarType t);

// A bool mask, a mask in the query's dtype, or a float32 mask for a
// half-precision query (check_attention_inputs allows nothing else).
MaskKind mask_kind_of(const at::Tensor& mask, const at::Tensor& query);

// How a backend wants the rows of q/k/v (and, in the backward, out and
// grad_out) laid out: t itself when it qualifies, else a copy that does.
using RowLayout = at::Tensor (*)(const at::Tensor&);

// t itself when its last dim is contiguous, else a copy that is (the CPU
// kernels, the simple CUDA kernels).
at::Tensor last_dim_contiguous(const at::Tensor& t);

// The gradients of a backward call per output head, in the accumulation
// dtype (float; double for float64): q is (grad_q_splits, outer..., L, E),
// zeroed; k and v are (outer..., S, E) and (outer..., S, Ev). For a packed
// batch: (grad_q_splits, total_q, H, E), (total_k, H, E), (total_k, H, Ev),
// all zeroed.
// mask_sums, when the mask's gradient was asked for, is its sums
// (allocate_mask_gradient_sums).
struct DenseGradients {
  at::Tensor q, k, v;
  std::optional<at::Tensor> mask_sums;
  bool packed_batch = false;

  // Summed over the dQ slices, grouped heads and broadcast dims into the
  // shapes and dtypes of the inputs.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> reduced_to(const at::Tensor& query,
                                                            const at::Tensor& key,
                                                            const at::Tensor& value) const;
  // The same and the mask's gradient (mask_gradient), or an empty tensor
  // where it was not asked for.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> reduced_to(
      const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
      const std::optional<at::Tensor>& attn_mask) const;
};

// Whether a call decodes with grouped-query heads in a way the kernels can
// read as rows: one query row (L = 1), H = G·H_kv query heads with G > 1,
// and nothing that tells those rows apart by position or head (no left
// window, a causal mask or right window only if bottom-right (they then
// hide nothing), no ALiBi, sinks or dropout; a mask per head is read as
// rows too). Then the G query heads
// that share a K/V head are G rows of one item (or G / G' items of G' rows,
// where the backend caps the rows: AttentionCall's most_packed_rows): K/V
// are read once per group, not once per head, and the score tiles are G
// rows deep instead of 1. (Key and value have the same heads: a value whose
// heads broadcast differently would tell the rows apart.)
bool packs_query_heads(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const std::optional<at::Tensor>& attn_mask, bool is_causal,
                       const AttentionVariants& variants, double dropout_p);

// The same for a packed batch: one query row per sequence (cu_seqlens_q =
// 0, 1, ..., B) and the conditions above. Read on the CPU only (on a GPU
// it would wait for the device).
bool packs_query_heads(const at::Tensor& query, const at::Tensor& key, const PackedBatch& batch,
                       bool is_causal, const AttentionVariants& variants, double dropout_p);

// The weights op's output on every backend, checked and allocated; false
// where no probability is positive (no query row, no key, or no head to
// average): it is then zeroed, and no kernel needs to run.
std::pair<at::Tensor, bool> start_weights(const WeightsArgs& args);

// One attention call described for the kernels (the inputs already checked).
// It keeps alive every copy its row layout made, and the device copy of a
// replayed rng_state, so it must outlive the kernels' run.
class AttentionCall {
 public:
  static constexpr int64_t kAnyRows = std::numeric_limits<int64_t>::max();
  // pack_query_heads allows reading the query heads that share a K/V head
  // as rows of one item when decoding (see packs_query_heads); the weights
  // pass, which averages over heads, does not allow it. most_packed_rows
  // caps the rows of one item: of G heads per K/V head, the most that
  // divide G and fit are packed (none where no divisor above 1 fits).
  AttentionCall(const char* op, const at::Tensor& query, const at::Tensor& key,
                const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                bool is_causal, std::optional<double> scale, bool enable_gqa,
                const AttentionVariants& variants, double dropout_p,
                RowLayout layout = last_dim_contiguous, bool pack_query_heads = true,
                int64_t most_packed_rows = kAnyRows);
  // A packed batch (its inputs already checked, values included).
  AttentionCall(const char* op, const at::Tensor& query, const at::Tensor& key,
                const at::Tensor& value, const PackedBatch& batch, bool is_causal,
                std::optional<double> scale, const AttentionVariants& variants,
                double dropout_p, RowLayout layout = last_dim_contiguous,
                int64_t most_packed_rows = kAnyRows);

  // The same from an op's record (ops/op_args.h): the forward's and the
  // backward's inputs; the weights pass's (key standing in for value, no
  // packed heads); a varlen call's, with its batch (whose lengths the
  // caller may have tightened).
  AttentionCall(const char* op, const ForwardArgs& a, RowLayout layout = last_dim_contiguous,
                bool pack_query_heads = true, int64_t most_packed_rows = kAnyRows)
      : AttentionCall(op, a.query, a.key, a.value, a.attn_mask, a.is_causal, a.scale,
                      a.enable_gqa, a.variants, a.dropout_p, layout, pack_query_heads,
                      most_packed_rows) {}
  AttentionCall(const char* op, const BackwardArgs& a, RowLayout layout = last_dim_contiguous)
      : AttentionCall(op, a.query, a.key, a.value, a.attn_mask, a.is_causal, a.scale,
                      a.enable_gqa, a.variants, a.dropout_p, layout) {}
  AttentionCall(const char* op, const WeightsArgs& a)
      : AttentionCall(op, a.query, a.key, a.key, a.attn_mask, a.is_causal, a.scale,
                      a.enable_gqa, a.variants, a.dropout_p, last_dim_contiguous,
                      /*pack_query_heads=*/false) {}
  template <typename VarlenArgs>
  AttentionCall(const char* op, const VarlenArgs& a, const PackedBatch& batch,
                RowLayout layout = last_dim_contiguous, int64_t most_packed_rows = kAnyRows)
      : AttentionCall(op, a.query, a.key, a.value, batch, a.is_causal, a.scale, a.variants,
                      a.dropout_p, layout, most_packed_rows) {}

  // The forward pass writing out and lse (as allocate_attention_outputs
  // made them). Dropout is left off: the backend draws its stream.
  AttentionParams forward(const at::Tensor& out, const at::Tensor& lse);

  // The backward pass of the forward call that returned out, logsumexp
  // and rng_state; gradient pointers are set by allocate_gradients once
  // the backend has chosen bp.grad_q_splits. grad_mask: the float mask whose
  // gradient is asked for (its sums allocated and described here, in
  // mask_sums' dtype: see BackwardParams::grad_mask).
  enum class MaskSums { kMaskDtype, kAccumulator };
  BackwardParams backward(const at::Tensor& grad_out, const at::Tensor& out,
                          const at::Tensor& logsumexp, const at::Tensor& rng_state,
                          double dropout_p,
                          const std::optional<at::Tensor>& grad_logsumexp = std::nullopt,
                          const std::optional<at::Tensor>& grad_mask = std::nullopt,
                          MaskSums mask_sums = MaskSums::kAccumulator);
  // The same for a BackwardArgs record.
  BackwardParams backward(const BackwardArgs& a, MaskSums mask_sums) {
    return backward(a.grad_out, a.out, a.logsumexp, a.rng_state, a.dropout_p, a.grad_logsumexp,
                    a.grad_attn_mask ? a.attn_mask : std::nullopt, mask_sums);
  }
  DenseGradients allocate_gradients(BackwardParams& bp) const;
  // bp.delta, rowsum(grad_out ∘ out) − grad_lse, computed with ATen ops
  // (the CUDA kernels read it; the CPU kernels compute it per block).
  void compute_delta(BackwardParams& bp, const at::Tensor& grad_out, const at::Tensor& out,
                     const std::optional<at::Tensor>& grad_logsumexp);

  // The weights pass of the forward call that returned logsumexp and
  // rng_state, writing into weights (allocate_attention_weights's).
  WeightsParams weights(const at::Tensor& logsumexp, const at::Tensor& rng_state,
                        double dropout_p, bool average_heads, const at::Tensor& weights);

  // The inputs alone (no outputs, dropout off).
  const AttentionParams& inputs() const { return inputs_; }

  // The dropout stream of rng_state as a forward call returned it (or as
  // dropout_state gave it: [seed, offset] or [seed, offset, row, column]);
  // off when dropout_p is 0.
  DropoutParams replay_dropout(const at::Tensor& rng_state, double dropout_p);

 private:
  // The outer shape (outer_shape_) into inputs_.outer and num_outer.
  void set_outer_shape(const char* op);
  // The scale, softcap, band, ALiBi and sinks into inputs_.
  void set_variants(bool is_causal, std::optional<double> scale, const AttentionVariants& v);
  // t's (rows, cols) matrices indexed by the kernels' outer shape.
  Matrix describe(const at::Tensor& t) const;
  Matrix describe(const void* data, c10::IntArrayRef sizes, c10::IntArrayRef strides) const;
  // A tensor of rows as the kernels read it: query-side rows (q, out,
  // grad_out, dQ) with packed query heads, key-side rows (k, v, dK, dV)
  // as they are; for a packed batch, t (rows, heads, cols), whose
  // sequences' rows the params' Sequences find.
  Matrix describe_rows(const at::Tensor& t, bool query_rows) const;
  // describe_rows after the row layout (any copy kept alive).
  Matrix describe_in_layout(const at::Tensor& t, bool query_rows);
  // The log-sum-exp (..., H, L), or (H, total_q) for a packed batch, and
  // tensors laid out like it (contiguous, so rows are adjacent).
  Matrix describe_lse(const at::Tensor& lse);
  // A mask that only pads the keys per batch index (left padding, a
  // suffix, or both) and may hide a causal band or sliding window
  // (find_mask_structure), as key spans and the band (CPU): the kernels then
  // skip the hidden keys instead of reading the mask. False (and nothing
  // set) for any other mask.
  bool use_mask_structure(const at::Tensor& mask);
  // Any other mask's tiles that hide every key or none (find_mask_tiles;
  // on CUDA a bool mask's, for the tensor-core kernels): the kernels skip the
  // first and add no mask over the second. A bool mask that hides nothing is
  // dropped (CPU).
  void use_mask_tiles(const at::Tensor& mask);
  // A per-head tensor (alibi_slopes, sinks) as one float64 per outer index.
  Matrix describe_per_head(const at::Tensor& t);
  // t (..., H, 1, cols) described as the kernels see it: (..., H_kv, G,
  // cols) when the query heads are packed, else as it is; as_column reads t
  // (..., H, 1) as (..., H, 1, 1) first.
  Matrix describe_packed(const at::Tensor& t, bool as_column = false) const;

  const char* op_;  // the entry point, as error messages start
  at::Tensor query_;
  RowLayout layout_;
  std::vector<int64_t> outer_shape_;     // batch dims..., heads (sizes 1 included)
  int64_t group_ = 1;                    // query heads read as rows of one item (1: none)
  bool packed_batch_ = false;            // q/k/v in FlashAttention's varlen layout
  int64_t key_rows_ = 0;                 // total_k of a packed batch
  std::optional<at::Tensor> mask_sums_;  // a backward call's mask gradient sums
  AttentionParams inputs_;
  std::vector<at::Tensor> kept_;
};

}  // namespace fusedmha::ops
