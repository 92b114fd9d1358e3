#pragma once

// The register-blocked GEMM micro-kernels every pass builds on (scores,
// P·V, the gradients), and the chunking of their sums that bounds rounding.
//
// Included only by the per-ISA kernel units (compiled once per level with
// -DCPU_CAPABILITY=<LEVEL>, see cpu/isa_kernels.h): everything here lives in
// an anonymous namespace inside fusedmha::cpu::<LEVEL>, so each level has its
// own private copy.

#include "cpu/prefetch.h"
#include "cpu/simd.h"

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

// Rows of the register-blocked micro-kernels: as many as leave room for two
// vector columns of accumulators plus operands in the register file.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kMicroRows = 12;  // 24 of 32 zmm registers accumulate
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kMicroRows = 6;   // 12 of 16 ymm registers accumulate
#else
constexpr int64_t kMicroRows = 4;
#endif

// What the score GEMM does to each vector of results before storing it:
// nothing, or the softcap s → c·tanh(s / c), while the scores are still in
// registers (one pass over the tile fewer).
struct NoEpilogue {
  template <typename Vec>
  Vec operator()(const Vec& s) const { return s; }
};

template <typename acc_t>
struct SoftcapEpilogue {
  Vectorized<acc_t> cap, two_over_cap;
  explicit SoftcapEpilogue(acc_t c) : cap(c), two_over_cap(acc_t(2) / c) {}
  Vectorized<acc_t> operator()(const Vectorized<acc_t>& s) const {
    return tanh_of_half(s * two_over_cap) * cap;
  }
};

// c[M × kVectors vectors] (+)= a[M × n] · b[n × kVectors vectors], b's row t
// at b + t·b_step, each result vector passed through the epilogue ep before
// it is stored. (kVectors = 1: few query lanes, few_row_scores.)
// The a operand comes two ways, both read in place:
//  - kRowsOfA: row i of a is a + i·lda (e.g. Sᵀ = K·Qᵀ with a = rows of K)
//  - otherwise a is given by its columns: element (i, t) at a[t·lda + i]
//    (e.g. O += P·V with P held as Pᵀ).
// kAddToC: the sum starts from 0 and c is added to it at the end (gemm's
// chunks after the first; kAccumulate instead starts the chain from c).
// Always inlined: compiled out of line, GCC keeps the accumulator arrays in
// memory (a store per FMA pair) instead of registers.
template <typename acc_t, int64_t M, bool kRowsOfA, bool kAccumulate, typename Epilogue,
          int kVectors = 2, bool kAddToC = false>
__attribute__((always_inline)) inline void microkernel(const acc_t* a, int64_t lda, const acc_t* b,
                                                       int64_t b_step, int64_t n, acc_t* c,
                                                       int64_t ldc, const Epilogue& ep) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t w = Vec::size();
  Vec c0[M], c1[kVectors == 2 ? M : 1];
#pragma GCC unroll 16
  for (int64_t i = 0; i < M; ++i) {
    c0[i] = kAccumulate ? Vec::loadu(c + i * ldc) : Vec(acc_t(0));
    if constexpr (kVectors == 2) c1[i] = kAccumulate ? Vec::loadu(c + i * ldc + w) : Vec(acc_t(0));
  }
  if constexpr (kRowsOfA) {
    // Row i of a is read at rows[i / 4] + {0, 1, 2, 3}[i % 4]·lda: three
    // pointers and two index registers (lda, 3·lda), each pointer stepped
    // along t. Left to itself, GCC keeps one pointer per row, which does not
    // fit the 16 general registers: it parks them in vector registers and on
    // the stack and moves one back per broadcast, on the FMA ports.
    constexpr int64_t kBases = (M + 3) / 4;
    const acc_t* rows[kBases];
#pragma GCC unroll 4
    for (int64_t r = 0; r < kBases; ++r) rows[r] = a + 4 * r * lda;
    const int64_t lda3 = 3 * lda;
    for (int64_t t = 0; t < n; ++t) {
      const Vec b0 = Vec::loadu(b + t * b_step);
      const Vec b1 = kVectors == 2 ? Vec::loadu(b + t * b_step + w) : b0;
#pragma GCC unroll 32
      for (int64_t i = 0; i < M; ++i) {
        const acc_t* row = rows[i / 4];
        const int64_t step = i % 4 == 3 ? lda3 : (i % 4) * lda;
        const Vec x(row[step]);
        c0[i] = at::vec::fmadd(x, b0, c0[i]);
        if constexpr (kVectors == 2) c1[i] = at::vec::fmadd(x, b1, c1[i]);
      }
#pragma GCC unroll 4
      for (int64_t r = 0; r < kBases; ++r) {
        ++rows[r];
        asm("" : "+r"(rows[r]));  // (keeps GCC from deriving a pointer per row again)
      }
    }
  } else {
    for (int64_t t = 0; t < n; ++t) {
      const Vec b0 = Vec::loadu(b + t * b_step);
      const Vec b1 = kVectors == 2 ? Vec::loadu(b + t * b_step + w) : b0;
#pragma GCC unroll 32
      for (int64_t i = 0; i < M; ++i) {
        const Vec x(a[t * lda + i]);
        c0[i] = at::vec::fmadd(x, b0, c0[i]);
        if constexpr (kVectors == 2) c1[i] = at::vec::fmadd(x, b1, c1[i]);
      }
    }
  }
