"""The attention variants on CPU, forward, side by side in one process (timed in alternation,
median per call): a sliding window against full causal attention and against PyTorch's SDPA
given the equivalent bool mask; softcap, ALiBi and sinks against the plain call. Prints time,
GFLOP/s (FlashAttention's count over the keys each query sees) and the ratios.

    python benchmarks/bench_variants_cpu.py [--quick] [--length 8192] [--window 512]
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedmha  # noqa: E402
from common import fma_peak_gflops, time_interleaved  # noqa: E402


def visible_pairs(L, left):
    """(query, key) pairs a causal window of `left` keys back sees, as a count."""
    return sum(min(i, left) + 1 for i in range(L))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--min-time", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    a = p.parse_args()
    if a.quick:
        a.length, a.window, a.heads, a.min_time = 1024, 128, 2, 0.1
    B, H, L, E, W = a.batch, a.heads, a.length, a.head_dim, a.window
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, E) for _ in range(3))
    i, j = torch.arange(L)[:, None], torch.arange(L)
    band = (j <= i) & (j > i - W)  # window (W - 1, 0): W keys including the diagonal
    print(f"threads={torch.get_num_threads()} isa={fusedmha.build_info()['cpu_isa_in_use']} "
          f"torch={torch.__version__} B={B} H={H} L=S={L} E={E} float32, forward")

    peak = fma_peak_gflops(0.25)
    print(f"fp32 FMA peak now: {peak:.0f} GFLOP/s (the % below)")

    def gflops(pairs, t):
        g = 4 * B * H * pairs * E / t / 1e9
        return f"{g:7.1f} GFLOP/s {100 * g / peak:4.0f}%"

    full, causal, window = L * L, visible_pairs(L, L), visible_pairs(L, W - 1)
    sdpa = fusedmha.scaled_dot_product_attention
    print(f"\nsliding window ({W - 1}, 0):")
    t_win, t_causal, t_mask = time_interleaved([
        lambda: sdpa(q, k, v, is_causal=True, window_left=W - 1),
        lambda: sdpa(q, k, v, is_causal=True),
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=band),
    ], a.min_time)
    print(f"  fusedmha window            {t_win * 1e3:9.2f} ms {gflops(window, t_win)}")
    print(f"  fusedmha full causal       {t_causal * 1e3:9.2f} ms {gflops(causal, t_causal)}"
          f"   window is {t_causal / t_win:5.2f}x faster")
    print(f"  torch SDPA, bool band mask {t_mask * 1e3:9.2f} ms {gflops(window, t_mask)} (useful)"
          f"   window is {t_mask / t_win:5.2f}x faster")

    print("\nscore variants, no mask (each against the plain call, same process):")
    slopes = torch.rand(H) * 0.1
    sinks = torch.randn(H)
    for name, kw in [("softcap 50", dict(softcap=50.0)), ("alibi", dict(alibi_slopes=slopes)),
                     ("sinks", dict(sinks=sinks))]:
        t_plain, t_var = time_interleaved([lambda: sdpa(q, k, v), lambda: sdpa(q, k, v, **kw)], a.min_time)
        print(f"  {name:11s} {t_var * 1e3:9.2f} ms vs plain {t_plain * 1e3:9.2f} ms "
              f"(plain {gflops(full, t_plain)}): +{(t_var / t_plain - 1) * 100:5.1f}%", flush=True)


if __name__ == "__main__":
    main()
