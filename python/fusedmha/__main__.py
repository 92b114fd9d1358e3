"""python -m fusedmha: check this build against PyTorch, then race it.

    python -m fusedmha [--quick] [--plot speedups.png]

1. Checks: fusedmha's functional and module front doors against PyTorch's own
   (F.scaled_dot_product_attention, nn.MultiheadAttention) on a few configurations (float32,
   bfloat16, causal, causal + padding, GQA, gradients, need_weights, dropout
   reproducibility), against float64 truth. Exits with status 1 if one fails.
2. A short side-by-side benchmark (progress bar on stderr) of the workloads users run: a
   transformer's MultiheadAttention over padded batches (inference with and without
   need_weights, a training step with dropout) and causal SDPA forward + backward. Prints a
   table of times and speed-ups; --plot saves them as a PNG (needs matplotlib).

benchmarks/ has the full tables.
"""

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import fusedmha


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------------------------
# Checks: each returns (fusedmha's error, PyTorch's error) against float64 truth; passes
# when fusedmha is within 2x PyTorch's error plus a floor.
# ---------------------------------------------------------------------------------------


def sdpa_error(dtype, B=2, H=8, L=256, S=256, E=64, kv_heads=None, mask=None, causal=False):
    q = torch.randn(B, H, L, E, dtype=dtype)
    k, v = (torch.randn(B, kv_heads or H, S, E, dtype=dtype) for _ in range(2))
    gqa = kv_heads is not None
    ours = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    truth = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                           is_causal=causal, enable_gqa=gqa)
    return max_diff(ours, truth), max_diff(theirs, truth)


def causal_padding_mask(B, L):
    lengths = torch.randint(L // 2, L + 1, (B,))
    padding = torch.arange(L)[None, :] < lengths[:, None]
    return torch.ones(L, L, dtype=torch.bool).tril() & padding[:, None, None, :]


def sdpa_grad_error():
    q, k, v = (torch.randn(1, 4, 200, 64, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 4, 200, 64)
    errors = []
    for sdpa in (fusedmha.scaled_dot_product_attention, F.scaled_dot_product_attention):
        got = torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), grad)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        out64 = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
        truth = torch.autograd.grad(out64, (q64, k64, v64), grad.double())
        errors.append(max(max_diff(a, b) for a, b in zip(got, truth)))
    return tuple(errors)


def module_pair(dtype=torch.float32, **kwargs):
    theirs = nn.MultiheadAttention(256, 8, batch_first=True, dtype=dtype, **kwargs)
    ours = fusedmha.MultiheadAttention(256, 8, batch_first=True, dtype=dtype, **kwargs)
    ours.load_state_dict(theirs.state_dict())
    truth = nn.MultiheadAttention(256, 8, batch_first=True, dtype=torch.float64, **kwargs)
    truth.load_state_dict(theirs.state_dict())
    return ours, theirs, truth


def module_error(need_weights):
    ours, theirs, truth = module_pair()
    x = torch.randn(4, 100, 256)
    padding = torch.zeros(4, 100, dtype=torch.bool)
    padding[1:, 70:] = True  # True = padded, nn.MultiheadAttention's polarity
    results = [m(x, x, x, key_padding_mask=padding, need_weights=need_weights) for m in (ours, theirs)]
    ref = truth(x.double(), x.double(), x.double(), key_padding_mask=padding, need_weights=need_weights)
    index = 1 if need_weights else 0
    return max_diff(results[0][index], ref[index]), max_diff(results[1][index], ref[index])


def module_grad_error():
    ours, theirs, truth = module_pair()
    x = torch.randn(2, 64, 256)
    errors = []
    ref = torch.autograd.grad(truth(x.double(), x.double(), x.double(), need_weights=False, is_causal=True,
                                    attn_mask=nn.Transformer.generate_square_subsequent_mask(64, dtype=torch.float64))[0].sum(),
                              list(truth.parameters()))
    for m in (ours, theirs):
        out = m(x, x, x, need_weights=False, is_causal=True,
                attn_mask=nn.Transformer.generate_square_subsequent_mask(64))[0]
        got = torch.autograd.grad(out.sum(), list(m.parameters()))
        errors.append(max(max_diff(a, b) for a, b in zip(got, ref)))
    return tuple(errors)


def dropout_repeatable():
    q, k, v = (torch.randn(1, 4, 128, 64) for _ in range(3))
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(fusedmha.scaled_dot_product_attention(q, k, v, dropout_p=0.1))
    ok = torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    return (0.0 if ok else float("inf")), 0.0


CHECKS = [
    ("SDPA float32", lambda: sdpa_error(torch.float32), 1e-6),
    ("SDPA bfloat16, causal", lambda: sdpa_error(torch.bfloat16, causal=True), 1e-2),
    ("SDPA causal + padding bool mask", lambda: sdpa_error(torch.float32, mask=causal_padding_mask(2, 256)), 1e-6),
    ("SDPA GQA 8/2 heads, L != S", lambda: sdpa_error(torch.float32, L=100, S=300, kv_heads=2), 1e-6),
    ("SDPA gradients, causal", sdpa_grad_error, 1e-5),
    ("MultiheadAttention output, padding", lambda: module_error(False), 1e-5),
    ("MultiheadAttention need_weights", lambda: module_error(True), 1e-6),
    ("MultiheadAttention parameter grads", module_grad_error, 1e-4),
    ("dropout: same seed same mask", dropout_repeatable, 0.0),
]


