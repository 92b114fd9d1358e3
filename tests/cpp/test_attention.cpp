// The C++ API against ATen's own scaled_dot_product_attention.

#include <fusedmha/fusedmha.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "expect_error.h"
#include "ops/mask_tiles.h"

#include <array>
#include <string>

namespace {

using torch::indexing::Slice;

// Fused vs ATen in float64 (ATen's math path), compared at the input dtype's precision.
void expect_matches_aten(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask = std::nullopt,
                         bool is_causal = false, std::optional<double> scale = std::nullopt,
                         bool enable_gqa = false) {
  const at::Tensor out =
      fusedmha::scaled_dot_product_attention(q, k, v, mask, 0.0, is_causal, scale, enable_gqa);
  std::optional<at::Tensor> mask64 = mask;
  if (mask.has_value() && mask->is_floating_point()) mask64 = mask->to(at::kDouble);
  const at::Tensor ref = at::scaled_dot_product_attention(
      q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), mask64, 0.0, is_causal, scale,
      enable_gqa);
  ASSERT_EQ(out.sizes(), ref.sizes());
  ASSERT_EQ(out.scalar_type(), q.scalar_type());
  const double tol = q.scalar_type() == at::kDouble  ? 1e-12
                     : q.scalar_type() == at::kFloat ? 1e-5
                     : q.scalar_type() == at::kHalf  ? 4e-3
                                                     : 3e-2;
  EXPECT_TRUE(torch::allclose(out.to(at::kDouble), ref, tol, tol))
      << "max abs diff " << (out.to(at::kDouble) - ref).abs().max().item<double>();
}

}  // namespace

TEST(Dispatcher, OpsAreRegistered) {
  auto& d = c10::Dispatcher::singleton();
  const auto fwd = d.findSchema({"fusedmha::attention_forward", ""});
  ASSERT_TRUE(fwd.has_value());
  EXPECT_TRUE(fwd->hasKernelForDispatchKey(c10::DispatchKey::CPU));
  EXPECT_TRUE(fwd->hasKernelForDispatchKey(c10::DispatchKey::Meta));
  EXPECT_TRUE(fwd->hasKernelForDispatchKey(c10::DispatchKey::Autograd));
  EXPECT_TRUE(d.findSchema({"fusedmha::scaled_dot_product_attention", ""}).has_value());
}

TEST(Dispatcher, CallByName) {
  torch::manual_seed(0);
  auto q = torch::randn({2, 3, 17, 8});
  auto k = torch::randn({2, 3, 23, 8});
  auto v = torch::randn({2, 3, 23, 5});
  const auto op = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("fusedmha::scaled_dot_product_attention", "")
                      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const std::optional<at::Tensor>&, double, bool,
                                        std::optional<double>, bool, int64_t, int64_t, bool,
                                        double, const std::optional<at::Tensor>&,
                                        const std::optional<at::Tensor>&)>();
  const auto out = op.call(q, k, v, std::nullopt, 0.0, false, std::nullopt, false, -1, -1, false,
                           0.0, std::nullopt, std::nullopt);
  EXPECT_TRUE(torch::equal(out, fusedmha::scaled_dot_product_attention(q, k, v)));
}

TEST(Attention, Dtypes) {
  torch::manual_seed(0);
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto opts = torch::TensorOptions().dtype(dtype);
    expect_matches_aten(torch::randn({2, 3, 17, 64}, opts), torch::randn({2, 3, 23, 64}, opts),
                        torch::randn({2, 3, 23, 64}, opts));
  }
}

TEST(Attention, HeadDimsAndLengths) {
  torch::manual_seed(0);
  for (int64_t e : {1, 7, 64, 128, 256}) {
    for (auto [l, s] : {std::pair<int64_t, int64_t>{1, 1}, {1, 50}, {50, 1}, {130, 300}}) {
      SCOPED_TRACE("E=" + std::to_string(e) + " L=" + std::to_string(l) + " S=" + std::to_string(s));
      expect_matches_aten(torch::randn({2, 2, l, e}), torch::randn({2, 2, s, e}),
                          torch::randn({2, 2, s, e + 3}));
    }
  }
}

