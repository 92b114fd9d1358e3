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


def fma_peak_gflops(seconds=0.1, readings=3):
    """This machine's fp32 FMA peak now, in GFLOP/s: register-only FMA chains at the ISA level
    fusedmha's kernels run at, on every intra-op thread (fusedmha.cpu_fma_peak_gflops, the
    fastest of five short rounds; benchmarks/probe_check.py holds it against an independent C
    loop). Measure it next to each timing: the clock of a shared machine drifts. The most of a
    few readings: in a busy minute every round of one reading can find a thread descheduled,
    and a row's % of it then reads high; take it before and after a row's timings and keep
    the higher (peak_after)."""
    import fusedmha

    return max(fusedmha.cpu_fma_peak_gflops(seconds) for _ in range(readings))


def peak_after(peak_before):
    """The FMA peak for a row whose timings ran since peak_before was read: the higher of that
    reading and one taken now (fma_peak_gflops says why)."""
    return max(peak_before, fma_peak_gflops())


class MemoryRead:
    """A probe of this machine's memory-read bandwidth: a call reads a buffer far larger than
    the caches with plain vector loads on every intra-op thread (fusedmha's
    cpu_memory_read; benchmarks/probe_check.py holds it against an independent streaming
    read). Time it in alternation with the calls it is the yardstick for (time_interleaved):
    the bandwidth of a shared machine drifts from minute to minute, and both sides then get
    the same minutes, and medians."""

    def __init__(self, nbytes=512 << 20):
        import fusedmha

        self.nbytes = nbytes
        self.buffer = torch.ones(nbytes // 4)
        self._read = fusedmha._C.cpu_memory_read

    def __call__(self):
        self._read(self.buffer)

    def gbps(self, seconds):
        return self.nbytes / seconds / 1e9


class CacheFlush:
    """Leaves the caches cold and clean: a read of twice the last-level cache. For memory-bound
    calls timed in alternation, which otherwise inherit each other's cache state: two calls
    over the same K/V find part of it in L3, and a call after PyTorch's grouped-query SDPA
    (which writes the K/V expanded per query head) first waits for its dirty lines to be
    written back (at S=4096 on Zen 4: a paged decode 2.2 ms after a plain read, 3.0 after
    PyTorch). A model's decode step reads each layer's cache cold, between layers that write
    little, so the plain read is the fair neighbour for both sides."""

    def __init__(self):
        llc = 32 << 20
        try:
            with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
                text = f.read().strip()
            llc = int(text[:-1]) << {"K": 10, "M": 20}[text[-1]] if text[-1] in "KM" else int(text)
        except (OSError, ValueError, KeyError):
            pass
        self.buffer = torch.ones(2 * max(llc, 32 << 20) // 4)

    def __call__(self):
        self.buffer.sum()


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


def time_interleaved(fns, min_time=0.5, warmup=1, before_each=None, min_rounds=3, samples=None):
    """Median seconds per call of each function, measured in alternation (one call of each
    per round) so that a slow spell of a shared machine hits all of them alike. before_each,
    when given, runs untimed before every call (cold caches: CacheFlush). samples, when given
    (a list), receives each function's times round by round, for paired_ratio."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    start = time.perf_counter()
    while time.perf_counter() - start < min_time * len(fns) or len(times[0]) < min_rounds:
        for fn, s in zip(fns, times):
            if before_each is not None:
                before_each()
            t = time.perf_counter()
            fn()
            s.append(time.perf_counter() - t)
    if samples is not None:
        samples[:] = times
    return [sorted(s)[len(s) // 2] for s in times]


def paired_ratio(numerators, denominators):
    """The median over rounds of one round's time over the other's, for two functions timed
    in the same rounds: a ratio that the machine's drift from round to round cancels out of,
    where the ratio of two medians can pair a fast minute of one with a slow one of the other."""
    ratios = sorted(n / d for n, d in zip(numerators, denominators))
    return ratios[len(ratios) // 2]


def peak_memory_in_fresh_process(script, *args):
    """Runs `script --measure-memory *args` (e.g. name L H E) in a new interpreter (so no freed
    but still resident pages of earlier runs are reused) and returns the bytes it prints last."""
    res = subprocess.run([sys.executable, script, "--measure-memory", *map(str, args)],
                         check=True, capture_output=True, text=True)
    return int(res.stdout.split()[-1])
