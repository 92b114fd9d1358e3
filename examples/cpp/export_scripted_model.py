"""Exports a model that uses fusedmha.MultiheadAttention for C++ serving, two ways, with an
input and the output Python computes, for the C++ example to load and check:

  OUT_DIR/model.pt2   torch.export + AOTInductor (aoti_compile_and_package): compiled code
                      that calls fusedmha's ops by name through the dispatcher
  OUT_DIR/model.pt    TorchScript (torch.jit.script)

    python examples/cpp/export_scripted_model.py OUT_DIR
    fusedmha_example OUT_DIR
"""

import os
import sys

import torch

import fusedmha


class Encoder(torch.nn.Module):
    """Self-attention + LayerNorm, causal: a minimal serving model."""

    def __init__(self, embed=64, heads=4):
        super().__init__()
        self.attn = fusedmha.MultiheadAttention(embed, heads, batch_first=True)
        self.norm = torch.nn.LayerNorm(embed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.attn(x, x, x, need_weights=False, is_causal=True)
        return self.norm(x + y)


class TensorFile(torch.nn.Module):
    """One tensor in a file that C++ reads with torch::jit::load(...).attr("tensor")."""

    def __init__(self, tensor):
        super().__init__()
        self.register_buffer("tensor", tensor)


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    model = Encoder().eval()
    x = torch.randn(2, 24, 64)
    with torch.no_grad():
        expected = model(x)
    torch.jit.script(model).save(os.path.join(out_dir, "model.pt"))
    exported = torch.export.export(model, (x,))
    torch._inductor.aoti_compile_and_package(exported, package_path=os.path.join(out_dir, "model.pt2"))
    torch.jit.script(TensorFile(x)).save(os.path.join(out_dir, "input.pt"))
    torch.jit.script(TensorFile(expected)).save(os.path.join(out_dir, "expected.pt"))
    print(f"exported to {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1])
