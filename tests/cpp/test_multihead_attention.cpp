// fusedmha::MultiheadAttention against torch::nn::MultiheadAttention on
// shared weights, and what only fusedmha's module supports.

#include <fusedmha/fusedmha.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>

namespace {

constexpr int64_t kEmbed = 16, kHeads = 4, kL = 5, kS = 7, kN = 3;

// A torch::nn::MultiheadAttention and a fusedmha one with the same weights.
struct Pair {
  torch::nn::MultiheadAttention theirs{nullptr};
  fusedmha::MultiheadAttention ours{nullptr};
};

Pair make_pair(bool bias = true, bool add_bias_kv = false, bool add_zero_attn = false,
               int64_t kdim = kEmbed) {
  Pair p;
  p.theirs = torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(kEmbed, kHeads)
                                               .bias(bias)
                                               .add_bias_kv(add_bias_kv)
                                               .add_zero_attn(add_zero_attn)
                                               .kdim(kdim)
                                               .vdim(kdim));
  p.ours = fusedmha::MultiheadAttention(fusedmha::MultiheadAttentionOptions(kEmbed, kHeads)
                                            .bias(bias)
                                            .add_bias_kv(add_bias_kv)
                                            .add_zero_attn(add_zero_attn)
                                            .kdim(kdim)
                                            .vdim(kdim));
  p.theirs->to(torch::kDouble);
  p.ours->to(torch::kDouble);
  torch::NoGradGuard no_grad;
  auto ours = p.ours->named_parameters();
  for (const auto& param : p.theirs->named_parameters()) {
    ours[param.key()].copy_(param.value());
  }
  return p;
}

torch::Tensor randn(std::vector<int64_t> shape) {
  return torch::randn(shape, torch::kDouble).requires_grad_();
}

void expect_close(const torch::Tensor& a, const torch::Tensor& b, const std::string& what = "",
                  double tol = 1e-10) {
  ASSERT_TRUE(a.defined() && b.defined()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  EXPECT_TRUE(torch::allclose(a, b, tol, tol))
      << what << ": max abs diff " << (a - b).abs().max().item<double>();
}

// Runs both with the same inputs, compares outputs, weights and all
// gradients. torch::nn::MultiheadAttention takes a bool key_padding_mask
// (true = masked) and a float attn_mask.
void expect_same(Pair& p, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                 const torch::Tensor& padding = {}, const torch::Tensor& mask = {},
                 bool need_weights = true, bool average = true,
                 const torch::Tensor& our_mask = {}) {
  p.theirs->zero_grad();
  p.ours->zero_grad();
  // Fresh leaves, aliased like the inputs (self-attention packs one projection).
  auto leaves = [&] {
    const auto qs = q.detach().clone().requires_grad_();
    const auto ks = k.is_same(q) ? qs : k.detach().clone().requires_grad_();
    const auto vs = v.is_same(k) ? ks : v.detach().clone().requires_grad_();
    return std::make_tuple(qs, ks, vs);
  };
  auto [qt, kt, vt] = leaves();
  auto [qs, ks, vs] = leaves();
  auto [out_t, w_t] = p.theirs->forward(qt, kt, vt, padding, need_weights, mask, average);
  auto [out_o, w_o] = p.ours->forward(qs, ks, vs, padding, need_weights,
                                      our_mask.defined() ? our_mask : mask, average);
  expect_close(out_o, out_t, "output");
  ASSERT_EQ(w_o.defined(), need_weights);
  if (need_weights) expect_close(w_o, w_t, "weights");
  (out_t.pow(2).sum()).backward();
  (out_o.pow(2).sum()).backward();
  expect_close(qs.grad(), qt.grad(), "query grad");
  if (!k.is_same(q)) expect_close(ks.grad(), kt.grad(), "key grad");
  if (!v.is_same(k)) expect_close(vs.grad(), vt.grad(), "value grad");
  auto ours = p.ours->named_parameters();
  for (const auto& param : p.theirs->named_parameters()) {
    expect_close(ours[param.key()].grad(), param.value().grad(), param.key() + " grad");
  }
}

torch::Tensor float_mask(const torch::Tensor& masked) {
  return torch::zeros(masked.sizes(), torch::kDouble)
      .masked_fill(masked, -std::numeric_limits<double>::infinity());
}

}  // namespace

TEST(MultiheadAttention, SameParametersAsTorch) {
  for (const int64_t kdim : {kEmbed, int64_t{8}}) {
    Pair p = make_pair(true, true, false, kdim);
    std::vector<std::string> theirs, ours;
    for (const auto& param : p.theirs->named_parameters()) theirs.push_back(param.key());
    for (const auto& param : p.ours->named_parameters()) ours.push_back(param.key());
    EXPECT_EQ(ours, theirs);
  }
}

