#pragma once

// The score pipeline of a tile (ScoreTiles), over the tile inputs.
//
// Layout convention: a score tile is held transposed, Sᵀ (keys × queries),
// so that queries are the vector lanes: softmax passes are vertical vector
// operations with no horizontal reduction per row. The queries come packed
// as transposed panels; the keys as rows through their strides (widened
// from half precision) or as a block transposed once (transpose_keys).
//
// Included only by the per-ISA kernel units (compiled once per level with
// -DCPU_CAPABILITY=<LEVEL>, see cpu/isa_kernels.h): everything here lives in
// an anonymous namespace inside fusedmha::cpu::<LEVEL>, so each level has its
// own private copy.

#include "cpu/dropout_lanes.h"
#include "cpu/mask_bits.h"
#include "cpu/micro_kernels.h"
#include "cpu/tile_inputs.h"

#include <algorithm>
#include <cstdint>
#include <utility>

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

// The score pipeline of a tile, on the transposed scores Sᵀ (keys × queries):
// Sᵀ = K·(scale·Q)ᵀ by the micro-kernels (or, for few query rows, by
// few_row_scores), then softcap, ALiBi, the band, the mask and dropout, in
// that order (common/attention_params.h); the backward's softcap derivative.
template <typename scalar_t, typename acc_t>
class ScoreTiles : public TileInputs<scalar_t, acc_t> {
  using Base = TileInputs<scalar_t, acc_t>;
  using Base::key_rows;
  using Base::p_;
  using Base::rows_at;
  using Base::stream_;
  using Base::transpose_block;
  using Base::with_mask_type;

 public:
  using Base::key_source;
  using Base::start;
  using typename Base::KeySide;
  using typename Base::Vec;
  using Base::kSameType;
  using Base::nr;
  using Base::w;

  explicit ScoreTiles(const AttentionParams& p) : Base(p) {}

  // Sᵀ as scores() computes it (no softcap), bit for bit, for a block of
  // few query rows (decoding: one row per head, or the G heads of a K/V
  // head), each score accumulated along the head dim one FMA per dim in the
  // score GEMM's order. So these scores equal the ones the backward and the
  // weights pass recompute with the GEMM: with scores of 1e30, one ulp of
  // difference (dot products summed across lanes) was a factor of e^(±1e23)
  // in their exp(s − lse). qt holds the rows as one panel of
  // few_row_lanes(rows) query lanes (pack_transposed); lanes rows..bq of st
  // get 0. Two ways, by the rows:
  //  - half a vector to one (the G = 4 heads of a GQA group in 8 float
  //    lanes): lane_scores, the GEMM itself with one vector of query lanes;
  //  - fewer (one query per head) or more: the key block transposed into
  //    kt (transpose_keys), then each row's scores a vector of keys at a
  //    time, so the FMAs are rows·cols·dim, not cols·dim·(the lanes' count)
  //    / w. (With 4 rows in 8 lanes, the transposes cost about what the
  //    wasted lanes do, and lane_scores writes no kt: docs/performance.md,
  //    "Few-row scores".)
  //
  // With keys_transposed, kt already holds this block's transpose (written
  // by the call before, for a head that reads the same keys) and k is not
  // read. Before a transpose, the block's lines are asked into L1 in
  // address order, all at once: the transposes read w rows side by side,
  // which neither the hardware prefetchers follow nor leaves the loads of
  // a tile anything to overlap with. The lane_scores path reads the keys
  // row by row, with no transposes, and was slower with these requests, so
  // it makes none (docs/performance.md, "Decode prefetches into L1").
  void few_row_scores(const acc_t* k, int64_t ldk, int64_t cols, const acc_t* qt, int64_t rows,
                      int64_t bq, acc_t* st, acc_t* kt, PrefetchQueue* prefetch = nullptr,
                      bool keys_transposed = false) const {
    if (scores_in_lanes(rows)) return lane_scores(k, ldk, cols, qt, bq, st, prefetch);
    const int64_t d = p_.dim_qk, ldt = round_up(cols, w), ldq = few_row_lanes(rows);
    if (!keys_transposed) {
      const int64_t row_bytes = d * static_cast<int64_t>(sizeof(acc_t));
      for (int64_t j = 0; j < cols; ++j) {
        const uintptr_t row = reinterpret_cast<uintptr_t>(k + j * ldk);
        for (uintptr_t line = row & ~uintptr_t(63); line < row + row_bytes; line += 64) {
          prefetch_line_l1(reinterpret_cast<const void*>(line));
        }
      }
      transpose_keys(k, ldk, cols, d, kt, prefetch);
    }
    for (int64_t j = 0; j < cols * bq; j += w) Vec(acc_t(0)).store(st + j);
    for (int64_t j0 = 0; j0 < cols; j0 += 2 * w) {
      // (the first rows' scores carry the prefetch bursts: few_row_bursts)
      auto bursts = [&](int64_t i) { return i == 0 ? prefetch : nullptr; };
      int64_t i = 0;
      if (j0 + w < cols) {
        for (; i + 4 <= rows; i += 4) {
          row_scores<4, 2>(kt, ldt, j0, cols, qt, ldq, i, bq, st, bursts(i));
        }
        for (; i < rows; ++i) row_scores<1, 2>(kt, ldt, j0, cols, qt, ldq, i, bq, st, bursts(i));
      } else {
        for (; i + 4 <= rows; i += 4) {
          row_scores<4, 1>(kt, ldt, j0, cols, qt, ldq, i, bq, st, bursts(i));
        }
        for (; i < rows; ++i) row_scores<1, 1>(kt, ldt, j0, cols, qt, ldq, i, bq, st, bursts(i));
      }
    }
  }

