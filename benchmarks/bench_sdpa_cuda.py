"""Attention on a CUDA GPU, side by side in one process: fusedmha's kernels next to
F.scaled_dot_product_attention with each of its backends (flash, efficient, cuDNN, math),
forward and forward+backward, then nn.MultiheadAttention vs fusedmha.MultiheadAttention.

TFLOP/s use FlashAttention's convention: 4·B·H·L·S·E for the forward, 2.5x that for the
backward (3.5x for forward+backward), halved when causal. Times are CUDA-event medians.

    python benchmarks/bench_sdpa_cuda.py [--quick] [--lengths 512 1024 ...] [--dims 64 128]
        [--markdown FILE]

Prints "no CUDA GPU" and exits 0 where there is none.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedmha  # noqa: E402
from common import attention_flops  # noqa: E402


def cuda_time(fn, reps=10, warmup=3):
    """Median seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def sdpa_backends():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}

    def call(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    impls = {"fusedmha": lambda q, k, v, causal: fusedmha.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    impls.update({f"torch-{name}": call(b) for name, b in names.items()})
    return impls


def measure(impl, q, k, v, causal, backward):
    def fwd():
        return impl(q, k, v, causal)

    if not backward:
        with torch.no_grad():
            return cuda_time(fwd)
    grad = torch.randn_like(q)

    def fwd_bwd():
        out = fwd()
        torch.autograd.grad(out, (q, k, v), grad)

    return cuda_time(fwd_bwd)


def emit(row, lines, markdown):
    """Prints a table row and rewrites the markdown file, so a run cut short keeps its rows."""
    lines.append(row)
    print(row, flush=True)
    if markdown:
        with open(markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


def run_sdpa(lengths, dims, total_tokens, dtype, lines, markdown):
    impls = sdpa_backends()
    header = f"| E | L=S | B | H | causal | pass | " + " | ".join(impls) + " | fusedmha / flash |"
    emit(header, lines, markdown)
    emit("|" + "---|" * (header.count("|") - 1), lines, markdown)
    for E in dims:
        H = 2048 // E
        for L in lengths:
            B = max(1, total_tokens // L)
            q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
            for causal in (False, True):
                for backward in (False, True):
                    flops = attention_flops(B, H, L, L, E, causal) * (3.5 if backward else 1.0)
                    cells, tflops = [], {}
                    for name, impl in impls.items():
                        if name == "torch-math" and B * H * L * L * 4 > (4 << 30):
                            cells.append("skip")  # L×S fp32 scores over 4 GiB: minutes per call
                            continue
                        try:
                            t = measure(impl, q, k, v, causal, backward)
                            tflops[name] = flops / t / 1e12
                            cells.append(f"{tflops[name]:.1f}")
                        except (RuntimeError, torch.OutOfMemoryError) as e:
                            cells.append("n/a")
                            torch.cuda.empty_cache()
                            if name == "fusedmha":
                                raise
                            del e
                    ratio = (f"{tflops['fusedmha'] / tflops['torch-flash']:.0%}"
                             if "torch-flash" in tflops else "n/a")
                    row = (f"| {E} | {L} | {B} | {H} | {causal} | {'fwd+bwd' if backward else 'fwd'} | "
                           + " | ".join(cells) + f" | {ratio} |")
                    emit(row, lines, markdown)
            del q, k, v
            torch.cuda.empty_cache()


def run_mha(lengths, dtype, lines, markdown):
    E, H, B = 1024, 16, 8
    emit("", lines, markdown)
    emit("| MHA L | pass | nn.MultiheadAttention ms | fusedmha ms | speed-up |", lines, markdown)
    emit("|---|---|---|---|---|", lines, markdown)
    for L in lengths:
        torch.manual_seed(0)
        ref = torch.nn.MultiheadAttention(E, H, batch_first=True, device="cuda", dtype=dtype)
        mine = fusedmha.MultiheadAttention(E, H, batch_first=True, device="cuda", dtype=dtype)
        mine.load_state_dict(ref.state_dict())
        x = torch.randn(B, L, E, device="cuda", dtype=dtype)
        for train in (False, True):
            def step(m):
                def run():
                    if train:
                        out, _ = m(x, x, x, need_weights=False)
                        out.float().sum().backward()
                    else:
                        with torch.no_grad():
                            m(x, x, x, need_weights=False)
                return run
            ref.train(train)
            mine.train(train)
            t_ref, t_mine = cuda_time(step(ref)), cuda_time(step(mine))
            row = f"| {L} | {'train' if train else 'inference'} | {t_ref * 1e3:.2f} | {t_mine * 1e3:.2f} | {t_ref / t_mine:.2f}x |"
            emit(row, lines, markdown)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few sizes only")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--tokens", type=int, default=16384, help="B·L, as FlashAttention's benchmark")
    parser.add_argument("--markdown", help="also write the tables to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to benchmark")
        return
    if not fusedmha.build_info()["cuda"]:
        sys.exit("fusedmha was built without CUDA kernels")
    lengths = [1024, 4096] if args.quick else args.lengths
    print(f"{torch.cuda.get_device_name()} torch={torch.__version__} fusedmha={fusedmha.__version__} "
          f"bf16, TFLOP/s (FlashAttention's FLOP count)", flush=True)
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, TFLOP/s", ""]
    run_sdpa(lengths, args.dims, args.tokens, torch.bfloat16, lines, args.markdown)
    run_mha([512, 2048] if args.quick else [512, 1024, 2048, 4096], torch.bfloat16, lines, args.markdown)


if __name__ == "__main__":
    main()
