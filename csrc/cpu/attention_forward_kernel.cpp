// Fused attention forward on the CPU, compiled once per ISA level.
//
// One work item = one (batch·head, block of query rows). For each block of
// keys it computes the transposed scores Sᵀ = K·(scale·Q)ᵀ (keys × queries)
// with register-blocked micro-kernels, folds them into a running max and
// sum per query (online softmax) and accumulates P·V into an fp32 (fp64 for
// double) accumulator that is normalised once at the end.
//
// Why Sᵀ: queries are the vector lanes, so
//  - the max/exp/sum passes of the softmax are plain vertical vector
//    operations (no horizontal reductions per row),
//  - K and V are read in place, row by row, through their strides (only Q is
//    repacked, once per item; half-precision K/V tiles are widened to fp32).
// Extra memory is a few tiles per thread; nothing of size L×S exists.
//
// This file sees only the params struct and ATen's header-only Vectorized:
// no tensors, no allocation, no threading (the host wrapper does those).

#include "cpu/attention_tiles.h"

#include <utility>

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

// Query rows per block. A block of at least kTransposedKeysRows computes its
// scores from each key block transposed (transpose_keys), which the score GEMM
// reads faster; the transpose pays for itself only when that many query rows (8
// panels of AVX-512 floats) use it. Items whose heads share a mask take blocks
// of kMaskBlockQ, so that more heads fit, and so do items that read a mask's
// rows of their own (a per-head mask) at head dims up to kMaskBlockMaxDim,
// where the mask weighs most against the scores' work: each key block's tile of
// it, a line or more from each of the block's rows (at S >= 1024 each row a
// page of its own), prefetched into L2 beside the block's state, then spans 128
// rows, not 512. (Zen 4, per-head masks, alternating with blocks of 512 in one
// process, E=64: float32 1.007-1.036x at B=4, H=8, L=S=1024 and 4096,
// 1.01-1.02x at B=1 and 2, L=S=4096 and 2048, GQA over 2 K/V heads 1.02x,
// bfloat16 1.01x, AVX2 1.01x; a bool mask at L=S=4096 1.03-1.04x. E=128:
// 0.975-1.008x, so not there. Blocks of 64 or 192 gained no more than 128.)
// Blocks of kLongBlockQ where they fit in L2 (long_block_fits).
constexpr int64_t kMaxBlockQ = 256;
constexpr int64_t kLongBlockQ = 512;
constexpr int64_t kTransposedKeysRows = 256;
constexpr int64_t kMaskBlockQ = 128;
constexpr int64_t kMaskBlockMaxDim = 64;
constexpr int64_t kBlockKV = 64;
// Key blocks whose per-head bool mask rows an item reads at once
// (TileReader::read_mask_bits). Zen 4, B=1 and 4, H=8, E=64 and 128, a
// (B, H, L, S) bool mask, alternating with reading each block's rows in one
// process: 1.03-1.05x at L=S=4096, 1.02x at 1024; spans of 8 or 16 blocks
// the same, of 2 half the gain.
constexpr int64_t kMaskBitsBlocks = 4;
// Query blocks of at most kFewRows rows take few_row_scores, and so do
// blocks of up to decode_rows() whose rows fill more than half a vector of
// lanes (lane_scores: 9-16 float rows on AVX-512).
constexpr int64_t kFewRows = 8;
// Decoding: the most query rows of one score tile (a panel), and so the
// most query heads of a K/V head the forward packs as rows of one item.
// (Packed beyond it, multi-query attention's 32 query heads over one K/V
// head took the GEMM path, whose items cannot split one K/V head's keys
// among threads, and ran on one thread: Zen 4, 2 threads, S=8192, E=128,
// 1.75x faster packed by 8.) Tiles of 16 rows, not
// 8, where a panel holds them: every 16 rows of a K/V head share one pass
// of the softmax and P·V, and on AVX-512 the keys stay untransposed (Zen 4,
// E=128, H=32, caches flushed, alternating in one process: 4 queries per
// head over H_kv=8, S=4096, 1.19-1.23x; 16 query heads per K/V head,
// S=8192, 1.20-1.22x; 32 per K/V head 1.15x; 3 queries per head 1.18-1.25x;
// 16 queries per head, which took the GEMM path, 1.8x; on AVX2 1.04-1.23x;
// one query per head over H_kv=8 within 1%). Float rows only (also half
// precision's), on AVX2 or AVX-512: 16 rows of doubles on AVX-512 were 0.86x
// as fast as 8, and 16 float rows at the DEFAULT level 0.54-0.64x.
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
// Decoding also takes up to kMostDecodeQueries query rows per head, in
// panels of at most decode_rows() (WorkSplit::row_splits), over at least
// kMinRowSplitKeys keys: the GEMM path reads a K/V head's keys once per
// query head (its items are one head's block of rows), pads the rows to a
// panel (17 rows cost as much as 32) and copies each value block into
// panels. (Zen 4 AVX-512, E=128, H=32 over H_kv=8, K/V in cache,
// alternating in one process: S=4096, 17 queries per head 1.29x, 24 1.17x,
// 32 1.12x, 40 1.21x, 48 1.22x, 56 1.00x, 64 0.97x; S=32768, 32 queries
// 1.38x, 64 1.14x; S=1024, 20 queries 1.19x, 32 1.00x, 48 1.13x; H=8 over
// H_kv=8, S=4096, 32 queries 1.36x, 64 1.14x; but S=300-512, 32 or 64
// queries, 0.93-0.98x.)
constexpr int64_t kMostDecodeQueries = 64;
constexpr int64_t kMinRowSplitKeys = 1024;
// Decoding takes at least kMinChunkBlocks key blocks, and splits the keys
// into chunks of at least kMinChunkKeys. (Chunks of 1024 left one of two
// threads idle below S = 2048: one query over a 1024-key GQA cache, E=128,
// took 1.0 ms, and 0.69-0.75 ms in chunks of 256; the merge is a few vector
// operations per chunk and head.)
constexpr int64_t kMinChunkBlocks = 4;
constexpr int64_t kMinChunkKeys = 256;
// Decoding's softmax issues a prefetch burst every this many keys (see
// TileReader::kScoreDimsPerBurst).
constexpr int64_t kSoftmaxKeysPerBurst = 2;
// Keys of the next work item prefetched into L2 (prefetch_item).
constexpr int64_t kPrefetchKeys = 128;
// ln 256: a running max moves only when a block's max passes it by more.
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
// blocks at a time (TileReader::read_mask_bits): one head per item (masks
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

  // One item = split_.heads outer indices (one, or the heads of a batch
  // index when they share a mask) over one block of query rows. Each key
  // block is taken by every head before the next: a shared mask's tile is
  // read and transposed once for all of them.
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
      // The mask's next tile; with spans, the next span's where one starts.
      int64_t mask_cols = next_cols;
      if (span) mask_cols = (next - kv_begin) % span == 0 ? std::min(span, kv_end - next) : 0;
      queue_prefetches(item, o0, q0, rows, next, next_cols, mask_cols,
                       heads * block_bursts(cols, lane1 - lane0, keys_transposed));
      const uint64_t* block_bits = nullptr;  // (the block's first row's, in ws_.mask_bits)
      if (span) {
        const int64_t at = (k0 - kv_begin) % span;
        if (at == 0) {
          tiles_.read_mask_bits(o0, q0, rows, k0, std::min(span, kv_end - k0), ws_.mask_bits, bq);
        }
        block_bits = ws_.mask_bits + at / split_.block_kv * bq;
      }
      if (ws_.terms) {
        // (Panel c's terms at terms + c·bkv: laid out like its scores.)
        for (int64_t c = lane0; c < lane1; c += nr) {
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
        // tile of Sᵀ (cols × nr) stays in L1 throughout, and K and V are
        // read from L1 by every panel after the first.
        for (int64_t c = lane0; c < lane1; c += nr) {
          const int64_t prow = std::min(nr, rows - c);
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
          const acc_t* terms = ws_.terms ? ws_.terms + c * split_.block_kv : nullptr;
          tiles_.transform_scores(o, q0 + c, prow, nr, k0, cols, ws_.st, ws_.mt, nullptr,
                                  /*shared_terms=*/terms != nullptr, /*period=*/0,
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
  void run_decode(int64_t item) {
    const int64_t g = item / split_.kv_splits, chunk = item % split_.kv_splits;
    const int64_t heads = split_.heads, o0 = g * heads;
    p_ = sequence_of(p_, o0);  // (a group's heads share their sequence)
    const int64_t panels = panel_count(split_), bq = nr;  // (a panel's rows: decode_rows <= nr)
    // The chunk's share of the keys any head of the group can see: chunks
    // of those keys, not of all, so that left padding, a static cache's
    // unused slots or a sliding window leave no thread idle. (Chunks are
    // whole blocks: a paged cache's still start at multiples of the block.)
    auto [kv_begin, kv_end] = key_range(o0, 0, p_.len_q);
    if (p_.pages.table) kv_begin = kv_begin / split_.block_kv * split_.block_kv;
    const int64_t chunk_len = chunk_length(kv_end - kv_begin);
    kv_begin = std::min(kv_end, kv_begin + chunk * chunk_len);
    kv_end = std::min(kv_end, kv_begin + chunk_len);
    // The first (head, block) now, while the query panels are packed: the
    // loop below queues each next one, and nothing queued this one. (One
    // query over a 1024-key GQA cache, caches flushed before each call:
    // 6-8% faster; at 4096 keys 1%.)
    if (p_.len_q > 0 && kv_begin < kv_end) {
      const int64_t cols = std::min(split_.block_kv, kv_end - kv_begin);
      tiles_.queue_key_rows(prefetch_, Tiles::KeySide::K, o0, kv_begin, cols, p_.dim_qk);
      tiles_.queue_key_rows(prefetch_, Tiles::KeySide::V, o0, kv_begin, cols, p_.dim_v);
      const Panel first = panel_of(o0, 0);
      tiles_.queue_mask_tile(prefetch_, first.o, first.q0, first.rows(), kv_begin, cols);
      prefetch_.issue(std::numeric_limits<int64_t>::max());
    }
    for (int64_t h = 0; h < panels; ++h) start_panel(panel_of(o0, h), bq, chunk, h);
    // The keys whose transpose ws_.kt holds: panels that read the same rows
    // (query heads of one K/V head that are not packed as rows of one item,
    // such as several queries per head, or one head's panels) transpose each
    // block once.
    const void* kt_keys = nullptr;
    int64_t kt_cols = 0;
    for (int64_t k0 = kv_begin; p_.len_q > 0 && k0 < kv_end; k0 += split_.block_kv) {
      const int64_t cols = std::min(split_.block_kv, kv_end - k0);
      for (int64_t h = 0; h < panels; ++h) {
        const Panel pn = panel_of(o0, h);  // (its heads read pn.o's K/V rows)
        const int64_t o = pn.o, rows = pn.rows();
        if (rows == 0) continue;  // (a shorter sequence's last panels)
        // Sᵀ's rows: up to w query rows (such as a GQA group's 4) in one
        // vector of lanes, not a panel of two (half the lines to zero and to
        // keep in L1).
        const int64_t ls = rows > w ? bq : w;
        const RowState<acc_t> st = head_state(h, bq);
        int64_t ldk = 0, ldv;
        const void* keys = tiles_.key_source(Tiles::KeySide::K, o, k0);
        const bool in_lanes = Tiles::scores_in_lanes(rows);
        const bool transposed = keys == kt_keys && cols == kt_cols && !in_lanes;
        queue_next_head_block(h, panels, k0, kv_end, rows, o0, transposed);
        PrefetchQueue* pq = &prefetch_;
        const acc_t* k =
            transposed ? nullptr
                       : tiles_.key_rows_of(Tiles::KeySide::K, o, k0, cols, p_.dim_qk, false,
                                            ws_.k, &ldk);
        tiles_.few_row_scores(k, ldk, cols, head_rows(h, bq), rows, ls, ws_.st, ws_.kt, pq,
                              transposed);
        if (!in_lanes) kt_keys = keys, kt_cols = cols;  // (lane_scores writes no kt)
        tiles_.transform_scores(o, pn.q0, rows, ls, k0, cols, ws_.st, ws_.mt, nullptr, false,
                                pn.per_head);
        if (rows <= w) {
          softmax_step<1>(ls, cols, st, /*terms=*/nullptr, pq);
        } else {
          softmax_step(ls, cols, st, /*terms=*/nullptr, pq);
        }
        if (k0 != kv_begin) rescale_output(0, rows, st);  // (the first block's output is 0)
        const acc_t* v =
            tiles_.key_rows_of(Tiles::KeySide::V, o, k0, cols, p_.dim_v, true, ws_.v, &ldv);
        gemm<acc_t, /*kRowsOfA=*/false, /*kAccumulate=*/true>(
            rows, ws_.dv, cols, ws_.st, ls, [&](int64_t e) { return v + e; }, ldv, st.o, ws_.dv,
            NoEpilogue{}, pq);
      }
    }
    for (int64_t h = 0; h < panels; ++h) {
      const RowState<acc_t> st = head_state(h, bq);
      const Panel pn = panel_of(o0, h);
      const int64_t rows = pn.rows();
      if (split_.kv_splits == 1) {
        write_panel(pn, st);
        continue;
      }
      acc_t* part = partial(g, chunk, h);
      std::copy(st.m, st.m + rows, part);
      const int64_t record_rows = partial_rows(split_, call_.len_q);
      std::copy(st.l, st.l + rows, part + record_rows);
      std::copy(st.o, st.o + rows * ws_.dv, part + 2 * record_rows);
    }
  }

 public:
  // Merges the partial states of group g's chunks (m, l, o of each) into
  // the output and log-sum-exp: M = max m_c, L = Σ l_c·e^(m_c − M),
  // O = Σ o_c·e^(m_c − M); a chunk that saw no key (m_c = −∞) weighs 0, and
  // one whose sum is NaN makes L NaN.
  void combine(int64_t g) {
    const int64_t o0 = g * split_.heads;
    p_ = sequence_of(p_, o0);
    const int64_t dv = ws_.dv, record_rows = partial_rows(split_, call_.len_q);
    const RowState<acc_t> st = head_state(0, nr);
    for (int64_t h = 0; h < panel_count(split_); ++h) {
      const Panel pn = panel_of(o0, h);
      for (int64_t i = 0; i < pn.rows(); ++i) {
        acc_t top = neg_inf<acc_t>();
        for (int64_t c = 0; c < split_.kv_splits; ++c) {
          const acc_t m = partial(g, c, h)[i];
          if (std::isnan(m) || m > top) top = m;  // (NaN stays)
          if (std::isnan(top)) break;
        }
        acc_t l = 0;
        acc_t* out = st.o + i * dv;
        std::fill(out, out + dv, acc_t(0));
        const bool finite = !std::isnan(top) && std::isfinite(top);
        for (int64_t c = 0; finite && c < split_.kv_splits; ++c) {
          const acc_t* part = partial(g, c, h);
          if (part[i] == neg_inf<acc_t>()) continue;
          const acc_t weight = std::exp(part[i] - top);
          l += part[record_rows + i] * weight;
          const acc_t* o = part + 2 * record_rows + i * dv;
          for (int64_t e = 0; e < dv; ++e) out[e] += o[e] * weight;
        }
        // (A chunk's NaN sum, from a NaN score, makes the row NaN.)
        for (int64_t c = 0; c < split_.kv_splits; ++c) {
          if (std::isnan(partial(g, c, h)[record_rows + i])) l = std::numeric_limits<acc_t>::quiet_NaN();
        }
        st.m[i] = top;
        st.l[i] = l;
      }
      write_panel(pn, st);
    }
  }

 private:
  // Decoding: queues the keys and values (and the mask's tile) of the
  // (panel, key block) after panel h's block at k0 into L2, paced over the
  // bursts that h's block issues (those of its scores, few_row_bursts, one
  // every kSoftmaxKeysPerBurst keys of its softmax and one per micro-kernel
  // call of its P·V); the loads find them there. Into L1 (prefetcht0), each
  // prefetch held one of L1's few miss buffers for a trip to memory and the
  // kernel stalled on them; in a (B, S, H_kv, E) cache a head's rows are
  // 4 KiB apart, in the same L1 sets, and were evicted before their use. On
  // Zen 4 (2 threads, E=128 GQA cache, one process alternating the choices,
  // caches flushed before each call): into L2 one (head, block) ahead read
  // 21.3-21.8 GB/s of K/V at S=32768 and 14.8-16.8 at 4096, into L2 two
  // ahead and into L1 one ahead (the choice before) 18.4-19.2 and 13.0-15.3,
  // into L2 two or three ahead 20.7-21.7 and 14.4-16.5; the AVX2 path alike.
  void queue_next_head_block(int64_t h, int64_t panels, int64_t k0, int64_t kv_end,
                             int64_t rows, int64_t o0, bool keys_transposed) {
    const bool last_head = h + 1 == panels;
    const int64_t o = panel_of(o0, h).o;
    const Panel next = panel_of(o0, last_head ? 0 : h + 1);
    const int64_t next_o = next.o;
    const int64_t next_k0 = last_head ? k0 + split_.block_kv : k0;
    const int64_t next_cols = std::min(split_.block_kv, kv_end - next_k0);
    // (Not where the next head reads this one's rows: they are here already.)
    auto same_rows = [&](Tiles::KeySide side) {
      return tiles_.key_source(side, next_o, next_k0) == tiles_.key_source(side, o, k0);
    };
    if (next_cols > 0 && !same_rows(Tiles::KeySide::K)) {
      tiles_.queue_key_rows(prefetch_, Tiles::KeySide::K, next_o, next_k0, next_cols, p_.dim_qk);
    }
    if (next_cols > 0 && !same_rows(Tiles::KeySide::V)) {
      tiles_.queue_key_rows(prefetch_, Tiles::KeySide::V, next_o, next_k0, next_cols, p_.dim_v);
    }
    // (A key padding row that every head shares: once per block.)
    const bool shared_row = p_.mask.row_stride == 0 &&
                            (p_.outer.dims == 0 || p_.mask.outer_stride[p_.outer.dims - 1] == 0);
    if (next_cols > 0 && p_.mask_kind != MaskKind::None && (last_head || !shared_row)) {
      tiles_.queue_mask_tile(prefetch_, next.o, next.q0, next.rows(), next_k0, next_cols);
    }
    const int64_t cols = std::min(split_.block_kv, kv_end - k0);
    prefetch_.pace(tiles_.few_row_bursts(cols, rows, keys_transposed) +
                   div_up(cols, kSoftmaxKeysPerBurst) +
                   ws_.dv / nr * div_up(rows, kMicroRows));
  }

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
  int64_t chunk_length(int64_t len_kv) const {
    return round_up(std::max(div_up(std::max<int64_t>(len_kv, 1), split_.kv_splits), kMinChunkKeys),
                    split_.block_kv);
  }
  // Chunk c's partial state of panel h of group g (partial_rows).
  acc_t* partial(int64_t g, int64_t c, int64_t h) const {
    const int64_t record = partial_rows(split_, call_.len_q) * (2 + ws_.dv);
    return static_cast<acc_t*>(split_.partials) +
           ((g * split_.kv_splits + c) * panel_count(split_) + h) * record;
  }

  // Decoding: an item's panel, one score tile's rows: per_head rows (from
  // q0) of each of heads o..o+heads-1, packed as one head's.
  struct Panel {
    int64_t o, q0, per_head, heads;
    int64_t rows() const { return per_head * heads; }
  };
  // Panel h of the item: its heads in runs of split_.merged, or each head's
  // rows in split_.row_splits runs of panel_step (the last ones of a shorter
  // sequence may have fewer rows, or none).
  Panel panel_of(int64_t o0, int64_t h) const {
    if (split_.row_splits == 1) return {o0 + h * split_.merged, 0, p_.len_q, split_.merged};
    const int64_t step = panel_step(split_, call_.len_q);
    const int64_t q0 = h % split_.row_splits * step;
    return {o0 + h / split_.row_splits, q0, std::clamp<int64_t>(p_.len_q - q0, 0, step), 1};
  }

  // Decoding: starts panel h of the item (state h): the scaled queries of
  // its heads side by side, and each head's rows with its own sink (only
  // chunk 0 has it).
  void start_panel(const Panel& pn, int64_t bq, int64_t chunk, int64_t h) {
    const int64_t rows = pn.rows(), per_head = pn.per_head;
    const RowState<acc_t> st = head_state(h, bq);
    if (rows > 0) {
      const int64_t lanes = Tiles::few_row_lanes(rows);
      for (int64_t m = 0; m < pn.heads; ++m) {
        // (The last head's call zeroes the panel's lanes past its rows.)
        const int64_t padded = m + 1 == pn.heads ? lanes - m * per_head : per_head;
        tiles_.pack_transposed(p_.q, pn.o + m, pn.q0, per_head, padded, p_.dim_qk,
                               static_cast<acc_t>(p_.scale), head_rows(h, bq) + m * per_head,
                               lanes);
      }
    }
    start_rows(pn.o, rows, bq, /*with_sink=*/chunk == 0, st);
    if (chunk != 0 || !has_sinks(p_)) return;
    for (int64_t m = 1; m < pn.heads; ++m) {
      std::fill_n(st.m + m * per_head, per_head, static_cast<acc_t>(sink_logit(p_, pn.o + m)));
    }
  }

  // Decoding: writes panel pn's rows out of its state st.
  void write_panel(const Panel& pn, const RowState<acc_t>& st) {
    for (int64_t m = 0; m < pn.heads; ++m) {
      const int64_t r = m * pn.per_head;
      write_output(pn.o + m, pn.q0, pn.per_head,
                   {st.m + r, st.l + r, st.alpha + r, st.o + r * ws_.dv});
    }
  }

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
  using Tiles = TileReader<scalar_t, acc_t>;

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

// Heads per item: with a mask that every head shares (mask_shared_by_heads),
// as many heads of a batch index as keep their states within kHeadsBytes
// (half of a typical per-core L2), so that each mask tile is read and
// transposed once for them; else 1.
constexpr int64_t kHeadsBytes = 1024 * 1024;
template <typename acc_t>
int64_t heads_sharing_mask(const AttentionParams& p) {
  if (p.seq.on() || !mask_shared_by_heads(p)) return 1;
  const int64_t h = p.outer.size[p.outer.dims - 1];
  if (h <= 1) return 1;  // (no heads: the divisions below need one)
  constexpr int64_t nr = panel_width<acc_t>();
  const int64_t rows = kMaskBlockQ;
  const int64_t per_head = static_cast<int64_t>(sizeof(acc_t)) *
                           (rows * p.dim_qk + 3 * rows + rows * round_up(p.dim_v, nr));
  int64_t heads = std::clamp<int64_t>(kHeadsBytes / std::max<int64_t>(per_head, 1), 1, h);
  while (h % heads != 0) --heads;
  return heads;
}

// Whether a block of kLongBlockQ query rows fits this CPU's L2 together
// with one key block: its state (queries, max/sum/alpha, output) is read
// once per key block, and the key block by each of its query panels. Then
// each key block, transposed and packed once, serves twice the queries of
// kMaxBlockQ, and each head's K/V stream through the caches half as often
// (at L=S=4096, E=64 on Zen 3's 512 KiB L2: 5–7% faster).
template <typename acc_t>
bool long_block_fits(const AttentionParams& p) {
  constexpr int64_t nr = panel_width<acc_t>();
  const int64_t dv = round_up(p.dim_v, nr);
  const int64_t state = kLongBlockQ * (p.dim_qk + 3 + dv);
  const int64_t key_block = kBlockKV * (p.dim_qk + dv);
  return static_cast<int64_t>(sizeof(acc_t)) * (state + key_block) <= l2_cache_bytes();
}

// Decoding's key blocks: as many keys (a multiple of 8, at most kBlockKV)
// as keep a (head, block)'s K and V within L1d, where the kernel prefetches
// them. In a (B, S, H_kv, E) cache a head's rows are often 4 KiB apart, all
// in the same L1 sets, and larger blocks are evicted before their use. On
// Zen 3 (32 KiB L1d; E=128 fp32, 32k GQA cache, interleaved in one
// process): 32-key blocks read that layout 4–13% faster than 64, and
// (B, H_kv, S, E) as fast; 16-key blocks were no faster than 32 there and
// up to 5% slower on (B, H_kv, S, E).
template <typename acc_t>
int64_t decode_block(const AttentionParams& p) {
  const int64_t key_bytes = static_cast<int64_t>(sizeof(acc_t)) * (p.dim_qk + p.dim_v);
  const int64_t keys = l1d_cache_bytes() / std::max<int64_t>(key_bytes, 1) / 8 * 8;
  return std::clamp<int64_t>(keys, 8, kBlockKV);
}

// The greatest common divisor of a, b >= 0, as std::gcd's. (Not std::gcd
// itself: a build that does not inline it emits it as a weak symbol in each
// ISA's objects, which the linker may share with baseline callers; see
// cmake/CheckNoSharedSymbols.cmake.)
int64_t common_divisor(int64_t a, int64_t b) {
  while (b != 0) a = std::exchange(b, a % b);
  return a;
}

// Of the last outer dim's indices (decoding's heads), how many in a row
// read the same rows of m (p.k or p.v): the query heads of a K/V head where
// they are not read as rows of one item, all of them where m has a single
// head.
int64_t heads_sharing(const AttentionParams& p, const Matrix& m) {
  if (p.outer.dims == 0) return 1;
  const int d = p.outer.dims - 1;
  return m.outer_stride[d] == 0 ? p.outer.size[d] : m.divisor[d];
}

// Runs of heads that an item keeps together: each K head's and each V
// head's readers are within one run.
int64_t heads_sharing_kv(const AttentionParams& p) {
  const int64_t k = heads_sharing(p, p.k), v = heads_sharing(p, p.v);
  return k == 0 || v == 0 ? 0 : k / common_divisor(k, v) * v;  // (0: an empty dim)
}

template <typename acc_t>
WorkSplit configure(const AttentionParams& p, int64_t threads) {
  constexpr int64_t nr = panel_width<acc_t>();
  WorkSplit split;
  split.heads = heads_sharing_mask<acc_t>(p);
  const bool mask_rows =
      p.mask_kind != MaskKind::None && p.mask.row_stride != 0 && p.dim_qk <= kMaskBlockMaxDim;
  split.block_q = band_block(
      p, std::min(work_block(p.len_q, p.num_outer / split.heads, threads, nr,
                             split.heads > 1 || mask_rows ? kMaskBlockQ
                             : long_block_fits<acc_t>(p)  ? kLongBlockQ
                                                          : kMaxBlockQ),
                  round_up(std::max<int64_t>(p.len_q, 1), nr)),
      nr);
  split.block_kv = paged_block(p, std::min(kBlockKV, std::max<int64_t>(p.len_kv, 1)));
  split.items = p.num_outer / split.heads * div_up(p.len_q, split.block_q);
  split.threads = std::max<int64_t>(threads, 1);
  // Decoding: few query rows (one block) against long keys.
  const bool few_queries = p.len_q <= decode_rows<acc_t>() ||
                           (p.len_q <= kMostDecodeQueries && p.len_kv >= kMinRowSplitKeys);
  if (p.len_q > 0 && few_queries && p.softcap == 0 && !p.dropout.on() &&
      p.len_kv >= kMinChunkBlocks * split.block_kv) {
    split.decode = true;
    split.row_splits = div_up(p.len_q, decode_rows<acc_t>());
    split.block_kv = paged_block(p, decode_block<acc_t>(p));
    // The heads of a sequence (packed batches), else of the last outer dim.
    split.heads = std::max<int64_t>(
        p.seq.on() ? p.seq.heads : (p.outer.dims ? p.outer.size[p.outer.dims - 1] : 1), 1);
    // Fewer heads per item, the most that still give every thread about two
    // items: where each head's keys are rows of their own ((B, H_kv, S, E),
    // not a cache's (B, S, H_kv, E) rows of all heads), so that the keys need
    // fewer splits and merges (none where there are heads enough) and each
    // item streams fewer K/V regions; and in any layout where the chunks of
    // the keys alone (groups × len_kv / kMinChunkKeys) would leave a thread
    // idle. Always a multiple of the heads that read the same K/V rows, which
    // then still stream in once. (Zen 4, 2 threads, one query over an E=128
    // GQA cache with 8 K/V heads, caches flushed, medians of alternating
    // rounds: (B, H_kv, S, E) with 2 heads per item, not 8 over a quarter of
    // the keys, 5% faster at S=1024 and 3% at 4096 and 32768; a
    // (B, S, H_kv, E) cache of 256 or 384 keys 25-40% faster.)
    const bool own_rows = p.k.row_stride == p.dim_qk && p.v.row_stride == p.dim_v;
    // (A split costs a merge pass: only chunks of kMinChunkKeys or more.)
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
    // block reads all of: 64 queries of 32 heads (E=128, fp32) hold 2 MiB.
    // The most heads that fit. (Zen 4, 1 MiB L2, H=32 over H_kv=8, a
    // (B, S, H_kv, E) cache, alternating in one process: 16 heads per item
    // at 32 queries per head and 8 at 64, not 32, 3-6% faster at S=4096 and
    // 32768; half of L2 as the bound, 8 and 4 heads, 2-5%.)
    const int64_t state_per_head = static_cast<int64_t>(sizeof(acc_t)) * p.len_q *
                                   (p.dim_qk + round_up(p.dim_v, nr) + 3);
    for (int64_t all = split.heads, h = all - 1, share = std::max<int64_t>(heads_sharing_kv(p), 1);
         h >= share && split.heads * state_per_head > l2_cache_bytes(); --h) {
      if (all % h == 0 && h % share == 0) split.heads = h;
    }
    // With key spans, items of one batch index each where the K/V rows
    // allow: an item reads the union of its heads' keys, and batch indices
    // (the last outer dim where each has one query head, or one K/V head of
    // packed query heads) pad theirs apart.
    if (p.key_spans) {
      const int64_t heads = common_divisor(split.heads, p.key_spans_group);
      if (heads % std::max<int64_t>(heads_sharing_kv(p), 1) == 0) split.heads = heads;
    }
    // Several query rows per head (speculative decoding's drafts): the rows
    // of as many heads of a K/V head as fit decode_rows() share each score
    // tile, so that the softmax and P·V work on up to 16 rows at a time, not 2-4,
    // and each block's keys serve fewer, deeper tiles. (The band is applied
    // per head's rows; ALiBi and masks, which tell heads or rows apart
    // otherwise, keep one head per tile. Zen 4, E=128, H=32 over H_kv=8,
    // S=4096, caches flushed: 2 queries per head 1.6-1.8x faster, 3 queries
    // 1.4x, 4 queries 1.1x; on AVX2 1.6x, 1.5x and 1.4x.)
    if (p.len_q > 1 && p.mask_kind == MaskKind::None && !p.alibi_slopes.data) {
      // (Of the item's heads, those that read the same K rows, the same V
      // rows (K and V may have different head counts, or one broadcast) and,
      // with key spans, the same span: where the last outer dim is not
      // the heads (one query head), it may be sequences with keys of their
      // own.)
      const int64_t same_kv = common_divisor(heads_sharing(p, p.k), heads_sharing(p, p.v));
      int64_t share = common_divisor(same_kv, split.heads);
      if (p.key_spans) share = common_divisor(share, p.key_spans_group);
      int64_t merged = std::min(share, decode_rows<acc_t>() / p.len_q);
      while (merged > 1 && share % merged != 0) --merged;
      split.merged = std::max<int64_t>(merged, 1);
    }
    const int64_t groups = p.num_outer / split.heads;
    // Enough chunks that every thread gets about two items.
    split.kv_splits =
        std::clamp<int64_t>(div_up(2 * threads, std::max<int64_t>(groups, 1)), 1, max_chunks);
    // Whole rounds: more items than threads, in a number the threads divide
    // where fewer chunks give one. (3 chunks of one group's keys on 2 threads
    // left a third of the work to one thread alone: Zen 4, one query, H=32
    // over H_kv=8, E=128, a (B, S, H_kv, E) cache, caches flushed, 2 chunks
    // for 3: 1.10-1.16x at 1000 keys, 1.05x at 768.)
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
  Arena<acc_t> counter(nullptr);
  ForwardWorkspace<acc_t> sizing(p, split, counter);
  split.workspace_bytes = counter.bytes();
  if (split.kv_splits > 1) {
    split.partial_bytes = sizeof(acc_t) * split.items * panel_count(split) *
                          partial_rows(split, p.len_q) * (2 + sizing.dv);
  }
  return split;
}

}  // namespace

WorkSplit forward_configure(const AttentionParams& p, int64_t threads) {
  return p.dtype == DType::Float64 ? configure<double>(p, threads) : configure<float>(p, threads);
}

void forward_item(const AttentionParams& p, const WorkSplit& split, int64_t item,
                  void* workspace) {
  run_item_for_dtype<ForwardKernel>(p.dtype, p, split, item, workspace);
}

int64_t forward_decode_rows(bool float64) {
  return float64 ? decode_rows<double>() : decode_rows<float>();
}

void forward_combine(const AttentionParams& p, const WorkSplit& split, int64_t group,
                     void* workspace) {
  with_kernel_for_dtype<ForwardKernel>(p.dtype, p, split, workspace,
                                       [&](auto& k) { k.combine(group); });
}

}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