TEST(MultiheadAttention, SelfAttentionMatchesTorch) {
  Pair p = make_pair();
  const auto x = randn({kL, kN, kEmbed});
  expect_same(p, x, x, x);
}

TEST(MultiheadAttention, CrossAttentionWithMasksMatchesTorch) {
  Pair p = make_pair();
  const auto q = randn({kL, kN, kEmbed}), k = randn({kS, kN, kEmbed}), v = randn({kS, kN, kEmbed});
  auto padding = torch::zeros({kN, kS}, torch::kBool);
  padding.index_put_({0, torch::indexing::Slice(-2, torch::indexing::None)}, true);
  auto masked = torch::rand({kL, kS}) > 0.7;
  masked.index_put_({torch::indexing::Slice(), 0}, false);
  expect_same(p, q, k, v, padding);
  expect_same(p, q, k, v, {}, float_mask(masked));
  expect_same(p, q, k, v, padding, float_mask(masked), true, false);
  // A per-head (N * num_heads, L, S) mask (torch's C++ module takes 2-D ones only).
  const auto additive = torch::randn({kL, kS}, torch::kDouble);
  expect_same(p, q, k, v, {}, additive, false, true, additive.expand({kN * kHeads, kL, kS}));
}

// A learnt float attn_mask (a bias that requires grad) with a key padding
// mask, the weights returned: the bias's gradient is torch's.
TEST(MultiheadAttention, LearntFloatMaskMatchesTorch) {
  Pair p = make_pair();
  const auto q = randn({kL, kN, kEmbed}), k = randn({kS, kN, kEmbed}), v = randn({kS, kN, kEmbed});
  auto padding = torch::zeros({kN, kS}, torch::kBool);
  padding.index_put_({0, torch::indexing::Slice(-2, torch::indexing::None)}, true);
  const auto bias = torch::randn({kL, kS}, torch::kDouble);
  std::vector<torch::Tensor> grads;
  for (const bool ours : {true, false}) {
    const auto b = bias.clone().requires_grad_();
    auto [out, weights] = ours ? p.ours->forward(q, k, v, padding, true, b)
                               : p.theirs->forward(q, k, v, padding, true, b);
    (out.pow(2).sum() + weights.sum()).backward();
    grads.push_back(b.grad());
  }
  expect_close(grads[0], grads[1], "attn_mask grad");
}

TEST(MultiheadAttention, ExtraKeysAndNoBiasMatchTorch) {
  for (const bool bias_kv : {false, true}) {
    Pair p = make_pair(/*bias=*/!bias_kv, bias_kv, /*add_zero_attn=*/!bias_kv);
    const auto q = randn({kL, kN, kEmbed}), k = randn({kS, kN, kEmbed});
    auto padding = torch::rand({kN, kS}) > 0.8;
    padding.index_put_({torch::indexing::Slice(), 0}, false);
    expect_same(p, q, k, k, padding);
  }
}

TEST(MultiheadAttention, BoolMasksMeanMasked) {
  Pair p = make_pair();
  const auto q = randn({kL, kN, kEmbed}), k = randn({kS, kN, kEmbed});
  auto masked = torch::rand({kL, kS}) > 0.7;
  masked.index_put_({torch::indexing::Slice(), 0}, false);
  auto [bool_out, bool_w] = p.ours->forward(q, k, k, {}, true, masked);
  auto [float_out, float_w] = p.theirs->forward(q, k, k, {}, true, float_mask(masked));
  expect_close(bool_out, float_out);
  expect_close(bool_w, float_w);
}

TEST(MultiheadAttention, CausalWithoutMaskIsTheCausalMask) {
  Pair p = make_pair();
  const auto x = randn({kL, kN, kEmbed});
  const auto causal = torch::ones({kL, kL}, torch::kBool).triu(1);
  auto [out, w] = p.ours->forward(x, x, x, {}, true, {}, true, /*is_causal=*/true);
  auto [ref, ref_w] = p.theirs->forward(x, x, x, {}, true, float_mask(causal));
  expect_close(out, ref);
  expect_close(w, ref_w);
}

