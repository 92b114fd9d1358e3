"""Concurrent calls: from many Python threads and from torch.jit.fork's interop threads, the ops
give bitwise the results of the same calls made one after another, and with dropout no two
calls share a random stream.

With dropout, a call's result is a function of its inputs and the stream it drew (rng_state,
drawn under the generator's lock). After manual_seed, n calls draw the same n streams whichever
order they run in; so with identical inputs, each concurrent result must equal, bit for bit,
the serial result of the call that drew the same stream."""

import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import List, Tuple

import pytest
import torch

import fusedmha  # noqa: F401

OPS = torch.ops.fusedmha
CALLS = 24
WORKERS = 8
SHAPE = dict(B=2, H=4, H_KV=2, L=77, S=131, E=32)  # GQA, ragged tiles on every side


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    s = SHAPE
    q = torch.randn(s["B"], s["H"], s["L"], s["E"], generator=g)
    k = torch.randn(s["B"], s["H_KV"], s["S"], s["E"], generator=g)
    v = torch.randn(s["B"], s["H_KV"], s["S"], s["E"], generator=g)
    grad = torch.randn(s["B"], s["H"], s["L"], s["E"], generator=g)
    mask = torch.rand(s["L"], s["S"], generator=g) > 0.2
    return q, k, v, grad, mask


def forward_backward(q, k, v, grad, mask, p):
    """attention_forward then attention_backward, as autograd calls them."""
    out, lse, rng = OPS.attention_forward(q, k, v, mask, p, False, None, True)
    dq, dk, dv, _ = OPS.attention_backward(grad, q, k, v, out, lse, rng, mask, p, False, None, True)
    return out, lse, rng, dq, dk, dv


def assert_bitwise(got, want):
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("how", ["python_threads", "jit_fork"])
def test_concurrent_calls_equal_serial_ones(how):
    cases = [inputs(seed) for seed in range(CALLS)]
    serial = [forward_backward(*c, 0.0) for c in cases]
    concurrent = run_concurrently(how, cases, 0.0)
    for got, want in zip(concurrent, serial):
        assert_bitwise(got, want)


@pytest.mark.parametrize("how", ["python_threads", "jit_fork"])
def test_concurrent_dropout_draws_distinct_streams_and_replays_serially(how):
    case = inputs(1234)
    p = 0.3
    torch.manual_seed(7)
    serial = [forward_backward(*case, p) for _ in range(CALLS)]
    torch.manual_seed(7)
    concurrent = run_concurrently(how, [case] * CALLS, p)

    def stream(result):
        return tuple(result[2].tolist())

    streams = [stream(r) for r in concurrent]
    assert len(set(streams)) == CALLS, "two concurrent calls drew the same dropout stream"
    by_stream = {stream(r): r for r in serial}
    assert set(streams) == set(by_stream)
    for r in concurrent:
        assert_bitwise(r, by_stream[stream(r)])


def run_concurrently(how, cases, p):
    if how == "python_threads":
        with ThreadPoolExecutor(WORKERS) as pool:
            return list(pool.map(lambda c: forward_backward(*c, p), cases))
    if torch.get_num_interop_threads() < 2:
        pytest.skip("one interop thread: torch.jit.fork runs its tasks one at a time")
    return [tuple(r) for r in _fork_all(cases, p)]


def _scripted_forward_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
                               mask: torch.Tensor, p: float) -> List[torch.Tensor]:
    out, lse, rng = torch.ops.fusedmha.attention_forward(q, k, v, mask, p, False, None, True)
    dq, dk, dv, _ = torch.ops.fusedmha.attention_backward(grad, q, k, v, out, lse, rng, mask, p,
                                                          False, None, True)
    return [out, lse, rng, dq, dk, dv]


def _fork_all(cases: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
              p: float) -> List[List[torch.Tensor]]:
    futures = [torch.jit.fork(_scripted_forward_backward, c[0], c[1], c[2], c[3], c[4], p)
               for c in cases]
    return [torch.jit.wait(f) for f in futures]


with warnings.catch_warnings():  # (torch.jit.script is deprecated; fork needs it still)
    warnings.simplefilter("ignore", FutureWarning)
    _scripted_forward_backward = torch.jit.script(_scripted_forward_backward)
    _fork_all = torch.jit.script(_fork_all)
