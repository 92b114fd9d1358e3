#pragma once

// Views for a call's setup on the CPU, made without the dispatcher. Each view
// op (transpose, select, flatten, narrow) goes through the dispatcher, a
// visible cost to a decoding step from cold caches, and a step makes a dozen
// (docs/performance.md, "A decoding call's fixed cost"); a view made here is
// a TensorImpl over the same storage with its sizes and strides set. It
// records no autograd
// view, so it is only for tensors a kernel reads or fills, never for what a
// user could differentiate through. Any tensor that is not a plain strided
// CPU one (meta, fake, symbolic sizes, a Python subclass, another device)
// takes the view op instead, so the shape (Meta) kernels can share the code.

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

namespace fusedmha::ops {

inline bool views_quickly(const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return t.is_cpu() && t.layout() == at::kStrided && !impl->has_symbolic_sizes_strides() &&
         !t.key_set().has(c10::DispatchKey::Python) && !t.is_nested();
}

// t's elements as sizes and strides say, from t's storage offset. (For a
// tensor that views_quickly.)
inline at::Tensor strided_view(const at::Tensor& t, at::IntArrayRef sizes,
                               at::IntArrayRef strides) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(),
                                                   t.dtype());
  impl->set_sizes_and_strides(sizes, strides, t.storage_offset());
  return at::Tensor(std::move(impl));
}

// t.transpose(a, b) (dims >= 0).
inline at::Tensor quick_transpose(const at::Tensor& t, int64_t a, int64_t b) {
  if (!views_quickly(t)) return t.transpose(a, b);
  c10::SmallVector<int64_t, 6> sizes(t.sizes().begin(), t.sizes().end());
  c10::SmallVector<int64_t, 6> strides(t.strides().begin(), t.strides().end());
  std::swap(sizes[a], sizes[b]);
  std::swap(strides[a], strides[b]);
  return strided_view(t, sizes, strides);
}

// t.select(0, 0) of a tensor with a first dim of size >= 1.
inline at::Tensor quick_first(const at::Tensor& t) {
  if (!views_quickly(t)) return t.select(0, 0);
  return strided_view(t, t.sizes().slice(1), t.strides().slice(1));
}

// t.flatten(0, 1): a view where dims 0 and 1 merge, else flatten's copy.
inline at::Tensor quick_flatten_01(const at::Tensor& t) {
  if (!views_quickly(t) || t.dim() < 2 || (t.size(0) > 1 && t.size(1) > 1 &&
                                            t.stride(0) != t.size(1) * t.stride(1))) {
    return t.flatten(0, 1);
  }
  c10::SmallVector<int64_t, 6> sizes(t.sizes().begin() + 1, t.sizes().end());
  c10::SmallVector<int64_t, 6> strides(t.strides().begin() + 1, t.strides().end());
  sizes[0] *= t.size(0);
  if (t.size(1) == 1) strides[0] = t.stride(0);  // (dim 1's stride means nothing then)
  return strided_view(t, sizes, strides);
}

}  // namespace fusedmha::ops
