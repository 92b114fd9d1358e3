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
// For inference: no gradients. Composed of ATen ops and fusedmha's ops, but
// registered for the CPU and CUDA keys with a shape kernel (Meta), so that
// torch.compile sees one opaque op: which path runs depends on values read
// on the host (on the CPU the lengths, on a GPU whether any sequence is
// left-padded: CacheSequences), which fake tensors do not have. It computes
// in the caches' dtype: autocast
// does not reach the ops it calls (a cast of the whole cache each step, and
// only where one path has an autocast kernel).

#include "ops/attention_checks.h"
#include "ops/kv_quantization.h"
#include "ops/op_args.h"
#include "ops/tensor_overlap.h"
#include "ops/quick_views.h"

#include <fusedmha/attention.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>
#include <vector>

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

// A tensor on the CPU of dtype int32 (or int64) holding `values`.
at::Tensor host_tensor(const std::vector<int64_t>& values, at::ScalarType dtype = at::kInt) {
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, dtype);
  if (dtype == at::kLong) {
    std::copy(values.begin(), values.end(), t.mutable_data_ptr<int64_t>());
  } else {
    std::copy(values.begin(), values.end(), t.mutable_data_ptr<int32_t>());
  }
  return t;
}

// A per-sequence integer tensor (B) checked: on q's device or the CPU.
const at::Tensor& checked_per_sequence(const at::Tensor& t, int64_t B, const char* name,
                                       const at::Device& device) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == B && !at::isFloatingType(t.scalar_type()), kOp,
              ": expected ", name, " as an integer tensor of shape (B) = (", B, "), got ",
              t.scalar_type(), " of shape ", t.sizes());
  TORCH_CHECK(t.device() == device || t.is_cpu(), kOp, ": expected ", name,
              " on q's device (", device, ") or the CPU, got ", t.device());
  return t;
}

// On a GPU: an int32 (B) tensor of per-sequence values on the device, or
// `fallback` for all.
at::Tensor per_sequence(const OptTensor& t, int64_t B, int64_t fallback, const char* name,
                        const at::Device& device) {
  if (!t.has_value()) return at::full({B}, fallback, at::TensorOptions(device).dtype(at::kInt));
  return checked_per_sequence(*t, B, name, device).to(device, at::kInt);
}

// t (4-d) with dims 1 and 2 swapped, (B, L, H, E) as (B, H, L, E) or back,
// keeping the first `batch` of dim 0 and the first `rows` of dim 1.
// (ops/quick_views.h: without the dispatcher, where t allows)
at::Tensor swap_dims_1_2(const at::Tensor& t, int64_t batch, int64_t rows) {
  if (!ops::views_quickly(t)) return t.narrow(0, 0, batch).narrow(1, 0, rows).transpose(1, 2);
  return ops::strided_view(t, {batch, t.size(2), rows, t.size(3)},
                           {t.stride(0), t.stride(2), t.stride(1), t.stride(3)});
}

// 0, 1, ..., n - 1.
std::vector<int64_t> first_integers(int64_t n) {
  std::vector<int64_t> x(n);
  std::iota(x.begin(), x.end(), int64_t{0});
  return x;
}

// The values of a small integer tensor on the CPU (lengths, indices), read
// once: checked and summed in plain loops, where each ATen reduction and
// .item() is an op dispatched, and tens of them are a large part of a
// decoding step (docs/performance.md, "A decoding call's fixed cost").
// (int32 and int64 are read in place, without a conversion op.)
std::vector<int64_t> host_values(const at::Tensor& t) {
  const bool in_place = t.scalar_type() == at::kInt || t.scalar_type() == at::kLong;
  const at::Tensor c = in_place ? t.contiguous() : t.to(at::kLong).contiguous();
  auto values = [&](const auto* x) { return std::vector<int64_t>(x, x + c.numel()); };
  return c.scalar_type() == at::kInt ? values(c.const_data_ptr<int32_t>())
                                     : values(c.const_data_ptr<int64_t>());
}

// Each sequence's cache length before the append (seqlens), left padding and
// cache index. On the CPU their values, read once: checked and summed in
// plain loops, and made into tensors only where a path needs one (each ATen
// call adds to a decoding step's fixed cost: docs/performance.md, "A
// decoding call's fixed cost"). On a GPU they stay device tensors, and the
// lengths and indices are never read on the host (that would wait for the
// device). The one value read there is a bool, where cache_leftpad is given:
// whether any sequence is left-padded (attend()'s no_leftpad, one .item(),
// which waits for the device), because caches chosen by cache_batch_idx
// are read in place as one page each only when none is; otherwise they are
// copied and attended from their padding.
struct CacheSequences {
  bool on_cpu;
  std::vector<int64_t> lens, pads, idx;    // (CPU)
  at::Tensor seqlens, leftpad, batch_idx;  // (GPU: int32, int32, int64)

