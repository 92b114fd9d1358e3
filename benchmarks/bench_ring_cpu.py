"""Context parallelism on CPU: fwd+bwd of causal attention over one long sequence, on one
process with one thread (fusedmha.flash_attn_func on the whole sequence) against W processes
with one thread each (fusedmha.distributed.ring_attention over zigzag shards, gloo on
localhost). Rounds alternate between the two; each prints the time, GFLOP/s, % of one core's
FMA peak (measured next to it) and the speed-up, then the median of the rounds against the
ideal W x (the work splits evenly; what is missing is communication not hidden by the
overlap, and the merges).

    python benchmarks/bench_ring_cpu.py [--quick] [--len 16384] [--heads 8] [--head-dim 64] [--world 2]
"""

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import attention_flops, fma_peak_gflops, peak_after  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inputs(L, H, E, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, L, H, E, generator=g, dtype=dtype) for _ in range(4)]


def fwd_bwd(fn, q, k, v, grad):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    start = time.perf_counter()
    fn(*leaves).backward(grad)
    return time.perf_counter() - start


def rank_main(rank, world, port, a, commands, results):
    torch.set_num_threads(1)
    import torch.distributed as dist

    import fusedmha.distributed as cp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    q, k, v, grad = (cp.shard(t, zigzag=True).contiguous() for t in inputs(a.len, a.heads, a.head_dim))
    while True:
        cmd = commands[rank].get()
        if cmd == "stop":
            break
        dist.barrier()
        t = fwd_bwd(lambda *x: cp.ring_attention(*x, causal=True), q, k, v, grad)
        times = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(times, torch.tensor([t]))
        if rank == 0:
            results.put(max(float(x) for x in times))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--len", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    a = p.parse_args()
    if a.quick:
        a.len, a.rounds = 1024, 1
    torch.set_num_threads(1)
    import fusedmha

    L, H, E, W = a.len, a.heads, a.head_dim, a.world
    flops = 3.5 * attention_flops(1, H, L, L, E, causal=True)
    print(f"isa={fusedmha.build_info()['cpu_isa_in_use']} torch={torch.__version__} B=1 L={L} "
          f"H={H} E={E} causal float32 fwd+bwd; 1 process x 1 thread vs {W} gloo processes x 1 "
          f"thread (zigzag shards)")
    ctx = multiprocessing.get_context("spawn")
    commands = [ctx.Queue() for _ in range(W)]
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, W, port, a, commands, results), daemon=True)
             for r in range(W)]
    for proc in procs:
        proc.start()
    q, k, v, grad = inputs(L, H, E)
    single = lambda *x: fusedmha.flash_attn_func(*x, causal=True)  # noqa: E731
    header = (f"{'round':>5s} {'1 proc s':>9s} {'GFLOP/s':>8s} {'% peak':>7s} {f'{W} procs s':>10s} "
              f"{'GFLOP/s':>8s} {'speed-up':>9s}")
    print(header)
    print("-" * len(header))
    ones, rings = [], []
    try:
        for rnd in range(a.rounds + 1):  # round 0 warms up
            peak = fma_peak_gflops()
            t1 = fwd_bwd(single, q, k, v, grad)
            peak = peak_after(peak)
            for c in commands:
                c.put("run")
            tw = results.get(timeout=1200)
            if rnd == 0:
                continue
            ones.append(t1)
            rings.append(tw)
            print(f"{rnd:>5d} {t1:>9.2f} {flops / t1 / 1e9:>8.1f} {100 * flops / t1 / 1e9 / peak:>6.0f}% "
                  f"{tw:>10.2f} {flops / tw / 1e9:>8.1f} {t1 / tw:>8.2f}x")
    finally:
        for c in commands:
            c.put("stop")
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    t1, tw = statistics.median(ones), statistics.median(rings)
    print(f"median: 1 process {t1:.2f} s, {W} processes {tw:.2f} s: {t1 / tw:.2f}x "
          f"(ideal {W:.2f}x)")


if __name__ == "__main__":
    main()
