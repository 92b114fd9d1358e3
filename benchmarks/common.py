"""Helpers shared by the benchmark scripts: timing, FLOP counts, peak memory."""

import gc
import os
import subprocess
import sys
import time

import torch


def time_call(fn, min_time=0.5, warmup=1):
    """Median seconds per call over enough repetitions to fill ~min_time."""
    for _ in range(warmup):
        fn()
    samples = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_time or len(samples) < 3:
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    samples.sort()
    return samples[len(samples) // 2]


def fma_peak_gflops(seconds=0.1):
    """This machine's fp32 FMA peak now, in GFLOP/s: register-only FMA chains at the ISA level
    fusedmha's kernels run at, on every intra-op thread. Measure it next to each timing: the
    clock of a shared machine drifts."""
    import fusedmha

    return fusedmha.cpu_fma_peak_gflops(seconds)


def memory_read_gbps(nbytes=1 << 30, repeats=5):
    """This machine's memory-read bandwidth in GB/s: the best of a few reductions over a
    buffer far larger than the caches (every intra-op thread reads)."""
    import time

    x = torch.ones(nbytes // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def attention_flops(B, H, L, S, E, causal):
    """FlashAttention's convention: 4·B·H·L·S·E for the forward, halved when causal."""
    flops = 4 * B * H * L * S * E
    return flops / 2 if causal else flops


def peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss():
    # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS.
    with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
        f.write("5")


def current_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_extra_memory(fn, output_bytes):
    """Peak resident memory a call adds beyond its output (bytes)."""
    gc.collect()
    reset_peak_rss()
    before = current_rss_bytes()
    out = fn()
    peak = peak_rss_bytes()
    del out
    return peak - before - output_bytes


def unfused_attention(q, k, v, attn_mask=None, is_causal=False):
    """The textbook implementation: materialises the L×S scores."""
    scores = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5)
    if is_causal:
        L, S = q.size(-2), k.size(-2)
        scores = scores.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    if attn_mask is not None:
        scores = scores + attn_mask
    return torch.softmax(scores, dim=-1) @ v


def time_interleaved(fns, min_time=0.5, warmup=1):
    """Median seconds per call of each function, measured in alternation (one call of each
    per round) so that a slow spell of a shared machine hits all of them alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    samples = [[] for _ in fns]
    start = time.perf_counter()
    while time.perf_counter() - start < min_time * len(fns) or len(samples[0]) < 3:
        for fn, s in zip(fns, samples):
            t = time.perf_counter()
            fn()
            s.append(time.perf_counter() - t)
    return [sorted(s)[len(s) // 2] for s in samples]


def peak_memory_in_fresh_process(script, name, L, H, E):
    """Runs `script --measure-memory name L H E` in a new interpreter (so no freed but still
    resident pages of earlier runs are reused) and returns the bytes it prints last."""
    res = subprocess.run([sys.executable, script, "--measure-memory", name, str(L), str(H), str(E)],
                         check=True, capture_output=True, text=True)
    return int(res.stdout.split()[-1])
