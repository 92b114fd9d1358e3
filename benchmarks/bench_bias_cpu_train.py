"""Training a learnt attention bias on CPU: forward + backward of attention whose float mask
requires grad (a T5/Swin-style relative position bias), side by side in one process:
fusedmha with the bias learnt, fusedmha with the same bias detached (the cost of its gradient
is the difference), and PyTorch's F.scaled_dot_product_attention with the bias learnt, timed
in alternation (paired ratios, median over rounds). Then the peak extra resident memory of
one learnt-bias step, each in a fresh process, beside the size of one B·H·L·S float32 tensor
(what materialising the scores or their gradient would cost).

    python benchmarks/bench_bias_cpu_train.py [--quick] [--bias-shapes HLS LS B1LS]
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedmha  # noqa: E402
from common import (fma_peak_gflops, paired_ratio, peak_after, peak_extra_memory,  # noqa: E402
                    peak_memory_in_fresh_process, time_interleaved)

IMPLEMENTATIONS = {"fusedmha": fusedmha.scaled_dot_product_attention,
                   "torch SDPA": F.scaled_dot_product_attention}


def bias_shape(name, B, H, L):
    """The bias's shape from its broadcast pattern's name (HLS: one (L, S) table per head)."""
    sizes = dict(B=B, H=H, L=L, S=L, **{"1": 1})
    return tuple(sizes[c] for c in name)


def make_problem(B, H, L, E, dtype, shape):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, E, dtype=dtype, requires_grad=True) for _ in range(3))
    bias = (torch.randn(bias_shape(shape, B, H, L)) * 0.5).to(dtype).requires_grad_()
    return q, k, v, bias, torch.randn(B, H, L, E, dtype=dtype)


def train_step(sdpa, q, k, v, bias, grad_out, learn):
    mask = bias if learn else bias.detach()

    def step():
        for t in (q, k, v, bias):
            t.grad = None
        sdpa(q, k, v, attn_mask=mask).backward(grad_out)
    return step


def run_speed(B, H, L, E, dtypes, shapes, min_time):
    print(f"threads={torch.get_num_threads()} isa={fusedmha.build_info()['cpu_isa_in_use']} "
          f"torch={torch.__version__}   forward + backward, B={B} H={H} L=S={L} E={E}; "
          f"fp32 FMA peak measured next to each row (now {fma_peak_gflops(0.25):.0f} GFLOP/s)")
    header = (f"{'dtype':9s} {'bias':>5s} {'detached ms':>12s} {'learnt ms':>10s} "
              f"{'learnt/detached':>16s} {'torch ms':>9s} {'vs torch':>9s} {'peak GFLOP/s':>13s}")
    print(header)
    print("-" * len(header))
    for dtype in dtypes:
        for shape in shapes:
            q, k, v, bias, grad_out = make_problem(B, H, L, E, dtype, shape)
            fns = [train_step(fusedmha.scaled_dot_product_attention, q, k, v, bias, grad_out, False),
                   train_step(fusedmha.scaled_dot_product_attention, q, k, v, bias, grad_out, True),
                   train_step(F.scaled_dot_product_attention, q, k, v, bias, grad_out, True)]
            peak = fma_peak_gflops()
            samples = []
            t_detached, t_learnt, t_torch = time_interleaved(fns, min_time, samples=samples)
            peak = peak_after(peak)
            print(f"{str(dtype).replace('torch.', ''):9s} {shape:>5s} {t_detached * 1e3:12.1f} "
                  f"{t_learnt * 1e3:10.1f} {paired_ratio(samples[1], samples[0]):15.2f}x "
                  f"{t_torch * 1e3:9.1f} {paired_ratio(samples[2], samples[1]):8.2f}x "
                  f"{peak:13.0f}", flush=True)


def measure_memory(name, B, H, L, E, dtype, shape):
    # A small step first: what the first call of a process sets up once (thread pools,
    # libraries loaded lazily) is not the step's memory. (Not a step of the full size: the
    # allocator could keep its freed memory resident and hide the next step's peak.)
    train_step(IMPLEMENTATIONS[name], *make_problem(1, H, 64, E, getattr(torch, dtype), shape)[:4],
               torch.randn(1, H, 64, E, dtype=getattr(torch, dtype)), True)()
    q, k, v, bias, grad_out = make_problem(B, H, L, E, getattr(torch, dtype), shape)
    # Beyond inputs: the output and the four gradients are what any implementation returns.
    returned = 4 * q.numel() * q.element_size() + bias.numel() * bias.element_size()
    step = train_step(IMPLEMENTATIONS[name], q, k, v, bias, grad_out, True)
    print(peak_extra_memory(step, returned))


def run_memory(B, H, L, E, dtypes, shapes):
    scores = B * H * L * L * 4
    print(f"\nPeak extra memory of one learnt-bias forward + backward, B={B} H={H} L=S={L} E={E} "
          f"(resident memory beyond inputs, output and gradients; one B·H·L·S float32 tensor is "
          f"{scores / 2**20:.0f} MiB):")
    for dtype in dtypes:
        for shape in shapes:
            row = []
            for name in IMPLEMENTATIONS:
                extra = peak_memory_in_fresh_process(__file__, name, B, H, L, E, dtype, shape)
                row.append(f"{name} {extra / 2**20:7.1f} MiB ({extra / scores:4.2f}×)")
            print(f"  {dtype:9s} {shape:>5s}  " + "   ".join(row), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, nargs=4, default=[4, 8, 1024, 64], metavar=("B", "H", "L", "E"))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--bias-shapes", nargs="+", default=["HLS", "LS", "B1LS"],
                   help="the bias's broadcast pattern over (B, H, L, S), 1 for a broadcast dim")
    p.add_argument("--min-time", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--measure-memory", nargs=7, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.measure_memory:
        name, B, H, L, E, dtype, shape = a.measure_memory
        return measure_memory(name, int(B), int(H), int(L), int(E), dtype, shape)
    if a.quick:
        a.size, a.bias_shapes, a.min_time = [1, 2, 256, 32], ["HLS"], 0.1
    B, H, L, E = a.size
    run_speed(B, H, L, E, [getattr(torch, d) for d in a.dtypes], a.bias_shapes, a.min_time)
    run_memory(B, H, L, E, a.dtypes, a.bias_shapes)


if __name__ == "__main__":
    main()
