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

#include "cpu/kernels.h"

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// Rows of the register-blocked micro-kernels: as many as leave room for two
// vector columns of accumulators plus operands in the register file.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kMicroRows = 12;  // 24 of 32 zmm registers accumulate
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kMicroRows = 6;   // 12 of 16 ymm registers accumulate
#else
constexpr int64_t kMicroRows = 4;
#endif
constexpr int64_t kMaxBlockQ = 128;
constexpr int64_t kBlockKV = 64;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int64_t div_up(int64_t x, int64_t m) { return (x + m - 1) / m; }

template <typename scalar_t> struct AccType { using type = float; };
template <> struct AccType<double> { using type = double; };

// Two vectors: the column width of the micro-kernels, and the granule in
// which query blocks and value dims are padded.
template <typename acc_t>
constexpr int64_t panel_width() { return 2 * Vectorized<acc_t>::size(); }

template <typename acc_t>
constexpr acc_t neg_inf() { return -std::numeric_limits<acc_t>::infinity(); }

// c[M × 2 vectors] (+)= a[M × n] · b[n × 2 vectors], b's row t at b + t·b_step.
// The a operand comes two ways, both read in place:
//  - kRowsOfA: row i of a is a + i·lda (Sᵀ = K·Qᵀ: a = rows of K)
//  - otherwise a is given by its columns: element (i, t) at a[t·lda + i]
//    (O += P·V with P held as Pᵀ).
template <typename acc_t, int64_t M, bool kRowsOfA, bool kAccumulate>
inline void microkernel(const acc_t* a, int64_t lda, const acc_t* b, int64_t b_step, int64_t n,
                        acc_t* c, int64_t ldc) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t w = Vec::size();
  Vec c0[M], c1[M];
#pragma GCC unroll 16
  for (int64_t i = 0; i < M; ++i) {
    c0[i] = kAccumulate ? Vec::loadu(c + i * ldc) : Vec(acc_t(0));
    c1[i] = kAccumulate ? Vec::loadu(c + i * ldc + w) : Vec(acc_t(0));
  }
  for (int64_t t = 0; t < n; ++t) {
    const Vec b0 = Vec::loadu(b + t * b_step);
    const Vec b1 = Vec::loadu(b + t * b_step + w);
#pragma GCC unroll 16
    for (int64_t i = 0; i < M; ++i) {
      const Vec x(kRowsOfA ? a[i * lda + t] : a[t * lda + i]);
      c0[i] = at::vec::fmadd(x, b0, c0[i]);
      c1[i] = at::vec::fmadd(x, b1, c1[i]);
    }
  }
#pragma GCC unroll 16
  for (int64_t i = 0; i < M; ++i) {
    c0[i].store(c + i * ldc);
    c1[i].store(c + i * ldc + w);
  }
}

// The same for any row count m <= kMicroRows (the tail of a block).
template <typename acc_t, bool kRowsOfA, bool kAccumulate, int64_t M = kMicroRows>
inline void microkernel_rows(int64_t m, const acc_t* a, int64_t lda, const acc_t* b,
                             int64_t b_step, int64_t n, acc_t* c, int64_t ldc) {
  if constexpr (M > 0) {
    if (m == M) return microkernel<acc_t, M, kRowsOfA, kAccumulate>(a, lda, b, b_step, n, c, ldc);
    return microkernel_rows<acc_t, kRowsOfA, kAccumulate, M - 1>(m, a, lda, b, b_step, n, c, ldc);
  }
}

// Scratch of one thread, in acc_t elements.
template <typename acc_t>
struct Workspace {
  int64_t bq, bkv, dqk, dv;  // padded sizes
  acc_t* qt;     // bq × dqk    scaled Qᵀ in panels of nr queries
  acc_t* st;     // bkv × bq    scores, then probabilities, transposed
  acc_t* o;      // bq × dv     unnormalised output
  acc_t* k;      // bkv × dqk   widened key block (half-precision inputs)
  acc_t* v;      // bkv × dv    widened/padded value block (when not read in place)
  acc_t* mt;     // w × bkv     mask terms of w queries (general masks)
  acc_t* m;      // bq   running max
  acc_t* l;      // bq   running sum
  acc_t* alpha;  // bq   rescale factor of the current step

