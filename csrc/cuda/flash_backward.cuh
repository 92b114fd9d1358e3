#pragma once

// The tensor-core backward for float16/bfloat16 (FlashAttention-2's
// design). A CTA of 8 warps owns 64 keys of one (batch, head): K and V stay
// in shared memory while the query tiles (Q, dO, lse, D = rowsum(dO∘O))
// stream past. Per query tile, with every product on tensor cores:
//   Sᵀ  = K·Qᵀ,  Pᵀ = exp(pipeline(scale·Sᵀ) − lse)   (recomputed: softcap,
//                                                     ALiBi, band, mask)
//   dPᵀ = V·dOᵀ, dSᵀ = Pᵀ ∘ (dPᵀ∘Z/(1−p) − D) ∘ C     (Z: the dropout keep mask,
//                                                     C: softcap's 1 − tanh²)
//   dV += (Pᵀ∘Z/(1−p))·dO,  dK += dSᵀ·Q                (in registers, all tiles)
//   dQ += dS·K                                          (fp32 atomics into grad_q)
// Pᵀ and dSᵀ go through shared memory, so each product uses the warp layout
// that suits it. dK and dQ are scaled by `scale` on the way out. Query tiles
// outside the band, or that the mask's tiles hide whole, are not visited.

#include "cuda/device_utils.cuh"
#include "cuda/flash_config.h"

#include <cuda_runtime_api.h>

#if !defined(FUSEDMHA_CUDA_EMULATION)
#include "cuda/launch.cuh"
#endif

