#pragma once

// Decoding in the forward kernel: few query rows against long keys. An item
// is a group of heads (their query rows packed into panels, one score tile
// each) over one chunk of the keys; with split keys, each chunk writes a
// partial result and combine() merges them by log-sum-exp.
//
// Included only by the per-ISA kernel units (compiled once per level with
// -DCPU_CAPABILITY=<LEVEL>, see cpu/isa_kernels.h): everything here lives in
// an anonymous namespace inside fusedmha::cpu::<LEVEL>.

#include "cpu/forward_kernel.h"

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

template <typename scalar_t, typename acc_t>
inline void ForwardKernel<scalar_t, acc_t>::run_decode(int64_t item) {
  const int64_t g = item / split_.kv_splits, chunk = item % split_.kv_splits;
  const int64_t heads = split_.heads, o0 = g * heads;
  p_ = sequence_of(p_, o0);                             // (a group's heads share their sequence)
  const int64_t panels = panel_count(split_), bq = nr;  // (a panel's rows: decode_rows <= nr)
  // The chunk's share of the keys any head of the group can see: chunks
  // of those keys, not of all, so that left padding, a static cache's
  // unused slots or a sliding window leave no thread idle. (Chunks are
  // whole blocks: a paged cache's still start at multiples of the block.)
  auto [kv_begin, kv_end] = key_range(o0, 0, p_.len_q);
  if (p_.pages.table) kv_begin = kv_begin / split_.block_kv * split_.block_kv;
  const int64_t chunk_len = chunk_length(kv_end - kv_begin);
  kv_begin = std::min(kv_end, kv_begin + chunk * chunk_len);
  kv_end = std::min(kv_end, kv_begin + chunk_len);
  // The first (head, block) now, while the query panels are packed: the
  // loop below queues each next one, and nothing queued this one. It
  // matters most where an item has few blocks (docs/performance.md,
  // "Decode prefetches into L1").
  if (p_.len_q > 0 && kv_begin < kv_end) {
    const int64_t cols = std::min(split_.block_kv, kv_end - kv_begin);
    tiles_.queue_key_rows(prefetch_, Tiles::KeySide::K, o0, kv_begin, cols, p_.dim_qk);
    tiles_.queue_key_rows(prefetch_, Tiles::KeySide::V, o0, kv_begin, cols, p_.dim_v);
    const Panel first = panel_of(o0, 0);
    tiles_.queue_mask_tile(prefetch_, first.o, first.q0, first.rows(), kv_begin, cols);
    prefetch_.issue(std::numeric_limits<int64_t>::max());
  }
  for (int64_t h = 0; h < panels; ++h) start_panel(panel_of(o0, h), bq, chunk, h);
  // The keys whose transpose ws_.kt holds: panels that read the same rows
  // (query heads of one K/V head that are not packed as rows of one item,
  // such as several queries per head, or one head's panels) transpose each
  // block once.
  const void* kt_keys = nullptr;
  int64_t kt_cols = 0;
  // Quantized K/V read straight from their codes (cpu/decode_codes.h): the
  // panels' queries are rows then (start_panel).
  const bool codes = tiles_.codes_in_registers();
  for (int64_t k0 = kv_begin; p_.len_q > 0 && k0 < kv_end; k0 += split_.block_kv) {
    const int64_t cols = std::min(split_.block_kv, kv_end - k0);
    for (int64_t h = 0; h < panels; ++h) {
      const Panel pn = panel_of(o0, h);  // (its heads read pn.o's K/V rows)
      const int64_t o = pn.o, rows = pn.rows();
      if (rows == 0) continue;  // (a shorter sequence's last panels)
      // Sᵀ's rows: up to w query rows (such as a GQA group's 4) in one
      // vector of lanes, not a panel of two (half the lines to zero and to
      // keep in L1).
      const int64_t ls = rows > w ? bq : w;
      const RowState<acc_t> st = head_state(h, bq);
      int64_t ldk = 0, ldv;
      const void* keys = tiles_.key_source(Tiles::KeySide::K, o, k0);
      const bool in_lanes = Tiles::scores_in_lanes(rows);
      const bool transposed = keys == kt_keys && cols == kt_cols && !in_lanes && !codes;
      queue_next_head_block(h, panels, k0, kv_end, rows, o0, transposed);
      PrefetchQueue* pq = &prefetch_;
      if (codes) {
        tiles_.code_scores_of(o, k0, cols, head_rows(h, bq), rows, ws_.st, ls, pq);
      } else {
        const acc_t* k = transposed ? nullptr
                                    : tiles_.key_rows_of(Tiles::KeySide::K, o, k0, cols,
                                                         p_.dim_qk, false, ws_.k, &ldk);
        tiles_.few_row_scores(k, ldk, cols, head_rows(h, bq), rows, ls, ws_.st, ws_.kt, pq,
                              transposed);
        if (!in_lanes) kt_keys = keys, kt_cols = cols;  // (lane_scores writes no kt)
      }
      tiles_.transform_scores(o, pn.q0, rows, ls, k0, cols, ws_.st, ws_.mt, nullptr, false,
                              pn.per_head);
      if (rows <= w) {
        softmax_step<1>(ls, cols, st, /*terms=*/nullptr, pq);
      } else {
        softmax_step(ls, cols, st, /*terms=*/nullptr, pq);
      }
      if (k0 != kv_begin) rescale_output(0, rows, st);  // (the first block's output is 0)
      if (codes) {
        tiles_.code_values_of(o, k0, cols, ws_.st, ls, rows, st.o, ws_.dv);
        continue;
      }
      const acc_t* v =
          tiles_.key_rows_of(Tiles::KeySide::V, o, k0, cols, p_.dim_v, true, ws_.v, &ldv);
      gemm<acc_t, /*kRowsOfA=*/false, /*kAccumulate=*/true>(
          rows, ws_.dv, cols, ws_.st, ls, [&](int64_t e) { return v + e; }, ldv, st.o, ws_.dv,
          NoEpilogue{}, pq);
    }
  }
  for (int64_t h = 0; h < panels; ++h) {
    const RowState<acc_t> st = head_state(h, bq);
    const Panel pn = panel_of(o0, h);
    const int64_t rows = pn.rows();
    if (split_.kv_splits == 1) {
      write_panel(pn, st);
      continue;
    }
    acc_t* part = partial(g, chunk, h);
    std::copy(st.m, st.m + rows, part);
    const int64_t record_rows = partial_rows(split_, call_.len_q);
    std::copy(st.l, st.l + rows, part + record_rows);
    std::copy(st.o, st.o + rows * ws_.dv, part + 2 * record_rows);
  }
}

