#pragma once

// How the host wrappers (csrc/cpu, csrc/cuda) describe tensors to their
// kernels: the element type, the mask kind, strides with broadcasting.

#include "common/attention_types.h"

#include <ATen/core/Tensor.h>

namespace fusedmha::ops {

DType dtype_of(at::ScalarType t);

// A bool mask, a mask in the query's dtype, or a float32 mask for a
// half-precision query (check_attention_inputs allows nothing else).
MaskKind mask_kind_of(const at::Tensor& mask, const at::Tensor& query);

// Stride of one of the last two dims (-1 or -2); a missing or size-1 dim
// broadcasts (stride 0).
int64_t broadcast_stride(const at::Tensor& t, int64_t dim);

// t itself when its last dim is contiguous, else a copy that is.
at::Tensor last_dim_contiguous(const at::Tensor& t);

}  // namespace fusedmha::ops
