"""What each rank runs in test_ring_attention.py: ring attention on its shards, compared with
the single-process op on the whole sequence (the same seeded inputs on every rank)."""

import zlib

import torch

import fusedmha
import fusedmha.distributed as cp

TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}

CASES = {
    # name: (B, H, H_kv, L, E, Ev, dtype, kwargs of ring_attention)
    "full": (2, 4, 4, 48, 16, 16, torch.float32, dict()),
    "causal_zigzag_gqa": (2, 4, 2, 48, 16, 16, torch.float32, dict(causal=True)),
    "causal_contiguous": (1, 2, 2, 48, 32, 32, torch.float32, dict(causal=True, zigzag=False)),
    "window_crossing_shards": (1, 2, 1, 48, 16, 16, torch.float32, dict(window_size=(5, 3))),
    "window_wider_than_a_shard": (1, 2, 2, 48, 16, 8, torch.float32, dict(window_size=(30, 17))),
    "causal_window_zigzag": (2, 2, 2, 48, 16, 16, torch.float32, dict(causal=True, window_size=(7, -1))),
    "causal_window_contiguous": (1, 2, 2, 48, 16, 16, torch.float32,
                                 dict(causal=True, zigzag=False, window_size=(19, 0))),
    "float64_causal": (1, 3, 1, 24, 8, 8, torch.float64, dict(causal=True, softmax_scale=0.3)),
    "bfloat16_causal": (1, 2, 2, 96, 32, 32, torch.bfloat16, dict(causal=True)),
    "tiles": (1, 2, 2, 312, 64, 64, torch.float32, dict(causal=True)),
}


def close(got, want, dtype, what):
    err = (got.double() - want.double()).abs().max().item()
    bound = TOL[dtype] * max(1.0, want.double().abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def check_case(name):
    B, H, H_kv, L, E, Ev, dtype, kw = CASES[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # the same on every rank
    q = torch.randn(B, L, H, E, generator=g).to(dtype)
    k = torch.randn(B, L, H_kv, E, generator=g).to(dtype)
    v = torch.randn(B, L, H_kv, Ev, generator=g).to(dtype)
    grad = torch.randn(B, L, H, Ev, generator=g).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = fusedmha.flash_attn_func(*leaves, causal=kw.get("causal", False),
                                    window_size=kw.get("window_size", (-1, -1)),
                                    softmax_scale=kw.get("softmax_scale"))
    want.backward(grad)
    zigzag = kw.get("zigzag", kw.get("causal", False))
    local = [cp.shard(t, zigzag=zigzag).detach().requires_grad_() for t in (q, k, v)]
    out = cp.ring_attention(*local, **kw)
    out.backward(cp.shard(grad, zigzag=zigzag))
    close(out, cp.shard(want, zigzag=zigzag), dtype, f"{name}: output")
    for n, t, ref in zip("qkv", local, leaves):
        close(t.grad, cp.shard(ref.grad, zigzag=zigzag), dtype, f"{name}: grad_{n}")


def all_cases(rank, world):
    for name in CASES:
        check_case(name)


def shard_and_unshard(rank, world):
    x = torch.arange(2 * 4 * world * 3, dtype=torch.float64).view(2, 4 * world, 3)
    for zigzag in (False, True):
        part = cp.shard(x, seq_dim=1, zigzag=zigzag).requires_grad_()
        assert part.shape == (2, 4, 3)
        whole = cp.unshard(part, seq_dim=1, zigzag=zigzag)
        assert torch.equal(whole, x)
        (whole * (rank + 1)).sum().backward()  # the sum of every rank's loss
        assert torch.equal(part.grad, torch.full_like(part, world * (world + 1) / 2))


def errors(rank, world):
    import pytest
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(NotImplementedError, match="ring_attention: dropout"):
        cp.ring_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="ring_attention: every rank must hold a shard of the same length"):
        cp.ring_attention(*(torch.randn(1, 4 + 2 * rank, 2, 16) for _ in range(3)))
    with pytest.raises(ValueError, match="ring_attention: the 3 query heads"):
        cp.ring_attention(torch.randn(1, 8, 3, 16), q, q)
    with pytest.raises(ValueError, match="shard: sequence length 7"):
        cp.shard(torch.randn(1, 7, 2, 16))
