"""In-kernel dropout: the same mask in forward and backward, reproducible from the seed, and
the expected statistics, on every device (the `device` fixture: CUDA cases skip, with the
reason, without a GPU)."""

import math

import pytest
import torch

import fusedmha
from reference import kernel_keep_mask, reference_attention

sdpa = fusedmha.scaled_dot_product_attention


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_forward_and_backward_match_reference_with_same_mask(is_causal, dtype, device):
    p = 0.3
    q, k, v = (torch.randn(2, 3, 37, 16, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    out, lse, rng = torch.ops.fusedmha.attention_forward(q, k, v, dropout_p=p, is_causal=is_causal)
    keep = kernel_keep_mask(rng, q, k, p)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, is_causal=is_causal, keep=keep, dropout_p=p)
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)

    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, rtol=tol * 5, atol=tol * 5)


def test_dropped_fraction_matches_p(rand):
    for p in (0.1, 0.5, 0.9):
        q = rand(4, 8, 64, 16)
        _, _, rng = torch.ops.fusedmha.attention_forward(q, q, q, dropout_p=p)
        keep = kernel_keep_mask(rng, q, q, p)
        n = keep.numel()
        dropped = 1 - keep.float().mean().item()
        assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n), (p, dropped)


def test_expectation_is_undropped_attention(rand):
    # Averaged over many masks, dropout leaves the output unchanged in expectation.
    q, k, v = rand(1, 1, 4, 8), rand(1, 1, 6, 8), rand(1, 1, 6, 8)
    mean = torch.stack([sdpa(q, k, v, dropout_p=0.5) for _ in range(4000)]).mean(0)
    torch.testing.assert_close(mean, sdpa(q, k, v), rtol=0.1, atol=0.1)


def test_same_seed_same_output_different_seed_different(rand):
    q, k, v = rand(2, 3, 20, 16), rand(2, 3, 20, 16), rand(2, 3, 20, 16)
    torch.manual_seed(7)
    a = sdpa(q, k, v, dropout_p=0.2)
    b = sdpa(q, k, v, dropout_p=0.2)
    torch.manual_seed(7)
    c = sdpa(q, k, v, dropout_p=0.2)
    assert torch.equal(a, c)
    assert not torch.equal(a, b)


def test_zero_dropout_is_bit_identical(rand):
    q, k, v = rand(2, 3, 20, 16), rand(2, 3, 20, 16), rand(2, 3, 20, 16)
    assert torch.equal(sdpa(q, k, v, dropout_p=0.0), sdpa(q, k, v))


def test_gradcheck_with_dropout_fixed_seed(device):
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, device=device, requires_grad=True) for _ in range(3))

    def f(a, b, c):
        torch.manual_seed(3)  # the same mask on every evaluation
        return sdpa(a, b, c, dropout_p=0.3)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_dropout_with_mask_and_gqa(device):
    p = 0.25
    q = torch.randn(2, 4, 9, 8, requires_grad=True).to(device)
    k, v = torch.randn(2, 2, 11, 8).to(device), torch.randn(2, 2, 11, 8).to(device)
    mask = (torch.rand(9, 11) > 0.3).to(device)
    out, _, rng = torch.ops.fusedmha.attention_forward(q, k, v, mask, p, enable_gqa=True)
    keep = kernel_keep_mask(rng, q, k, p)
    ref = reference_attention(q, k, v, attn_mask=mask, enable_gqa=True, keep=keep, dropout_p=p)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)


def test_dropout_state_positions_a_part_of_a_longer_sequence():
    """attention_forward(dropout_state=[seed, offset, row, column]) on rows row.. and keys
    column.. of a sequence drops what a call on the whole sequence with [seed, offset] drops
    there (context parallelism's ring steps rely on it), forward and backward."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 16, generator=g) for _ in range(3))
    p, seed, offset = 0.3, 1234567, 89
    full = torch.tensor([seed, offset])
    keep = torch.ops.fusedmha._dropout_keep_mask(full, 6, 40, 40, p).view(2, 3, 40, 40)
    for row, col, n, m in [(0, 0, 40, 40), (7, 12, 20, 16), (33, 36, 7, 4)]:
        qp = q[:, :, row:row + n].clone().requires_grad_()
        kp, vp = (t[:, :, col:col + m].clone().requires_grad_() for t in (k, v))
        state = torch.tensor([seed, offset, row, col])
        out, lse, rng = torch.ops.fusedmha.attention_forward(qp, kp, vp, None, p, dropout_state=state)
        assert torch.equal(rng, state)
        part_keep = keep[:, :, row:row + n, col:col + m]
        leaves = [t.detach().double().requires_grad_() for t in (qp, kp, vp)]
        want = reference_attention(*leaves, keep=part_keep, dropout_p=p)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (qp, kp, vp), grad)
        expected = torch.autograd.grad(want, leaves, grad.double())
        for a, b in zip(got, expected):
            torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("state, message", [
    (torch.tensor([1, 2, 3]), r"dropout_state int64 \[seed, offset\]"),
    (torch.tensor([1.0, 2.0]), r"dropout_state int64 \[seed, offset\]"),
    (torch.tensor([1, 2, 0, 6]), "column a multiple of 4"),
    (torch.tensor([1, 2, -1, 0]), "row >= 0"),
])
def test_bad_dropout_state_is_an_error(state, message):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="fusedmha.attention_forward: .*" + message):
        torch.ops.fusedmha.attention_forward(q, q, q, None, 0.1, dropout_state=state)
