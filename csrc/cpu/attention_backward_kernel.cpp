// Fused attention backward on the CPU, compiled once per ISA level.
//
// FlashAttention-2's backward, transposed like the forward (queries in the
// vector lanes). The key blocks of each batch·head are dealt into
// grad_q_splits interleaved sets (set s takes blocks s, s + splits, ...);
// one work item = one (batch·head, set), so a single (batch, head) still
// spreads over every thread (or the batch·heads that share a mask
// gradient's elements, in turn, and a set). For each key block, and each block of queries
// that can see those keys, it recomputes, never storing L×S:
//   Pᵀ  = exp(K·(scale·Q)ᵀ − lse)          (masks as in the forward)
//   Zᵀ  = Pᵀ ∘ M                          (M: the forward's dropout factors,
//                                           regenerated; Z = P without dropout)
//   dV += Zᵀ·dO
//   dPᵀ = (V·dOᵀ) ∘ M
//   dSᵀ = Pᵀ ∘ (dPᵀ − D),  D = rowsum(dO ∘ O)
//   dK += dSᵀ·Q             (times scale at the end)
//   dQ += dSᵀᵀ·K            (into the set's own slice of grad_q; the host
//                            adds the slices, so no two threads share memory)
//   dMask += dS             (a float mask's gradient, when asked for: summed
//                            into the mask's shape; an item takes all the outer
//                            indices that sum into the same elements)
// with the same register-blocked micro-kernels, accumulating in fp32 (fp64
// for double).

#include "cpu/kernel_scratch.h"
#include "cpu/score_tiles.h"

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

// Scratch of one thread.
template <typename acc_t>
struct BackwardWorkspace {
  int64_t dqk, dv;  // head dims padded to the panel width
  acc_t* qt;   // bq × E      scaled Qᵀ in panels of nr queries
  acc_t* q;    // bq × dqk    widened query rows (when not read in place)
  acc_t* dot;  // bq × Ev     dOᵀ in panels of nr queries
  acc_t* dor;  // bq × dv     widened dO rows (when not read in place)
  acc_t* d;    // bq          D = rowsum(dO ∘ O)
  acc_t* lse;  // bq          log-sum-exp of the query block (+inf in padding)
  acc_t* pt;   // bkv × bq    Pᵀ
  acc_t* dst;  // bkv × bq    dPᵀ, then dSᵀ
  acc_t* dm;   // bkv × bq    dropout factors M (when dropout is on)
  acc_t* zt;   // bkv × bq    Zᵀ = Pᵀ ∘ M (when dropout is on)
  acc_t* dcap; // bkv × bq    1 − tanh² of the softcap (when softcap is on)
  acc_t* k;    // bkv × dqk   widened key block
  acc_t* v;    // bkv × dv    widened value block
  acc_t* mt;   // w × bkv     mask terms (general masks)
  acc_t* dk;   // bkv × dqk   dK accumulator
  acc_t* dvv;  // bkv × dv    dV accumulator
  acc_t* dq;   // bq × dqk    dQ of one query block
  acc_t* gm;   // mask_rows × mask_cols   a float mask's gradient over a key block's
               //             columns (one column where it broadcasts over keys)
  int64_t mask_rows, mask_cols, mask_ld;  // (mask_ld: 0 where it broadcasts over rows)

