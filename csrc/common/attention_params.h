#pragma once

// One description of an attention call, read by the CPU and the CUDA
// kernels alike: plain pointers, sizes and strides, no ATen types, so the
// kernels compile fast, can be read on their own, and (on CUDA) take it by
// value as their argument with nothing copied to the device first.
//
// There is one struct per pass (forward, backward, weights); the host fills
// them in one place (ops/attention_params_filler.h). What a new parameter of
// the call touches from the op's schema to here: docs/architecture.md,
// "Adding a parameter".

#include "common/attention_types.h"
#include "common/philox.h"

#include <cstdint>

namespace fusedmha {

// The output's outer dims: its batch dims and heads, innermost (heads)
// last. Outer index o is the flattened position in these dims.
constexpr int kMaxOuterDims = 8;  // (Matrix::divisor's initialiser lists 8 ones)

struct OuterShape {
  int dims = 0;
  int64_t size[kMaxOuterDims] = {};
};

// A tensor read as one (rows, cols) matrix per outer index: element
// (o, r, c) is data[outer_offset(shape, m, o) + r * row_stride + c *
// col_stride]. A dim the tensor broadcasts has stride 0; a dim with fewer
// entries than the output's (grouped-query heads) maps index i to i /
// divisor. Transposed layouts (the (B, L, H, E) projection viewed as
// (B, H, L, E)) are just other strides, so the host copies no input for
// its layout, except where a backend's row layout asks for one (RowLayout,
// ops/attention_params_filler.h).
struct Matrix {
  void* data = nullptr;  // const for inputs; the kernels write only outputs
  int64_t start = 0;     // element offset of matrix 0 (a packed sequence's first row)
  int64_t outer_stride[kMaxOuterDims] = {};
  int64_t divisor[kMaxOuterDims] = {1, 1, 1, 1, 1, 1, 1, 1};
  int64_t row_stride = 0;
  int64_t col_stride = 1;  // 1 for q/k/v/out; any value (0 too) for a mask
};

FUSEDMHA_HOST_DEVICE int64_t outer_offset(const OuterShape& shape, const Matrix& m, int64_t o) {
  int64_t offset = m.start;
  for (int d = shape.dims - 1; d >= 0; --d) {
    const int64_t i = o % shape.size[d];
    o /= shape.size[d];
    offset += (i / m.divisor[d]) * m.outer_stride[d];
  }
  return offset;
}

// Where matrix o of m starts, as T.
template <typename T>
FUSEDMHA_HOST_DEVICE T* matrix_start(const OuterShape& shape, const Matrix& m, int64_t o) {
  return static_cast<T*>(m.data) + outer_offset(shape, m, o);
}

// Dropout on the normalised probabilities, with the stream of
// common/philox.h: element (o, i, j) is kept iff its number is >=
// threshold, and kept ones are scaled by 1/(1 - p). Off when p == 0.
struct DropoutParams {
  double p = 0.0;
  uint32_t threshold = 0;
  // The stream's (seed, offset), by value (the CPU, and CUDA outside graph
  // capture)...
  uint64_t seed = 0;
  uint64_t offset = 0;
  // ...or, when these are set, read where the kernel runs: under CUDA graph
  // capture from the generator's device memory (*offset_ptr + offset)...
  const int64_t* seed_ptr = nullptr;
  const int64_t* offset_ptr = nullptr;
  // ...or, in the backward and weights passes on CUDA, from the rng_state
  // tensor the forward returned (a device tensor: no host sync).
  const int64_t* state_in = nullptr;
  // The CUDA forward writes (seed, offset) here, (0, 0) without dropout.
  int64_t* state_out = nullptr;
  // Where this call's rows and columns start in the sequence the stream is
  // drawn for: (0, 0) but in a ring step; col_offset is a multiple of 4.
  int64_t row_offset = 0;
  int64_t col_offset = 0;

