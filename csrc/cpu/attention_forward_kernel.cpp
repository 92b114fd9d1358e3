// Fused attention forward on the CPU, compiled once per ISA level.
//
// One work item = one (batch·head, block of query rows). For each block of
// keys it computes the transposed scores Sᵀ = K·(scale·Q)ᵀ (keys × queries)
// with register-blocked micro-kernels, folds them into a running max and
// sum per query (online softmax) and accumulates P·V into an fp32 (fp64 for
// double) accumulator that is normalised once at the end.
//
// Why Sᵀ: queries are the vector lanes, so
//  - the max/exp/sum passes of the softmax are plain vertical vector
//    operations (no horizontal reductions per row),
//  - K and V are read in place, row by row, through their strides (only Q is
//    repacked, once per item; half-precision K/V tiles are widened to fp32).
// Extra memory is a few tiles per thread; nothing of size L×S exists.
//
// This file sees only the params struct and ATen's header-only Vectorized:
// no tensors, no allocation, no threading (the host wrapper does those).

#include "cpu/attention_tiles.h"

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kMaxBlockQ = 128;
constexpr int64_t kBlockKV = 64;
// Query blocks of at most this many rows (decoding) take few_row_scores.
constexpr int64_t kFewRows = 8;

// Scratch of one thread.
template <typename acc_t>
struct ForwardWorkspace {
  acc_t* qt;     // bq × dqk    scaled Qᵀ in panels of nr queries
  acc_t* qr;     // kFewRows × dqk  scaled Q rows (blocks of few rows)
  acc_t* st;     // bkv × bq    scores, then probabilities, transposed
  acc_t* o;      // bq × dv     unnormalised output (dv: Ev padded to the panel width)
  acc_t* k;      // bkv × dqk   widened key block (half-precision inputs)
  acc_t* v;      // bkv × dv    widened/padded value block (when not read in place)
  acc_t* mt;     // w × bkv     mask terms of w queries (general masks)
  acc_t* dm;     // bkv × bq    dropout factors (when dropout is on)
  acc_t* m;      // bq          running max
  acc_t* l;      // bq          running sum
  acc_t* alpha;  // bq          rescale factor of the current step
  int64_t dv;

  ForwardWorkspace(const AttentionParams& p, const WorkSplit& split, Arena<acc_t>& arena) {
    constexpr int64_t nr = panel_width<acc_t>(), w = Vectorized<acc_t>::size();
    const int64_t bq = split.block_q, bkv = split.block_kv;
    dv = round_up(p.dim_v, nr);
    qt = arena.take(bq * p.dim_qk);
    qr = arena.take(kFewRows * p.dim_qk);
    st = arena.take(bkv * bq);
    o = arena.take(bq * dv);
    k = arena.take(bkv * round_up(p.dim_qk, nr));
    v = arena.take(bkv * dv);
    mt = arena.take(w * round_up(bkv, w));
    dm = p.dropout.on() ? arena.take(bkv * bq) : nullptr;
    m = arena.take(bq);
    l = arena.take(bq);
    alpha = arena.take(bq);
  }
};

template <typename scalar_t, typename acc_t>
class ForwardKernel {
 public:
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t nr = panel_width<acc_t>();
  static constexpr int64_t w = Vec::size();

  ForwardKernel(const AttentionParams& p, const WorkSplit& split, Arena<acc_t> arena)
      : p_(p), split_(split), tiles_(p_), ws_(p, split, arena) {}

