"""Module level, side by side in one process: fusedmha.MultiheadAttention vs
torch.nn.MultiheadAttention with the same weights, self-attention over a batch of padded
sequences (a key_padding_mask), batch_first, timed in alternation (median per call).

  infer+weights  eval, no_grad, need_weights=True (PyTorch's default: its unfused path)
  infer          eval, no_grad, need_weights=False (PyTorch's fast path)
  train          training mode, dropout 0.1, need_weights=False (as nn.Transformer* layers
                 call it), forward + backward

float32, and bfloat16 under torch.autocast("cpu"). Prints times and the ratio (>1 = fusedmha
faster), then the peak extra memory of one training step at L=4096 in a fresh process.

    python benchmarks/bench_mha_cpu.py [--quick] [--lengths 128 512 2048]
"""

import argparse
import contextlib
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedmha  # noqa: E402
from common import (fma_peak_gflops, peak_after, peak_extra_memory, peak_memory_in_fresh_process,  # noqa: E402
                    time_interleaved)

MODES = ["infer+weights", "infer", "train"]


def make_modules(embed, heads, dropout):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(embed, heads, dropout=dropout, batch_first=True)
    fused = fusedmha.MultiheadAttention(embed, heads, dropout=dropout, batch_first=True)
    fused.load_state_dict(ref.state_dict())
    return {"fusedmha": fused, "torch": ref}


def padded_batch(batch, length, embed, requires_grad=False):
    x = torch.randn(batch, length, embed, requires_grad=requires_grad)
    # Sequence b is padded over its last b/(2·batch) fraction: up to half padding.
    lengths = [length - (length * b) // (2 * batch) for b in range(batch)]
    padding = torch.arange(length)[None, :] >= torch.tensor(lengths)[:, None]
    return x, padding


def step_fn(module, mode, x, padding, grad, autocast):
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext

    if mode == "train":
        module.train()

        def step():
            module.zero_grad(set_to_none=True)
            x.grad = None
            with amp():
                out = module(x, x, x, key_padding_mask=padding, need_weights=False)[0]
            out.backward(grad)
    else:
        module.eval()
        need_weights = mode == "infer+weights"

        def step():
            with torch.no_grad(), amp():
                module(x, x, x, key_padding_mask=padding, need_weights=need_weights)
    return step


def run_speed(lengths, batch, embed, heads, modes, precisions, min_time):
    print(f"threads={torch.get_num_threads()} isa={fusedmha.build_info()['cpu_isa_in_use']} "
          f"torch={torch.__version__}  embed={embed} heads={heads} batch={batch}, "
          "self-attention with key_padding_mask; GFLOP/s: the four projections and the attention "
          "(3x for training), %peak: of the fp32 FMA peak measured next to each row")
    header = (f"{'precision':15s} {'L':>5s} {'mode':>14s} {'fusedmha ms':>12s} {'GFLOP/s':>8s} {'%peak':>6s} "
              f"{'torch ms':>10s} {'vs torch':>9s}")
    print(header)
    print("-" * len(header))
    modules = make_modules(embed, heads, dropout=0.1)
    for precision in precisions:
        autocast = precision == "bf16 autocast"
        for L in lengths:
            for mode in modes:
                x, padding = padded_batch(batch, L, embed, requires_grad=mode == "train")
                grad = torch.randn(batch, L, embed, dtype=torch.bfloat16 if autocast else torch.float32)
                fns = [step_fn(m, mode, x, padding, grad, autocast) for m in modules.values()]
                peak = fma_peak_gflops()  # next to the timing: the clock drifts
                t_f, t_t = time_interleaved(fns, min_time)
                peak = peak_after(peak)
                flops = (8 * batch * L * embed * embed + 4 * batch * L * L * embed) * (3 if mode == "train" else 1)
                g_f = flops / t_f / 1e9
                print(f"{precision:15s} {L:5d} {mode:>14s} {t_f * 1e3:12.2f} {g_f:8.1f} {100 * g_f / peak:5.0f}% "
                      f"{t_t * 1e3:10.2f} {t_t / t_f:8.2f}x", flush=True)


def measure_memory(name, L, heads, embed):
    module = make_modules(embed, heads, dropout=0.1)[name]
    x, padding = padded_batch(1, L, embed, requires_grad=True)
    grad = torch.randn(1, L, embed)
    step = step_fn(module, "train", x, padding, grad, autocast=False)
    # Beyond the inputs: the input's and the parameters' gradients, which any
    # implementation returns.
    returned = x.numel() * 4 + sum(p.numel() * 4 for p in module.parameters())
    print(peak_extra_memory(step, returned))


def run_memory(L, heads, embed):
    print(f"\nPeak extra memory of a training step (dropout 0.1), batch 1, L={L}, embed={embed}, "
          f"heads={heads}, float32 (resident memory beyond inputs and gradients):")
    for name in ("fusedmha", "torch"):
        extra = peak_memory_in_fresh_process(__file__, name, L, heads, embed)
        print(f"  {name:9s} {extra / 2**20:9.1f} MiB", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--embed", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--precisions", nargs="+", default=["float32", "bf16 autocast"])
    p.add_argument("--min-time", type=float, default=1.0)
    p.add_argument("--memory-length", type=int, default=4096)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--measure-memory", nargs=4, metavar=("IMPL", "L", "H", "E"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.measure_memory:
        name, L, H, E = a.measure_memory
        return measure_memory(name, int(L), int(H), int(E))
    if a.quick:
        a.lengths, a.batch, a.min_time, a.memory_length = [64], 2, 0.05, 256
    run_speed(a.lengths, a.batch, a.embed, a.heads, a.modes, a.precisions, a.min_time)
    run_memory(a.memory_length, a.heads, a.embed)


if __name__ == "__main__":
    main()