  FUSEDMHA_HOST_DEVICE bool on() const { return p > 0.0; }
  // The stream when it is given by value (the CPU kernels).
  FUSEDMHA_HOST_DEVICE DropoutStream stream() const {
    return {seed, offset, row_offset, col_offset / 4};
  }
};

// Sequences of their own lengths in one call (FlashAttention's varlen and
// KV-cache calls), when any pointer is set: outer index o belongs to
// sequence b = o / heads. Its queries are rows cu_q[b] .. cu_q[b + 1] of
// q and out (and lse, grad_out, grad_q, grad_lse, delta); its keys are
// rows from cu_k[b] of k and v (grad_k, grad_v), up to cu_k[b + 1] or
// used_k[b] of them. A null cu_q or cu_k: every sequence starts at row 0
// of its own matrices (a padded batch), up to len_q / len_kv rows.
// len_q and len_kv are then the longest sequence's, and the kernels work
// on sequence_of(p, o): the params narrowed to o's sequence.
struct Sequences {
  const int32_t* cu_q = nullptr;    // (B + 1) cumulative query counts
  const int32_t* cu_k = nullptr;    // (B + 1) cumulative key counts
  const int32_t* used_k = nullptr;  // (B) keys each sequence uses
  int64_t heads = 1;                // outer indices per sequence

  FUSEDMHA_HOST_DEVICE bool on() const { return cu_q || cu_k || used_k; }
};

// A paged K/V cache (FlashAttention's block_table), when table is set: k and
// v are pages of `size` rows, page_stride_k / page_stride_v elements apart,
// and key j of sequence b (see Sequences) is row j % size of page
// table[b * table_stride + j / size]. The kernels read keys in blocks that
// never cross a page (their block sizes divide `size`, and blocks start at
// multiples of them).
struct Pages {
  const int32_t* table = nullptr;
  int64_t table_stride = 0;
  int64_t size = 0;
  int64_t page_stride_k = 0;
  int64_t page_stride_v = 0;
  // (Quantized K/V: their scales' pages, the same way.)
  int64_t page_stride_k_scale = 0;
  int64_t page_stride_v_scale = 0;
};

// A mask tile's state: bit 0 set where some key of the tile may be seen,
// bit 1 where some key is hidden or has a value to add, so that the state
// of a range of tiles is the OR of theirs (0: an empty range).
constexpr int64_t kMaskTileRows = 16;
constexpr int64_t kMaskTileKeys = 64;
enum MaskTileState : uint8_t { kTileVisible = 1, kTileHidden = 2, kTileMixed = 3 };

// The forward pass; the backward and weights passes read it too (with
// out and lse then being what the forward wrote).
struct AttentionParams {
  DType dtype = DType::Float32;
  OuterShape outer;
  int64_t num_outer = 0;  // product of outer.size
  int64_t len_q = 0;
  int64_t len_kv = 0;
  int64_t dim_qk = 0;
  int64_t dim_v = 0;

  Matrix q, k, v;
  // Quantized K/V (kv_storage not Dense): k and v hold 8-bit codes, and
  // k_scale / v_scale each key row's float32 scale (one-column matrices
  // laid out as k's and v's rows, paged alike: k_scale_at, v_scale_at); key
  // j's values are its codes · its scale.
  KVStorage kv_storage = KVStorage::Dense;
  Matrix k_scale, v_scale;
  MaskKind mask_kind = MaskKind::None;
  Matrix mask;
  // Padding of the keys, when set: outer index o sees only keys [begin,
  // end) = key_spans[2b], key_spans[2b + 1] with b = o / key_spans_group
  // (the rest are skipped, never read). The CPU host sets it for a mask that
  // only pads the keys, left (a padded batch), right (a suffix, a static
  // cache's unused slots) or both, and may hide a band (ops/mask_structure.h).
  const int64_t* key_spans = nullptr;
  int64_t key_spans_group = 1;
  // What each tile of the mask holds (data null: not known), one
  // MaskTileState byte per tile of kMaskTileRows queries × kMaskTileKeys
  // keys, laid out as the mask's tiles (broadcast where it is): the host
  // finds it (ops/mask_tiles.h) and the kernels skip the tiles that hide
  // every key and add nothing where a tile hides none.
  Matrix mask_tiles;
  Sequences seq;
  Pages pages;

