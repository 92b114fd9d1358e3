// fusedmha::flex_attention, the C++ API of FlexAttention: the block mask's
// dense mask (kept with the BlockMask) and the bias made one attn_mask, and
// the forward op called through the dispatcher, so autograd trains through
// it in C++ as in Python (python/fusedmha/flex.py is the Python side).

#include <fusedmha/flex.h>

#include <ATen/ATen.h>

#include "ops/attention_checks.h"

#include <limits>
#include <utility>
#include <vector>

namespace fusedmha {
namespace {

constexpr const char* kFlexOp = "fusedmha::flex_attention";

// The block mask against the inputs: its lengths, then the batch and heads
// of the dense mask it stands for (those of its lists, or of full lists or
// bits of their own), each 1 or the query's.
at::Tensor dense_mask_for(const BlockMask& m, const at::Tensor& query, const at::Tensor& key) {
  const int64_t L = query.size(2), S = key.size(2);
  TORCH_CHECK(m.q_length == L && m.kv_length == S, kFlexOp, ": block_mask is for (L, S) = (",
              m.q_length, ", ", m.kv_length, "), the inputs have (", L, ", ", S, ")");
  at::Tensor mask = m.dense();
  const int64_t Bm = mask.size(0), Hm = mask.size(1), B = query.size(0), H = query.size(1);
  TORCH_CHECK((Bm == 1 || Bm == B) && (Hm == 1 || Hm == H), kFlexOp,
              ": block_mask is for (B, H) = (", Bm, ", ", Hm, "), the query has (", B, ", ", H,
              "): expected 1 or the query's, each");
  TORCH_CHECK(mask.device() == query.device(), kFlexOp, ": block_mask is on ", mask.device(),
              ", the query on ", query.device());
  return mask;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> flex_attention(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value,
                                                  const std::optional<BlockMask>& block_mask,
                                                  const FlexAttentionOptions& options) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"query", query},
                                {"key", key},
                                {"value", value}}) {
    TORCH_CHECK(t.defined() && t.dim() == 4, kFlexOp, ": expected ", name,
                " of 4 dims (B, H, L or S, E), got ", t.defined() ? t.sizes() : at::IntArrayRef{});
  }
  TORCH_CHECK(query.size(1) == key.size(1) || options.enable_gqa, kFlexOp, ": query has ",
              query.size(1), " heads and key ", key.size(1),
              ": set enable_gqa for grouped-query attention");
  std::optional<at::Tensor> mask;
  if (block_mask) mask = dense_mask_for(*block_mask, query, key);
  if (options.bias) {
    const at::Tensor& bias = *options.bias;
    TORCH_CHECK(bias.defined() && at::isFloatingType(bias.scalar_type()) && bias.dim() <= 4,
                kFlexOp, ": expected bias, a floating tensor broadcastable to (B, H, L, S)");
    TORCH_CHECK(bias.device() == query.device(), kFlexOp, ": bias is on ", bias.device(),
                ", the query on ", query.device());
    const std::vector<c10::SymInt> scores{query.sym_size(0), query.sym_size(1),
                                          query.sym_size(2), key.sym_size(2)};
    TORCH_CHECK(ops::mask_broadcasts_to(bias.sym_sizes(), scores), kFlexOp, ": bias of shape ",
                bias.sizes(), " does not broadcast to (B, H, L, S) = ",
                c10::SymIntArrayRef(scores));
    const at::Tensor b = bias.to(query.scalar_type());
    // (A hidden score is -inf whatever its bias: the bias's gradient is 0 there.)
    mask = mask ? at::where(*mask, b, -std::numeric_limits<double>::infinity()) : b;
  }
  auto [out, lse, rng] = attention_forward(query, key, value, mask, options.dropout_p,
                                           /*is_causal=*/false, options.scale,
                                           options.enable_gqa, options.variants);
  // (The op's lse of a row that sees no key is +inf, for its backward;
  // flex_attention's is -inf.)
  return {out, at::where(lse.isposinf(), -std::numeric_limits<double>::infinity(), lse)};
}

}  // namespace fusedmha
