"""fusedmha on torch.distributed, over 2 and 3 gloo processes on localhost: context-parallel
(ring) attention, whose forward and every gradient equal the single-process op on the whole
sequence, and MultiheadAttention under DDP and FSDP (what each rank runs:
distributed_cases.py)."""

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

import distributed_cases
from spawn_ranks import free_port, run_ranks, torchrun_passed

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


@pytest.mark.parametrize("world", [2, 3])
def test_ring_attention_matches_the_whole_sequence(world):
    run_ranks(distributed_cases.all_cases, world)


@pytest.mark.parametrize("world", [2, 3])
def test_shard_and_unshard(world):
    run_ranks(distributed_cases.shard_and_unshard, world)


def test_bad_calls_get_clear_errors():
    run_ranks(distributed_cases.errors, 2)


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_encoder_layer(world):
    run_ranks(distributed_cases.encoder_layer, world)


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_multihead_attention_under_data_parallelism(wrap):
    run_ranks(distributed_cases.data_parallel, 2, wrap=wrap)


def test_example_training_script_runs_under_torchrun():
    """examples/python/train_context_parallel.py, as docs/distributed.md launches it (fewer steps)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "examples", "python", "train_context_parallel.py")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), script, "--steps", "25"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    # (Rank 0 prints the last step's figures after an all_reduce with every rank.)
    assert torchrun_passed(res, "step   25  loss", 1), res.stdout + res.stderr
    assert "dp=1 x cp=2" in res.stdout and "step   25  loss" in res.stdout, res.stdout


def test_pair_bands_see_exactly_the_keys_of_the_global_band():
    """Every (query run, key run) placement that _pair returns, read as the kernels read it
    (bottom-right band [-a, b], -1 unbounded), covers exactly the global band's keys."""
    import random

    import torch

    from fusedmha.distributed import _pair

    rng = random.Random(0)
    for _ in range(3000):
        lq, lk = rng.randint(1, 12), rng.randint(1, 12)
        q0, k0 = rng.randint(0, 30), rng.randint(0, 30)
        left, right = rng.choice([-1, 0, 1, 3, 8, 20]), rng.choice([-1, 0, 1, 3, 8, 20])
        i = torch.arange(lq).view(-1, 1) + q0
        j = torch.arange(lk).view(1, -1) + k0
        want = torch.ones(lq, lk, dtype=torch.bool)
        if left >= 0:
            want &= j >= i - left
        if right >= 0:
            want &= j <= i + right
        got = torch.zeros(lq, lk, dtype=torch.bool)
        placed = _pair(q0, lq, k0, lk, left, right)
        if placed is not None:
            t, nq, nk, a, b = placed
            ii, jj = torch.arange(nq).view(-1, 1), torch.arange(nk).view(1, -1)
            band = torch.ones(nq, nk, dtype=torch.bool)
            if a >= 0:
                band &= jj >= ii + nk - nq - a
            if b >= 0:
                band &= jj <= ii + nk - nq + b
            got[t:t + nq, :nk] = band
        assert torch.equal(got, want), (q0, lq, k0, lk, left, right, placed)
