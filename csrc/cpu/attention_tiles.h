#pragma once

// The building blocks the forward and backward CPU kernels share. Included
// only by the per-ISA kernel files (compiled once per level with
// -DCPU_CAPABILITY=<LEVEL>): everything here lives in an anonymous namespace
// inside fusedmha::cpu::<LEVEL>, so each level has its own private copy.
//
// Layout convention: a score tile is held transposed, Sᵀ (keys × queries),
// so that queries are the vector lanes: softmax passes are vertical vector
// operations and K/V rows are read in place through their strides.

#include "common/attention_params.h"
#include "cpu/isa_kernels.h"

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>

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

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int64_t div_up(int64_t x, int64_t m) { return (x + m - 1) / m; }

// The register type under Vectorized<acc_t> (__m512 …; the class itself
// where it has none), for arrays of accumulators. GCC 12 keeps such an
// array in registers only when it holds these and every loop over it is
// flat (nested loops are unrolled too late); otherwise, beside an inlined
// PrefetchQueue::issue, it kept a copy in memory: a store per FMA.
template <typename acc_t> struct Register { using type = Vectorized<acc_t>; };
#if defined(CPU_CAPABILITY_AVX512)
template <> struct Register<float> { using type = __m512; };
template <> struct Register<double> { using type = __m512d; };
#elif defined(CPU_CAPABILITY_AVX2)
template <> struct Register<float> { using type = __m256; };
template <> struct Register<double> { using type = __m256d; };
#endif

template <typename scalar_t> struct AccType { using type = float; };
template <> struct AccType<double> { using type = double; };

// dst[0..n) = src[0..n) as acc_t. Half precision is widened a vector at a
// time (F16C's vcvtph2ps; bfloat16 is its high 16 bits): element by element,
// fp16 goes through a scalar conversion per value, which made widening the
// K/V blocks cost as much as the score GEMM. Exact either way.
template <typename scalar_t, typename acc_t>
inline void widen(const scalar_t* src, acc_t* dst, int64_t n) {
  int64_t e = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<scalar_t, c10::Half>) {
      for (; e + 16 <= n; e += 16) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + e));
        _mm512_storeu_ps(dst + e, _mm512_cvtph_ps(h));
      }
    } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      for (; e + 16 <= n; e += 16) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + e));
        _mm512_storeu_ps(dst + e, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
      }
    }
#elif defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<scalar_t, c10::Half>) {
      for (; e + 8 <= n; e += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e));
        _mm256_storeu_ps(dst + e, _mm256_cvtph_ps(h));
      }
    } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      for (; e + 8 <= n; e += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e));
        _mm256_storeu_ps(dst + e, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
      }
    }
#endif
  }
  for (; e < n; ++e) dst[e] = static_cast<acc_t>(src[e]);
}

// Two vectors: the column width of the micro-kernels, and the granule in
// which query blocks and head dims are padded.
template <typename acc_t>
constexpr int64_t panel_width() { return 2 * Vectorized<acc_t>::size(); }

template <typename acc_t>
constexpr acc_t neg_inf() { return -std::numeric_limits<acc_t>::infinity(); }

// dst[0..n) = a bool mask's additive terms: 0 where src is true (may
// attend), −inf where false; float lanes a vector at a time. Element by
// element, converting a per-head (B, H, L, S) bool mask cost 1 ns per score
// on Zen 4: the forward ran at 0.58 of the unmasked speed (B=4, H=8,
// L=S=1024, E=64), 0.92 with this (1.6x faster); an (L, S) bool mask, read
// once for several heads, went from 0.89 to 0.96.
template <typename acc_t>
inline void bool_terms(const bool* src, acc_t* dst, int64_t n) {
  int64_t e = 0;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(src);
  if constexpr (std::is_same_v<acc_t, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512 vneg_inf = _mm512_set1_ps(neg_inf<float>()), zero = _mm512_setzero_ps();
    for (; e + 16 <= n; e += 16) {
      const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + e)));
      _mm512_storeu_ps(dst + e, _mm512_mask_blend_ps(_mm512_test_epi32_mask(x, x), vneg_inf, zero));
    }
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256 vneg_inf = _mm256_set1_ps(neg_inf<float>());
    for (; e + 8 <= n; e += 8) {
      const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + e)));
      const __m256 blocked = _mm256_castsi256_ps(_mm256_cmpeq_epi32(x, _mm256_setzero_si256()));
      _mm256_storeu_ps(dst + e, _mm256_and_ps(blocked, vneg_inf));  // (−inf or +0)
    }
#endif
  }
  for (; e < n; ++e) dst[e] = bytes[e] ? acc_t(0) : neg_inf<acc_t>();
}

#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kBlockedKeys = 64;

// The keys [0, n) (n <= kBlockedKeys) that a bool mask's row hides, as bits:
// bit j set where key j is false (bits j >= n are meaningless).
inline uint64_t hidden_keys(const bool* row, int64_t n) {
  const __mmask64 valid = n >= 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1;
  const __m512i x = _mm512_maskz_loadu_epi8(valid, row);
  return _mm512_testn_epi8_mask(x, x);
}

