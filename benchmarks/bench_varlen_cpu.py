"""Ragged batches on CPU: a batch of sequences of random lengths (BERT-like: lengths uniform
in [32, 512], H=12, E=64), run three ways, timed in alternation in one process (median per
call), forward only:
  - fusedmha.flash_attn_varlen_func on the packed sequences (no work on padding);
  - PyTorch's F.scaled_dot_product_attention on the padded batch with its key padding mask;
  - fusedmha.scaled_dot_product_attention on the same padded batch and mask.
GFLOP/s count only the real (unpadded) work, against this machine's fp32 FMA peak.
"work ratio" is the padded call's work over the packed call's: fusedmha's padded path skips
the padded keys (suffix padding), so it computes S·len scores for a sequence of len tokens
(its padded queries still attend to its keys) against len² packed — the most packing can
gain over it when both run at the same speed (not causal; with --causal the padded call gets
a dense mask and computes everything).

    python benchmarks/bench_varlen_cpu.py [--quick] [--batch 32] [--min-len 32] [--max-len 512]
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedmha  # noqa: E402
from common import fma_peak_gflops, peak_after, time_interleaved  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one batch per seed")
    p.add_argument("--min-time", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    a = p.parse_args()
    if a.quick:
        a.batch, a.max_len, a.seeds, a.min_time = 4, 64, [0], 0.1
    B, H, E = a.batch, a.heads, a.head_dim
    print(f"threads={torch.get_num_threads()} isa={fusedmha.build_info()['cpu_isa_in_use']} "
          f"torch={torch.__version__} B={B} H={H} E={E} lengths uniform in [{a.min_len}, "
          f"{a.max_len}] causal={a.causal} float32, forward")
    header = (f"{'seed':>4s} {'tokens':>7s} {'pad %':>6s} {'varlen ms':>10s} {'GFLOP/s':>8s} "
              f"{'% peak':>7s} {'torch pad ms':>13s} {'fused pad ms':>13s} {'vs torch':>9s} "
              f"{'vs fused pad':>13s} {'work ratio':>11s}")
    print(header)
    print("-" * len(header))
    for seed in a.seeds:
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(a.min_len, a.max_len + 1, (B,), generator=g)
        S, total = int(lens.max()), int(lens.sum())
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
        q, k, v = (torch.randn(total, H, E, generator=g) for _ in range(3))
        # The same sequences padded to (B, H, S, E), with the key padding mask.
        padded = [torch.zeros(B, S, H, E) for _ in range(3)]
        for b in range(B):
            for dst, src in zip(padded, (q, k, v)):
                dst[b, : lens[b]] = src[cu[b]:cu[b + 1]]
        qp, kp, vp = (t.transpose(1, 2) for t in padded)
        mask = (torch.arange(S)[None, :] < lens[:, None])[:, None, None, :]  # (B, 1, 1, S)
        peak = fma_peak_gflops()
        t_v, t_t, t_f = time_interleaved([
            lambda: fusedmha.flash_attn_varlen_func(q, k, v, cu, cu, S, S, causal=a.causal),
            lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=False)
            if not a.causal else F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask & torch.ones(S, S, dtype=torch.bool).tril()),
            lambda: fusedmha.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)
            if not a.causal else fusedmha.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask & torch.ones(S, S, dtype=torch.bool).tril()),
        ], a.min_time)
        peak = peak_after(peak)
        flops = sum(4 * H * int(n) * int(n) * E for n in lens) / (2 if a.causal else 1)
        gflops = flops / t_v / 1e9
        pad = 100 * (1 - total / (B * S))
        work = sum(S * int(n) for n in lens) / sum(int(n) * int(n) for n in lens)
        work_ratio = f"{'-':>11s}" if a.causal else f"{work:10.2f}x"
        print(f"{seed:4d} {total:7d} {pad:5.0f}% {t_v * 1e3:10.2f} {gflops:8.1f} "
              f"{100 * gflops / peak:6.0f}% {t_t * 1e3:13.2f} {t_f * 1e3:13.2f} "
              f"{t_t / t_v:8.2f}x {t_f / t_v:12.2f}x {work_ratio}", flush=True)


if __name__ == "__main__":
    main()
