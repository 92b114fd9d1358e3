#pragma once

// The simple CUDA kernels: one warp per query row, CUDA cores, any dtype.
// They run float32 and float64 attention (true fp32/fp64 arithmetic, no
// tf32), the attention weights pass of every dtype, and half-precision
// attention where the tensor-core kernels do not apply (head dims over
// 256, GPUs before sm_80, tiles that do not fit the shared memory, paged
// caches, and the backward under torch.use_deterministic_algorithms:
// attention_cuda.cpp). Correct and readable rather than fast: the
// tensor-core kernels are the fast path.
//
// A warp walks the keys of its row one at a time: the 32 lanes split the
// head dims of each dot product (then sum with shuffles), and each lane owns
// the same head dims of the row's accumulators, kept in shared memory.

#include "common/kv_codes.h"
#include "cuda/device_utils.cuh"

namespace fusedmha::cuda::simple {


template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

template <typename A, typename T>
__device__ __forceinline__ A to_acc(T x) {
  return static_cast<A>(to_float(x));
}
template <>
__device__ __forceinline__ double to_acc<double, double>(double x) {
  return x;
}

template <typename A>
__device__ __forceinline__ A warp_max(A x) {
#pragma unroll
  for (int d = 16; d > 0; d /= 2) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, d));
  return x;
}

template <typename A>
__device__ __forceinline__ A warp_sum(A x) {
#pragma unroll
  for (int d = 16; d > 0; d /= 2) x += __shfl_xor_sync(0xffffffffu, x, d);
  return x;
}

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }

// lane's share of dot(a (shared, acc), b (global row)) over n elements.
template <typename T, typename A>
__device__ __forceinline__ A dot_row(const A* a, const T* b, int64_t stride, int n, int lane) {
  A s = 0;
  for (int e = lane; e < n; e += 32) s += a[e] * (to_acc<A>(b[e * stride]));
  return warp_sum(s);
}

constexpr int kWarpsPerBlock = 4;

