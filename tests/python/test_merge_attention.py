"""fusedmha.merge_attention: partial results over disjoint sets of keys combine into the
result of one call over all of them (output, log-sum-exp and gradients), in C++ and Python."""

import pytest
import torch

import fusedmha


def partials(q, k, v, bounds, **kw):
    outs, lses = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        out, lse, _ = fusedmha.flash_attn_func(q, k[:, a:b], v[:, a:b], return_attn_probs=True, **kw)
        outs.append(out)
        lses.append(lse)
    return outs, lses


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bounds", [(0, 64), (0, 17, 40, 64), (0, 1, 63, 64)])
def test_merge_equals_one_call(device, dtype, bounds):
    B, L, H, E, S = 2, 9, 4, 16, 64
    q = torch.randn(B, L, H, E, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(B, S, 2, E, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(B, S, 2, E, dtype=dtype, device=device, requires_grad=True)
    sinks = None
    outs, lses = partials(q, k, v, list(bounds), softcap=3.0)
    out, lse = fusedmha.merge_attention(outs, lses)
    ref, ref_lse, _ = fusedmha.flash_attn_func(q, k, v, softcap=3.0, return_attn_probs=True)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, **tol)
    del sinks


def test_partials_with_rows_that_saw_nothing():
    """A chunk a row cannot see (causal: keys after it) has lse +inf there and weighs nothing;
    a row no chunk saw stays 0 with lse +inf."""
    B, L, H, E = 1, 6, 2, 8
    q, k, v = (torch.randn(B, L, H, E, dtype=torch.float64) for _ in range(3))
    outs, lses = [], []
    for a, b in [(0, 3), (3, 6)]:
        # Keys a..b-1 against queries 0..5, causal (query i sees keys <= i): a mask per chunk.
        visible = torch.arange(L)[:, None] >= torch.arange(a, b)[None, :]
        o, lse, _ = torch.ops.fusedmha.attention_forward(
            q.transpose(1, 2), k[:, a:b].transpose(1, 2), v[:, a:b].transpose(1, 2), visible)
        outs.append(o.transpose(1, 2))
        lses.append(lse)
    assert torch.isinf(lses[1][..., :3]).all()
    out, lse = fusedmha.merge_attention(outs, lses)
    ref = fusedmha.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out, ref)
    empty = [o[:, :0] for o in outs], [lse_[..., :0] for lse_ in lses]
    assert fusedmha.merge_attention(*empty)[0].shape == (B, 0, H, E)
    o, l2 = fusedmha.merge_attention([torch.zeros(1, 2, 1, 4)], [torch.full((1, 1, 2), float("inf"))])
    assert torch.all(o == 0) and torch.isinf(l2).all()


def test_bad_partials_are_refused():
    out, lse = torch.randn(1, 3, 2, 4), torch.randn(1, 2, 3)
    with pytest.raises(RuntimeError, match="as many outputs as lses"):
        fusedmha.merge_attention([out], [lse, lse])
    with pytest.raises(RuntimeError, match=r"outputs \(B, L, H, E\) and lses \(B, H, L\)"):
        fusedmha.merge_attention([out], [lse.transpose(1, 2)])
