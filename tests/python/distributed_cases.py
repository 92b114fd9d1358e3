"""What each rank runs in test_distributed.py: ring attention on its shards, compared with
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
    "dropout": (2, 2, 2, 48, 16, 16, torch.float32, dict(dropout_p=0.3)),
    "dropout_causal_zigzag_gqa": (1, 4, 2, 48, 16, 16, torch.float32, dict(causal=True, dropout_p=0.2)),
    "dropout_window": (1, 2, 2, 48, 16, 16, torch.float32, dict(window_size=(9, 2), dropout_p=0.25)),
}


def reference(q, k, v, kw):
    """The single-process op on the whole sequence: flash_attn_func, or with dropout the op
    given the stream the ring draws (the same seed before both)."""
    causal, window = kw.get("causal", False), kw.get("window_size", (-1, -1))
    if not kw.get("dropout_p"):
        return fusedmha.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                        softmax_scale=kw.get("softmax_scale"))
    torch.manual_seed(123)
    state = cp._draw_dropout_state(None, q.device)
    out, _, _ = torch.ops.fusedmha.attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, kw["dropout_p"], causal,
        kw.get("softmax_scale"), q.size(2) != k.size(2), window_left=window[0],
        window_right=window[1], dropout_state=state)
    torch.manual_seed(123)  # the ring draws the same stream
    return out.transpose(1, 2)


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
    want = reference(*leaves, kw)
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
    with pytest.raises(ValueError, match="ring_attention: with dropout, each shard's chunks must be a multiple of 4"):
        cp.ring_attention(*(torch.randn(1, 6, 2, 16) for _ in range(3)), dropout_p=0.1)
    with pytest.raises(ValueError, match="ring_attention: every rank must hold a shard of the same length"):
        cp.ring_attention(*(torch.randn(1, 4 + 2 * rank, 2, 16) for _ in range(3)))
    with pytest.raises(ValueError, match="ring_attention: the 3 query heads"):
        cp.ring_attention(torch.randn(1, 8, 3, 16), q, q)
    with pytest.raises(ValueError, match="shard: sequence length 7"):
        cp.shard(torch.randn(1, 7, 2, 16))


def encoder_layer(rank, world):
    """nn.TransformerEncoderLayer with its self-attention made context-parallel: outputs, input
    gradients and (summed over ranks) parameter gradients equal the layer on the whole
    sequence."""
    import copy

    import torch.distributed as dist
    from torch import nn

    for batch_first, causal in ((True, True), (False, False)):
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0,
                                           batch_first=batch_first)
        parallel = cp.context_parallel(copy.deepcopy(layer))
        assert isinstance(parallel.self_attn, cp.ContextParallelMultiheadAttention)
        L, seq_dim = 8 * world, 1 if batch_first else 0
        shape = (3, L, 32) if batch_first else (L, 3, 32)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1), requires_grad=True)
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(2))
        mask = nn.Transformer.generate_square_subsequent_mask(L) if causal else None
        want = layer(x, src_mask=mask, is_causal=causal)
        want.backward(grad)
        part = cp.shard(x.detach(), seq_dim=seq_dim, zigzag=causal).requires_grad_()
        out = parallel(part, is_causal=causal, src_mask=mask)
        out.backward(cp.shard(grad, seq_dim=seq_dim, zigzag=causal))
        close(out, cp.shard(want, seq_dim=seq_dim, zigzag=causal), torch.float32, "output")
        close(part.grad, cp.shard(x.grad, seq_dim=seq_dim, zigzag=causal), torch.float32, "grad_x")
        for (name, p), ref in zip(parallel.named_parameters(), layer.parameters()):
            g = p.grad.clone()
            dist.all_reduce(g)
            close(g, ref.grad, torch.float32, f"grad of {name}")
        with torch.no_grad():  # eval and no grad: still context-parallel (no fast path)
            parallel.eval()
            layer.eval()
            close(parallel(part, is_causal=causal, src_mask=mask),
                  cp.shard(layer(x, src_mask=mask, is_causal=causal), seq_dim=seq_dim, zigzag=causal),
                  torch.float32, "eval output")


class _Block(torch.nn.Module):
    """A residual self-attention block with a fusedmha.MultiheadAttention."""

    def __init__(self):
        super().__init__()
        self.attn = fusedmha.MultiheadAttention(16, 4, batch_first=True)
        self.ff = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.ff(x + self.attn(x, x, x, need_weights=False, is_causal=True)[0])


def _one_process_step(x, target, lr):
    """The reference: one SGD step on the global batch, on one process."""
    torch.manual_seed(0)
    model = _Block()
    loss = torch.nn.functional.mse_loss(model(x), target)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return dict(model.named_parameters())


def data_parallel(rank, world, wrap):
    """A step of DDP or FSDP (fully_shard) over `world` ranks, each with its part of the global
    batch, gives the parameters of the same step on one process with the whole batch."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(5)
    x, target = torch.randn(2 * world, 12, 16, generator=g), torch.randn(2 * world, 12, 16, generator=g)
    lr = 0.1
    want = _one_process_step(x, target, lr)
    torch.manual_seed(0)
    model = _Block()
    if wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        params = lambda: dict(model.module.named_parameters())  # noqa: E731
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.attn)
        fully_shard(model)
        params = None
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    mine = slice(2 * rank, 2 * rank + 2)
    torch.nn.functional.mse_loss(model(x[mine]), target[mine]).backward()
    opt.step()
    if wrap == "ddp":
        got = params()
    else:  # the full parameters, gathered from their shards
        got = {name: p.full_tensor() for name, p in model.named_parameters()}
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name, p in got.items():
        close(p.detach(), want[name].detach(), torch.float32, f"{wrap}: {name} after the step")
    dist.barrier()
