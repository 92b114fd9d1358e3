#pragma once

// Quantized K/V codes read as acc_t: int8, float8_e4m3fn and float8_e5m2
// codes times their row's scale, a vector at a time (attention_with_kvcache's
// quantized caches; ops/kv_quantization.h has the rule that wrote them).
//
// (One code's value, for the vector loops' tails and acc_t double:
// common/kv_codes.h.) Each conversion is exact: an int8 code is an integer,
// an e5m2 code is the high byte of an fp16, and an e4m3 code moves into an
// fp16 as its sign,
// exponent and mantissa bits (e4m3's 2^-6 subnormal scale is fp16's 2^-14
// times 2^8): so a value is code · scale rounded once in acc_t, as
// dequantize_kv's float32 product, and F16C converts both fp8 kinds.
//
// Included only by the per-ISA kernel units (compiled once per level with
// -DCPU_CAPABILITY=<LEVEL>, see cpu/isa_kernels.h): everything here lives in
// an anonymous namespace inside fusedmha::cpu::<LEVEL>.

#include "common/kv_codes.h"
#include "cpu/simd.h"

#include <cstdint>

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

#if defined(CPU_CAPABILITY_AVX512)
using CodeLanes = __m256i;  // 16 codes, one per 16-bit lane
using FloatLanes = __m512;
constexpr int64_t kCodeLanes = 16;
CodeLanes load_codes(const uint8_t* c) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
}
CodeLanes load_signed_codes(const uint8_t* c) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
}
FloatLanes int8_codes(const uint8_t* c) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
FloatLanes fp16_lanes(CodeLanes h) { return _mm512_cvtph_ps(h); }
CodeLanes lanes_of(int16_t x) { return _mm256_set1_epi16(x); }
CodeLanes both(CodeLanes a, CodeLanes b) { return _mm256_and_si256(a, b); }
CodeLanes either(CodeLanes a, CodeLanes b) { return _mm256_or_si256(a, b); }
template <int kBits>
CodeLanes shifted_left(CodeLanes a) { return _mm256_slli_epi16(a, kBits); }
CodeLanes equal(CodeLanes a, CodeLanes b) { return _mm256_cmpeq_epi16(a, b); }
FloatLanes splat(float x) { return _mm512_set1_ps(x); }
FloatLanes times(FloatLanes a, FloatLanes b) { return _mm512_mul_ps(a, b); }
void store(float* d, FloatLanes x) { _mm512_storeu_ps(d, x); }
#elif defined(CPU_CAPABILITY_AVX2)
using CodeLanes = __m128i;  // 8 codes, one per 16-bit lane
using FloatLanes = __m256;
constexpr int64_t kCodeLanes = 8;
CodeLanes load_codes(const uint8_t* c) {
  return _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
}
CodeLanes load_signed_codes(const uint8_t* c) {
  return _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
}
FloatLanes int8_codes(const uint8_t* c) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
FloatLanes fp16_lanes(CodeLanes h) { return _mm256_cvtph_ps(h); }
CodeLanes lanes_of(int16_t x) { return _mm_set1_epi16(x); }
CodeLanes both(CodeLanes a, CodeLanes b) { return _mm_and_si128(a, b); }
CodeLanes either(CodeLanes a, CodeLanes b) { return _mm_or_si128(a, b); }
template <int kBits>
CodeLanes shifted_left(CodeLanes a) { return _mm_slli_epi16(a, kBits); }
CodeLanes equal(CodeLanes a, CodeLanes b) { return _mm_cmpeq_epi16(a, b); }
FloatLanes splat(float x) { return _mm256_set1_ps(x); }
FloatLanes times(FloatLanes a, FloatLanes b) { return _mm256_mul_ps(a, b); }
void store(float* d, FloatLanes x) { _mm256_storeu_ps(d, x); }
#endif

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// e4m3 codes, sign-extended into 16-bit lanes (load_signed_codes), as fp16
// bits: exponent and mantissa just below the sign, read as the value / 2^8;
// the NaN code (0x7F in magnitude) as an fp16 NaN. (Shifted left by 7, a
// sign-extended code has the sign in bits 14 and 15: bit 14 is cleared.)
CodeLanes e4m3_as_fp16(CodeLanes signed_codes) {
  const CodeLanes h = both(shifted_left<7>(signed_codes), lanes_of(int16_t(0xBF80)));
  const CodeLanes exponent_and_mantissa = lanes_of(0x3F80);
  return either(h, equal(both(h, exponent_and_mantissa), exponent_and_mantissa));
}
#endif

// Calls f with S as a compile-time constant (std::integral_constant).
template <typename F>
void with_storage(KVStorage s, const F& f) {
  using Int8 = std::integral_constant<KVStorage, KVStorage::Int8>;
  using E4M3 = std::integral_constant<KVStorage, KVStorage::Float8E4M3>;
  using E5M2 = std::integral_constant<KVStorage, KVStorage::Float8E5M2>;
  switch (s) {
    case KVStorage::Int8: return f(Int8{});
    case KVStorage::Float8E4M3: return f(E4M3{});
    case KVStorage::Float8E5M2: return f(E5M2{});
    case KVStorage::Dense: return;
  }
}

// e4m3 codes read as their value / 2^8 (code_lanes): the product by 2^8.
template <KVStorage S>
constexpr float code_unit() { return S == KVStorage::Float8E4M3 ? 256.0f : 1.0f; }

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// One vector of codes (kCodeLanes of them) as floats: int8 and e5m2 as
// their values, e4m3 as its value / 2^8 (code_unit).
template <KVStorage S>
FloatLanes code_lanes(const uint8_t* c) {
  if constexpr (S == KVStorage::Int8) return int8_codes(c);
  if constexpr (S == KVStorage::Float8E5M2) return fp16_lanes(shifted_left<8>(load_codes(c)));
  return fp16_lanes(e4m3_as_fp16(load_signed_codes(c)));
}
#endif

// dst[0..n) = codes[0..n) · scale, codes stored as s.
template <typename acc_t>
inline void dequantize(KVStorage s, const uint8_t* codes, acc_t scale, acc_t* dst, int64_t n) {
  int64_t e = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    with_storage(s, [&](auto storage) {
      constexpr KVStorage S = decltype(storage)::value;
      const FloatLanes vs = splat(scale), unit = splat(code_unit<S>());
      for (; e + kCodeLanes <= n; e += kCodeLanes) {
        const FloatLanes x = code_lanes<S>(codes + e);
        store(dst + e, times(S == KVStorage::Float8E4M3 ? times(x, unit) : x, vs));
      }
    });
  }
#endif
  for (; e < n; ++e) dst[e] = static_cast<acc_t>(code_value(s, codes[e])) * scale;
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
