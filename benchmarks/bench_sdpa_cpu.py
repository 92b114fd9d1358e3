"""Forward attention on CPU, side by side in one process: fusedmha vs PyTorch's
F.scaled_dot_product_attention (its fused CPU flash kernel) vs an unfused textbook
implementation, timed in alternation (median per call). Prints time, GFLOP/s and the ratios
(>1 = fusedmha faster), then the peak extra memory of a 16k×16k attention.

Variants: plain, causal, a float (L, S) mask ("mask"), a bool mask per head, (B, H, L, S), that
hides a fifth of the scores at random ("head-mask"), a float mask per head of random terms
(B, H, L, S) ("head-float"), ALiBi-style float biases, one (L, S)
matrix per head that the batch shares, (1, H, L, S) ("bias"), a bool key padding mask of shape
(B, 1, 1, S) that pads the last eighth of the keys ("pad"), and the bool (B, 1, L, S) causal
mask with left padding (up to 3/16 of the keys) that transformers passes for a padded batch
("hf-mask", read as the causal band and key spans). For the masks, "of unmasked" is
fusedmha's unmasked time (plain; causal for hf-mask) over its masked time, the unmasked call
timed in the same alternation, as the median over the rounds of each round's ratio (GFLOP/s
count the full L·S work either way, half of it for hf-mask).

    python benchmarks/bench_sdpa_cpu.py [--quick] [--lengths 256 1024 4096]
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedmha  # noqa: E402
from common import (attention_flops, fma_peak_gflops, peak_after, peak_extra_memory,  # noqa: E402
                    paired_ratio, peak_memory_in_fresh_process, time_interleaved, unfused_attention)


def run_speed(lengths, dtypes, B, H, E, min_time):
    print(f"threads={torch.get_num_threads()} isa={fusedmha.build_info()['cpu_isa_in_use']} "
          f"torch={torch.__version__} B={B} H={H} E={E}; %peak: of the fp32 FMA peak, measured "
          f"next to each row (now {fma_peak_gflops(0.25):.0f} GFLOP/s)")
    header = (f"{'dtype':9s} {'L=S':>6s} {'variant':10s} {'fusedmha ms':>12s} {'GFLOP/s':>8s} {'%peak':>6s} "
              f"{'torch ms':>9s} {'GFLOP/s':>8s} {'%peak':>6s} {'vs torch':>9s} {'unfused ms':>11s} "
              f"{'vs unfused':>11s} {'of unmasked':>12s}")
    print(header)
    print("-" * len(header))
    for dtype in dtypes:
        for L in lengths:
            q, k, v = (torch.randn(B, H, L, E, dtype=dtype) for _ in range(3))
            mask = torch.randn(L, L, dtype=dtype)
            padding = torch.ones(B, 1, 1, L, dtype=torch.bool)
            padding[..., L - L // 8:] = False  # (True = may attend)
            i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
            hf_mask = torch.stack([(j <= i) & (j >= b * L // (4 * B)) for b in range(B)])[:, None]
            masks = {"mask": mask, "pad": padding, "hf-mask": hf_mask}
            # (B·H·L·S bytes, and PyTorch's masked call makes it a float tensor four times that
            # size: skipped over 1 GiB, L=S=4096 at B=4, H=8 being 512 MiB.)
            if B * H * L * L <= 1 << 30:
                masks["head-mask"] = torch.empty(B, H, L, L, dtype=torch.bool).bernoulli_(0.8)
            # (2 GiB in float32 at L=S=4096, B=4, H=8; skipped over that.)
            if B * H * L * L * q.element_size() <= 2 << 30:
                masks["head-float"] = torch.randn(B, H, L, L, dtype=dtype)
            # (H·L·S elements: 512 MiB in float32 at L=S=4096, H=8; skipped over 1 GiB.)
            if H * L * L * q.element_size() <= 1 << 30:
                distance = (i - j).abs().to(dtype)
                slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)
                bias = torch.empty(1, H, L, L, dtype=dtype)
                for h, slope in enumerate(slopes.tolist()):
                    torch.mul(distance, -slope, out=bias[0, h])
                masks["bias"] = bias
            for variant in ["plain", "causal", "mask", "head-mask", "head-float", "bias", "pad",
                            "hf-mask"]:
                if variant in ("head-mask", "head-float", "bias") and variant not in masks:
                    continue
                kw = {"is_causal": True} if variant == "causal" else {}
                if variant in masks:
                    kw["attn_mask"] = masks[variant]
                causal = variant in ("causal", "hf-mask")
                fns = [lambda: fusedmha.scaled_dot_product_attention(q, k, v, **kw),
                       lambda: F.scaled_dot_product_attention(q, k, v, **kw)]
                # The unfused version needs B·H·L·S scores (and takes a minute per call in
                # bf16 at 4096); skip it where they are over 512 MiB.
                with_unfused = B * H * L * L * q.element_size() <= 512 << 20
                if with_unfused:
                    fns.append(lambda: unfused_attention(q, k, v, **kw))
                if variant in masks:
                    fns.append(lambda: fusedmha.scaled_dot_product_attention(
                        q, k, v, is_causal=variant == "hf-mask"))
                peak = fma_peak_gflops()  # next to the timing: the clock drifts
                # (5 rounds at least for the masked rows: "of unmasked" is a ratio of two of
                # this row's calls, the median of its rounds.)
                samples = []
                times = time_interleaved(fns, min_time, min_rounds=5 if variant in masks else 3,
                                         samples=samples)
                t_f, t_t = times[0], times[1]
                peak = peak_after(peak)
                if with_unfused:
                    unfused = f"{times[2] * 1e3:11.2f} {times[2] / t_f:10.2f}x"
                else:
                    unfused = f"{'-':>11s} {'-':>11s}"
                of_unmasked = (f"{paired_ratio(samples[-1], samples[0]):11.2f}x" if variant in masks
                            else f"{'-':>12s}")
                flops = attention_flops(B, H, L, L, E, causal)
                g_f, g_t = flops / t_f / 1e9, flops / t_t / 1e9
                print(f"{str(dtype).replace('torch.', ''):9s} {L:6d} {variant:10s} {t_f * 1e3:11.2f} "
                      f"{g_f:8.1f} {100 * g_f / peak:5.0f}% {t_t * 1e3:9.2f} {g_t:8.1f} "
                      f"{100 * g_t / peak:5.0f}% {t_t / t_f:8.2f}x {unfused} {of_unmasked}", flush=True)


IMPLEMENTATIONS = {
    "fusedmha": lambda q, k, v: fusedmha.scaled_dot_product_attention(q, k, v),
    "torch SDPA": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
    "unfused": unfused_attention,
}


def measure_memory(name, L, H, E):
    """Runs in a fresh process so no freed-but-resident pages of another run are reused."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, L, E) for _ in range(3))
    extra = peak_extra_memory(lambda: IMPLEMENTATIONS[name](q, k, v), q.numel() * q.element_size())
    print(extra)


