// fusedmha::attention_with_kvcache: one generation step against a KV cache,
// FlashAttention's flash_attn_with_kvcache. The new keys and values are
// appended to the cache in place (rotary embedding applied first, when
// given), then the queries attend over the cache through the kernels that
// read it best:
//  - a paged cache (block_table), or caches chosen by cache_batch_idx (each
//    read as one page): varlen_attention_forward with the block table;
//  - a batch whose sequences share one length, on the CPU: attention_forward
//    over a view of the cache (decoding reads each K/V head once for the
//    query heads it serves);
//  - otherwise: varlen_attention_forward over the cache as a packed batch,
//    each sequence from its left padding, seqused_k keys long.
// Composed of ATen ops and fusedmha's ops (CompositeImplicitAutograd), for
// inference: no gradients.

#include "ops/attention_checks.h"

#include <fusedmha/attention.h>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

namespace fusedmha {
namespace {

constexpr const char* kOp = "fusedmha.attention_with_kvcache";
using OptTensor = std::optional<at::Tensor>;

// Rotary embedding of the first 2·cos.size(1) dims of x (B, L, H, E) at
// positions (B, L): adjacent pairs (interleaved, GPT-J) or the two halves
// (GPT-NeoX) rotated by the angles whose cos and sin the tables hold.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& positions, bool interleaved) {
  const int64_t half = cos.size(1), B = x.size(0), L = x.size(1);
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor flat = positions.flatten();
  const at::Tensor c = cos.index_select(0, flat).view({B, L, 1, half}).to(acc);
  const at::Tensor s = sin.index_select(0, flat).view({B, L, 1, half}).to(acc);
  const at::Tensor head = x.narrow(-1, 0, 2 * half).to(acc);
  at::Tensor rotated;
  if (interleaved) {
    const at::Tensor x1 = head.slice(-1, 0, std::nullopt, 2), x2 = head.slice(-1, 1, std::nullopt, 2);
    rotated = at::stack({x1 * c - x2 * s, x1 * s + x2 * c}, -1).flatten(-2);
  } else {
    const at::Tensor x1 = head.narrow(-1, 0, half), x2 = head.narrow(-1, half, half);
    rotated = at::cat({x1 * c - x2 * s, x1 * s + x2 * c}, -1);
  }
  return at::cat({rotated.to(x.scalar_type()), x.narrow(-1, 2 * half, x.size(-1) - 2 * half)}, -1);
}

// An int32 (B) tensor of per-sequence values on device, or `fallback` for all.
at::Tensor per_sequence(const OptTensor& t, int64_t B, int64_t fallback, const char* name,
                        const at::Device& device) {
  if (!t.has_value()) return at::full({B}, fallback, at::TensorOptions(device).dtype(at::kInt));
  TORCH_CHECK(t->dim() == 1 && t->size(0) == B && !at::isFloatingType(t->scalar_type()), kOp,
              ": expected ", name, " as an integer tensor of shape (B) = (", B, "), got ",
              t->scalar_type(), " of shape ", t->sizes());
  return t->to(device, at::kInt);
}

// The caches are written in place: each must hold distinct elements (not an
// expand()ed view) and share none with the other or with the new rows, or
// a write would land on rows that are read or written again. Their dtype and
// device are checked here too, so that errors name this op, not the kernel
// it hands the call to.
void check_caches(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const OptTensor& k, const OptTensor& v) {
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), kOp,
              ": expected q of dtype float32, float64, bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              kOp, ": expected k_cache and v_cache of q's dtype (", q.scalar_type(), "), got ",
              k_cache.scalar_type(), " and ", v_cache.scalar_type());
  TORCH_CHECK(k_cache.device() == q.device() && v_cache.device() == q.device(), kOp,
              ": expected k_cache and v_cache on q's device (", q.device(), "), got ",
              k_cache.device(), " and ", v_cache.device());
  if (k.has_value() && v.has_value()) {
    TORCH_CHECK(k->device() == q.device() && v->device() == q.device(), kOp,
                ": expected k and v on q's device (", q.device(), "), got ", k->device(), " and ",
                v->device());
    TORCH_CHECK(at::isFloatingType(k->scalar_type()) && at::isFloatingType(v->scalar_type()), kOp,
                ": expected floating-point k and v, got ", k->scalar_type(), " and ",
                v->scalar_type());
  }
  TORCH_CHECK(at::has_internal_overlap(k_cache) != at::MemOverlap::Yes &&
                  at::has_internal_overlap(v_cache) != at::MemOverlap::Yes,
              kOp, ": k_cache and v_cache are written in place and must not have elements that "
              "share memory (an expand()ed view, for one); pass a contiguous cache");
  // (TooHard, a layout whose overlap the check can't decide, is let through)
  auto shares = [](const at::Tensor& a, const at::Tensor& b) {
    const at::MemOverlapStatus status = at::get_overlap_status(a, b);
    return status == at::MemOverlapStatus::Full || status == at::MemOverlapStatus::Partial;
  };
  TORCH_CHECK(!shares(k_cache, v_cache), kOp,
              ": k_cache and v_cache are written in place and must not share memory");
  for (const OptTensor* t : {&k, &v}) {
    if (!t->has_value()) continue;
    TORCH_CHECK(!shares(k_cache, **t) && !shares(v_cache, **t),
                kOp, ": the new k and v must not share memory with k_cache or v_cache");
  }
}

