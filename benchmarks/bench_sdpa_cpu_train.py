"""Forward + backward attention on CPU, side by side in one process: fusedmha vs PyTorch's
F.scaled_dot_product_attention (its fused flash kernel; with dropout, its unfused math path),
timed in alternation (median per step), plain, causal and with dropout 0.1. Prints time,
GFLOP/s (FlashAttention's convention: 4·B·H·L·S·E forward × 3.5 for forward + backward,
halved when causal) and the ratio (>1 = fusedmha faster), then the peak extra memory of one
forward + backward at 16k.

    python benchmarks/bench_sdpa_cpu_train.py [--quick] [--lengths 512 1024 4096]
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedmha  # noqa: E402
from common import (attention_flops, fma_peak_gflops, peak_after, peak_extra_memory,  # noqa: E402
                    peak_memory_in_fresh_process, time_interleaved)

IMPLEMENTATIONS = {"fusedmha": fusedmha.scaled_dot_product_attention, "torch SDPA": F.scaled_dot_product_attention}


def train_step(sdpa, q, k, v, grad_out, **kw):
    def step():
        for t in (q, k, v):
            t.grad = None
        sdpa(q, k, v, **kw).backward(grad_out)
    return step


def run_speed(lengths, dtypes, shapes, E, min_time):
    print(f"threads={torch.get_num_threads()} isa={fusedmha.build_info()['cpu_isa_in_use']} "
          f"torch={torch.__version__} E={E}   forward + backward; %peak: of the fp32 FMA peak, "
          f"measured next to each row (now {fma_peak_gflops(0.25):.0f} GFLOP/s)")
    header = (f"{'dtype':9s} {'B':>2s} {'H':>2s} {'L=S':>6s} {'variant':>11s} {'fusedmha ms':>12s} {'GFLOP/s':>8s} "
              f"{'%peak':>6s} {'torch ms':>10s} {'GFLOP/s':>8s} {'%peak':>6s} {'vs torch':>9s}")
    print(header)
    print("-" * len(header))
    for dtype in dtypes:
        for B, H in shapes:
            for L in lengths:
                q, k, v = (torch.randn(B, H, L, E, dtype=dtype, requires_grad=True) for _ in range(3))
                grad_out = torch.randn(B, H, L, E, dtype=dtype)
                for variant, kw in [("plain", {}), ("causal", {"is_causal": True}),
                                    ("dropout 0.1", {"dropout_p": 0.1})]:
                    causal = variant == "causal"
                    fns = [train_step(f, q, k, v, grad_out, **kw) for f in IMPLEMENTATIONS.values()]
                    peak = fma_peak_gflops()  # next to the timing: the clock drifts
                    t_f, t_t = time_interleaved(fns, min_time)
                    peak = peak_after(peak)
                    flops = 3.5 * attention_flops(B, H, L, L, E, causal)
                    g_f, g_t = flops / t_f / 1e9, flops / t_t / 1e9
                    print(f"{str(dtype).replace('torch.', ''):9s} {B:2d} {H:2d} {L:6d} {variant:>11s} "
                          f"{t_f * 1e3:12.2f} {g_f:8.1f} {100 * g_f / peak:5.0f}% {t_t * 1e3:10.2f} "
                          f"{g_t:8.1f} {100 * g_t / peak:5.0f}% {t_t / t_f:8.2f}x", flush=True)


def measure_memory(name, L, H, E):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, L, E, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(1, H, L, E)
    # Beyond inputs: the output and the three gradients are what any implementation returns.
    returned = 4 * q.numel() * q.element_size()
    extra = peak_extra_memory(lambda: IMPLEMENTATIONS[name](q, k, v).backward(grad_out), returned)
    print(extra)


def run_memory(L, H, E):
    print(f"\nPeak extra memory of forward + backward, B=1 H={H} L=S={L} E={E} float32 "
          "(resident memory beyond inputs, output and gradients):")
    for name in IMPLEMENTATIONS:
        extra = peak_memory_in_fresh_process(__file__, name, L, H, E)
        print(f"  {name:12s} {extra / 2**20:9.1f} MiB", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 4096])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--shapes", nargs="+", default=["1x1", "1x8", "4x8"], help="BxH")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--min-time", type=float, default=1.0)
    p.add_argument("--memory-length", type=int, default=16384)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--measure-memory", nargs=4, metavar=("IMPL", "L", "H", "E"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.measure_memory:
        name, L, H, E = a.measure_memory
        return measure_memory(name, int(L), int(H), int(E))
    if a.quick:
        a.lengths, a.shapes, a.min_time, a.memory_length = [512], ["1x1"], 0.1, 2048
    torch.manual_seed(0)
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes]
    run_speed(a.lengths, [getattr(torch, d) for d in a.dtypes], shapes, a.head_dim, a.min_time)
    run_memory(a.memory_length, 8, a.head_dim)


if __name__ == "__main__":
    main()
