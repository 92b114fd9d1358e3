#pragma once

// The forward kernel (ForwardKernel): its constants, per-thread scratch,
// the running softmax state, the prefill path and what decoding shares with
// it. Decoding's own members: cpu/forward_decode.h.
//
// Included only by the per-ISA kernel units (compiled once per level with
// -DCPU_CAPABILITY=<LEVEL>, see cpu/isa_kernels.h): everything here lives in
// an anonymous namespace inside fusedmha::cpu::<LEVEL>.

#include "cpu/kernel_scratch.h"
#include "cpu/plan.h"
#include "cpu/score_tiles.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

// A query block of at least this many rows computes its scores from each
// key block transposed (transpose_keys), which the score GEMM reads faster:
// the transpose repays itself only when that many query rows use it.
constexpr int64_t kTransposedKeysRows = 256;
// Key blocks whose per-head bool mask rows an item reads at once
// (ScoreTiles::read_mask_bits). docs/performance.md, "Bool masks as bits".
constexpr int64_t kMaskBitsBlocks = 4;
// Query blocks of at most kFewRows rows take few_row_scores, and so do
// blocks of up to decode_rows() whose rows fill more than half a vector of
// lanes (lane_scores).
constexpr int64_t kFewRows = 8;
// Decoding: the most query rows of one score tile (a panel), and so the
// most query heads of a K/V head the forward packs as rows of one item.
// Tiles of 16 rows where a panel holds them: every 16 rows of a K/V head
// share one pass of the softmax and P·V. Float rows only (also half
// precision's), on AVX2 or AVX-512: 16 rows of doubles, and 16 float rows at
// the DEFAULT level, were slower than 8. docs/performance.md, "Decode packing".
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kMostDecodeRows = 16;
#else
constexpr int64_t kMostDecodeRows = kFewRows;
#endif
template <typename acc_t>
constexpr int64_t decode_rows() {
  return std::min(sizeof(acc_t) == sizeof(float) ? kMostDecodeRows : kFewRows,
                  panel_width<acc_t>());  // (decoding's state: a panel)
}
// Decoding: a head's query rows go in split.row_splits panels of at most
// this many (all of them in one where they fit a tile).
int64_t panel_step(const WorkSplit& split, int64_t len_q) {
  return div_up(len_q, split.row_splits);
}
// Decoding with split keys: the rows of each partial-result record (one per
// item and panel: the rows' m, then l, then their unnormalised output,
// rows × dv), those of a panel of the call's longest query.
int64_t partial_rows(const WorkSplit& split, int64_t len_q) {
  return split.merged * panel_step(split, len_q);
}
// Decoding: an item's panels (ForwardKernel::panel_of), one state and one
// partial-result record each.
int64_t panel_count(const WorkSplit& split) {
  return split.heads / split.merged * split.row_splits;
}
// Decoding's softmax issues a prefetch burst every this many keys (see
// ScoreTiles::kScoreDimsPerBurst).
constexpr int64_t kSoftmaxKeysPerBurst = 2;
// Keys of the next work item prefetched into L2 (prefetch_item).
constexpr int64_t kPrefetchKeys = 128;
// ln 256: a running max moves only when a block's max passes it by more
// (docs/performance.md, "Lazy rescaling").
constexpr double kRescaleSlack = 5.545177444479562;

// The running softmax state of a block of query rows: max, sum, the
// current step's rescale factor, and the unnormalised output.
template <typename acc_t>
struct RowState {
  acc_t* m;
  acc_t* l;
  acc_t* alpha;
  acc_t* o;
};

// Whether the items read a per-head bool mask's rows kMaskBitsBlocks key
// blocks at a time (ScoreTiles::read_mask_bits): one head per item (masks
// the heads share are read once for all of them), key blocks as wide as a
// row's bits, and AVX-512 float scores (bool_strip).
template <typename acc_t>
bool reads_mask_bits(const AttentionParams& p, const WorkSplit& split) {
#if defined(CPU_CAPABILITY_AVX512)
  return std::is_same_v<acc_t, float> && p.mask_kind == MaskKind::Bool && p.mask.col_stride == 1 &&
         p.mask.row_stride != 0 && split.heads == 1 && !split.decode &&
         split.block_kv == kBlockedKeys;
#else
  (void)p, (void)split;
  return false;
#endif
}

