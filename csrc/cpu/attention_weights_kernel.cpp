// The attention weights pass on the CPU, compiled once per ISA level: the
// probabilities P = exp(scale·Q·Kᵀ + mask − lse) recomputed tile by tile
// from the forward's log-sum-exp, dropout applied with the forward's stream,
// and written out (optionally averaged over heads). This is what
// MultiheadAttention's need_weights=True returns; the output itself stays
// with the fused forward.
//
// One work item = one (batch index, block of query rows) when averaging
// over heads (the heads are summed in a register-friendly tile before one
// write), else one (batch·head, block of query rows). Tiles are held
// transposed, Sᵀ (keys × queries), as in the forward, so the same tile
// reader, masks and dropout code apply.

#include "cpu/kernel_scratch.h"
#include "cpu/score_tiles.h"

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

// Scratch of one thread.
template <typename acc_t>
struct WeightsWorkspace {
  acc_t* qt;   // bq × dqk    scaled Qᵀ in panels of nr queries
  acc_t* st;   // bkv × bq    scores, then probabilities, transposed
  acc_t* acc;  // bkv × bq    sum over the item's heads
  acc_t* k;    // bkv × dqk   widened key block (half-precision inputs)
  acc_t* mt;   // w × bkv     mask terms of w queries (general masks)
  acc_t* dm;   // bkv × bq    dropout factors (when dropout is on)
  acc_t* lse;  // bq          log-sum-exp of the block's queries (+inf in padded lanes)

  WeightsWorkspace(const WeightsParams& wp, const WorkSplit& split, Arena<acc_t>& arena) {
    constexpr int64_t nr = panel_width<acc_t>(), w = Vectorized<acc_t>::size();
    const AttentionParams& p = wp.fwd;
    const int64_t bq = split.block_q, bkv = split.block_kv;
    qt = arena.take(bq * p.dim_qk);
    st = arena.take(bkv * bq);
    acc = arena.take(bkv * bq);
    k = arena.take(bkv * round_up(p.dim_qk, nr));
    mt = arena.take(w * round_up(bkv, w));
    dm = p.dropout.on() ? arena.take(bkv * bq) : nullptr;
    lse = arena.take(bq);
  }
};

template <typename scalar_t, typename acc_t>
class WeightsKernel {
 public:
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t nr = panel_width<acc_t>();
  static constexpr int64_t w = Vec::size();

  WeightsKernel(const WeightsParams& wp, const WorkSplit& split, Arena<acc_t> arena)
      : wp_(wp), p_(wp.fwd), split_(split), tiles_(wp.fwd), ws_(wp, split, arena) {}

  void run(int64_t item) {
    const int64_t nqb = div_up(p_.len_q, split_.block_q);
    const int64_t group = item / nqb;  // output matrix
    const int64_t q0 = (item % nqb) * split_.block_q;
    const int64_t rows = std::min(split_.block_q, p_.len_q - q0);
    const int64_t bq = round_up(rows, nr);
    const int64_t heads = wp_.heads_per_item;
    const acc_t head_weight = acc_t(1) / static_cast<acc_t>(heads);
    scalar_t* out = static_cast<scalar_t*>(wp_.weights) + (group * p_.len_q + q0) * p_.len_kv;

    for (int64_t k0 = 0; k0 < p_.len_kv; k0 += split_.block_kv) {
      const int64_t cols = std::min(split_.block_kv, p_.len_kv - k0);
      std::fill(ws_.acc, ws_.acc + cols * bq, acc_t(0));
      // A head's key block outside the block's band (causal, sliding window),
      // or whose mask tiles hide every key, adds 0.
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t o = group * heads + h;
        const auto [kv_begin, kv_end] = tiles_.key_range(o, q0, rows);
        const uint8_t tiles = mask_tiles_over(p_, o, q0, rows, k0, cols);
        if (k0 >= kv_end || k0 + cols <= kv_begin || tiles == kTileHidden) continue;
        add_head_tile(o, q0, rows, bq, k0, cols, head_weight, tiles == kTileVisible);
      }
      for (int64_t i = 0; i < rows; ++i) {
        scalar_t* dst = out + i * p_.len_kv + k0;
        for (int64_t j = 0; j < cols; ++j) dst[j] = static_cast<scalar_t>(ws_.acc[j * bq + i]);
      }
    }
  }

 private:
  using Tiles = ScoreTiles<scalar_t, acc_t>;

  // acc += weight · P(o) over the tile (keys k0.., queries q0..); without_mask: its
  // mask tiles hide no key.
  void add_head_tile(int64_t o, int64_t q0, int64_t rows, int64_t bq, int64_t k0, int64_t cols,
                     acc_t weight, bool without_mask) {
    // Q and lse are packed once per (head, query block) when the item has one
    // head; when averaging over heads, once per key block and head (1/block_kv
    // of the score GEMM's work), which keeps the scratch independent of H.
    if (o != packed_o_ || q0 != packed_q0_) {
      tiles_.pack_transposed(p_.q, o, q0, rows, bq, p_.dim_qk, static_cast<acc_t>(p_.scale),
                             ws_.qt);
      const auto lse = lse_rows<const acc_t>(p_, p_.lse, o);
      for (int64_t i = 0; i < rows; ++i) ws_.lse[i] = lse[q0 + i];
      std::fill(ws_.lse + rows, ws_.lse + bq, std::numeric_limits<acc_t>::infinity());
      packed_o_ = o;
      packed_q0_ = q0;
    }

    int64_t ldk;
    const acc_t* k = tiles_.key_rows_of(Tiles::KeySide::K, o, k0, cols, p_.dim_qk, false, ws_.k,
                                               &ldk);
    tiles_.scores(k, ldk, cols, ws_.qt, bq, ws_.st);
    tiles_.transform_scores(o, q0, rows, bq, k0, cols, ws_.st, ws_.mt, nullptr, without_mask);
    if (p_.dropout.on()) tiles_.dropout_factors(o, q0, rows, bq, k0, cols, ws_.dm);

    // exp(s − lse): a masked score (−inf) or a row with nothing to attend
    // to (lse = +inf) gives 0, a NaN row stays NaN.
    const Vec vweight(weight);
    for (int64_t j = 0; j < cols; ++j) {
      const acc_t* s = ws_.st + j * bq;
      acc_t* a = ws_.acc + j * bq;
      const acc_t* d = ws_.dm ? ws_.dm + j * bq : nullptr;
      for (int64_t c = 0; c < bq; c += w) {
        Vec prob = exp_of_difference(Vec::loadu(s + c), Vec::loadu(ws_.lse + c)) * vweight;
        if (d) prob = prob * Vec::loadu(d + c);
        (Vec::loadu(a + c) + prob).store(a + c);
      }
    }
  }

  const WeightsParams& wp_;
  const AttentionParams& p_;
  const WorkSplit& split_;
  Tiles tiles_;
  WeightsWorkspace<acc_t> ws_;
  int64_t packed_o_ = -1, packed_q0_ = -1;  // what ws_.qt and ws_.lse hold
};

}  // namespace

void weights_scratch(const WeightsParams& wp, WorkSplit& split) {
  split.workspace_bytes = workspace_bytes<WeightsWorkspace>(wp.fwd.dtype, wp, split);
}

void weights_item(const WeightsParams& wp, const WorkSplit& split, int64_t item,
                  void* workspace) {
  run_item_for_dtype<WeightsKernel>(wp.fwd.dtype, wp, split, item, workspace);
}

}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
