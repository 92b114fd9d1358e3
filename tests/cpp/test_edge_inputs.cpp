// Empty and size-1 dims, broadcast batch dims and masks of every kind, through
// the C++ API: each call returns the float64 truth (a row with no key to see
// gives 0) or throws a c10::Error; none may end the process.

#include <fusedmha/fusedmha.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

// The float64 truth of scaled_dot_product_attention with fusedmha's meaning
// (PyTorch's, except that a row that sees no key gives 0).
at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, bool is_causal) {
  const at::Tensor q64 = q.to(at::kDouble), k64 = k.to(at::kDouble), v64 = v.to(at::kDouble);
  const int64_t E = q.size(-1), L = q.size(-2), S = k.size(-2);
  const double scale = E > 0 ? 1.0 / std::sqrt(static_cast<double>(E)) : 1.0;
  at::Tensor scores = at::matmul(q64, k64.transpose(-2, -1)).mul(scale);
  const double neg_inf = -std::numeric_limits<double>::infinity();
  if (is_causal) scores = scores.masked_fill(at::ones({L, S}, at::kBool).tril().logical_not(), neg_inf);
  if (mask.has_value()) {
    scores = mask->scalar_type() == at::kBool ? scores.masked_fill(mask->logical_not(), neg_inf)
                                              : scores.add(mask->to(at::kDouble));
  }
  const at::Tensor sees = scores.gt(neg_inf).any(-1, /*keepdim=*/true);
  const at::Tensor probs = at::where(sees, scores, at::zeros_like(scores)).softmax(-1).mul(sees);
  return at::matmul(probs, v64);
}

int64_t pick(std::mt19937& rng, std::vector<int64_t> sizes) {
  return sizes[std::uniform_int_distribution<size_t>(0, sizes.size() - 1)(rng)];
}

std::string shape_of(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return "none";
  std::ostringstream s;
  s << t->sizes() << ":" << t->scalar_type();
  return s.str();
}

TEST(EdgeInputs, ScaledDotProductAttentionNeverCrashes) {
  std::mt19937 rng(59);
  int returned = 0, refused = 0;
  for (int n = 0; n < 400; ++n) {
    const int64_t B = pick(rng, {0, 1, 2}), H = pick(rng, {0, 1, 2}), L = pick(rng, {0, 1, 3, 40});
    const int64_t S = pick(rng, {0, 1, 5, 70}), E = pick(rng, {0, 1, 8}), Ev = pick(rng, {0, 1, 8});
    // Each tensor's batch and head dims broadcast (1) or not, now and then
    // one that does not go with the others (3).
    auto dims = [&](int64_t rows, int64_t cols) {
      return std::vector<int64_t>{pick(rng, {B, B, B, 1, 3}), pick(rng, {H, H, 1}), rows, cols};
    };
    const at::Tensor q = at::randn(dims(L, E)), k = at::randn(dims(S, E)), v = at::randn(dims(S, Ev));
    std::optional<at::Tensor> mask;
    const int64_t kind = pick(rng, {0, 1, 2});
    if (kind > 0) {
      std::vector<int64_t> shape{pick(rng, {B, 1}), pick(rng, {H, 1}), pick(rng, {L, 1}), S};
      shape.erase(shape.begin(), shape.begin() + pick(rng, {0, 1, 2}));
      const at::Tensor visible = at::rand(shape).gt(0.4);
      mask = kind == 1 ? visible
                       : at::zeros(shape).masked_fill(visible.logical_not(),
                                                      -std::numeric_limits<float>::infinity());
    }
    const bool is_causal = !mask.has_value() && pick(rng, {0, 1}) == 1;
    const std::string what = "q " + shape_of(q) + " k " + shape_of(k) + " v " + shape_of(v) +
                             " mask " + shape_of(mask) + (is_causal ? " causal" : "");
    // The output's shape: the broadcast of q's, k's and v's batch and head dims, (L, Ev).
    std::vector<int64_t> shape;
    at::Tensor want;
    try {
      shape = at::infer_size(at::infer_size(q.sizes().slice(0, 2), k.sizes().slice(0, 2)),
                             v.sizes().slice(0, 2));
      shape.insert(shape.end(), {L, Ev});
      want = reference(q, k, v, mask, is_causal);
    } catch (const c10::Error&) {
    }
    if (!want.defined() || want.sizes() != c10::IntArrayRef(shape)) {
      // Shapes that do not go together, or a mask that would grow the output:
      // the call must refuse them.
      EXPECT_THROW(fusedmha::scaled_dot_product_attention(q, k, v, mask, 0.0, is_causal), c10::Error)
          << what;
      ++refused;
      continue;
    }
    at::Tensor out;
    try {
      out = fusedmha::scaled_dot_product_attention(q, k, v, mask, 0.0, is_causal);
    } catch (const c10::Error& e) {
      ADD_FAILURE() << what << ": refused a call the reference computes: " << e.what();
      continue;
    }
    ++returned;
    ASSERT_EQ(out.sizes(), want.sizes()) << what;
    EXPECT_TRUE(at::allclose(out.to(at::kDouble), want, 1e-5, 1e-5)) << what;
  }
  // Both outcomes are exercised: the draws are not all one kind.
  EXPECT_GT(returned, 100);
  EXPECT_GT(refused, 10);
}