  // few_row_scores for rows <= w: Sᵀ = K·Qᵀ by micro-kernels over kLaneKeys
  // keys and one vector of query lanes (as the score GEMM, which takes two),
  // reading the keys in place: no transpose, and nothing written but st.
  // The head dim goes in steps of kLaneSteps (each step's sums kept in st,
  // exact), with a prefetch burst before each: decoding's next K/V block
  // streams in evenly over this block's work. After the first kScoreSumChunk
  // dims, each chunk's steps sum in `chunk` and are then added to st: the
  // micro-kernel's own order, so the scores equal the GEMM's to the bit.
  static constexpr int64_t kLaneKeys = 8;  // chains: FMA latency × ports on current x86
  static constexpr int64_t kLaneSteps = 16;
  static_assert(kScoreSumChunk % kLaneSteps == 0, "a lane step never spans two sum chunks");
  __attribute__((noinline)) void lane_scores(const acc_t* k, int64_t ldk, int64_t cols,
                                             const acc_t* qt, int64_t bq, acc_t* st,
                                             PrefetchQueue* prefetch) const {
    const int64_t d = p_.dim_qk;
    if (d == 0) {  // no head dim: every score is 0 (and no step below writes st)
      for (int64_t j = 0; j < cols * bq; j += w) Vec(acc_t(0)).store(st + j);
      return;
    }
    alignas(64) acc_t chunk[kLaneKeys * w];
    for (int64_t j = 0; j < cols; j += kLaneKeys) {
      const int64_t m = std::min(kLaneKeys, cols - j);
      const acc_t* kj = k + j * ldk;
      acc_t* sj = st + j * bq;
      for (int64_t e = 0; e < d; e += kLaneSteps) {
        if (prefetch) prefetch->issue();
        const int64_t n = std::min(kLaneSteps, d - e);
        acc_t* c = e < kScoreSumChunk ? sj : chunk;
        const int64_t ldc = e < kScoreSumChunk ? bq : w;
        if (e % kScoreSumChunk == 0) {
          microkernel_rows<acc_t, /*kRowsOfA=*/true, /*kAccumulate=*/false, NoEpilogue, kLaneKeys,
                           1>(m, kj + e, ldk, qt + e * nr, nr, n, c, ldc, NoEpilogue{});
        } else {
          microkernel_rows<acc_t, /*kRowsOfA=*/true, /*kAccumulate=*/true, NoEpilogue, kLaneKeys,
                           1>(m, kj + e, ldk, qt + e * nr, nr, n, c, ldc, NoEpilogue{});
        }
        if (c == chunk && (e + n == d || (e + n) % kScoreSumChunk == 0)) {  // (a chunk's last step)
          for (int64_t i = 0; i < m; ++i) {
            (Vec::loadu(chunk + i * w) + Vec::loadu(sj + i * bq)).store(sj + i * bq);
          }
        }
      }
    }
    for (int64_t j = 0; j < cols; ++j) {
      for (int64_t c = w; c < bq; c += w) Vec(acc_t(0)).store(st + j * bq + c);
    }
  }