template <typename scalar_t, typename acc_t>
inline void ForwardKernel<scalar_t, acc_t>::combine(int64_t g) {
  const int64_t o0 = g * split_.heads;
  p_ = sequence_of(p_, o0);
  const int64_t dv = ws_.dv, record_rows = partial_rows(split_, call_.len_q);
  const RowState<acc_t> st = head_state(0, nr);
  for (int64_t h = 0; h < panel_count(split_); ++h) {
    const Panel pn = panel_of(o0, h);
    for (int64_t i = 0; i < pn.rows(); ++i) {
      acc_t top = neg_inf<acc_t>();
      for (int64_t c = 0; c < split_.kv_splits; ++c) {
        const acc_t m = partial(g, c, h)[i];
        if (std::isnan(m) || m > top) top = m;  // (NaN stays)
        if (std::isnan(top)) break;
      }
      acc_t l = 0;
      acc_t* out = st.o + i * dv;
      std::fill(out, out + dv, acc_t(0));
      const bool finite = !std::isnan(top) && std::isfinite(top);
      for (int64_t c = 0; finite && c < split_.kv_splits; ++c) {
        const acc_t* part = partial(g, c, h);
        if (part[i] == neg_inf<acc_t>()) continue;
        const acc_t weight = std::exp(part[i] - top);
        l += part[record_rows + i] * weight;
        const acc_t* o = part + 2 * record_rows + i * dv;
        for (int64_t e = 0; e < dv; ++e) out[e] += o[e] * weight;
      }
      // (A chunk's NaN sum, from a NaN score, makes the row NaN.)
      for (int64_t c = 0; c < split_.kv_splits; ++c) {
        if (std::isnan(partial(g, c, h)[record_rows + i]))
          l = std::numeric_limits<acc_t>::quiet_NaN();
      }
      st.m[i] = top;
      st.l[i] = l;
    }
    write_panel(pn, st);
  }
}

