// The CPU work split (plan.h). Each constant below was chosen by a
// measurement: docs/performance.md, "Work split and block sizes", has them.

#include "cpu/plan.h"

#include <algorithm>
#include <numeric>

namespace fusedmha::cpu {
namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t div_up(int64_t x, int64_t m) { return (x + m - 1) / m; }

// ---- the forward ----------------------------------------------------------

// Query rows per block: kMaxBlockQ, or kLongBlockQ where such a block and a
// key block fit in L2 (each key block, transposed and packed once, then
// serves twice the queries, and each head's K/V stream through the caches
// half as often). Items whose heads share a mask take kMaskBlockQ, so that
// more heads fit, and so do items that read a mask's rows of their own at
// head dims up to kMaskBlockMaxDim, where the mask's tile, prefetched into
// L2 beside the block's state, weighs most against the scores' work.
constexpr int64_t kMaxBlockQ = 256;
constexpr int64_t kLongBlockQ = 512;
constexpr int64_t kMaskBlockQ = 128;
constexpr int64_t kMaskBlockMaxDim = 64;
constexpr int64_t kBlockKV = 64;
// Heads per item that share a mask: as many as keep their states within
// this (half of a typical per-core L2).
constexpr int64_t kHeadsBytes = 1024 * 1024;
// Decoding also takes up to kMostDecodeQueries query rows per head (in
// panels of at most decode_rows), over at least kMinRowSplitKeys keys: the
// GEMM path reads a K/V head's keys once per query head and pads the rows
// to a panel. Below kMinRowSplitKeys keys the GEMM path is as fast.
constexpr int64_t kMostDecodeQueries = 64;
constexpr int64_t kMinRowSplitKeys = 1024;
// Decoding takes at least kMinChunkBlocks key blocks.
constexpr int64_t kMinChunkBlocks = 4;

// The block length along one dim of the work split: up to max_block, but
// small enough that `threads` threads get a few items each over `outer`
// rows (short sequences, batch 1, one head); a multiple of granule.
int64_t work_block(int64_t len, int64_t outer, int64_t threads, int64_t granule,
                   int64_t max_block) {
  const int64_t per_row = div_up(4 * std::max<int64_t>(threads, 1), std::max<int64_t>(outer, 1));
  const int64_t block = round_up(div_up(std::max<int64_t>(len, 1), per_row), granule);
  return std::clamp(block, granule, max_block);
}

// A block length no larger than an eighth of a sliding window's band (when
// both sides are bounded): a block of b queries computes about (band + b)
// keys for the band·b it needs, so b = band/8 keeps that 89% useful; a
// multiple of granule, at least one.
int64_t band_block(const AttentionParams& p, int64_t block, int64_t granule) {
  if (p.window_left < 0 || p.window_right < 0) return block;
  const int64_t band = p.window_left + p.window_right + 1;
  return std::clamp(band / 8 / granule * granule, granule, block);
}

// Whether one tile of mask terms serves every head: a mask that differs per
// query row (not a key padding row) and is broadcast over the heads (the
// last outer dim). The forward then reads and transposes each mask tile once
// for the heads of an item, not once per head.
bool mask_shared_by_heads(const AttentionParams& p) {
  return p.mask_kind != MaskKind::None && p.mask.row_stride != 0 && p.outer.dims > 0 &&
         p.mask.outer_stride[p.outer.dims - 1] == 0;
}

// Heads per item: with a mask that every head shares, as many heads of a
// batch index as keep their states within kHeadsBytes, so that each mask
// tile is read and transposed once for them; else 1.
int64_t heads_sharing_mask(const AttentionParams& p, int64_t nr, int64_t acc_bytes) {
  if (p.seq.on() || !mask_shared_by_heads(p)) return 1;
  const int64_t h = p.outer.size[p.outer.dims - 1];
  if (h <= 1) return 1;  // (no heads: the divisions below need one)
  const int64_t rows = kMaskBlockQ;
  const int64_t per_head = acc_bytes * (rows * p.dim_qk + 3 * rows + rows * round_up(p.dim_v, nr));
  int64_t heads = std::clamp<int64_t>(kHeadsBytes / std::max<int64_t>(per_head, 1), 1, h);
  while (h % heads != 0) --heads;
  return heads;
}

// Whether a block of kLongBlockQ query rows fits in L2 together with one key
// block: its state (queries, max/sum/alpha, output) is read once per key
// block, and the key block by each of its query panels.
bool long_block_fits(const AttentionParams& p, int64_t nr, int64_t acc_bytes, int64_t l2) {
  const int64_t dv = round_up(p.dim_v, nr);
  const int64_t state = kLongBlockQ * (p.dim_qk + 3 + dv);
  const int64_t key_block = kBlockKV * (p.dim_qk + dv);
  return acc_bytes * (state + key_block) <= l2;
}

// Decoding's key blocks: as many keys (a multiple of 8, at most kBlockKV) as
// keep a (head, block)'s K and V within L1d, where the kernel prefetches
// them. In a (B, S, H_kv, E) cache a head's rows are often 4 KiB apart, all
// in the same L1 sets, and larger blocks are evicted before their use.
int64_t decode_block(const AttentionParams& p, int64_t acc_bytes, int64_t l1d) {
  const int64_t keys = l1d / std::max<int64_t>(acc_bytes * (p.dim_qk + p.dim_v), 1) / 8 * 8;
  return std::clamp<int64_t>(keys, 8, kBlockKV);
}

// Where the kernel reads 8-bit codes or 16-bit rows in registers
// (cpu/decode_codes.h): as many keys as make 4 KiB of a head's K rows (32
// keys of int8 at head dim 128, 16 of bfloat16, 64 of int8 at 64), at least
// 16 (docs/performance.md, "Decode key blocks of codes").
int64_t register_decode_block(const AttentionParams& p) {
  const int64_t element = p.kv_storage != KVStorage::Dense ? 1 : 2;
  const int64_t keys = 4096 / std::max<int64_t>(element * p.dim_qk, 1) / 8 * 8;
  return std::clamp<int64_t>(keys, 16, kBlockKV);
}

// Of the last outer dim's indices (decoding's heads), how many in a row read
// the same rows of m (p.k or p.v): the query heads of a K/V head where they
// are not read as rows of one item, all of them where m has a single head.
int64_t heads_sharing(const AttentionParams& p, const Matrix& m) {
  if (p.outer.dims == 0) return 1;
  const int d = p.outer.dims - 1;
  return m.outer_stride[d] == 0 ? p.outer.size[d] : m.divisor[d];
}

// Runs of heads that an item keeps together: each K head's and each V
// head's readers are within one run.
int64_t heads_sharing_kv(const AttentionParams& p) {
  const int64_t k = heads_sharing(p, p.k), v = heads_sharing(p, p.v);
  return k == 0 || v == 0 ? 0 : std::lcm(k, v);  // (0: an empty dim)
}

// Decoding: the heads an item takes, its panels and its key chunks.
void plan_decode(const AttentionParams& p, const KernelTraits& isa, const CacheSizes& caches,
                 int64_t threads, WorkSplit& split) {
  const bool f64 = p.dtype == DType::Float64;
  const int64_t acc_bytes = f64 ? 8 : 4, nr = isa.panel_width(f64);
  const int64_t decode_rows = isa.decode_rows(f64);
  split.decode = true;
  split.row_splits = div_up(p.len_q, decode_rows);
  const bool in_registers =
      isa.codes_in_registers && (p.kv_storage != KVStorage::Dense || p.dtype == DType::BFloat16 ||
                                 p.dtype == DType::Float16);
  split.block_kv = paged_block(
      p, in_registers ? register_decode_block(p) : decode_block(p, acc_bytes, caches.l1d));
  // The heads of a sequence (packed batches), else of the last outer dim.
  split.heads = std::max<int64_t>(
      p.seq.on() ? p.seq.heads : (p.outer.dims ? p.outer.size[p.outer.dims - 1] : 1), 1);
  // Fewer heads per item, the most that still give every thread about two
  // items: where each head's keys are rows of their own ((B, H_kv, S, E),
  // not a cache's (B, S, H_kv, E) rows of all heads), so that the keys need
  // fewer splits and merges and each item streams fewer K/V regions; and in
  // any layout where the chunks of the keys alone would leave a thread
  // idle. Always a multiple of the heads that read the same K/V rows, which
  // then still stream in once.
  const bool own_rows = p.k.row_stride == p.dim_qk && p.v.row_stride == p.dim_v;
  const int64_t max_chunks = std::max<int64_t>(p.len_kv / kMinChunkKeys, 1);
  if (own_rows || p.num_outer / split.heads * max_chunks < threads) {
    const int64_t chunks = own_rows ? 1 : max_chunks, share = heads_sharing_kv(p);
    for (int64_t h = split.heads, all = split.heads; h >= share; --h) {
      if (all % h != 0 || h % share != 0) continue;
      split.heads = h;  // (else the fewest: key chunks make up the rest)
      if (p.num_outer / h * chunks >= 2 * threads) break;
    }
  }
  // And no more heads than keep their query rows' state (queries, output,
  // max/sum; counted by rows, not padded lanes) within L2, which every key
  // block reads all of: the most heads that fit.
  const int64_t state_per_head = acc_bytes * p.len_q * (p.dim_qk + round_up(p.dim_v, nr) + 3);
  for (int64_t all = split.heads, h = all - 1, share = std::max<int64_t>(heads_sharing_kv(p), 1);
       h >= share && split.heads * state_per_head > caches.l2; --h) {
    if (all % h == 0 && h % share == 0) split.heads = h;
  }
  // With key spans, items of one batch index each where the K/V rows allow:
  // an item reads the union of its heads' keys, and batch indices pad
  // theirs apart.
  if (p.key_spans) {
    const int64_t heads = std::gcd(split.heads, p.key_spans_group);
    if (heads % std::max<int64_t>(heads_sharing_kv(p), 1) == 0) split.heads = heads;
  }
  // Several query rows per head (speculative decoding's drafts): the rows of
  // as many heads of a K/V head as fit a tile share each score tile, so that
  // the softmax and P·V work on up to decode_rows rows at a time and each
  // block's keys serve fewer, deeper tiles. (The band is applied per head's
  // rows; ALiBi and masks, which tell heads or rows apart otherwise, keep
  // one head per tile.)
  if (p.len_q > 1 && p.mask_kind == MaskKind::None && !p.alibi_slopes.data) {
    // (Of the item's heads, those that read the same K rows, the same V rows
    // and, with key spans, the same span.)
    int64_t share = std::gcd(std::gcd(heads_sharing(p, p.k), heads_sharing(p, p.v)), split.heads);
    if (p.key_spans) share = std::gcd(share, p.key_spans_group);
    int64_t merged = std::min(share, decode_rows / p.len_q);
    while (merged > 1 && share % merged != 0) --merged;
    split.merged = std::max<int64_t>(merged, 1);
  }
  const int64_t groups = p.num_outer / split.heads;
  // Enough chunks that every thread gets about two items.
  split.kv_splits =
      std::clamp<int64_t>(div_up(2 * threads, std::max<int64_t>(groups, 1)), 1, max_chunks);
  // Whole rounds: more items than threads, in a number the threads divide
  // where fewer chunks give one (else the last round leaves threads idle).
  if (groups * split.kv_splits > threads && groups * split.kv_splits % threads != 0) {
    for (int64_t k = split.kv_splits - 1; k >= 1; --k) {
      if (groups * k >= threads && groups * k % threads == 0) {
        split.kv_splits = k;
        break;
      }
    }
  }
  split.items = groups * split.kv_splits;
}

}  // namespace