  // The bursts of prefetches few_row_scores issues over cols keys of rows rows.
  int64_t few_row_bursts(int64_t cols, int64_t rows, bool keys_transposed = false) const {
    if (scores_in_lanes(rows)) return div_up(cols, kLaneKeys) * div_up(p_.dim_qk, kLaneSteps);
    return (keys_transposed ? 0 : div_up(cols, w) * (p_.dim_qk / w)) +
           (rows > 0 ? div_up(cols, 2 * w) * div_up(p_.dim_qk, kScoreDimsPerBurst) : 0);
  }


  // row_scores issues a prefetch burst every kScoreDimsPerBurst dims: a
  // burst of more lines than the core has miss buffers for stalls it until
  // they arrive, serialising the transfer with the compute it should
  // overlap, so decoding's next (head, block) goes out in small bursts
  // spread over all its work. Bursts only at the key transposes and the P·V
  // calls left decoding waiting on them; with row_scores' sums kept in
  // registers (Register), every 8 dims read K/V fastest of the spacings
  // tried, and every kSoftmaxKeysPerBurst keys for the softmax
  // (ForwardKernel). docs/performance.md, "The prefetch queue".
  static constexpr int64_t kScoreDimsPerBurst = 8;

  // Whether few_row_scores takes lane_scores for `rows` rows (else the keys
  // transposed): where they fill more than half of 16 lanes, or half of 8 or
  // more. Rows that leave half the lanes or more empty do better from keys
  // transposed once (and kept while the next tile reads the same keys) than
  // from the GEMM's wasted lanes; on AVX2, rows that fill exactly half the
  // lanes stay in them, as there the transposes cost about what the wasted
  // lanes do (docs/performance.md, "Few-row scores").
  static constexpr bool scores_in_lanes(int64_t rows) {
    return rows <= w && (w >= 16 ? 2 * rows > w : 2 * rows >= w);
  }

  // The query lanes few_row_scores wants `rows` rows packed in: a panel of
  // nr where lane_scores loads them as vectors, else just the rows, which
  // row_scores broadcasts one element at a time. (A decoding item packs
  // its heads' queries into lines the caches have lost since the last
  // call: 4 rows padded to 32 lanes would write 8 times the lines, each
  // first read from memory; docs/performance.md, "Few-row scores".)
  static constexpr int64_t few_row_lanes(int64_t rows) {
    return scores_in_lanes(rows) ? nr : std::max<int64_t>(rows, 1);
  }

  // few_row_scores' scores of rows i..i+R and keys j0..j0+V·w (those below
  // cols): R·V independent FMA chains. Out of line, as gemm: inlined into
  // the decoding loop, GCC stored every accumulator to the stack each step.
  template <int R, int V>
  __attribute__((noinline)) void row_scores(const acc_t* kt, int64_t ldt, int64_t j0,
                                            int64_t cols, const acc_t* qt, int64_t ldq,
                                            int64_t i, int64_t bq, acc_t* st,
                                            PrefetchQueue* prefetch) const {
    const int64_t d = p_.dim_qk;
    const acc_t* q = qt + i;  // (row i + r, dim e at q[e·ldq + r])
    // In chunks of kScoreSumChunk dims, as the micro-kernel sums (the same bits).
    // The accumulators are of the register type, and every loop over them
    // is one flat loop over t = r·V + v (see Register).
    typename Register<acc_t>::type a[R * V];
    alignas(64) acc_t total[R * V * w];
#pragma GCC unroll 8
    for (int t = 0; t < R * V; ++t) a[t] = Vec(acc_t(0));
    for (int64_t e0 = 0; e0 < d; e0 += kScoreSumChunk) {
      if (e0 > 0) {
#pragma GCC unroll 8
        for (int t = 0; t < R * V; ++t) {
          if (e0 > kScoreSumChunk) a[t] = Vec(a[t]) + Vec::loadu(total + t * w);
          Vec(a[t]).store(total + t * w);
          a[t] = Vec(acc_t(0));
        }
      }
      for (int64_t e = e0, e1 = std::min(d, e0 + kScoreSumChunk); e < e1; ++e) {
        if (prefetch && e % kScoreDimsPerBurst == 0) prefetch->issue();
        const acc_t* keys = kt + e * ldt + j0;
#pragma GCC unroll 8
        for (int t = 0; t < R * V; ++t) {
          a[t] = at::vec::fmadd(Vec::loadu(keys + t % V * w), Vec(q[e * ldq + t / V]), Vec(a[t]));
        }
      }
    }
    if (d > kScoreSumChunk) {
#pragma GCC unroll 8
      for (int t = 0; t < R * V; ++t) a[t] = Vec(a[t]) + Vec::loadu(total + t * w);
    }
    // (total, done with, takes the finished sums for the scalar writes to st.)
#pragma GCC unroll 8
    for (int t = 0; t < R * V; ++t) Vec(a[t]).store(total + t * w);
    const int64_t n = std::min<int64_t>(cols - j0, V * w);
    for (int r = 0; r < R; ++r) {
      for (int64_t j = 0; j < n; ++j) st[(j0 + j) * bq + i + r] = total[r * V * w + j];
    }
  }

