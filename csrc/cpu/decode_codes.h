#pragma once

// Decoding over quantized K/V (int8 or fp8 codes, a float32 scale per row)
// and over bfloat16 / float16 K/V: the scores and the P·V product straight
// from the stored elements, each converted in a register once per group of
// query rows and never stored.
// The float tiles of the other inputs (TileInputs::key_rows_of, which
// converts a block into L1 first and then runs the float micro-kernels)
// cost a store and a load per element beside the 4 FMAs that a GQA group's
// query heads spend on it; here a converted vector feeds the FMAs of up to
// 8 rows directly, and each row's scale multiplies a score (K) or a
// probability (V), not every element (docs/performance.md, "Codes converted
// in registers").
//
// Scores are dot products: row-major query rows (scaled) against key rows,
// summed across lanes once per key, so the FMAs are rows · keys · dim (no
// lanes wasted on a GQA group of 4 in 8 or 16 lanes). They are not the
// score GEMM's to the bit, which the backward and the weights pass
// recompute (ScoreTiles::few_row_scores): quantized K/V are forward only,
// and half-precision outputs and gradients round far coarser than the
// float sums' different order. Float acc_t, AVX2 and AVX-512; other levels
// and acc_t take the float tiles.
//
// Included only by the per-ISA kernel units (compiled once per level with
// -DCPU_CAPABILITY=<LEVEL>, see cpu/isa_kernels.h): everything here lives in
// an anonymous namespace inside fusedmha::cpu::<LEVEL>.

#include "cpu/kv_codes.h"
#include "cpu/prefetch.h"

#include <algorithm>
#include <cstdint>

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

// code_scores issues a burst of the next block's prefetches every this many
// keys (a multiple of every step's keys): at every step of two keys, issuing
// cost a sixth of the call.
constexpr int64_t kCodeKeysPerBurst = 8;

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kCodesInRegisters = true;

// Two vectors of codes (2 · kCodeLanes) as code_lanes gives them. fp8 codes
// become fp16 bits two vectors' worth at a time in one register (16 with
// AVX2, 32 with AVX-512): half the integer operations per code.
template <KVStorage S>
void code_pair(const uint8_t* c, FloatLanes& lo, FloatLanes& hi) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (S != KVStorage::Int8) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    __m256i h;
    if constexpr (S == KVStorage::Float8E5M2) {
      h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);
    } else {
      h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                           _mm256_set1_epi16(int16_t(0xBF80)));
      const __m256i exponent_and_mantissa = _mm256_set1_epi16(0x3F80);
      h = _mm256_or_si256(h, _mm256_cmpeq_epi16(_mm256_and_si256(h, exponent_and_mantissa),
                                                exponent_and_mantissa));
    }
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    return;
  }
#elif defined(CPU_CAPABILITY_AVX512)
  if constexpr (S != KVStorage::Int8) {  // (32 codes as fp16 bits in one 512-bit register)
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
    __m512i h;
    if constexpr (S == KVStorage::Float8E5M2) {
      h = _mm512_slli_epi16(_mm512_cvtepu8_epi16(bytes), 8);
    } else {
      h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(bytes), 7),
                           _mm512_set1_epi16(int16_t(0xBF80)));
      const __m512i exponent_and_mantissa = _mm512_set1_epi16(0x3F80);
      h = _mm512_or_si512(h, _mm512_movm_epi16(_mm512_cmpeq_epi16_mask(
                                 _mm512_and_si512(h, exponent_and_mantissa),
                                 exponent_and_mantissa)));
    }
    lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    return;
  }
#endif
  lo = code_lanes<S>(c);
  hi = code_lanes<S>(c + kCodeLanes);
}

