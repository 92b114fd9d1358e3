"""Gradients of fusedmha.scaled_dot_product_attention against a float64 reference."""

import pytest
import torch
import torch.nn.functional as F

import fusedmha
from reference import ATOL_FLOOR, reference_attention

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
sdpa = fusedmha.scaled_dot_product_attention
GRAD_FLOOR = {torch.float64: 1e-11, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def leaf(t):
    return t.detach().requires_grad_()


def assert_grads_close(q, k, v, **kwargs):
    """fusedmha's gradients must be as close to the float64 truth as PyTorch's own SDPA's
    at the same dtype (within 2x), or within the dtype's floor."""
    q, k, v = leaf(q), leaf(k), leaf(v)
    out = sdpa(q, k, v, **kwargs)
    grad_out = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), grad_out)

    q64, k64, v64 = (leaf(t.double()) for t in (q, k, v))
    ref = torch.autograd.grad(reference_attention(q64, k64, v64, **kwargs), (q64, k64, v64), grad_out.double())

    qt, kt, vt = leaf(q), leaf(k), leaf(v)
    theirs = torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, **kwargs), (qt, kt, vt), grad_out)
    for name, a, r, t, x in zip("qkv", ours, ref, theirs, (q, k, v)):
        assert a.shape == x.shape and a.dtype == x.dtype, name
        err = (a.double() - r).abs().max().item() if a.numel() else 0.0
        torch_err = (torch.nan_to_num(t.double()) - r).abs().max().item() if a.numel() else 0.0
        scale = max(1.0, r.abs().max().item() if r.numel() else 1.0)
        bound = 2 * torch_err + GRAD_FLOOR[x.dtype] * scale
        assert err <= bound, f"grad_{name}: max error {err:.3g} > {bound:.3g} (PyTorch's {torch_err:.3g})"


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E,Ev", [(1, 1), (7, 5), (16, 16), (64, 64), (80, 48), (128, 128)])
def test_head_dims(dtype, E, Ev):
    assert_grads_close(rand(2, 3, 37, E, dtype=dtype), rand(2, 3, 45, E, dtype=dtype), rand(2, 3, 45, Ev, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("L,S", [(1, 1), (1, 37), (37, 1), (64, 64), (100, 300), (300, 100), (257, 130)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_lengths(dtype, L, S, is_causal):
    assert_grads_close(rand(2, 2, L, 32, dtype=dtype), rand(2, 2, S, 32, dtype=dtype), rand(2, 2, S, 32, dtype=dtype),
                       is_causal=is_causal)


@pytest.mark.parametrize("mask_shape", [(19, 23), (1, 23), (19, 1), (4, 19, 23), (2, 1, 19, 23), (2, 4, 19, 23)], ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks(mask_shape, kind):
    q, k, v = rand(2, 4, 19, 16), rand(2, 4, 23, 16), rand(2, 4, 23, 8)
    if kind == "bool":
        mask = torch.rand(mask_shape) > 0.3
    else:
        mask = torch.randn(mask_shape).masked_fill(torch.rand(mask_shape) < 0.2, float("-inf"))
    assert_grads_close(q, k, v, attn_mask=mask)


def test_fully_masked_rows_get_zero_gradient():
    q, k, v = leaf(rand(2, 4, 19, 16)), leaf(rand(2, 4, 23, 16)), leaf(rand(2, 4, 23, 8))
    allowed = torch.rand(2, 4, 19, 23) > 0.3
    allowed[:, :, 5] = False
    out = sdpa(q, k, v, attn_mask=allowed)
    out.sum().backward()
    assert torch.equal(q.grad[:, :, 5], torch.zeros_like(q.grad[:, :, 5]))
    assert not any(t.grad.isnan().any() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("hq,hk", [(8, 1), (8, 2), (6, 3)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gqa(dtype, hq, hk, is_causal):
    assert_grads_close(rand(2, hq, 33, 16, dtype=dtype), rand(2, hk, 41, 16, dtype=dtype), rand(2, hk, 41, 16, dtype=dtype),
                       is_causal=is_causal, enable_gqa=True)


def test_broadcast_batch_and_heads():
    assert_grads_close(rand(2, 3, 19, 16), rand(1, 1, 23, 16), rand(2, 1, 23, 8))


@pytest.mark.parametrize("batch", [(), (3,), (2, 3)], ids=str)
def test_batch_dims(batch):
    assert_grads_close(rand(*batch, 4, 19, 16), rand(*batch, 4, 23, 16), rand(*batch, 4, 23, 8))


def test_two_dim_inputs():
    assert_grads_close(rand(19, 16), rand(23, 16), rand(23, 8))


def test_strided_inputs():
    q = rand(2, 37, 4, 16).transpose(1, 2)
    k = rand(2, 4, 16, 29).transpose(-1, -2)
    v = rand(2, 4, 29, 32)[..., ::2]
    assert_grads_close(q, k, v, is_causal=True)


def test_single_head_uses_key_blocks_in_parallel():
    # Batch 1 x 1 head: the work is split over key blocks; the result must not depend on it.
    q, k, v = rand(1, 1, 300, 64), rand(1, 1, 700, 64), rand(1, 1, 700, 64)
    assert_grads_close(q, k, v)
    old = torch.get_num_threads()
    grads = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        qq, kk, vv = leaf(q), leaf(k), leaf(v)
        sdpa(qq, kk, vv).sum().backward()
        grads.append([t.grad for t in (qq, kk, vv)])
    torch.set_num_threads(old)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gradcheck_float64():
    q, k, v = (leaf(torch.randn(1, 2, 5, 4, dtype=torch.float64)) for _ in range(3))
    mask = torch.rand(5, 5) > 0.2
    assert torch.autograd.gradcheck(lambda a, b, c: sdpa(a, b, c), (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: sdpa(a, b, c, is_causal=True), (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: sdpa(a, b, c, attn_mask=mask, scale=0.7), (q, k, v))
    k2, v2 = (leaf(torch.randn(1, 1, 6, 4, dtype=torch.float64)) for _ in range(2))
    assert torch.autograd.gradcheck(lambda a, b, c: sdpa(a, b, c, enable_gqa=True), (q, k2, v2))


def test_gradgradcheck_raises_clear_error():
    q, k, v = (leaf(torch.randn(1, 2, 5, 4, dtype=torch.float64)) for _ in range(3))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.gradgradcheck(lambda a, b, c: sdpa(a, b, c), (q, k, v))


def test_opcheck_with_autograd():
    for args, kwargs in [
        ((rand(2, 4, 19, 16), rand(2, 4, 23, 16), rand(2, 4, 23, 8)), {}),
        ((rand(2, 4, 19, 16), rand(2, 4, 23, 16), rand(2, 4, 23, 16)), {"is_causal": True}),
        ((rand(2, 8, 19, 16), rand(2, 2, 23, 16), rand(2, 2, 23, 16)), {"enable_gqa": True, "attn_mask": torch.rand(19, 23) > 0.2}),
    ]:
        args = tuple(leaf(a) for a in args)
        torch.library.opcheck(torch.ops.fusedmha.attention_forward.default, args, kwargs)


def test_opcheck_backward_op():
    q, k, v = rand(2, 4, 19, 16), rand(2, 4, 23, 16), rand(2, 4, 23, 8)
    for p in (0.0, 0.3):
        out, lse, rng = torch.ops.fusedmha.attention_forward(q, k, v, dropout_p=p)
        torch.library.opcheck(torch.ops.fusedmha.attention_backward.default,
                              (torch.randn_like(out), q, k, v, out, lse, rng, None, p, False, None, False))


def test_compiled_training_step():
    torch._dynamo.reset()

    def step(q, k, v):
        out = sdpa(q, k, v, is_causal=True)
        return out.square().sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for L in (17, 40):
        q, k, v = leaf(rand(2, 4, L, 16)), leaf(rand(2, 4, L, 16)), leaf(rand(2, 4, L, 16))
        compiled(q, k, v).backward()
        qe, ke, ve = leaf(q), leaf(k), leaf(v)
        step(qe, ke, ve).backward()
        for a, b in zip((q, k, v), (qe, ke, ve)):
            torch.testing.assert_close(a.grad, b.grad)
