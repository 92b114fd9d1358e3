// ops/tensor_overlap.h: sharing decided by the views' strides where ATen
// gives up.

#include "ops/tensor_overlap.h"

#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

namespace fusedmha::ops {
namespace {

// The dims of two views with the same strides, as the ranges of index
// differences j (a's index minus b's) along each, sorted by stride; empty
// when a stride is not positive or the dims do not nest (each stride past
// the most the smaller dims can reach): the layouts decided below.
struct IndexRange { int64_t stride, lo, hi; };
std::optional<std::vector<IndexRange>> nested_dims(const at::Tensor& a, const at::Tensor& b) {
  std::vector<IndexRange> dims;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) <= 1 && b.size(d) <= 1) continue;
    if (a.stride(d) <= 0) return std::nullopt;
    dims.push_back({a.stride(d), 1 - b.size(d), a.size(d) - 1});
  }
  std::sort(dims.begin(), dims.end(),
            [](const IndexRange& x, const IndexRange& y) { return x.stride < y.stride; });
  int64_t reach = 0;
  for (const IndexRange& d : dims) {
    if (d.stride <= reach) return std::nullopt;
    reach += std::max(-d.lo, d.hi) * d.stride;
  }
  return dims;
}

}  // namespace

// Whether a tensor may hold one element twice (an expand()ed or as_strided
// view): decided by nesting where at::has_internal_overlap gives up.
bool may_overlap_itself(const at::Tensor& t) {
  switch (at::has_internal_overlap(t)) {
    case at::MemOverlap::No: return false;
    case at::MemOverlap::Yes: return true;
    case at::MemOverlap::TooHard: return !nested_dims(t, t).has_value();
  }
  return true;
}

// Whether two tensors may hold a common element, decided exactly where
// at::get_overlap_status gives up (TooHard: a non-contiguous view, such as
// k_cache = buf[:, :-1] and v_cache = buf[:, 1:], or K and V interleaved in
// one (B, S, 2, H, E) buffer). Views of one storage with the same nested
// strides share an element iff their offsets differ by sum_k j_k * stride_k
// with each j_k in its range; nesting leaves at most two candidates for each
// j_k, tried from the largest stride down. Any other layout whose memory
// ranges meet counts as sharing (the caller asks for a contiguous cache).
bool may_share_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  switch (at::get_overlap_status(a, b)) {
    case at::MemOverlapStatus::Full:
    case at::MemOverlapStatus::Partial: return true;
    case at::MemOverlapStatus::No: return false;
    case at::MemOverlapStatus::TooHard: break;
  }
  if (!a.is_alias_of(b)) return false;
  auto bytes = [](const at::Tensor& t) {  // the byte range [lo, hi] t covers
    int64_t lo = t.storage_offset(), hi = lo;
    for (int64_t d = 0; d < t.dim(); ++d) {
      (t.stride(d) < 0 ? lo : hi) += (t.size(d) - 1) * t.stride(d);
    }
    return std::make_pair(lo * t.element_size(), (hi + 1) * t.element_size() - 1);
  };
  const auto [a_lo, a_hi] = bytes(a);
  const auto [b_lo, b_hi] = bytes(b);
  if (a_hi < b_lo || b_hi < a_lo) return false;
  if (a.element_size() != b.element_size() || a.strides() != b.strides()) return true;
  const auto dims = nested_dims(a, b);
  if (!dims.has_value()) return true;
  std::function<bool(size_t, int64_t)> reachable = [&](size_t k, int64_t rest) {
    if (k == 0) return rest == 0;
    const IndexRange& d = (*dims)[k - 1];
    const int64_t j = rest / d.stride;  // (truncated: the other candidate is one further out)
    for (int64_t c : {j, rest < 0 ? j - 1 : j + 1}) {
      if (c >= d.lo && c <= d.hi && reachable(k - 1, rest - c * d.stride)) return true;
    }
    return false;
  };
  return reachable(dims->size(), b.storage_offset() - a.storage_offset());
}


}  // namespace fusedmha::ops
