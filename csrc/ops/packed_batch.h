#pragma once

// A packed batch of sequences, FlashAttention's "varlen" layout: the
// sequences' rows one after another in q (total_q, H, E), k (total_k, H_kv,
// E) and v (total_k, H_kv, Ev), with H a multiple of H_kv. Sequence b's
// rows start at cu_seqlens_q[b] and cu_seqlens_k[b] (int32, B + 1, on the
// query's device) and end at the next entry; it uses only its first
// seqused_k[b] keys when seqused_k (int32, B) is given. max_seqlen_q/k
// bound the sequences' lengths. With block_table (int32, (B, pages per
// sequence)), k and v are a paged cache instead, (num_pages, page_size,
// H_kv, E/Ev): key j of sequence b is row j % page_size of page
// block_table[b, j / page_size], and cu_seqlens_k (or seqused_k) only gives
// the sequences' key counts. Paged calls are forward only. With k_scale
// and v_scale (float32, k's and v's shapes without the last dim), k and v
// are quantized: 8-bit codes whose values are code · scale (forward only).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace fusedmha::ops {

struct PackedBatch {
  at::Tensor cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  std::optional<at::Tensor> seqused_k;
  std::optional<at::Tensor> block_table;
  std::optional<at::Tensor> k_scale, v_scale;
};

}  // namespace fusedmha::ops