template <typename T, typename A>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) forward_kernel(const AttentionParams params) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int dk = static_cast<int>(params.dim_qk), dv = static_cast<int>(params.dim_v);
  A* q_s = reinterpret_cast<A*>(dynamic_smem()) + warp * (dk + dv);
  A* o_s = q_s + dk;

  const bool dropout = params.dropout.p > 0.0;
  const DropoutStream stream = dropout ? dropout_stream(params) : DropoutStream{};
  if (blockIdx.x == 0 && threadIdx.x == 0 && params.dropout.state_out != nullptr) {  // (0, 0) without dropout
    params.dropout.state_out[0] = static_cast<int64_t>(stream.seed);
    params.dropout.state_out[1] = static_cast<int64_t>(stream.offset);
  }
  // Rows cover the longest sequence; a shorter one's extra rows do nothing.
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= params.num_outer * params.len_q) return;
  const int64_t o = row / params.len_q, i = row % params.len_q;
  const AttentionParams p = sequence_of(params, o);
  if (i >= p.len_q) return;

  const T* q = static_cast<const T*>(p.q.data) + outer_offset(p.outer, p.q, o) + i * p.q.row_stride;
  const T* k = static_cast<const T*>(p.k.data);  // key row j at k_row_offset(p, o, j)
  const T* v = static_cast<const T*>(p.v.data);
  const int64_t mask_base = p.mask_kind == MaskKind::None ? 0 : outer_offset(p.outer, p.mask, o);
  const A scale = static_cast<A>(p.scale);
  for (int e = lane; e < dk; e += 32) q_s[e] = (to_acc<A>(q[e])) * scale;
  for (int e = lane; e < dv; e += 32) o_s[e] = 0;
  __syncwarp();  // every lane reads all of q_s

  // Keys in chunks of 32, one per lane: each lane scores its key, the warp
  // agrees on the chunk's max and sum, then walks the chunk's keys adding
  // their value rows (lanes over head dims again). Only the row's band is
  // visited; a sink (a score with no value) starts the max and the sum.
  const int64_t kv_begin = band_key_begin(p, i), kv_end = band_key_end(p, i + 1);
  const A slope = static_cast<A>(alibi_slope(p, o));
  A m = has_sinks(p) ? A(sink_logit(p, o)) : A(-INFINITY), l = has_sinks(p) ? A(1) : A(0);
  for (int64_t j0 = kv_begin; j0 < kv_end; j0 += 32) {
    const int64_t j = j0 + lane;
    A x = -INFINITY;
    if (j < kv_end) {
      A s = 0;
      if (p.kv_storage == KVStorage::Dense) {
        const T* k_row = k + k_row_offset(p, o, j);
        for (int e = 0; e < dk; ++e) s += q_s[e] * to_acc<A>(k_row[e]);
      } else {  // (quantized: codes · the row's scale)
        const uint8_t* codes = static_cast<const uint8_t*>(p.k.data) + k_row_offset(p, o, j);
        for (int e = 0; e < dk; ++e) s += q_s[e] * A(code_value(p.kv_storage, codes[e]));
        s *= A(*k_scale_at(p, o, j));
      }
      x = transformed_score(p, s, slope, i, j);
      if (p.mask_kind != MaskKind::None) x += mask_term<A>(p, mask_base, i, j);
    }
    const A m_new = fmax(m, warp_max(x));
    const A m_use = m_new == A(-INFINITY) ? A(0) : m_new;  // no visible key yet
    const A alpha = exp_acc(m - m_use);
    A pr = x == A(-INFINITY) ? A(0) : exp_acc(x - m_use);
    l = l * alpha + warp_sum(pr);
    m = m_new;
    if (dropout && j < kv_end && !dropout_keeps(stream, p.dropout.threshold, o, i, j)) pr = 0;
    for (int e = lane; e < dv; e += 32) o_s[e] *= alpha;
    const int n = static_cast<int>(min64(32, kv_end - j0));
    for (int t = 0; t < n; ++t) {
      const A pt = __shfl_sync(0xffffffffu, pr, t);
      if (pt == A(0)) continue;  // (warp-uniform)
      if (p.kv_storage != KVStorage::Dense) {  // (quantized: the row's scale on its probability)
        const uint8_t* codes = static_cast<const uint8_t*>(p.v.data) + v_row_offset(p, o, j0 + t);
        const A ps = pt * A(*v_scale_at(p, o, j0 + t));
        for (int e = lane; e < dv; e += 32) o_s[e] += ps * A(code_value(p.kv_storage, codes[e]));
        continue;
      }
      const T* v_row = v + v_row_offset(p, o, j0 + t);
      for (int e = lane; e < dv; e += 32) o_s[e] += pt * to_acc<A>(v_row[e]);
    }
  }
  A inv, lse;
  if (isnan(l) || m == A(INFINITY)) {
    inv = NAN;
    lse = NAN;
  } else if (l > 0) {
    inv = (dropout ? A(1.0 / (1.0 - p.dropout.p)) : A(1)) / l;
    lse = m + log_acc(l);
  } else {
    inv = 0;
    lse = INFINITY;
  }
  T* out = static_cast<T*>(const_cast<void*>(p.out.data)) + outer_offset(p.outer, p.out, o) +
           i * p.out.row_stride;
  for (int e = lane; e < dv; e += 32) out[e * p.out.col_stride] = from_acc<T>(o_s[e] * inv);
  if (lane == 0) lse_rows<A>(p, p.lse, o)[i] = lse;
}

// What the backward needs of element (o, i, j) of the band besides the
// products: the probability P (0 where masked), the dropout factor Z/(1-p)
// (1 without dropout) and softcap's 1 − tanh² (1 without). Shared by both
// backward passes so that they agree exactly.
template <typename A>
struct BackwardElement {
  A p, z, dcap;
};

template <typename A>
__device__ __forceinline__ BackwardElement<A> backward_element(const AttentionParams& p,
                                                               const DropoutStream& stream,
                                                               int64_t mask_base, A slope,
                                                               A score, A lse, int64_t o,
                                                               int64_t i, int64_t j) {
  A dcap = 1;
  A x = transformed_score(p, score, slope, i, j, &dcap);
  if (p.mask_kind != MaskKind::None) x += mask_term<A>(p, mask_base, i, j);
  // exp(-inf - lse) is 0, and lse = +inf (a row with no key) gives 0 too.
  const A pr = x == A(-INFINITY) ? A(0) : exp_acc(x - lse);
  A z = 1;
  if (p.dropout.p > 0.0) {
    z = dropout_keeps(stream, p.dropout.threshold, o, i, j) ? A(1.0 / (1.0 - p.dropout.p)) : A(0);
  }
  return {pr, z, dcap};
}

