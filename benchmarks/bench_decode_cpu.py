"""Decoding on CPU: one query (or a few) per head against a long grouped-query K/V cache,
fusedmha vs PyTorch's F.scaled_dot_product_attention (enable_gqa), timed in alternation in one
process (median per call). Decoding reads K/V once per step and computes little, so the
yardstick is memory: K/V bytes read per second against this machine's measured read bandwidth.

    python benchmarks/bench_decode_cpu.py [--quick] [--lengths 4096 32768]
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedmha  # noqa: E402
from common import memory_read_gbps, time_interleaved  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--queries", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--min-time", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    a = p.parse_args()
    if a.quick:
        a.lengths, a.min_time = [1024], 0.1
    bandwidth = memory_read_gbps(256 << 20 if a.quick else 1 << 30)
    H, Hkv, E, L = a.heads, a.kv_heads, a.head_dim, a.queries
    print(f"threads={torch.get_num_threads()} isa={fusedmha.build_info()['cpu_isa_in_use']} "
          f"torch={torch.__version__} B=1 H={H} H_kv={Hkv} L={L} E={E} float32; memory read "
          f"bandwidth {bandwidth:.1f} GB/s")
    header = (f"{'S':>7s} {'fusedmha ms':>12s} {'K/V GB/s':>9s} {'% bw':>5s} {'torch ms':>9s} "
              f"{'K/V GB/s':>9s} {'% bw':>5s} {'vs torch':>9s}")
    print(header)
    print("-" * len(header))
    torch.manual_seed(0)
    for S in a.lengths:
        q = torch.randn(1, H, L, E)
        k, v = torch.randn(1, Hkv, S, E), torch.randn(1, Hkv, S, E)
        kv_bytes = 2 * Hkv * S * E * 4
        t_f, t_t = time_interleaved([
            lambda: fusedmha.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        ], a.min_time)
        g_f, g_t = kv_bytes / t_f / 1e9, kv_bytes / t_t / 1e9
        print(f"{S:7d} {t_f * 1e3:12.3f} {g_f:9.1f} {100 * g_f / bandwidth:4.0f}% {t_t * 1e3:9.3f} "
              f"{g_t:9.1f} {100 * g_t / bandwidth:4.0f}% {t_t / t_f:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
