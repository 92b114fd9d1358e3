// A tiny transformer block on fusedmha::MultiheadAttention, trained for a few
// steps on a synthetic task, saved and reloaded; then the attention op called
// by name through the dispatcher, and (given the directory
// export_scripted_model.py wrote) a model that uses fusedmha.MultiheadAttention
// exported from Python, run from C++ both as an AOTInductor package and as
// TorchScript.
//
//   fusedmha_example [EXPORT_DIR]
//
// Exits non-zero if any step does not do what it should.

#include <fusedmha/fusedmha.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <iostream>

namespace {

// Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)).
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t embed, int64_t heads)
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({embed})))),
        attn(register_module("attn", fusedmha::MultiheadAttention(
                                         fusedmha::MultiheadAttentionOptions(embed, heads)
                                             .dropout(0.1)
                                             .batch_first(true)))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({embed})))),
        mlp(register_module("mlp", torch::nn::Sequential(torch::nn::Linear(embed, 4 * embed),
                                                         torch::nn::GELU(),
                                                         torch::nn::Linear(4 * embed, embed)))) {}

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& padding) {
    const torch::Tensor h = ln1(x);
    // Causal attention over the real tokens: is_causal plus a key padding mask.
    torch::Tensor y = x + std::get<0>(attn->forward(h, h, h, padding, /*need_weights=*/false,
                                                    /*attn_mask=*/{}, true, /*is_causal=*/true));
    return y + mlp->forward(ln2(y));
  }

  torch::nn::LayerNorm ln1, ln2;
  fusedmha::MultiheadAttention attn;
  torch::nn::Sequential mlp;
};
TORCH_MODULE(Block);

bool check(bool ok, const char* what) {
  std::cout << (ok ? "  ok   " : "  FAIL ") << what << "\n";
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  torch::manual_seed(0);
  const torch::Device device = torch::cuda::is_available() ? torch::kCUDA : torch::kCPU;
  std::cout << "fusedmha " << fusedmha::build_info().version << " on " << device << "\n";
  bool ok = true;

  // 1. Train: predict a running mean of the inputs (needs causal attention).
  const int64_t batch = 8, len = 32, embed = 64;
  Block block(embed, 4);
  block->to(device);
  torch::optim::Adam opt(block->parameters(), torch::optim::AdamOptions(3e-3));
  const auto x = torch::randn({batch, len, embed}, device);
  const auto target = x.cumsum(1) / torch::arange(1, len + 1, x.options()).view({1, len, 1});
  auto padding = torch::zeros({batch, len}, x.options().dtype(torch::kBool));
  padding.index_put_({torch::indexing::Slice(0, batch / 2), torch::indexing::Slice(len - 4)}, true);
  const auto real = padding.logical_not().unsqueeze(-1);
  auto loss_of = [&] {
    return ((block->forward(x, padding) - target).pow(2) * real).sum() / real.sum() / embed;
  };
  double first = 0, last = 0;
  for (int step = 0; step < 40; ++step) {
    opt.zero_grad();
    const auto loss = loss_of();
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  std::printf("  training loss %.4f -> %.4f over 40 steps\n", first, last);
  ok &= check(last < 0.5 * first, "the block trains");

  // 2. Save and reload into a fresh block.
  block->eval();
  const auto path = std::filesystem::temp_directory_path() / "fusedmha_example_block.pt";
  torch::save(block, path.string());
  Block reloaded(embed, 4);
  torch::load(reloaded, path.string());
  reloaded->to(device);
  reloaded->eval();
  torch::NoGradGuard no_grad;
  ok &= check(torch::equal(block->forward(x, padding), reloaded->forward(x, padding)),
              "torch::save / torch::load round trip");
  std::filesystem::remove(path);

  // 3. The op by name, as an app that only knows the dispatcher would call it.
  const auto op = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("fusedmha::scaled_dot_product_attention", "")
                      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const std::optional<at::Tensor>&, double, bool,
                                        std::optional<double>, bool, int64_t, int64_t, bool,
                                        double, const std::optional<at::Tensor>&,
                                        const std::optional<at::Tensor>&)>();
  const auto q = torch::randn({2, 4, 16, 32}, device);
  // The schema's arguments: SDPA's, then the variants (window, alignment,
  // softcap, ALiBi slopes, sinks), here all off.
  const auto by_name = op.call(q, q, q, std::nullopt, 0.0, true, std::nullopt, false, -1, -1,
                               false, 0.0, std::nullopt, std::nullopt);
  const auto reference = at::scaled_dot_product_attention(q, q, q, {}, 0.0, true);
  ok &= check(torch::allclose(by_name, reference, 1e-5, 1e-5), "op called through the dispatcher");

  // 4. A model exported from Python, served here.
  if (argc == 2) {
    const std::filesystem::path dir = argv[1];
    auto tensor_file = [&](const char* name) {
      return torch::jit::load((dir / name).string()).attr("tensor").toTensor();
    };
    const auto input = tensor_file("input.pt"), expected = tensor_file("expected.pt");
    torch::inductor::AOTIModelPackageLoader aoti((dir / "model.pt2").string());
    const auto compiled = aoti.run({input}).at(0);
    ok &= check(torch::allclose(compiled, expected, 1e-5, 1e-5),
                "AOTInductor package from Python (torch.export)");
    torch::jit::script::Module scripted = torch::jit::load((dir / "model.pt").string());
    ok &= check(torch::allclose(scripted.forward({input}).toTensor(), expected, 1e-5, 1e-5),
                "TorchScript model from Python");
  }
  std::cout << (ok ? "example passed\n" : "example FAILED\n");
  return ok ? 0 : 1;
}