// The backward in two passes without atomics for dQ, dK and dV (so those
// are deterministic), both recomputing P: dQ with one warp per query row,
// then dK and dV with one warp per key row. dS = P∘(dP∘Z/(1−p) − D),
// D = rowsum(dO∘O). A float mask's gradient, where asked for, is summed
// with atomics (its elements may be shared by rows, heads and batches).
template <typename T, typename A>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) backward_dq_kernel(const BackwardParams params) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int dk = static_cast<int>(params.fwd.dim_qk), dv = static_cast<int>(params.fwd.dim_v);
  A* q_s = reinterpret_cast<A*>(dynamic_smem()) + warp * (2 * dk + dv);
  A* dq_s = q_s + dk;
  A* do_s = dq_s + dk;

  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= params.fwd.num_outer * params.fwd.len_q) return;
  const int64_t o = row / params.fwd.len_q, i = row % params.fwd.len_q;
  const BackwardParams bp = sequence_of(params, o);
  const AttentionParams& p = bp.fwd;
  if (i >= p.len_q) return;
  const DropoutStream stream = p.dropout.p > 0.0 ? dropout_stream(p) : DropoutStream{};
  const T* q = static_cast<const T*>(p.q.data) + outer_offset(p.outer, p.q, o) + i * p.q.row_stride;
  const T* dout = static_cast<const T*>(bp.grad_out.data) + outer_offset(p.outer, bp.grad_out, o) +
                  i * bp.grad_out.row_stride;
  const T* k = static_cast<const T*>(p.k.data);  // key row j at k_row_offset(p, o, j)
  const T* v = static_cast<const T*>(p.v.data);
  const int64_t mask_base = p.mask_kind == MaskKind::None ? 0 : outer_offset(p.outer, p.mask, o);
  const A scale = static_cast<A>(p.scale);
  for (int e = lane; e < dk; e += 32) {
    q_s[e] = to_acc<A>(q[e]) * scale;
    dq_s[e] = 0;
  }
  for (int e = lane; e < dv; e += 32) do_s[e] = to_acc<A>(dout[e]);
  const A lse = lse_rows<const A>(p, p.lse, o)[i];
  const A delta = lse_rows<const A>(p, bp.delta, o)[i];

  const A slope = static_cast<A>(alibi_slope(p, o));
  for (int64_t j = band_key_begin(p, i); j < band_key_end(p, i + 1); ++j) {
    const T* k_row = k + k_row_offset(p, o, j);
    const A score = dot_row<T, A>(q_s, k_row, 1, dk, lane);
    const BackwardElement<A> el =
        backward_element(p, stream, mask_base, slope, score, lse, o, i, j);
    if (el.p == A(0)) continue;  // (warp-uniform: every lane has the same sums)
    const A dp = dot_row<T, A>(do_s, v + v_row_offset(p, o, j), 1, dv, lane);
    const A ds = el.p * (dp * el.z - delta) * el.dcap * scale;
    for (int e = lane; e < dk; e += 32) dq_s[e] += ds * to_acc<A>(k_row[e]);
  }
  A* grad_q = matrix_start<A>(p.outer, bp.grad_q, o) + i * bp.grad_q.row_stride;
  for (int e = lane; e < dk; e += 32) grad_q[e] = dq_s[e];
}