#if defined(CPU_CAPABILITY_AVX512)
FloatLanes load(const float* x) { return _mm512_loadu_ps(x); }
FloatLanes zero() { return _mm512_setzero_ps(); }
FloatLanes fmadd(FloatLanes a, FloatLanes b, FloatLanes c) { return _mm512_fmadd_ps(a, b, c); }
__m256 halves_added(FloatLanes a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#else
FloatLanes load(const float* x) { return _mm256_loadu_ps(x); }
FloatLanes zero() { return _mm256_setzero_ps(); }
FloatLanes fmadd(FloatLanes a, FloatLanes b, FloatLanes c) { return _mm256_fmadd_ps(a, b, c); }
__m256 halves_added(FloatLanes a) { return a; }
#endif

// What code_scores and code_values read, a vector of lanes at a time: a
// quantized cache's 8-bit codes (CodeRows: each row's scale applies, e4m3
// read as its value / 2^8), or the rows of a bfloat16 or float16 K/V as they
// are (HalfRows: no scale), widened in registers as codes are instead of
// copied into float tiles first.
template <KVStorage S>
struct CodeRows {
  using Element = uint8_t;
  static constexpr bool kScaled = true;
  static constexpr float kUnit = code_unit<S>();
  static FloatLanes lanes(const Element* c) { return code_lanes<S>(c); }
  static void pair(const Element* c, FloatLanes& lo, FloatLanes& hi) { code_pair<S>(c, lo, hi); }
  // One element as lanes reads it (its value / kUnit).
  static float value(Element c) { return code_value(S, c) / kUnit; }
};

template <typename Half>  // c10::BFloat16 or c10::Half
struct HalfRows {
  using Element = uint16_t;
  static constexpr bool kScaled = false;
  static constexpr float kUnit = 1.0f;
  static constexpr bool kBFloat16 = std::is_same_v<Half, c10::BFloat16>;
  static FloatLanes lanes(const Element* c) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
    if constexpr (kBFloat16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
#else
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    if constexpr (kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
#endif
  }
  static void pair(const Element* c, FloatLanes& lo, FloatLanes& hi) {
    lo = lanes(c);
    hi = lanes(c + kCodeLanes);
  }
  static float value(Element c) { return static_cast<float>(Half(c, Half::from_bits())); }
};

// A key's scale as the scores and probabilities take it (1 for HalfRows).
template <typename Rows>
float scale_of(const float* scales, int64_t index) {
  if constexpr (Rows::kScaled) {
    return scales[index] * Rows::kUnit;
  } else {
    (void)scales, (void)index;
    return 1.0f;
  }
}

// The lane sums of 8 vectors, as one vector of 8 floats (sums[n] of a[n]).
__attribute__((always_inline)) inline __m256 lane_sums(const FloatLanes* a) {
  __m256 x[8];
  for (int n = 0; n < 8; ++n) x[n] = halves_added(a[n]);
  const __m256 t0 = _mm256_hadd_ps(x[0], x[1]), t1 = _mm256_hadd_ps(x[2], x[3]);
  const __m256 t2 = _mm256_hadd_ps(x[4], x[5]), t3 = _mm256_hadd_ps(x[6], x[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Sᵀ rows i0..i0+R of keys j..j+8/R: sᵀ[key][row] = k_scale · q_row · codes,
// R query rows of q (dim apart) against 8 / R key rows, 8 accumulators.
// Inlined into code_scores' loop, its sums scaled as one vector: called per
// step, its frame (the accumulators zeroed on the stack) and a scalar
// product and store per score cost as much as its FMAs.
template <typename Rows, int R>
__attribute__((always_inline)) inline void code_score_step(const float* q,
                                                           const typename Rows::Element* codes,
                                                           int64_t code_stride,
                                                           const float* scales,
                                                           int64_t scale_stride, int64_t dim,
                                                           float* st, int64_t ls) {
  constexpr int K = 8 / R;
  FloatLanes acc[8];
  for (int n = 0; n < 8; ++n) acc[n] = zero();
  const int64_t whole = dim / kCodeLanes * kCodeLanes;
  int64_t e = 0;
  for (; e + 2 * kCodeLanes <= whole; e += 2 * kCodeLanes) {  // (two vectors of each key)
    FloatLanes k[2 * K];
    for (int c = 0; c < K; ++c) Rows::pair(codes + c * code_stride + e, k[2 * c], k[2 * c + 1]);
    for (int r = 0; r < R; ++r) {
      const FloatLanes q0 = load(q + r * dim + e), q1 = load(q + r * dim + e + kCodeLanes);
      for (int c = 0; c < K; ++c) {
        acc[c * R + r] = fmadd(q0, k[2 * c], acc[c * R + r]);
        acc[c * R + r] = fmadd(q1, k[2 * c + 1], acc[c * R + r]);
      }
    }
  }
  for (; e < whole; e += kCodeLanes) {
    FloatLanes k[K];
    for (int c = 0; c < K; ++c) k[c] = Rows::lanes(codes + c * code_stride + e);
    for (int r = 0; r < R; ++r) {
      const FloatLanes qr = load(q + r * dim + e);
      for (int c = 0; c < K; ++c) acc[c * R + r] = fmadd(qr, k[c], acc[c * R + r]);
    }
  }
  const __m256 sums = lane_sums(acc);
  if (whole == dim) {
    // Each key's scale over its R lanes, one product, R lanes stored per key.
    auto scale = [&](int c) { return scale_of<Rows>(scales, c * scale_stride); };
    if constexpr (R == 4) {
      const __m256 f = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(scale(0))),
                                            _mm_set1_ps(scale(1)), 1);
      const __m256 x = _mm256_mul_ps(sums, f);
      _mm_storeu_ps(st, _mm256_castps256_ps128(x));
      _mm_storeu_ps(st + ls, _mm256_extractf128_ps(x, 1));
      return;
    }
    alignas(32) float x[8];
    if constexpr (R == 2) {
      _mm256_store_ps(x, _mm256_mul_ps(sums, _mm256_setr_ps(scale(0), scale(0), scale(1), scale(1),
                                                            scale(2), scale(2), scale(3),
                                                            scale(3))));
    } else {
      _mm256_store_ps(x, _mm256_mul_ps(sums, _mm256_setr_ps(scale(0), scale(1), scale(2), scale(3),
                                                            scale(4), scale(5), scale(6),
                                                            scale(7))));
    }
    for (int c = 0; c < K; ++c) {
      for (int r = 0; r < R; ++r) st[c * ls + r] = x[c * R + r];
    }
    return;
  }
  alignas(32) float partial[8];
  _mm256_store_ps(partial, sums);
  for (int c = 0; c < K; ++c) {
    for (int r = 0; r < R; ++r) {
      float s = partial[c * R + r];
      for (int64_t e = whole; e < dim; ++e) {  // (a head dim that is not whole vectors)
        s += q[r * dim + e] * Rows::value(codes[c * code_stride + e]);
      }
      st[c * ls + r] = s * scale_of<Rows>(scales, c * scale_stride);
    }
  }
}

// Sᵀ (cols keys × ls lanes; lanes rows.. zero) of `rows` query rows (q,
// row-major, dim apart, zero rows up to a multiple of 4 where rows > 2)
// against cols quantized key rows; a burst of prefetch's lines per step
// (code_score_steps).
template <typename Rows>
void code_scores(const float* q, int64_t rows, const typename Rows::Element* codes,
                 int64_t code_stride, const float* scales, int64_t scale_stride, int64_t cols,
                 int64_t dim, float* st, int64_t ls, PrefetchQueue* prefetch) {
  auto run = [&](auto rows_per_step) {
    constexpr int R = decltype(rows_per_step)::value, K = 8 / R;
    for (int64_t i0 = 0; i0 < rows; i0 += R) {
      int64_t j = 0;
      for (; j + K <= cols; j += K) {
        if (prefetch && j % kCodeKeysPerBurst == 0) prefetch->issue();
        // (HalfRows have no scales: no offset on their null pointer.)
        const float* key_scales = Rows::kScaled ? scales + j * scale_stride : scales;
        code_score_step<Rows, R>(q + i0 * dim, codes + j * code_stride, code_stride, key_scales,
                                 scale_stride, dim, st + j * ls + i0, ls);
      }
      if (j < cols && prefetch && j % kCodeKeysPerBurst != 0) prefetch->issue();
      for (; j < cols; ++j) {  // (the block's last keys, one at a time)
        for (int64_t r = 0; r < R; ++r) {
          float s = 0;
          for (int64_t e = 0; e < dim; ++e) {
            s += q[(i0 + r) * dim + e] * Rows::value(codes[j * code_stride + e]);
          }
          st[j * ls + i0 + r] = s * scale_of<Rows>(scales, j * scale_stride);
        }
      }
    }
  };
  if (rows == 1) {
    run(std::integral_constant<int, 1>{});
  } else if (rows == 2) {
    run(std::integral_constant<int, 2>{});
  } else {
    run(std::integral_constant<int, 4>{});
  }
  const int64_t written = rows <= 2 ? rows : (rows + 3) / 4 * 4;
  for (int64_t j = 0; j < cols; ++j) std::fill(st + j * ls + written, st + (j + 1) * ls, 0.0f);
}

// out (R rows, ldo apart; dims e0..e1, whole runs of C vectors) += Σ_j
// p[j][row] · codes_j, with p = Pᵀ (cols × ls lanes) already multiplied by
// each key's v_scale · code_unit (CodeRows): R · C accumulators, each
// converted vector of codes used by R rows.
template <typename Rows, int R, int C>
void code_value_rows(const float* p, int64_t ls, const typename Rows::Element* codes,
                     int64_t code_stride, int64_t cols, int64_t e0, int64_t e1, float* out,
                     int64_t ldo) {
  static_assert(R * C <= 8, "8 accumulators at most: the others hold codes and a probability");
  for (int64_t e = e0; e + C * kCodeLanes <= e1; e += C * kCodeLanes) {
    FloatLanes acc[R * C];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) acc[r * C + c] = load(out + r * ldo + e + c * kCodeLanes);
    }
    for (int64_t j = 0; j < cols; ++j) {
      FloatLanes v[C];
      const typename Rows::Element* row = codes + j * code_stride + e;
      int c = 0;
      for (; c + 2 <= C; c += 2) Rows::pair(row + c * kCodeLanes, v[c], v[c + 1]);
      for (; c < C; ++c) v[c] = Rows::lanes(row + c * kCodeLanes);
      for (int r = 0; r < R; ++r) {
        const FloatLanes pj = splat(p[j * ls + r]);
        for (int c = 0; c < C; ++c) acc[r * C + c] = fmadd(pj, v[c], acc[r * C + c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) store(out + r * ldo + e + c * kCodeLanes, acc[r * C + c]);
    }
  }
}

// out (rows × dim, ldo apart) += Pᵀ's rows · the cols quantized value rows;
// p (Pᵀ, cols × ls lanes) is multiplied by each key's scale on the way.
template <typename Rows>
void code_values(float* p, int64_t ls, int64_t rows, const typename Rows::Element* codes,
                 int64_t code_stride, const float* scales, int64_t scale_stride, int64_t cols,
                 int64_t dim, float* out, int64_t ldo) {
  // (Each key's scale once, on its probabilities.)
  for (int64_t j = 0; Rows::kScaled && j < cols; ++j) {
    const float s = scale_of<Rows>(scales, j * scale_stride);
    for (int64_t i = 0; i < rows; ++i) p[j * ls + i] *= s;
  }
  const int64_t vectors = dim / kCodeLanes * kCodeLanes;
  for (int64_t i0 = 0; i0 < rows;) {
    // Rows 8, 4, 2 or 1 at a time; dims in runs of 8 / R vectors, then a vector at a time.
    const int64_t left = rows - i0;
    auto rows_of = [&](auto rows_per_step) {
      constexpr int R = decltype(rows_per_step)::value;
      constexpr int64_t span = (8 / R) * kCodeLanes;
      const int64_t runs = dim / span * span;
      float* rows_out = out + i0 * ldo;
      code_value_rows<Rows, R, 8 / R>(p + i0, ls, codes, code_stride, cols, 0, runs, rows_out,
                                      ldo);
      code_value_rows<Rows, R, 1>(p + i0, ls, codes, code_stride, cols, runs, vectors, rows_out,
                                  ldo);
      return R;
    };
    const int R = left >= 8   ? rows_of(std::integral_constant<int, 8>{})
                  : left >= 4 ? rows_of(std::integral_constant<int, 4>{})
                  : left >= 2 ? rows_of(std::integral_constant<int, 2>{})
                              : rows_of(std::integral_constant<int, 1>{});
    for (int64_t r = 0; r < R; ++r) {  // (a head dim that is not whole vectors)
      for (int64_t e = vectors; e < dim; ++e) {
        float sum = out[(i0 + r) * ldo + e];
        for (int64_t j = 0; j < cols; ++j) {
          sum += p[j * ls + i0 + r] * Rows::value(codes[j * code_stride + e]);
        }
        out[(i0 + r) * ldo + e] = sum;
      }
    }
    i0 += R;
  }
}

#else
constexpr bool kCodesInRegisters = false;
#endif

// The number of bursts code_scores issues over cols keys of rows rows (one
// per kCodeKeysPerBurst keys of each group of rows).
constexpr int64_t code_score_steps(int64_t cols, int64_t rows) {
  const int64_t R = rows == 1 ? 1 : rows == 2 ? 2 : 4;
  return (rows + R - 1) / R * ((cols + kCodeKeysPerBurst - 1) / kCodeKeysPerBurst);
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