// 16 rows' hidden keys (bits[i]: row i's, as hidden_keys gives them) as the
// queries each key hides: blocked[j] has bit i set where row i hides key j.
inline void blocked_from_bits(const uint64_t* bits, uint16_t* blocked) {
  // x[h] byte 16c + i = byte 4h + c of bits[i] (keys 8(4h + c) on): the
  // rows' bytes of one group of 8 keys side by side. First each 128-bit lane
  // (rows 2l, 2l + 1) pairs the two rows' bytes c; then 16-bit permutes
  // gather the 8 pairs of each group.
  const __m512i pairs = _mm512_set4_epi32(0x0f070e06, 0x0d050c04, 0x0b030a02, 0x09010800);
  const __m512i lo = _mm512_shuffle_epi8(_mm512_loadu_si512(bits), pairs);      // rows 0–7
  const __m512i hi = _mm512_shuffle_epi8(_mm512_loadu_si512(bits + 8), pairs);  // rows 8–15
  alignas(64) static constexpr auto gather = [] {
    std::array<uint16_t, 64> idx{};
    for (int h = 0; h < 2; ++h) {
      for (int c = 0; c < 4; ++c) {
        for (int k = 0; k < 8; ++k) {  // pair k: rows 2k, 2k + 1
          const int group = 4 * h + c;
          idx[32 * h + 8 * c + k] = static_cast<uint16_t>(k < 4 ? 8 * k + group : 32 + 8 * (k - 4) + group);
        }
      }
    }
    return idx;
  }();
  const __m512i x[2] = {_mm512_permutex2var_epi16(lo, _mm512_load_si512(gather.data()), hi),
                        _mm512_permutex2var_epi16(lo, _mm512_load_si512(gather.data() + 32), hi)};
  // Bit b of every byte, to its top bit, then collected: 16 rows for each of
  // 4 groups, key 8·group + b.
  for (int h = 0; h < 2; ++h) {
    for (int b = 0; b < 8; ++b) {
      const uint64_t r = _mm512_movepi8_mask(_mm512_slli_epi16(x[h], 7 - b));
      for (int c = 0; c < 4; ++c) blocked[8 * (4 * h + c) + b] = static_cast<uint16_t>(r >> (16 * c));
    }
  }
}

// A bool mask's 16 rows (queries; ld apart) × n keys, as the queries each
// key hides: blocked[j] has bit i set where row i's key j is false. Each row
// is read 64 keys at a time and reduced to bits at once, and the bits are
// transposed with a few byte shuffles, so a per-head (B, H, L, S) bool mask
// no longer goes through float terms and 16 × 16 float transposes per head
// (Zen 4, B=4, H=8, L=S=1024, E=64: the forward with such a mask ran at 0.90
// of the unmasked speed, 0.93 with this; forward + backward 0.91, 0.95). On
// AVX2 the same scheme (8 rows, lane masks from a table) was no faster than
// the terms' path, so AVX2 keeps that. n <= kBlockedKeys; blocked[j] for
// j >= n is meaningless (read [0, n) only).
inline void blocked_queries(const bool* m, int64_t ld, int64_t n, uint16_t* blocked) {
  alignas(64) uint64_t bits[16];  // bits[i]: bit j where row i hides key j
  for (int64_t i = 0; i < 16; ++i) bits[i] = hidden_keys(m + i * ld, n);
  blocked_from_bits(bits, blocked);
}
#endif

// tanh(x / 2) = 1 − 2 / (exp(x) + 1). For float lanes, written out so that
// softcap costs a fraction of the score GEMM: x is clamped to ±20 (tanh is
// ±1 to float precision there, and NaN stays NaN), exp is 2^n · p(r) with
// r = x − n·ln 2 in ±ln2/2 and p its Taylor polynomial of degree 6
// (relative error 1e-7), and the reciprocal is the hardware estimate with
// Newton steps. Elsewhere: the library's exp and a division.
template <typename acc_t>
Vectorized<acc_t> tanh_of_half(const Vectorized<acc_t>& x_in) {
  using Vec = Vectorized<acc_t>;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    using V = __m512;
#define FMH_(op) _mm512_##op
#else
    using V = __m256;
#define FMH_(op) _mm256_##op
#endif
    const V two = FMH_(set1_ps)(2.0f), one = FMH_(set1_ps)(1.0f);
    // (max/min return their second operand when one is NaN.)
    const V x = FMH_(min_ps)(FMH_(set1_ps)(20.0f), FMH_(max_ps)(FMH_(set1_ps)(-20.0f), V(x_in)));
    const V scaled = FMH_(mul_ps)(x, FMH_(set1_ps)(1.44269504f));  // x·log2(e)
#if defined(CPU_CAPABILITY_AVX512)
    const V n = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const V n = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
    V r = FMH_(fnmadd_ps)(n, FMH_(set1_ps)(0.693145752f), x);  // ln 2, high bits
    r = FMH_(fnmadd_ps)(n, FMH_(set1_ps)(1.42860677e-6f), r);  // ln 2, the rest
    V p = FMH_(fmadd_ps)(FMH_(set1_ps)(1.0f / 720), r, FMH_(set1_ps)(1.0f / 120));
    p = FMH_(fmadd_ps)(p, r, FMH_(set1_ps)(1.0f / 24));
    p = FMH_(fmadd_ps)(p, r, FMH_(set1_ps)(1.0f / 6));
    p = FMH_(fmadd_ps)(p, r, FMH_(set1_ps)(0.5f));
    p = FMH_(fmadd_ps)(p, r, one);
    p = FMH_(fmadd_ps)(p, r, one);
#if defined(CPU_CAPABILITY_AVX512)
    const V d = FMH_(add_ps)(_mm512_scalef_ps(p, n), one);  // exp(x) + 1
    V inv = _mm512_rcp14_ps(d);                              // 14 bits
#else
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const V d = FMH_(fmadd_ps)(p, _mm256_castsi256_ps(bits), one);  // exp(x) + 1
    V inv = _mm256_rcp_ps(d);                                       // 12 bits
    inv = FMH_(mul_ps)(inv, FMH_(fnmadd_ps)(d, inv, two));
#endif
    inv = FMH_(mul_ps)(inv, FMH_(fnmadd_ps)(d, inv, two));  // float precision
    return Vec(FMH_(fnmadd_ps)(two, inv, one));
#undef FMH_
  }