  // The positions of the first new rows, counted from the left padding: (B, 1) int64.
  at::Tensor first_positions() const {
    if (!on_cpu) return seqlens.sub(leftpad).to(at::kLong).unsqueeze(1);
    std::vector<int64_t> x(lens.size());
    for (size_t b = 0; b < x.size(); ++b) x[b] = lens[b] - pads[b];
    return host_tensor(x, at::kLong).unsqueeze(1);
  }
  at::Tensor lengths(at::ScalarType dtype) const {
    return on_cpu ? host_tensor(lens, dtype) : seqlens.to(dtype);
  }
  at::Tensor indices(at::ScalarType dtype) const {
    return on_cpu ? host_tensor(idx, dtype) : batch_idx.to(dtype);
  }
};

// The append on the CPU as row copies, where each cache row (H_kv, E), or
// each scale row (H_kv) of a quantized cache, is contiguous (the usual
// caches): the general path, index_put_ with index tensors, is a dozen ATen
// ops per call, a large share of a short decoding step
// (docs/performance.md, "A decoding call's fixed cost").
// Keeps the bytes it overwrites, for undo().
class RowAppend {
 public:
  // Whether t's rows, its dims past the first two, are contiguous.
  static bool applies(const at::Tensor& t) {
    int64_t contiguous_stride = 1;
    for (int64_t d = t.dim() - 1; d >= 2; --d) {
      if (t.size(d) > 1 && t.stride(d) != contiguous_stride) return false;
      contiguous_stride *= t.size(d);
    }
    return t.is_cpu();
  }
  // Row n of rows (B, added, ...), n = b·added + i, into the cache's row
  // places[n] = (cache or page index, row). (The caller bumps the caches'
  // versions first, as an in-place op would: that may refuse.)
  RowAppend(const at::Tensor& cache, const at::Tensor& rows,
            const std::vector<std::pair<int64_t, int64_t>>& places)
      : row_bytes_(c10::multiply_integers(cache.sizes().slice(2)) * cache.element_size()) {
    if (row_bytes_ == 0) return;  // (rows of no elements: nothing to copy, no buffers)
    const at::Tensor src = rows.scalar_type() == cache.scalar_type() && rows.is_contiguous()
                               ? rows
                               : rows.to(cache.scalar_type()).contiguous();
    const char* from = static_cast<const char*>(src.const_data_ptr());
    char* base = static_cast<char*>(cache.mutable_data_ptr());
    saved_.resize(places.size() * row_bytes_);
    for (size_t n = 0; n < places.size(); ++n) {
      const auto [index, row] = places[n];
      char* to = base + (index * cache.stride(0) + row * cache.stride(1)) * cache.element_size();
      std::memcpy(saved_.data() + n * row_bytes_, to, row_bytes_);
      std::memcpy(to, from + n * row_bytes_, row_bytes_);
      rows_.push_back(to);
    }
  }
  // (In reverse: a row written twice gets its first old bytes back.)
  void undo() {
    for (size_t n = rows_.size(); n-- > 0;) {
      std::memcpy(rows_[n], saved_.data() + n * row_bytes_, row_bytes_);
    }
  }

 private:
  int64_t row_bytes_;
  std::vector<char> saved_;
  std::vector<char*> rows_;
};

// The caches and the new rows on q's device.
void check_devices(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const OptTensor& k, const OptTensor& v) {
  TORCH_CHECK(k_cache.device() == q.device() && v_cache.device() == q.device(), kOp,
              ": expected k_cache and v_cache on q's device (", q.device(), "), got ",
              k_cache.device(), " and ", v_cache.device());
  if (k.has_value() && v.has_value()) {
    TORCH_CHECK(k->device() == q.device() && v->device() == q.device(), kOp,
                ": expected k and v on q's device (", q.device(), "), got ", k->device(), " and ",
                v->device());
  }
}