  // Sᵀ = K·(scale·Q)ᵀ for keys k (ldk apart) and the packed query panels qt.
  // With softcap, the scores come out capped (the GEMM's epilogue).
  void scores(const acc_t* k, int64_t ldk, int64_t cols, const acc_t* qt, int64_t bq,
              acc_t* st, PrefetchQueue* prefetch = nullptr) const {
    score_gemm</*kRowsOfA=*/true>(k, ldk, cols, qt, bq, st, prefetch);
  }

  // Kᵀ of a key block: the cols rows of k (ldk apart, dim wide) as dim rows
  // of ldt = round_up(cols, w) keys (lanes past cols zero), through w × w
  // register transposes. scores_of_keys_transposed then reads each step's
  // keys from one or two cache lines, where scores() reads one element of
  // each of its kMicroRows rows of k.
  // (prefetch: a burst of its lines per w × w block.)
  void transpose_keys(const acc_t* k, int64_t ldk, int64_t cols, int64_t dim, acc_t* kt,
                      PrefetchQueue* prefetch = nullptr) const {
    const int64_t ldt = round_up(cols, w);
    int64_t j0 = 0;
    for (; j0 + w <= cols; j0 += w) {
      int64_t e0 = 0;
      for (; e0 + w <= dim; e0 += w) {
        if (prefetch) prefetch->issue();
        transpose_block(k + j0 * ldk + e0, ldk, kt + e0 * ldt + j0, ldt);
      }
      for (; e0 < dim; ++e0) {
        for (int64_t j = 0; j < w; ++j) kt[e0 * ldt + j0 + j] = k[(j0 + j) * ldk + e0];
      }
    }
    for (; j0 < ldt; ++j0) {
      for (int64_t e = 0; e < dim; ++e) kt[e * ldt + j0] = j0 < cols ? k[j0 * ldk + e] : acc_t(0);
    }
  }

  // scores() from the key block's transpose_keys.
  void scores_of_keys_transposed(const acc_t* kt, int64_t cols, const acc_t* qt, int64_t bq,
                                 acc_t* st, PrefetchQueue* prefetch = nullptr) const {
    score_gemm</*kRowsOfA=*/false>(kt, round_up(cols, w), cols, qt, bq, st, prefetch);
  }

