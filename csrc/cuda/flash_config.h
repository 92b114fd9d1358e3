#pragma once

// Tile sizes of the tensor-core kernels, and the shared memory they take
// (the host checks it against the GPU's limit before choosing them).

#include <cstddef>

namespace fusedmha::cuda {

namespace flash_fwd {
constexpr int kBlockQ = 64;   // query rows per CTA (16 per warp)
constexpr int kBlockKV = 64;  // keys per step
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
// Q, K and V tiles of 16-bit elements.
constexpr size_t smem_bytes(int head_dim) { return size_t(kBlockQ + 2 * kBlockKV) * head_dim * 2; }
}  // namespace flash_fwd

namespace flash_bwd {
constexpr int kBlockQ = 64;   // query rows per step
constexpr int kBlockKV = 64;  // keys per CTA
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
// K, V, Q, dO tiles; Pᵀ and dSᵀ; lse and D of the query tile.
constexpr size_t smem_bytes(int head_dim) {
  return size_t(2 * kBlockKV + 2 * kBlockQ) * head_dim * 2 + size_t(2 * kBlockKV * kBlockQ) * 2 +
         2 * kBlockQ * sizeof(float);
}
}  // namespace flash_bwd

// The largest head dim the tensor-core kernels take (float16/bfloat16 on
// sm_80 and newer); larger ones run the simple kernels.
constexpr int kFlashMaxHeadDim = 256;

// The head dim an instance is compiled for: the smallest of 64, 128, 256
// that holds the call's query/key and value head dims.
constexpr int flash_head_dim_group(long long dim_qk, long long dim_v) {
  const long long d = dim_qk > dim_v ? dim_qk : dim_v;
  return d <= 64 ? 64 : d <= 128 ? 128 : 256;
}

}  // namespace fusedmha::cuda