#endif
  const Vec one(acc_t(1));
  return one - Vec(acc_t(2)) / (x_in.exp() + one);
}


// e^(x − m), the softmax's exponential, elementwise. For float lanes it is
// 2^t with t = (x − m)·log2(e), split as t = n + r with n
// an integer and r in ±1/2: 2^r is a degree-5 polynomial fitted to 2^r on
// that interval (relative error 3e-7 in float, against exp_u20's 20 ulp)
// and 2^n goes into the exponent (AVX-512's scalef; on AVX2 by integer
// arithmetic, t clamped to [−126, 128]). t below −126 gives 0 (so
// −inf does, exactly: a masked key adds nothing to a row's sum), and NaN
// stays NaN. About 13 vector operations, against 20 for exp_u20 with the
// subtraction. Elsewhere: exp_u20.
template <typename acc_t>
Vectorized<acc_t> exp_of_difference(const Vectorized<acc_t>& x_in, const Vectorized<acc_t>& m_in) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    using V = __m512;
#define FMH_(op) _mm512_##op
#else
    using V = __m256;
#define FMH_(op) _mm256_##op
#endif
    const V log2e = FMH_(set1_ps)(1.44269504f), lowest = FMH_(set1_ps)(-126.0f);
    // (Not one fmsub: its rounded m·log2(e) costs |m|·6e-8 in t, 1e-5 at m = 100.)
    const V t = FMH_(mul_ps)(FMH_(sub_ps)(V(x_in), V(m_in)), log2e);
    // (max/min return their second operand when one is NaN.)
#if defined(CPU_CAPABILITY_AVX512)
    const __mmask16 keep = _mm512_cmp_ps_mask(t, lowest, _CMP_NLT_UQ);  // t >= −126 or NaN
    const V tc = FMH_(max_ps)(lowest, t);
    const V n = _mm512_roundscale_ps(tc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const V keep = _mm256_cmp_ps(t, lowest, _CMP_NLT_UQ);
    // (Clamped above at 128, whose exponent bits, 255, are +inf's: t past
    // the float range gives +inf, as AVX-512's scalef and exp itself do, not
    // 2^127; with huge scores a row's alpha or sum can take that path.)
    const V tc = FMH_(min_ps)(FMH_(set1_ps)(128.0f), FMH_(max_ps)(lowest, t));
    const V n = _mm256_round_ps(tc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
    const V r = FMH_(sub_ps)(tc, n);
    V p = FMH_(fmadd_ps)(FMH_(set1_ps)(1.33908668e-3f), r, FMH_(set1_ps)(9.66637395e-3f));
    p = FMH_(fmadd_ps)(p, r, FMH_(set1_ps)(5.55035695e-2f));
    p = FMH_(fmadd_ps)(p, r, FMH_(set1_ps)(2.40223482e-1f));
    p = FMH_(fmadd_ps)(p, r, FMH_(set1_ps)(6.93147182e-1f));
    p = FMH_(fmadd_ps)(p, r, FMH_(set1_ps)(1.0f));
#if defined(CPU_CAPABILITY_AVX512)
    return Vectorized<acc_t>(_mm512_maskz_scalef_ps(keep, p, n));
#else
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return Vectorized<acc_t>(_mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(bits))));
#endif
#undef FMH_
  }
#endif
  return (x_in - m_in).exp_u20();
}

// Asks for the cache line at p to come into L2 (prefetcht1). An asm
// statement on x86: GCC 12 deletes loops of __builtin_prefetch once they are
// inlined into the kernels (a loop with no other effect), so the prefetches
// the kernels asked for were never issued.
inline void prefetch_line(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Asks for the cache line at p to come into L1 (prefetcht0); an asm
// statement for the reason prefetch_line gives.
inline void prefetch_line_l1(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// Cache lines to bring into the caches a few at a time, spread over the work that
// comes before their use. A burst of more prefetches than the core has line
// fill buffers (16 on current x86 cores) stalls it until lines arrive: the
// transfer is then serialised with the compute it was meant to overlap. In
// a 2-thread test on the AVX-512 Xeon, 64 KiB blocks read at 23 GB/s from
// L3 (18 from DRAM) with the next block prefetched at once, 32 (21) with no
// prefetch, and 37–39 (25–28) with it prefetched 4–16 lines at a time
// between the reads of this one.
class PrefetchQueue {
 public:
  // rows rows of `bytes` bytes each, `stride` bytes apart, from first, to
  // come into L2: the forward's prefetches come a block ahead, beside the
  // GEMMs' own L1 tiles (BERT-base was 4% slower with prefetcht0), and
  // decoding's a (head, block) ahead (queue_next_head_block says why).
  void add(const void* first, int64_t stride, int64_t rows, int64_t bytes) {
    if (rows <= 0 || bytes <= 0) return;
    // Full: issue all that is queued. (Not issue(lines_): lines_ is only
    // an upper bound, and when it is exact a last region whose lines are all
    // issued is still counted, so the queue would stay full and this write
    // overrun it: rows of 31 floats, which straddle lines, did.)
    if (count_ == kMaxRegions) issue(std::numeric_limits<int64_t>::max());
    const uintptr_t start = reinterpret_cast<uintptr_t>(first);
    regions_[count_++] = {start & ~uintptr_t(63), start + bytes, start, stride, rows, bytes};
    lines_ += rows * (bytes / 64 + 2);  // (at most; a row may straddle lines)
  }
  // Spreads what is queued over the next `calls` calls of issue().
  void pace(int64_t calls) { burst_ = std::max<int64_t>(div_up(lines_, std::max<int64_t>(calls, 1)), 1); }
  // Issues the next burst of lines queued, in order.
  void issue() { issue(burst_); }
  void issue(int64_t n) {
    while (n > 0 && next_ < count_) {
      Region& r = regions_[next_];
      if (r.line >= r.end) {
        if (--r.rows == 0) {
          ++next_;
          continue;
        }
        r.row += r.stride;
        r.line = r.row & ~uintptr_t(63);
        r.end = r.row + r.bytes;
      }
      // As many of the row's lines as the burst has left, in a tight loop.
      const int64_t k = std::min<int64_t>(n, static_cast<int64_t>((r.end - r.line + 63) / 64));
      const uintptr_t line = r.line;
      for (int64_t i = 0; i < k; ++i) prefetch_line(reinterpret_cast<const void*>(line + 64 * i));
      r.line = line + 64 * k;
      n -= k;
      lines_ -= k;
    }
    if (next_ == count_) count_ = next_ = 0, lines_ = 0;
  }

 private:
  static constexpr int kMaxRegions = 40;
  struct Region {
    uintptr_t line, end;  // the next line, and the end of the current row
    uintptr_t row;        // the current row's first byte
    int64_t stride, rows, bytes;
  };
  Region regions_[kMaxRegions];
  int count_ = 0, next_ = 0;
  int64_t lines_ = 0, burst_ = 8;
};

// max(x, y), or y where x is NaN: one instruction (max_ps returns its
// second operand when either is NaN), where at::vec::maximum adds three
// more to propagate NaN. For running maxima whose NaN is caught elsewhere.
template <typename acc_t>
Vectorized<acc_t> max_of_numbers(const Vectorized<acc_t>& x, const Vectorized<acc_t>& y) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) return Vectorized<acc_t>(_mm512_max_ps(x, y));
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float>) return Vectorized<acc_t>(_mm256_max_ps(x, y));
#endif
  return at::vec::maximum(x, y);
}