WorkSplit plan_forward(const AttentionParams& p, const KernelTraits& isa, const CacheSizes& caches,
                       int64_t threads) {
  const bool f64 = p.dtype == DType::Float64;
  const int64_t acc_bytes = f64 ? 8 : 4, nr = isa.panel_width(f64);
  WorkSplit split;
  split.heads = heads_sharing_mask(p, nr, acc_bytes);
  const bool mask_rows =
      p.mask_kind != MaskKind::None && p.mask.row_stride != 0 && p.dim_qk <= kMaskBlockMaxDim;
  const int64_t max_block = split.heads > 1 || mask_rows                   ? kMaskBlockQ
                            : long_block_fits(p, nr, acc_bytes, caches.l2) ? kLongBlockQ
                                                                           : kMaxBlockQ;
  split.block_q =
      band_block(p,
                 std::min(work_block(p.len_q, p.num_outer / split.heads, threads, nr, max_block),
                          round_up(std::max<int64_t>(p.len_q, 1), nr)),
                 nr);
  split.block_kv = paged_block(p, std::min(kBlockKV, std::max<int64_t>(p.len_kv, 1)));
  split.items = p.num_outer / split.heads * div_up(p.len_q, split.block_q);
  split.threads = std::max<int64_t>(threads, 1);
  // Decoding: few query rows (one block) against long keys.
  const int64_t decode_rows = isa.decode_rows(f64);
  const bool few_queries =
      p.len_q <= decode_rows || (p.len_q <= kMostDecodeQueries && p.len_kv >= kMinRowSplitKeys);
  if (p.len_q > 0 && few_queries && p.softcap == 0 && !p.dropout.on() &&
      p.len_kv >= kMinChunkBlocks * split.block_kv) {
    plan_decode(p, isa, caches, threads, split);
  }
  return split;
}

