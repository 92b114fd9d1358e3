// FlexAttention from C++: create_block_mask against the mask it was built
// from, and flex_attention (output, lse, gradients) against float64
// attention with that dense mask.

#include <fusedmha/fusedmha.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "expect_error.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

// Causal attention within documents: query i sees key j <= i of its own
// document (doc ids per position, the same for queries and keys).
fusedmha::MaskMod document_causal(const at::Tensor& doc) {
  return [doc](const at::Tensor&, const at::Tensor&, const at::Tensor& q, const at::Tensor& kv) {
    return doc.index({q}).eq(doc.index({kv})).logical_and(kv <= q);
  };
}

// A mask that reads b and h: a window of 8 + 16·h keys, and batch 1 sees
// only even keys.
at::Tensor per_head_window(const at::Tensor& b, const at::Tensor& h, const at::Tensor& q,
                           const at::Tensor& kv) {
  const at::Tensor near = (q - kv).abs() <= h * 16 + 8;
  return near.logical_and(b.eq(0).logical_or(kv.remainder(2).eq(0)));
}

at::Tensor grid_mask(const fusedmha::MaskMod& mod, int64_t B, int64_t H, int64_t L, int64_t S) {
  const auto longs = at::TensorOptions().dtype(at::kLong);
  return mod(at::arange(B, longs).view({-1, 1, 1, 1}), at::arange(H, longs).view({1, -1, 1, 1}),
             at::arange(L, longs).view({1, 1, -1, 1}), at::arange(S, longs).view({1, 1, 1, -1}))
      .expand({B, H, L, S});
}

at::Tensor documents(int64_t length, std::vector<int64_t> ends) {
  at::Tensor doc = at::empty({length}, at::kLong);
  int64_t start = 0;
  for (int64_t d = 0; d < static_cast<int64_t>(ends.size()); ++d) {
    doc.narrow(0, start, ends[d] - start).fill_(d);
    start = ends[d];
  }
  return doc;
}

// Float64 attention with a bool mask (and a bias), written out: rows that
// see no key give 0 and lse -inf.
std::tuple<at::Tensor, at::Tensor> reference(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& mask,
                                             const std::optional<at::Tensor>& bias) {
  const int64_t group = q.size(1) / k.size(1);
  const at::Tensor kk = k.repeat_interleave(group, 1), vv = v.repeat_interleave(group, 1);
  at::Tensor s = at::matmul(q, kk.transpose(-1, -2)) / std::sqrt(double(q.size(-1)));
  if (bias) s = s + *bias;
  s = s.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  // (Softmax spelled out so that a row of -inf gives 0 and no NaN gradient.)
  at::Tensor top = s.amax(-1, true).detach();
  top = at::where(top.isneginf(), at::zeros_like(top), top);
  const at::Tensor e = (s - top).exp(), sum = e.sum(-1, true);
  const at::Tensor p = e / at::where(sum.eq(0), at::ones_like(sum), sum);
  return {at::matmul(p, vv), (sum.log() + top).squeeze(-1)};
}

}  // namespace