template <typename T, typename A>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) backward_dkdv_kernel(const BackwardParams params) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int dk = static_cast<int>(params.fwd.dim_qk), dv = static_cast<int>(params.fwd.dim_v);
  A* k_s = reinterpret_cast<A*>(dynamic_smem()) + warp * (2 * dk + 2 * dv);
  A* dk_s = k_s + dk;
  A* v_s = dk_s + dk;
  A* dv_s = v_s + dv;

  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= params.fwd.num_outer * params.fwd.len_kv) return;
  const int64_t o = row / params.fwd.len_kv, j = row % params.fwd.len_kv;
  const BackwardParams bp = sequence_of(params, o);
  const AttentionParams& p = bp.fwd;
  if (j >= p.len_kv) return;
  const DropoutStream stream = p.dropout.p > 0.0 ? dropout_stream(p) : DropoutStream{};
  const T* q = static_cast<const T*>(p.q.data) + outer_offset(p.outer, p.q, o);
  const T* dout = static_cast<const T*>(bp.grad_out.data) + outer_offset(p.outer, bp.grad_out, o);
  const T* k = static_cast<const T*>(p.k.data) + k_row_offset(p, o, j);
  const T* v = static_cast<const T*>(p.v.data) + v_row_offset(p, o, j);
  const int64_t mask_base = p.mask_kind == MaskKind::None ? 0 : outer_offset(p.outer, p.mask, o);
  const A scale = static_cast<A>(p.scale);
  for (int e = lane; e < dk; e += 32) {
    k_s[e] = to_acc<A>(k[e]) * scale;
    dk_s[e] = 0;
  }
  for (int e = lane; e < dv; e += 32) {
    v_s[e] = to_acc<A>(v[e]);
    dv_s[e] = 0;
  }
  const auto lse = lse_rows<const A>(p, p.lse, o);
  const auto delta = lse_rows<const A>(p, bp.delta, o);
  // The mask's gradient, summed with atomics (it may broadcast over warps).
  A* grad_mask = bp.grad_mask.data
                     ? matrix_start<A>(p.outer, bp.grad_mask, o) + j * bp.grad_mask.col_stride
                     : nullptr;

  // Only the queries whose band sees key j.
  const A slope = static_cast<A>(alibi_slope(p, o));
  for (int64_t i = band_query_begin(p, j); i < band_query_end(p, j + 1); ++i) {
    const T* q_row = q + i * p.q.row_stride;
    const A score = dot_row<T, A>(k_s, q_row, 1, dk, lane);
    const BackwardElement<A> el =
        backward_element(p, stream, mask_base, slope, score, lse[i], o, i, j);
    if (el.p == A(0)) continue;  // (warp-uniform)
    const T* do_row = dout + i * bp.grad_out.row_stride;
    const A dp = dot_row<T, A>(v_s, do_row, 1, dv, lane);
    const A ds_mask = el.p * (dp * el.z - delta[i]);  // (the gradient where the mask is added)
    if (grad_mask && lane == 0) {
      atomicAdd(grad_mask + i * bp.grad_mask.row_stride,
                ds_mask * static_cast<A>(bp.grad_mask_scale));
    }
    const A ds = ds_mask * el.dcap * scale;
    const A pd = el.p * el.z;
    for (int e = lane; e < dv; e += 32) dv_s[e] += pd * to_acc<A>(do_row[e]);
    for (int e = lane; e < dk; e += 32) dk_s[e] += ds * to_acc<A>(q_row[e]);
  }
  A* grad_k = matrix_start<A>(p.outer, bp.grad_k, o) + j * bp.grad_k.row_stride;
  A* grad_v = matrix_start<A>(p.outer, bp.grad_v, o) + j * bp.grad_v.row_stride;
  for (int e = lane; e < dk; e += 32) grad_k[e] = dk_s[e];
  for (int e = lane; e < dv; e += 32) grad_v[e] = dv_s[e];
}

// One warp per (item, query row); lanes over keys. An item is one outer
// index, or heads_per_item adjacent ones averaged.
template <typename T, typename A>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) weights_kernel(const WeightsParams wp) {
  const AttentionParams& p = wp.fwd;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int dk = static_cast<int>(p.dim_qk);
  const int64_t heads = wp.heads_per_item;
  A* q_s = reinterpret_cast<A*>(dynamic_smem()) + warp * heads * dk;

  const int64_t n_items = p.num_outer / heads;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= n_items * p.len_q) return;
  const int64_t item = row / p.len_q, i = row % p.len_q;
  const bool dropout = p.dropout.p > 0.0;
  const DropoutStream stream = dropout ? dropout_stream(p) : DropoutStream{};
  const A keep_scale = dropout ? A(1.0 / (1.0 - p.dropout.p)) : A(1);
  const A scale = static_cast<A>(p.scale);
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t o = item * heads + h;
    const T* q = static_cast<const T*>(p.q.data) + outer_offset(p.outer, p.q, o) + i * p.q.row_stride;
    for (int e = lane; e < dk; e += 32) q_s[h * dk + e] = (to_acc<A>(q[e])) * scale;
  }
  __syncwarp();
  T* out = static_cast<T*>(wp.weights) + row * p.len_kv;
  for (int64_t j = lane; j < p.len_kv; j += 32) {
    A w = 0;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t o = item * heads + h;
      const T* k_row = static_cast<const T*>(p.k.data) + k_row_offset(p, o, j);
      A x = 0;
      for (int e = 0; e < dk; ++e) x += q_s[h * dk + e] * (to_acc<A>(k_row[e]));
      x = transformed_score(p, x, A(alibi_slope(p, o)), i, j);
      if (!in_band(p, i, j)) {
        x = -INFINITY;
      } else if (p.mask_kind != MaskKind::None) {
        x += mask_term<A>(p, outer_offset(p.outer, p.mask, o), i, j);
      }
      const A lse = lse_rows<const A>(p, p.lse, o)[i];
      A pr = x == A(-INFINITY) ? A(0) : exp_acc(x - lse);
      if (dropout) pr *= dropout_keeps(stream, p.dropout.threshold, o, i, j) ? keep_scale : A(0);
      w += pr;
    }
    out[j] = from_acc<T>(w / static_cast<A>(heads));
  }
}

}  // namespace fusedmha::cuda::simple
