"""Exports a model that uses fusedmha.MultiheadAttention as TorchScript, with an input and
the output Python computes, for the C++ example to load and check:

    python examples/cpp/export_scripted_model.py OUT_DIR
    fusedmha_example OUT_DIR/model.pt OUT_DIR/input.pt OUT_DIR/expected.pt
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
    torch.jit.script(TensorFile(x)).save(os.path.join(out_dir, "input.pt"))
    torch.jit.script(TensorFile(expected)).save(os.path.join(out_dir, "expected.pt"))
    print(f"exported to {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1])
