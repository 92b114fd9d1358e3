#include "ops/kernel_inputs.h"

namespace fusedmha::ops {

DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return DType::Float64;
    case at::kBFloat16: return DType::BFloat16;
    case at::kHalf: return DType::Float16;
    default: return DType::Float32;
  }
}

MaskKind mask_kind_of(const at::Tensor& mask, const at::Tensor& query) {
  if (mask.scalar_type() == at::kBool) return MaskKind::Bool;
  return mask.scalar_type() == query.scalar_type() ? MaskKind::Additive : MaskKind::AdditiveFloat32;
}

int64_t broadcast_stride(const at::Tensor& t, int64_t dim) {
  if (t.dim() < -dim || t.size(dim) == 1) return 0;
  return t.stride(dim);
}

at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

}  // namespace fusedmha::ops