  void run(int64_t item) {
    // Items cover the longest sequence; a shorter one's extra items do nothing.
    const int64_t nqb = div_up(p_.len_q, split_.block_q);
    const int64_t o = item / nqb;
    const int64_t q0 = (item % nqb) * split_.block_q;
    p_ = sequence_of(p_, o);
    if (q0 >= p_.len_q) return;
    const int64_t rows = std::min(split_.block_q, p_.len_q - q0);
    const int64_t bq = round_up(rows, nr);  // queries in vector lanes, padded

    const bool few_rows = rows <= kFewRows && p_.softcap == 0;
    if (few_rows) {
      tiles_.pack_rows(p_.q, o, q0, rows, p_.dim_qk, static_cast<acc_t>(p_.scale), ws_.qr);
    } else {
      tiles_.pack_transposed(p_.q, o, q0, rows, bq, p_.dim_qk, static_cast<acc_t>(p_.scale),
                             ws_.qt);
    }
    std::fill(ws_.o, ws_.o + rows * ws_.dv, acc_t(0));
    // A sink is a key of score `sink` and no value: the running max and sum
    // start from it.
    const bool sink = has_sinks(p_);
    std::fill(ws_.m, ws_.m + bq, sink ? static_cast<acc_t>(sink_logit(p_, o)) : neg_inf<acc_t>());
    std::fill(ws_.l, ws_.l + bq, acc_t(sink ? 1 : 0));

    // Only the keys the block's band can see (causal, sliding window): the
    // rest are skipped, not computed and masked.
    auto [kv_begin, kv_end] = tiles_.key_range(o, q0, rows);
    // (Blocks of a paged cache start at multiples of the block, so none
    // crosses a page; the band masks the keys this adds.)
    if (p_.pages.table) kv_begin = kv_begin / split_.block_kv * split_.block_kv;
    for (int64_t k0 = kv_begin; k0 < kv_end; k0 += split_.block_kv) {
      const int64_t cols = std::min(split_.block_kv, kv_end - k0);
      if (k0 + cols < kv_end) {
        const int64_t next = std::min(split_.block_kv, kv_end - k0 - cols);
        tiles_.prefetch_key_rows(Tiles::KeySide::K, o, k0 + cols, next, p_.dim_qk);
        tiles_.prefetch_key_rows(Tiles::KeySide::V, o, k0 + cols, next, p_.dim_v);
      }
      int64_t ldk, ldv;
      const acc_t* k = tiles_.key_rows_of(Tiles::KeySide::K, o, k0, cols, p_.dim_qk, false, ws_.k,
                                                 &ldk);
      if (few_rows) {
        tiles_.few_row_scores(k, ldk, cols, ws_.qr, rows, bq, ws_.st);
      } else {
        tiles_.scores(k, ldk, cols, ws_.qt, bq, ws_.st);
      }
      tiles_.transform_scores(o, q0, rows, bq, k0, cols, ws_.st, ws_.mt);
      softmax_step(bq, cols);
      rescale_output(rows);
      if (p_.dropout.on()) {
        // The running sum normalises with every probability; the output
        // accumulates only the kept ones, scaled by 1/(1 - p).
        tiles_.dropout_factors(o, q0, rows, bq, k0, cols, ws_.dm);
        Tiles::scale_by(ws_.st, ws_.dm, cols, bq);
      }
      const acc_t* v = tiles_.key_rows_of(Tiles::KeySide::V, o, k0, cols, p_.dim_v, true, ws_.v,
                                                 &ldv);
      gemm<acc_t, /*kRowsOfA=*/false, /*kAccumulate=*/true>(
          rows, ws_.dv, cols, ws_.st, bq, [&](int64_t e) { return v + e; }, ldv, ws_.o, ws_.dv);
    }
    write_output(o, q0, rows);
  }

 private:
  using Tiles = TileReader<scalar_t, acc_t>;

  // Folds the block's scores into the running max/sum of each query and
  // turns them into probabilities relative to the new max; alpha[i] is the
  // factor the output accumulated so far must be rescaled by.
  void softmax_step(int64_t bq, int64_t cols) {
    // Two vectors of queries at a time: two independent dependency chains,
    // and each key row of Sᵀ is read as one contiguous panel.
    const Vec vneg_inf(neg_inf<acc_t>()), zero(acc_t(0));
    for (int64_t c = 0; c < bq; c += nr) {
      const Vec m_old0 = Vec::loadu(ws_.m + c), m_old1 = Vec::loadu(ws_.m + c + w);
      Vec max0 = m_old0, max1 = m_old1;
      for (int64_t j = 0; j < cols; ++j) {
        const acc_t* s = ws_.st + j * bq + c;
        max0 = at::vec::maximum(max0, Vec::loadu(s));
        max1 = at::vec::maximum(max1, Vec::loadu(s + w));
      }
      // A query that has seen no attendable key yet keeps max -inf; subtract
      // 0 instead so that exp gives 0 rather than NaN.
      const Vec use0 = Vec::blendv(max0, zero, max0 == vneg_inf);
      const Vec use1 = Vec::blendv(max1, zero, max1 == vneg_inf);
      Vec sum0 = zero, sum1 = zero;
      for (int64_t j = 0; j < cols; ++j) {
        acc_t* s = ws_.st + j * bq + c;
        const Vec e0 = (Vec::loadu(s) - use0).exp_u20();
        const Vec e1 = (Vec::loadu(s + w) - use1).exp_u20();
        e0.store(s);
        e1.store(s + w);
        sum0 = sum0 + e0;
        sum1 = sum1 + e1;
      }
      const Vec alpha0 = (m_old0 - use0).exp_u20(), alpha1 = (m_old1 - use1).exp_u20();
      (Vec::loadu(ws_.l + c) * alpha0 + sum0).store(ws_.l + c);
      (Vec::loadu(ws_.l + c + w) * alpha1 + sum1).store(ws_.l + c + w);
      max0.store(ws_.m + c);
      max1.store(ws_.m + c + w);
      alpha0.store(ws_.alpha + c);
      alpha1.store(ws_.alpha + c + w);
    }
  }