std::tuple<at::Tensor, at::Tensor> attention_with_kvcache_composite(
    const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const OptTensor& k,
    const OptTensor& v, const OptTensor& rotary_cos, const OptTensor& rotary_sin,
    const OptTensor& cache_seqlens, const OptTensor& cache_batch_idx,
    const OptTensor& cache_leftpad, const OptTensor& block_table, std::optional<double> scale,
    bool is_causal, bool rotary_interleaved, int64_t window_left, int64_t window_right,
    double softcap, const OptTensor& alibi_slopes, const OptTensor& sinks) {
  const at::NoGradGuard inference_only;
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4, kOp,
              ": expected q (B, L, H, E) and k_cache/v_cache (B_cache, S_cache, H_kv, E) or "
              "pages (num_pages, page_size, H_kv, E), got ", q.sizes(), ", ", k_cache.sizes(),
              " and ", v_cache.sizes());
  check_caches(q, k_cache, v_cache, k, v);
  TORCH_CHECK(k.has_value() == v.has_value(), kOp, ": pass k and v together");
  TORCH_CHECK(rotary_cos.has_value() == rotary_sin.has_value(), kOp,
              ": pass rotary_cos and rotary_sin together");
  const bool paged = block_table.has_value();
  TORCH_CHECK(!paged || (!cache_batch_idx.has_value() && !cache_leftpad.has_value()), kOp,
              ": cache_batch_idx and cache_leftpad are not supported with block_table (a paged "
              "KV cache)");
  const int64_t B = q.size(0), L = q.size(1), page = k_cache.size(1);
  const int64_t rows_per_sequence = paged ? page * block_table->size(1) : page;
  const int64_t added = k.has_value() ? k->size(1) : 0;
  const at::Device device = q.device();
  TORCH_CHECK(cache_seqlens.has_value() || !k.has_value(), kOp,
              ": cache_seqlens is needed to append k/v");
  const at::Tensor seqlens = per_sequence(cache_seqlens, B, rows_per_sequence, "cache_seqlens", device);
  const at::Tensor leftpad = per_sequence(cache_leftpad, B, 0, "cache_leftpad", device);
  if (k.has_value()) {
    TORCH_CHECK(k->dim() == 4 && k->size(0) == B && v->sizes() == k->sizes(), kOp,
                ": expected k and v (B, L_new, H_kv, E) with B = ", B, ", got ", k->sizes(),
                " and ", v->sizes());
  }
  if (device.is_cpu()) {  // (on a GPU, reading them would wait for it)
    TORCH_CHECK(seqlens.add(added).le(rows_per_sequence).all().item<bool>() &&
                    leftpad.ge(0).all().item<bool>() && leftpad.le(seqlens).all().item<bool>(),
                kOp, ": cache_seqlens + ", added, " new rows must fit the cache's ",
                rows_per_sequence, " rows per sequence, and 0 <= cache_leftpad <= cache_seqlens");
  }

  // Rotary embedding at the positions counted from the left padding: the new
  // keys at cache_seqlens + i; the queries there too when causal or windowed
  // (they are the last positions), else all at cache_seqlens.
  at::Tensor query = q;
  OptTensor new_k = k;
  if (rotary_cos.has_value()) {
    const at::Tensor start = seqlens.sub(leftpad).to(at::kLong).unsqueeze(1);
    const auto steps = at::arange(std::max(L, added), at::TensorOptions(device).dtype(at::kLong));
    const bool moving = is_causal || window_left >= 0 || window_right >= 0;
    query = rotate(q, *rotary_cos, *rotary_sin,
                   moving ? start + steps.narrow(0, 0, L) : start.expand({B, L}),
                   rotary_interleaved);
    if (k.has_value()) {
      new_k = rotate(*k, *rotary_cos, *rotary_sin, start + steps.narrow(0, 0, added),
                     rotary_interleaved);
    }
  }
  const at::Tensor batch_idx = cache_batch_idx.has_value()
                                   ? cache_batch_idx->to(device, at::kLong)
                                   : at::arange(B, at::TensorOptions(device).dtype(at::kLong));
  if (k.has_value()) {
    const at::Tensor rows =
        seqlens.to(at::kLong).unsqueeze(1) + at::arange(added, batch_idx.options());
    if (paged) {
      const at::Tensor pages = block_table->to(at::kLong).gather(1, rows.div(page, "floor"));
      k_cache.index_put_({pages, rows.remainder(page)}, new_k->to(k_cache.scalar_type()));
      v_cache.index_put_({pages, rows.remainder(page)}, v->to(v_cache.scalar_type()));
    } else {
      k_cache.index_put_({batch_idx.unsqueeze(1), rows}, new_k->to(k_cache.scalar_type()));
      v_cache.index_put_({batch_idx.unsqueeze(1), rows}, v->to(v_cache.scalar_type()));
    }
  }

  const at::Tensor used = seqlens.add(added);
  AttentionVariants variants{window_left, window_right, /*bottom_right=*/true, softcap,
                             alibi_slopes, sinks};
  const auto int32 = at::TensorOptions(device).dtype(at::kInt);
  const at::Tensor cu_q = at::arange(B + 1, int32).mul(L);
  const at::Tensor packed_q = query.reshape({B * L, query.size(2), query.size(3)});
  // (B·L rows, H) out and (H, B·L) lse as flash_attn returns them: (B, L, H, E), (B, H, L).
  auto unpack = [&](const at::Tensor& out, const at::Tensor& lse) {
    return std::make_tuple(out.view({B, L, out.size(1), out.size(2)}),
                           lse.view({lse.size(0), B, L}).transpose(0, 1));
  };
  const bool no_leftpad = !cache_leftpad.has_value() || !leftpad.any().item<bool>();
  if (paged || (cache_batch_idx.has_value() && no_leftpad)) {
    // A block table; caches chosen by cache_batch_idx are each one page.
    const at::Tensor table = paged ? *block_table : batch_idx.to(at::kInt).view({B, 1});
    const at::Tensor cu_k = at::cat({at::zeros({1}, int32), used.cumsum(0).to(at::kInt)});
    auto [out, lse, rng] = varlen_attention_forward(packed_q, k_cache, v_cache, cu_q, cu_k, L,
                                                    rows_per_sequence, 0.0, is_causal, scale,
                                                    variants, std::nullopt, table);
    return unpack(out, lse);
  }
  at::Tensor keys = k_cache.narrow(0, 0, B), values = v_cache.narrow(0, 0, B);
  if (cache_batch_idx.has_value()) {  // (with left padding: the chosen caches copied)
    keys = k_cache.index_select(0, batch_idx);
    values = v_cache.index_select(0, batch_idx);
  }
  if (device.is_cpu() && no_leftpad && used.eq(used[0]).all().item<bool>()) {
    const int64_t n = used[0].item<int64_t>();
    const at::Tensor qh = query.transpose(1, 2);
    const at::Tensor kh = keys.narrow(1, 0, n).transpose(1, 2), vh = values.narrow(1, 0, n).transpose(1, 2);
    auto [out, lse, rng] = attention_forward(qh, kh, vh, std::nullopt, 0.0, is_causal, scale,
                                             qh.size(1) != kh.size(1), variants);
    return {out.transpose(1, 2), lse};
  }
  const int64_t S = keys.size(1);
  const at::Tensor starts = at::cat({at::arange(B, int32).mul(S).add(leftpad), at::full({1}, B * S, int32)});
  auto [out, lse, rng] = varlen_attention_forward(
      packed_q, keys.reshape({B * S, keys.size(2), keys.size(3)}),
      values.reshape({B * S, values.size(2), values.size(3)}), cu_q, starts, L, S, 0.0,
      is_causal, scale, variants, used.sub(leftpad).to(at::kInt));
  return unpack(out, lse);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CompositeImplicitAutograd, m) {
  m.impl("attention_with_kvcache", TORCH_FN(attention_with_kvcache_composite));
}

}  // namespace fusedmha