  // Lays the arrays out from base, or only counts them when base is null;
  // returns the number of elements.
  int64_t carve(const ForwardParams& p, acc_t* base) {
    constexpr int64_t nr = panel_width<acc_t>();
    bq = p.block_q;
    bkv = p.block_kv;
    dqk = p.dim_qk;
    dv = round_up(p.dim_v, nr);
    int64_t n = 0;
    auto take = [&](int64_t count) {
      acc_t* at = base ? base + n : nullptr;
      n += round_up(count, 16);  // each array starts on a 64-byte boundary
      return at;
    };
    qt = take(bq * dqk);
    st = take(bkv * bq);
    o = take(bq * dv);
    k = take(bkv * dqk);
    v = take(bkv * dv);
    mt = take(Vectorized<acc_t>::size() * round_up(bkv, Vectorized<acc_t>::size()));
    m = take(bq);
    l = take(bq);
    alpha = take(bq);
    return n;
  }
};

template <typename scalar_t, typename acc_t>
class ForwardKernel {
 public:
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t nr = panel_width<acc_t>();
  static constexpr int64_t w = Vec::size();

  ForwardKernel(const ForwardParams& p, void* workspace) : p_(p) {
    ws_.carve(p, static_cast<acc_t*>(workspace));
  }

  void run(int64_t item) {
    const int64_t nqb = num_query_blocks(p_);
    const int64_t o = item / nqb;
    const int64_t q0 = (item % nqb) * p_.block_q;
    const int64_t rows = std::min(p_.block_q, p_.len_q - q0);
    const int64_t bq = round_up(rows, nr);  // queries in vector lanes, padded

    pack_query(o, q0, rows, bq);
    std::fill(ws_.o, ws_.o + rows * ws_.dv, acc_t(0));
    std::fill(ws_.m, ws_.m + bq, neg_inf<acc_t>());
    std::fill(ws_.l, ws_.l + bq, acc_t(0));

    // Causal (top-left): query i sees keys 0..i, so this block needs keys
    // below q0 + rows; key blocks entirely above the diagonal are skipped.
    const int64_t kv_end = p_.is_causal ? std::min(p_.len_kv, q0 + rows) : p_.len_kv;
    for (int64_t k0 = 0; k0 < kv_end; k0 += p_.block_kv) {
      const int64_t cols = std::min(p_.block_kv, kv_end - k0);
      const acc_t* k = key_rows(o, k0, cols);
      const int64_t ldk = key_row_stride();
      for (int64_t j = 0; j < cols; j += kMicroRows) {
        for (int64_t c = 0; c < bq; c += nr) {
          microkernel_rows<acc_t, /*kRowsOfA=*/true, /*kAccumulate=*/false>(
              std::min(kMicroRows, cols - j), k + j * ldk, ldk, ws_.qt + c * ws_.dqk, nr,
              ws_.dqk, ws_.st + j * bq + c, bq);
        }
      }
      apply_masks(o, q0, rows, bq, k0, cols);
      softmax_step(bq, cols);
      rescale_output(rows);
      const acc_t* v = value_rows(o, k0, cols);
      const int64_t ldv = value_row_stride();
      // Value panels outermost: one panel of the value block stays in L1
      // while every query of the block accumulates from it.
      for (int64_t e = 0; e < ws_.dv; e += nr) {
        for (int64_t i = 0; i < rows; i += kMicroRows) {
          microkernel_rows<acc_t, /*kRowsOfA=*/false, /*kAccumulate=*/true>(
              std::min(kMicroRows, rows - i), ws_.st + i, bq, v + e, ldv, cols,
              ws_.o + i * ws_.dv + e, ws_.dv);
        }
      }
    }
    write_output(o, q0, rows);
  }

 private:
  const scalar_t* row_ptr(const MatrixView& t, int64_t o, int64_t i) const {
    return static_cast<const scalar_t*>(t.data) + t.offsets[o] + i * t.row_stride;
  }

  // Qᵀ in panels of nr queries: (query i, dim e) at [(i/nr)·dqk + e]·nr + i%nr.
  void pack_query(int64_t o, int64_t q0, int64_t rows, int64_t bq) {
    const acc_t scale = static_cast<acc_t>(p_.scale);
    for (int64_t i = 0; i < bq; ++i) {
      acc_t* dst = ws_.qt + (i / nr) * ws_.dqk * nr + i % nr;
      if (i < rows) {
        const scalar_t* src = row_ptr(p_.q, o, q0 + i);
        for (int64_t e = 0; e < ws_.dqk; ++e) dst[e * nr] = static_cast<acc_t>(src[e]) * scale;
      } else {
        for (int64_t e = 0; e < ws_.dqk; ++e) dst[e * nr] = acc_t(0);
      }
    }
  }