  // The rest of the score pipeline on the (capped) transposed scores st of
  // scores() (row j = key k0 + j, bq query lanes, queries q0..q0+rows): ALiBi,
  // the band (causal, sliding window), the explicit mask. With softcap and
  // dcap given, dcap first gets each element's d(capped)/d(score) = 1 − tanh²
  // = 1 − (capped / c)², laid out like st (the backward's chain rule). mt is
  // scratch of w × round_up(cols, w). With without_mask, the mask is left
  // out: the tile hides no key (its mask tiles say so), or the caller adds
  // mask_terms' tile (shared by several heads) itself.
  // A period p > 0 (decoding's merged heads: rows of several heads, p
  // each, that share the rest) takes row i as query q0 + i % p for the band;
  // then there is no ALiBi and no mask. With bits (a per-head bool mask's
  // hidden keys read ahead: the tile's first row's, in the block's chunk),
  // the tile's whole strips of w rows take them instead of the mask's rows:
  // the caller's bits must be o's rows q0.. over keys k0..k0+cols.
  void transform_scores(int64_t o, int64_t q0, int64_t rows, int64_t bq, int64_t k0,
                        int64_t cols, acc_t* st, acc_t* mt, acc_t* dcap = nullptr,
                        bool without_mask = false, int64_t period = 0,
                        const MaskBits& bits = {}) const {
    if (p_.softcap > 0 && dcap) softcap_derivative(cols * bq, st, dcap);
    if (p_.alibi_slopes.data) apply_alibi(o, q0, bq, k0, cols, st);
    if (has_band(p_)) {
      const int64_t step = period > 0 ? period : std::max<int64_t>(rows, 1);
      for (int64_t i = 0; i < rows; i += step) apply_band(q0, step, bq, k0, cols, st + i);
    }
    // Keys outside o's span (padding, left or right): rows of −inf.
    const int64_t first = std::clamp<int64_t>(first_key_of(p_, o) - k0, 0, cols);
    const int64_t last = std::clamp<int64_t>(keys_of(p_, o) - k0, first, cols);
    std::fill(st, st + first * bq, neg_inf<acc_t>());
    std::fill(st + last * bq, st + cols * bq, neg_inf<acc_t>());
    if (without_mask) return;
    with_mask_type([&](auto mask) {
      apply_mask<decltype(mask), /*kAdd=*/true>(o, q0, rows, bq, k0, cols, st, mt, bits);
    });
  }

  // The mask's additive terms of the tile (keys k0..k0+cols, queries
  // q0..q0+rows of outer index o), laid out like Sᵀ in terms (bkv × bq):
  // what transform_scores would add (0 in the padded lanes, which it leaves alone).
  void mask_terms(int64_t o, int64_t q0, int64_t rows, int64_t bq, int64_t k0, int64_t cols,
                  acc_t* terms, acc_t* mt) const {
    with_mask_type([&](auto mask) {
      apply_mask<decltype(mask), /*kAdd=*/false>(o, q0, rows, bq, k0, cols, terms, mt);
    });
    const int64_t lanes = round_up(rows, w);
    for (int64_t j = 0; lanes < bq && j < cols; ++j) {
      std::fill(terms + j * bq + lanes, terms + (j + 1) * bq, acc_t(0));
    }
  }

  // Dropout factors of the tile, laid out like Sᵀ: dm[j·bq + i] is
  // 1/(1 − p) where element (query q0 + i, key k0 + j) is kept, else 0
  // (0 in padded query lanes too).
  void dropout_factors(int64_t o, int64_t q0, int64_t rows, int64_t bq, int64_t k0, int64_t cols,
                       acc_t* dm) const {
    // Eight queries at a time: each key row of dm then takes 8 contiguous
    // factors from one batch of Philox blocks.
    constexpr int kLanes = 8;
    const acc_t keep = static_cast<acc_t>(1.0 / (1.0 - p_.dropout.p));
    const uint32_t threshold = p_.dropout.threshold;
#if defined(__AVX2__)
    if constexpr (std::is_same_v<acc_t, float>) {
      return dropout_factors_avx2(o, q0, rows, bq, k0, cols, keep, threshold, dm);
    }
#endif
    uint32_t r[4][kLanes];
    for (int64_t i0 = 0; i0 < bq; i0 += kLanes) {
      const int64_t n = std::clamp<int64_t>(rows - i0, 0, kLanes);  // real queries here
      for (int64_t key4 = k0 / 4 * 4; key4 < k0 + cols; key4 += 4) {
        if (n > 0) philox_rows<kLanes>(stream_, o, q0 + i0, key4 / 4, r);
        for (int64_t c = 0; c < 4; ++c) {
          const int64_t j = key4 + c - k0;
          if (j < 0 || j >= cols) continue;
          acc_t* d = dm + j * bq + i0;
          for (int64_t l = 0; l < kLanes; ++l) {
            d[l] = l < n && r[c][l] >= threshold ? keep : acc_t(0);
          }
        }
      }
    }
  }

#if defined(__AVX2__)
  // dropout_factors for float tiles, all in vector registers: the stream's
  // 64-bit lanes are compared with the threshold and packed into 8 float
  // lanes (one per query) per key.
  void dropout_factors_avx2(int64_t o, int64_t q0, int64_t rows, int64_t bq, int64_t k0,
                            int64_t cols, float keep, uint32_t threshold, float* dm) const {
    const __m256 vkeep = _mm256_set1_ps(keep);
    // Kept iff the number is >= threshold: numbers are < 2^32, so a signed
    // 64-bit compare with threshold - 1 decides.
    const __m256i below = _mm256_set1_epi64x(static_cast<int64_t>(threshold) - 1);
    const __m256i low_halves = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t i0 = 0; i0 < bq; i0 += 8) {
      const int64_t n = std::clamp<int64_t>(rows - i0, 0, 8);  // real queries here
      const __m256i real = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane);
      for (int64_t key4 = k0 / 4 * 4; key4 < k0 + cols; key4 += 4) {
        __m256i words[4][2];
        if (n > 0) philox_words<2>(stream_, o, q0 + i0, key4 / 4, words);
        for (int64_t c = 0; c < 4; ++c) {
          const int64_t j = key4 + c - k0;
          if (j < 0 || j >= cols) continue;
          float* d = dm + j * bq + i0;
          if (n == 0) {
            _mm256_storeu_ps(d, _mm256_setzero_ps());
            continue;
          }
          const __m256i kept0 = _mm256_permutevar8x32_epi32(
              _mm256_cmpgt_epi64(words[c][0], below), low_halves);
          const __m256i kept1 = _mm256_permutevar8x32_epi32(
              _mm256_cmpgt_epi64(words[c][1], below), low_halves);
          const __m256i kept = _mm256_and_si256(_mm256_blend_epi32(kept0, kept1, 0xF0), real);
          _mm256_storeu_ps(d, _mm256_and_ps(_mm256_castsi256_ps(kept), vkeep));
        }
      }
    }
  }
