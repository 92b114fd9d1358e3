#pragma once

// A bool mask read as the kernels want it: additive terms (0 or -inf) a
// vector at a time, and on AVX-512 rows of hidden keys as bits, so that a
// per-head mask costs a fraction of the score GEMM.
//
// Included only by the per-ISA kernel units (compiled once per level with
// -DCPU_CAPABILITY=<LEVEL>, see cpu/isa_kernels.h): everything here lives in
// an anonymous namespace inside fusedmha::cpu::<LEVEL>, so each level has its
// own private copy.

#include "cpu/simd.h"

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

// dst[0..n) = a bool mask's additive terms: 0 where src is true (may
// attend), −inf where false; float lanes a vector at a time. Converted one
// element at a time, a per-head (B, H, L, S) bool mask cost the forward a
// large share of its time, and a mask the heads share a noticeable one
// (docs/performance.md, "Bool masks as bits").
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
// (docs/performance.md, "Bool masks as bits"). On AVX2 the same scheme (8
// rows, lane masks from a table) was no faster than the terms' path, so
// AVX2 keeps that. n <= kBlockedKeys; blocked[j] for
// j >= n is meaningless (read [0, n) only).
inline void blocked_queries(const bool* m, int64_t ld, int64_t n, uint16_t* blocked) {
  alignas(64) uint64_t bits[16];  // bits[i]: bit j where row i hides key j
  for (int64_t i = 0; i < 16; ++i) bits[i] = hidden_keys(m + i * ld, n);
  blocked_from_bits(bits, blocked);
}
#endif

// A bool mask's hidden keys over a span of key blocks, read once for a
// query block (ScoreTiles::read_mask_bits) instead of once per key block:
// bits[c·stride + i] has bit j set where row i hides key kBlockedKeys·c + j
// of the span. (Empty: the tile reads the mask itself.)
struct MaskBits {
  const uint64_t* bits = nullptr;
  int64_t stride = 0;
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
