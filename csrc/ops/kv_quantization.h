#pragma once

// Quantized KV caches: which 8-bit codes a cache holds, and the one rule by
// which rows become codes and scales (fusedmha::quantize_kv, and the
// in-place append of attention_with_kvcache).

#include "common/attention_types.h"

#include <ATen/core/Tensor.h>

#include <tuple>

namespace fusedmha::ops {

// The storage of codes of dtype t (int8, float8_e4m3fn, float8_e5m2);
// Dense for any other dtype.
KVStorage kv_storage_of(at::ScalarType t);

// The largest code of a quantized dtype: 127, 448 or 57344.
double largest_code(at::ScalarType codes);

// x (..., E) as codes of dtype (..., E) and float32 scales (...): each row's
// scale max|row| / largest_code(dtype) (0 for a row of zeros), its codes
// x / scale rounded to the nearest (int8: halves to even; fp8: the
// conversion's round to nearest even). No checks: quantize_kv's.
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, at::ScalarType dtype);

}  // namespace fusedmha::ops