#if defined(CPU_CAPABILITY_AVX512)
// dst[16 × 16] = transpose of the 16 × 16 floats at src (rows ld apart), in
// registers: pairs of rows interleaved by 32 then 64 bits, which leaves each
// 128-bit lane holding 4 rows of one column, then the lanes of each group
// of four vectors transposed. (ATen's transpose_mxn for runtime sizes goes
// through the stack with memcpy, at several times the cost.)
inline void transpose_16x16(const float* src, int64_t ld, float* dst, int64_t ldd = 16) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld);
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  // r[4m + c], lane l: column 4l + c, rows 4m..4m+3.
  for (int m = 0; m < 4; ++m) {
    const __m512d a = _mm512_castps_pd(t[4 * m]), b = _mm512_castps_pd(t[4 * m + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * m + 1]), d = _mm512_castps_pd(t[4 * m + 3]);
    r[4 * m] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * m + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * m + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * m + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  // Column 4l + c is lane l of r[c], r[4 + c], r[8 + c], r[12 + c].
  for (int c = 0; c < 4; ++c) {
    const __m512 p0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44);
    const __m512 p1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
    const __m512 p2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
    const __m512 p3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
    _mm512_storeu_ps(dst + c * ldd, _mm512_shuffle_f32x4(p0, p2, 0x88));
    _mm512_storeu_ps(dst + (4 + c) * ldd, _mm512_shuffle_f32x4(p0, p2, 0xDD));
    _mm512_storeu_ps(dst + (8 + c) * ldd, _mm512_shuffle_f32x4(p1, p3, 0x88));
    _mm512_storeu_ps(dst + (12 + c) * ldd, _mm512_shuffle_f32x4(p1, p3, 0xDD));
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// dst[8 × 8] = transpose of the 8 × 8 floats at src (rows ld apart), in
// registers: pairs of rows interleaved by 32 bits, then by 64 bits, which
// leaves each 128-bit lane with 4 rows of one column, then the lanes of
// rows 0–3 and 4–7 joined. (Our own, in this file's anonymous namespace:
// ATen's transpose_mxn, when the compiler keeps it out of line, is a weak
// symbol the linker could share with code built for another ISA level.)
inline void transpose_8x8(const float* src, int64_t ld, float* dst, int64_t ldd = 8) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld);
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  // r[4m + c], lane l: column c + 4l, rows 4m..4m+3.
  for (int m = 0; m < 2; ++m) {
    r[4 * m] = _mm256_shuffle_ps(t[4 * m], t[4 * m + 2], 0x44);
    r[4 * m + 1] = _mm256_shuffle_ps(t[4 * m], t[4 * m + 2], 0xEE);
    r[4 * m + 2] = _mm256_shuffle_ps(t[4 * m + 1], t[4 * m + 3], 0x44);
    r[4 * m + 3] = _mm256_shuffle_ps(t[4 * m + 1], t[4 * m + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * ldd, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
    _mm256_storeu_ps(dst + (c + 4) * ldd, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
  }
}
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
// chain over a 256-dim head had 2.4x the error of MKL's SGEMM; chains of 64
// dims still put the output past twice PyTorch's error (the fuzzer's bound)
// in 4-8% of random calls at scale 2 with E = 64-256 (a float64 model of the
// chains; the fuzzer found 2 such calls in 100000), chains of 32 in none of
// 300 (median error 0.9-1.04x PyTorch's, against 1.0-2.1x). few_row_scores
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

#if defined(__AVX2__)
// The rounds of philox4x32_10 (common/philox.h) for the 4 columns 4·j4.. of
// 4·V consecutive rows i.. of outer index o, 32-bit words in 64-bit lanes so
// the 32×32→64-bit products are single vector multiplies (vpmuludq):
// words[c][v] holds column 4·j4 + c of rows i + 4v .. i + 4v + 3.
template <int V>
inline void philox_words(const DropoutStream& stream, int64_t o, int64_t i, int64_t j4,
                         __m256i words[4][V]) {
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t k0 = static_cast<uint32_t>(stream.seed), k1 = static_cast<uint32_t>(stream.seed >> 32);
  const __m256i low = _mm256_set1_epi64x(0xFFFFFFFFll);
  const __m256i mul0 = _mm256_set1_epi64x(0xD2511F53ll), mul1 = _mm256_set1_epi64x(0xCD9E8D57ll);
  __m256i c0[V], c1[V], c2[V], c3[V];
  for (int v = 0; v < V; ++v) {
    c0[v] = _mm256_set1_epi64x(static_cast<uint32_t>(j4 + stream.col4));
    c1[v] = _mm256_and_si256(_mm256_add_epi64(_mm256_set1_epi64x(static_cast<uint32_t>(i + stream.row) + 4ll * v),
                                              _mm256_set_epi64x(3, 2, 1, 0)),
                             low);
    c2[v] = _mm256_set1_epi64x(static_cast<uint32_t>(o));
    c3[v] = _mm256_set1_epi64x(stream.counter3(o));
  }
  for (int round = 0; round < 10; ++round) {
    const __m256i key0 = _mm256_set1_epi64x(k0), key1 = _mm256_set1_epi64x(k1);
    for (int v = 0; v < V; ++v) {
      const __m256i p0 = _mm256_mul_epu32(c0[v], mul0);
      const __m256i p1 = _mm256_mul_epu32(c2[v], mul1);
      c0[v] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), c1[v]), key0);
      c2[v] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p0, 32), c3[v]), key1);
      c1[v] = _mm256_and_si256(p1, low);
      c3[v] = _mm256_and_si256(p0, low);
    }
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  for (int v = 0; v < V; ++v) {
    words[0][v] = c0[v];
    words[1][v] = c1[v];
    words[2][v] = c2[v];
    words[3][v] = c3[v];
  }
}
#endif

