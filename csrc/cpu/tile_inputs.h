#pragma once

// The inputs of a call as tiles: packing, widening and prefetching (TileInputs).
//
// Included only by the per-ISA kernel units (compiled once per level with
// -DCPU_CAPABILITY=<LEVEL>, see cpu/isa_kernels.h): everything here lives in
// an anonymous namespace inside fusedmha::cpu::<LEVEL>, so each level has its
// own private copy.

#include "common/attention_params.h"
#include "cpu/decode_codes.h"
#include "cpu/kv_codes.h"
#include "cpu/mask_bits.h"
#include "cpu/prefetch.h"
#include "cpu/simd.h"

#include <algorithm>
#include <cstdint>

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

// Reads the inputs described by AttentionParams tile by tile, in the layouts
// the micro-kernels want (query panels transposed, key rows, value panels),
// widening half precision and quantized K/V codes to acc_t, and queues the
// lines of the next tiles for prefetching.
template <typename scalar_t, typename acc_t>
class TileInputs {
 public:
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t nr = panel_width<acc_t>();
  static constexpr int64_t w = Vec::size();
  static constexpr bool kSameType = std::is_same_v<scalar_t, acc_t>;

  explicit TileInputs(const AttentionParams& p) : p_(p), stream_(p.dropout.stream()) {}

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
    // contiguous lanes each (not one strided store per lane: a few query
    // rows padded to a whole panel spent more here than on their scores).
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
  // the cache is paged); quantized codes always into dst, times their
  // rows' scales.
  enum class KeySide { K, V };
  const acc_t* key_rows_of(KeySide side, int64_t o, int64_t k0, int64_t cols, int64_t dim,
                           bool panel_rows, acc_t* dst, int64_t* ld) const {
    if (quantized()) {
      *ld = round_up(dim, nr);
      const uint8_t* codes = key_codes(side, o, k0);
      const float* scale = scale_at(side, o, k0);
      const int64_t row_stride = key_matrix(side).row_stride;
      const int64_t scale_stride = scale_matrix(side).row_stride;
      for (int64_t j = 0; j < cols; ++j) {
        acc_t* d = dst + j * *ld;
        const acc_t row_scale = static_cast<acc_t>(scale[j * scale_stride]);
        dequantize(p_.kv_storage, codes + j * row_stride, row_scale, d, dim);
        std::fill(d + dim, d + *ld, acc_t(0));
      }
      return dst;
    }
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
    if (quantized()) return code_panels_of(side, o, k0, cols, dim, dst);
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

  // Decoding over quantized K/V, or over bfloat16 / float16 K/V, with the
  // elements converted in registers (cpu/decode_codes.h): float acc_t at the
  // levels that have it. (Its scores are not the score GEMM's to the bit;
  // half-precision outputs and gradients round far coarser than the
  // difference.)
  static constexpr bool kFusedCodes = kCodesInRegisters && std::is_same_v<acc_t, float>;
  static constexpr bool kHalfRows =
      std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>;
  bool codes_in_registers() const { return kFusedCodes && (quantized() || kHalfRows); }

  // Rows r0..r0+rows of t (dim wide) times scale, row-major into dst (dim
  // apart), and zero rows up to padded_rows: the query rows code_scores
  // takes.
  void pack_rows(const Matrix& t, int64_t o, int64_t r0, int64_t rows, int64_t padded_rows,
                 int64_t dim, acc_t scale, acc_t* dst) const {
    const scalar_t* first = start(t, o) + r0 * t.row_stride;
    for (int64_t i = 0; i < rows; ++i) {
      acc_t* d = dst + i * dim;
      widen(first + i * t.row_stride, d, dim);
      for (int64_t e = 0; e < dim; ++e) d[e] *= scale;
    }
    std::fill(dst + rows * dim, dst + std::max(rows, padded_rows) * dim, acc_t(0));
  }
  // Sᵀ (cols × ls) of `rows` rows packed by pack_rows (zero rows up to a
  // multiple of 4 where rows > 2) against quantized or half-precision keys
  // k0..k0+cols of outer index o.
  void code_scores_of(int64_t o, int64_t k0, int64_t cols, const acc_t* q, int64_t rows,
                      acc_t* st, int64_t ls, PrefetchQueue* prefetch) const {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    if constexpr (kFusedCodes) {
      if constexpr (kHalfRows) {
        if (!quantized()) {
          code_scores<HalfRows<scalar_t>>(q, rows, half_rows(KeySide::K, o, k0), p_.k.row_stride,
                                          nullptr, 0, cols, p_.dim_qk, st, ls, prefetch);
          return;
        }
      }
      with_storage(p_.kv_storage, [&](auto s) {
        code_scores<CodeRows<decltype(s)::value>>(q, rows, key_codes(KeySide::K, o, k0),
                                                  p_.k.row_stride, k_scale_at(p_, o, k0),
                                                  p_.k_scale.row_stride, cols, p_.dim_qk, st,
                                                  ls, prefetch);
      });
    }
#else
    (void)o, (void)k0, (void)cols, (void)q, (void)rows, (void)st, (void)ls, (void)prefetch;
#endif
  }
  // out (rows × dim_v, ldo apart) += Pᵀ (cols × ls; scaled in place for
  // codes) times quantized or half-precision values k0..k0+cols of outer
  // index o.
  void code_values_of(int64_t o, int64_t k0, int64_t cols, acc_t* p, int64_t ls, int64_t rows,
                      acc_t* out, int64_t ldo) const {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    if constexpr (kFusedCodes) {
      if constexpr (kHalfRows) {
        if (!quantized()) {
          code_values<HalfRows<scalar_t>>(p, ls, rows, half_rows(KeySide::V, o, k0),
                                          p_.v.row_stride, nullptr, 0, cols, p_.dim_v, out, ldo);
          return;
        }
      }
      with_storage(p_.kv_storage, [&](auto s) {
        code_values<CodeRows<decltype(s)::value>>(p, ls, rows, key_codes(KeySide::V, o, k0),
                                                  p_.v.row_stride, v_scale_at(p_, o, k0),
                                                  p_.v_scale.row_stride, cols, p_.dim_v, out,
                                                  ldo);
      });
    }
#else
    (void)o, (void)k0, (void)cols, (void)p, (void)ls, (void)rows, (void)out, (void)ldo;
#endif
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
  // or more long is a page of its own, and a query block's rows each missed
  // the L1 TLB at every block (docs/performance.md, "Bool masks as bits").
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
    const int64_t size = key_element_bytes();
    queue.add(key_source(side, o, k0), key_matrix(side).row_stride * size, cols, dim * size);
  }

  // Where keys k0.. of outer index o start in K or V (before any widening):
  // two heads that read the same rows have the same address.
  const void* key_source(KeySide side, int64_t o, int64_t k0) const {
    return static_cast<const char*>(key_matrix(side).data) +
           key_offset(side, o, k0) * key_element_bytes();
  }

 protected:
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

  const Matrix& key_matrix(KeySide side) const { return side == KeySide::K ? p_.k : p_.v; }
  int64_t key_offset(KeySide side, int64_t o, int64_t k0) const {
    return side == KeySide::K ? k_row_offset(p_, o, k0) : v_row_offset(p_, o, k0);
  }
  const scalar_t* key_rows(KeySide side, int64_t o, int64_t k0) const {
    return static_cast<const scalar_t*>(key_matrix(side).data) + key_offset(side, o, k0);
  }

  // Quantized K/V (p_.kv_storage): one byte a code, a float32 scale per row.
  bool quantized() const { return p_.kv_storage != KVStorage::Dense; }
  int64_t key_element_bytes() const { return quantized() ? 1 : int64_t{sizeof(scalar_t)}; }
  const uint8_t* key_codes(KeySide side, int64_t o, int64_t k0) const {
    return static_cast<const uint8_t*>(key_source(side, o, k0));
  }
  // Rows of a bfloat16 or float16 K/V as their bits (HalfRows).
  const uint16_t* half_rows(KeySide side, int64_t o, int64_t k0) const {
    return static_cast<const uint16_t*>(key_source(side, o, k0));
  }
  const Matrix& scale_matrix(KeySide side) const {
    return side == KeySide::K ? p_.k_scale : p_.v_scale;
  }
  const float* scale_at(KeySide side, int64_t o, int64_t k0) const {
    return side == KeySide::K ? k_scale_at(p_, o, k0) : v_scale_at(p_, o, k0);
  }
  // key_panels_of for quantized codes.
  void code_panels_of(KeySide side, int64_t o, int64_t k0, int64_t cols, int64_t dim,
                      acc_t* dst) const {
    const uint8_t* first = key_codes(side, o, k0);
    const float* scale = scale_at(side, o, k0);
    const int64_t row_stride = key_matrix(side).row_stride;
    const int64_t scale_stride = scale_matrix(side).row_stride, full = dim / nr * nr;
    for (int64_t e = 0; e < full; e += nr) {
      for (int64_t j = 0; j < cols; ++j) {
        dequantize(p_.kv_storage, first + j * row_stride + e,
                   static_cast<acc_t>(scale[j * scale_stride]), dst + (e * cols + j * nr), nr);
      }
    }
    for (int64_t j = 0; full < dim && j < cols; ++j) {
      acc_t* tail = dst + full * cols + j * nr;
      dequantize(p_.kv_storage, first + j * row_stride + full,
                 static_cast<acc_t>(scale[j * scale_stride]), tail, dim - full);
      std::fill(tail + dim - full, tail + nr, acc_t(0));
    }
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
