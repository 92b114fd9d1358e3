// CPU kernels of fusedmha::attention_forward and varlen_attention_forward:
// check, allocate, fill the params, draw the dropout stream, run the work
// items on the threads.

#include "cpu/isa_kernels.h"
#include "cpu/work_items.h"
#include "ops/attention_checks.h"
#include "ops/attention_params_filler.h"
#include "ops/attention_shapes.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/core/DistributionsHelper.h>
#include <torch/library.h>

#include <mutex>

namespace fusedmha::cpu {
namespace {

// The most bytes of decoding's partial results a thread keeps between calls.
constexpr size_t kMostKeptPartialBytes = size_t(1) << 20;

// The dropout stream of a call, drawn from the default CPU generator:
// torch.manual_seed makes runs repeatable, and two calls differ.
DropoutParams draw_dropout(double dropout_p) {
  DropoutParams d;
  if (dropout_p <= 0) return d;
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
      std::nullopt, at::detail::getDefaultCPUGenerator());
  const std::lock_guard<std::mutex> lock(gen->mutex_);
  d.p = dropout_p;
  d.threshold = dropout_threshold(dropout_p);
  d.seed = gen->random64();
  d.offset = gen->random64();
  return d;
}

// The most query heads of a K/V head that the forward packs as rows of one
// decoding item: the selected kernels' score tile.
int64_t decode_rows(const at::Tensor& query) {
  return selected_kernels().forward_decode_rows(query.scalar_type() == at::kDouble);
}

// Runs the forward pass p on the intra-op threads; with `draw`, with a
// fresh dropout stream, which it records in rng_state (else p has it).
void run_forward(AttentionParams p, double dropout_p, const at::Tensor& rng_state,
                 bool draw = true) {
  if (draw) {
    p.dropout = draw_dropout(dropout_p);
    // (Written in place, not as rng_state[i] = x: two ATen ops each, which
    // cost a decoding step microseconds from cold caches.)
    int64_t* state = rng_state.mutable_data_ptr<int64_t>();  // (2,) int64, contiguous
    state[0] = static_cast<int64_t>(p.dropout.seed);
    state[1] = static_cast<int64_t>(p.dropout.offset);
  }
  const IsaKernels kernels = selected_kernels();
  WorkSplit split = kernels.forward_configure(p, available_threads());
  // Decoding's partial results: in the calling thread's kept buffer (an
  // allocation per call cost a decoding step microseconds from cold caches),
  // unless so large that no thread should keep them.
  at::Tensor partials;
  if (split.partial_bytes > kMostKeptPartialBytes) {
    partials = at::empty({static_cast<int64_t>(split.partial_bytes)}, at::kByte);
    split.partials = partials.mutable_data_ptr();
  } else if (split.partial_bytes > 0) {
    split.partials = call_scratch(split.partial_bytes);
  }
  run_items_in_parallel(split.items, split.workspace_bytes, [&](int64_t item, void* workspace) {
    kernels.forward_item(p, split, item, workspace);
  });
  if (split.kv_splits > 1) {
    // Decoding with the keys split across threads: merge each group's parts.
    run_items_in_parallel(p.num_outer / split.heads, split.workspace_bytes,
                          [&](int64_t group, void* workspace) {
                            kernels.forward_combine(p, split, group, workspace);
                          });
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
    std::optional<double> scale, bool enable_gqa, int64_t window_left, int64_t window_right, bool bottom_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& dropout_state) {
  const AttentionVariants variants{window_left, window_right, bottom_right, softcap,
                                   alibi_slopes, sinks};
  ops::check_attention_inputs(ops::kForwardOp, query, key, value, attn_mask, dropout_p, scale,
                              enable_gqa, variants);
  ops::check_dropout_state(ops::kForwardOp, dropout_state);
  auto [out, lse, rng_state] = ops::allocate_attention_outputs(query, key, value, enable_gqa);
  ops::AttentionCall call(ops::kForwardOp, query, key, value, attn_mask, is_causal, scale,
                          enable_gqa, variants, dropout_p, ops::last_dim_contiguous,
                          /*pack_query_heads=*/true, decode_rows(query));
  AttentionParams p = call.forward(out, lse);
  if (dropout_state.has_value()) {
    rng_state = ops::returned_rng_state(rng_state, dropout_state);
    p.dropout = call.replay_dropout(rng_state, dropout_p);
  }
  run_forward(p, dropout_p, rng_state, /*draw=*/!dropout_state.has_value());
  return {out, lse, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_forward_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, double dropout_p, bool is_causal, std::optional<double> scale,
    int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& block_table) {
  const AttentionVariants variants{window_left, window_right, bottom_right, softcap,
                                   alibi_slopes, sinks};
  ops::PackedBatch batch{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                         block_table};
  ops::check_varlen_inputs(ops::kVarlenForwardOp, query, key, value, batch, dropout_p, scale,
                           variants);
  // The kernels sized by the longest sequences, not by max_seqlen_q/k, which
  // may bound them loosely (a cache's capacity, or a generous max): one
  // query per sequence under a max_seqlen_q of 4096 is still decoding, and
  // keys fewer than the bound leave no thread idle.
  std::tie(batch.max_seqlen_q, batch.max_seqlen_k) =
      ops::check_packed_batch_values(ops::kVarlenForwardOp, batch, query.size(0), key);
  // (Every row of a sequence is written by the kernel: where they start at
  // row 0, only the rows after the last are filled.)
  const at::Tensor cu_q = cu_seqlens_q.contiguous();
  const int32_t* cu = cu_q.const_data_ptr<int32_t>();
  const std::optional<int64_t> covered =
      cu[0] == 0 ? std::optional<int64_t>(cu[cu_q.size(0) - 1]) : std::nullopt;
  auto [out, lse, rng_state] = ops::allocate_varlen_outputs(query, value, covered);
  ops::AttentionCall call(ops::kVarlenForwardOp, query, key, value, batch, is_causal, scale,
                          variants, dropout_p, ops::last_dim_contiguous, decode_rows(query));
  run_forward(call.forward(out, lse), dropout_p, rng_state);
  return {out, lse, rng_state};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CPU, m) {
  m.impl("attention_forward", TORCH_FN(attention_forward_cpu));
  m.impl("varlen_attention_forward", TORCH_FN(varlen_attention_forward_cpu));
}

}  // namespace fusedmha::cpu