  void rescale_output(int64_t rows) {
    for (int64_t i = 0; i < rows; ++i) {
      const acc_t a = ws_.alpha[i];
      if (a == acc_t(1)) continue;
      acc_t* acc = ws_.o + i * ws_.dv;
      const Vec va(a);
      for (int64_t e = 0; e < ws_.dv; e += w) (Vec::loadu(acc + e) * va).store(acc + e);
    }
  }

  void write_output(int64_t o, int64_t q0, int64_t rows) {
    scalar_t* out = matrix_start<scalar_t>(p_.outer, p_.out, o);
    const auto lse = lse_rows<acc_t>(p_, p_.lse, o);
    constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
    constexpr acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
    for (int64_t i = 0; i < rows; ++i) {
      const acc_t m = ws_.m[i], l = ws_.l[i];
      acc_t inv, row_lse;
      if (std::isnan(m) || m == inf) {
        // A NaN or +inf score makes the whole softmax row NaN, as in exact
        // arithmetic (the fast exp would otherwise hide it).
        inv = nan;
        row_lse = nan;
      } else if (l > acc_t(0)) {
        inv = acc_t(1) / l;
        row_lse = m + std::log(l);
      } else {
        // No key to attend to: output 0 and lse +inf, so that
        // exp(score - lse) is 0 for every key in the backward.
        inv = acc_t(0);
        row_lse = inf;
      }
      const acc_t* acc = ws_.o + i * ws_.dv;
      scalar_t* dst = out + (q0 + i) * p_.out.row_stride;
      for (int64_t e = 0; e < p_.dim_v; ++e) dst[e] = static_cast<scalar_t>(acc[e] * inv);
      lse[q0 + i] = row_lse;
    }
  }

  AttentionParams p_;  // a copy: run() narrows it to the item's sequence
  const WorkSplit& split_;
  Tiles tiles_;
  ForwardWorkspace<acc_t> ws_;
};

template <typename acc_t>
WorkSplit configure(const AttentionParams& p, int64_t threads) {
  constexpr int64_t nr = panel_width<acc_t>();
  WorkSplit split;
  split.block_q = band_block(p, std::min(work_block(p.len_q, p.num_outer, threads, nr, kMaxBlockQ),
                                          round_up(std::max<int64_t>(p.len_q, 1), nr)),
                             nr);
  split.block_kv = paged_block(p, std::min(kBlockKV, std::max<int64_t>(p.len_kv, 1)));
  split.items = p.num_outer * div_up(p.len_q, split.block_q);
  Arena<acc_t> counter(nullptr);
  ForwardWorkspace<acc_t> sizing(p, split, counter);
  split.workspace_bytes = counter.bytes();
  return split;
}

}  // namespace

WorkSplit forward_configure(const AttentionParams& p, int64_t threads) {
  return p.dtype == DType::Float64 ? configure<double>(p, threads) : configure<float>(p, threads);
}

void forward_item(const AttentionParams& p, const WorkSplit& split, int64_t item,
                  void* workspace) {
  run_item_for_dtype<ForwardKernel>(p.dtype, p, split, item, workspace);
}

}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