  // fp32/fp64 keys are read in place; half-precision ones are widened.
  static constexpr bool kReadKeysInPlace = std::is_same_v<scalar_t, acc_t>;
  int64_t key_row_stride() const { return kReadKeysInPlace ? p_.k.row_stride : ws_.dqk; }
  const acc_t* key_rows(int64_t o, int64_t k0, int64_t cols) {
    if constexpr (kReadKeysInPlace) {
      return row_ptr(p_.k, o, k0);
    } else {
      for (int64_t j = 0; j < cols; ++j) {
        const scalar_t* src = row_ptr(p_.k, o, k0 + j);
        acc_t* dst = ws_.k + j * ws_.dqk;
        for (int64_t e = 0; e < ws_.dqk; ++e) dst[e] = static_cast<acc_t>(src[e]);
      }
      return ws_.k;
    }
  }

  // Values are read in place when their rows fill whole panels; otherwise
  // (half precision, or Ev not a multiple of the panel) widened and padded.
  bool values_in_place() const {
    return std::is_same_v<scalar_t, acc_t> && p_.dim_v % nr == 0;
  }
  int64_t value_row_stride() const { return values_in_place() ? p_.v.row_stride : ws_.dv; }
  const acc_t* value_rows(int64_t o, int64_t k0, int64_t cols) {
    if (values_in_place()) return reinterpret_cast<const acc_t*>(row_ptr(p_.v, o, k0));
    for (int64_t j = 0; j < cols; ++j) {
      const scalar_t* src = row_ptr(p_.v, o, k0 + j);
      acc_t* dst = ws_.v + j * ws_.dv;
      for (int64_t e = 0; e < p_.dim_v; ++e) dst[e] = static_cast<acc_t>(src[e]);
      std::fill(dst + p_.dim_v, dst + ws_.dv, acc_t(0));
    }
    return ws_.v;
  }

  // Causal and explicit masks on the transposed scores (row j = key k0 + j).
  void apply_masks(int64_t o, int64_t q0, int64_t rows, int64_t bq, int64_t k0, int64_t cols) {
    if (p_.is_causal && k0 + cols - 1 > q0) {
      for (int64_t j = 0; j < cols; ++j) {
        // Key k0 + j is hidden from queries q0 + i with i < k0 + j - q0.
        const int64_t hidden = std::clamp<int64_t>(k0 + j - q0, 0, rows);
        std::fill(ws_.st + j * bq, ws_.st + j * bq + hidden, neg_inf<acc_t>());
      }
    }
    switch (p_.mask_kind) {
      case MaskKind::None: return;
      case MaskKind::Bool: return apply_mask<bool>(o, q0, rows, bq, k0, cols);
      case MaskKind::Additive: return apply_mask<scalar_t>(o, q0, rows, bq, k0, cols);
      case MaskKind::AdditiveFloat32: return apply_mask<float>(o, q0, rows, bq, k0, cols);
    }
  }

  // A mask value as a term added to the score: bool masks add 0 or -inf.
  static acc_t additive(bool allowed) { return allowed ? acc_t(0) : neg_inf<acc_t>(); }
  template <typename mask_t>
  static acc_t additive(mask_t value) { return static_cast<acc_t>(value); }

