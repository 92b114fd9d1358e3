// CPU kernels of fusedmha::attention_forward and varlen_attention_forward:
// check, allocate, fill the params, draw the dropout stream, run the work
// items on the threads.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/DistributionsHelper.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>

#include "cpu/isa_kernels.h"
#include "cpu/work_items.h"
#include "ops/attention_checks.h"
#include "ops/attention_params_filler.h"
#include "ops/attention_shapes.h"

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
  return selected_kernels().traits.decode_rows(query.scalar_type() == at::kDouble);
}

// Below this many scores per outer index, grouping the batch indices that
// share a mask (batch_sharing_mask) gains nothing: a tile read once for
// several batch indices saves too little beside the items' fixed work
// (docs/performance.md, "Batch indices sharing a mask").
constexpr int64_t kMinBatchSharedMaskScores = 384 * 384;

// The innermost outer dim, not the last, over which the mask repeats
// (stride 0, more than one index), where the items would each take one
// outer index: a (1, H, L, S) mask of biases (ALiBi's, T5's or Swin's, as a
// float mask) over a batch. -1 if none, or where an outer index means more
// than its place in the dims: a dropout stream, sequences, pages or key
// spans are drawn or looked up by it.
int batch_sharing_mask(const AttentionParams& p, const WorkSplit& split) {
  if (split.decode || split.heads != 1 || p.mask_kind == MaskKind::None || p.mask.row_stride == 0 ||
      p.len_q * p.len_kv < kMinBatchSharedMaskScores || p.dropout.on() || p.seq.on() ||
      p.pages.table || p.key_spans) {
    return -1;
  }
  for (int d = p.outer.dims - 2; d >= 0; --d) {
    if (p.mask.outer_stride[d] == 0 && p.outer.size[d] > 1) return d;
  }
  return -1;
}

// p with outer dim d moved last (the others keep their order), in every
// matrix the outer index places.
AttentionParams with_outer_dim_last(AttentionParams p, int d) {
  auto rotate = [&](auto& a) { std::rotate(a + d, a + d + 1, a + p.outer.dims); };
  rotate(p.outer.size);
  for (Matrix* m : {&p.q, &p.k, &p.v, &p.k_scale, &p.v_scale, &p.mask, &p.mask_tiles,
                    &p.alibi_slopes, &p.sinks, &p.out, &p.lse}) {
    rotate(m->outer_stride);
    rotate(m->divisor);
  }
  return p;
}

// Runs the forward pass p on the intra-op threads; with `draw`, with a
// fresh dropout stream, which it records in rng_state (else p has it).
void run_forward(AttentionParams p, double dropout_p, const at::Tensor& rng_state,
                 bool draw = true) {
  // No query rows (an empty batch, head or query dim, or no sequence):
  // nothing to compute, and the work split below would divide by zero.
  if (p.num_outer == 0 || p.len_q == 0) return;
  if (draw) {
    p.dropout = draw_dropout(dropout_p);
    // (Written in place, not as rng_state[i] = x: two ATen ops each, whose
    // dispatch is a noticeable part of a decoding step from cold caches;
    // docs/performance.md, "A decoding call's fixed cost".)
    int64_t* state = rng_state.mutable_data_ptr<int64_t>();  // (2,) int64, contiguous
    state[0] = static_cast<int64_t>(p.dropout.seed);
    state[1] = static_cast<int64_t>(p.dropout.offset);
  }
  const IsaKernels kernels = selected_kernels();
  WorkSplit split = kernels.forward_split(p, available_threads());
  // A mask the batch shares: with the batch dim last, the items take
  // several batch indices of one head, as they take the heads of a mask the
  // heads share, and read and transpose each of its tiles once for them.
  // Only the items' order changes, not what they compute: the outputs are
  // the same to the bit (docs/performance.md, "Batch indices sharing a
  // mask").
  if (const int d = batch_sharing_mask(p, split); d >= 0) {
    p = with_outer_dim_last(p, d);
    split = kernels.forward_split(p, available_threads());
  }
  // Decoding's partial results: in the calling thread's kept buffer (an
  // allocation per call is a noticeable part of a decoding step from cold
  // caches: docs/performance.md, "The arena and kept workspaces"), unless so
  // large that no thread should keep them.
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_cpu(const ops::ForwardArgs& a) {
  ops::check_forward_inputs(ops::kForwardOp, a);
  auto [out, lse, rng_state] =
      ops::allocate_attention_outputs(a.query, a.key, a.value, a.enable_gqa);
  if (a.dropout_state.has_value()) rng_state = ops::returned_rng_state(rng_state, a.dropout_state);
  // No query rows: nothing to compute, and no mask to scan.
  if (lse.numel() == 0) return {out, lse, rng_state};
  ops::AttentionCall call(ops::kForwardOp, a, ops::last_dim_contiguous,
                          /*pack_query_heads=*/true, decode_rows(a.query));
  AttentionParams p = call.forward(out, lse);
  if (a.dropout_state.has_value()) p.dropout = call.replay_dropout(rng_state, a.dropout_p);
  run_forward(p, a.dropout_p, rng_state, /*draw=*/!a.dropout_state.has_value());
  return {out, lse, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_forward_cpu(
    const ops::VarlenForwardArgs& a) {
  ops::check_varlen_forward_inputs(ops::kVarlenForwardOp, a);
  // The kernels sized by the longest sequences, not by max_seqlen_q/k, which
  // may bound them loosely (a cache's capacity, or a generous max): one
  // query per sequence under a max_seqlen_q of 4096 is still decoding, and
  // keys fewer than the bound leave no thread idle.
  ops::PackedBatch batch = ops::packed_batch(a);
  std::tie(batch.max_seqlen_q, batch.max_seqlen_k) =
      ops::check_packed_batch_values(ops::kVarlenForwardOp, batch, a.query.size(0), a.key);
  // (Every row of a sequence is written by the kernel: where they start at
  // row 0, only the rows after the last are filled.)
  const at::Tensor cu_q = a.cu_seqlens_q.contiguous();
  const int32_t* cu = cu_q.const_data_ptr<int32_t>();
  const std::optional<int64_t> covered =
      cu[0] == 0 ? std::optional<int64_t>(cu[cu_q.size(0) - 1]) : std::nullopt;
  auto [out, lse, rng_state] = ops::allocate_varlen_outputs(a.query, a.value, covered);
  ops::AttentionCall call(ops::kVarlenForwardOp, a, batch, ops::last_dim_contiguous,
                          decode_rows(a.query));
  run_forward(call.forward(out, lse), a.dropout_p, rng_state);
  return {out, lse, rng_state};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CPU, m) {
  FUSEDMHA_OP_IMPL(m, attention_forward_cpu);
  FUSEDMHA_OP_IMPL(m, varlen_attention_forward_cpu);
}

}  // namespace fusedmha::cpu
