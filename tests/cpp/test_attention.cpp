#include <fusedmha/fusedmha.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

TEST(Dispatcher, OpsAreRegistered) {
  auto& d = c10::Dispatcher::singleton();
  EXPECT_TRUE(d.findSchema({"fusedmha::attention_forward", ""}).has_value());
  EXPECT_TRUE(d.findSchema({"fusedmha::scaled_dot_product_attention", ""}).has_value());
}

TEST(Attention, MatchesATenFloat32) {
  torch::manual_seed(0);
  auto q = torch::randn({2, 3, 17, 8});
  auto k = torch::randn({2, 3, 23, 8});
  auto v = torch::randn({2, 3, 23, 5});
  auto ref = at::scaled_dot_product_attention(q, k, v);
  auto out = fusedmha::scaled_dot_product_attention(q, k, v);
  EXPECT_TRUE(torch::allclose(out, ref, 1e-5, 1e-5));
}