TEST(Attention, Causal) {
  torch::manual_seed(0);
  for (auto [l, s] : {std::pair<int64_t, int64_t>{64, 64}, {100, 37}, {37, 100}}) {
    expect_matches_aten(torch::randn({2, 4, l, 32}), torch::randn({2, 4, s, 32}),
                        torch::randn({2, 4, s, 32}), std::nullopt, /*is_causal=*/true);
  }
}

TEST(Attention, Masks) {
  torch::manual_seed(0);
  auto q = torch::randn({2, 4, 19, 16});
  auto k = torch::randn({2, 4, 23, 16});
  auto v = torch::randn({2, 4, 23, 16});
  for (auto shape : std::vector<std::vector<int64_t>>{{19, 23}, {1, 23}, {4, 19, 23}, {2, 1, 19, 23}}) {
    expect_matches_aten(q, k, v, torch::rand(shape) > 0.2);
    expect_matches_aten(q, k, v, torch::randn(shape));
  }
}

TEST(Attention, FullyMaskedRowIsZero) {
  torch::manual_seed(0);
  auto q = torch::randn({1, 2, 5, 8});
  auto k = torch::randn({1, 2, 7, 8});
  auto v = torch::randn({1, 2, 7, 8});
  auto mask = torch::ones({5, 7}, torch::kBool);
  mask.index_put_({2}, false);
  const auto out = fusedmha::scaled_dot_product_attention(q, k, v, mask);
  EXPECT_TRUE(torch::equal(out.index({Slice(), Slice(), 2}), torch::zeros({1, 2, 8})));
  EXPECT_FALSE(out.isnan().any().item<bool>());
}

// The tiles a CUDA bool mask takes (found with ATen ops, on the mask's
// device) equal the CPU's scan: broadcast batch, heads, rows or keys,
// lengths that are not multiples of the tiles; none for a float mask.
TEST(Attention, MaskTilesOnDeviceEqualTheScan) {
  torch::manual_seed(0);
  const int64_t L = 70, S = 200;
  const auto rows = torch::arange(L).view({L, 1}), keys = torch::arange(S).view({1, S});
  const auto document = (rows / 32) == (keys / 64);  // (whole tiles seen and hidden)
  const std::vector<torch::Tensor> masks = {
      document.view({1, 1, L, S}).expand({2, 3, L, S}),
      torch::logical_and(document, torch::rand({2, 1, L, S}) > 0.01),  // (and mixed)
      keys.view({1, 1, 1, S}).expand({2, 1, 1, S}) < torch::tensor({150, 64}).view({2, 1, 1, 1}),
      (rows < 40).view({1, L, 1}).expand({3, L, S}),
      (keys < 150).view({1, 1, 1, S}).expand({2, 1, L, S}),  // (rows of stride 0)
      torch::ones({S}, torch::kBool)};
  for (const auto& mask : masks) {
    const auto scan = fusedmha::ops::find_mask_tiles(mask, L, S);
    ASSERT_TRUE(scan.has_value());
    // (Also a mask of one key as given, where the scan reads it expanded.)
    const auto one_key = mask.stride(-1) != 0 ? mask : mask.select(-1, 0).unsqueeze(-1);
    for (const auto& given : {mask, one_key}) {
      const auto on_device = fusedmha::ops::mask_tiles_on_device(given, L, S);
      ASSERT_TRUE(on_device.has_value());
      EXPECT_TRUE(torch::equal(on_device->states.expand_as(scan->states), scan->states))
          << given.sizes() << given.strides();
      EXPECT_TRUE(on_device->any_uniform);
    }
  }
  EXPECT_FALSE(fusedmha::ops::mask_tiles_on_device(torch::zeros({L, S}), L, S).has_value());
}

TEST(Attention, GroupedQueryAttention) {
  torch::manual_seed(0);
  expect_matches_aten(torch::randn({2, 8, 19, 16}), torch::randn({2, 2, 23, 16}),
                      torch::randn({2, 2, 23, 16}), std::nullopt, false, std::nullopt,
                      /*enable_gqa=*/true);
  expect_matches_aten(torch::randn({2, 8, 19, 16}), torch::randn({2, 2, 19, 16}),
                      torch::randn({2, 2, 19, 16}), std::nullopt, true, 0.5, true);
}