// Quantized caches: codes of one 8-bit dtype, and float32 scales of the
// caches' shapes without the last dim, on q's device.
void check_quantized_caches(const ops::KVCacheArgs& a) {
  TORCH_CHECK(a.k_scale.has_value() && a.v_scale.has_value(), kOp,
              ": pass k_scale and v_scale together (a quantized cache)");
  TORCH_CHECK(ops::kv_storage_of(a.k_cache.scalar_type()) != KVStorage::Dense &&
                  a.v_cache.scalar_type() == a.k_cache.scalar_type(),
              kOp, ": with k_scale and v_scale, expected k_cache and v_cache of one quantized "
              "dtype (int8, float8_e4m3fn or float8_e5m2), got ", a.k_cache.scalar_type(), " and ",
              a.v_cache.scalar_type());
  for (const auto& [name, s, cache] : {std::make_tuple("k_scale", &*a.k_scale, &a.k_cache),
                                       std::make_tuple("v_scale", &*a.v_scale, &a.v_cache)}) {
    const c10::SymIntArrayRef rows = cache->sym_sizes().slice(0, 3);
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->sym_sizes() == rows &&
                    s->device() == a.q.device(),
                kOp, ": expected ", name, " of dtype float32 and shape ", rows,
                " (the cache's without its last dim) on q's device (", a.q.device(), "), got ",
                s->scalar_type(), " of shape ", s->sym_sizes(), " on ", s->device());
  }
}

// The checks that need no values, for the real kernel and the shape kernel
// alike: ranks, arguments that go together, dtypes, devices. (Every tensor's
// device: one meta tensor among CPU ones sends a call to the shape kernel.)
void check_arguments(const ops::KVCacheArgs& a) {
  auto& [q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
         cache_leftpad, block_table, scale, is_causal, rotary_interleaved, window_left,
         window_right, softcap, alibi_slopes, sinks, cache_seqlens_sym, k_scale, v_scale] = a;
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4, kOp,
              ": expected q (B, L, H, E) and k_cache/v_cache (B_cache, S_cache, H_kv, E) or "
              "pages (num_pages, page_size, H_kv, E), got ", q.sym_sizes(), ", ",
              k_cache.sym_sizes(), " and ", v_cache.sym_sizes());
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), kOp,
              ": expected q of dtype float32, float64, bfloat16 or float16, got ", q.scalar_type());
  if (k_scale.has_value() || v_scale.has_value()) {
    check_quantized_caches(a);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() &&
                    v_cache.scalar_type() == q.scalar_type(),
                kOp, ": expected k_cache and v_cache of q's dtype (", q.scalar_type(), "), got ",
                k_cache.scalar_type(), " and ", v_cache.scalar_type(),
                ops::kv_storage_of(k_cache.scalar_type()) != KVStorage::Dense
                    ? " (a quantized cache needs k_scale and v_scale)"
                    : "");
  }
  check_devices(q, k_cache, v_cache, k, v);
  TORCH_CHECK(k.has_value() == v.has_value(), kOp, ": pass k and v together");
  TORCH_CHECK(rotary_cos.has_value() == rotary_sin.has_value(), kOp,
              ": pass rotary_cos and rotary_sin together");
  TORCH_CHECK(!(cache_seqlens.has_value() && cache_seqlens_sym.has_value()), kOp,
              ": pass cache_seqlens as a tensor or as cache_seqlens_value, not both");
  TORCH_CHECK(cache_seqlens.has_value() || cache_seqlens_sym.has_value() || !k.has_value(), kOp,
              ": cache_seqlens is needed to append k/v");
  const std::pair<const char*, const OptTensor*> on_q_device[] = {
      {"rotary_cos", &rotary_cos}, {"rotary_sin", &rotary_sin}, {"block_table", &block_table},
      {"alibi_slopes", &alibi_slopes}, {"sinks", &sinks}};
  for (const auto& [name, t] : on_q_device) {
    TORCH_CHECK(!t->has_value() || (*t)->device() == q.device(), kOp, ": expected ", name,
                " on q's device (", q.device(), "), got ", (*t)->device());
  }
  const std::pair<const char*, const OptTensor*> on_q_device_or_cpu[] = {
      {"cache_seqlens", &cache_seqlens}, {"cache_batch_idx", &cache_batch_idx},
      {"cache_leftpad", &cache_leftpad}};
  for (const auto& [name, t] : on_q_device_or_cpu) {
    TORCH_CHECK(!t->has_value() || (*t)->device() == q.device() || (*t)->is_cpu(), kOp,
                ": expected ", name, " on q's device (", q.device(), ") or the CPU, got ",
                (*t)->device());
  }
}

