#pragma once

// The tensor-core forward for float16/bfloat16 (FlashAttention-2's design).
// A CTA of 4 warps owns 64 query rows of one (batch, head); each warp owns
// 16 of them. Q is loaded once into shared memory; K and V tiles of 64 keys
// stream through shared memory with cp.async, V's load overlapping Q·Kᵀ
// and the next K's load overlapping softmax and P·V. Scores and the
// running output stay in registers; softmax is online, in base 2 (exp2),
// with log2(e) applied after softcap and ALiBi. Key tiles outside the band
// (causal, sliding window) are not visited, nor those the mask's tiles hide
// whole; a sink starts the running max and sum. Included by one instance
// file per dtype and head-dim group, generated into the build tree from
// flash_instance.cu.in.

#include "cuda/device_utils.cuh"
#include "cuda/flash_config.h"

#include <cuda_runtime_api.h>

#if !defined(FUSEDMHA_CUDA_EMULATION)
#include "cuda/launch.cuh"
#endif

namespace fusedmha::cuda {

namespace flash_fwd {

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) kernel(const AttentionParams params) {
  T* smem = reinterpret_cast<T*>(dynamic_smem());
  const SwizzledTile<T, kBlockQ, D> q_tile{smem};
  const SwizzledTile<T, kBlockKV, D> k_tile{smem + kBlockQ * D};
  const SwizzledTile<T, kBlockKV, D> v_tile{smem + (kBlockQ + kBlockKV) * D};

  // Heaviest query tiles (the last ones, under causal masking) first.
  // Tiles cover the longest sequence; a shorter one's extra tiles do nothing.
  const int64_t n_q_tiles = (params.len_q + kBlockQ - 1) / kBlockQ;
  const int64_t o = blockIdx.x / n_q_tiles;
  const int64_t q0 = (n_q_tiles - 1 - blockIdx.x % n_q_tiles) * kBlockQ;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;

  const bool dropout = params.dropout.p > 0.0;
  const DropoutStream stream = dropout ? dropout_stream(params) : DropoutStream{};
  // (seed, offset) of this call, (0, 0) without dropout: written by the
  // kernel so that the host neither waits nor launches anything for it.
  if (blockIdx.x == 0 && tid == 0 && params.dropout.state_out != nullptr) {
    params.dropout.state_out[0] = static_cast<int64_t>(stream.seed);
    params.dropout.state_out[1] = static_cast<int64_t>(stream.offset);
  }
  const AttentionParams p = sequence_of(params, o);
  if (q0 >= p.len_q) return;

  const T* q = static_cast<const T*>(p.q.data) + outer_offset(p.outer, p.q, o) + q0 * p.q.row_stride;
  const T* k = static_cast<const T*>(p.k.data) + outer_offset(p.outer, p.k, o);
  const T* v = static_cast<const T*>(p.v.data) + outer_offset(p.outer, p.v, o);
  const int64_t mask_base = p.mask_kind == MaskKind::None ? 0 : outer_offset(p.outer, p.mask, o);
  const int q_rows = static_cast<int>(min64(kBlockQ, p.len_q - q0));
  const int dk = static_cast<int>(p.dim_qk), dv = static_cast<int>(p.dim_v);

  // Keys this tile's band can see (causal, sliding window).
  const int64_t kv_begin = band_key_begin(p, q0), kv_end = band_key_end(p, q0 + q_rows);
  const int n_kv_tiles =
      kv_end > kv_begin ? static_cast<int>((kv_end - kv_begin + kBlockKV - 1) / kBlockKV) : 0;
  const bool band = has_band(p);
  const float slope = static_cast<float>(alibi_slope(p, o));

  const float scale = static_cast<float>(p.scale);
  const bool has_mask = p.mask_kind != MaskKind::None;

  // Key tiles whose mask tiles (AttentionParams::mask_tiles, where the host
  // found them) hide every key of these rows are not visited, as a band's
  // are not; tiles they show whole take no mask.
  auto tile_state = [&](int jt) {
    const int64_t k0 = kv_begin + int64_t(jt) * kBlockKV;
    return mask_tiles_over(p, o, q0, q_rows, k0, min64(kBlockKV, kv_end - k0));
  };
  // The first tile from jt on that is not hidden; its state into `found`.
  uint8_t found = kTileMixed;
  auto seen_from = [&](int jt) {
    for (; jt < n_kv_tiles; ++jt) {
      found = tile_state(jt);
      if (found != kTileHidden) break;
    }
    return jt;
  };
  const int first = seen_from(0);
  uint8_t state = found;  // (tile jt's, in the loop)

  q_tile.template load_async<kThreads>(q, p.q.row_stride, q_rows, dk, tid);
  cp_async_commit();
  if (first < n_kv_tiles) {
    const int64_t k1 = kv_begin + int64_t(first) * kBlockKV;
    k_tile.template load_async<kThreads>(k + k1 * p.k.row_stride, p.k.row_stride,
                                         static_cast<int>(min64(kBlockKV, kv_end - k1)), dk, tid);
  }
  cp_async_commit();

  constexpr int kOutTiles = D / 8;
  float acc[kOutTiles][4];
#pragma unroll
  for (int n = 0; n < kOutTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  // Per thread two rows: warp*16 + g and + 8. m in the base-2 domain; l is
  // this thread's partial sum (its quad's four partials add up at the end).
  // A sink is a key of score `sink` and no value: m and l start from it.
  const bool sink = has_sinks(p);
  const float m_start = sink ? static_cast<float>(sink_logit(p, o)) * kLog2e : -INFINITY;
  const float l_start = sink && t4 == 0 ? 1.0f : 0.0f;
  float m_row[2] = {m_start, m_start}, l_row[2] = {l_start, l_start};
  const int64_t row_of[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};

  for (int jt = first, next; jt < n_kv_tiles; jt = next, state = found) {
    const bool tile_mask = has_mask && state != kTileVisible;
    next = seen_from(jt + 1);
    const int64_t k0 = kv_begin + int64_t(jt) * kBlockKV;
    const int kv_rows = static_cast<int>(min64(kBlockKV, kv_end - k0));
    v_tile.template load_async<kThreads>(v + k0 * p.v.row_stride, p.v.row_stride, kv_rows, dv, tid);
    cp_async_commit();
    cp_async_wait<1>();  // Q and this K
    __syncthreads();

    float s[kBlockKV / 8][4];
#pragma unroll
    for (int n = 0; n < kBlockKV / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    warp_mma<false, false, D / 16, kBlockKV / 16, T>(s, q_tile, warp * 16, 0, k_tile, 0, 0, lane);
    __syncthreads();  // every warp is done with K
    if (next < n_kv_tiles) {
      const int64_t k1 = kv_begin + int64_t(next) * kBlockKV;
      k_tile.template load_async<kThreads>(k + k1 * p.k.row_stride, p.k.row_stride,
                                           static_cast<int>(min64(kBlockKV, kv_end - k1)), dk, tid);
    }
    cp_async_commit();

    // Scores in base 2 with masks; the tile's row maxima.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kBlockKV / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e / 2;
        const int64_t j = k0 + n * 8 + 2 * t4 + (e & 1);
        float x = transformed_score(p, s[n][e] * scale, slope, row_of[h], j);
        if (j >= kv_end || (band && !in_band(p, row_of[h], j))) {
          x = -INFINITY;
        } else if (tile_mask && row_of[h] < p.len_q) {
          x += mask_term(p, mask_base, row_of[h], j);
        }
        s[n][e] = x * kLog2e;
        tile_max[h] = fmaxf(tile_max[h], x);
      }
    }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
      const float m_new = fmaxf(m_row[h], tile_max[h]);
      // A row with no visible key so far keeps m = -inf; exponents then use 0.
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      alpha[h] = exp2f(m_row[h] - m_use);
      m_row[h] = m_new;
      tile_max[h] = m_use;
    }
    float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < kBlockKV / 8; ++n) {
      // The stream's words of this thread's elements: [row g / g+8][column 2·t4 + e].
      uint32_t bits[2][2];
      if (dropout) {
        // Columns 2·t4, +1 of this n-tile are words 2·(t4 % 2), +1 of the
        // group of four keys (k0 + 8n)/4 + t4/2. Lanes t4 = 2m and 2m+1
        // need the same two blocks (rows g and g+8): each computes one row's
        // and hands the other the two words it needs.
        const int64_t j4 = (k0 + n * 8) / 4 + t4 / 2;
        const int mine = t4 & 1;  // 0: row g, 1: row g+8
        const Philox4x32 block = stream.block(o, mine ? row_of[1] : row_of[0], j4);
        const uint32_t got0 = __shfl_xor_sync(0xffffffffu, mine ? block.v[0] : block.v[2], 1);
        const uint32_t got1 = __shfl_xor_sync(0xffffffffu, mine ? block.v[1] : block.v[3], 1);
        bits[0][0] = mine ? got0 : block.v[0];
        bits[0][1] = mine ? got1 : block.v[1];
        bits[1][0] = mine ? block.v[2] : got0;
        bits[1][1] = mine ? block.v[3] : got1;
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e / 2;
        float pr = exp2f(s[n][e] - tile_max[h]);
        tile_sum[h] += pr;
        if (dropout && bits[h][e & 1] < p.dropout.threshold) pr = 0.0f;
        s[n][e] = pr;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l_row[h] = l_row[h] * alpha[h] + tile_sum[h];
#pragma unroll
    for (int n = 0; n < kOutTiles; ++n) {
      acc[n][0] *= alpha[0];
      acc[n][1] *= alpha[0];
      acc[n][2] *= alpha[1];
      acc[n][3] *= alpha[1];
    }

    // P as A fragments: the accumulators of n-tiles 2k, 2k+1 are exactly
    // the m16k16 A fragment of key step k.
    uint32_t pa[kBlockKV / 16][4];
#pragma unroll
    for (int ks = 0; ks < kBlockKV / 16; ++ks) {
      pa[ks][0] = pack2<T>(s[2 * ks][0], s[2 * ks][1]);
      pa[ks][1] = pack2<T>(s[2 * ks][2], s[2 * ks][3]);
      pa[ks][2] = pack2<T>(s[2 * ks + 1][0], s[2 * ks + 1][1]);
      pa[ks][3] = pack2<T>(s[2 * ks + 1][2], s[2 * ks + 1][3]);
    }

    if (next < n_kv_tiles) {
      cp_async_wait<1>();  // this V (the next K may still be in flight)
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < kBlockKV / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < D / 16; ++np) {
        uint32_t b[4];
        v_tile.load_b_kn(b, np * 16, ks * 16, lane);
        mma_16816<T>(acc[2 * np], pa[ks], b[0], b[1]);
        mma_16816<T>(acc[2 * np + 1], pa[ks], b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with V
  }

  cp_async_wait<0>();  // (with no key tile, Q's copy is still pending)

  // Normalise, write the output and the log-sum-exp (natural log).
  T* out = static_cast<T*>(const_cast<void*>(p.out.data)) + outer_offset(p.outer, p.out, o);
  const auto lse = lse_rows<float>(p, p.lse, o);
  const float keep_scale = dropout ? static_cast<float>(1.0 / (1.0 - p.dropout.p)) : 1.0f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_row[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int64_t i = row_of[h];
    float inv, row_lse;
    if (isnan(l) || m_row[h] == INFINITY) {
      // A NaN or +inf score makes the row NaN, as in exact arithmetic.
      inv = NAN;
      row_lse = NAN;
    } else if (l > 0.0f) {
      inv = keep_scale / l;
      row_lse = (m_row[h] + log2f(l)) * kLn2;
    } else {
      // No key to attend to: output 0, lse +inf (so the backward's P is 0).
      inv = 0.0f;
      row_lse = INFINITY;
    }
    if (i >= p.len_q) continue;
    if (t4 == 0) lse[i] = row_lse;
    T* dst = out + i * p.out.row_stride;
#pragma unroll
    for (int n = 0; n < kOutTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = n * 8 + 2 * t4 + e;
        if (c < dv) dst[c * p.out.col_stride] = from_acc<T>(acc[n][2 * h + e] * inv);
      }
    }
  }
}

}  // namespace flash_fwd

#if !defined(FUSEDMHA_CUDA_EMULATION)
template <typename T, int D>
cudaError_t run_flash_forward(const AttentionParams& p, cudaStream_t stream) {
  const int64_t n_q_tiles = (p.len_q + flash_fwd::kBlockQ - 1) / flash_fwd::kBlockQ;
  return launch_blocks(&flash_fwd::kernel<T, D>, n_q_tiles * p.num_outer, flash_fwd::kThreads,
                       flash_fwd::smem_bytes(D), stream, p);
}

#endif

}  // namespace fusedmha::cuda