template <typename scalar_t, typename acc_t>
inline void ForwardKernel<scalar_t, acc_t>::queue_next_head_block(int64_t h, int64_t panels,
                                                                  int64_t k0, int64_t kv_end,
                                                                  int64_t rows, int64_t o0,
                                                                  bool keys_transposed) {
  const bool last_head = h + 1 == panels;
  const int64_t o = panel_of(o0, h).o;
  const Panel next = panel_of(o0, last_head ? 0 : h + 1);
  const int64_t next_o = next.o;
  const int64_t next_k0 = last_head ? k0 + split_.block_kv : k0;
  const int64_t next_cols = std::min(split_.block_kv, kv_end - next_k0);
  // (Not where the next head reads this one's rows: they are here already.)
  auto same_rows = [&](Tiles::KeySide side) {
    return tiles_.key_source(side, next_o, next_k0) == tiles_.key_source(side, o, k0);
  };
  if (next_cols > 0 && !same_rows(Tiles::KeySide::K)) {
    tiles_.queue_key_rows(prefetch_, Tiles::KeySide::K, next_o, next_k0, next_cols, p_.dim_qk);
  }
  if (next_cols > 0 && !same_rows(Tiles::KeySide::V)) {
    tiles_.queue_key_rows(prefetch_, Tiles::KeySide::V, next_o, next_k0, next_cols, p_.dim_v);
  }
  // (A key padding row that every head shares: once per block.)
  const bool shared_row = p_.mask.row_stride == 0 &&
                          (p_.outer.dims == 0 || p_.mask.outer_stride[p_.outer.dims - 1] == 0);
  if (next_cols > 0 && p_.mask_kind != MaskKind::None && (last_head || !shared_row)) {
    tiles_.queue_mask_tile(prefetch_, next.o, next.q0, next.rows(), next_k0, next_cols);
  }
  const int64_t cols = std::min(split_.block_kv, kv_end - k0);
  if (tiles_.codes_in_registers()) {
    prefetch_.pace(code_score_steps(cols, rows) + div_up(cols, kSoftmaxKeysPerBurst));
    return;
  }
  prefetch_.pace(tiles_.few_row_bursts(cols, rows, keys_transposed) +
                 div_up(cols, kSoftmaxKeysPerBurst) + ws_.dv / nr * div_up(rows, kMicroRows));
}

template <typename scalar_t, typename acc_t>
inline int64_t ForwardKernel<scalar_t, acc_t>::chunk_length(int64_t len_kv) const {
  return round_up(std::max(div_up(std::max<int64_t>(len_kv, 1), split_.kv_splits), kMinChunkKeys),
                  split_.block_kv);
}

template <typename scalar_t, typename acc_t>
inline acc_t* ForwardKernel<scalar_t, acc_t>::partial(int64_t g, int64_t c, int64_t h) const {
  const int64_t record = partial_rows(split_, call_.len_q) * (2 + ws_.dv);
  return static_cast<acc_t*>(split_.partials) +
         ((g * split_.kv_splits + c) * panel_count(split_) + h) * record;
}

template <typename scalar_t, typename acc_t>
inline typename ForwardKernel<scalar_t, acc_t>::Panel ForwardKernel<scalar_t, acc_t>::panel_of(
    int64_t o0, int64_t h) const {
  if (split_.row_splits == 1) return {o0 + h * split_.merged, 0, p_.len_q, split_.merged};
  const int64_t step = panel_step(split_, call_.len_q);
  const int64_t q0 = h % split_.row_splits * step;
  return {o0 + h / split_.row_splits, q0, std::clamp<int64_t>(p_.len_q - q0, 0, step), 1};
}

template <typename scalar_t, typename acc_t>
inline void ForwardKernel<scalar_t, acc_t>::start_panel(const Panel& pn, int64_t bq, int64_t chunk,
                                                        int64_t h) {
  const int64_t rows = pn.rows(), per_head = pn.per_head;
  const RowState<acc_t> st = head_state(h, bq);
  if (rows > 0 && tiles_.codes_in_registers()) {
    // (Rows up to a multiple of 4 zero: code_scores takes them 4 at a time.)
    for (int64_t m = 0; m < pn.heads; ++m) {
      const int64_t padded = m + 1 == pn.heads ? round_up(rows, 4) - m * per_head : per_head;
      tiles_.pack_rows(p_.q, pn.o + m, pn.q0, per_head, padded, p_.dim_qk,
                       static_cast<acc_t>(p_.scale), head_rows(h, bq) + m * per_head * p_.dim_qk);
    }
  } else if (rows > 0) {
    const int64_t lanes = Tiles::few_row_lanes(rows);
    for (int64_t m = 0; m < pn.heads; ++m) {
      // (The last head's call zeroes the panel's lanes past its rows.)
      const int64_t padded = m + 1 == pn.heads ? lanes - m * per_head : per_head;
      tiles_.pack_transposed(p_.q, pn.o + m, pn.q0, per_head, padded, p_.dim_qk,
                             static_cast<acc_t>(p_.scale), head_rows(h, bq) + m * per_head, lanes);
    }
  }
  start_rows(pn.o, rows, bq, /*with_sink=*/chunk == 0, st);
  if (chunk != 0 || !has_sinks(p_)) return;
  for (int64_t m = 1; m < pn.heads; ++m) {
    std::fill_n(st.m + m * per_head, per_head, static_cast<acc_t>(sink_logit(p_, pn.o + m)));
  }
}

template <typename scalar_t, typename acc_t>
inline void ForwardKernel<scalar_t, acc_t>::write_panel(const Panel& pn,
                                                        const RowState<acc_t>& st) {
  for (int64_t m = 0; m < pn.heads; ++m) {
    const int64_t r = m * pn.per_head;
    write_output(pn.o + m, pn.q0, pn.per_head,
                 {st.m + r, st.l + r, st.alpha + r, st.o + r * ws_.dv});
  }
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
