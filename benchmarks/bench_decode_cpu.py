"""Decoding on CPU: one query (or a few) per head against a long grouped-query K/V cache,
fusedmha vs PyTorch's F.scaled_dot_product_attention (enable_gqa), timed in alternation in one
process (median per call). Three caches: (B, H_kv, S, E) tensors through the SDPA front door,
and through fusedmha.flash_attn_with_kvcache (the step's L new tokens appended) FlashAttention's
(B, S, H_kv, E) cache and a paged one (pages of --page rows, shuffled); PyTorch reads the
same (B, S, H_kv, E) cache as a view. Decoding reads K/V once per step and computes little, so the
yardstick is memory: K/V bytes read per second against this machine's measured read bandwidth.
Every call starts from cold, clean caches (common.CacheFlush), as each layer's decode step does;
the bandwidth is measured in the same rounds (common.MemoryRead). A plain read of as many bytes
as K/V, in one call from cold caches too ("sum"), is timed in the same rounds: the most any
call could read them at, fixed cost and ramp-up included ("% sum": fusedmha's share of it).

    python benchmarks/bench_decode_cpu.py [--quick] [--lengths 4096 32768]
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedmha  # noqa: E402
from common import CacheFlush, MemoryRead, time_interleaved  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--queries", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=256)
    p.add_argument("--min-time", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    a = p.parse_args()
    if a.quick:
        a.lengths, a.min_time, a.page = [1024], 0.1, 64
    probe, flush = MemoryRead(64 << 20 if a.quick else 512 << 20), CacheFlush()
    H, Hkv, E, L = a.heads, a.kv_heads, a.head_dim, a.queries
    print(f"threads={torch.get_num_threads()} isa={fusedmha.build_info()['cpu_isa_in_use']} "
          f"torch={torch.__version__} B=1 H={H} H_kv={Hkv} L={L} E={E} float32; % bw: of the memory "
          f"read bandwidth measured in the same rounds")
    header = (f"{'S':>7s} {'cache':>9s} {'bw GB/s':>8s} {'sum % bw':>9s} {'fusedmha ms':>12s} {'K/V GB/s':>9s} "
              f"{'% bw':>5s} {'% sum':>6s} {'torch ms':>9s} {'K/V GB/s':>9s} {'% bw':>5s} {'vs torch':>9s}")
    print(header)
    print("-" * len(header))
    torch.manual_seed(0)
    for S in a.lengths:
        q = torch.randn(1, H, L, E)
        k, v = torch.randn(1, Hkv, S, E), torch.randn(1, Hkv, S, E)
        kv_bytes = 2 * Hkv * S * E * 4
        same_bytes = torch.ones(kv_bytes // 4)
        plain_read = lambda: same_bytes.sum()  # noqa: E731
        # FlashAttention's cache layout, the L new tokens appended by each call at rows S - L..S - 1.
        rows = S + a.page
        k_cache, v_cache = torch.randn(1, rows, Hkv, E), torch.randn(1, rows, Hkv, E)
        pages = rows // a.page
        k_pages, v_pages = (t.view(pages, a.page, Hkv, E) for t in (k_cache.clone(), v_cache.clone()))
        table = torch.randperm(pages).view(1, pages).to(torch.int32)
        q_step, k_step, v_step = torch.randn(1, L, H, E), torch.randn(1, L, Hkv, E), torch.randn(1, L, Hkv, E)
        k_view, v_view = k_cache[:, :S].transpose(1, 2), v_cache[:, :S].transpose(1, 2)
        runs = {
            "(B,H,S,E)": (lambda: fusedmha.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                          lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
            "(B,S,H,E)": (lambda: fusedmha.flash_attn_with_kvcache(
                              q_step, k_cache, v_cache, k_step, v_step, cache_seqlens=S - L,
                              causal=True),
                          lambda: F.scaled_dot_product_attention(q, k_view, v_view, enable_gqa=True)),
            "paged": (lambda: fusedmha.flash_attn_with_kvcache(
                          q_step, k_pages, v_pages, k_step, v_step, cache_seqlens=S - L,
                          block_table=table, causal=True),
                      lambda: F.scaled_dot_product_attention(q, k_view, v_view, enable_gqa=True)),
        }
        for name, (ours, theirs) in runs.items():
            t_f, t_t, t_bw, t_sum = time_interleaved([ours, theirs, probe, plain_read], a.min_time,
                                                     before_each=flush)
            g_f, g_t, bandwidth = kv_bytes / t_f / 1e9, kv_bytes / t_t / 1e9, probe.gbps(t_bw)
            g_sum = kv_bytes / t_sum / 1e9
            print(f"{S:7d} {name:>9s} {bandwidth:8.1f} {100 * g_sum / bandwidth:8.0f}% {t_f * 1e3:12.3f} "
                  f"{g_f:9.1f} {100 * g_f / bandwidth:4.0f}% {100 * t_sum / t_f:5.0f}% {t_t * 1e3:9.3f} "
                  f"{g_t:9.1f} {100 * g_t / bandwidth:4.0f}% {t_t / t_f:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