// Decoding's score tiles of up to 16 query rows (float): 16 query heads of a K/V head packed as
// rows, 4 heads × 4 queries merged, one head's 16 queries, and 17, 40 or 64 queries per head in
// panels of rows; the keys of a cache's layout split across 2 threads, with and without a key
// padding mask. (The sanitized build runs these too: tiles, states and partial results at their
// largest.)
TEST(Attention, DecodingTilesAndRowPanels) {
  torch::manual_seed(0);
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  const int64_t S = 1100, E = 24;
  for (const auto& [H, H_kv, L] :
       std::vector<std::array<int64_t, 3>>{{32, 2, 1}, {8, 2, 4}, {4, 2, 16}, {4, 2, 17}, {4, 2, 40}, {4, 2, 64}}) {
    SCOPED_TRACE("H=" + std::to_string(H) + " H_kv=" + std::to_string(H_kv) + " L=" + std::to_string(L));
    const auto q = torch::randn({2, H, L, E});
    const auto k = torch::randn({2, S, H_kv, E}).transpose(1, 2);  // (a cache's layout: split keys)
    const auto v = torch::randn({2, S, H_kv, E}).transpose(1, 2);
    const auto pad = torch::arange(S).lt(torch::tensor({S, S / 3}).view({2, 1, 1, 1}));
    expect_matches_aten(q, k, v, std::nullopt, false, std::nullopt, /*enable_gqa=*/true);
    expect_matches_aten(q, k, v, pad, false, std::nullopt, true);
  }
  at::set_num_threads(threads);
}

TEST(Attention, TransposedInputs) {
  torch::manual_seed(0);
  auto q = torch::randn({2, 19, 4, 16}).transpose(1, 2);
  auto k = torch::randn({2, 23, 4, 16}).transpose(1, 2);
  auto v = torch::randn({2, 23, 4, 16}).transpose(1, 2);
  expect_matches_aten(q, k, v);
}

TEST(Attention, ForwardReturnsLogSumExp) {
  torch::manual_seed(0);
  auto q = torch::randn({2, 3, 17, 8});
  auto k = torch::randn({2, 3, 23, 8});
  auto v = torch::randn({2, 3, 23, 8});
  auto [out, lse, rng_state] = fusedmha::attention_forward(q, k, v);
  auto ref = torch::logsumexp(torch::matmul(q.to(at::kDouble), k.to(at::kDouble).transpose(-1, -2)) /
                                  std::sqrt(8.0),
                              -1);
  EXPECT_EQ(lse.sizes(), (std::vector<int64_t>{2, 3, 17}));
  EXPECT_TRUE(torch::allclose(lse.to(at::kDouble), ref, 1e-5, 1e-5));
}

TEST(Backward, MatchesATenGradients) {
  torch::manual_seed(0);
  struct Case {
    std::vector<int64_t> q, kv;
    bool causal, gqa, mask;
  };
  for (const Case& c : std::vector<Case>{{{2, 3, 17, 16}, {2, 3, 23, 16}, false, false, false},
                                         {{2, 3, 40, 32}, {2, 3, 40, 32}, true, false, false},
                                         {{2, 8, 19, 16}, {2, 2, 23, 16}, false, true, false},
                                         {{2, 4, 19, 16}, {2, 4, 23, 16}, false, false, true}}) {
    auto q = torch::randn(c.q, torch::requires_grad());
    auto k = torch::randn(c.kv, torch::requires_grad());
    auto v = torch::randn(c.kv, torch::requires_grad());
    std::optional<at::Tensor> mask;
    if (c.mask) mask = torch::rand({c.q[2], c.kv[2]}) > 0.3;
    auto out = fusedmha::scaled_dot_product_attention(q, k, v, mask, 0.0, c.causal, std::nullopt, c.gqa);
    auto grad_out = torch::randn_like(out);
    out.backward(grad_out);

    auto q64 = q.detach().to(at::kDouble).requires_grad_();
    auto k64 = k.detach().to(at::kDouble).requires_grad_();
    auto v64 = v.detach().to(at::kDouble).requires_grad_();
    at::scaled_dot_product_attention(q64, k64, v64, mask, 0.0, c.causal, std::nullopt, c.gqa)
        .backward(grad_out.to(at::kDouble));
    for (auto [ours, ref] : {std::pair{q.grad(), q64.grad()}, {k.grad(), k64.grad()},
                             {v.grad(), v64.grad()}}) {
      ASSERT_EQ(ours.sizes(), ref.sizes());
      EXPECT_TRUE(torch::allclose(ours.to(at::kDouble), ref, 1e-4, 1e-5))
          << "max abs diff " << (ours.to(at::kDouble) - ref).abs().max().item<double>();
    }
  }
}