// The caches are written in place: each must hold distinct elements (not an
// expand()ed view) and share none with the other or with the new rows, or
// a write would land on rows that are read or written again. (Dtypes and
// devices are checked here and in check_arguments, so that errors name this
// op, not the kernel it hands the call to.)
void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, const OptTensor& k,
                  const OptTensor& v, const OptTensor& k_scale, const OptTensor& v_scale) {
  if (k.has_value() && v.has_value()) {
    TORCH_CHECK(at::isFloatingType(k->scalar_type()) && at::isFloatingType(v->scalar_type()), kOp,
                ": expected floating-point k and v, got ", k->scalar_type(), " and ",
                v->scalar_type());
  }
  TORCH_CHECK(!ops::may_overlap_itself(k_cache) && !ops::may_overlap_itself(v_cache),
              kOp, ": k_cache and v_cache are written in place and must not have elements that "
              "share memory (an expand()ed view, for one); pass a contiguous cache");
  const auto shares = ops::may_share_memory;
  TORCH_CHECK(!shares(k_cache, v_cache), kOp,
              ": k_cache and v_cache are written in place and must not share memory");
  for (const OptTensor* t : {&k, &v}) {
    if (!t->has_value()) continue;
    TORCH_CHECK(!shares(k_cache, **t) && !shares(v_cache, **t),
                kOp, ": the new k and v must not share memory with k_cache or v_cache");
  }
  if (!k_scale.has_value()) return;
  // A quantized cache's scales are written in place too.
  const at::Tensor &ks = *k_scale, &vs = *v_scale;
  TORCH_CHECK(!ops::may_overlap_itself(ks) && !ops::may_overlap_itself(vs) && !shares(ks, vs), kOp,
              ": k_scale and v_scale are written in place and must not share memory (with each "
              "other or within themselves)");
  for (const OptTensor* t : {&k, &v}) {
    TORCH_CHECK(!t->has_value() ||
                    (!shares(ks, **t) && !shares(vs, **t)),
                kOp, ": the new k and v must not share memory with k_scale or v_scale");
  }
  TORCH_CHECK(!shares(ks, k_cache) && !shares(ks, v_cache) && !shares(vs, k_cache) &&
                  !shares(vs, v_cache),
              kOp, ": k_scale and v_scale must not share memory with k_cache or v_cache");
}