#endif

  // The keys [begin, end) that queries q0..q0+rows of outer index o can see
  // (the band, the key padding, and the mask's tiles that hide every key).
  std::pair<int64_t, int64_t> key_range(int64_t o, int64_t q0, int64_t rows) const {
    const TileSpan tiles = visible_tiles(p_, o, /*along_keys=*/true, q0, rows);
    const int64_t end = std::min({band_key_end(p_, q0 + rows), keys_of(p_, o), tiles.end});
    const int64_t begin = std::max({band_key_begin(p_, q0), first_key_of(p_, o), tiles.begin});
    return {std::min(begin, end), end};
  }

  // x[j·bq + c] *= dm[j·bq + c] over the tile.
  static void scale_by(acc_t* x, const acc_t* dm, int64_t cols, int64_t bq) {
    for (int64_t t = 0; t < cols * bq; t += w) (Vec::loadu(x + t) * Vec::loadu(dm + t)).store(x + t);
  }

 private:
  // The score GEMM of scores() (kRowsOfA: keys as rows of k) and of
  // scores_of_keys_transposed (keys as the columns of kᵀ, ldk apart).
  template <bool kRowsOfA>
  void score_gemm(const acc_t* k, int64_t ldk, int64_t cols, const acc_t* qt, int64_t bq,
                  acc_t* st, PrefetchQueue* prefetch) const {
    const int64_t d = p_.dim_qk;
    auto q_panel = [&](int64_t c) { return qt + c * d; };
    if (p_.softcap > 0) {
      const SoftcapEpilogue<acc_t> cap(static_cast<acc_t>(p_.softcap));
      gemm<acc_t, kRowsOfA, /*kAccumulate=*/false, decltype(q_panel), SoftcapEpilogue<acc_t>,
           kScoreSumChunk>(cols, bq, d, k, ldk, q_panel, nr, st, bq, cap, prefetch);
    } else {
      gemm<acc_t, kRowsOfA, /*kAccumulate=*/false, decltype(q_panel), NoEpilogue,
           kScoreSumChunk>(cols, bq, d, k, ldk, q_panel, nr, st, bq, NoEpilogue{}, prefetch);
    }
  }

  // dcap = 1 − (s / c)² over n capped scores s = c·tanh(·).
  void softcap_derivative(int64_t n, const acc_t* st, acc_t* dcap) const {
    const Vec inv_c(acc_t(1) / static_cast<acc_t>(p_.softcap)), one(acc_t(1));
    for (int64_t t = 0; t < n; t += w) {
      const Vec tanh = Vec::loadu(st + t) * inv_c;
      (one - tanh * tanh).store(dcap + t);
    }
  }

  // + (−slope·|q + diagonal_offset − key|) on every element.
  void apply_alibi(int64_t o, int64_t q0, int64_t bq, int64_t k0, int64_t cols,
                   acc_t* st) const {
    const Vec neg_slope(static_cast<acc_t>(-alibi_slope(p_, o)));
    acc_t lane[w];
    for (int64_t l = 0; l < w; ++l) lane[l] = static_cast<acc_t>(l);
    const Vec lanes = Vec::loadu(lane);
    for (int64_t j = 0; j < cols; ++j) {
      // Query q0 + i's distance to key k0 + j is |i − (k0 + j − q0 − offset)|.
      const acc_t start = static_cast<acc_t>(q0 + p_.diagonal_offset - k0 - j);
      acc_t* s = st + j * bq;
      for (int64_t i = 0; i < bq; i += w) {
        const Vec distance = (lanes + Vec(start + static_cast<acc_t>(i))).abs();
        (Vec::loadu(s + i) + neg_slope * distance).store(s + i);
      }
    }
  }

  // −inf outside the band: key k0 + j is seen by queries [lo, hi] (absolute).
  void apply_band(int64_t q0, int64_t rows, int64_t bq, int64_t k0, int64_t cols,
                  acc_t* st) const {
    const bool left_ok = p_.window_left < 0 ||
                         k0 >= q0 + rows - 1 + p_.diagonal_offset - p_.window_left;
    const bool right_ok = p_.window_right < 0 ||
                          k0 + cols - 1 <= q0 + p_.diagonal_offset + p_.window_right;
    if (left_ok && right_ok) return;  // the whole tile is inside
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t key = k0 + j;
      // Seen by queries key − offset − right .. key − offset + left.
      const int64_t first = p_.window_right < 0 ? 0 : key - p_.diagonal_offset - p_.window_right;
      const int64_t last = p_.window_left < 0 ? q0 + rows : key - p_.diagonal_offset + p_.window_left;
      const int64_t lo = std::clamp<int64_t>(first - q0, 0, rows);
      const int64_t hi = std::clamp<int64_t>(last - q0 + 1, lo, rows);
      acc_t* s = st + j * bq;
      std::fill(s, s + lo, neg_inf<acc_t>());
      std::fill(s + hi, s + rows, neg_inf<acc_t>());
    }
  }

  // A mask value as a term added to the score: bool masks add 0 or -inf.
  static acc_t additive(bool allowed) { return allowed ? acc_t(0) : neg_inf<acc_t>(); }
  template <typename mask_t>
  static acc_t additive(mask_t value) { return static_cast<acc_t>(value); }

  // kAdd: st += the mask's terms of the tile; otherwise st = them (general
  // masks only; lanes from round_up(rows, w) on are left alone either way).
  template <typename mask_t, bool kAdd>
  void apply_mask(int64_t o, int64_t q0, int64_t rows, int64_t bq, int64_t k0, int64_t cols,
                  acc_t* st, acc_t* mt, const MaskBits& bits = {}) const {
    const Matrix& mk = p_.mask;
    const int64_t cs = mk.col_stride;
    const mask_t* base = matrix_start<const mask_t>(p_.outer, mk, o) + k0 * cs;
    if (mk.row_stride == 0) {
      // The same mask row for every query (a key padding mask): one term
      // per key row of Sᵀ.
      for (int64_t j = 0; j < cols; ++j) {
        const Vec term(additive(base[j * cs]));
        acc_t* s = st + j * bq;
        for (int64_t i = 0; i < rows; i += w) (kAdd ? Vec::loadu(s + i) + term : term).store(s + i);
      }
      return;
    }
    // A general mask is read along its rows (w queries at a time) into mt as
    // additive terms, then added onto Sᵀ through w × w transposes; on
    // AVX-512, a bool mask's strips of w whole rows, with keys contiguous,
    // go through bits instead (bool_strip).
    const int64_t ldm = round_up(cols, w);
    for (int64_t i0 = 0; i0 < rows; i0 += w) {
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (std::is_same_v<mask_t, bool> && std::is_same_v<acc_t, float>) {
        static_assert(w == 16, "bool_strip takes strips of 16 float lanes");
        if (bits.bits && i0 + w <= rows) {
          bool_strip<kAdd>(MaskBits{bits.bits + i0, bits.stride}, cols, st + i0, bq);
          continue;
        }
        if (cs == 1 && i0 + w <= rows) {
          bool_strip<kAdd>(base + (q0 + i0) * mk.row_stride, mk.row_stride, cols, st + i0, bq);
          continue;
        }
      }
#endif
      // A float mask's whole w × w blocks are transposed in place: no copy
      // into mt first.
      if constexpr (std::is_same_v<mask_t, acc_t>) {
        if (cs == 1 && i0 + w <= rows && cols % w == 0) {
          const mask_t* m = base + (q0 + i0) * mk.row_stride;
          acc_t block[w * w];
          for (int64_t j0 = 0; j0 < cols; j0 += w) {
            transpose_block(m + j0, mk.row_stride, block);
            for (int64_t j = 0; j < w; ++j) {
              acc_t* s = st + (j0 + j) * bq + i0;
              const Vec term = Vec::loadu(block + j * w);
              if constexpr (kAdd) {
                (Vec::loadu(s) + term).store(s);
              } else {
                term.store(s);
              }
            }
          }
          continue;
        }
      }
      for (int64_t i = 0; i < w; ++i) {
        acc_t* dst = mt + i * ldm;
        int64_t j = 0;
        if (i0 + i < rows) {
          const mask_t* m = base + (q0 + i0 + i) * mk.row_stride;
          if (cs == 1) {
            // (A vector at a time: bool and half-precision masks take this
            // path for every tile.)
            if constexpr (std::is_same_v<mask_t, bool>) {
              bool_terms(m, dst, cols);
            } else {
              widen(m, dst, cols);
            }
            j = cols;
          } else {
            for (; j < cols; ++j) dst[j] = additive(m[j * cs]);
          }
        }
        std::fill(dst + j, dst + ldm, acc_t(0));
      }
      acc_t block[w * w];
      for (int64_t j0 = 0; j0 < cols; j0 += w) {
        transpose_block(mt + j0, ldm, block);
        for (int64_t j = j0; j < std::min(j0 + w, cols); ++j) {
          acc_t* s = st + j * bq + i0;
          const Vec term = Vec::loadu(block + (j - j0) * w);
          if constexpr (kAdd) {
            (Vec::loadu(s) + term).store(s);
          } else {
            term.store(s);
          }
        }
      }
    }
  }

