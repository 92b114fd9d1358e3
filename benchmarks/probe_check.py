"""The yardsticks against independent ones: fusedmha.cpu_fma_peak_gflops() at every ISA level
this CPU runs, next to a plain C loop of register-only FMA chains built for that level, and
benchmarks/common.py's memory-read probe next to a plain C streaming read
(tests/python/peak_probes.c, built here with the system's C compiler). Readings alternate, in
the same minutes; each line prints both and their ratio.

    python benchmarks/probe_check.py [--rounds 3]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fusedmha  # noqa: E402
from common import MemoryRead  # noqa: E402

SOURCE = os.path.join(HERE, "..", "tests", "python", "peak_probes.c")
# The C loop's flags per fusedmha ISA level (CMakeLists.txt's FUSEDMHA_ISA_FLAGS_*).
FLAGS = {"default": [], "avx2": ["-mavx2", "-mfma"], "avx512": ["-mavx512f", "-mfma"]}
NEEDS = {"default": set(), "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "fma"}}


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def levels():
    """The ISA levels both this build of fusedmha and this CPU have."""
    have = cpu_flags()
    return [lv for lv in fusedmha.build_info()["cpu_isas"] if NEEDS[lv] <= have]


def build(level, out_dir):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("probe_check.py: no C compiler (cc) on PATH")
    exe = os.path.join(out_dir, f"peak_probes_{level}")
    subprocess.run([compiler, "-O2", "-fopenmp", *FLAGS[level], SOURCE, "-o", exe], check=True)
    return exe


def c_probe(exe, what, threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    return float(subprocess.run([exe, what], check=True, capture_output=True, text=True,
                                env=env).stdout.split()[-1])


def best_of(fn, rounds):
    fn()  # (untimed: the pages touched, the threads awake)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def fusedmha_peak(level):
    old = os.environ.get("FUSEDMHA_CPU_ISA")
    os.environ["FUSEDMHA_CPU_ISA"] = level
    try:
        return fusedmha.cpu_fma_peak_gflops()
    finally:
        if old is None:
            del os.environ["FUSEDMHA_CPU_ISA"]
        else:
            os.environ["FUSEDMHA_CPU_ISA"] = old


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating readings (default 3)")
    parser.add_argument("--read-mib", type=int, default=512, help="the read probes' buffer (MiB)")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    print(f"{threads} threads; fusedmha at {fusedmha.build_info()['cpu_isa_in_use']} by default")
    print(f"{'probe':<22}{'fusedmha':>10}{'plain C':>10}{'ratio':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        exes = {lv: build(lv, tmp) for lv in levels()}
        read = MemoryRead(args.read_mib << 20)
        for _ in range(args.rounds):
            for lv, exe in exes.items():
                # (each the fastest of several timings: the C loop's of five rounds, fusedmha's
                # of three readings of five rounds, as benchmarks/common.py takes it)
                ours = max(fusedmha_peak(lv) for _ in range(3))
                theirs = c_probe(exe, "fma", threads)
                print(f"{'FMA GFLOP/s ' + lv:<22}{ours:>10.1f}{theirs:>10.1f}{ours / theirs:>8.3f}",
                      flush=True)
            ours = read.gbps(best_of(read, 5))  # (as the C read: the fastest of five passes)
            theirs = c_probe(exes[levels()[-1]], "read", threads)
            print(f"{'read GB/s':<22}{ours:>10.1f}{theirs:>10.1f}{ours / theirs:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
