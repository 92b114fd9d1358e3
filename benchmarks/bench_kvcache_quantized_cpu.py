"""Quantized KV caches on CPU: one decoding step through fusedmha.flash_attn_with_kvcache (one
new token appended) over float32, bfloat16, int8, float8_e4m3fn and float8_e5m2 caches of the
same grouped-query shape, timed in alternation in one process from cold caches
(common.CacheFlush), beside this machine's read bandwidth (common.MemoryRead) and FMA peak
measured in the same minutes. Each row prints the bytes a step reads (codes and scales), the
rate it reads them at against the bandwidth, and the FLOP rate against the FMA peak (each
cached element costs H / H_kv FMAs, plus its conversion); the speed-ups are paired per round
(common.paired_ratio). Then the accuracy of each dtype: the output's error against float64
attention over the dequantized cache (the kernels' own error) and over the unquantized one
(the quantization's), on keys with a few large channels, as real models' keys have, and what
a per-channel key scale would give instead.

    python benchmarks/bench_kvcache_quantized_cpu.py [--quick] [--shapes 1x32768 8x4096]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedmha  # noqa: E402
from common import CacheFlush, MemoryRead, fma_peak_gflops, paired_ratio, peak_after, time_interleaved  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8,
          "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def caches_of(k_cache, v_cache):
    """Each dtype's cache of the same values: (query dtype, k_cache, v_cache, keywords)."""
    out = {}
    for name, dtype in DTYPES.items():
        if dtype in (torch.float32, torch.bfloat16):
            out[name] = (dtype, k_cache.to(dtype), v_cache.to(dtype), {})
        else:
            (kc, ks), (vc, vs) = fusedmha.quantize_kv(k_cache, dtype), fusedmha.quantize_kv(v_cache, dtype)
            out[name] = (torch.float32, kc, vc, dict(k_scale=ks, v_scale=vs))
    return out


