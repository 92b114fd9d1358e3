#pragma once

// What the host wrappers tell the kernels (CPU and CUDA alike) about the
// element type and the kind of attn_mask. Plain C++, for host and device.

namespace fusedmha {

enum class DType { Float32, Float64, BFloat16, Float16 };

enum class MaskKind {
  None,
  Bool,            // true = may attend
  Additive,        // added to the scores, query's dtype
  AdditiveFloat32  // added to the scores, float32 (for half-precision queries)
};

// How key and value are stored: in the query's dtype, or quantized as
// 8-bit codes with a float32 scale per row and head (value = code · scale:
// attention_with_kvcache's quantized caches).
enum class KVStorage { Dense, Int8, Float8E4M3, Float8E5M2 };

}  // namespace fusedmha