// A learnt bias (a float mask that requires grad) trains from C++: its
// gradient, summed into its (H, L, S) shape, and the backward op's own, as
// ATen's SDPA gives them in double.
TEST(Backward, LearntBiasMatchesATen) {
  torch::manual_seed(0);
  const auto opts = torch::TensorOptions().dtype(torch::kDouble);
  const auto q = torch::randn({2, 3, 11, 8}, opts), k = torch::randn({2, 3, 14, 8}, opts),
             v = torch::randn({2, 3, 14, 8}, opts), grad_out = torch::randn({2, 3, 11, 8}, opts);
  const auto bias = torch::randn({3, 11, 14}, opts).requires_grad_();
  fusedmha::scaled_dot_product_attention(q, k, v, bias).backward(grad_out);
  const auto ref_bias = bias.detach().clone().requires_grad_();
  at::scaled_dot_product_attention(q, k, v, ref_bias).backward(grad_out);
  ASSERT_EQ(bias.grad().sizes(), bias.sizes());
  EXPECT_TRUE(torch::allclose(bias.grad(), ref_bias.grad(), 1e-10, 1e-12));

  torch::NoGradGuard no_grad;
  const auto [out, lse, rng] = fusedmha::attention_forward(q, k, v, bias);
  const auto grads = fusedmha::attention_backward(grad_out, q, k, v, out, lse, rng, bias, 0.0,
                                                  false, std::nullopt, false, {}, std::nullopt,
                                                  /*grad_attn_mask=*/true);
  EXPECT_TRUE(torch::allclose(std::get<3>(grads), ref_bias.grad(), 1e-10, 1e-12));
  EXPECT_EQ(std::get<3>(fusedmha::attention_backward(grad_out, q, k, v, out, lse, rng, bias))
                .numel(),
            0);
}

// A tiny causal self-attention model trained from C++: the loss must fall.
TEST(Backward, TinyModelTrains) {
  torch::manual_seed(0);
  torch::nn::Linear qkv(32, 96), proj(32, 32);
  std::vector<at::Tensor> params;
  for (auto& p : qkv->parameters()) params.push_back(p);
  for (auto& p : proj->parameters()) params.push_back(p);
  torch::optim::Adam opt(params, torch::optim::AdamOptions(1e-2));
  auto x = torch::randn({8, 12, 32});
  auto target = torch::roll(x, 1, 1);  // learn to look one token back
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    auto h = qkv->forward(x).view({8, 12, 3, 4, 8});
    auto q = h.select(2, 0).transpose(1, 2), k = h.select(2, 1).transpose(1, 2),
         v = h.select(2, 2).transpose(1, 2);
    auto y = fusedmha::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true);
    auto loss = torch::mse_loss(proj->forward(y.transpose(1, 2).reshape({8, 12, 32})), target);
    opt.zero_grad();
    loss.backward();
    opt.step();
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  EXPECT_LT(last, 0.7 * first) << "first loss " << first << ", last " << last;
}

