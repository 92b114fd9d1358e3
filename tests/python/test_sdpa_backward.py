"""Gradients of fusedmha.scaled_dot_product_attention against a float64 reference, on every
device (the `device` fixture: CUDA cases skip, with the reason, without a GPU)."""

import pytest
import torch
import torch.nn.functional as F

import fusedmha
from reference import assert_close_to_truth, grad_tolerance, leaves, reference_attention

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
sdpa = fusedmha.scaled_dot_product_attention


def leaf(t):
    return t.detach().requires_grad_()


def assert_grads_close(q, k, v, **kwargs):
    """fusedmha's gradients must be as close to the float64 truth as PyTorch's own SDPA's
    at the same dtype (within 2x on the CPU, 3x on CUDA), or within the dtype's floor."""
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
        factor, floor = grad_tolerance(x.dtype, x.device)
        assert_close_to_truth(a, r, t, factor=factor, floor=floor, what=f"grad_{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E,Ev", [(1, 1), (7, 5), (16, 16), (64, 64), (80, 48), (128, 128)])
def test_head_dims(dtype, E, Ev, rand):
    assert_grads_close(rand(2, 3, 37, E, dtype=dtype), rand(2, 3, 45, E, dtype=dtype), rand(2, 3, 45, Ev, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E", [16, 64, 100, 128, 256])
@pytest.mark.parametrize("case", ["plain", "causal", "mask", "gqa"])
def test_head_dim_groups_and_kinds(dtype, E, case, device, rand):
    """Every head-dim group of the CUDA kernels (up to 64, 128, 256) over several 64-row tiles,
    plain, causal, with a mask that leaves query row 0 nothing to attend to, and GQA."""
    L, S = 75, 140
    H, Hkv = 4, (2 if case == "gqa" else 4)
    q = rand(2, H, L, E, dtype=dtype).requires_grad_()
    k = rand(2, Hkv, S, E, dtype=dtype).requires_grad_()
    v = rand(2, Hkv, S, E, dtype=dtype).requires_grad_()
    kwargs = {"is_causal": case == "causal", "enable_gqa": case == "gqa"}
    if case == "mask":
        g = torch.Generator(device="cpu").manual_seed(1)
        keep = torch.rand(2, 3, L, S, generator=g) > 0.3
        keep[..., 0, :] = False  # a row with nothing to attend to
        kwargs["attn_mask"] = keep[:, :1].to(device)
    out = sdpa(q, k, v, **kwargs)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    q64, k64, v64 = leaves(q, k, v, dtype=torch.float64)
    ref = reference_attention(q64, k64, v64, **kwargs)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())
    t = leaves(q, k, v)
    torch_out = F.scaled_dot_product_attention(*t, **kwargs)
    torch_grads = torch.autograd.grad(torch_out, t, grad_out)
    factor, floor = grad_tolerance(dtype, device)
    for name, g, r, tg in zip("qkv", grads, ref_grads, torch_grads):
        assert g.shape == r.shape and g.dtype == dtype, name
        # PyTorch may give NaN for the fully masked row; then only the dtype's floor bounds us.
        assert_close_to_truth(g, r, tg if torch.isfinite(tg).all() else None, dtype=dtype, factor=factor,
                              floor=floor, what=f"grad_{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("L,S", [(1, 1), (1, 37), (37, 1), (64, 64), (100, 300), (300, 100), (257, 130)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_lengths(dtype, L, S, is_causal, rand):
    assert_grads_close(rand(2, 2, L, 32, dtype=dtype), rand(2, 2, S, 32, dtype=dtype), rand(2, 2, S, 32, dtype=dtype),
                       is_causal=is_causal)


@pytest.mark.parametrize("mask_shape", [(19, 23), (1, 23), (19, 1), (4, 19, 23), (2, 1, 19, 23), (2, 4, 19, 23)], ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks(mask_shape, kind, device, rand):
    q, k, v = rand(2, 4, 19, 16), rand(2, 4, 23, 16), rand(2, 4, 23, 8)
    if kind == "bool":
        mask = torch.rand(mask_shape) > 0.3
    else:
        mask = torch.randn(mask_shape).masked_fill(torch.rand(mask_shape) < 0.2, float("-inf"))
    assert_grads_close(q, k, v, attn_mask=mask.to(device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bool_mask_per_head_over_several_key_blocks(dtype, rand):
    # Strips of 16 query rows and a tail, keys in chunks of 64 and a tail (read as bits on
    # AVX-512), mask rows a stride apart (a slice of a wider mask), keys no strip sees.
    keep = torch.rand(2, 3, 40, 200) > 0.5
    keep[..., 60:75] = False
    keep[..., 1] = True
    assert_grads_close(rand(2, 3, 40, 32, dtype=dtype), rand(2, 3, 150, 32, dtype=dtype),
                       rand(2, 3, 150, 24, dtype=dtype), attn_mask=keep[..., :150])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fully_masked_rows_get_zero_gradient(dtype, device, rand):
    q, k, v = leaf(rand(2, 4, 19, 16, dtype=dtype)), leaf(rand(2, 4, 23, 16, dtype=dtype)), leaf(rand(2, 4, 23, 8, dtype=dtype))
    allowed = torch.rand(2, 4, 19, 23) > 0.3
    allowed[:, :, 5] = False
    out = sdpa(q, k, v, attn_mask=allowed.to(device))
    out.float().sum().backward()
    assert torch.equal(q.grad[:, :, 5], torch.zeros_like(q.grad[:, :, 5]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("hq,hk", [(8, 1), (8, 2), (6, 3)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gqa(dtype, hq, hk, is_causal, rand):
    assert_grads_close(rand(2, hq, 33, 16, dtype=dtype), rand(2, hk, 41, 16, dtype=dtype), rand(2, hk, 41, 16, dtype=dtype),
                       is_causal=is_causal, enable_gqa=True)


def test_broadcast_batch_and_heads(rand):
    assert_grads_close(rand(2, 3, 19, 16), rand(1, 1, 23, 16), rand(2, 1, 23, 8))


@pytest.mark.parametrize("batch", [(), (3,), (2, 3)], ids=str)
def test_batch_dims(batch, rand):
    assert_grads_close(rand(*batch, 4, 19, 16), rand(*batch, 4, 23, 16), rand(*batch, 4, 23, 8))


def test_two_dim_inputs(rand):
    assert_grads_close(rand(19, 16), rand(23, 16), rand(23, 8))


def test_strided_inputs(rand):
    q = rand(2, 37, 4, 16).transpose(1, 2)
    k = rand(2, 4, 16, 29).transpose(-1, -2)
    v = rand(2, 4, 29, 32)[..., ::2]
    assert_grads_close(q, k, v, is_causal=True)


def test_single_head_uses_key_blocks_in_parallel():
    # Batch 1 x 1 head: the work is split over key blocks; the result must not depend on it.
    q, k, v = torch.randn(1, 1, 300, 64), torch.randn(1, 1, 700, 64), torch.randn(1, 1, 700, 64)
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


def test_gradcheck_float64(device):
    q, k, v = (leaf(torch.randn(1, 2, 5, 4, dtype=torch.float64, device=device)) for _ in range(3))
    mask = (torch.rand(5, 5) > 0.2).to(device)
    # nondet_tol=0: the float64 backward (the CUDA simple kernels too) is deterministic.
    assert torch.autograd.gradcheck(lambda a, b, c: sdpa(a, b, c), (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: sdpa(a, b, c, is_causal=True), (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: sdpa(a, b, c, attn_mask=mask, scale=0.7), (q, k, v))
    k2, v2 = (leaf(torch.randn(1, 1, 6, 4, dtype=torch.float64, device=device)) for _ in range(2))
    assert torch.autograd.gradcheck(lambda a, b, c: sdpa(a, b, c, enable_gqa=True), (q, k2, v2))
    # 9 rows and keys, head dim 8: causal, and a mask with dropout_p given as 0.
    q, k, v = (leaf(torch.randn(1, 2, 9, 8, dtype=torch.float64, device=device)) for _ in range(3))
    mask = (torch.rand(9, 9) > 0.3).to(device)
    assert torch.autograd.gradcheck(lambda a, b, c: sdpa(a, b, c, is_causal=True), (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: sdpa(a, b, c, attn_mask=mask, dropout_p=0.0), (q, k, v))


def test_gradgradcheck_raises_clear_error(device):
    q, k, v = (leaf(torch.randn(1, 2, 5, 4, dtype=torch.float64, device=device)) for _ in range(3))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.gradgradcheck(lambda a, b, c: sdpa(a, b, c), (q, k, v))


# (importing torch.autograd.forward_ad scripts a helper: torch.jit.script's deprecation warning)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_calls_that_record_nothing_skip_autograd_alike(rand):
    # Calls with nothing to record run below autograd (no node, nothing saved): outputs
    # without grad_fn, equal to a recorded call's; a forward-mode tangent is still refused,
    # not dropped; the packed-batch op alike.
    q, k, v = rand(2, 4, 7, 16), rand(2, 2, 9, 16), rand(2, 2, 9, 16)
    recorded = sdpa(leaf(q), k, v, enable_gqa=True)
    assert recorded.grad_fn is not None
    for out in (sdpa(q, k, v, enable_gqa=True), _no_grad(lambda: sdpa(leaf(q), k, v, enable_gqa=True))):
        assert out.grad_fn is None and not out.requires_grad
        assert torch.equal(out, recorded.detach())
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(RuntimeError, match="jvp"):
            sdpa(dual, k, v, enable_gqa=True)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    packed = q[0].transpose(0, 1), k[0, :, :7].transpose(0, 1), v[0, :, :7].transpose(0, 1)
    out = torch.ops.fusedmha.varlen_attention_forward(*packed, cu, cu, 4, 4)[0]
    with_graph = torch.ops.fusedmha.varlen_attention_forward(leaf(packed[0]), *packed[1:], cu, cu, 4, 4)[0]
    assert out.grad_fn is None and with_graph.grad_fn is not None
    assert torch.equal(out, with_graph.detach())


def _no_grad(fn):
    with torch.no_grad():
        return fn()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_opcheck_with_autograd(dtype, device, rand):
    for args, kwargs in [
        ((rand(2, 4, 19, 16, dtype=dtype), rand(2, 4, 23, 16, dtype=dtype), rand(2, 4, 23, 8, dtype=dtype)), {}),
        ((rand(2, 4, 19, 16, dtype=dtype), rand(2, 4, 23, 16, dtype=dtype), rand(2, 4, 23, 16, dtype=dtype)),
         {"is_causal": True}),
        ((rand(2, 8, 19, 16, dtype=dtype), rand(2, 2, 23, 16, dtype=dtype), rand(2, 2, 23, 16, dtype=dtype)),
         {"enable_gqa": True, "attn_mask": (torch.rand(19, 23) > 0.2).to(device)}),
        ((rand(2, 2, 20, 16, dtype=dtype), rand(2, 2, 20, 16, dtype=dtype), rand(2, 2, 20, 16, dtype=dtype)),
         {"attn_mask": (torch.rand(20, 20) > 0.2).to(device)}),
        ((rand(2, 2, 20, 16, dtype=dtype), rand(2, 2, 20, 16, dtype=dtype), rand(2, 2, 20, 16, dtype=dtype)),
         {"is_causal": True, "scale": 0.3}),
    ]:
        args = tuple(leaf(a) for a in args)
        torch.library.opcheck(torch.ops.fusedmha.attention_forward.default, args, kwargs)


def test_opcheck_backward_op(rand):
    q, k, v = rand(2, 4, 19, 16), rand(2, 4, 23, 16), rand(2, 4, 23, 8)
    for p in (0.0, 0.3):
        out, lse, rng = torch.ops.fusedmha.attention_forward(q, k, v, dropout_p=p)
        torch.library.opcheck(torch.ops.fusedmha.attention_backward.default,
                              (torch.randn_like(out), q, k, v, out, lse, rng, None, p, False, None, False))


def test_compiled_training_step(rand):
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