namespace fusedmha::cuda {

namespace flash_bwd {

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) kernel(const BackwardParams params) {
  T* smem = reinterpret_cast<T*>(dynamic_smem());
  const SwizzledTile<T, kBlockKV, D> k_tile{smem};
  const SwizzledTile<T, kBlockKV, D> v_tile{smem + kBlockKV * D};
  const SwizzledTile<T, kBlockQ, D> q_tile{smem + 2 * kBlockKV * D};
  const SwizzledTile<T, kBlockQ, D> do_tile{smem + (2 * kBlockKV + kBlockQ) * D};
  const SwizzledTile<T, kBlockKV, kBlockQ> pt_tile{smem + (2 * kBlockKV + 2 * kBlockQ) * D};
  const SwizzledTile<T, kBlockKV, kBlockQ> dst_tile{pt_tile.data + kBlockKV * kBlockQ};
  float* lse_s = reinterpret_cast<float*>(dst_tile.data + kBlockKV * kBlockQ);
  float* delta_s = lse_s + kBlockQ;

  // Tiles cover the longest sequence; a shorter one's extra tiles do nothing.
  const int64_t n_kv_tiles = (params.fwd.len_kv + kBlockKV - 1) / kBlockKV;
  const int64_t o = blockIdx.x / n_kv_tiles;
  const int64_t k0 = (blockIdx.x % n_kv_tiles) * kBlockKV;
  const BackwardParams bp = sequence_of(params, o);
  const AttentionParams& p = bp.fwd;
  if (k0 >= p.len_kv) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int wr = warp % 4, wc = warp / 4;  // 4 row blocks of 16 x 2 column halves
  const int dk = static_cast<int>(p.dim_qk), dv = static_cast<int>(p.dim_v);
  const int kv_rows = static_cast<int>(min64(kBlockKV, p.len_kv - k0));

  const T* q = static_cast<const T*>(p.q.data) + outer_offset(p.outer, p.q, o);
  const T* dout = static_cast<const T*>(bp.grad_out.data) + outer_offset(p.outer, bp.grad_out, o);
  const int64_t mask_base = p.mask_kind == MaskKind::None ? 0 : outer_offset(p.outer, p.mask, o);
  const auto lse = lse_rows<const float>(p, p.lse, o);
  const auto delta = lse_rows<const float>(p, bp.delta, o);
  float* grad_q = matrix_start<float>(p.outer, bp.grad_q, o);
  // The mask's gradient, summed with atomics (it may broadcast over CTAs).
  float* grad_mask = bp.grad_mask.data ? matrix_start<float>(p.outer, bp.grad_mask, o) : nullptr;
  const float mask_scale = static_cast<float>(bp.grad_mask_scale);

  k_tile.template load_async<kThreads>(static_cast<const T*>(p.k.data) + outer_offset(p.outer, p.k, o) + k0 * p.k.row_stride,
                                       p.k.row_stride, kv_rows, dk, tid);
  v_tile.template load_async<kThreads>(static_cast<const T*>(p.v.data) + outer_offset(p.outer, p.v, o) + k0 * p.v.row_stride,
                                       p.v.row_stride, kv_rows, dv, tid);
  cp_async_commit();

  const bool dropout = p.dropout.p > 0.0;
  const DropoutStream stream = dropout ? dropout_stream(p) : DropoutStream{};
  const float keep_scale = dropout ? static_cast<float>(1.0 / (1.0 - p.dropout.p)) : 1.0f;
  const float scale = static_cast<float>(p.scale);
  const bool has_mask = p.mask_kind != MaskKind::None;
  const bool band = has_band(p), softcap = p.softcap > 0.0;
  const float slope = static_cast<float>(alibi_slope(p, o));

  // This warp's dK/dV block: keys wr*16.., columns wc*D/2.. .
  constexpr int kHalfTiles = D / 16;  // n-tiles of 8 in D/2 columns
  float dk_acc[kHalfTiles][4], dv_acc[kHalfTiles][4];
#pragma unroll
  for (int n = 0; n < kHalfTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[n][e] = dv_acc[n][e] = 0.0f;
  }

  // Only the query tiles whose band sees these keys (causal, sliding window).
  const int64_t first_q_tile = band_query_begin(p, k0) / kBlockQ;
  const int64_t n_q_tiles = (band_query_end(p, k0 + kv_rows) + kBlockQ - 1) / kBlockQ;
  for (int64_t it = first_q_tile; it < n_q_tiles; ++it) {
    const int64_t q0 = it * kBlockQ;
    const int q_rows = static_cast<int>(min64(kBlockQ, p.len_q - q0));
    // A query tile the mask's tiles (AttentionParams::mask_tiles) hide from
    // these keys whole has P = 0 throughout: nothing to add, not visited
    // (the whole CTA agrees). One they show whole takes no mask.
    const uint8_t tile_state = mask_tiles_over(p, o, q0, q_rows, k0, kv_rows);
    if (tile_state == kTileHidden) continue;
    const bool tile_mask = has_mask && tile_state != kTileVisible;
    q_tile.template load_async<kThreads>(q + q0 * p.q.row_stride, p.q.row_stride, q_rows, dk, tid);
    do_tile.template load_async<kThreads>(dout + q0 * bp.grad_out.row_stride, bp.grad_out.row_stride,
                                          q_rows, dv, tid);
    cp_async_commit();
    if (tid < kBlockQ) {
      // Padding queries: lse = +inf makes their P exactly 0.
      lse_s[tid] = tid < q_rows ? lse[q0 + tid] * kLog2e : INFINITY;
      delta_s[tid] = tid < q_rows ? delta[q0 + tid] : 0.0f;
    }
    cp_async_wait<0>();
    __syncthreads();

    // Sᵀ and dPᵀ for keys wr*16.., queries wc*32.. .
    float st[4][4], dpt[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.0f;
    }
    warp_mma<false, false, D / 16, 2, T>(st, k_tile, wr * 16, 0, q_tile, wc * 32, 0, lane);
    warp_mma<false, false, D / 16, 2, T>(dpt, v_tile, wr * 16, 0, do_tile, wc * 32, 0, lane);

#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const int qc = wc * 32 + n * 8 + 2 * t4;  // query column of e = 0, 1
      // The stream's words of this thread's elements of n-tile n, [h][e]:
      // element (query q0 + qc + e, key k0 + wr*16 + g + 8h) is word g % 4
      // of block (query, (k0 + wr*16 + 8h)/4 + g/4). The four lanes that
      // differ in g % 4 need the same four blocks (h, e), each a different
      // word: each lane computes block r = g % 4 (h = r/2, e = r%2) and the
      // four swap words (a 4x4 transpose by xor shuffles over lane bits 2-3).
      uint32_t bits[2][2];
      if (dropout) {
        const int r = g & 3;
        const Philox4x32 block =
            stream.block(o, q0 + qc + (r & 1), (k0 + wr * 16 + 8 * (r >> 1)) / 4 + g / 4);
        uint32_t got[4];  // got[x]: word r of block r ^ x
        got[0] = philox_word(block, r);
#pragma unroll
        for (int x = 1; x < 4; ++x) {
          got[x] = __shfl_xor_sync(0xffffffffu, philox_word(block, r ^ x), x << 2);
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int x = r ^ c;
          bits[c >> 1][c & 1] = x == 0 ? got[0] : x == 1 ? got[1] : x == 2 ? got[2] : got[3];
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int kr = wr * 16 + g + 8 * h;  // key row
        const int64_t j = k0 + kr;
        float pt[2], ds[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t i = q0 + qc + e;
          float dcap = 1.0f;
          float x = transformed_score(p, st[n][2 * h + e] * scale, slope, i, j,
                                      softcap ? &dcap : nullptr);
          if (j >= p.len_kv || i >= p.len_q || (band && !in_band(p, i, j))) {
            x = -INFINITY;
          } else if (tile_mask) {
            x += mask_term(p, mask_base, i, j);
          }
          x *= kLog2e;
          const float lse_i = lse_s[qc + e];
          // lse = +inf (a row with no key) gives 0; x = -inf too.
          float pr = x == -INFINITY ? 0.0f : exp2f(x - lse_i);
          float dp = dpt[n][2 * h + e];
          float pd = pr;
          if (dropout) {
            // Pᵀ∘Z with Z in {0, 1} (16-bit storage; 1/(1−p) is applied to
            // dV at the end), dP∘Z/(1−p) in fp32.
            const bool keep = i < p.len_q && bits[h][e] >= p.dropout.threshold;
            pd = keep ? pr : 0.0f;
            dp = keep ? dp * keep_scale : 0.0f;
          }
          pt[e] = pd;
          ds[e] = pr * (dp - delta_s[qc + e]);
          if (grad_mask && pr != 0.0f) {
            atomicAdd(grad_mask + i * bp.grad_mask.row_stride + j * bp.grad_mask.col_stride,
                      ds[e] * mask_scale);
          }
          ds[e] *= dcap;
        }
        *reinterpret_cast<uint32_t*>(pt_tile.at(kr, qc)) = pack2<T>(pt[0], pt[1]);
        *reinterpret_cast<uint32_t*>(dst_tile.at(kr, qc)) = pack2<T>(ds[0], ds[1]);
      }
    }
    __syncthreads();

    // dV += Pᵀ·dO and dK += dSᵀ·Q for keys wr*16.., columns wc*D/2.. .
    warp_mma<false, true, kBlockQ / 16, D / 32, T>(dv_acc, pt_tile, wr * 16, 0, do_tile,
                                                   wc * (D / 2), 0, lane);
    warp_mma<false, true, kBlockQ / 16, D / 32, T>(dk_acc, dst_tile, wr * 16, 0, q_tile,
                                                   wc * (D / 2), 0, lane);
    // dQ += dS·K for queries wr*16.., columns wc*D/2.., summed across CTAs.
    float dq[kHalfTiles][4];
#pragma unroll
    for (int n = 0; n < kHalfTiles; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
    warp_mma<true, true, kBlockKV / 16, D / 32, T>(dq, dst_tile, wr * 16, 0, k_tile, wc * (D / 2),
                                                   0, lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i = q0 + wr * 16 + g + 8 * h;
      if (i >= p.len_q) continue;
      float* dst = grad_q + i * bp.grad_q.row_stride;
#pragma unroll
      for (int n = 0; n < kHalfTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = wc * (D / 2) + n * 8 + 2 * t4 + e;
          if (c < dk) atomicAdd(dst + c, dq[n][2 * h + e] * scale);
        }
      }
    }
    __syncthreads();  // before the next tile overwrites Q, dO, Pᵀ, dSᵀ
  }

  cp_async_wait<0>();  // (with no query tile, K's and V's copies are still pending)

  // dK (scaled) and dV (times 1/(1−p)) of this CTA's keys, dense fp32 per
  // outer index.
  float* grad_k = matrix_start<float>(p.outer, bp.grad_k, o) + k0 * bp.grad_k.row_stride;
  float* grad_v = matrix_start<float>(p.outer, bp.grad_v, o) + k0 * bp.grad_v.row_stride;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = wr * 16 + g + 8 * h;
    if (r >= kv_rows) continue;
#pragma unroll
    for (int n = 0; n < kHalfTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = wc * (D / 2) + n * 8 + 2 * t4 + e;
        if (c < dk) grad_k[r * bp.grad_k.row_stride + c] = dk_acc[n][2 * h + e] * scale;
        if (c < dv) grad_v[r * bp.grad_v.row_stride + c] = dv_acc[n][2 * h + e] * keep_scale;
      }
    }
  }
}

}  // namespace flash_bwd

#if !defined(FUSEDMHA_CUDA_EMULATION)
template <typename T, int D>
cudaError_t run_flash_backward(const BackwardParams& bp, cudaStream_t stream) {
  const int64_t n_kv_tiles = (bp.fwd.len_kv + flash_bwd::kBlockKV - 1) / flash_bwd::kBlockKV;
  return launch_blocks(&flash_bwd::kernel<T, D>, n_kv_tiles * bp.fwd.num_outer,
                       flash_bwd::kThreads, flash_bwd::smem_bytes(D), stream, bp);
}
#endif

}  // namespace fusedmha::cuda