TEST(Errors, ClearMessages) {
  auto q = torch::randn({2, 4, 5, 8});
  auto k = torch::randn({2, 4, 7, 8});
  auto v = torch::randn({2, 4, 7, 6});
  auto sdpa = [](auto&&... args) { return fusedmha::scaled_dot_product_attention(args...); };
  expect_error([&] { sdpa(q.select(0, 0).select(0, 0).select(0, 0), k, v); }, "at least 2 dims");
  expect_error([&] { sdpa(q, k.narrow(-1, 0, 5), v); }, "key's last dim (E) to equal query's");
  expect_error([&] { sdpa(q, k, v.narrow(-2, 0, 6)); }, "value's sequence length");
  expect_error([&] { sdpa(q, k.to(at::kDouble), v); }, "same dtype");
  expect_error([&] { sdpa(q.to(at::kLong), k.to(at::kLong), v.to(at::kLong)); },
               "query of dtype float32, float64, bfloat16 or float16");
  expect_error([&] { sdpa(q, torch::randn({2, 2, 7, 8}), torch::randn({2, 2, 7, 6})); },
               "same number of heads");
  expect_error(
      [&] {
        fusedmha::scaled_dot_product_attention(torch::randn({2, 6, 5, 8}), torch::randn({2, 4, 7, 8}),
                                               torch::randn({2, 4, 7, 6}), std::nullopt, 0.0,
                                               false, std::nullopt, true);
      },
      "must divide the number of heads in query");
  expect_error(
      [&] { fusedmha::scaled_dot_product_attention(q, k, v, torch::ones({5, 7}, torch::kLong)); },
      "attn_mask of dtype bool, float32");
  expect_error(
      [&] { fusedmha::scaled_dot_product_attention(q, k, v, torch::ones({4, 7}, torch::kBool)); },
      "is not broadcastable");
  expect_error(
      [&] {
        fusedmha::scaled_dot_product_attention(q, k, v, torch::ones({5, 7}, torch::kBool), 0.0,
                                               true);
      },
      "should not be set when is_causal=True");
  expect_error([&] { fusedmha::scaled_dot_product_attention(q, k, v, std::nullopt, 1.5); },
               "dropout_p must be in [0, 1)");
  // dropout_p = 1 drops everything, as PyTorch's does.
  EXPECT_TRUE(fusedmha::scaled_dot_product_attention(q, k, v, std::nullopt, 1.0).eq(0).all().item<bool>());
  expect_error([&] { fusedmha::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, false, -1.0); },
               "scale must be a finite number >= 0");
}

TEST(BuildInfo, Reported) {
  const auto info = fusedmha::build_info();
  EXPECT_FALSE(info.version.empty());
  EXPECT_FALSE(info.torch_version.empty());
  ASSERT_FALSE(info.cpu_isas.empty());
  EXPECT_EQ(info.cpu_isas.front(), "default");
}

// The CUDA kernels from C++: forward and backward against ATen in float64,
// and the module on the GPU. Skipped without CUDA kernels or a GPU.
TEST(Cuda, ForwardBackwardAndModule) {
  if (!fusedmha::build_info().cuda) GTEST_SKIP() << "fusedmha was built without CUDA kernels";
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU visible";
  torch::manual_seed(0);
  for (const auto dtype : {at::kHalf, at::kBFloat16, at::kFloat}) {
    const auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(dtype);
    expect_matches_aten(torch::randn({2, 4, 100, 64}, opts), torch::randn({2, 4, 130, 64}, opts),
                        torch::randn({2, 4, 130, 64}, opts));
    expect_matches_aten(torch::randn({2, 4, 100, 128}, opts), torch::randn({2, 4, 100, 128}, opts),
                        torch::randn({2, 4, 100, 128}, opts), std::nullopt, true);
    auto q = torch::randn({2, 4, 70, 64}, opts.requires_grad(true));
    auto k = torch::randn({2, 4, 90, 64}, opts.requires_grad(true));
    auto v = torch::randn({2, 4, 90, 64}, opts.requires_grad(true));
    auto out = fusedmha::scaled_dot_product_attention(q, k, v);
    auto grad_out = torch::randn_like(out);
    out.backward(grad_out);
    auto q64 = q.detach().to(at::kDouble).requires_grad_();
    auto k64 = k.detach().to(at::kDouble).requires_grad_();
    auto v64 = v.detach().to(at::kDouble).requires_grad_();
    at::scaled_dot_product_attention(q64, k64, v64).backward(grad_out.to(at::kDouble));
    const double tol = dtype == at::kFloat ? 1e-4 : dtype == at::kHalf ? 1e-2 : 6e-2;
    for (auto [ours, ref] : {std::pair{q.grad(), q64.grad()}, {k.grad(), k64.grad()},
                             {v.grad(), v64.grad()}}) {
      EXPECT_TRUE(torch::allclose(ours.to(at::kDouble), ref, tol, tol))
          << "max abs diff " << (ours.to(at::kDouble) - ref).abs().max().item<double>();
    }
  }
  fusedmha::MultiheadAttention mha(fusedmha::MultiheadAttentionOptions(128, 4));
  mha->to(torch::kCUDA);
  const auto x = torch::randn({50, 3, 128}, torch::kCUDA);
  const auto [y, w] = mha->forward(x, x, x);
  EXPECT_EQ(y.device().type(), torch::kCUDA);
  EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
}