#if defined(CPU_CAPABILITY_AVX512)
  // A bool mask's 16 full query rows (ld apart) × cols keys onto their lanes
  // of Sᵀ (st: the first of them, rows bq apart): kAdd adds −inf where a key
  // is hidden (as adding the terms does, so NaN scores stay NaN), otherwise
  // stores the terms, 0 or −inf.
  template <bool kAdd>
  static void bool_strip(const bool* m, int64_t ld, int64_t cols, float* st, int64_t bq) {
    uint16_t blocked[kBlockedKeys];
    for (int64_t j0 = 0; j0 < cols; j0 += kBlockedKeys) {
      const int64_t n = std::min(kBlockedKeys, cols - j0);
      blocked_queries(m + j0, ld, n, blocked);
      add_blocked<kAdd>(blocked, n, st + j0 * bq, bq);
    }
  }
  // The same from the strip's hidden keys read ahead (bits: its first row's).
  template <bool kAdd>
  static void bool_strip(const MaskBits& bits, int64_t cols, float* st, int64_t bq) {
    uint16_t blocked[kBlockedKeys];
    for (int64_t j0 = 0; j0 < cols; j0 += kBlockedKeys) {
      blocked_from_bits(bits.bits + j0 / kBlockedKeys * bits.stride, blocked);
      add_blocked<kAdd>(blocked, std::min(kBlockedKeys, cols - j0), st + j0 * bq, bq);
    }
  }
  template <bool kAdd>
  static void add_blocked(const uint16_t* blocked, int64_t n, float* st, int64_t bq) {
    const __m512 vneg_inf = _mm512_set1_ps(neg_inf<float>());
    for (int64_t j = 0; j < n; ++j) {
      float* s = st + j * bq;
      if constexpr (kAdd) {
        const __m512 x = _mm512_loadu_ps(s);
        _mm512_storeu_ps(s, _mm512_mask_add_ps(x, blocked[j], x, vneg_inf));
      } else {
        _mm512_storeu_ps(s, _mm512_maskz_mov_ps(blocked[j], vneg_inf));
      }
    }
  }
#endif
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
