#pragma once

// The dropout stream's random numbers (Philox, common/philox.h) for
// several rows and columns at once, in vector lanes on AVX2 and AVX-512.
//
// Included only by the per-ISA kernel units (compiled once per level with
// -DCPU_CAPABILITY=<LEVEL>, see cpu/isa_kernels.h): everything here lives in
// an anonymous namespace inside fusedmha::cpu::<LEVEL>, so each level has its
// own private copy.

#include "common/attention_params.h"
#include "cpu/simd.h"

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

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

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