// The variants through the C++ API (fusedmha::AttentionVariants), forward and
// backward, against the same pipeline written with ATen ops in float64.
TEST(Attention, VariantsFromCpp) {
  torch::manual_seed(0);
  const int64_t B = 2, H = 3, L = 9, S = 14, E = 8;
  const auto opts = torch::TensorOptions().dtype(torch::kDouble);
  const auto q = torch::randn({B, H, L, E}, opts).requires_grad_();
  const auto k = torch::randn({B, H, S, E}, opts).requires_grad_();
  const auto v = torch::randn({B, H, S, E}, opts).requires_grad_();
  const auto sinks = torch::randn({H}, opts).requires_grad_();
  fusedmha::AttentionVariants variants;
  variants.window_left = 4;
  variants.bottom_right = true;
  variants.softcap = 2.0;
  variants.alibi_slopes = torch::rand({H}, opts);
  variants.sinks = sinks;
  const auto out = fusedmha::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0,
                                                          /*is_causal=*/true, std::nullopt,
                                                          false, variants);

  const double scale = 1.0 / std::sqrt(double(E));
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * scale;
  scores = 2.0 * torch::tanh(scores / 2.0);
  const auto i = torch::arange(L, opts).unsqueeze(-1) + (S - L), j = torch::arange(S, opts);
  scores = scores - variants.alibi_slopes->view({H, 1, 1}) * (i - j).abs();
  const auto hidden = (j > i).logical_or(j < i - 4);
  scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  const auto with_sink = torch::cat({scores, sinks.view({1, H, 1, 1}).expand({B, H, L, 1})}, -1);
  const auto probs = torch::softmax(with_sink, -1).narrow(-1, 0, S);
  const auto reference = torch::matmul(probs, v);
  EXPECT_TRUE(torch::allclose(out, reference, 1e-10, 1e-12));

  const auto grad = torch::randn_like(out);
  const auto ours = torch::autograd::grad({out}, {q, k, v, sinks}, {grad});
  const auto theirs = torch::autograd::grad({reference}, {q, k, v, sinks}, {grad});
  for (size_t n = 0; n < ours.size(); ++n) {
    EXPECT_TRUE(torch::allclose(ours[n], theirs[n], 1e-9, 1e-11)) << "gradient " << n;
  }
}