// Every block sorted as the mask makes it, the partial bits where they
// belong, and the dense mask equal to mask_mod over the grid, for block
// sizes that do not divide the lengths.
TEST(FlexBlockMask, CreateBlockMaskSortsBlocks) {
  const int64_t L = 300, S = 250;
  for (auto [QB, KB] : {std::pair<int64_t, int64_t>{64, 32}, {128, 128}, {16, 48}}) {
    const at::Tensor doc = documents(std::max(L, S), {70, 71, 200, 300});
    for (auto [B, H, mod] : {std::tuple<int64_t, int64_t, fusedmha::MaskMod>{
                                 1, 1, document_causal(doc)},
                             {2, 3, per_head_window}}) {
      const fusedmha::BlockMask m =
          fusedmha::create_block_mask(mod, B, H, L, S, {QB, KB, at::kCPU});
      const at::Tensor want = grid_mask(mod, B, H, L, S);
      EXPECT_TRUE(m.dense().equal(want)) << QB << "x" << KB;
      // Each block's state from the lists, against the mask itself.
      const int64_t nq = (L + QB - 1) / QB, nk = (S + KB - 1) / KB;
      ASSERT_EQ(m.kv_num_blocks.sizes(), (std::vector<int64_t>{B, H, nq}));
      int64_t partial = 0;
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t i = 0; i < nq; ++i) {
            std::vector<int> state(nk, 0);
            for (int64_t n = 0; n < m.kv_num_blocks[b][h][i].item<int64_t>(); ++n) {
              const int64_t j = m.kv_indices[b][h][i][n].item<int64_t>();
              state[j] = 1;
              const at::Tensor block = want[b][h]
                                           .narrow(0, i * QB, std::min(QB, L - i * QB))
                                           .narrow(1, j * KB, std::min(KB, S - j * KB));
              const at::Tensor bits = m.partial_bits[partial++]
                                          .narrow(0, 0, block.size(0))
                                          .narrow(1, 0, block.size(1));
              EXPECT_TRUE(bits.equal(block));
            }
            for (int64_t n = 0; n < (*m.full_kv_num_blocks)[b][h][i].item<int64_t>(); ++n) {
              state[(*m.full_kv_indices)[b][h][i][n].item<int64_t>()] = 2;
            }
            for (int64_t j = 0; j < nk; ++j) {
              const at::Tensor block = want[b][h]
                                           .narrow(0, i * QB, std::min(QB, L - i * QB))
                                           .narrow(1, j * KB, std::min(KB, S - j * KB));
              const int expected = block.all().item<bool>()   ? 2
                                   : block.any().item<bool>() ? 1
                                                              : 0;
              EXPECT_EQ(state[j], expected) << b << " " << h << " " << i << " " << j;
            }
          }
        }
      }
      EXPECT_EQ(partial, m.partial_bits.size(0));
    }
  }
}

// Keys enough that create_block_mask evaluates one query block at a time:
// the bands' partial blocks come back in list order (batch first).
TEST(FlexBlockMask, BandsKeepListOrder) {
  const int64_t B = 2, L = 256, S = int64_t{1} << 17;
  const fusedmha::BlockMask m = fusedmha::create_block_mask(per_head_window, B, 1, L, S);
  EXPECT_TRUE(m.dense().equal(grid_mask(per_head_window, B, 1, L, S)));
  EXPECT_EQ(m.partial_bits.size(0), m.kv_num_blocks.sum().item<int64_t>());
}

// The bits are read in list order whatever order the blocks are listed in,
// blocks listed as partial and full are full, and the dense mask is kept
// until a tensor changes in place.
TEST(FlexBlockMask, HandWrittenListsAndTheKeptMask) {
  fusedmha::BlockMask m;
  m.q_length = 4;
  m.kv_length = 6;
  m.q_block_size = 2;
  m.kv_block_size = 2;
  // Query block 0: partial key blocks 2 then 0; block 1: partial 1, full 1 and 2.
  m.kv_num_blocks = torch::tensor({2, 1}, at::kInt).view({1, 1, 2});
  m.kv_indices = torch::tensor({2, 0, 1, 0}, at::kInt).view({1, 1, 2, 2});
  m.full_kv_num_blocks = torch::tensor({0, 2}, at::kInt).view({1, 1, 2});
  m.full_kv_indices = torch::tensor({0, 0, 1, 2}, at::kInt).view({1, 1, 2, 2});
  m.partial_bits = torch::tensor({1, 0, 0, 0, /**/ 0, 1, 1, 1, /**/ 0, 0, 0, 0}, at::kBool)
                       .view({3, 2, 2});
  const at::Tensor want = torch::tensor({0, 1, 0, 0, 1, 0,  //
                                         1, 1, 0, 0, 0, 0,  //
                                         0, 0, 1, 1, 1, 1,  //
                                         0, 0, 1, 1, 1, 1},
                                        at::kBool)
                              .view({1, 1, 4, 6});
  const at::Tensor dense = m.dense();
  EXPECT_TRUE(dense.equal(want)) << dense;
  EXPECT_TRUE(m.dense().is_same(dense));
  // (flex_attention's copy of the mask shares what it keeps.)
  const std::optional<fusedmha::BlockMask> copy = m;
  EXPECT_TRUE(copy->dense().is_same(dense));
  m.partial_bits.zero_();
  EXPECT_FALSE(m.dense().is_same(dense));
  EXPECT_FALSE(m.dense()[0][0][0].any().item<bool>());
}

