"""FlexAttention block masks on CPU: fusedmha.flex_attention against PyTorch's SDPA with the
equivalent dense boolean mask, and against torch.compile(flex_attention) (forward: torch's has
no CPU backward), for document masking (causal within documents of random lengths), prefix-LM
and a sliding window, timed in alternation in one process (common.time_interleaved; ratios
paired per round). Each row prints the share of the L·S scores the pattern keeps, the time of
torch's create_block_mask and of fusedmha's first call (which evaluates the BlockMask's
partial blocks once), and the steady-state rates against this machine's FMA peak (measured
beside them) counting the kept scores only; "max x" is the most any kernel could be faster
than SDPA on this machine (SDPA's time over the kept scores' FMAs at the FMA peak). Also the
sliding window against fusedmha's own window_size path, and a BlockMask with every block full
against the unmasked call, and the SDPA drop-in given the document mask as a float mask of 0
and -inf against the same mask as a bool (both read tile by tile, the float one 4 bytes an
element).

    python benchmarks/bench_flex_cpu.py [--quick] [--length 8192] [--no-compile]
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, create_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedmha  # noqa: E402
from common import fma_peak_gflops, paired_ratio, peak_after, time_interleaved  # noqa: E402


def patterns(L, documents, prefix, window):
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(L - 1, generator=g)[: documents - 1] + 1).values
    doc = torch.zeros(L, dtype=torch.long)
    doc[cuts] = 1
    doc = doc.cumsum(0)
    return {
        f"document x{documents}": lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv),
        f"prefix-LM {prefix}": lambda b, h, q, kv: (kv < prefix) | (q >= kv),
        f"window {window}": lambda b, h, q, kv: (q >= kv) & (q - kv <= window),
    }


def timed_once(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--min-time", type=float, default=1.0)
    parser.add_argument("--no-compile", action="store_true",
                        help="skip torch.compile(flex_attention)")
    parser.add_argument("--quick", action="store_true", help="small sizes, no compile: a smoke run")
    a = parser.parse_args()
    if a.quick:
        a.length, a.heads, a.min_time, a.no_compile = 512, 2, 0.05, True
    L, H, E = a.length, a.heads, a.head_dim
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, L, E, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, H, L, E)
    qd, kd, vd = (t.detach() for t in (q, k, v))  # (torch's CPU flex_attention: no grad)
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} B=1 H={H} L=S={L} E={E} "
          "float32; rates count the kept scores only (4·E FLOP each forward, 10·E forward and "
          "backward)")
    compiled = None if a.no_compile else torch.compile(torch_flex)
    header = (f"{'pattern':>16} {'kept':>6} {'mask ms':>8} {'1st ms':>8} {'fwd ms':>8} "
              f"{'x sdpa':>7} {'max x':>7} {'x flex':>7} {'% peak':>7} {'f+b ms':>8} "
              f"{'x sdpa':>7} {'max x':>7} {'% peak':>7}")
    print(header)
    print("-" * len(header))
    document = None
    for name, mask_mod in patterns(L, 8, L // 8, 512).items():
        built = time.perf_counter()
        block_mask = create_block_mask(mask_mod, None, None, L, L, device="cpu")
        mask_ms = (time.perf_counter() - built) * 1e3
        first_ms = timed_once(lambda: fusedmha.flex_attention(q, k, v, block_mask=block_mask)) * 1e3
        dense = create_mask(mask_mod, 1, 1, L, L, device="cpu")
        kept = dense.float().mean().item()
        document = dense if document is None else document
        with torch.no_grad():
            forward = [lambda: fusedmha.flex_attention(q, k, v, block_mask=block_mask),
                       lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)]
            compile_note = ""
            if compiled is not None:
                compile_s = timed_once(lambda: compiled(qd, kd, vd, block_mask=block_mask))
                compile_note = f"  (torch.compile(flex_attention): {compile_s:.1f} s to compile)"
                forward.append(lambda: compiled(qd, kd, vd, block_mask=block_mask))
            peak = fma_peak_gflops()
            samples = []
            fwd = time_interleaved(forward, a.min_time, samples=samples)
            peak = peak_after(peak)
        x_sdpa = paired_ratio(samples[1], samples[0])
        x_flex = "      -"
        if compiled is not None:
            x_flex = f"{paired_ratio(samples[2], samples[0]):6.2f}x"

        def train(fn):
            return lambda: torch.autograd.grad(fn(), (q, k, v), grad)

        samples_t = []
        both = time_interleaved(
            [train(lambda: fusedmha.flex_attention(q, k, v, block_mask=block_mask)),
             train(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense))],
            a.min_time, samples=samples_t)
        scores = kept * H * L * L
        fwd_at_peak, both_at_peak = (n * E * scores / (peak * 1e9) for n in (4, 10))
        print(f"{name:>16} {kept:6.1%} {mask_ms:8.1f} {first_ms:8.1f} {fwd[0] * 1e3:8.1f} "
              f"{x_sdpa:6.2f}x {fwd[1] / fwd_at_peak:6.1f}x {x_flex} "
              f"{fwd_at_peak / fwd[0]:7.1%} {both[0] * 1e3:8.1f} "
              f"{paired_ratio(samples_t[1], samples_t[0]):6.2f}x "
              f"{both[1] / both_at_peak:6.1f}x {both_at_peak / both[0]:7.1%}{compile_note}")
    # The window as a BlockMask against the kernels' own window, and all-full against unmasked.
    window = create_block_mask(lambda b, h, qi, kv: (qi >= kv) & (qi - kv <= 512), None, None, L,
                               L, device="cpu")
    full = create_block_mask(lambda b, h, qi, kv: qi >= 0, None, None, L, L, device="cpu")
    qf, kf, vf = (t.detach().transpose(1, 2) for t in (q, k, v))
    with torch.no_grad():
        samples = []
        time_interleaved([lambda: fusedmha.flex_attention(q, k, v, block_mask=window),
                          lambda: fusedmha.flash_attn_func(qf, kf, vf, causal=True,
                                                           window_size=(512, 0)),
                          lambda: fusedmha.flex_attention(q, k, v, block_mask=full),
                          lambda: fusedmha.scaled_dot_product_attention(q, k, v)],
                         a.min_time, samples=samples)
    print(f"window 512 as a BlockMask: {paired_ratio(samples[0], samples[1]):.2f}x the time of "
          "flash_attn_func(window_size=(512, 0))")
    print(f"every block full: {paired_ratio(samples[2], samples[3]):.2f}x the time of the "
          "unmasked call")
    as_float = torch.zeros(document.shape).masked_fill(~document, float("-inf"))
    sdpa = fusedmha.scaled_dot_product_attention
    with torch.no_grad():
        samples = []
        time_interleaved([lambda: sdpa(q, k, v, attn_mask=as_float),
                          lambda: sdpa(q, k, v, attn_mask=document)], a.min_time, samples=samples)
    print(f"document mask as a float mask of 0 and -inf: "
          f"{paired_ratio(samples[0], samples[1]):.2f}x the time of the bool mask")


if __name__ == "__main__":
    main()