// The dropout stream's numbers of the 4 columns 4·j4.. for kLanes
// consecutive rows i.. of outer index o: out[c][l] for column 4·j4 + c, row
// i + l.
template <int kLanes>
inline void philox_rows(const DropoutStream& stream, int64_t o, int64_t i, int64_t j4,
                        uint32_t out[4][kLanes]) {
#if defined(__AVX2__)
  static_assert(kLanes % 4 == 0);
  constexpr int V = kLanes / 4;
  __m256i words[4][V];
  philox_words<V>(stream, o, i, j4, words);
  alignas(32) uint64_t lanes[4][kLanes];
  for (int c = 0; c < 4; ++c) {
    for (int v = 0; v < V; ++v) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[c] + 4 * v), words[c][v]);
    }
  }
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < kLanes; ++l) out[c][l] = static_cast<uint32_t>(lanes[c][l]);
  }
#else
  for (int l = 0; l < kLanes; ++l) {
    const Philox4x32 r = stream.block(o, i + l, j4);
    for (int w = 0; w < 4; ++w) out[w][l] = r.v[w];
  }
#endif
}

// The block length along one dim of the work split: up to max_block, but
// small enough that `threads` threads get a few items each over `outer`
// rows (short sequences, batch 1, one head); a multiple of granule.
inline int64_t work_block(int64_t len, int64_t outer, int64_t threads, int64_t granule,
                          int64_t max_block) {
  const int64_t per_row = div_up(4 * std::max<int64_t>(threads, 1), std::max<int64_t>(outer, 1));
  const int64_t block = round_up(div_up(std::max<int64_t>(len, 1), per_row), granule);
  return std::clamp(block, granule, max_block);
}

// A block length no larger than an eighth of a sliding window's band (when
// both sides are bounded): a block of b queries computes about (band + b)
// keys for the band·b it needs, so b = band/8 keeps that 89% useful; a
// multiple of granule, at least one.
inline int64_t band_block(const AttentionParams& p, int64_t block, int64_t granule) {
  if (p.window_left < 0 || p.window_right < 0) return block;
  const int64_t band = p.window_left + p.window_right + 1;
  return std::clamp(band / 8 / granule * granule, granule, block);
}

// Whether one tile of mask terms serves every head: a mask that differs per
// query row (not a key padding row) and is broadcast over the heads (the
// last outer dim). The forward then reads and transposes each mask tile once
// for the heads of an item (TileReader::mask_terms), not once per head.
inline bool mask_shared_by_heads(const AttentionParams& p) {
  return p.mask_kind != MaskKind::None && p.mask.row_stride != 0 && p.outer.dims > 0 &&
         p.mask.outer_stride[p.outer.dims - 1] == 0;
}

// Carves a thread's scratch memory into arrays; with a null base it only
// counts, so the same code sizes the workspace and lays it out.
template <typename acc_t>
class Arena {
 public:
  explicit Arena(void* base) : base_(static_cast<acc_t*>(base)) {}
  acc_t* take(int64_t count) {
    acc_t* at = base_ ? base_ + used_ : nullptr;
    used_ += round_up(count, 64 / sizeof(acc_t));  // each array on its own cache lines
    return at;
  }
  size_t bytes() const { return sizeof(acc_t) * used_; }

 private:
  acc_t* base_;
  int64_t used_ = 0;
};

// Calls work(kernel) with a Kernel<scalar_t, acc_t> for dtype, its scratch
// carved from workspace.
template <template <typename, typename> class Kernel, typename Params, typename Work>
void with_kernel_for_dtype(DType dtype, const Params& p, const WorkSplit& split, void* workspace,
                           const Work& work) {
  auto run = [&](auto scalar) {
    using scalar_t = decltype(scalar);
    using acc_t = typename AccType<scalar_t>::type;
    Kernel<scalar_t, acc_t> kernel(p, split, Arena<acc_t>(workspace));
    work(kernel);
  };
  switch (dtype) {
    case DType::Float32: return run(float{});
    case DType::Float64: return run(double{});
    case DType::BFloat16: return run(c10::BFloat16{});
    case DType::Float16: return run(c10::Half{});
  }
}