// Output, lse and the gradients of query, key, value and a bias against
// float64 attention with the dense mask: per-batch and per-head patterns,
// a shared document mask over a batch, GQA, L != S.
TEST(FlexAttention, MatchesDenseMaskForwardAndBackward) {
  torch::manual_seed(0);
  const at::Tensor doc = documents(200, {37, 38, 120, 200});
  struct Case {
    int64_t B, H, H_kv, L, S, mB, mH;
    fusedmha::MaskMod mod;
    bool bias;
  };
  for (const Case& c : {Case{2, 3, 3, 150, 140, 2, 3, per_head_window, false},
                        Case{2, 4, 2, 200, 200, 1, 1, document_causal(doc), true},
                        Case{1, 2, 1, 96, 160, 1, 2, per_head_window, true}}) {
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    const at::Tensor q = torch::randn({c.B, c.H, c.L, 16}, f64).requires_grad_();
    const at::Tensor k = torch::randn({c.B, c.H_kv, c.S, 16}, f64).requires_grad_();
    const at::Tensor v = torch::randn({c.B, c.H_kv, c.S, 8}, f64).requires_grad_();
    const at::Tensor bias = torch::randn({c.H, c.L, c.S}, f64).requires_grad_();
    const fusedmha::BlockMask m =
        fusedmha::create_block_mask(c.mod, c.mB, c.mH, c.L, c.S, {32, 64});
    fusedmha::FlexAttentionOptions options;
    options.enable_gqa = c.H != c.H_kv;
    if (c.bias) options.bias = bias;
    const auto [out, lse] = fusedmha::flex_attention(q, k, v, m, options);
    const at::Tensor mask = grid_mask(c.mod, c.mB, c.H, c.L, c.S);
    const auto [ref_out, ref_lse] =
        reference(q, k, v, mask, c.bias ? std::optional<at::Tensor>(bias) : std::nullopt);
    EXPECT_TRUE(torch::allclose(out, ref_out, 1e-10, 1e-10));
    EXPECT_TRUE(torch::allclose(lse, ref_lse, 1e-10, 1e-10, /*equal_nan=*/true));
    // (The first case's last rows see no key: 0 and -inf.)
    EXPECT_EQ(lse.isneginf().any().item<bool>(), c.L == 150);
    const at::Tensor g = torch::randn_like(out);
    const auto grads = torch::autograd::grad({out}, {q, k, v, bias}, {g}, true, false, true);
    const auto ref_grads =
        torch::autograd::grad({ref_out}, {q, k, v, bias}, {g}, true, false, true);
    for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(torch::allclose(grads[i], ref_grads[i], 1e-9, 1e-9));
    if (c.bias) {
      // (The reference's bias gradient is 0 where the mask hides a score.)
      EXPECT_TRUE(torch::allclose(grads[3], ref_grads[3], 1e-9, 1e-9));
    }
  }
}

// Dropout, softcap and sinks reach the kernels as through attention_forward.
TEST(FlexAttention, VariantsAndDropoutCompose) {
  const int64_t L = 130;
  const at::Tensor doc = documents(L, {50, 130});
  const fusedmha::BlockMask m = fusedmha::create_block_mask(document_causal(doc), 1, 1, L, L);
  const at::Tensor q = torch::randn({2, 2, L, 16}), k = torch::randn({2, 2, L, 16});
  const at::Tensor v = torch::randn({2, 2, L, 16});
  fusedmha::FlexAttentionOptions options;
  options.dropout_p = 0.25;
  options.variants.softcap = 5.0;
  options.variants.sinks = torch::randn({2});
  torch::manual_seed(7);
  const at::Tensor out = std::get<0>(fusedmha::flex_attention(q, k, v, m, options));
  torch::manual_seed(7);
  const at::Tensor want = std::get<0>(
      fusedmha::attention_forward(q, k, v, m.dense(), 0.25, false, std::nullopt, false,
                                  options.variants));
  EXPECT_TRUE(out.equal(want));
}