#pragma GCC unroll 32
  for (int64_t i = 0; i < M; ++i) {
    if constexpr (kAddToC) {
      c0[i] = c0[i] + Vec::loadu(c + i * ldc);
      if constexpr (kVectors == 2) c1[i] = c1[i] + Vec::loadu(c + i * ldc + w);
    }
    ep(c0[i]).store(c + i * ldc);
    if constexpr (kVectors == 2) ep(c1[i]).store(c + i * ldc + w);
  }
}

// The same for any row count m <= kMicroRows (the tail of a block).
template <typename acc_t, bool kRowsOfA, bool kAccumulate, typename Epilogue,
          int64_t M = kMicroRows, int kVectors = 2, bool kAddToC = false>
inline void microkernel_rows(int64_t m, const acc_t* a, int64_t lda, const acc_t* b,
                             int64_t b_step, int64_t n, acc_t* c, int64_t ldc,
                             const Epilogue& ep) {
  if constexpr (M > 0) {
    if (m == M) {
      return microkernel<acc_t, M, kRowsOfA, kAccumulate, Epilogue, kVectors, kAddToC>(
          a, lda, b, b_step, n, c, ldc, ep);
    }
    return microkernel_rows<acc_t, kRowsOfA, kAccumulate, Epilogue, M - 1, kVectors, kAddToC>(
        m, a, lda, b, b_step, n, c, ldc, ep);
  }
}

// Sums of more than kSumChunk terms (the rows of a gradient, P·V's keys) go
// in chunks of kSumChunk, each summed from 0 in the registers and then added
// to c: a load and an add of the tile per chunk.
constexpr int64_t kSumChunk = 64;

// The scores' sums over the head dim go in shorter chunks: an error δ in a
// score is a relative error δ in its probability, and with large scores
// (|s| ~ 50 at scale 2) a float chain's rounding grows with its length. One
// chain over the whole head dim, and chains of 64 dims, still put some
// random calls at scale 2 past twice PyTorch's error (the fuzzer's bound);
// chains of 32 put none there and bring the median error to PyTorch's
// (docs/performance.md, "Score sums in chunks of 32"). few_row_scores
// splits its sums alike (the same bits).
constexpr int64_t kScoreSumChunk = 32;

// c[m × ncols] (+)= a[m × n] · b[n × ncols] with ncols a multiple of the panel
// width, as a grid of micro-kernel calls. b_panel(col) gives the start of the
// column panel at col, and its rows are b_step apart. Out of line: inlined
// into a kernel's item loop, GCC ran out of general registers and kept the
// score kernel's row pointers on the stack (loads and stores every step).
template <typename acc_t, bool kRowsOfA, bool kAccumulate, typename BPanel,
          typename Epilogue = NoEpilogue, int64_t kChunk = kSumChunk>
__attribute__((noinline)) void gemm(int64_t m, int64_t ncols, int64_t n, const acc_t* a, int64_t lda,
                 BPanel b_panel, int64_t b_step, acc_t* c, int64_t ldc,
                 const Epilogue& ep = {}, PrefetchQueue* prefetch = nullptr) {
  constexpr int64_t nr = panel_width<acc_t>();
  // Column panels outermost: one panel of b stays in L1 while every row of
  // a passes over it.
  for (int64_t col = 0; col < ncols; col += nr) {
    const acc_t* b = b_panel(col);
    for (int64_t i = 0; i < m; i += kMicroRows) {
      if (prefetch) prefetch->issue();  // (a burst per micro-kernel call)
      const int64_t mi = std::min(kMicroRows, m - i);
      const acc_t* ai = kRowsOfA ? a + i * lda : a + i;
      acc_t* ci = c + i * ldc + col;
      if (n <= kChunk) {
        microkernel_rows<acc_t, kRowsOfA, kAccumulate>(mi, ai, lda, b, b_step, n, ci, ldc, ep);
        continue;
      }
      microkernel_rows<acc_t, kRowsOfA, kAccumulate>(mi, ai, lda, b, b_step, kChunk, ci, ldc,
                                                     NoEpilogue{});
      for (int64_t t = kChunk; t < n; t += kChunk) {
        const acc_t* a_t = kRowsOfA ? ai + t : ai + t * lda;  // (column t of a)
        if (t + kChunk < n) {
          microkernel_rows<acc_t, kRowsOfA, false, NoEpilogue, kMicroRows, 2, /*kAddToC=*/true>(
              mi, a_t, lda, b + t * b_step, b_step, kChunk, ci, ldc, NoEpilogue{});
        } else {
          microkernel_rows<acc_t, kRowsOfA, false, Epilogue, kMicroRows, 2, /*kAddToC=*/true>(
              mi, a_t, lda, b + t * b_step, b_step, n - t, ci, ldc, ep);
        }
      }
    }
  }
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