// Runs work item `item` with Kernel<scalar_t, acc_t> for dtype.
template <template <typename, typename> class Kernel, typename Params>
void run_item_for_dtype(DType dtype, const Params& p, const WorkSplit& split, int64_t item,
                        void* workspace) {
  with_kernel_for_dtype<Kernel>(dtype, p, split, workspace, [&](auto& k) { k.run(item); });
}

// A bool mask's hidden keys over a span of key blocks, read once for a
// query block (TileReader::read_mask_bits) instead of once per key block:
// bits[c·stride + i] has bit j set where row i hides key kBlockedKeys·c + j
// of the span. (Empty: the tile reads the mask itself.)
struct MaskBits {
  const uint64_t* bits = nullptr;
  int64_t stride = 0;
};

// Reads the inputs described by AttentionParams tile by tile, in the layouts
// the micro-kernels want, widening half precision to acc_t.
template <typename scalar_t, typename acc_t>
class TileReader {
 public:
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t nr = panel_width<acc_t>();
  static constexpr int64_t w = Vec::size();
  static constexpr bool kSameType = std::is_same_v<scalar_t, acc_t>;

  explicit TileReader(const AttentionParams& p) : p_(p), stream_(p.dropout.stream()) {}

  // Where matrix o of t starts (one outer-offset computation per call: the
  // callers then step through rows by their stride).
  const scalar_t* start(const Matrix& t, int64_t o) const {
    return matrix_start<const scalar_t>(p_.outer, t, o);
  }

  // Rows r0..r0+rows of t (dim wide) transposed into panels of `lanes` rows
  // (nr, or few_row_lanes), times scale: (row i, dim e) at
  // [(i/lanes)·dim + e]·lanes + i%lanes; rows up to padded_rows are zero.
  void pack_transposed(const Matrix& t, int64_t o, int64_t r0, int64_t rows,
                       int64_t padded_rows, int64_t dim, acc_t scale, acc_t* dst,
                       int64_t lanes = nr) const {
    const scalar_t* first = start(t, o) + r0 * t.row_stride;
    int64_t i = 0;
    // Whole w × w blocks through register transposes: each block's columns
    // land as w contiguous lanes of a panel (where w divides its width).
    // (Half precision is widened a block at a time first.)
    const int64_t dims = dim / w * w;
    acc_t block[w * w], wide[w * w];
    const Vec vscale(scale);
    for (; dims > 0 && lanes % w == 0 && i + w <= rows; i += w) {
      acc_t* d = dst + (i / lanes) * dim * lanes + i % lanes;
      const scalar_t* src = first + i * t.row_stride;
      for (int64_t e0 = 0; e0 < dims; e0 += w) {
        if constexpr (kSameType) {
          transpose_block(reinterpret_cast<const acc_t*>(src) + e0, t.row_stride, block);
        } else {
          for (int64_t l = 0; l < w; ++l) widen(src + l * t.row_stride + e0, wide + l * w, w);
          transpose_block(wide, w, block);
        }
        for (int64_t e = 0; e < w; ++e) {
          (Vec::loadu(block + e * w) * vscale).store(d + (e0 + e) * lanes);
        }
      }
      for (int64_t e = dims; e < dim; ++e) {
        for (int64_t l = 0; l < w; ++l) {
          d[e * lanes + l] = static_cast<acc_t>(src[l * t.row_stride + e]) * scale;
        }
      }
    }
    for (; i < rows; ++i) {
      acc_t* d = dst + (i / lanes) * dim * lanes + i % lanes;
      const scalar_t* src = first + i * t.row_stride;
      for (int64_t e = 0; e < dim; ++e) d[e * lanes] = static_cast<acc_t>(src[e]) * scale;
    }
    // The padding, lanes rows..padded_rows of each dim's panel row: a run of
    // contiguous lanes each (not one strided store per lane: decoding's 4
    // query rows in 32 lanes spent more here than on their scores).
    for (; i < padded_rows; i = round_up(i + 1, lanes)) {
      const int64_t end = std::min(round_up(i + 1, lanes), padded_rows);
      acc_t* d = dst + (i / lanes) * dim * lanes + i % lanes;
      for (int64_t e = 0; e < dim; ++e) {
        std::fill(d + e * lanes, d + e * lanes + (end - i), acc_t(0));
      }
    }
  }

  // Rows r0..r0+rows of t (query-side rows: q, grad_out) as acc_t rows: in
  // place (returning the input's row stride in *ld) when the type matches
  // and, if panel_rows, the rows fill whole panels; otherwise widened into
  // dst, zero-padded to a multiple of the panel width.
  const acc_t* rows_of(const Matrix& t, int64_t o, int64_t r0, int64_t rows, int64_t dim,
                       bool panel_rows, acc_t* dst, int64_t* ld) const {
    return rows_at(start(t, o) + r0 * t.row_stride, t.row_stride, rows, dim, panel_rows, dst, ld);
  }

  // The same for keys k0..k0+cols of K or V (a block within one page when
  // the cache is paged).
  enum class KeySide { K, V };
  const acc_t* key_rows_of(KeySide side, int64_t o, int64_t k0, int64_t cols, int64_t dim,
                           bool panel_rows, acc_t* dst, int64_t* ld) const {
    return rows_at(key_rows(side, o, k0), key_matrix(side).row_stride, cols, dim, panel_rows,
                   dst, ld);
  }

