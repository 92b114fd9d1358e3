"""Training smoke tests: a 2-layer transformer whose attention calls fusedmha follows the same
loss curve as the same model calling PyTorch's SDPA; a trainable relative-position bias
(examples/python/train_relative_position_bias.py) learns through fusedmha.MultiheadAttention
as through torch.nn.MultiheadAttention."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import fusedmha
# examples/python: on sys.path through pytest's pythonpath (pyproject.toml)
import train_relative_position_bias as example


class Block(nn.Module):
    def __init__(self, dim, heads, sdpa):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, L, 3, self.heads, D // self.heads).unbind(2)
        y = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, L, D))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, sdpa, vocab=64, dim=64, heads=4, layers=2, max_len=32):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(max_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, sdpa) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def set_sdpa(self, sdpa):
        for block in self.blocks:
            block.sdpa = sdpa


def train(model, data, steps=50):
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        tokens = data[step % len(data)]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_two_layer_transformer_matches_pytorch_sdpa():
    torch.manual_seed(0)
    # A learnable pattern: each sequence counts up modulo the vocabulary from a random start.
    starts = torch.randint(0, 64, (10, 16, 1))
    data = list((starts + torch.arange(25)) % 64)
    ours = TinyLM(fusedmha.scaled_dot_product_attention)
    theirs = copy.deepcopy(ours)
    theirs.set_sdpa(F.scaled_dot_product_attention)
    a, b = train(ours, data), train(theirs, data)
    assert a[-1] < 0.5 * a[0], f"did not learn: {a[0]:.3f} -> {a[-1]:.3f}"
    for step, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 2e-3 * max(1.0, abs(y)), f"step {step}: fusedmha {x:.6f} vs PyTorch {y:.6f}"


def test_relative_position_bias_example_learns_like_pytorch():
    """examples/python/train_relative_position_bias.py at a small size: the bucketed bias table,
    the model's only position information, trains through fusedmha.MultiheadAttention's float
    attn_mask exactly as through torch.nn.MultiheadAttention's.

    The two runs differ only in summation order inside attention: a few float32 ulps of the loss
    (~5e-7 observed over 80 steps) and float64's ~1e-15. The bounds (2e-5 and 1e-12) are ~40x
    and ~500x that, and far below what a wrong bias gradient does: the table is the only way to
    find the token `lag` back (with it frozen at zero the loss is still 2.3 after 80 steps)."""
    sizes = dict(steps=80, batch=8, length=16, vocab=16, lag=3, dim=32, heads=4, layers=2,
                 num_buckets=8, max_distance=16, log=None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (tiny shapes: a second thread only contends)
    try:
        runs = {dtype: example.train(dtype=dtype, **sizes) for dtype in ("float32", "float64")}
    finally:
        torch.set_num_threads(threads)
    lag_bucket = example.relative_position_bucket(torch.tensor(-3), 8, 16, bidirectional=False)
    for dtype, tol in (("float32", 2e-5), ("float64", 1e-12)):
        ours, ref = runs[dtype]["fusedmha"], runs[dtype]["torch"]
        losses, ref_losses = (torch.tensor(run["losses"], dtype=torch.float64) for run in (ours, ref))
        assert losses[0] > 2.5 and losses[-1] < 0.1, f"{dtype}: {losses[0]:.3f} -> {losses[-1]:.4f}"
        # Every head learnt to favour the keys `lag` back.
        assert (ours["bias"].argmax(0) == lag_bucket).all(), f"{dtype}: {ours['bias']}"
        torch.testing.assert_close(losses, ref_losses, atol=tol, rtol=tol)
        torch.testing.assert_close(ours["bias"], ref["bias"], atol=tol, rtol=tol)