  template <typename mask_t>
  void apply_mask(int64_t o, int64_t q0, int64_t rows, int64_t bq, int64_t k0, int64_t cols) {
    const MatrixView& mk = p_.mask;
    const int64_t cs = mk.col_stride;
    const mask_t* base = static_cast<const mask_t*>(mk.data) + mk.offsets[o] + k0 * cs;
    if (mk.row_stride == 0) {
      // The same mask row for every query (a key padding mask): one term
      // per key row of Sᵀ.
      for (int64_t j = 0; j < cols; ++j) {
        const Vec term(additive(base[j * cs]));
        acc_t* s = ws_.st + j * bq;
        for (int64_t i = 0; i < rows; i += w) (Vec::loadu(s + i) + term).store(s + i);
      }
      return;
    }
    // A general mask is read along its rows (w queries at a time) into mt as
    // additive terms, then added onto Sᵀ through w × w transposes.
    const int64_t ldm = round_up(cols, w);
    for (int64_t i0 = 0; i0 < rows; i0 += w) {
      for (int64_t i = 0; i < w; ++i) {
        acc_t* dst = ws_.mt + i * ldm;
        int64_t j = 0;
        if (i0 + i < rows) {
          const mask_t* m = base + (q0 + i0 + i) * mk.row_stride;
          if (cs == 1) {
            for (; j < cols; ++j) dst[j] = additive(m[j]);
          } else {
            for (; j < cols; ++j) dst[j] = additive(m[j * cs]);
          }
        }
        std::fill(dst + j, dst + ldm, acc_t(0));
      }
      acc_t block[w * w];
      for (int64_t j0 = 0; j0 < cols; j0 += w) {
        transpose_block(ws_.mt + j0, ldm, block);
        for (int64_t j = j0; j < std::min(j0 + w, cols); ++j) {
          acc_t* s = ws_.st + j * bq + i0;
          (Vec::loadu(s) + Vec::loadu(block + (j - j0) * w)).store(s);
        }
      }
    }
  }

  // dst[w × w] = transpose of the w × w block at src (leading dim ld).
  static void transpose_block(const acc_t* src, int64_t ld, acc_t* dst) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<acc_t, float>) {
      return at::vec::transpose_mxn<float, 8, 8>(src, ld, dst, w);
    }
#elif defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<acc_t, float>) {
      return at::vec::transpose_mxn<float>(src, ld, dst, w, 16, 16);
    }
#endif
    for (int64_t i = 0; i < w; ++i) {
      for (int64_t j = 0; j < w; ++j) dst[j * w + i] = src[i * ld + j];
    }
  }

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
    scalar_t* out = static_cast<scalar_t*>(p_.out) + p_.out_offsets[o];
    acc_t* lse = static_cast<acc_t*>(p_.lse) + o * p_.len_q;
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
      scalar_t* dst = out + (q0 + i) * p_.out_row_stride;
      for (int64_t e = 0; e < p_.dim_v; ++e) dst[e] = static_cast<scalar_t>(acc[e] * inv);
      lse[q0 + i] = row_lse;
    }
  }

  const ForwardParams& p_;
  Workspace<acc_t> ws_;
};

template <typename scalar_t>
void run_items(const ForwardParams& p, int64_t begin, int64_t end, void* workspace) {
  ForwardKernel<scalar_t, typename AccType<scalar_t>::type> kernel(p, workspace);
  for (int64_t item = begin; item < end; ++item) kernel.run(item);
}

template <typename acc_t>
size_t configure(ForwardParams& p) {
  constexpr int64_t nr = panel_width<acc_t>();
  // Query blocks as large as kMaxBlockQ, but small enough that every thread
  // gets a few items (short sequences, batch 1).
  const int64_t lq = std::max<int64_t>(p.len_q, 1);
  const int64_t wanted_items = 4 * std::max<int64_t>(p.num_threads, 1);
  const int64_t blocks_per_row = div_up(wanted_items, std::max<int64_t>(p.outer, 1));
  p.block_q = std::clamp(round_up(div_up(lq, blocks_per_row), nr), nr, kMaxBlockQ);
  p.block_q = std::min(p.block_q, round_up(lq, nr));
  p.block_kv = std::min(kBlockKV, std::max<int64_t>(p.len_kv, 1));
  return sizeof(acc_t) * Workspace<acc_t>().carve(p, nullptr);
}

}  // namespace

size_t forward_configure(ForwardParams& p) {
  return p.dtype == DType::Float64 ? configure<double>(p) : configure<float>(p);
}

void forward_items(const ForwardParams& p, int64_t begin, int64_t end, void* workspace) {
  switch (p.dtype) {
    case DType::Float32: return run_items<float>(p, begin, end, workspace);
    case DType::Float64: return run_items<double>(p, begin, end, workspace);
    case DType::BFloat16: return run_items<c10::BFloat16>(p, begin, end, workspace);
    case DType::Float16: return run_items<c10::Half>(p, begin, end, workspace);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
