"""What only a CUDA GPU can show: the half-precision tensor-core head dims, PyTorch's CUDA
output layout, the CUDA dropout stream against the CPU's, agreement with the CPU kernels,
inputs on two devices, float32 determinism, CUDA-graph capture, streams and the device guard.

Every other test runs on CUDA too, through the `device` fixture (conftest.py). Skipped, with
the reason shown, where fusedmha was built without CUDA kernels or no GPU is visible
(tests/run.sh prints skip reasons)."""

import math

import pytest
import torch
import torch.nn.functional as F

import fusedmha
from devices import CUDA
from reference import assert_attention_close, assert_close_to_truth, leaves, reference_attention

pytestmark = CUDA

ops = torch.ops.fusedmha
sdpa = fusedmha.scaled_dot_product_attention
DEV = "cuda"


def rand(*shape, dtype=torch.float16):
    return torch.randn(*shape, device=DEV, dtype=dtype)


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E", [8, 33, 64, 80, 128, 200, 256, 320])
def test_forward_head_dims(dtype, E):
    """Head dims in and between the tensor-core kernels' groups (up to 64, 128, 256) and past
    them (320: the simple kernels), across tiles of 64 rows and keys."""
    q, k, v = rand(2, 3, 77, E, dtype=dtype), rand(2, 3, 91, E, dtype=dtype), rand(2, 3, 91, E, dtype=dtype)
    assert_attention_close(sdpa(q, k, v), q, k, v)


def test_output_layout_follows_query():
    """PyTorch's CUDA kernels give (B, L, H, E) memory; for such a query, fusedmha's output has
    PyTorch's strides (the CPU twin: test_sdpa_parity.test_output_layout_matches_pytorch)."""
    q = rand(2, 50, 4, 64).transpose(1, 2)
    out = sdpa(q, q, q)
    assert out.stride() == F.scaled_dot_product_attention(q, q, q).stride()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_dropout_matches_cpu_stream(dtype, is_causal):
    p = 0.25
    q, k, v = (rand(2, 3, 90, 64, dtype=dtype).requires_grad_() for _ in range(3))
    out, lse, rng = ops.attention_forward(q, k, v, dropout_p=p, is_causal=is_causal)
    assert rng.device.type == "cuda"
    keep = ops._dropout_keep_mask(rng.cpu(), 6, 90, 90, p).view(2, 3, 90, 90)
    q64, k64, v64 = leaves(q.cpu(), k.cpu(), v.cpu(), dtype=torch.float64)
    ref = reference_attention(q64, k64, v64, is_causal=is_causal, keep=keep, dropout_p=p)
    assert_close_to_truth(out, ref, dtype=dtype)
    # Backward replays the same mask.
    grad_out = torch.randn_like(out)
    grads = ops.attention_backward(grad_out, q, k, v, out, lse, rng, None, p, is_causal, None, False)[:3]
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.detach().cpu().double())
    for g, r in zip(grads, ref_grads):
        assert_close_to_truth(g, r, dtype=dtype, factor=1.0)
    # The CPU kernels, handed the same (seed, offset), drop the same elements.
    w_cuda = ops.attention_weights(q, k, lse, rng, None, p, is_causal)
    w_cpu = ops.attention_weights(q.cpu().float(), k.cpu().float(), lse.cpu(), rng.cpu(), None, p, is_causal)
    assert torch.equal(w_cuda.cpu() == 0, w_cpu == 0)


def test_cpu_and_cuda_agree():
    q, k, v = (torch.randn(2, 4, 60, 64) for _ in range(3))
    mask = torch.rand(60, 60) > 0.2
    cpu = sdpa(q, k, v, attn_mask=mask)
    cuda = sdpa(q.to(DEV), k.to(DEV), v.to(DEV), attn_mask=mask.to(DEV))
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-5, atol=1e-5)


def test_bad_input_names_the_argument():
    q = rand(2, 3, 10, 64)
    with pytest.raises(RuntimeError, match="same device"):
        sdpa(q, q.cpu(), q)
    with pytest.raises(RuntimeError, match="attn_mask"):
        sdpa(q, q, q, attn_mask=torch.ones(10, 10, dtype=torch.bool))


def test_float32_backward_is_deterministic():
    q, k, v = (rand(2, 4, 100, 64, dtype=torch.float32).requires_grad_() for _ in range(3))
    g = torch.randn(2, 4, 100, 64, device=DEV)
    first = torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), g)
    second = torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), g)
    assert all(torch.equal(a, b) for a, b in zip(first, second))



@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_deterministic_switch_removes_atomics_from_the_half_precision_backward(dtype):
    """The tensor-core backward sums dQ with atomics; under use_deterministic_algorithms it
    takes the atomic-free kernels: bitwise equal gradients, run after run."""
    q, k, v = (rand(2, 4, 300, 64, dtype=dtype).requires_grad_() for _ in range(3))
    grad = rand(2, 4, 300, 64, dtype=dtype)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(3):
            out = fusedmha.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           causal=True, deterministic=True)
            runs.append(torch.autograd.grad(out, (q, k, v), grad.transpose(1, 2)))
    finally:
        torch.use_deterministic_algorithms(before)
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert torch.equal(a, b)
    q64 = q.detach().double().requires_grad_()
    want = reference_attention(q64, k.detach().double(), v.detach().double(), is_causal=True)
    want_dq, = torch.autograd.grad(want, q64, grad.double())
    assert_close_to_truth(runs[0][0], want_dq, dtype=dtype, what="grad_q")


def test_deterministic_flag_without_the_switch_is_an_error():
    q = rand(1, 16, 2, 64).requires_grad_()
    with pytest.raises(RuntimeError, match="flash_attn_func: deterministic=True on CUDA needs"):
        fusedmha.flash_attn_func(q, q, q, deterministic=True)

def test_cuda_graph_capture_with_dropout():
    q, k, v = (rand(2, 4, 128, 64).requires_grad_() for _ in range(3))
    static_grad = torch.randn(2, 4, 128, 64, device=DEV, dtype=torch.float16)

    def step():
        out, lse, rng = ops.attention_forward(q, k, v, dropout_p=0.2)
        grads = ops.attention_backward(static_grad, q, k, v, out, lse, rng, None, 0.2, False, None, False)[:3]
        return out, rng, grads

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, rng, grads = step()
    seen = set()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        keep = ops._dropout_keep_mask(rng.cpu(), 8, 128, 128, 0.2).view(2, 4, 128, 128)
        ref = reference_attention(*(t.detach().cpu() for t in (q, k, v)), keep=keep, dropout_p=0.2)
        assert_close_to_truth(out, ref, dtype=torch.float16)
        seen.add(tuple(rng.cpu().tolist()))
    assert len(seen) == 3, "each replay should draw a fresh dropout stream"
    assert all(torch.isfinite(g).all() for g in grads)


def test_runs_on_the_current_stream_and_device_guard():
    q = rand(2, 4, 256, 64)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # q is made on the default stream
    with torch.cuda.stream(s):
        out = sdpa(q, q, q)
    s.synchronize()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q), rtol=2e-3, atol=2e-3)
    if torch.cuda.device_count() > 1:
        q1 = q.to("cuda:1")
        torch.testing.assert_close(sdpa(q1, q1, q1).cpu(), out.cpu(), rtol=2e-3, atol=2e-3)


def test_build_info_reports_cuda():
    assert fusedmha.build_info()["cuda"] is True
    assert math.isfinite(sdpa(rand(1, 1, 4, 8), rand(1, 1, 4, 8), rand(1, 1, 4, 8)).float().sum().item())