// Scratch of one thread.
template <typename acc_t>
struct ForwardWorkspace {
  acc_t* st;     // bkv × nr    scores, then probabilities, of one panel of queries, transposed
  acc_t* k;      // bkv × dqk   widened key block (half-precision inputs)
  acc_t* kt;     // dqk × bkv   the key block transposed (blocks of kTransposedKeysRows or more, or few rows)
  acc_t* v;      // bkv × dv    the value block in column panels (key_panels_of); decoding: widened/padded rows
  acc_t* mt;     // w × bkv     mask terms of w queries (general masks)
  acc_t* terms;  // bkv × bq    mask terms shared by the item's heads (split.heads > 1), by panel
  acc_t* dm;     // bkv × nr    dropout factors of a panel (when dropout is on)
  uint64_t* mask_bits;  // a per-head bool mask's hidden keys (MaskBits), kMaskBitsBlocks key blocks × bq
  // Per head of the item (head_floats each): its scaled queries (Qᵀ in
  // panels of nr queries), then the running max m, sum l and rescale factor
  // alpha (bq each), then the unnormalised output o (rows × dv). Decoding
  // keeps one such state per panel (at most decode_rows() queries each;
  // split.heads × split.row_splits of them).
  acc_t* heads_state;
  int64_t dv;    // Ev padded to the panel width
  int64_t state_rows;  // query rows a head's state holds

  ForwardWorkspace(const AttentionParams& p, const WorkSplit& split, Arena<acc_t>& arena) {
    constexpr int64_t nr = panel_width<acc_t>(), w = Vectorized<acc_t>::size();
    const int64_t bq = split.block_q, bkv = split.block_kv;
    dv = round_up(p.dim_v, nr);
    state_rows = split.decode ? nr : bq;
    st = arena.take(bkv * nr);
    k = arena.take(bkv * round_up(p.dim_qk, nr));
    kt = arena.take(round_up(bkv, w) * p.dim_qk);
    v = arena.take(bkv * dv);
    mt = arena.take(w * round_up(bkv, w));
    terms = split.heads > 1 && !split.decode ? arena.take(bkv * bq) : nullptr;
    dm = p.dropout.on() ? arena.take(bkv * nr) : nullptr;
    // (In acc_t elements; run()'s rows of a block, round_up(rows, nr), are
    // at most block_q, a multiple of nr.)
    const int64_t bits_size =
        kMaskBitsBlocks * bq * div_up(int64_t{sizeof(uint64_t)}, int64_t{sizeof(acc_t)});
    mask_bits = reads_mask_bits<acc_t>(p, split)
                    ? reinterpret_cast<uint64_t*>(arena.take(bits_size))
                    : nullptr;
    heads_state = arena.take(split.heads * split.row_splits * head_floats(p, bq));
  }

  // The size of one head's state (a multiple of a cache line).
  int64_t head_floats(const AttentionParams& p, int64_t bq) const {
    return round_up(state_rows * p.dim_qk + 3 * bq + state_rows * dv, 64);
  }
};

template <typename scalar_t, typename acc_t>
class ForwardKernel {
 public:
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t nr = panel_width<acc_t>();
  static constexpr int64_t w = Vec::size();

  ForwardKernel(const AttentionParams& p, const WorkSplit& split, Arena<acc_t> arena)
      : call_(p), p_(p), split_(split), tiles_(p_), ws_(p, split, arena) {}