def run_memory(L, H, E):
    print(f"\nPeak extra memory, B=1 H={H} L=S={L} E={E} float32 (resident memory beyond inputs and output):")
    for name in IMPLEMENTATIONS:
        scores_bytes = H * L * L * 4
        if name == "unfused" and scores_bytes > 2 << 30:
            print(f"  {name:12s} {scores_bytes / 2**20:9.1f} MiB for the scores alone (not run)")
            continue
        extra = peak_memory_in_fresh_process(__file__, name, L, H, E)
        print(f"  {name:12s} {extra / 2**20:9.1f} MiB", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--min-time", type=float, default=1.0, help="seconds of repetitions per measurement")
    p.add_argument("--memory-length", type=int, default=16384)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--measure-memory", nargs=4, metavar=("IMPL", "L", "H", "E"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.measure_memory:
        name, L, H, E = a.measure_memory
        return measure_memory(name, int(L), int(H), int(E))
    if a.quick:
        a.lengths, a.min_time, a.memory_length = [256], 0.1, 2048
    torch.manual_seed(0)
    run_speed(a.lengths, [getattr(torch, d) for d in a.dtypes], a.batch, a.heads, a.head_dim, a.min_time)
    run_memory(a.memory_length, a.heads, a.head_dim)


if __name__ == "__main__":
    main()
