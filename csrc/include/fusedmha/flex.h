#pragma once

// FlexAttention for C++: torch.nn.attention.flex_attention's BlockMask and
// create_block_mask, and flex_attention over it, trainable (autograd in C++).

#include <fusedmha/attention.h>
#include <fusedmha/macros.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <tuple>

namespace fusedmha {

// A block-sparse mask over queries (q_length) and keys (kv_length) cut into
// blocks of q_block_size × kv_block_size, torch's BlockMask with the partial
// blocks' bits beside it. For batch b, head h and query block i, the key
// blocks kv_indices[b][h][i][0 .. kv_num_blocks[b][h][i]) are partial:
// attended to where their bits are true; full_kv_indices[b][h][i][0 ..
// full_kv_num_blocks[b][h][i]) are full: attended to whole. A key block
// listed in neither is not attended to. Batch and heads of 1 broadcast; a
// block listed as both is full; list each block once.
struct FUSEDMHA_API BlockMask {
  // int32 or int64, (B or 1, H or 1, ceil(q_length / q_block_size)).
  at::Tensor kv_num_blocks;
  // The same dtype, (B or 1, H or 1, ceil(q_length / q_block_size), K),
  // key block indices; entries past kv_num_blocks are not read.
  at::Tensor kv_indices;
  // bool (P, q_block_size, kv_block_size): the bits of each listed partial
  // block, in list order (batch, head, query block, then list position),
  // over the block's own rows and keys (those past the lengths are not
  // read). P is the sum of kv_num_blocks.
  at::Tensor partial_bits;
  // The full blocks, as kv_num_blocks / kv_indices: none when absent.
  std::optional<at::Tensor> full_kv_num_blocks;
  std::optional<at::Tensor> full_kv_indices;
  int64_t q_length = 0;
  int64_t kv_length = 0;
  int64_t q_block_size = 128;
  int64_t kv_block_size = 128;

  BlockMask();

  // The bool mask (B or 1, H or 1, q_length, kv_length) that this block
  // mask stands for (block_mask_dense), on the device of its tensors:
  // computed once and kept, shared by copies of this BlockMask (flex_attention
  // calls with a copy reuse it), until one of its tensors is replaced or
  // changed in place (inference tensors: replaced).
  at::Tensor dense() const;

 private:
  struct DenseCache;
  std::shared_ptr<DenseCache> dense_cache_;
};

// mask_mod(b, h, q_idx, kv_idx) -> bool tensor: true where query q_idx of
// batch b and head h may attend to key kv_idx. Called with int64 index
// tensors that broadcast against each other (b (B, 1, 1, 1), h (1, H, 1,
// 1), q_idx (1, 1, Lc, 1), kv_idx (1, 1, 1, S)); its result broadcasts to
// their shape. Torch's mask_mod, written with ATen ops.
using MaskMod = std::function<at::Tensor(const at::Tensor& b, const at::Tensor& h,
                                         const at::Tensor& q_idx, const at::Tensor& kv_idx)>;

struct BlockMaskOptions {
  int64_t q_block_size = 128;
  int64_t kv_block_size = 128;
  at::Device device = at::kCPU;
};

// torch's create_block_mask: mask_mod evaluated over every (b, h, q_idx,
// kv_idx) with b < B, h < H (B or H of 1: a mask shared by every batch
// index or head), a band of query blocks at a time, and each block sorted
// into full (every element true), partial (kept with its bits) or empty.
FUSEDMHA_API BlockMask create_block_mask(const MaskMod& mask_mod, int64_t B, int64_t H,
                                         int64_t q_length, int64_t kv_length,
                                         const BlockMaskOptions& options = {});

// The bool mask (B, H, L, S) a block mask's lists and bits stand for (op
// fusedmha::block_mask_dense): partial_bits (P, QB, KB) as BlockMask's, or
// (Bp, Hp, P, QB, KB) with bits of their own for each batch index and head
// where the lists have a batch or heads of 1. B is the largest batch of
// the two lists and the bits (each 1 or B), H the same for heads.
// block_size is (QB, KB), seq_lengths (L, S).
FUSEDMHA_API at::Tensor block_mask_dense(const at::Tensor& kv_num_blocks,
                                         const at::Tensor& kv_indices,
                                         const at::Tensor& partial_bits,
                                         std::array<int64_t, 2> block_size,
                                         std::array<int64_t, 2> seq_lengths,
                                         const std::optional<at::Tensor>& full_kv_num_blocks = {},
                                         const std::optional<at::Tensor>& full_kv_indices = {});

// What flex_attention takes beside the block mask. The score_mods fusedmha
// computes: variants.softcap, variants.alibi_slopes (top-left: -slope ·
// |q_idx - kv_idx| unless variants.bottom_right), and bias, a floating
// tensor broadcastable to (B, H, L, S) added to the scores, differentiable;
// the other variants (windows, sinks) and dropout apply too.
struct FlexAttentionOptions {
  std::optional<double> scale;
  bool enable_gqa = false;
  double dropout_p = 0.0;
  std::optional<at::Tensor> bias;
  AttentionVariants variants;
};

// torch's flex_attention for query (B, H, L, E), key (B, H_kv, S, E) and
// value (B, H_kv, S, Ev) under block_mask (none: every key): returns the
// output (B, H, L, Ev) and the log-sum-exp of each row (B, H, L), float32
// (float64 for float64 inputs); a row that sees no key gets 0 and -inf.
// Differentiable with respect to query, key, value, the bias and the sinks.
FUSEDMHA_API std::tuple<at::Tensor, at::Tensor> flex_attention(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const std::optional<BlockMask>& block_mask = std::nullopt,
    const FlexAttentionOptions& options = {});

}  // namespace fusedmha
