#pragma once

// Whether tensors may share memory, decided exactly for the strided views
// ATen's own checks give up on (at::has_internal_overlap and
// at::get_overlap_status answer TooHard): what a call that writes in place
// (attention_with_kvcache's caches and scales) must refuse.

#include <ATen/core/Tensor.h>

namespace fusedmha::ops {

// Whether a tensor may hold one element twice (an expand()ed or as_strided
// view).
bool may_overlap_itself(const at::Tensor& t);

// Whether two tensors may hold a common element (for views of one storage
// with nested strides, exactly; any other layout whose memory ranges meet
// counts as sharing).
bool may_share_memory(const at::Tensor& a, const at::Tensor& b);

}  // namespace fusedmha::ops