TEST(EdgeInputs, MultiheadAttentionEmptyBatchesAndSequences) {
  for (const int64_t N : {0, 1, 2}) {
    for (const int64_t L : {0, 1, 3}) {
      for (const int64_t S : {0, 1, 4}) {
        fusedmha::MultiheadAttention mha(fusedmha::MultiheadAttentionOptions(8, 2));
        torch::nn::MultiheadAttention ref(torch::nn::MultiheadAttentionOptions(8, 2));
        {
          // The same parameters, biases made nonzero so that they matter.
          torch::NoGradGuard no_grad;
          for (auto& p : ref->named_parameters()) {
            if (p.key().find("bias") != std::string::npos) p.value().uniform_(-1, 1);
          }
          auto theirs = ref->named_parameters();
          for (auto& p : mha->named_parameters()) p.value().copy_(theirs[p.key()]);
        }
        const at::Tensor query = at::randn({L, N, 8}), key = at::randn({S, N, 8});
        const at::Tensor padding = at::rand({N, S}).gt(0.5);  // true = masked
        const std::string what = "N=" + std::to_string(N) + " L=" + std::to_string(L) +
                                 " S=" + std::to_string(S);
        for (const bool with_mask : {false, true}) {
          at::Tensor out, weights;
          try {
            std::tie(out, weights) =
                mha->forward(query, key, key, with_mask ? padding : at::Tensor());
          } catch (const c10::Error& e) {
            ADD_FAILURE() << what << ": " << e.what();
            continue;
          }
          ASSERT_EQ(out.sizes(), query.sizes()) << what;
          ASSERT_EQ(weights.sizes(), (std::vector<int64_t>{N, L, S})) << what;
          // S = 0 or every key masked: attention 0, so the output is out_proj's bias.
          EXPECT_TRUE(at::isfinite(out).all().item<bool>()) << what;
          if (S == 0 && out.numel() > 0) {
            EXPECT_TRUE(at::allclose(out, mha->out_proj->bias.expand_as(out))) << what;
          } else if (!with_mask && S > 0 && N > 0) {
            // (No row is fully masked: PyTorch's module is the truth. It cannot take N = 0.)
            const auto [want, want_weights] = ref->forward(query, key, key);
            EXPECT_TRUE(at::allclose(out, want, 1e-4, 1e-5)) << what;
            EXPECT_TRUE(at::allclose(weights, want_weights, 1e-4, 1e-6)) << what;
          }
        }
      }
    }
  }
}

}  // namespace