TEST(FlexAttention, ClearErrors) {
  const at::Tensor q = torch::randn({1, 2, 8, 4}), k = torch::randn({1, 2, 8, 4});
  const at::Tensor doc = documents(8, {8});
  const fusedmha::BlockMask m =
      fusedmha::create_block_mask(document_causal(doc), 1, 2, 8, 8, {4, 4});
  expect_error([&] { fusedmha::flex_attention(q, k.narrow(2, 0, 6), k.narrow(2, 0, 6), m); },
               "block_mask is for (L, S) = (8, 8), the inputs have (8, 6)");
  const fusedmha::BlockMask three =
      fusedmha::create_block_mask(document_causal(doc), 1, 3, 8, 8, {4, 4});
  expect_error([&] { fusedmha::flex_attention(q, k, k, three); }, "block_mask is for (B, H)");
  fusedmha::FlexAttentionOptions bad_bias;
  bad_bias.bias = torch::randn({3, 8, 8});
  expect_error([&] { fusedmha::flex_attention(q, k, k, m, bad_bias); },
               "does not broadcast to (B, H, L, S)");
  expect_error([&] { fusedmha::flex_attention(q, k.narrow(1, 0, 1), k.narrow(1, 0, 1), m); },
               "enable_gqa");
  fusedmha::BlockMask out_of_range = m;
  out_of_range.kv_indices = m.kv_indices.clone().fill_(5);
  expect_error([&] { out_of_range.dense(); }, "lists key blocks outside [0, 2)");
  fusedmha::BlockMask short_bits = m;
  short_bits.partial_bits = m.partial_bits.narrow(0, 0, m.partial_bits.size(0) - 1);
  expect_error([&] { short_bits.dense(); }, "expected partial_bits bool");
  fusedmha::BlockMask too_many = m;
  too_many.kv_num_blocks = m.kv_num_blocks.clone().fill_(9);
  expect_error([&] { too_many.dense(); }, "expected kv_num_blocks in [0, ");
  expect_error([&] { fusedmha::create_block_mask(per_head_window, 1, 1, 0, 8); },
               "expected B, H, q_length and kv_length > 0");
}

// Under InferenceMode (tensors without version counters) the mask is made
// and kept as anywhere else.
TEST(FlexAttention, InferenceMode) {
  c10::InferenceMode guard;
  const at::Tensor doc = documents(40, {10, 40});
  const fusedmha::BlockMask m =
      fusedmha::create_block_mask(document_causal(doc), 1, 1, 40, 40, {16, 16});
  const at::Tensor q = torch::randn({1, 2, 40, 8});
  const at::Tensor out = std::get<0>(fusedmha::flex_attention(q, q, q, m));
  const at::Tensor want = fusedmha::scaled_dot_product_attention(q, q, q, m.dense());
  EXPECT_TRUE(out.equal(want));
  EXPECT_TRUE(m.dense().is_same(m.dense()));
}

// Sizes at the edges: one query and key under blocks larger than both, an
// empty batch, no queries (a hand-made mask of no query blocks), every
// block empty (rows that see nothing: 0 and -inf).
TEST(FlexAttention, EdgeSizes) {
  const auto one = fusedmha::create_block_mask(per_head_window, 1, 1, 1, 1);
  const at::Tensor x = torch::randn({1, 1, 1, 8});
  EXPECT_TRUE(std::get<0>(fusedmha::flex_attention(x, x, x, one)).equal(x));
  const fusedmha::BlockMask m = fusedmha::create_block_mask(per_head_window, 1, 1, 5, 7);
  const at::Tensor k = torch::randn({0, 2, 7, 8});
  EXPECT_EQ(std::get<0>(fusedmha::flex_attention(torch::randn({0, 2, 5, 8}), k, k, m)).sizes(),
            (std::vector<int64_t>{0, 2, 5, 8}));
  fusedmha::BlockMask none;
  none.q_length = 0;
  none.kv_length = 7;
  none.kv_num_blocks = torch::zeros({1, 1, 0}, at::kInt);
  none.kv_indices = torch::zeros({1, 1, 0, 1}, at::kInt);
  none.partial_bits = torch::zeros({0, 128, 128}, at::kBool);
  const at::Tensor kv = torch::randn({1, 1, 7, 8});
  EXPECT_EQ(std::get<1>(fusedmha::flex_attention(torch::randn({1, 1, 0, 8}), kv, kv, none))
                .sizes(),
            (std::vector<int64_t>{1, 1, 0}));
  const fusedmha::BlockMask hidden = fusedmha::create_block_mask(
      [](const at::Tensor&, const at::Tensor&, const at::Tensor& q, const at::Tensor&) {
        return q < 0;
      },
      1, 1, 9, 7, {4, 4});
  EXPECT_EQ(hidden.kv_num_blocks.sum().item<int64_t>(), 0);
  const at::Tensor q = torch::randn({1, 1, 9, 8});
  const auto [out, lse] = fusedmha::flex_attention(q, kv, kv, hidden);
  EXPECT_TRUE(out.eq(0).all().item<bool>());
  EXPECT_TRUE(lse.isneginf().all().item<bool>());
}