// The attention over the caches once the new rows are in: seqlens + added
// keys per sequence, from its left padding.
std::tuple<at::Tensor, at::Tensor> attend(
    const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const OptTensor& k_scale, const OptTensor& v_scale, const CacheSequences& seq, int64_t added,
    bool paged,
    bool chosen_caches, bool has_leftpad, const OptTensor& block_table, int64_t page,
    int64_t rows_per_sequence, std::optional<double> scale, bool is_causal,
    const AttentionVariants& variants) {
  const int64_t B = query.size(0), L = query.size(1);
  const at::Device device = query.device();
  const bool on_cpu = device.is_cpu();
  std::vector<int64_t> used_host = seq.lens;  // (CPU)
  for (int64_t& n : used_host) n += added;

  const auto int32 = at::TensorOptions(device).dtype(at::kInt);
  // Cumulative lengths: (on the CPU, from the values read once)
  auto cumulative = [&](const std::vector<int64_t>& lengths) {
    std::vector<int64_t> cu(lengths.size() + 1, 0);
    for (size_t b = 0; b < lengths.size(); ++b) cu[b + 1] = cu[b] + lengths[b];
    return host_tensor(cu);
  };
  auto cu_q = [&] {
    return on_cpu ? cumulative(std::vector<int64_t>(B, L)) : at::arange(B + 1, int32).mul(L);
  };
  auto packed_q = [&] { return ops::quick_flatten_01(query); };
  auto used = [&] { return seq.seqlens.add(added); };  // (GPU)
  // (B·L rows, H) out and (H, B·L) lse as flash_attn returns them: (B, L, H, E), (B, H, L).
  // (contiguous, whichever path ran: the meta kernel below cannot know which)
  auto unpack = [&](const at::Tensor& out, const at::Tensor& lse) {
    if (!ops::views_quickly(out) || !ops::views_quickly(lse)) {
      return std::make_tuple(out.view({B, L, out.size(1), out.size(2)}),
                             lse.view({lse.size(0), B, L}).transpose(0, 1).contiguous());
    }
    // (both contiguous, as the packed kernels return them)
    return std::make_tuple(
        ops::strided_view(out, {B, L, out.size(1), out.size(2)},
                          {L * out.stride(0), out.stride(0), out.stride(1), out.stride(2)}),
        ops::strided_view(lse, {B, lse.size(0), L},
                          {L * lse.stride(1), lse.stride(0), lse.stride(1)})
            .contiguous());
  };
  const bool no_leftpad =
      !has_leftpad ||
      (on_cpu ? std::all_of(seq.pads.begin(), seq.pads.end(), [](int64_t x) { return x == 0; })
              : !seq.leftpad.any().item<bool>());
  // (caches of no rows are no pages: they take the last path)
  if (paged || (chosen_caches && no_leftpad && page > 0)) {
    // A block table; caches chosen by cache_batch_idx are each one page.
    const at::Tensor table = paged ? *block_table : seq.indices(at::kInt).view({B, 1});
    const at::Tensor cu_k = on_cpu ? cumulative(used_host)
                                   : at::cat({at::zeros({1}, int32), used().cumsum(0).to(at::kInt)});
    auto [out, lse, rng] = varlen_attention_forward(packed_q(), k_cache, v_cache, cu_q(), cu_k, L,
                                                    rows_per_sequence, 0.0, is_causal, scale,
                                                    variants, std::nullopt, table, k_scale,
                                                    v_scale);
    return unpack(out, lse);
  }
  // (caches chosen by cache_batch_idx, with left padding: copied)
  const at::Tensor index = chosen_caches ? seq.indices(at::kLong) : at::Tensor();
  // (the first B caches are read in place)
  auto chosen = [&](const at::Tensor& t) { return chosen_caches ? t.index_select(0, index) : t; };
  const at::Tensor keys = chosen(k_cache), values = chosen(v_cache);
  const bool quantized = k_scale.has_value();
  // (A quantized cache takes the packed path: the scales are its fields.)
  if (on_cpu && B > 0 && no_leftpad && !quantized &&
      std::all_of(used_host.begin(), used_host.end(), [&](int64_t x) { return x == used_host[0]; })) {
    // The caches' first n rows as (B, H_kv, n, E), q as (B, H, L, E).
    const int64_t n = used_host[0];
    const at::Tensor qh = swap_dims_1_2(query, B, L);
    const at::Tensor kh = swap_dims_1_2(keys, B, n), vh = swap_dims_1_2(values, B, n);
    auto [out, lse, rng] = attention_forward(qh, kh, vh, std::nullopt, 0.0, is_causal, scale,
                                             qh.size(1) != kh.size(1), variants);
    return {swap_dims_1_2(out, B, out.size(1)).contiguous(), lse.contiguous()};
  }
  const int64_t S = keys.size(1);
  // Each sequence's first key (past its left padding), then the keys past it.
  at::Tensor starts, lengths;
  if (on_cpu) {
    std::vector<int64_t> first(B + 1, B * S), n = used_host;
    for (int64_t b = 0; b < B; ++b) {
      first[b] = b * S + seq.pads[b];
      n[b] -= seq.pads[b];
    }
    starts = host_tensor(first);
    lengths = host_tensor(n);
  } else {
    starts = at::cat({at::arange(B, int32).mul(S).add(seq.leftpad), at::full({1}, B * S, int32)});
    lengths = used().sub(seq.leftpad).to(at::kInt);
  }
  // (B·S rows of the first B caches, and of their scales)
  auto rows = [&](const at::Tensor& t) {
    std::vector<int64_t> shape{B * S};
    shape.insert(shape.end(), t.sizes().begin() + 2, t.sizes().end());
    return t.narrow(0, 0, B).reshape(shape);
  };
  OptTensor key_scales, value_scales;
  if (quantized) key_scales = rows(chosen(*k_scale)), value_scales = rows(chosen(*v_scale));
  auto [out, lse, rng] = varlen_attention_forward(
      packed_q(), rows(keys), rows(values), cu_q(), starts, L, S, 0.0, is_causal, scale, variants,
      lengths, std::nullopt, key_scales, value_scales);
  return unpack(out, lse);
}


