// The tensor-core forward's and backward's mask tiles
// (AttentionParams::mask_tiles), run on the CPU through cuda/emulation.h: a
// tile of the scores that the mask tiles hide whole is not visited, and one
// they show whole takes no mask.
//
// Each case runs the kernels twice: once with a document-like bool mask and
// no tiles, once with that mask's tiles and a copy of the mask scrambled
// wherever the tiles the kernels visit are uniform (hidden elements set to
// seen, seen elements to hidden). The kernels read neither, so both runs' outputs and
// gradients agree bit for bit; kernels that read them would differ.
// test_cuda_emulated.cpp checks the mask path itself against float64.

#include "cuda/flash_backward.cuh"
#include "cuda/flash_config.h"
#include "cuda/flash_forward.cuh"
#include "cuda_emulated_matrix.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace fusedmha::cuda {
namespace {

struct Case {
  int B, H, L, S;
  bool causal;
  int window_left;  // -1: none
  double dropout;
};

// The call's shape, band and mask tiles (from the (B, tq, tk) states where
// given, heads broadcast): what decides the tiles the kernels visit.
AttentionParams params_of(const Case& c, std::vector<uint8_t>* tiles) {
  AttentionParams p;
  p.dtype = DType::Float16;
  p.outer.dims = 2;
  p.outer.size[0] = c.B;
  p.outer.size[1] = c.H;
  p.num_outer = int64_t(c.B) * c.H;
  p.len_q = c.L;
  p.len_kv = c.S;
  p.window_left = c.window_left;
  p.window_right = c.causal ? 0 : -1;
  const int tq = (c.L + kMaskTileRows - 1) / kMaskTileRows;
  const int tk = (c.S + kMaskTileKeys - 1) / kMaskTileKeys;
  if (tiles) {
    p.mask_tiles = dense(*tiles, 1, tq, tk);
    p.mask_tiles.outer_stride[1] = 0;
  }
  return p;
}

// The mask elements (B, L, S) either kernel reads given the tiles: those of
// the tiles of 64 queries × 64 keys it visits (the forward's key tiles from
// each query tile's band start, the backward's query tiles from each key
// tile's) whose mask tiles mix states.
std::vector<bool> read_by_kernels(const Case& c, std::vector<uint8_t>& tiles) {
  const AttentionParams p = params_of(c, &tiles);
  std::vector<bool> read(size_t(c.B) * c.L * c.S, false);
  auto visit = [&](int b, int64_t q0, int64_t k0) {
    const int64_t rows = std::min<int64_t>(64, c.L - q0), cols = std::min<int64_t>(64, c.S - k0);
    if (mask_tiles_over(p, int64_t(b) * c.H, q0, rows, k0, cols) != kTileMixed) return;
    for (int64_t i = q0; i < q0 + rows; ++i) {
      for (int64_t j = k0; j < k0 + cols; ++j) read[(size_t(b) * c.L + i) * c.S + j] = true;
    }
  };
  for (int b = 0; b < c.B; ++b) {
    for (int64_t q0 = 0; q0 < c.L; q0 += flash_fwd::kBlockQ) {
      const int64_t end = band_key_end(p, std::min<int64_t>(q0 + flash_fwd::kBlockQ, c.L));
      for (int64_t k0 = band_key_begin(p, q0); k0 < end; k0 += flash_fwd::kBlockKV) visit(b, q0, k0);
    }
    for (int64_t k0 = 0; k0 < c.S; k0 += flash_bwd::kBlockKV) {
      const int64_t end = band_query_end(p, std::min<int64_t>(k0 + flash_bwd::kBlockKV, c.S));
      for (int64_t q0 = band_query_begin(p, k0) / flash_bwd::kBlockQ * flash_bwd::kBlockQ;
           q0 < end; q0 += flash_bwd::kBlockQ) {
        visit(b, q0, k0);
      }
    }
  }
  return read;
}

// The forward's output and lse, then the backward's dQ, dK and dV (from dO
// and any delta: the two runs compared take the same).
std::vector<float> run(const Case& c, std::vector<__half>& q, std::vector<__half>& k,
                       std::vector<__half>& v, std::vector<__half>& dout, std::vector<float>& delta,
                       std::vector<unsigned char>& mask, std::vector<uint8_t>* tiles) {
  constexpr int E = 64;
  AttentionParams p = params_of(c, tiles);
  p.dim_qk = p.dim_v = E;
  p.q = dense(q, c.H, c.L, E);
  p.k = dense(k, c.H, c.S, E);
  p.v = dense(v, c.H, c.S, E);
  p.scale = 0.125;
  p.mask_kind = MaskKind::Bool;
  p.mask = dense(mask, 1, c.L, c.S);  // (B, 1, L, S): heads broadcast
  p.mask.outer_stride[1] = 0;
  int64_t rng_state[2];
  if (c.dropout > 0) {
    p.dropout.p = c.dropout;
    p.dropout.threshold = dropout_threshold(c.dropout);
    p.dropout.seed = 7;
  }
  p.dropout.state_out = rng_state;
  std::vector<__half> out(size_t(c.B) * c.H * c.L * E);
  std::vector<float> lse(size_t(c.B) * c.H * c.L);
  p.out = dense(out, c.H, c.L, E);
  p.lse = dense(lse, c.H, c.L, 1);
  const unsigned q_blocks =
      unsigned((c.L + flash_fwd::kBlockQ - 1) / flash_fwd::kBlockQ * p.num_outer);
  emulation::launch(q_blocks, flash_fwd::kThreads, flash_fwd::smem_bytes(E),
                    [&] { flash_fwd::kernel<__half, E>(p); });

  BackwardParams bp;
  bp.fwd = p;
  bp.fwd.dropout.state_out = nullptr;
  bp.fwd.dropout.state_in = c.dropout > 0 ? rng_state : nullptr;
  bp.grad_out = dense(dout, c.H, c.L, E);
  bp.delta = dense(delta, c.H, c.L, 1);
  std::vector<float> grad_q(q.size(), 0.0f), grad_k(k.size()), grad_v(v.size());
  bp.grad_q = dense(grad_q, c.H, c.L, E);
  bp.grad_k = dense(grad_k, c.H, c.S, E);
  bp.grad_v = dense(grad_v, c.H, c.S, E);
  const unsigned kv_blocks =
      unsigned((c.S + flash_bwd::kBlockKV - 1) / flash_bwd::kBlockKV * p.num_outer);
  emulation::launch(kv_blocks, flash_bwd::kThreads, flash_bwd::smem_bytes(E),
                    [&] { flash_bwd::kernel<__half, E>(bp); });

  std::vector<float> all(lse);
  for (const __half x : out) all.push_back(__half2float(x));
  for (const auto* g : {&grad_q, &grad_k, &grad_v}) all.insert(all.end(), g->begin(), g->end());
  return all;
}

TEST(CudaMaskTiles, ForwardAndBackwardSkipHiddenTilesAndUnmaskSeenOnes) {
  for (const Case c : {Case{2, 2, 150, 330, false, -1, 0.0}, Case{1, 2, 200, 260, true, -1, 0.2},
                       Case{1, 1, 70, 64 * 6, false, -1, 0.0}, Case{1, 2, 190, 300, true, 90, 0.0}}) {
    std::mt19937 rng(c.L + c.S);
    std::normal_distribution<float> normal;
    auto filled = [&](size_t n) {
      std::vector<__half> x(n);
      for (auto& e : x) e = __float2half(normal(rng));
      return x;
    };
    std::vector<__half> q = filled(size_t(c.B) * c.H * c.L * 64);
    std::vector<__half> k = filled(size_t(c.B) * c.H * c.S * 64), v = filled(k.size());
    std::vector<__half> dout = filled(q.size());
    std::vector<float> delta(size_t(c.B) * c.H * c.L);
    for (auto& d : delta) d = normal(rng);
    // Documents over whole mask tiles, each batch index its own, some
    // mixed: even key tiles by 64 rows, odd ones by 32 (where a kernel's
    // tile of 64 rows combines two kinds); rows 64–127 see nothing.
    std::bernoulli_distribution coin(0.5);
    const int tq = (c.L + kMaskTileRows - 1) / kMaskTileRows;
    const int tk = (c.S + kMaskTileKeys - 1) / kMaskTileKeys;
    std::vector<unsigned char> mask(size_t(c.B) * c.L * c.S);
    std::vector<uint8_t> tiles(size_t(c.B) * tq * tk, 0);
    for (size_t n = 0; n < mask.size(); ++n) {
      const int b = int(n / (size_t(c.L) * c.S)), i = int(n / c.S % c.L), j = int(n % c.S);
      const int key_tile = j / kMaskTileKeys, rows = key_tile % 2 ? i / 32 : i / 64;
      const int kind = (rows + key_tile + b) % 3;
      mask[n] = i / 64 == 1 ? 0 : kind == 0 ? 1 : kind == 1 ? 0 : coin(rng);
      tiles[(size_t(b) * tq + i / kMaskTileRows) * tk + j / kMaskTileKeys] |=
          mask[n] ? kTileVisible : kTileHidden;
    }
    // Scrambled wherever neither kernel reads the mask.
    const std::vector<bool> read = read_by_kernels(c, tiles);
    std::vector<unsigned char> scrambled = mask;
    size_t changed = 0;
    for (size_t n = 0; n < mask.size(); ++n) {
      if (!read[n]) scrambled[n] = !mask[n], ++changed;
    }
    ASSERT_GT(changed, mask.size() / 8);
    const std::vector<float> expected = run(c, q, k, v, dout, delta, mask, nullptr);
    const std::vector<float> got = run(c, q, k, v, dout, delta, scrambled, &tiles);
    size_t differ = 0;
    for (size_t n = 0; n < got.size(); ++n) {
      differ += !(got[n] == expected[n] || (std::isnan(got[n]) && std::isnan(expected[n])));
    }
    EXPECT_EQ(differ, 0u) << "L=" << c.L << " S=" << c.S << " causal=" << c.causal
                          << " window_left=" << c.window_left;
  }
}

}  // namespace
}  // namespace fusedmha::cuda
