"""fusedmha.attention_weights: the probabilities of a forward call, recomputed from its
log-sum-exp (MultiheadAttention's need_weights), against a float64 reference; dropout
consistent with the forward's output; gradients (gradcheck) and the op contract. On every
device (the `device` fixture: CUDA cases skip, with the reason, without a GPU)."""

import pytest
import torch

from reference import reference_probs, weights_atol

OPS = torch.ops.fusedmha


def forward_and_weights(q, k, v, mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False, average_heads=False):
    out, lse, rng = OPS.attention_forward(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
    weights = OPS.attention_weights(q, k, lse, rng, mask, dropout_p, is_causal, scale,
                                    enable_gqa, average_heads)
    return out, weights


CASES = {
    "plain": dict(q=(2, 3, 37, 16), k=(2, 3, 53, 16)),
    "plain_head_dim_32": dict(q=(2, 4, 50, 32), k=(2, 4, 70, 32)),
    "causal": dict(q=(2, 3, 70, 16), k=(2, 3, 70, 16), is_causal=True),
    "causal_l_ne_s": dict(q=(1, 2, 9, 8), k=(1, 2, 140, 8), is_causal=True),
    "bool_mask": dict(q=(2, 3, 37, 16), k=(2, 3, 53, 16), mask=("bool", (2, 1, 37, 53))),
    "padding_mask": dict(q=(2, 3, 37, 16), k=(2, 3, 53, 16), mask=("bool", (2, 1, 1, 53))),
    "float_mask": dict(q=(2, 3, 37, 16), k=(2, 3, 53, 16), mask=("float", (37, 53))),
    "gqa": dict(q=(2, 4, 21, 8), k=(2, 2, 30, 8), enable_gqa=True),
    "broadcast_batch": dict(q=(2, 3, 21, 8), k=(1, 3, 30, 8)),
    "two_dim": dict(q=(21, 8), k=(30, 8)),
    "scale": dict(q=(1, 2, 21, 8), k=(1, 2, 30, 8), scale=0.3),
}


def make_case(case, dtype, device):
    q = torch.randn(case["q"], dtype=dtype, device=device)
    k = torch.randn(case["k"], dtype=dtype, device=device)
    v = torch.randn(case["k"], dtype=dtype, device=device)
    mask = None
    if "mask" in case:
        kind, shape = case["mask"]
        mask = torch.rand(shape) > 0.3 if kind == "bool" else torch.randn(shape, dtype=dtype)
        mask = mask.to(device)
    kwargs = dict(is_causal=case.get("is_causal", False), scale=case.get("scale"),
                  enable_gqa=case.get("enable_gqa", False))
    return q, k, v, mask, kwargs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("average_heads", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_weights_match_reference(name, average_heads, dtype, device):
    q, k, v, mask, kwargs = make_case(CASES[name], dtype, device)
    _, weights = forward_and_weights(q, k, v, mask, average_heads=average_heads, **kwargs)
    ref = reference_probs(q, k, mask, **kwargs)
    if average_heads and ref.dim() > 2:
        ref = ref.mean(-3)
    assert weights.shape == ref.shape and weights.dtype == dtype
    assert weights.is_contiguous()
    torch.testing.assert_close(weights.double(), ref, atol=weights_atol(dtype, device), rtol=0)


def test_fully_masked_rows_are_zero(device, rand):
    q, k, v = rand(1, 2, 4, 8), rand(1, 2, 6, 8), rand(1, 2, 6, 8)
    mask = torch.ones(4, 6, dtype=torch.bool, device=device)
    mask[1] = False
    _, weights = forward_and_weights(q, k, v, mask)
    assert (weights[:, :, 1] == 0).all()
    torch.testing.assert_close(weights[:, :, 0].sum(-1), torch.ones(1, 2, device=device))


@pytest.mark.parametrize("average_heads", [False, True])
def test_dropout_weights_reproduce_the_output(average_heads, rand):
    q, k, v = (rand(2, 3, 40, 8, dtype=torch.float64) for _ in range(3))
    out, weights = forward_and_weights(q, k, v, dropout_p=0.3)
    torch.testing.assert_close(weights @ v, out)
    dropped = (weights == 0).double().mean().item()
    assert abs(dropped - 0.3) < 0.03
    torch.manual_seed(5)
    _, averaged = forward_and_weights(q, k, v, dropout_p=0.3, average_heads=True)
    torch.manual_seed(5)
    _, per_head = forward_and_weights(q, k, v, dropout_p=0.3)
    torch.testing.assert_close(averaged, per_head.mean(1))


GRAD_CASES = [
    dict(),
    dict(dropout_p=0.3),
    dict(average_heads=True, dropout_p=0.2),
    dict(is_causal=True, enable_gqa=True, scale=0.7, kv_heads=2),
    dict(mask="bool"),
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=str)
def test_gradcheck(case, device):
    case = dict(case)
    kv_heads = case.pop("kv_heads", 4)
    q = torch.randn(2, 4, 6, 5, dtype=torch.float64, device=device, requires_grad=True)
    k = torch.randn(2, kv_heads, 7, 5, dtype=torch.float64, device=device, requires_grad=True)
    v = torch.randn(2, kv_heads, 7, 5, dtype=torch.float64, device=device)
    mask = (torch.rand(6, 7) > 0.3).to(device) if case.pop("mask", None) else None

    def weights_of(q, k):
        torch.manual_seed(7)  # the same dropout stream on every evaluation
        return forward_and_weights(q, k, v, mask, **case)[1]

    assert torch.autograd.gradcheck(weights_of, (q, k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_are_rounded_once(dtype):
    """In half precision the backward recomputes the probabilities in float (the forward's
    lse is float): rounded to the input dtype first, each had an error of up to 2^-9 (bf16),
    and the gradients of q and k came out 1.9-2.1x as far from the float64 truth as their own
    rounding to the dtype; now as far as that rounding (the incoming gradient is exact in the
    dtype, as autograd hands it over)."""
    worst = 0.0
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(2, 3, 37, 16, generator=g).to(dtype).requires_grad_()
        k = torch.randn(2, 3, 53, 16, generator=g).to(dtype).requires_grad_()
        mask = torch.randn(37, 53, generator=g).to(dtype)
        grad = torch.randn(2, 3, 37, 53, generator=g).to(dtype)
        _, weights = forward_and_weights(q, k, k.detach(), mask)
        got = torch.autograd.grad(weights, (q, k), grad)
        q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
        want = torch.autograd.grad(reference_probs(q64, k64, mask.double()), (q64, k64), grad.double())
        for a, b in zip(got, want):
            rounding = (b.to(dtype).double() - b).abs().max().item()
            worst = max(worst, (a.double() - b).abs().max().item() / rounding)
    assert worst <= 1.3, worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_inside_autocast_gives_the_same_gradients(dtype):
    """backward() called inside torch.autocast (on the CPU it runs on the calling thread, with
    autocast on): the weights' backward runs with autocast off, as outside it, where autocast
    had cast its widened inputs back to bf16 and run its matmuls in bf16."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 37, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, 3, 53, 16, generator=g).to(dtype).requires_grad_()
    mask = torch.randn(37, 53, generator=g).to(dtype)
    grad = torch.randn(2, 3, 37, 53, generator=g).to(dtype)

    def gradients(autocast):
        _, weights = forward_and_weights(q, k, k.detach(), mask)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return torch.autograd.grad(weights, (q, k), grad)

    for a, b in zip(gradients(False), gradients(True)):
        assert torch.equal(a, b)


def test_opcheck(rand):
    q, k, v = rand(2, 3, 9, 8), rand(2, 3, 11, 8), rand(2, 3, 11, 8)
    q.requires_grad_()
    _, lse, rng = OPS.attention_forward(q, k, v, None, 0.2, True)
    torch.library.opcheck(OPS.attention_weights.default,
                          (q, k, lse, rng, None, 0.2, True, None, False, True))


def test_bad_logsumexp_is_refused():
    q, k = torch.randn(2, 3, 9, 8), torch.randn(2, 3, 11, 8)
    _, lse, rng = OPS.attention_forward(q, k, k)
    with pytest.raises(RuntimeError, match="logsumexp"):
        OPS.attention_weights(q, k, lse[:, :, :5], rng)
    with pytest.raises(RuntimeError, match="rng_state"):
        OPS.attention_weights(q, k, lse, rng.float())