std::tuple<at::Tensor, at::Tensor> attention_with_kvcache_kernel(const ops::KVCacheArgs& a) {
  auto& [q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
         cache_leftpad, block_table, scale, is_causal, rotary_interleaved, window_left,
         window_right, softcap, alibi_slopes, sinks, cache_seqlens_sym, k_scale, v_scale] = a;
  const at::NoGradGuard inference_only;
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  // (A backend kernel gets real tensors, so the int is concrete.)
  const std::optional<int64_t> cache_seqlens_value =
      cache_seqlens_sym.has_value() ? std::optional<int64_t>(cache_seqlens_sym->expect_int())
                                    : std::nullopt;
  check_arguments(a);
  check_caches(k_cache, v_cache, k, v, k_scale, v_scale);
  const bool paged = block_table.has_value();
  TORCH_CHECK(!paged || (!cache_batch_idx.has_value() && !cache_leftpad.has_value()), kOp,
              ": cache_batch_idx and cache_leftpad are not supported with block_table (a paged "
              "KV cache)");
  TORCH_CHECK(v_cache.sizes().slice(0, 3) == k_cache.sizes().slice(0, 3), kOp,
              ": expected v_cache with k_cache's first three sizes (B_cache or num_pages, "
              "S_cache or page_size, H_kv), got k_cache ", k_cache.sizes(), " and v_cache ",
              v_cache.sizes());
  if (paged) {
    TORCH_CHECK(block_table->dim() == 2 && block_table->size(0) == q.size(0) &&
                    block_table->scalar_type() == at::kInt && block_table->device() == q.device(),
                kOp, ": expected block_table int32 (B, pages per sequence) with B = ", q.size(0),
                " on q's device, got ", block_table->scalar_type(), " of shape ",
                block_table->sizes(), " on ", block_table->device());
  } else {
    TORCH_CHECK(cache_batch_idx.has_value() || k_cache.size(0) >= q.size(0), kOp,
                ": expected a cache for each of the B = ", q.size(0), " sequences (k_cache (B_cache, "
                "S_cache, H_kv, E) with B_cache >= B, or cache_batch_idx), got k_cache ",
                k_cache.sizes());
  }
  const int64_t B = q.size(0), L = q.size(1), page = k_cache.size(1);
  const int64_t rows_per_sequence = paged ? page * block_table->size(1) : page;
  const int64_t added = k.has_value() ? k->size(1) : 0;
  const at::Device device = q.device();
  // (Checked before it becomes an int32 tensor, where a value past 2^31 would wrap.)
  TORCH_CHECK(!cache_seqlens_value.has_value() ||
                  (*cache_seqlens_value >= 0 && *cache_seqlens_value <= rows_per_sequence - added),
              kOp, ": cache_seqlens + ", added, " new rows must fit the cache's ",
              rows_per_sequence, " rows per sequence, and cache_seqlens >= 0; got cache_seqlens ",
              cache_seqlens_value.value_or(0));
  if (k.has_value()) {
    TORCH_CHECK(k->dim() == 4 && k->size(0) == B && k->size(2) == k_cache.size(2) &&
                    k->size(3) == k_cache.size(3) && v->dim() == 4 &&
                    v->sizes().slice(0, 3) == k->sizes().slice(0, 3) &&
                    v->size(3) == v_cache.size(3),
                kOp, ": expected k (B, L_new, H_kv, E) and v (B, L_new, H_kv, Ev) with B = ", B,
                " and H_kv, E, Ev of the caches (", k_cache.size(2), ", ", k_cache.size(3), ", ",
                v_cache.size(3), "), got ", k->sizes(), " and ", v->sizes());
  }
  if (rotary_cos.has_value()) {
    const at::Tensor &cos = *rotary_cos, &sin = *rotary_sin;
    TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && 2 * cos.size(1) <= q.size(3) &&
                    at::isFloatingType(cos.scalar_type()) && sin.scalar_type() == cos.scalar_type(),
                kOp, ": expected rotary_cos and rotary_sin of one floating dtype and shape "
                "(seqlen_ro, rotary_dim / 2) with rotary_dim <= E = ", q.size(3), ", got ",
                cos.scalar_type(), " ", cos.sizes(), " and ", sin.scalar_type(), " ", sin.sizes());
  }
  // The variants too, before anything is written into the caches.
  ops::check_variants(kOp, q, {q.sym_size(0), q.sym_size(2)}, a.variants());
  CacheSequences seq{device.is_cpu()};
  const int64_t default_length = cache_seqlens_value.value_or(rows_per_sequence);
  if (seq.on_cpu) {
    auto values = [&](const OptTensor& t, const char* name, std::vector<int64_t> fallback) {
      return t.has_value() ? host_values(checked_per_sequence(*t, B, name, device)) : fallback;
    };
    seq.lens = values(cache_seqlens, "cache_seqlens", std::vector<int64_t>(B, default_length));
    seq.pads = values(cache_leftpad, "cache_leftpad", std::vector<int64_t>(B, 0));
    seq.idx = values(cache_batch_idx, "cache_batch_idx", first_integers(B));
  } else {
    seq.seqlens = per_sequence(cache_seqlens, B, default_length, "cache_seqlens", device);
    seq.leftpad = per_sequence(cache_leftpad, B, 0, "cache_leftpad", device);
    seq.batch_idx = cache_batch_idx.has_value()
                        ? per_sequence(cache_batch_idx, B, 0, "cache_batch_idx", device).to(at::kLong)
                        : at::arange(B, at::TensorOptions(device).dtype(at::kLong));
  }
  const std::vector<int64_t> &lens = seq.lens, &pads = seq.pads, &idx = seq.idx;  // (CPU)
  if (seq.on_cpu) {
    for (int64_t b = 0; b < B; ++b) {
      // (as lens <= rows - added: an int64 tensor's values may be near its range's end)
      TORCH_CHECK(lens[b] <= rows_per_sequence - added && pads[b] >= 0 && pads[b] <= lens[b], kOp,
                  ": cache_seqlens + ", added, " new rows must fit the cache's ",
                  rows_per_sequence, " rows per sequence, and 0 <= cache_leftpad <= cache_seqlens");
    }
    for (const int64_t i : idx) {
      TORCH_CHECK(i >= 0 && i < k_cache.size(0), kOp, ": expected cache_batch_idx in [0, ",
                  k_cache.size(0), ")");
    }
    if (paged) {
      const at::Tensor table = block_table->contiguous();
      const int32_t* entry = table.const_data_ptr<int32_t>();
      TORCH_CHECK(std::all_of(entry, entry + table.numel(),
                              [&](int32_t x) { return x >= 0 && x < k_cache.size(0); }),
                  kOp, ": expected block_table's pages in [0, ", k_cache.size(0), ")");
    }
    if (rotary_cos.has_value() && B > 0) {
      int64_t last = 0;
      for (int64_t b = 0; b < B; ++b) last = std::max(last, lens[b] - pads[b]);
      last += std::max(L, added) - 1;
      TORCH_CHECK(last < rotary_cos->size(0), kOp, ": rotary_cos and rotary_sin have ",
                  rotary_cos->size(0), " positions; this call reaches position ", last);
    }
  }

  // Rotary embedding at the positions counted from the left padding: the new
  // keys at cache_seqlens + i; the queries there too when causal or windowed
  // (they are the last positions), else all at cache_seqlens.
  at::Tensor query = q;
  OptTensor new_k = k;
  if (rotary_cos.has_value()) {
    const at::Tensor start = seq.first_positions();
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
  // The rows to append: for a quantized cache, their codes and scales.
  const bool quantized = k_scale.has_value();
  OptTensor k_codes = new_k, v_codes = v, k_row_scales, v_row_scales;
  if (quantized && k.has_value()) {
    std::tie(k_codes, k_row_scales) = ops::quantize_rows(*new_k, k_cache.scalar_type());
    std::tie(v_codes, v_row_scales) = ops::quantize_rows(*v, v_cache.scalar_type());
  }
  // (The tensors the append writes, with their new rows: the caches, and a
  // quantized cache's scales.)
  std::vector<std::pair<at::Tensor, at::Tensor>> written;
  if (k.has_value()) {
    written = {{k_cache, *k_codes}, {v_cache, *v_codes}};
    if (quantized) {
      written.insert(written.end(), {{*k_scale, *k_row_scales}, {*v_scale, *v_row_scales}});
    }
  }
  // The append, undone if the attention refuses the call: a bad call leaves
  // the caches as they were. (The rows it overwrites are kept: B x L_new.)
  std::vector<at::indexing::TensorIndex> where;
  std::vector<at::Tensor> old_rows;
  std::vector<RowAppend> row_appends;
  if (k.has_value() && device.is_cpu() &&
      std::all_of(written.begin(), written.end(),
                  [](const auto& t) { return RowAppend::applies(t.first); })) {
    std::vector<std::pair<int64_t, int64_t>> places;  // (cache or page, row) of each new row
    const at::Tensor table = paged ? block_table->contiguous() : at::Tensor();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < added; ++i) {
        const int64_t row = lens[b] + i;
        places.emplace_back(
            paged ? table.const_data_ptr<int32_t>()[b * table.size(1) + row / page] : idx[b],
            paged ? row % page : row);
      }
    }
    for (const auto& [t, rows] : written) t.unsafeGetTensorImpl()->bump_version();
    row_appends.reserve(written.size());
    for (const auto& [t, rows] : written) row_appends.emplace_back(t, rows, places);
  } else if (k.has_value()) {
    const at::Tensor rows = seq.lengths(at::kLong).unsqueeze(1) +
                            at::arange(added, at::TensorOptions(device).dtype(at::kLong));
    if (paged) {
      where = {block_table->to(at::kLong).gather(1, rows.div(page, "floor")), rows.remainder(page)};
    } else {
      where = {seq.indices(at::kLong).unsqueeze(1), rows};
    }
    for (auto& [t, rows] : written) {
      old_rows.push_back(t.index(where));
      t.index_put_(where, rows.to(t.scalar_type()));
    }
  }
  try {
    return attend(query, k_cache, v_cache, k_scale, v_scale, seq, added, paged,
                  cache_batch_idx.has_value(), cache_leftpad.has_value(), block_table, page,
                  rows_per_sequence, scale, is_causal, a.variants());
  } catch (const c10::Error& e) {
    for (size_t n = row_appends.size(); n-- > 0;) row_appends[n].undo();
    for (size_t n = old_rows.size(); n-- > 0;) written[n].first.index_put_(where, old_rows[n]);
    // Named as the entry point called, not the op the call was handed to.
    std::string message = e.what_without_backtrace();
    for (const std::string inner : {ops::kVarlenForwardOp, ops::kForwardOp}) {
      if (message.rfind(inner + ":", 0) == 0) {
        message = kOp + message.substr(inner.size());
        break;
      }
    }
    TORCH_CHECK(false, message);
  }
}