  BackwardWorkspace(const BackwardParams& bp, const WorkSplit& split, Arena<acc_t>& arena) {
    constexpr int64_t nr = panel_width<acc_t>(), w = Vectorized<acc_t>::size();
    const AttentionParams& p = bp.fwd;
    const int64_t bq = split.block_q, bkv = split.block_kv;
    dqk = round_up(p.dim_qk, nr);
    dv = round_up(p.dim_v, nr);
    qt = arena.take(bq * p.dim_qk);
    q = arena.take(bq * dqk);
    dot = arena.take(bq * p.dim_v);
    dor = arena.take(bq * dv);
    d = arena.take(bq);
    lse = arena.take(bq);
    pt = arena.take(bkv * bq);
    dst = arena.take(bkv * bq);
    dm = p.dropout.on() ? arena.take(bkv * bq) : nullptr;
    zt = p.dropout.on() ? arena.take(bkv * bq) : nullptr;
    dcap = p.softcap > 0 ? arena.take(bkv * bq) : nullptr;
    k = arena.take(bkv * dqk);
    v = arena.take(bkv * dv);
    mt = arena.take(w * round_up(bkv, w));
    dk = arena.take(bkv * dqk);
    dvv = arena.take(bkv * dv);
    dq = arena.take(bq * dqk);
    const Matrix& g = bp.grad_mask;
    mask_rows = g.data && g.row_stride != 0 ? p.len_q : 1;
    mask_cols = g.data && g.col_stride != 0 ? bkv : 1;
    mask_ld = mask_rows > 1 ? mask_cols : 0;
    gm = g.data ? arena.take(mask_rows * mask_cols) : nullptr;
  }
};

template <typename scalar_t, typename acc_t>
class BackwardKernel {
 public:
  using Vec = Vectorized<acc_t>;
  using Tiles = ScoreTiles<scalar_t, acc_t>;
  static constexpr int64_t nr = panel_width<acc_t>();
  static constexpr int64_t w = Vec::size();

  BackwardKernel(const BackwardParams& bp, const WorkSplit& split, Arena<acc_t> arena)
      : call_(bp), bp_(bp), p_(bp_.fwd), split_(split), tiles_(bp_.fwd), ws_(bp, split, arena) {}

  // The item's key blocks, each for its members in turn (members > 1: the
  // outer indices that share a mask gradient's elements). A mask's gradient
  // is summed in ws_.gm over the members and written once per key block (or
  // once per item, where it broadcasts over the keys: a single set).
  void run(int64_t item) {
    const int64_t splits = call_.grad_q_splits;
    const int64_t group = item / splits, set = item % splits;
    const int64_t nkb = div_up(call_.fwd.len_kv, split_.block_kv);
    const bool mask_per_key = call_.grad_mask.col_stride != 0;
    if (ws_.gm) std::fill(ws_.gm, ws_.gm + ws_.mask_rows * ws_.mask_cols, acc_t(0));
    for (int64_t kb = set; kb < nkb; kb += splits) {
      const int64_t block_k0 = kb * split_.block_kv;
      for (int64_t m = 0; m < split_.members; ++m) {
        const int64_t o = outer_of_member(call_, group, m);
        bp_ = sequence_of(call_, o);
        if (block_k0 >= p_.len_kv) continue;  // (past a shorter sequence's keys)
        acc_t* grad_q =
            matrix_start<acc_t>(p_.outer, bp_.grad_q, o) + set * bp_.grad_q_split_stride;
        key_block(o, block_k0, grad_q);
      }
      if (ws_.gm && mask_per_key) {
        write_mask_gradient(group, block_k0,
                            std::min(split_.block_kv, call_.fwd.len_kv - block_k0));
      }
    }
    if (ws_.gm && !mask_per_key) write_mask_gradient(group, 0, 1);
  }

