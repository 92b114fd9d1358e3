#pragma once

// The vector math the CPU kernels share: register and accumulator types,
// widening half precision, the softmax's exp and softcap's tanh written out
// for float lanes, NaN-tolerant max, and in-register transposes.
//
// Included only by the per-ISA kernel units (compiled once per level with
// -DCPU_CAPABILITY=<LEVEL>, see cpu/isa_kernels.h): everything here lives in
// an anonymous namespace inside fusedmha::cpu::<LEVEL>, so each level has its
// own private copy.

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

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
// K/V blocks cost as much as the score GEMM (docs/performance.md, "Half
// precision widened a vector at a time"). Exact either way.
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
// through the stack with memcpy, at several times the cost; measured with
// the exponential: docs/performance.md, "The softmax exponential".)
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

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