  // Keys k0..k0+cols of K or V (dim wide) as column panels of nr: (key j,
  // dim e) at dst[((e / nr)·cols + j)·nr + e % nr], dims past dim zero. A
  // GEMM that takes the block as its b operand then streams each panel
  // from contiguous memory (rows nr apart) instead of a slice of every row
  // (a row stride apart), which the caches prefetch far better.
  void key_panels_of(KeySide side, int64_t o, int64_t k0, int64_t cols, int64_t dim,
                     acc_t* dst) const {
    const scalar_t* first = key_rows(side, o, k0);
    const int64_t row_stride = key_matrix(side).row_stride, full = dim / nr * nr;
    for (int64_t e = 0; e < full; e += nr) {  // (stores in order)
      const scalar_t* src = first + e;
      acc_t* d = dst + e * cols;
      for (int64_t j = 0; j < cols; ++j, src += row_stride, d += nr) {
        if constexpr (kSameType) {
          Vec::loadu(src).store(d);
          Vec::loadu(src + w).store(d + w);
        } else {
          widen(src, d, nr);
        }
      }
    }
    for (int64_t j = 0; full < dim && j < cols; ++j) {
      acc_t* tail = dst + full * cols + j * nr;
      widen(first + j * row_stride + full, tail, dim - full);
      std::fill(tail + dim - full, tail + nr, acc_t(0));
    }
  }

  // Queues rows r0..r0+rows of t (dim wide) to be brought into L2.
  void queue_rows(PrefetchQueue& queue, const Matrix& t, int64_t o, int64_t r0, int64_t rows,
                  int64_t dim) const {
    constexpr int64_t size = sizeof(scalar_t);
    queue.add(start(t, o) + r0 * t.row_stride, t.row_stride * size, rows, dim * size);
  }
  // Queues the mask's tile of queries q0..q0+rows and keys k0..k0+cols
  // (outer index o): a general mask's rows are a row stride apart, with long
  // keys each in a page of its own, where the hardware prefetchers do not
  // follow; a key padding mask is one row (decoding reads its few lines
  // a block at a time, each a stall from cold caches when not queued).
  void queue_mask_tile(PrefetchQueue& queue, int64_t o, int64_t q0, int64_t rows, int64_t k0,
                       int64_t cols) const {
    const Matrix& mk = p_.mask;
    if (mk.col_stride != 1 || cols <= 0) return;
    with_mask_type([&](auto mask) {
      using mask_t = decltype(mask);
      constexpr int64_t size = sizeof(mask_t);
      const mask_t* first = matrix_start<const mask_t>(p_.outer, mk, o) + q0 * mk.row_stride + k0;
      queue.add(first, mk.row_stride * size, rows > 0 && mk.row_stride == 0 ? 1 : rows,
                cols * size);
    });
  }
  // The hidden keys of outer index o's mask rows q0..q0+rows over keys
  // k0..k0+cols, into bits as MaskBits lays them out (stride apart). Each
  // row is read once for the span, four or five lines in a row, where the
  // tiles read it once per key block: every row of a (B, H, L, S) mask 4 KiB
  // or more long is a page of its own, and a query block's 512 rows missed
  // the L1 TLB at every block (Zen 4: such a mask on 2 MiB pages cost half as
  // much).
  void read_mask_bits(int64_t o, int64_t q0, int64_t rows, int64_t k0, int64_t cols,
                      uint64_t* bits, int64_t stride) const {
#if defined(CPU_CAPABILITY_AVX512)
    const Matrix& mk = p_.mask;
    const bool* row = matrix_start<const bool>(p_.outer, mk, o) + q0 * mk.row_stride + k0;
    for (int64_t i = 0; i < rows; ++i, row += mk.row_stride) {
      for (int64_t j0 = 0; j0 < cols; j0 += kBlockedKeys) {
        const int64_t n = std::min(kBlockedKeys, cols - j0);
        bits[j0 / kBlockedKeys * stride + i] = hidden_keys(row + j0, n);
      }
    }
#else
    (void)o, (void)q0, (void)rows, (void)k0, (void)cols, (void)bits, (void)stride;
#endif
  }
  // Queues keys k0..k0+cols of K or V (dim wide) to be brought into L2.
  void queue_key_rows(PrefetchQueue& queue, KeySide side, int64_t o, int64_t k0, int64_t cols,
                      int64_t dim) const {
    constexpr int64_t size = sizeof(scalar_t);
    queue.add(key_rows(side, o, k0), key_matrix(side).row_stride * size, cols, dim * size);
  }

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
  //    wasted lanes do; lane_scores writes no kt, and decoding's 32k GQA
  //    cache read 3–13% faster with it, alternating on Zen 3.)
  //
  // With keys_transposed, kt already holds this block's transpose (written
  // by the call before, for a head that reads the same keys) and k is not
  // read. Before a transpose, the block's lines are asked into L1 in
  // address order, all at once: the transposes read w rows side by side,
  // which neither the hardware prefetchers follow nor leaves the loads of
  // a tile anything to overlap with. (Zen 4 AVX-512, 2 threads, one query
  // over an E=128 cache, caches flushed, one process alternating, medians
  // of each run's rounds: with H=32 over H_kv=8, S=4096 -6% to +9% (median
  // of runs +2.4%), S=32768 +2% to +7% (+5.4%), a (B, S, H_kv, E) cache 0
  // to +2%; with H_kv=32, +3% to +6%; short keys outside decoding, 128-200,
  // +3% to +5%, and 2-3% slower when K is already in cache. The lane_scores
  // path reads the keys row by row, and was 2-4% slower with it.)
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