// The shapes alone (fake tensors, torch.compile): the output (B, L, H, Ev)
// in q's dtype and the log-sum-exp (B, H, L), both contiguous as every path
// returns them. The checks that need no values run here too; the rest (the
// lengths, the pages) wait for the real call.
std::tuple<at::Tensor, at::Tensor> attention_with_kvcache_meta(const ops::KVCacheArgs& a) {
  const auto& [q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
               cache_batch_idx, cache_leftpad, block_table, scale, is_causal, rotary_interleaved,
               window_left, window_right, softcap, alibi_slopes, sinks, cache_seqlens_sym, k_scale,
               v_scale] = a;
  check_arguments(a);
  const auto lse_dtype = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return {at::empty_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2), v_cache.sym_size(3)},
                           q.options()),
          at::empty_symint({q.sym_size(0), q.sym_size(2), q.sym_size(1)},
                           q.options().dtype(lse_dtype))};
}

// Inference only: below autograd, so the outputs record nothing (as under
// torch.no_grad()), whatever requires grad. (A kernel of our own, not the
// boxed fallback: one decoding step pays for each dispatch.)
std::tuple<at::Tensor, at::Tensor> attention_with_kvcache_autograd(const ops::KVCacheArgs& a) {
  static const auto op = ops::find_op<ops::KVCacheArgs>();
  const at::AutoDispatchBelowAutograd below_autograd;  // (in-place ops below still bump versions)
  return op.call(a.q, a.k_cache, a.v_cache, a.k, a.v, a.rotary_cos, a.rotary_sin, a.cache_seqlens,
                 a.cache_batch_idx, a.cache_leftpad, a.block_table, a.scale, a.is_causal,
                 a.rotary_interleaved, a.window_left, a.window_right, a.softcap, a.alibi_slopes,
                 a.sinks, a.cache_seqlens_value, a.k_scale, a.v_scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedmha, CPU, m) { FUSEDMHA_OP_IMPL(m, attention_with_kvcache_kernel); }
TORCH_LIBRARY_IMPL(fusedmha, CUDA, m) { FUSEDMHA_OP_IMPL(m, attention_with_kvcache_kernel); }
TORCH_LIBRARY_IMPL(fusedmha, Meta, m) { FUSEDMHA_OP_IMPL(m, attention_with_kvcache_meta); }
TORCH_LIBRARY_IMPL(fusedmha, Autograd, m) { FUSEDMHA_OP_IMPL(m, attention_with_kvcache_autograd); }

}  // namespace fusedmha
