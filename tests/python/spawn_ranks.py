"""Runs a function on W local processes joined in a gloo group on 127.0.0.1, each with one
intra-op thread, and reports every rank's failure. Every process ends: the parent waits up
to a deadline, then kills what is left and fails."""

import multiprocessing
import os
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torch 2.15's gloo process groups can abort a rank at interpreter exit, after its script has
# ended ("terminate called without an active exception", about one run in five on a loaded
# machine; reproduced with plain DDP and no fusedmha). A torchrun whose every rank printed its
# last line, and which failed only with that abort, has run its script through.
TORCH_EXIT_ABORT = "terminate called without an active exception"


def torchrun_passed(res, done, count):
    """Whether a finished torchrun (subprocess.run's result) ran its script through: exit 0,
    or `done` printed `count` times and nothing but torch's abort at exit after it."""
    if res.returncode == 0:
        return True
    out = res.stdout + res.stderr
    return out.count(done) >= count and TORCH_EXIT_ABORT in out


def _entry(fn, rank, world, port, results, timeout_s, kwargs):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        try:
            fn(rank, world, **kwargs)
        finally:
            dist.destroy_process_group()
        results.put((rank, None))
    except BaseException:  # noqa: BLE001  (reported to the parent, which fails the test)
        results.put((rank, traceback.format_exc()))


def run_ranks(fn, world, timeout_s=240, **kwargs):
    """fn(rank, world, **kwargs) on `world` processes; raises AssertionError with every
    failing rank's traceback, or if any process is still running after timeout_s."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, results, timeout_s, kwargs),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    reports = {}
    try:
        for _ in range(world):
            rank, error = results.get(timeout=timeout_s)
            reports[rank] = error
            if error:  # the others may wait for it in a collective: stop them now
                break
    except Exception:  # noqa: BLE001  (queue.Empty: a rank hung or died without a report)
        pass
    finally:
        for p in procs:
            p.join(timeout=10 if all(e is None for e in reports.values()) else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r}:\n{e}" for r, e in sorted(reports.items()) if e]
    missing = [r for r in range(world) if r not in reports]
    if missing and not errors:
        errors.append(f"ranks {missing} gave no report within {timeout_s} s (hung or crashed; "
                      f"exit codes {[p.exitcode for p in procs]})")
    assert not errors, "\n".join(errors)