WorkSplit plan_backward(BackwardParams& bp, const KernelTraits& isa, int64_t threads) {
  // Query rows per block, and the most keys per item's block.
  constexpr int64_t kBlockQ = 64;
  constexpr int64_t kMaxBlockKV = 128;
  const AttentionParams& p = bp.fwd;
  const int64_t nr = isa.panel_width(p.dtype == DType::Float64);
  WorkSplit split;
  split.block_q = std::min(kBlockQ, round_up(std::max<int64_t>(p.len_q, 1), nr));
  // The outer indices that sum into the same elements of a mask's gradient
  // (a mask broadcast over batch or heads) are one item's, taken in turn:
  // each element then has one writer and one order of summation, with no
  // copy of the gradient per thread. The key blocks are sized by the groups
  // of them, so that a mask every outer index shares still splits.
  split.members = shared_mask_members(bp);
  const int64_t groups = p.num_outer / std::max<int64_t>(split.members, 1);
  split.block_kv = paged_block(
      p, band_block(p, work_block(p.len_kv, groups, threads, isa.micro_rows, kMaxBlockKV),
                    isa.micro_rows));
  // Enough sets of key blocks that every thread gets about two items; each
  // set beyond the first costs a (len_q × E) slice of dQ per outer index,
  // so with many outer indices there is one set (no extra memory). Items
  // of several members cost a slice per member: one item per thread then,
  // and no more sets than keep those slices within a quarter of the
  // scores' size (len_q × len_kv per outer index) (docs/performance.md,
  // "Mask gradients summed in the kernels"). A mask gradient that
  // broadcasts over the keys takes one set: every key block sums into it.
  const int64_t key_blocks = div_up(p.len_kv, split.block_kv);
  const int64_t items_per_thread = split.members > 1 ? 1 : 2;
  int64_t most_sets = std::max<int64_t>(key_blocks, 1);
  if (split.members > 1) {
    most_sets = std::min(most_sets, 1 + p.len_kv / (4 * std::max<int64_t>(p.dim_qk, 1)));
  }
  bp.grad_q_splits = std::clamp<int64_t>(
      div_up(items_per_thread * threads, std::max<int64_t>(groups, 1)), 1, most_sets);
  if (bp.grad_mask.data && bp.grad_mask.col_stride == 0) bp.grad_q_splits = 1;
  split.items = p.len_kv > 0 ? groups * bp.grad_q_splits : 0;
  return split;
}

WorkSplit plan_weights(const WeightsParams& wp, const KernelTraits& isa, int64_t threads) {
  constexpr int64_t kMaxBlockQ = 128;
  constexpr int64_t kBlockKV = 64;
  const AttentionParams& p = wp.fwd;
  const int64_t nr = isa.panel_width(p.dtype == DType::Float64);
  const int64_t matrices = p.num_outer / wp.heads_per_item;
  WorkSplit split;
  split.block_q = std::min(work_block(p.len_q, matrices, threads, nr, kMaxBlockQ),
                           round_up(std::max<int64_t>(p.len_q, 1), nr));
  split.block_kv = std::min(kBlockKV, std::max<int64_t>(p.len_kv, 1));
  split.items = matrices * div_up(p.len_q, split.block_q);
  return split;
}

}  // namespace fusedmha::cpu