TEST(MultiheadAttention, BatchFirstAndUnbatched) {
  Pair p = make_pair();
  auto batch_first = fusedmha::MultiheadAttention(
      fusedmha::MultiheadAttentionOptions(kEmbed, kHeads).batch_first(true));
  batch_first->to(torch::kDouble);
  {
    torch::NoGradGuard no_grad;
    auto dst = batch_first->named_parameters();
    for (const auto& param : p.ours->named_parameters()) dst[param.key()].copy_(param.value());
  }
  const auto x = torch::randn({kL, kN, kEmbed}, torch::kDouble);
  auto [seq_out, seq_w] = p.ours->forward(x, x, x);
  const auto xb = x.transpose(0, 1).contiguous();
  auto [bf_out, bf_w] = batch_first->forward(xb, xb, xb);
  expect_close(bf_out, seq_out.transpose(0, 1));
  expect_close(bf_w, seq_w);
  const auto x0 = x.select(1, 0);
  // Unbatched input (torch::nn::MultiheadAttention has none): batch 1, squeezed.
  auto [un_out, un_w] = p.ours->forward(x0, x0, x0, {}, true, {}, false);
  const auto x1 = x0.unsqueeze(1);
  auto [ref_out, ref_w] = p.theirs->forward(x1, x1, x1, {}, true, {}, false);
  expect_close(un_out, ref_out.squeeze(1));
  expect_close(un_w, ref_w.squeeze(0));
}

TEST(MultiheadAttention, SaveLoadInterchangesWithTorch) {
  Pair p = make_pair();
  auto fresh = fusedmha::MultiheadAttention(kEmbed, kHeads);
  fresh->to(torch::kDouble);
  std::stringstream stream;
  torch::save(p.theirs, stream);
  torch::load(fresh, stream);
  const auto x = torch::randn({kL, kN, kEmbed}, torch::kDouble);
  expect_close(std::get<0>(fresh->forward(x, x, x)), std::get<0>(p.theirs->forward(x, x, x)));

  auto theirs = torch::nn::MultiheadAttention(kEmbed, kHeads);
  theirs->to(torch::kDouble);
  std::stringstream back;
  torch::save(p.ours, back);
  torch::load(theirs, back);
  expect_close(std::get<0>(theirs->forward(x, x, x)), std::get<0>(p.ours->forward(x, x, x)));
}

TEST(MultiheadAttention, TrainsWithDropout) {
  torch::manual_seed(0);
  auto mha = fusedmha::MultiheadAttention(
      fusedmha::MultiheadAttentionOptions(kEmbed, kHeads).dropout(0.1).batch_first(true));
  torch::optim::Adam opt(mha->parameters(), torch::optim::AdamOptions(1e-2));
  const auto x = torch::randn({4, 10, kEmbed}), target = torch::randn({4, 10, kEmbed});
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    opt.zero_grad();
    const auto loss = torch::mse_loss(std::get<0>(mha->forward(x, x, x, {}, false)), target);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, 0.8 * first);
  mha->eval();  // no dropout: repeatable
  const auto a = std::get<0>(mha->forward(x, x, x)), b = std::get<0>(mha->forward(x, x, x));
  EXPECT_TRUE(torch::equal(a, b));
}

TEST(MultiheadAttention, HalfPrecisionAndSeparateKeyValueDims) {
  auto mha = fusedmha::MultiheadAttention(
      fusedmha::MultiheadAttentionOptions(kEmbed, kHeads).kdim(8).vdim(12));
  const auto q = torch::randn({kL, kN, kEmbed}), k = torch::randn({kS, kN, 8}),
             v = torch::randn({kS, kN, 12});
  auto [ref, ref_w] = mha->forward(q, k, v);
  mha->to(torch::kBFloat16);
  auto [out, w] = mha->forward(q.to(torch::kBFloat16), k.to(torch::kBFloat16),
                               v.to(torch::kBFloat16));
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::allclose(out.to(torch::kFloat), ref, 5e-2, 5e-2));
  EXPECT_TRUE(torch::allclose(w.to(torch::kFloat), ref_w, 2e-2, 2e-2));
}

TEST(MultiheadAttention, BadInputsGiveClearErrors) {
  auto mha = fusedmha::MultiheadAttention(kEmbed, kHeads);
  const auto x = torch::randn({kL, kN, kEmbed});
  auto expect_error = [](auto f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "expected an error containing: " << needle;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { fusedmha::MultiheadAttention(10, 3); }, "divisible by num_heads");
  expect_error([&] { mha->forward(x, x.select(1, 0), x); }, "expected key and value to be 3-D");
  expect_error([&] { mha->forward(torch::randn({kL, kN, 8}), x, x); }, "embed_dim=16");
  expect_error([&] { mha->forward(x, x, x, torch::zeros({kN, kL + 1}, torch::kBool)); },
               "key_padding_mask of shape (N, S)");
  expect_error([&] { mha->forward(x, x, x, {}, true, torch::zeros({kL, kL + 1})); },
               "2-D attn_mask of shape (L, S)");
  expect_error([&] { mha->forward(x, x, x, {}, true, torch::zeros({kHeads, kL, kL})); },
               "3-D attn_mask");
  expect_error([&] { mha->forward(x, x, x, torch::zeros({kN, kL}, torch::kLong)); },
               "only bool and floating types of key_padding_mask");
}