 private:
  // dK and dV of the key block at block_k0 of outer index o, and their
  // share of dQ added into grad_q (o's rows of this set's slice).
  void key_block(int64_t o, int64_t block_k0, acc_t* grad_q) {
    const int64_t block_end = std::min(block_k0 + split_.block_kv, p_.len_kv);
    // Only the block's keys in o's span (key padding, left or right): those
    // outside it are neither read nor computed (as in the forward, which
    // starts and ends at the span), and their gradients are 0.
    const int64_t k0 = std::clamp(first_key_of(p_, o), block_k0, block_end);
    const int64_t cols = std::clamp(keys_of(p_, o), k0, block_end) - k0;
    zero_key_gradients(o, block_k0, k0 - block_k0);
    zero_key_gradients(o, k0 + cols, block_end - k0 - cols);
    if (cols == 0) return;
    const int64_t E = p_.dim_qk, Ev = p_.dim_v;

    int64_t ldk, ldv;
    const acc_t* k = tiles_.key_rows_of(Tiles::KeySide::K, o, k0, cols, E, /*panel_rows=*/true,
                                                 ws_.k, &ldk);
    const acc_t* v = tiles_.key_rows_of(Tiles::KeySide::V, o, k0, cols, Ev, /*panel_rows=*/false,
                                                 ws_.v, &ldv);
    std::fill(ws_.dk, ws_.dk + cols * ws_.dqk, acc_t(0));
    std::fill(ws_.dvv, ws_.dvv + cols * ws_.dv, acc_t(0));

    // Only the queries whose band sees these keys (causal, sliding window),
    // and whose mask tiles do not hide them all.
    const int64_t block_q = split_.block_q;
    const TileSpan seen = visible_tiles(p_, o, /*along_keys=*/false, k0, cols);
    const int64_t q_begin = std::max(band_query_begin(p_, k0), seen.begin);
    const int64_t q_end = std::min(band_query_end(p_, k0 + cols), seen.end);
    for (int64_t q0 = q_begin; q0 < q_end; q0 += block_q) {
      const int64_t rows = std::min(block_q, q_end - q0);
      const uint8_t tiles = mask_tiles_over(p_, o, q0, rows, k0, cols);
      if (tiles == kTileHidden) continue;  // (its gradients are 0)
      const int64_t bq = round_up(rows, nr);
      int64_t ldq, lddo;
      tiles_.pack_transposed(p_.q, o, q0, rows, bq, E, static_cast<acc_t>(p_.scale), ws_.qt);
      const acc_t* q = tiles_.rows_of(p_.q, o, q0, rows, E, true, ws_.q, &ldq);
      tiles_.pack_transposed(bp_.grad_out, o, q0, rows, bq, Ev, acc_t(1), ws_.dot);
      const acc_t* dout = tiles_.rows_of(bp_.grad_out, o, q0, rows, Ev, true, ws_.dor, &lddo);
      load_row_stats(o, q0, rows, bq, dout, lddo);

      tiles_.scores(k, ldk, cols, ws_.qt, bq, ws_.pt);
      tiles_.transform_scores(o, q0, rows, bq, k0, cols, ws_.pt, ws_.mt, ws_.dcap,
                              /*without_mask=*/tiles == kTileVisible);
      probabilities(cols, bq);
      const acc_t* zt = ws_.pt;
      if (p_.dropout.on()) {
        tiles_.dropout_factors(o, q0, rows, bq, k0, cols, ws_.dm);
        std::copy(ws_.pt, ws_.pt + cols * bq, ws_.zt);
        Tiles::scale_by(ws_.zt, ws_.dm, cols, bq);
        zt = ws_.zt;
      }
      // dV += Zᵀ·dO
      gemm<acc_t, /*kRowsOfA=*/true, /*kAccumulate=*/true>(
          cols, ws_.dv, rows, zt, bq, [&](int64_t e) { return dout + e; }, lddo, ws_.dvv, ws_.dv);
      // dPᵀ = (V·dOᵀ) ∘ M, then dSᵀ = Pᵀ ∘ (dPᵀ − D)
      gemm<acc_t, /*kRowsOfA=*/true, /*kAccumulate=*/false>(
          cols, bq, Ev, v, ldv, [&](int64_t c) { return ws_.dot + c * Ev; }, nr, ws_.dst, bq);
      if (p_.dropout.on()) Tiles::scale_by(ws_.dst, ws_.dm, cols, bq);
      score_gradients(cols, bq);
      if (ws_.gm) add_mask_gradient(q0, rows, bq, k0 - block_k0, cols);
      if (ws_.dcap) Tiles::scale_by(ws_.dst, ws_.dcap, cols, bq);
      // dK += dSᵀ·Q
      gemm<acc_t, /*kRowsOfA=*/true, /*kAccumulate=*/true>(
          cols, ws_.dqk, rows, ws_.dst, bq, [&](int64_t e) { return q + e; }, ldq, ws_.dk,
          ws_.dqk);
      // dQ (this key block's share) = dS·K, times scale
      gemm<acc_t, /*kRowsOfA=*/false, /*kAccumulate=*/false>(
          rows, ws_.dqk, cols, ws_.dst, bq, [&](int64_t e) { return k + e; }, ldk, ws_.dq,
          ws_.dqk);
      add_scaled_rows(grad_q + q0 * bp_.grad_q.row_stride, ws_.dq, rows);
    }
    write_key_gradients(o, k0, cols);
  }