  // The score pipeline: s = scale·q·k → softcap → + ALiBi → masks and the
  // band → softmax (with the sink in the denominator) → dropout → ·V.
  double scale = 1.0;
  // > 0: s → softcap·tanh(s / softcap).
  double softcap = 0.0;
  // Query i's diagonal is key i + diagonal_offset (0: top-left, as SDPA's
  // is_causal; S − L: bottom-right, as FlashAttention's, recomputed per
  // sequence by sequence_of when bottom_right). It sees keys j
  // with diagonal − window_left <= j <= diagonal + window_right; a negative
  // bound is unbounded. Causal attention is window_right = 0.
  int64_t diagonal_offset = 0;
  bool bottom_right = false;
  int64_t window_left = -1;
  int64_t window_right = -1;
  // One float64 slope per outer index (data null: off): −slope·|diagonal − j|
  // is added to score (i, j). (Float64 so that float64 calls stay exact.)
  Matrix alibi_slopes;
  // One float64 logit per outer index (data null: off), joining each row's
  // softmax denominator with no value (a "sink").
  Matrix sinks;

  DropoutParams dropout;

  // The output (query's dtype) and the log-sum-exp of each row's scores in
  // acc_t (float; double for Float64), one column (row i of outer index o
  // is lse_rows(p, p.lse, o)[i]).
  Matrix out;
  Matrix lse;
};

// The rows of outer index o in m, a one-column matrix laid out like p.lse
// (lse, grad_lse, delta): rows[i] is row i.
template <typename T>
struct RowValues {
  T* first;
  int64_t stride;
  FUSEDMHA_HOST_DEVICE T& operator[](int64_t i) const { return first[i * stride]; }
};
template <typename T>
FUSEDMHA_HOST_DEVICE RowValues<T> lse_rows(const AttentionParams& p, const Matrix& m, int64_t o) {
  return {matrix_start<T>(p.outer, m, o), m.row_stride};
}

// ---- key rows (paged or not) ---------------------------------------------

// The element offset of key row j of outer index o in m (p.k or p.v, its
// pages page_stride apart); rows j.. up to the end of j's page follow
// m.row_stride apart.
FUSEDMHA_HOST_DEVICE int64_t key_row_offset(const AttentionParams& p, const Matrix& m,
                                            int64_t page_stride, int64_t o, int64_t j) {
  const int64_t offset = outer_offset(p.outer, m, o);
  if (!p.pages.table) return offset + j * m.row_stride;
  const int64_t page = p.pages.table[(o / p.seq.heads) * p.pages.table_stride + j / p.pages.size];
  return offset + page * page_stride + (j % p.pages.size) * m.row_stride;
}
FUSEDMHA_HOST_DEVICE int64_t k_row_offset(const AttentionParams& p, int64_t o, int64_t j) {
  return key_row_offset(p, p.k, p.pages.page_stride_k, o, j);
}
FUSEDMHA_HOST_DEVICE int64_t v_row_offset(const AttentionParams& p, int64_t o, int64_t j) {
  return key_row_offset(p, p.v, p.pages.page_stride_v, o, j);
}
// Where quantized key row j's scale is (rows j.. up to the end of its page
// follow k_scale.row_stride apart); the same for v.
FUSEDMHA_HOST_DEVICE const float* k_scale_at(const AttentionParams& p, int64_t o, int64_t j) {
  return static_cast<const float*>(p.k_scale.data) +
         key_row_offset(p, p.k_scale, p.pages.page_stride_k_scale, o, j);
}
FUSEDMHA_HOST_DEVICE const float* v_scale_at(const AttentionParams& p, int64_t o, int64_t j) {
  return static_cast<const float*>(p.v_scale.data) +
         key_row_offset(p, p.v_scale, p.pages.page_stride_v_scale, o, j);
}

// A key block length for p: block itself, or with pages the largest
// divisor of the page size that is at most block (so blocks never cross a
// page).
FUSEDMHA_HOST_DEVICE int64_t paged_block(const AttentionParams& p, int64_t block) {
  if (!p.pages.table) return block;
  int64_t d = block < p.pages.size ? block : p.pages.size;
  while (d > 1 && p.pages.size % d != 0) --d;
  return d < 1 ? 1 : d;
}

// ---- packed sequences -----------------------------------------------------

FUSEDMHA_HOST_DEVICE void skip_rows(Matrix& m, int64_t rows) { m.start += rows * m.row_stride; }

// p narrowed to the sequence of outer index o (p itself without sequences):
// its lengths, its bottom-right diagonal, and its rows' starts.
FUSEDMHA_HOST_DEVICE AttentionParams sequence_of(const AttentionParams& p, int64_t o) {
  AttentionParams s = p;
  if (!p.seq.on()) return s;
  const int64_t b = o / p.seq.heads;
  if (p.seq.cu_q) {
    const int64_t first = p.seq.cu_q[b];
    s.len_q = p.seq.cu_q[b + 1] - first;
    skip_rows(s.q, first);
    skip_rows(s.out, first);
    skip_rows(s.lse, first);
  }
  if (p.seq.cu_k) {
    const int64_t first = p.seq.cu_k[b];
    s.len_kv = p.seq.cu_k[b + 1] - first;
    if (!p.pages.table) {  // (paged keys are found through the block table)
      skip_rows(s.k, first);
      skip_rows(s.v, first);
      skip_rows(s.k_scale, first);
      skip_rows(s.v_scale, first);
    }
  }
  if (p.seq.used_k) s.len_kv = p.seq.used_k[b];
  if (p.bottom_right) s.diagonal_offset = s.len_kv - s.len_q;
  return s;
}

// ---- the band of keys each query sees ------------------------------------

FUSEDMHA_HOST_DEVICE bool has_band(const AttentionParams& p) {
  return p.window_left >= 0 || p.window_right >= 0;
}

// Whether query i may see key j (the band; masks aside).
FUSEDMHA_HOST_DEVICE bool in_band(const AttentionParams& p, int64_t i, int64_t j) {
  const int64_t d = i + p.diagonal_offset;
  return (p.window_right < 0 || j <= d + p.window_right) &&
         (p.window_left < 0 || j >= d - p.window_left);
}

// The keys [begin, end) that queries [q0, q1) can see, clamped to [0, len_kv).
FUSEDMHA_HOST_DEVICE int64_t band_key_begin(const AttentionParams& p, int64_t q0) {
  if (p.window_left < 0) return 0;
  const int64_t k = q0 + p.diagonal_offset - p.window_left;
  return k < 0 ? 0 : (k > p.len_kv ? p.len_kv : k);
}
FUSEDMHA_HOST_DEVICE int64_t band_key_end(const AttentionParams& p, int64_t q1) {
  if (p.window_right < 0) return p.len_kv;
  const int64_t k = q1 - 1 + p.diagonal_offset + p.window_right + 1;
  return k < 0 ? 0 : (k > p.len_kv ? p.len_kv : k);
}
// The queries [begin, end) that can see keys [k0, k1), clamped to [0, len_q).
FUSEDMHA_HOST_DEVICE int64_t band_query_begin(const AttentionParams& p, int64_t k0) {
  if (p.window_right < 0) return 0;
  const int64_t q = k0 - p.diagonal_offset - p.window_right;
  return q < 0 ? 0 : (q > p.len_q ? p.len_q : q);
}
FUSEDMHA_HOST_DEVICE int64_t band_query_end(const AttentionParams& p, int64_t k1) {
  if (p.window_left < 0) return p.len_q;
  const int64_t q = k1 - 1 - p.diagonal_offset + p.window_left + 1;
  return q < 0 ? 0 : (q > p.len_q ? p.len_q : q);
}

// The keys [first_key_of, keys_of) outer index o may see at all (padding
// aside: [0, len_kv)).
FUSEDMHA_HOST_DEVICE int64_t first_key_of(const AttentionParams& p, int64_t o) {
  return p.key_spans ? p.key_spans[2 * (o / p.key_spans_group)] : 0;
}
FUSEDMHA_HOST_DEVICE int64_t keys_of(const AttentionParams& p, int64_t o) {
  return p.key_spans ? p.key_spans[2 * (o / p.key_spans_group) + 1] : p.len_kv;
}

// The state of the mask over queries [q0, q0 + rows) × keys [k0, k0 + cols)
// of outer index o (MaskTileState): mixed where its tiles are not known.
FUSEDMHA_HOST_DEVICE uint8_t mask_tiles_over(const AttentionParams& p, int64_t o, int64_t q0,
                                             int64_t rows, int64_t k0, int64_t cols) {
  if (!p.mask_tiles.data) return kTileMixed;
  if (rows <= 0 || cols <= 0) return 0;
  const uint8_t* t = matrix_start<const uint8_t>(p.outer, p.mask_tiles, o);
  uint8_t state = 0;
  for (int64_t r = q0 / kMaskTileRows; r <= (q0 + rows - 1) / kMaskTileRows; ++r) {
    for (int64_t c = k0 / kMaskTileKeys; c <= (k0 + cols - 1) / kMaskTileKeys; ++c) {
      state |= t[r * p.mask_tiles.row_stride + c];
    }
  }
  return state;
}

// The whole tiles [begin, end) along one side whose mask tiles do not hide
// every key: along the keys, those that queries [from, from + count) of
// outer index o may see; along the queries, those that may see keys [from,
// from + count). The side's whole length where the tiles are not known;
// begin == end where every tile hides every key.
struct TileSpan {
  int64_t begin, end;
};
FUSEDMHA_HOST_DEVICE TileSpan visible_tiles(const AttentionParams& p, int64_t o, bool along_keys,
                                            int64_t from, int64_t count) {
  const int64_t len = along_keys ? p.len_kv : p.len_q;
  if (!p.mask_tiles.data || count <= 0) return {0, len};
  const int64_t size = along_keys ? kMaskTileKeys : kMaskTileRows, tiles = (len + size - 1) / size;
  int64_t first = tiles, last = -1;
  for (int64_t t = 0; t < tiles; ++t) {
    const uint8_t state = along_keys ? mask_tiles_over(p, o, from, count, t * size, 1)
                                     : mask_tiles_over(p, o, t * size, 1, from, count);
    if (state == kTileHidden) continue;
    if (first == tiles) first = t;
    last = t;
  }
  if (last < 0) return {0, 0};
  const int64_t end = (last + 1) * size;
  return {first * size, end < len ? end : len};
}

// The slope and sink of outer index o (0 and -inf when off).
FUSEDMHA_HOST_DEVICE double alibi_slope(const AttentionParams& p, int64_t o) {
  return p.alibi_slopes.data ? *matrix_start<const double>(p.outer, p.alibi_slopes, o) : 0.0;
}
FUSEDMHA_HOST_DEVICE bool has_sinks(const AttentionParams& p) { return p.sinks.data != nullptr; }
FUSEDMHA_HOST_DEVICE double sink_logit(const AttentionParams& p, int64_t o) {
  return *matrix_start<const double>(p.outer, p.sinks, o);
}

// The backward pass: gradients in acc_t with contiguous rows, one matrix
// per outer index (the host sums them over broadcast and grouped heads):
// grad_k (len_kv, dim_qk) and grad_v (len_kv, dim_v) per outer index.
// grad_q is grad_q_splits zeroed copies of (len_q, dim_qk) per outer
// index, grad_q_split_stride elements apart: the keys are split into
// grad_q_splits interleaved sets of key blocks, each set summing its share
// of dQ into its own copy (no two writers ever share memory, so no locks
// and no atomics on the CPU), and the host adds the copies. The
// tensor-core CUDA kernel uses one copy and atomics.
struct BackwardParams {
  AttentionParams fwd;  // fwd.out and fwd.lse: what the forward returned
  Matrix grad_out;
  // rowsum(grad_out ∘ out) − grad_lse per row, acc_t, laid out like
  // fwd.lse; the CUDA host computes it; data null on the CPU, whose kernels
  // compute it per block.
  Matrix delta;
  // The gradient of the log-sum-exp, acc_t, laid out like fwd.lse, or data
  // null: it adds grad_lse·P to the scores' gradient, i.e. subtracts from D.
  Matrix grad_lse;
  Matrix grad_q;
  int64_t grad_q_splits = 1;
  int64_t grad_q_split_stride = 0;
  Matrix grad_k;
  Matrix grad_v;
  // The gradient of a float mask (data null: not asked for): dS = P ∘
  // (dP − D) of each score, taken where the mask is added (after softcap and
  // ALiBi), summed into the mask's own elements, times grad_mask_scale. It
  // broadcasts (stride 0) wherever the mask does, so several outer indices,
  // rows or columns may sum into one element (see outer_of_member). The CPU
  // kernels write each element once, in the mask's dtype (float32 where
  // grad_mask_float32, else the query's); the CUDA kernels add into acc_t
  // zeros with atomics.
  Matrix grad_mask;
  bool grad_mask_float32 = false;
  double grad_mask_scale = 1.0;
};

// The outer indices whose mask gradients share memory: those that differ
// only along the outer dims where bp.grad_mask has stride 0. Group g's
// member m is outer index outer_of_member(bp, g, m), members ascending
// along those dims; groups and members each count from 0, and there are
// shared_mask_members(bp) members per group.
FUSEDMHA_HOST_DEVICE int64_t shared_mask_members(const BackwardParams& bp) {
  int64_t members = 1;
  if (!bp.grad_mask.data) return members;
  for (int d = 0; d < bp.fwd.outer.dims; ++d) {
    if (bp.grad_mask.outer_stride[d] == 0) members *= bp.fwd.outer.size[d];
  }
  return members;
}
FUSEDMHA_HOST_DEVICE int64_t outer_of_member(const BackwardParams& bp, int64_t g, int64_t m) {
  if (!bp.grad_mask.data) return g;
  int64_t o = 0, place = 1;
  for (int d = bp.fwd.outer.dims - 1; d >= 0; --d) {
    const int64_t size = bp.fwd.outer.size[d];
    int64_t& digits = bp.grad_mask.outer_stride[d] == 0 ? m : g;
    o += digits % size * place;
    digits /= size;
    place *= size;
  }
  return o;
}

// bp narrowed to the sequence of outer index o (see sequence_of).
FUSEDMHA_HOST_DEVICE BackwardParams sequence_of(const BackwardParams& bp, int64_t o) {
  BackwardParams s = bp;
  if (!bp.fwd.seq.on()) return s;
  s.fwd = sequence_of(bp.fwd, o);
  const int64_t b = o / bp.fwd.seq.heads;
  if (bp.fwd.seq.cu_q) {
    const int64_t first = bp.fwd.seq.cu_q[b];
    skip_rows(s.grad_out, first);
    skip_rows(s.delta, first);
    skip_rows(s.grad_lse, first);
    skip_rows(s.grad_q, first);
  }
  if (bp.fwd.seq.cu_k) {
    const int64_t first = bp.fwd.seq.cu_k[b];
    skip_rows(s.grad_k, first);
    skip_rows(s.grad_v, first);
  }
  return s;
}

// What only the CPU kernels read: key spans (found by the CPU host's mask
// scan, ops/mask_structure.h) and dQ split into several copies. The CUDA
// launchers refuse params that set them (csrc/cuda/attention_cuda.cpp).
// (Mask tiles are a hint beside the mask, which stays: the CUDA tensor-core
// kernels skip by them, and the kernels that do not read them read the mask.)
inline bool uses_cpu_only_fields(const AttentionParams& p) { return p.key_spans != nullptr; }
inline bool uses_cpu_only_fields(const BackwardParams& bp) {
  return uses_cpu_only_fields(bp.fwd) || bp.grad_q_splits != 1;
}

// The attention weights pass: the probabilities of the forward call
// (dropout applied), recomputed from fwd.lse and written dense,
// (num_outer / heads_per_item, len_q, len_kv) in dtype; heads_per_item > 1
// averages that many adjacent outer indices (the heads of a batch index).
struct WeightsParams {
  AttentionParams fwd;
  int64_t heads_per_item = 1;
  void* weights = nullptr;
};

}  // namespace fusedmha
