// fusedmha::quantize_kv and dequantize_kv, and the rule they share with
// attention_with_kvcache's append (ops/kv_quantization.h). Composed of ATen
// ops and registered as composites: every backend, shapes and autograd
// come from the ops they call.

#include "ops/kv_quantization.h"

#include <fusedmha/attention.h>

#include <ATen/ATen.h>
#include <torch/library.h>

namespace fusedmha {
namespace ops {

KVStorage kv_storage_of(at::ScalarType t) {
  switch (t) {
    case at::kChar: return KVStorage::Int8;
    case at::kFloat8_e4m3fn: return KVStorage::Float8E4M3;
    case at::kFloat8_e5m2: return KVStorage::Float8E5M2;
    default: return KVStorage::Dense;
  }
}

double largest_code(at::ScalarType codes) {
  switch (kv_storage_of(codes)) {
    case KVStorage::Int8: return 127.0;
    case KVStorage::Float8E4M3: return 448.0;
    case KVStorage::Float8E5M2: return 57344.0;
    case KVStorage::Dense: break;
  }
  return 0.0;
}

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, at::ScalarType dtype) {
  const double qmax = largest_code(dtype);
  const at::Tensor wide = x.to(at::kFloat);
  const at::Tensor scale = wide.abs().amax(-1).div(qmax);
  const at::Tensor s = scale.unsqueeze(-1);
  // (A row of zeros has scale 0: its codes are 0, not 0 / 0. The clamp
  // keeps a quotient rounded just past qmax a code: past e4m3's largest,
  // the conversion gives NaN, and e5m2's, infinity.)
  at::Tensor q = at::where(s > 0, wide.div(s), at::zeros({}, wide.options()))
                     .clamp(-qmax, qmax);
  if (dtype == at::kChar) q = q.round();
  return {q.to(dtype), scale};
}

namespace {

constexpr const char* kQuantizeOp = "fusedmha.quantize_kv";
constexpr const char* kDequantizeOp = "fusedmha.dequantize_kv";

std::tuple<at::Tensor, at::Tensor> quantize_kv_composite(const at::Tensor& x,
                                                         at::ScalarType dtype) {
  TORCH_CHECK(kv_storage_of(dtype) != KVStorage::Dense, kQuantizeOp,
              ": expected dtype int8, float8_e4m3fn or float8_e5m2, got ", dtype);
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) && x.dim() >= 1, kQuantizeOp,
              ": expected x of a floating dtype with at least one dim (..., E), got ",
              x.scalar_type(), " of shape ", x.sym_sizes());
  return quantize_rows(x, dtype);
}

at::Tensor dequantize_kv_composite(const at::Tensor& codes, const at::Tensor& scale,
                                   at::ScalarType dtype) {
  TORCH_CHECK(kv_storage_of(codes.scalar_type()) != KVStorage::Dense && codes.dim() >= 1,
              kDequantizeOp, ": expected codes of dtype int8, float8_e4m3fn or float8_e5m2 "
              "with at least one dim, got ", codes.scalar_type(), " of shape ", codes.sym_sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat &&
                  scale.sym_sizes() == codes.sym_sizes().slice(0, codes.dim() - 1),
              kDequantizeOp, ": expected scale of dtype float32 and shape ",
              codes.sym_sizes().slice(0, codes.dim() - 1), " (codes' without the last dim), got ",
              scale.scalar_type(), " of shape ", scale.sym_sizes());
  TORCH_CHECK(at::isFloatingType(dtype), kDequantizeOp, ": expected a floating dtype, got ",
              dtype);
  // (In float64 for a float64 result: exact. Otherwise one float32 product,
  // as the kernels form it, then rounded to dtype.)
  const auto acc = dtype == at::kDouble ? at::kDouble : at::kFloat;
  return codes.to(acc).mul(scale.to(acc).unsqueeze(-1)).to(dtype);
}

}  // namespace
}  // namespace ops

std::tuple<at::Tensor, at::Tensor> quantize_kv(const at::Tensor& x, at::ScalarType dtype) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fusedmha::quantize_kv", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&,
                                                                       at::ScalarType)>();
  return op.call(x, dtype);
}

at::Tensor dequantize_kv(const at::Tensor& codes, const at::Tensor& scale,
                         at::ScalarType dtype) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fusedmha::dequantize_kv", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType)>();
  return op.call(codes, scale, dtype);
}

TORCH_LIBRARY_IMPL(fusedmha, CompositeImplicitAutograd, m) {
  m.impl("quantize_kv", TORCH_FN(ops::quantize_kv_composite));
  m.impl("dequantize_kv", TORCH_FN(ops::dequantize_kv_composite));
}

}  // namespace fusedmha