  // dst[i, :E] += scale · dq[i, :E] for rows i (dst rows grad_q's row
  // stride apart, dq's ws_.dqk apart).
  void add_scaled_rows(acc_t* dst, const acc_t* dq, int64_t rows) const {
    const int64_t E = p_.dim_qk, ld = bp_.grad_q.row_stride;
    const acc_t scale = static_cast<acc_t>(p_.scale);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t e = 0; e < E; ++e) dst[i * ld + e] += scale * dq[i * ws_.dqk + e];
    }
  }

  // D = rowsum(dO ∘ O) − grad_lse and the saved log-sum-exp of the query block; padded
  // lanes get D = 0 and lse = +inf, so their probabilities are 0.
  void load_row_stats(int64_t o, int64_t q0, int64_t rows, int64_t bq, const acc_t* dout,
                      int64_t lddo) {
    const auto lse = lse_rows<const acc_t>(p_, p_.lse, o);
    const bool has_grad_lse = bp_.grad_lse.data != nullptr;
    const auto grad_lse = lse_rows<const acc_t>(p_, bp_.grad_lse, o);
    const scalar_t* out_rows = tiles_.start(p_.out, o) + q0 * p_.out.row_stride;
    for (int64_t i = 0; i < rows; ++i) {
      const scalar_t* out = out_rows + i * p_.out.row_stride;
      const acc_t* g = dout + i * lddo;
      acc_t sum = 0;
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        for (int64_t e = 0; e < p_.dim_v; ++e) sum += g[e] * out[e];
      } else {
        // (Widened a chunk at a time: a scalar conversion per value costs more than the dot.)
        acc_t wide[64];
        for (int64_t e0 = 0; e0 < p_.dim_v; e0 += 64) {
          const int64_t n = std::min<int64_t>(64, p_.dim_v - e0);
          widen(out + e0, wide, n);
          for (int64_t e = 0; e < n; ++e) sum += g[e0 + e] * wide[e];
        }
      }
      ws_.d[i] = has_grad_lse ? sum - grad_lse[q0 + i] : sum;
      ws_.lse[i] = lse[q0 + i];
    }
    std::fill(ws_.d + rows, ws_.d + bq, acc_t(0));
    std::fill(ws_.lse + rows, ws_.lse + bq, std::numeric_limits<acc_t>::infinity());
  }

  // Pᵀ = exp(Sᵀ − lse). A row with no attendable key has lse = +inf and so
  // P = 0; a NaN row (NaN lse) stays NaN.
  void probabilities(int64_t cols, int64_t bq) {
    for (int64_t c = 0; c < bq; c += w) {
      const Vec lse = Vec::loadu(ws_.lse + c);
      for (int64_t j = 0; j < cols; ++j) {
        acc_t* s = ws_.pt + j * bq + c;
        exp_of_difference(Vec::loadu(s), lse).store(s);
      }
    }
  }

  // dSᵀ = Pᵀ ∘ (dPᵀ − D): the gradient of the scores where the mask is
  // added (the softcap's factor comes after).
  void score_gradients(int64_t cols, int64_t bq) {
    for (int64_t c = 0; c < bq; c += w) {
      const Vec d = Vec::loadu(ws_.d + c);
      for (int64_t j = 0; j < cols; ++j) {
        acc_t* ds = ws_.dst + j * bq + c;
        (Vec::loadu(ws_.pt + j * bq + c) * (Vec::loadu(ds) - d)).store(ds);
      }
    }
  }

  // dS of queries q0.. (rows) and keys c0.. of the key block (cols) added
  // into ws_.gm, transposed from the tile's keys-by-queries layout. Where
  // the mask broadcasts over rows or keys the terms sum into one element.
  void add_mask_gradient(int64_t q0, int64_t rows, int64_t bq, int64_t c0, int64_t cols) {
    const int64_t ld = ws_.mask_ld, step = ws_.mask_cols > 1 ? 1 : 0;
    acc_t* first = ws_.gm + q0 * ld + c0 * step;
    for (int64_t i = 0; i < rows; ++i) {
      acc_t* row = first + i * ld;
      for (int64_t j = 0; j < cols; ++j) row[j * step] += ws_.dst[j * bq + i];
    }
  }

  // ws_.gm, scaled, into group's mask gradient at keys k0..k0+cols (in the
  // mask's dtype: each element is written once, by this item), then zeroed.
  void write_mask_gradient(int64_t group, int64_t k0, int64_t cols) {
    const Matrix& g = call_.grad_mask;
    if (g.col_stride == 0) cols = 1;
    const int64_t o = outer_of_member(call_, group, 0);
    const acc_t scale = static_cast<acc_t>(call_.grad_mask_scale);
    auto write = [&](auto* grad) {
      using out_t = std::remove_pointer_t<decltype(grad)>;
      grad = matrix_start<out_t>(call_.fwd.outer, g, o) + k0 * g.col_stride;
      for (int64_t i = 0; i < ws_.mask_rows; ++i) {
        acc_t* src = ws_.gm + i * ws_.mask_ld;
        for (int64_t j = 0; j < cols; ++j) {
          grad[i * g.row_stride + j * g.col_stride] = static_cast<out_t>(src[j] * scale);
        }
        std::fill(src, src + cols, acc_t(0));
      }
    };
    if (call_.grad_mask_float32) {
      write(static_cast<float*>(nullptr));
    } else {
      write(static_cast<scalar_t*>(nullptr));
    }
  }

  // Zero gradients for keys k0..k0+cols of outer index o (key padding).
  void zero_key_gradients(int64_t o, int64_t k0, int64_t cols) {
    const int64_t ldk = bp_.grad_k.row_stride, ldv = bp_.grad_v.row_stride;
    acc_t* gk = matrix_start<acc_t>(p_.outer, bp_.grad_k, o) + k0 * ldk;
    acc_t* gv = matrix_start<acc_t>(p_.outer, bp_.grad_v, o) + k0 * ldv;
    for (int64_t j = 0; j < cols; ++j) {
      std::fill(gk + j * ldk, gk + j * ldk + p_.dim_qk, acc_t(0));
      std::fill(gv + j * ldv, gv + j * ldv + p_.dim_v, acc_t(0));
    }
  }

  void write_key_gradients(int64_t o, int64_t k0, int64_t cols) {
    const int64_t E = p_.dim_qk, Ev = p_.dim_v;
    const acc_t scale = static_cast<acc_t>(p_.scale);
    const int64_t ldk = bp_.grad_k.row_stride, ldv = bp_.grad_v.row_stride;
    acc_t* gk = matrix_start<acc_t>(p_.outer, bp_.grad_k, o) + k0 * ldk;
    acc_t* gv = matrix_start<acc_t>(p_.outer, bp_.grad_v, o) + k0 * ldv;
    for (int64_t j = 0; j < cols; ++j) {
      for (int64_t e = 0; e < E; ++e) gk[j * ldk + e] = ws_.dk[j * ws_.dqk + e] * scale;
      for (int64_t e = 0; e < Ev; ++e) gv[j * ldv + e] = ws_.dvv[j * ws_.dv + e];
    }
  }

  const BackwardParams call_;  // the whole call
  BackwardParams bp_;          // call_ narrowed to an outer index's sequence
  const AttentionParams& p_;   // bp_.fwd
  const WorkSplit& split_;
  Tiles tiles_;
  BackwardWorkspace<acc_t> ws_;
};

}  // namespace

void backward_scratch(const BackwardParams& bp, WorkSplit& split) {
  split.workspace_bytes = workspace_bytes<BackwardWorkspace>(bp.fwd.dtype, bp, split);
}

void backward_item(const BackwardParams& bp, const WorkSplit& split, int64_t item,
                   void* workspace) {
  run_item_for_dtype<BackwardKernel>(bp.fwd.dtype, bp, split, item, workspace);
}

}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