namespace {

// One row of tests/data/mha_cases.txt (its header says what the columns mean).
struct SharedCase {
  std::string name, inputs, attn_mask, key_padding_mask;
  std::map<std::string, int64_t> flags;
  int64_t operator[](const std::string& flag) const { return flags.at(flag); }
};

std::vector<SharedCase> read_shared_cases() {
  std::ifstream file(FUSEDMHA_TEST_DATA_DIR "/mha_cases.txt");
  EXPECT_TRUE(file.good()) << "cannot read " FUSEDMHA_TEST_DATA_DIR "/mha_cases.txt";
  const std::vector<std::string> flags{"batch_first", "batched", "need_weights", "average",
                                       "is_causal", "bias", "add_bias_kv", "add_zero_attn",
                                       "kdim", "vdim"};
  std::vector<SharedCase> cases;
  std::string line;
  while (std::getline(file, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream row(line);
    SharedCase c;
    int64_t batch_first, batched;
    row >> c.name >> batch_first >> batched >> c.inputs >> c.attn_mask >> c.key_padding_mask;
    c.flags["batch_first"] = batch_first;
    c.flags["batched"] = batched;
    for (size_t i = 2; i < flags.size(); ++i) row >> c.flags[flags[i]];
    EXPECT_FALSE(row.fail()) << "malformed row: " << line;
    cases.push_back(c);
  }
  return cases;
}

// (ours, theirs): a mask of the case's kind. torch::nn::MultiheadAttention
// takes a float (L, S) attn_mask and a bool key padding mask, so it gets
// each mask in that form: bool masks as -inf terms, per-head masks as the
// 2-D mask ours gets expanded over heads, float padding masks with values
// 0 or -inf only. (The Python tests run genuinely per-head masks.)
std::pair<torch::Tensor, torch::Tensor> shared_case_mask(const std::string& kind,
                                                         std::vector<int64_t> shape,
                                                         bool padding, int64_t heads_first) {
  if (kind == "none") return {};
  auto masked = torch::rand(shape) < 0.35;
  masked.index_put_({torch::indexing::Ellipsis, 0}, false);  // key 0 stays visible
  if (kind == "causal") masked = torch::ones(shape, torch::kBool).triu(1);
  auto as_float = [&](torch::ScalarType dtype) {
    auto m = float_mask(masked);
    if (!padding && kind != "causal") m = m + torch::randn(shape, torch::kDouble);
    return m.to(dtype);
  };
  torch::Tensor ours, theirs;
  if (kind == "bool" || kind == "bool3d" || kind == "causal") {
    ours = masked;
    theirs = padding ? masked : float_mask(masked);
  } else {
    ours = as_float(kind == "lowp" ? torch::kFloat : torch::kDouble);
    theirs = padding ? masked : ours.to(torch::kDouble);
  }
  if (kind.size() > 2 && kind.substr(kind.size() - 2) == "3d") {
    std::vector<int64_t> per_head{heads_first};
    per_head.insert(per_head.end(), shape.begin(), shape.end());
    ours = ours.expand(per_head);
  }
  return {ours, theirs};
}

}  // namespace

// Every row of tests/data/mha_cases.txt, the table the Python module's tests
// run too (tests/python/test_mha_shared_cases.py).
TEST(MultiheadAttention, SharedCasesMatchTorch) {
  const std::vector<SharedCase> cases = read_shared_cases();
  ASSERT_GE(cases.size(), 10u);
  size_t skipped = 0;
  for (const SharedCase& c : cases) {
    SCOPED_TRACE(c.name);
    torch::manual_seed(0);
    const int64_t kdim = c["kdim"] ? c["kdim"] : kEmbed, vdim = c["vdim"] ? c["vdim"] : kEmbed;
    if (kdim != vdim) {
      // torch::nn::MultiheadAttention asserts key.sizes() == value.sizes(); these rows
      // run against nn.MultiheadAttention in the Python tests only.
      ++skipped;
      continue;
    }
    auto theirs = torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(kEmbed, kHeads)
                                                    .bias(c["bias"])
                                                    .add_bias_kv(c["add_bias_kv"])
                                                    .add_zero_attn(c["add_zero_attn"])
                                                    .kdim(kdim)
                                                    .vdim(vdim));
    auto ours = fusedmha::MultiheadAttention(fusedmha::MultiheadAttentionOptions(kEmbed, kHeads)
                                                 .bias(c["bias"])
                                                 .add_bias_kv(c["add_bias_kv"])
                                                 .add_zero_attn(c["add_zero_attn"])
                                                 .kdim(kdim)
                                                 .vdim(vdim)
                                                 .batch_first(c["batch_first"]));
    theirs->to(torch::kDouble);
    ours->to(torch::kDouble);
    {
      torch::NoGradGuard no_grad;
      auto dst = ours->named_parameters();
      for (const auto& param : theirs->named_parameters()) {
        if (param.key().find("bias") != std::string::npos) param.value().normal_(0, 0.5);
        dst[param.key()].copy_(param.value());
      }
    }
    const int64_t S = c.inputs == "self" ? kL : kS;
    // torch's layout (L, N, E); ours gets it batch-first or unbatched as the case says.
    const auto q = torch::randn({kL, kN, kEmbed}, torch::kDouble);
    const auto k = c.inputs == "self" ? q : torch::randn({S, kN, kdim}, torch::kDouble);
    const auto v = c.inputs == "cross" ? torch::randn({S, kN, vdim}, torch::kDouble) : k;
    const int64_t n = c["batched"] ? kN : 1;
    auto [mask, their_mask] = shared_case_mask(c.attn_mask, {kL, S}, false, n * kHeads);
    auto [padding, their_padding] = shared_case_mask(c.key_padding_mask, {n, S}, true, 0);
    if (c["is_causal"] && !their_mask.defined()) {
      their_mask = float_mask(torch::ones({kL, S}, torch::kBool).triu(1));
    }
    auto ours_layout = [&](const torch::Tensor& t) {
      if (!c["batched"]) return t.select(1, 0);
      return c["batch_first"] ? t.transpose(0, 1) : t;
    };
    auto leaves = [&](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& d) {
      const auto qs = a.detach().clone().requires_grad_();
      const auto ks = b.is_same(a) ? qs : b.detach().clone().requires_grad_();
      const auto vs = d.is_same(b) ? ks : d.detach().clone().requires_grad_();
      return std::make_tuple(qs, ks, vs);
    };
    const auto q_t = c["batched"] ? q : q.narrow(1, 0, 1);
    const auto k_t = k.is_same(q) ? q_t : (c["batched"] ? k : k.narrow(1, 0, 1));
    const auto v_t = v.is_same(k) ? k_t : (c["batched"] ? v : v.narrow(1, 0, 1));
    auto [qt, kt, vt] = leaves(q_t, k_t, v_t);
    auto [out_t, w_t] = theirs->forward(qt, kt, vt, their_padding, c["need_weights"], their_mask,
                                        c["average"]);
    const auto qo_in = ours_layout(q_t);
    const auto ko_in = k_t.is_same(q_t) ? qo_in : ours_layout(k_t);
    const auto vo_in = v_t.is_same(k_t) ? ko_in : ours_layout(v_t);
    auto [qo, ko, vo] = leaves(qo_in, ko_in, vo_in);
    if (!c["batched"] && padding.defined()) padding = padding.select(0, 0);
    auto [out_o, w_o] = ours->forward(qo, ko, vo, padding, c["need_weights"], mask, c["average"],
                                      c["is_causal"]);
    const auto out_expected = c["batched"] ? (c["batch_first"] ? out_t.transpose(0, 1) : out_t)
                                           : out_t.select(1, 0);
    expect_close(out_o, out_expected, "output");
    ASSERT_EQ(w_o.defined(), bool(c["need_weights"]));
    if (c["need_weights"]) expect_close(w_o, c["batched"] ? w_t : w_t.select(0, 0), "weights");
    out_t.pow(2).sum().backward();
    out_o.pow(2).sum().backward();
    auto back = [&](const torch::Tensor& g) {
      if (!c["batched"]) return g.unsqueeze(1);
      return c["batch_first"] ? g.transpose(0, 1) : g;
    };
    expect_close(back(qo.grad()), qt.grad(), "query grad");
    if (!ko.is_same(qo)) expect_close(back(ko.grad()), kt.grad(), "key grad");
    if (!vo.is_same(ko)) expect_close(back(vo.grad()), vt.grad(), "value grad");
    auto grads = ours->named_parameters();
    for (const auto& param : theirs->named_parameters()) {
      expect_close(grads[param.key()].grad(), param.value().grad(), param.key() + " grad");
    }
  }
  EXPECT_LE(skipped, 2u) << "rows torch::nn::MultiheadAttention cannot run";
}