def run_checks():
    print("Checks against PyTorch (max |error| vs float64 truth: fusedmha / PyTorch):")
    failed = 0
    for name, check, floor in CHECKS:
        ours, theirs = check()
        ok = ours <= 2 * theirs + floor
        failed += not ok
        print(f"  {'ok  ' if ok else 'FAIL'} {name:38s} {ours:9.2e} / {theirs:9.2e}", flush=True)
    return failed


# ---------------------------------------------------------------------------------------
# Benchmark
# ---------------------------------------------------------------------------------------


def median_time(fn, min_time):
    fn()
    samples, start = [], time.perf_counter()
    while time.perf_counter() - start < min_time or len(samples) < 3:
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return sorted(samples)[len(samples) // 2]


def mha_case(L, mode, batch=4, embed=512, heads=8):
    """(fusedmha step, PyTorch step, flops of one step) for nn.MultiheadAttention's workload at
    length L: four projections and the attention (FlashAttention's count), 3x for training."""
    theirs = nn.MultiheadAttention(embed, heads, dropout=0.1, batch_first=True)
    ours = fusedmha.MultiheadAttention(embed, heads, dropout=0.1, batch_first=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(batch, L, embed, requires_grad=mode == "train")
    padding = torch.arange(L)[None, :] >= torch.tensor([L - L * b // (2 * batch) for b in range(batch)])[:, None]

    def step(m):
        if mode == "train":
            m.train()
            return lambda: m(x, x, x, key_padding_mask=padding, need_weights=False)[0].sum().backward()
        m.eval()

        def infer():
            with torch.no_grad():
                m(x, x, x, key_padding_mask=padding, need_weights=mode == "need_weights")
        return infer

    flops = 8 * batch * L * embed * embed + 4 * batch * L * L * embed
    return step(ours), step(theirs), flops * (3 if mode == "train" else 1)


def sdpa_train_case(L, heads=8):
    q, k, v = (torch.randn(1, heads, L, 64, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, heads, L, 64)

    def step(sdpa):
        return lambda: torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), grad)

    flops = 3.5 * 4 * heads * L * L * 64 / 2  # forward + backward, causal: half
    return step(fusedmha.scaled_dot_product_attention), step(F.scaled_dot_product_attention), flops


def progress(done, total, label):
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:45s}")
    sys.stderr.flush()
    if done == total:
        sys.stderr.write("\r" + " " * (width + 60) + "\r")


def run_benchmark(lengths, min_time):
    cases = []
    for L in lengths:
        cases += [(f"MHA inference, need_weights, L={L}", lambda L=L: mha_case(L, "need_weights")),
                  (f"MHA inference, L={L}", lambda L=L: mha_case(L, "infer")),
                  (f"MHA train step, dropout 0.1, L={L}", lambda L=L: mha_case(L, "train")),
                  (f"SDPA causal fwd+bwd, 8 heads, L={2 * L}", lambda L=L: sdpa_train_case(2 * L))]
    print(f"\nBenchmark on {torch.get_num_threads()} threads "
          f"(MHA: embed 512, 8 heads, batch 4 with key_padding_mask):")
    results = []
    for i, (name, make) in enumerate(cases):
        progress(i, len(cases), name)
        ours, theirs, flops = make()
        # The machine's FMA peak next to each timing (a shared machine's clock drifts), before
        # and after it, the higher kept: a reading taken while a thread was descheduled is low.
        peak = fusedmha.cpu_fma_peak_gflops(0.1)
        t_ours, t_theirs = median_time(ours, min_time), median_time(theirs, min_time)
        peak = max(peak, fusedmha.cpu_fma_peak_gflops(0.1))
        results.append((name, t_ours, t_theirs, flops / t_ours / 1e9, peak))
    progress(len(cases), len(cases), "")
    print(f"  {'workload':42s} {'fusedmha ms':>12s} {'GFLOP/s':>8s} {'% peak':>7s} "
          f"{'PyTorch ms':>11s} {'speed-up':>9s}")
    for name, t_ours, t_theirs, gflops, peak in results:
        print(f"  {name:42s} {t_ours * 1e3:12.1f} {gflops:8.1f} {100 * gflops / peak:6.0f}% "
              f"{t_theirs * 1e3:11.1f} {t_theirs / t_ours:8.2f}x")
    peaks = [r[4] for r in results]
    print(f"  (% peak: of this machine's fp32 FMA peak at {fusedmha.build_info()['cpu_isa_in_use']}, "
          f"measured next to each row: {min(peaks):.0f}-{max(peaks):.0f} GFLOP/s on "
          f"{torch.get_num_threads()} threads)")
    return [r[:3] for r in results]


def save_plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install matplotlib")
    names = [r[0] for r in results]
    speedups = [r[2] / r[1] for r in results]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(names) + 1.2))
    ax.barh(names[::-1], speedups[::-1], color="tab:blue")
    ax.axvline(1.0, color="gray", linestyle="--")
    ax.set_xlabel("speed-up over PyTorch (x)")
    ax.set_title(f"fusedmha {fusedmha.__version__} vs PyTorch {torch.__version__}, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nSaved {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fusedmha", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="checks and one small benchmark size")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds per timing")
    parser.add_argument("--plot", metavar="PNG", help="save the speed-ups as a bar chart")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.min_time = [128], 0.05
    torch.manual_seed(0)
    info = fusedmha.build_info()
    print(f"fusedmha {info['version']}, built against torch {info['torch_version']}, running on torch "
          f"{torch.__version__}; CPU kernels: {info['cpu_isa_in_use']}\n")
    failed = run_checks()
    results = run_benchmark(args.lengths, args.min_time)
    if args.plot:
        save_plot(results, args.plot)
    if failed:
        print(f"\n{failed} check(s) FAILED")
        return 1
    print("\nAll checks passed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