// Partial results over two halves of the keys merge into the one-call result
// (output, log-sum-exp and, through the log-sum-exp, the gradients).
TEST(Attention, MergeAttentionFromCpp) {
  torch::manual_seed(0);
  const auto opts = torch::TensorOptions().dtype(torch::kDouble);
  const auto q = torch::randn({2, 3, 7, 8}, opts).requires_grad_();
  const auto k = torch::randn({2, 3, 20, 8}, opts).requires_grad_();
  const auto v = torch::randn({2, 3, 20, 8}, opts).requires_grad_();
  std::vector<at::Tensor> outs, lses;
  for (const auto& [a, b] : {std::pair<int64_t, int64_t>{0, 9}, {9, 20}}) {
    auto [o, lse, rng] = fusedmha::attention_forward(q, k.slice(2, a, b), v.slice(2, a, b));
    outs.push_back(o.transpose(1, 2));  // (B, L, H, E)
    lses.push_back(lse);
  }
  auto [merged, merged_lse] = fusedmha::merge_attention(outs, lses);
  auto [whole, whole_lse, rng] = fusedmha::attention_forward(q, k, v);
  EXPECT_TRUE(torch::allclose(merged, whole.transpose(1, 2), 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(merged_lse, whole_lse, 1e-12, 1e-12));
  const auto grad = torch::randn_like(merged);
  const auto ours = torch::autograd::grad({merged}, {q, k, v}, {grad});
  const auto theirs = torch::autograd::grad({whole.transpose(1, 2)}, {q, k, v}, {grad});
  for (size_t n = 0; n < 3; ++n) EXPECT_TRUE(torch::allclose(ours[n], theirs[n], 1e-10, 1e-12));
}

// A packed batch through the C++ front door equals each sequence through
// attention_forward alone, output and gradients (autograd from C++).
TEST(Attention, VarlenFromCpp) {
  torch::manual_seed(0);
  const std::vector<int64_t> lens_q{4, 0, 9}, lens_k{6, 2, 9};
  const int64_t H = 4, H_kv = 2, E = 8;
  const auto opts = torch::TensorOptions().dtype(torch::kDouble);
  auto cumulative = [](const std::vector<int64_t>& lens) {
    std::vector<int32_t> cu{0};
    for (const int64_t n : lens) cu.push_back(cu.back() + int32_t(n));
    return torch::tensor(cu, torch::kInt);
  };
  const auto cu_q = cumulative(lens_q), cu_k = cumulative(lens_k);
  const auto q = torch::randn({13, H, E}, opts).requires_grad_();
  const auto k = torch::randn({17, H_kv, E}, opts).requires_grad_();
  const auto v = torch::randn({17, H_kv, E}, opts).requires_grad_();
  fusedmha::AttentionVariants variants;
  variants.bottom_right = true;
  variants.softcap = 3.0;
  const auto [out, lse, rng] = fusedmha::varlen_attention_forward(
      q, k, v, cu_q, cu_k, 9, 9, 0.0, /*is_causal=*/true, std::nullopt, variants);
  ASSERT_EQ(out.sizes(), q.sizes());
  ASSERT_EQ(lse.sizes(), (std::vector<int64_t>{H, 13}));

  std::vector<torch::Tensor> parts;
  int64_t q0 = 0, k0 = 0;
  for (size_t b = 0; b < lens_q.size(); ++b) {
    const auto qb = q.narrow(0, q0, lens_q[b]).transpose(0, 1);
    const auto kb = k.narrow(0, k0, lens_k[b]).transpose(0, 1);
    const auto vb = v.narrow(0, k0, lens_k[b]).transpose(0, 1);
    parts.push_back(std::get<0>(fusedmha::attention_forward(qb, kb, vb, std::nullopt, 0.0, true,
                                                            std::nullopt, true, variants))
                        .transpose(0, 1));
    q0 += lens_q[b];
    k0 += lens_k[b];
  }
  const auto reference = torch::cat(parts);
  EXPECT_TRUE(torch::allclose(out, reference, 1e-12, 1e-12));

  const auto grad = torch::randn_like(out);
  const auto got = torch::autograd::grad({out}, {q, k, v}, {grad});
  const auto want = torch::autograd::grad({reference}, {q, k, v}, {grad});
  for (size_t n = 0; n < got.size(); ++n) {
    EXPECT_TRUE(torch::allclose(got[n], want[n], 1e-11, 1e-11)) << "gradient " << n;
  }
}

// A generation step through the C++ KV-cache front door: the new rows land in
// the cache in place, and the output equals attention over the whole
// sequences (decode with grouped-query heads, two cache lengths).
TEST(Attention, KVCacheFromCpp) {
  torch::manual_seed(0);
  const int64_t B = 2, S_cache = 32, H = 4, H_kv = 2, E = 8;
  const auto opts = torch::TensorOptions().dtype(torch::kDouble);
  auto k_cache = torch::randn({B, S_cache, H_kv, E}, opts);
  auto v_cache = torch::randn({B, S_cache, H_kv, E}, opts);
  const auto before_k = k_cache.clone(), before_v = v_cache.clone();
  const auto q = torch::randn({B, 1, H, E}, opts);
  const auto k = torch::randn({B, 1, H_kv, E}, opts), v = torch::randn({B, 1, H_kv, E}, opts);
  fusedmha::KVCacheStep step;
  step.k = k;
  step.v = v;
  step.cache_seqlens = torch::tensor({5, 20}, torch::kInt);
  const auto [out, lse] =
      fusedmha::attention_with_kvcache(q, k_cache, v_cache, step, std::nullopt, /*is_causal=*/true);
  ASSERT_EQ(out.sizes(), q.sizes());
  ASSERT_EQ(lse.sizes(), (std::vector<int64_t>{B, H, 1}));
  const std::vector<int64_t> lengths{5, 20};
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lengths[b];
    EXPECT_TRUE(torch::equal(k_cache[b][n], k[b][0]));
    EXPECT_TRUE(torch::equal(v_cache[b].narrow(0, 0, n), before_v[b].narrow(0, 0, n)));
    const auto keys = torch::cat({before_k[b].narrow(0, 0, n), k[b]}).transpose(0, 1);
    const auto values = torch::cat({before_v[b].narrow(0, 0, n), v[b]}).transpose(0, 1);
    const auto want = std::get<0>(fusedmha::attention_forward(q[b].transpose(0, 1), keys, values,
                                                               std::nullopt, 0.0, false,
                                                               std::nullopt, true));
    EXPECT_TRUE(torch::allclose(out[b], want.transpose(0, 1), 1e-12, 1e-12)) << "sequence " << b;
  }
}