def speed(a, B, S, probe, flush):
    H, Hkv, E = a.heads, a.kv_heads, a.head_dim
    torch.manual_seed(0)
    rows = S + 1  # (room for the step's token: the cache holds S rows after it)
    k_cache, v_cache = torch.randn(B, rows, Hkv, E), torch.randn(B, rows, Hkv, E)
    q, k, v = torch.randn(B, 1, H, E), torch.randn(B, 1, Hkv, E), torch.randn(B, 1, Hkv, E)
    calls = {}
    for name, (dtype, kc, vc, kw) in caches_of(k_cache, v_cache).items():
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        calls[name] = (lambda qd=qd, kc=kc, vc=vc, kd=kd, vd=vd, kw=kw: fusedmha.flash_attn_with_kvcache(
            qd, kc, vc, kd, vd, cache_seqlens=S - 1, causal=True, **kw))
    peak = fma_peak_gflops()
    samples = []
    times = time_interleaved(list(calls.values()) + [probe], a.min_time, before_each=flush,
                             samples=samples)
    peak = peak_after(peak)
    bandwidth = probe.gbps(times[-1])
    elements = 2 * B * S * Hkv * E
    flops = 2 * elements * (H // Hkv)
    print(f"B={B} S={S}: read bandwidth {bandwidth:.1f} GB/s, FMA peak {peak:.0f} GFLOP/s")
    header = (f"{'cache':>9s} {'ms':>8s} {'MB read':>8s} {'GB/s':>6s} {'% bw':>5s} {'GFLOP/s':>8s} "
              f"{'% peak':>7s} {'x fp32':>7s} {'x bf16':>7s}")
    print(header)
    print("-" * len(header))
    names = list(calls)
    for n, name in enumerate(names):
        dtype = DTYPES[name]
        scale_bytes = 0 if dtype in (torch.float32, torch.bfloat16) else 2 * B * S * Hkv * 4
        nbytes = elements * torch.empty((), dtype=dtype).element_size() + scale_bytes
        t = times[n]
        gbps, gflops = nbytes / t / 1e9, flops / t / 1e9
        vs32 = paired_ratio(samples[0], samples[n])
        vs16 = paired_ratio(samples[1], samples[n])
        print(f"{name:>9s} {t * 1e3:8.2f} {nbytes / 1e6:8.1f} {gbps:6.1f} {100 * gbps / bandwidth:4.0f}% "
              f"{gflops:8.1f} {100 * gflops / peak:6.0f}% {vs32:6.2f}x {vs16:6.2f}x", flush=True)


def attention64(q, keys, values):
    """Float64 attention of q (B, 1, H, E) over keys/values (B, S, H_kv, E)."""
    G = q.shape[2] // keys.shape[2]
    qh = q.double().transpose(1, 2)
    kh, vh = (t.double().transpose(1, 2).repeat_interleave(G, 1) for t in (keys, values))
    return torch.softmax(qh @ kh.transpose(-1, -2) / qh.shape[-1] ** 0.5, -1) @ vh


def accuracy(a):
    """Errors of one decoding step, relative to the output's norm."""
    B, S, H, Hkv, E = 2, 4096 if not a.quick else 512, a.heads, a.kv_heads, a.head_dim
    torch.manual_seed(1)
    keys = torch.randn(B, S, Hkv, E)
    keys[..., torch.randperm(E)[:4]] *= 12  # (a few large channels, as real keys have)
    keys += 2 * torch.randn(1, 1, Hkv, E)  # (and per-channel offsets)
    values = torch.randn(B, S, Hkv, E)
    q = torch.randn(B, 1, H, E)
    truth = attention64(q, keys, values)
    norm = truth.norm().item()
    print(f"\naccuracy, B={B} S={S}: relative error of the output (norm of the difference / norm)")
    header = f"{'cache':>9s} {'vs dequantized':>15s} {'vs unquantized':>15s} {'per-channel K':>14s}"
    print(header)
    print("-" * len(header))
    for name in ("int8", "e4m3", "e5m2"):
        dtype = DTYPES[name]
        (kc, ks), (vc, vs) = fusedmha.quantize_kv(keys, dtype), fusedmha.quantize_kv(values, dtype)
        out = fusedmha.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=S, k_scale=ks, v_scale=vs)
        dequant = attention64(q, fusedmha.dequantize_kv(kc, ks, torch.float64),
                              fusedmha.dequantize_kv(vc, vs, torch.float64))
        own = (out.double().transpose(1, 2) - dequant).norm().item() / norm
        rule = (out.double().transpose(1, 2) - truth).norm().item() / norm
        # Keys quantized per channel (one scale per channel and head over the tokens, as KIVI
        # does), values per row: the error such a layout would give, computed here in float64.
        kt = keys.transpose(1, 3)  # (B, E, H_kv, S): rows are channels
        kcodes, kscale = fusedmha.quantize_kv(kt, dtype)
        per_channel = attention64(q, fusedmha.dequantize_kv(kcodes, kscale, torch.float64).transpose(1, 3),
                                  fusedmha.dequantize_kv(vc, vs, torch.float64))
        channel = (per_channel - truth).norm().item() / norm
        print(f"{name:>9s} {own:15.2e} {rule:15.2e} {channel:14.2e}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["1x32768", "8x4096"], help="BxS")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--min-time", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    a = p.parse_args()
    if a.quick:
        a.shapes, a.min_time = ["1x1024"], 0.1
    probe, flush = MemoryRead(64 << 20 if a.quick else 512 << 20), CacheFlush()
    print(f"threads={torch.get_num_threads()} isa={fusedmha.build_info()['cpu_isa_in_use']} "
          f"torch={torch.__version__} H={a.heads} H_kv={a.kv_heads} E={a.head_dim}; one token "
          f"appended and attended per call, float32 queries (bfloat16 for the bfloat16 cache)")
    for shape in a.shapes:
        B, S = map(int, shape.split("x"))
        speed(a, B, S, probe, flush)
    accuracy(a)


if __name__ == "__main__":
    main()