  // Where keys k0.. of outer index o start in K or V (before any widening):
  // two heads that read the same rows have the same address.
  const void* key_source(KeySide side, int64_t o, int64_t k0) const {
    return key_rows(side, o, k0);
  }

  // row_scores issues a prefetch burst every kScoreDimsPerBurst dims: a
  // burst of more lines than the core has miss buffers for stalls it until
  // they arrive (a fifth of decoding's time sat on prefetch instructions),
  // so decoding's next (head, block) goes out in small bursts spread over
  // all its work. Zen 4 AVX-512, 2 threads, one query over a GQA cache of
  // E=128, caches flushed before each call, one process alternating: with
  // bursts only at the key transposes and P·V calls, K/V read at 16.9-18.3
  // GB/s (S=4096) and 19.7-20.5 (32768); with these every 4 dims, 20.9-23.1
  // and 24.4-25.9. Since row_scores keeps its sums in registers (Register;
  // a decode whose K/V sit in L3 runs 26-28% faster for it), every 8 dims
  // reads 4-8% more than every 4 at 4096 and 4-14% more at 32768; every 2,
  // 12, 16 or 32 reads less.
  // The softmax's every 2 keys (ForwardKernel) beat every 1, 4 or none.
  static constexpr int64_t kScoreDimsPerBurst = 8;

  // Whether few_row_scores takes lane_scores for `rows` rows (else the keys
  // transposed): where they fill more than half of 16 lanes, or half of 8 or
  // more. (On Zen 4, E=128, caches flushed, alternating in one process: 8
  // rows in 16 lanes, the lanes' half empty, against the keys transposed
  // once for every tile of 8 rows that reads them: 32 query heads over one
  // K/V head 1.39x faster transposed, 16 over one (two tiles) 1.20x, 4
  // queries each of 8 heads over a K/V head (merged two heads a tile) 1.10x,
  // one tile of 8 rows 1.02-1.06x. On AVX2, 4 rows in 8 lanes against
  // transposed keys: within 2%, so there the lanes stay.)
  static constexpr bool scores_in_lanes(int64_t rows) {
    return rows <= w && (w >= 16 ? 2 * rows > w : 2 * rows >= w);
  }

  // The query lanes few_row_scores wants `rows` rows packed in: a panel of
  // nr where lane_scores loads them as vectors, else just the rows, which
  // row_scores broadcasts one element at a time. (A decoding item packs
  // its 8 heads' queries into lines the caches have lost since the last
  // call: 4 rows in 32 lanes wrote 8× the lines, each first read from
  // memory.)
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
  // scratch of w × round_up(cols, w). With shared_terms, the mask is left
  // out: the caller adds mask_terms' tile (shared by several heads) itself.
  // A period p > 0 (decoding's merged heads: rows of several heads, p
  // each, that share the rest) takes row i as query q0 + i % p for the band;
  // then there is no ALiBi and no mask. With bits (a per-head bool mask's
  // hidden keys read ahead: the tile's first row's, in the block's chunk),
  // the tile's whole strips of w rows take them instead of the mask's rows:
  // the caller's bits must be o's rows q0.. over keys k0..k0+cols.
  void transform_scores(int64_t o, int64_t q0, int64_t rows, int64_t bq, int64_t k0,
                        int64_t cols, acc_t* st, acc_t* mt, acc_t* dcap = nullptr,
                        bool shared_terms = false, int64_t period = 0,
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
    if (shared_terms) return;
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
  // (the band, and the key padding).
  std::pair<int64_t, int64_t> key_range(int64_t o, int64_t q0, int64_t rows) const {
    const int64_t end = std::min(band_key_end(p_, q0 + rows), keys_of(p_, o));
    return {std::min(std::max(band_key_begin(p_, q0), first_key_of(p_, o)), end), end};
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

  const Matrix& key_matrix(KeySide side) const { return side == KeySide::K ? p_.k : p_.v; }
  const scalar_t* key_rows(KeySide side, int64_t o, int64_t k0) const {
    return static_cast<const scalar_t*>(key_matrix(side).data) +
           (side == KeySide::K ? k_row_offset(p_, o, k0) : v_row_offset(p_, o, k0));
  }

  const acc_t* rows_at(const scalar_t* first, int64_t row_stride, int64_t rows, int64_t dim,
                       bool panel_rows, acc_t* dst, int64_t* ld) const {
    if (kSameType && (!panel_rows || dim % nr == 0)) {
      *ld = row_stride;
      return reinterpret_cast<const acc_t*>(first);
    }
    *ld = round_up(dim, nr);
    for (int64_t i = 0; i < rows; ++i) {
      const scalar_t* src = first + i * row_stride;
      acc_t* d = dst + i * *ld;
      widen(src, d, dim);
      std::fill(d + dim, d + *ld, acc_t(0));
    }
    return dst;
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

  // Calls f with a value of the mask's element type (none: not called).
  template <typename F>
  void with_mask_type(const F& f) const {
    switch (p_.mask_kind) {
      case MaskKind::None: return;
      case MaskKind::Bool: return f(bool{});
      case MaskKind::Additive: return f(scalar_t{});
      case MaskKind::AdditiveFloat32: return f(float{});
    }
  }

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

  // The transpose of the w × w block at src (rows ld apart) into dst's rows
  // (ldd apart).
  static void transpose_block(const acc_t* src, int64_t ld, acc_t* dst, int64_t ldd = w) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<acc_t, float>) return transpose_8x8(src, ld, dst, ldd);
#elif defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<acc_t, float>) return transpose_16x16(src, ld, dst, ldd);
#endif
    for (int64_t i = 0; i < w; ++i) {
      for (int64_t j = 0; j < w; ++j) dst[j * ldd + i] = src[i * ld + j];
    }
  }

  const AttentionParams& p_;
  const DropoutStream stream_;
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