// A quantized cache through the C++ front door: quantize_kv fills it, the
// step's rows are quantized into codes and scales in place, and the output
// equals attention over the dequantized cache (a float64 cache of the same
// values, through the same door).
TEST(Attention, QuantizedKVCacheFromCpp) {
  torch::manual_seed(0);
  const int64_t B = 2, S_cache = 32, H = 4, H_kv = 2, E = 24;
  for (const auto codes : {torch::kChar, torch::kFloat8_e4m3fn, torch::kFloat8_e5m2}) {
    auto [k_cache, k_scale] = fusedmha::quantize_kv(torch::randn({B, S_cache, H_kv, E}), codes);
    auto [v_cache, v_scale] = fusedmha::quantize_kv(torch::randn({B, S_cache, H_kv, E}), codes);
    const auto q = torch::randn({B, 1, H, E});
    const auto k = torch::randn({B, 1, H_kv, E}), v = torch::randn({B, 1, H_kv, E});
    fusedmha::KVCacheStep step;
    step.k = k;
    step.v = v;
    step.cache_seqlens = torch::tensor({5, 20}, torch::kInt);
    step.k_scale = k_scale;
    step.v_scale = v_scale;
    const auto out = std::get<0>(fusedmha::attention_with_kvcache(q, k_cache, v_cache, step,
                                                                  std::nullopt, true));
    const auto [new_codes, new_scale] = fusedmha::quantize_kv(k, codes);
    EXPECT_TRUE(torch::equal(k_cache[1][20].to(torch::kFloat), new_codes[1][0].to(torch::kFloat)));
    EXPECT_TRUE(torch::equal(k_scale[1][20], new_scale[1][0]));
    auto keys = fusedmha::dequantize_kv(k_cache, k_scale, torch::kDouble);
    auto values = fusedmha::dequantize_kv(v_cache, v_scale, torch::kDouble);
    fusedmha::KVCacheStep full;
    full.cache_seqlens = torch::tensor({6, 21}, torch::kInt);
    const auto want = std::get<0>(fusedmha::attention_with_kvcache(
        q.to(torch::kDouble), keys, values, full, std::nullopt, true));
    EXPECT_TRUE(torch::allclose(out.to(torch::kDouble), want, 1e-5, 2e-6)) << codes;
  }
}