  // One item = split_.heads consecutive outer indices over one block of
  // query rows: one, or where they share a mask the heads of a batch index
  // (or, with the batch dim moved last by the host, the batch indices of a
  // head). Each key block is taken by every one of them before the next: a
  // shared mask's tile is read and transposed once for all of them.
  void run(int64_t item) {
    if (split_.decode) return run_decode(item);
    // Items cover the longest sequence; a shorter one's extra items do nothing.
    const int64_t heads = split_.heads;
    const auto [o0, q0] = item_place(item);
    p_ = sequence_of(p_, o0);  // (heads of one item share their sequence)
    if (q0 >= p_.len_q) return;
    const int64_t rows = std::min(split_.block_q, p_.len_q - q0);
    const int64_t bq = round_up(rows, nr);  // queries in vector lanes, padded

    // (Rows in one panel: st holds one.)
    const bool few_rows =
        p_.softcap == 0 && rows <= nr &&
        (rows <= kFewRows || (rows <= decode_rows<acc_t>() && Tiles::scores_in_lanes(rows)));
    const bool keys_transposed = !few_rows && bq >= kTransposedKeysRows;
    const acc_t scale = static_cast<acc_t>(p_.scale);
    // (few_row_scores takes its queries in few_row_lanes.)
    const int64_t lanes = few_rows ? Tiles::few_row_lanes(rows) : nr;
    for (int64_t h = 0; h < heads; ++h) {
      tiles_.pack_transposed(p_.q, o0 + h, q0, rows, few_rows ? lanes : bq, p_.dim_qk, scale,
                             head_rows(h, bq), lanes);
      start_rows(o0 + h, rows, bq, /*with_sink=*/true, head_state(h, bq));
    }

    // Only the keys the block's band can see (causal, sliding window): the
    // rest are skipped, not computed and masked.
    auto [kv_begin, kv_end] = key_range(o0, q0, rows);
    // (Blocks of a paged cache start at multiples of the block, so none
    // crosses a page; the band masks the keys this adds.)
    if (p_.pages.table) kv_begin = kv_begin / split_.block_kv * split_.block_kv;
    // A per-head bool mask's rows, read a span of key blocks at a time.
    const int64_t span = ws_.mask_bits ? kMaskBitsBlocks * split_.block_kv : 0;
    for (int64_t k0 = kv_begin; k0 < kv_end; k0 += split_.block_kv) {
      const int64_t cols = std::min(split_.block_kv, kv_end - k0);
      // The query panels [lane0, lane1) that see any of the block's keys: in
      // a band's corners (the diagonal's blocks, causal), whole panels of
      // queries see none and are neither computed nor updated.
      const auto [lane0, lane1] = seeing_lanes(q0, rows, bq, k0, cols);
      const int64_t next = k0 + cols, next_cols = std::min(split_.block_kv, kv_end - next);
      const uint64_t* block_bits = nullptr;  // (the block's first row's, in ws_.mask_bits)
      if (span) {
        const int64_t at = (k0 - kv_begin) % span;
        if (at == 0) {
          tiles_.read_mask_bits(o0, q0, rows, k0, std::min(span, kv_end - k0), ws_.mask_bits, bq);
        }
        block_bits = ws_.mask_bits + at / split_.block_kv * bq;
      }
      // A block whose mask tiles hide every key is skipped (the heads of an
      // item share the mask, and so its tiles).
      if (mask_tiles_over(p_, o0, q0, rows, k0, cols) == kTileHidden) continue;
      // The mask's next tile; with spans, the next span's where one starts.
      int64_t mask_cols = next_cols;
      if (span) mask_cols = (next - kv_begin) % span == 0 ? std::min(span, kv_end - next) : 0;
      queue_prefetches(item, o0, q0, rows, next, next_cols, mask_cols,
                       heads * block_bursts(cols, lane1 - lane0, keys_transposed));
      if (ws_.terms) {
        // (Panel c's terms at terms + c·bkv: laid out like its scores.)
        for (int64_t c = lane0; c < lane1; c += nr) {
          if (panel_tiles(o0, q0, rows, c, k0, cols) != kTileMixed) continue;
          tiles_.mask_terms(o0, q0 + c, std::min(nr, rows - c), nr, k0, cols,
                            ws_.terms + c * split_.block_kv, ws_.mt);
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t o = o0 + h;
        const RowState<acc_t> st = head_state(h, bq);
        int64_t ldk;
        const acc_t* k =
            tiles_.key_rows_of(Tiles::KeySide::K, o, k0, cols, p_.dim_qk, false, ws_.k, &ldk);
        // (V in column panels: every query panel's P·V streams them.)
        tiles_.key_panels_of(Tiles::KeySide::V, o, k0, cols, p_.dim_v, ws_.v);
        if (keys_transposed) tiles_.transpose_keys(k, ldk, cols, p_.dim_qk, ws_.kt, &prefetch_);
        // One panel of nr queries at a time, from its scores to its P·V: its
        // tile of Sᵀ (cols × nr) stays in L1 throughout, and the key block
        // (or its transpose) and the value panels are read from L1 by every
        // panel after the first.
        for (int64_t c = lane0; c < lane1; c += nr) {
          const int64_t prow = std::min(nr, rows - c);
          // (A panel whose tiles hide every key is skipped; one whose tiles
          // hide none takes no mask.)
          const uint8_t tiles = panel_tiles(o, q0, rows, c, k0, cols);
          if (tiles == kTileHidden) continue;
          const bool masked = tiles != kTileVisible;
          const RowState<acc_t> ps{st.m + c, st.l + c, st.alpha + c, st.o + c * ws_.dv};
          const acc_t* qt = head_rows(h, bq) + c * p_.dim_qk;
          PrefetchQueue* pq = &prefetch_;
          if (few_rows) {  // (then a single panel)
            tiles_.few_row_scores(k, ldk, cols, head_rows(h, bq), rows, nr, ws_.st, ws_.kt, pq);
          } else if (keys_transposed) {
            tiles_.scores_of_keys_transposed(ws_.kt, cols, qt, nr, ws_.st, pq);
          } else {
            tiles_.scores(k, ldk, cols, qt, nr, ws_.st, pq);
          }
          const acc_t* terms = ws_.terms && masked ? ws_.terms + c * split_.block_kv : nullptr;
          tiles_.transform_scores(o, q0 + c, prow, nr, k0, cols, ws_.st, ws_.mt, nullptr,
                                  /*without_mask=*/terms != nullptr || !masked, /*period=*/0,
                                  block_bits ? MaskBits{block_bits + c, bq} : MaskBits{});
          softmax_step(nr, cols, ps, terms);
          if (k0 != kv_begin) rescale_output(0, prow, ps);  // (the first block's output is 0)
          if (p_.dropout.on()) {
            // The running sum normalises with every probability; the output
            // accumulates only the kept ones, scaled by 1/(1 - p).
            tiles_.dropout_factors(o, q0 + c, prow, nr, k0, cols, ws_.dm);
            Tiles::scale_by(ws_.st, ws_.dm, cols, nr);
          }
          gemm<acc_t, /*kRowsOfA=*/false, /*kAccumulate=*/true>(
              prow, ws_.dv, cols, ws_.st, nr, [&](int64_t e) { return ws_.v + e * cols; }, nr,
              ps.o, ws_.dv, NoEpilogue{}, pq);
        }
      }
    }
    for (int64_t h = 0; h < heads; ++h) write_output(o0 + h, q0, rows, head_state(h, bq));
  }

  // Decoding: one item = split_.heads outer indices (the heads of a batch
  // index or of a sequence, or some of them: configure) over one chunk of
  // the keys. Each key block is read for every head of the item before the
  // next block: in a KV cache's (B, S, H_kv, E) layout a key's heads are
  // adjacent, so whole rows stream in, not one head's slice of every row.
  // The item's rows go in panels (panel_of), each one score tile: the rows
  // of split_.merged heads, or some of one head's. With split keys the item
  // leaves its partial state for combine().
  void run_decode(int64_t item);

 public:
  // Merges the partial states of group g's chunks (m, l, o of each) into
  // the output and log-sum-exp: M = max m_c, L = Σ l_c·e^(m_c − M),
  // O = Σ o_c·e^(m_c − M); a chunk that saw no key (m_c = −∞) weighs 0, and
  // one whose sum is NaN makes L NaN.
  void combine(int64_t g);

 private:
  // Decoding: queues the keys and values (and the mask's tile) of the
  // (panel, key block) after panel h's block at k0 into L2, paced over the
  // bursts that h's block issues (those of its scores, few_row_bursts, one
  // every kSoftmaxKeysPerBurst keys of its softmax and one per micro-kernel
  // call of its P·V); the loads find them there. Into L1 (prefetcht0), each
  // prefetch held one of L1's few miss buffers for a trip to memory and the
  // kernel stalled on them; in a (B, S, H_kv, E) cache a head's rows are
  // 4 KiB apart, in the same L1 sets, and were evicted before their use.
  // One (head, block) ahead into L2 read K/V fastest (docs/performance.md,
  // "The prefetch queue").
  void queue_next_head_block(int64_t h, int64_t panels, int64_t k0, int64_t kv_end,
                             int64_t rows, int64_t o0, bool keys_transposed);

  // Item i's first outer index and first query row.
  std::pair<int64_t, int64_t> item_place(int64_t i) const {
    const int64_t nqb = div_up(call_.len_q, split_.block_q);
    return {i / nqb * split_.heads, i % nqb * split_.block_q};
  }

  // Queues what should come into L2 while the key block before keys
  // k0..k0+cols of item `item` (outer indices o0.., queries q0..q0+rows)
  // computes, paced over its `bursts` bursts: the mask tile of keys
  // k0..k0+mask_cols (its rows are far apart, where the hardware prefetchers
  // do not follow; none where the block's rows were read with a span's) and,
  // with several heads per item, their keys and values (all heads' do not
  // stay in L2 from the item's previous pass; one head's mostly do). After
  // the last block (cols = 0): the next item's query block and, when it
  // belongs to other heads, its first kPrefetchKeys keys; where each head's
  // rows are read once (short sequences: a BERT batch streams every block
  // from memory), this hides that latency.
  void queue_prefetches(int64_t item, int64_t o0, int64_t q0, int64_t rows, int64_t k0,
                        int64_t cols, int64_t mask_cols, int64_t bursts) {
    if (cols > 0) {
      tiles_.queue_mask_tile(prefetch_, o0, q0, rows, k0, mask_cols);
      for (int64_t h = 0; h < split_.heads && split_.heads > 1; ++h) {
        tiles_.queue_key_rows(prefetch_, Tiles::KeySide::K, o0 + h, k0, cols, p_.dim_qk);
        tiles_.queue_key_rows(prefetch_, Tiles::KeySide::V, o0 + h, k0, cols, p_.dim_v);
      }
    } else {
      queue_item(item, item - split_.threads);  // (the thread's next item)
    }
    prefetch_.pace(bursts);
  }

  // The bursts one head issues over a key block of cols keys for `lanes`
  // query lanes: a w × w key transpose or a micro-kernel call each.
  int64_t block_bursts(int64_t cols, int64_t lanes, bool keys_transposed) const {
    const int64_t per_panel = div_up(cols, kMicroRows) + ws_.dv / nr * div_up(nr, kMicroRows);
    const int64_t transposes = keys_transposed ? div_up(cols, w) * (p_.dim_qk / w) : 0;
    return transposes + lanes / nr * per_panel;
  }

  // The query block of item `next` and, when it belongs to other heads than
  // item `current`, the first kPrefetchKeys keys it sees.
  void queue_item(int64_t current, int64_t next) {
    if (next < 0 || call_.pages.table) return;
    const auto [o0, q0] = item_place(next);
    const bool same_heads = item_place(current).first == o0;
    const AttentionParams np = sequence_of(call_, o0);
    if (q0 >= np.len_q) return;
    const int64_t rows = std::min(split_.block_q, np.len_q - q0);
    const Tiles next_tiles(np);
    for (int64_t h = 0; h < split_.heads; ++h) {
      const int64_t o = o0 + h;
      next_tiles.queue_rows(prefetch_, np.q, o, q0, rows, np.dim_qk);
      if (same_heads) continue;
      const auto [begin, end] = next_tiles.key_range(o, q0, rows);
      const int64_t cols = std::min(end - begin, kPrefetchKeys);
      next_tiles.queue_key_rows(prefetch_, Tiles::KeySide::K, o, begin, cols, np.dim_qk);
      next_tiles.queue_key_rows(prefetch_, Tiles::KeySide::V, o, begin, cols, np.dim_v);
    }
  }

  // The state of the item's head h (decoding: of its panel h): its query
  // rows, and its RowState.
  acc_t* head_rows(int64_t h, int64_t bq) const {
    return ws_.heads_state + h * ws_.head_floats(p_, bq);
  }
  RowState<acc_t> head_state(int64_t h, int64_t bq) const {
    acc_t* base = head_rows(h, bq) + ws_.state_rows * p_.dim_qk;
    return {base, base + bq, base + 2 * bq, base + 3 * bq};
  }
  // The query lanes [lane0, lane1) of a block (queries q0..q0+rows in bq
  // lanes) that can see any of keys k0..k0+cols: whole panels, lane0 below
  // rows.
  std::pair<int64_t, int64_t> seeing_lanes(int64_t q0, int64_t rows, int64_t bq, int64_t k0,
                                           int64_t cols) const {
    if (!has_band(p_)) return {0, bq};
    const int64_t first = std::clamp<int64_t>(band_query_begin(p_, k0) - q0, 0, rows - 1);
    const int64_t last = std::clamp<int64_t>(band_query_end(p_, k0 + cols) - q0, first + 1, rows);
    return {first / nr * nr, round_up(last, nr)};
  }

  // What the mask's tiles hold over panel c of a block (queries q0 + c..,
  // keys k0..k0+cols) of outer index o: a MaskTileState.
  uint8_t panel_tiles(int64_t o, int64_t q0, int64_t rows, int64_t c, int64_t k0,
                      int64_t cols) const {
    return mask_tiles_over(p_, o, q0 + c, std::min(nr, rows - c), k0, cols);
  }

  // The keys any of the heads o0.. of an item can see (the band, and each
  // head's padding: keys past a head's own length are masked in its tiles).
  std::pair<int64_t, int64_t> key_range(int64_t o0, int64_t q0, int64_t rows) const {
    int64_t begin = p_.len_kv, end = 0;
    for (int64_t h = 0; h < split_.heads; ++h) {
      const auto [b, e] = tiles_.key_range(o0 + h, q0, rows);
      if (b < e) begin = std::min(begin, b), end = std::max(end, e);
    }
    return {std::min(begin, end), end};
  }
  // Keys per chunk: a multiple of the key block, kMinChunkKeys at least (a
  // short span's chunks would otherwise be a block each, and merges).
  int64_t chunk_length(int64_t len_kv) const;
  // Chunk c's partial state of panel h of group g (partial_rows).
  acc_t* partial(int64_t g, int64_t c, int64_t h) const;

  // Decoding: an item's panel, one score tile's rows: per_head rows (from
  // q0) of each of heads o..o+heads-1, packed as one head's.
  struct Panel {
    int64_t o, q0, per_head, heads;
    int64_t rows() const { return per_head * heads; }
  };
  // Panel h of the item: its heads in runs of split_.merged, or each head's
  // rows in split_.row_splits runs of panel_step (the last ones of a shorter
  // sequence may have fewer rows, or none).
  Panel panel_of(int64_t o0, int64_t h) const;

  // Decoding: starts panel h of the item (state h): the scaled queries of
  // its heads side by side, and each head's rows with its own sink (only
  // chunk 0 has it).
  void start_panel(const Panel& pn, int64_t bq, int64_t chunk, int64_t h);

  // Decoding: writes panel pn's rows out of its state st.
  void write_panel(const Panel& pn, const RowState<acc_t>& st);

  // Zero output, and the running max and sum: −∞ and 0, or with a sink
  // (a key of score `sink` and no value) from it.
  void start_rows(int64_t o, int64_t rows, int64_t bq, bool with_sink,
                  const RowState<acc_t>& st) const {
    std::fill(st.o, st.o + rows * ws_.dv, acc_t(0));
    const bool sink = with_sink && has_sinks(p_);
    std::fill(st.m, st.m + bq, sink ? static_cast<acc_t>(sink_logit(p_, o)) : neg_inf<acc_t>());
    std::fill(st.l, st.l + bq, acc_t(sink ? 1 : 0));
  }

 private:
  using Tiles = ScoreTiles<scalar_t, acc_t>;

  // Folds the block's scores into the running max/sum of each query and
  // turns them into probabilities relative to the new max; alpha[i] is the
  // factor the output accumulated so far must be rescaled by. With terms
  // (a shared mask's tile, laid out like Sᵀ), they are added to the scores
  // first, in the pass that finds the max. (The max passes over NaN scores:
  // their exp is NaN, which makes the row's sum NaN, and write_output turns
  // that into a NaN row.) The scores are Sᵀ's rows of bq lanes (ld = bq);
  // the first kVectors·w lanes of each: a panel (kVectors = 2, two
  // independent dependency chains), or where one vector holds every query
  // (decoding's few rows), that one alone.
  // (prefetch: a burst every kSoftmaxKeysPerBurst keys, decoding's.)
  template <int kVectors = 2>
  void softmax_step(int64_t bq, int64_t cols, const RowState<acc_t>& st,
                    const acc_t* terms = nullptr, PrefetchQueue* prefetch = nullptr) {
    static_assert(kVectors * w <= nr, "one panel at most");
    const Vec vneg_inf(neg_inf<acc_t>()), zero(acc_t(0));
    Vec m_old[kVectors], max[kVectors], use[kVectors], sum[kVectors];
#pragma GCC unroll 2
    for (int v = 0; v < kVectors; ++v) max[v] = m_old[v] = Vec::loadu(st.m + v * w);
    if (terms) {
      for (int64_t j = 0; j < cols; ++j) {
        acc_t* s = ws_.st + j * bq;
        const acc_t* t = terms + j * bq;
#pragma GCC unroll 2
        for (int v = 0; v < kVectors; ++v) {
          const Vec x = Vec::loadu(s + v * w) + Vec::loadu(t + v * w);
          x.store(s + v * w);
          max[v] = max_of_numbers(x, max[v]);
        }
      }
    } else {
      for (int64_t j = 0; j < cols; ++j) {
        const acc_t* s = ws_.st + j * bq;
#pragma GCC unroll 2
        for (int v = 0; v < kVectors; ++v) max[v] = max_of_numbers(Vec::loadu(s + v * w), max[v]);
      }
    }
    // The running max moves only when the block's max passes it by more
    // than kRescaleSlack: otherwise the old one stays, alpha is exactly 1
    // and the output needs no rescaling pass (probabilities of up to 256
    // relative to the max kept are well within range, and the sum and
    // lse stay exact for any reference). A max of −inf, NaN or +inf
    // always moves (the compare is false).
    const Vec slack(static_cast<acc_t>(kRescaleSlack));
#pragma GCC unroll 2
    for (int v = 0; v < kVectors; ++v) {
      max[v] = Vec::blendv(max[v], m_old[v], (max[v] - m_old[v]) <= slack);
      // A query that has seen no attendable key yet keeps max -inf; subtract
      // 0 instead so that exp gives 0 rather than NaN.
      use[v] = Vec::blendv(max[v], zero, max[v] == vneg_inf);
      sum[v] = zero;
    }
    for (int64_t j = 0; j < cols; ++j) {
      if (prefetch && j % kSoftmaxKeysPerBurst == 0) prefetch->issue();
      acc_t* s = ws_.st + j * bq;
#pragma GCC unroll 2
      for (int v = 0; v < kVectors; ++v) {
        const Vec e = exp_of_difference(Vec::loadu(s + v * w), use[v]);
        e.store(s + v * w);
        sum[v] = sum[v] + e;
      }
    }
#pragma GCC unroll 2
    for (int v = 0; v < kVectors; ++v) {
      const Vec alpha = exp_of_difference(m_old[v], use[v]);
      (Vec::loadu(st.l + v * w) * alpha + sum[v]).store(st.l + v * w);
      max[v].store(st.m + v * w);
      alpha.store(st.alpha + v * w);
    }
  }

  // Rows [begin, end) of the output times their alpha.
  void rescale_output(int64_t begin, int64_t end, const RowState<acc_t>& st) {
    for (int64_t i = begin; i < end; ++i) {
      const acc_t a = st.alpha[i];
      if (a == acc_t(1)) continue;
      acc_t* acc = st.o + i * ws_.dv;
      const Vec va(a);
      for (int64_t e = 0; e < ws_.dv; e += w) (Vec::loadu(acc + e) * va).store(acc + e);
    }
  }

  void write_output(int64_t o, int64_t q0, int64_t rows, const RowState<acc_t>& st) {
    scalar_t* out = matrix_start<scalar_t>(p_.outer, p_.out, o);
    const auto lse = lse_rows<acc_t>(p_, p_.lse, o);
    constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
    constexpr acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
    for (int64_t i = 0; i < rows; ++i) {
      const acc_t m = st.m[i], l = st.l[i];
      acc_t inv, row_lse;
      if (std::isnan(m) || std::isnan(l) || m == inf) {
        // A NaN or +inf score makes the whole softmax row NaN, as in exact
        // arithmetic (the fast exp would otherwise hide it).
        inv = nan;
        row_lse = nan;
      } else if (l > acc_t(0)) {
        inv = acc_t(1) / l;
        row_lse = m + std::log(l);
      } else {
        // No key to attend to: output 0 and lse +inf, so that
        // exp(score - lse) is 0 for every key in the backward.
        inv = acc_t(0);
        row_lse = inf;
      }
      const acc_t* acc = st.o + i * ws_.dv;
      scalar_t* dst = out + (q0 + i) * p_.out.row_stride;
      for (int64_t e = 0; e < p_.dim_v; ++e) dst[e] = static_cast<scalar_t>(acc[e] * inv);
      lse[q0 + i] = row_lse;
    }
  }

  const AttentionParams& call_;  // the whole call
  AttentionParams p_;  // a copy: run() narrows it to the item's sequence
  const WorkSplit& split_;
  Tiles tiles_;
  ForwardWorkspace<acc_t> ws_;
  PrefetchQueue prefetch_;
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
