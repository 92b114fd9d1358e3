"""fusedmha.flex_attention against float64 attention with the dense mask a BlockMask stands
for: outputs, log-sum-exp and gradients, for the common mask_mod patterns, per-batch and
per-head masks, random block sparsity, the score_mod helpers, GQA; and its errors."""

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import fusedmha
import fusedmha.flex as flex


def _block_dense(block_mask, B=None, H=None):
    """The (B, H, L, S) mask a BlockMask stands for, built here from its definition: listed
    full blocks whole, listed partial blocks where mask_mod holds (called with each batch
    index's and head's own b and h, also where the BlockMask's batch or heads are 1), nothing
    else."""
    L, S = block_mask.seq_lengths
    QB, KB = block_mask.BLOCK_SIZE
    Bm, Hm, nq = block_mask.kv_num_blocks.shape
    B, H = B or Bm, H or Hm
    out = torch.zeros(B, H, L, S, dtype=torch.bool)
    lists = [(block_mask.kv_num_blocks, block_mask.kv_indices, False)]
    if block_mask.full_kv_num_blocks is not None:
        lists.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True))
    for num, idx, full in lists:
        for b in range(B):
            for h in range(H):
                bl, hl = b % Bm, h % Hm
                for i in range(nq):
                    for j in idx[bl, hl, i, : num[bl, hl, i]].tolist():
                        qs = slice(i * QB, min((i + 1) * QB, L))
                        ks = slice(j * KB, min((j + 1) * KB, S))
                        if full:
                            out[b, h, qs, ks] = True
                            continue
                        qi = torch.arange(qs.start, qs.stop).view(-1, 1)
                        ki = torch.arange(ks.start, ks.stop).view(1, -1)
                        bb, hh = torch.full_like(qi, b), torch.full_like(qi, h)
                        out[b, h, qs, ks] = block_mask.mask_mod(bb, hh, qi, ki).expand(
                            qi.shape[0], ki.shape[1])
    return out


def _reference(q, k, v, mask, score_mod=None, scale=None):
    """float64 attention: scores, score_mod as a function of the index grid, mask, softmax."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ kk.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    B, H, L, S = s.shape
    if score_mod is not None:
        grid = torch.meshgrid(torch.arange(B), torch.arange(H), torch.arange(L), torch.arange(S),
                              indexing="ij")
        s = score_mod(s, *grid)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (q, k, v), p @ vv, lse


def _check(q, k, v, block_mask, score_mod=None, enable_gqa=False, scale=None, tol=2e-5):
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = fusedmha.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                       scale=scale, enable_gqa=enable_gqa, return_lse=True)
    B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    mask = (_block_dense(block_mask, B, H) if block_mask is not None
            else torch.ones(1, 1, L, S, dtype=torch.bool)).expand(B, H, L, S)
    ref_mod = score_mod if not isinstance(score_mod, flex.bias) else flex.bias(
        score_mod.tensor.detach().double())
    inputs, ref_out, ref_lse = _reference(q, k, v, mask, ref_mod, scale)
    assert (out - ref_out).abs().max() <= tol * ref_out.abs().max().clamp(min=1)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~seen)
    assert (lse[seen] - ref_lse[seen]).abs().max() <= tol * 10
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref_out, inputs, g.double())
    for name, a, b in zip("qkv", grads, ref_grads):
        assert (a - b).abs().max() <= 10 * tol * b.abs().max().clamp(min=1), name


def _qkv(B=2, H=4, L=200, S=200, E=32, H_kv=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, E, generator=g, dtype=dtype)
    k = torch.randn(B, H_kv or H, S, E, generator=g, dtype=dtype)
    v = torch.randn(B, H_kv or H, S, E, generator=g, dtype=dtype)
    return q, k, v


def _documents(S, n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randint(0, n, (S,), generator=g)).values


PATTERNS = {
    "document_causal": lambda docs: lambda b, h, q, kv: (docs[q] == docs[kv]) & (q >= kv),
    "prefix_lm": lambda docs: lambda b, h, q, kv: (kv < 48) | (q >= kv),
    "window_and_sinks": lambda docs: lambda b, h, q, kv: ((q - kv).abs() <= 40) | (kv < 4),
    "dilated": lambda docs: lambda b, h, q, kv: ((q - kv) % 3 == 0) & (q >= kv),
    "per_head": lambda docs: lambda b, h, q, kv: (q >= kv) | (h % 2 == 1),
    "per_batch": lambda docs: lambda b, h, q, kv: (kv <= q + 16 * b),
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("block_size", [64, 128, (32, 64)])
def test_patterns(pattern, block_size):
    q, k, v = _qkv()
    mask_mod = PATTERNS[pattern](_documents(200))
    B = 2 if pattern == "per_batch" else None
    H = 4 if pattern == "per_head" else None
    bm = create_block_mask(mask_mod, B, H, 200, 200, device="cpu", BLOCK_SIZE=block_size)
    _check(q, k, v, bm)


@pytest.mark.parametrize("pattern", ["per_head", "per_batch"])
def test_block_mask_of_one_batch_and_head_calls_mask_mod_with_each(pattern):
    # (torch's create_block_mask(..., None, None, ...) lists blocks for b = h = 0 only; the
    # partial blocks' mask_mod still sees every b and h.)
    bm = create_block_mask(PATTERNS[pattern](None), None, None, 200, 200, device="cpu",
                           BLOCK_SIZE=64)
    _check(*_qkv(), bm)


def test_mask_kept_per_head_only_where_mask_mod_reads_the_head():
    kept = {}
    for pattern in ("per_head", "per_batch", "prefix_lm"):
        bm = create_block_mask(PATTERNS[pattern](None), None, None, 200, 200, device="cpu",
                               BLOCK_SIZE=64)
        kept[pattern] = tuple(flex._block_mask_dense(bm, 2, 4, torch.device("cpu")).shape[:2])
    assert kept == {"per_head": (1, 4), "per_batch": (2, 1), "prefix_lm": (1, 1)}


def test_changed_block_mask_is_evaluated_again():
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 200, 200, device="cpu",
                           BLOCK_SIZE=64)
    q, k, v = _qkv()
    first = fusedmha.flex_attention(q, k, v, block_mask=bm)
    bm.mask_mod = lambda b, h, q, kv: q >= kv + 3
    assert not torch.equal(first, fusedmha.flex_attention(q, k, v, block_mask=bm))
    _check(q, k, v, bm)
    bm.kv_num_blocks.zero_()  # (every partial block dropped, in place)
    _check(q, k, v, bm)


@pytest.mark.parametrize("L,S", [(1, 200), (77, 200), (200, 93)])
def test_lengths_and_gqa(L, S):
    q, k, v = _qkv(L=L, S=S, H=4, H_kv=2)
    bm = create_block_mask(lambda b, h, q, kv: (kv - q) % 5 != 0, None, None, L, S,
                           device="cpu", BLOCK_SIZE=32)
    _check(q, k, v, bm, enable_gqa=True, scale=0.3)


def test_random_block_sparsity():
    g = torch.Generator().manual_seed(3)
    blocks = torch.rand(2, 4, 7, 7, generator=g) < 0.4
    blocks[..., 0] = False  # (rows with no block at all)
    bm = create_block_mask(lambda b, h, q, kv: blocks[b, h, q // 32, kv // 32], 2, 4, 200, 200,
                           device="cpu", BLOCK_SIZE=32)
    _check(*_qkv(), bm)


def test_no_block_mask_and_fully_masked_rows():
    _check(*_qkv(L=50, S=60), None)
    bm = create_block_mask(lambda b, h, q, kv: kv < q - 100, None, None, 200, 200, device="cpu",
                           BLOCK_SIZE=64)
    q, k, v = _qkv()
    out, lse = fusedmha.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert torch.all(out[:, :, :101] == 0) and torch.all(torch.isneginf(lse[:, :, :101]))
    _check(q, k, v, bm)


@pytest.mark.parametrize("kind", ["softcap", "alibi", "bias", "relative_position"])
def test_score_mods(kind):
    q, k, v = _qkv(L=120, S=150)
    q = q * 3
    bm = create_block_mask(lambda b, h, q, kv: q + 30 >= kv, None, None, 120, 150, device="cpu",
                           BLOCK_SIZE=64)
    g = torch.Generator().manual_seed(5)
    if kind == "softcap":
        mod = flex.softcap(5.0)
    elif kind == "alibi":
        mod = flex.alibi(torch.rand(4, generator=g))
    elif kind == "bias":
        mod = flex.bias(torch.randn(4, 120, 1, generator=g))  # (broadcast over the keys)
    else:
        mod = flex.relative_position(torch.randn(4, 41, generator=g))  # (distances past 20 clamp)
    _check(q, k, v, bm, score_mod=mod)


def test_bias_gradient():
    q, k, v = _qkv(B=1, H=2, L=40, S=50, dtype=torch.float64)
    table = torch.randn(2, 40, 50, dtype=torch.float64, requires_grad=True)
    bm = create_block_mask(lambda b, h, q, kv: q >= kv - 5, None, None, 40, 50, device="cpu",
                           BLOCK_SIZE=16)
    out = fusedmha.flex_attention(q, k, v, score_mod=flex.bias(table), block_mask=bm)
    mask = _block_dense(bm)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(32) + table
    ref = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, table, g)
    (ref_grad,) = torch.autograd.grad(ref, table, g)
    assert torch.allclose(grad, ref_grad, atol=1e-10)


def test_relative_position_table_gradient():
    q, k, v = _qkv(B=2, H=2, L=40, S=50, dtype=torch.float64)
    table = torch.randn(2, 21, dtype=torch.float64, requires_grad=True)
    bm = create_block_mask(lambda b, h, q, kv: q >= kv - 5, None, None, 40, 50, device="cpu",
                           BLOCK_SIZE=16)
    out = fusedmha.flex_attention(q, k, v, score_mod=flex.relative_position(table), block_mask=bm)
    distance = (torch.arange(50) - torch.arange(40)[:, None]).clamp(-10, 10) + 10
    s = (q @ k.transpose(-1, -2)) / math.sqrt(32) + table[:, distance]
    ref = torch.softmax(s.masked_fill(~_block_dense(bm, 2, 2), float("-inf")), -1) @ v
    assert torch.allclose(out, ref, atol=1e-12)
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, table, g)
    (ref_grad,) = torch.autograd.grad(ref, table, g)
    assert torch.allclose(grad, ref_grad, atol=1e-10)


def test_mask_mod_evaluated_once_per_block_mask():
    calls = []

    def causal(b, h, q, kv):
        calls.append(1)
        return q >= kv

    bm = create_block_mask(causal, None, None, 200, 200, device="cpu", BLOCK_SIZE=64)
    before = len(calls)
    for _ in range(3):
        fusedmha.flex_attention(*_qkv(), block_mask=bm).sum()
    assert len(calls) == before + 1


def test_signature_is_flex_attentions():
    import inspect

    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    ours = inspect.signature(fusedmha.flex_attention).parameters
    theirs = inspect.signature(torch_flex).parameters
    assert [(n, p.kind, p.default) for n, p in ours.items()] == [
        (n, p.kind, p.default) for n, p in theirs.items()]


def test_errors():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="softcap.*alibi.*bias.*relative_position"):
        fusedmha.flex_attention(q, k, v, score_mod=lambda s, b, h, q, kv: s * 2)
    with pytest.raises(ValueError, match="enable_gqa"):
        fusedmha.flex_attention(q, k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="4-D"):
        fusedmha.flex_attention(q[0], k, v)
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 100, 100, device="cpu")
    with pytest.raises(ValueError, match="block_mask is for"):
        fusedmha.flex_attention(q, k, v, block_mask=bm)
    with pytest.raises(ValueError, match="return_aux"):
        fusedmha.flex_attention(q, k, v, return_aux=object())
    two = create_block_mask(lambda b, h, q, kv: q >= kv, 2, 3, 200, 200, device="cpu")
    with pytest.raises(ValueError, match=r"block_mask is for \(B, H\) = \(2, 3\)"):
        fusedmha.flex_attention(q, k, v, block_mask=two)
    broken = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 200, 200, device="cpu")
    broken.kv_indices[0, 0, 0, 0] = -1  # (a listed partial block)
    with pytest.raises(RuntimeError, match=r"lists key blocks outside \[0, 2\)"):
        fusedmha.flex_attention(q, k, v, block_mask=broken)
    with pytest.raises(ValueError, match="bias: tensor of shape"):
        fusedmha.flex_attention(q, k, v, score_mod=flex.bias(torch.zeros(3, 200, 200)))
    with pytest.raises(ValueError, match=r"table must be a floating-point tensor \(H, 2R \+ 1\)"):
        flex.relative_position(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="table has 3 rows"):
        fusedmha.flex_attention(q, k, v, score_mod=flex.relative_position(torch.zeros(3, 5)))
    with pytest.raises(ValueError, match="cap must be > 0"):
        flex.softcap(0)
    with pytest.raises(ValueError, match="slopes has 3 entries"):
        fusedmha.flex_attention(q, k, v, score_mod=flex.alibi(torch.ones(3)))


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_whole_grid_evaluation_equals_partial_blocks(pattern):
    # (torch.compile evaluates mask_mod over the whole grid; eager calls over partial blocks.)
    mask_mod = PATTERNS[pattern](_documents(200))
    bm = create_block_mask(mask_mod, 2, 4, 200, 190, device="cpu", BLOCK_SIZE=(32, 64))
    whole = flex._block_states_dense(bm, 2, 4, whole_grid=True)
    assert torch.equal(whole, flex._block_states_dense(bm, 2, 4, whole_grid=False))
    assert torch.equal(whole, _block_dense(bm))


def test_compile_fullgraph():
    docs = _documents(200)
    bm = create_block_mask(PATTERNS["document_causal"](docs), None, None, 200, 200,
                           device="cpu", BLOCK_SIZE=64)
    table = torch.randn(4, 200, 200, requires_grad=True)

    def step(q, k, v, block_mask):
        return flex_call(q, k, v, block_mask).square().sum()

    def flex_call(q, k, v, block_mask):
        return fusedmha.flex_attention(q, k, v, score_mod=flex.bias(table), block_mask=block_mask)

    q, k, v = (t.requires_grad_() for t in _qkv())
    compiled = torch.compile(step, fullgraph=True)
    grads = torch.autograd.grad(compiled(q, k, v, bm), (q, k, v, table))
    ref = torch.autograd.grad(step(q, k, v, bm), (q, k, v, table))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_block_mask_dense_op():
    """The op that places a block mask's bits (C++'s BlockMask::dense, and flex_attention's
    partial blocks): bits in list order whatever order the blocks are listed in, a block
    listed as partial and full is full, bits of their own per batch index over lists of 1,
    and its errors."""
    op = torch.ops.fusedmha.block_mask_dense
    num = torch.tensor([2, 1], dtype=torch.int32).view(1, 1, 2)
    idx = torch.tensor([2, 0, 1, 0], dtype=torch.int32).view(1, 1, 2, 2)
    full_num = torch.tensor([0, 2], dtype=torch.int32).view(1, 1, 2)
    full_idx = torch.tensor([0, 0, 1, 2], dtype=torch.int32).view(1, 1, 2, 2)
    bits = torch.tensor([1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool).view(3, 2, 2)
    want = torch.tensor([[0, 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0],
                         [0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    # (Lengths 3 x 5: the blocks' elements past them are dropped.)
    assert torch.equal(op(num, idx, bits, [2, 2], [4, 6], full_num, full_idx)[0, 0], want)
    assert torch.equal(op(num, idx, bits, [2, 2], [3, 5], full_num, full_idx)[0, 0],
                       want[:3, :5])
    # Bits of their own for each of 2 batch indices, over lists of batch 1.
    per_batch = torch.stack([bits, ~bits]).unsqueeze(1)  # (2, 1, 3, 2, 2)
    both = op(num, idx, per_batch, [2, 2], [4, 6])
    assert both.shape == (2, 1, 4, 6)
    assert torch.equal(both[0, 0], op(num, idx, bits, [2, 2], [4, 6])[0, 0])
    assert torch.equal(both[1, 0], op(num, idx, ~bits, [2, 2], [4, 6])[0, 0])
    with pytest.raises(RuntimeError, match=r"lists key blocks outside \[0, 3\)"):
        op(num, idx.clone().fill_(3), bits, [2, 2], [4, 6])
    with pytest.raises(RuntimeError, match=r"expected partial_bits bool \(3, 2, 2\)"):
        op(num, idx, bits[:2], [2, 2], [4, 6])
    with pytest.raises(RuntimeError, match=r"expected kv_num_blocks to have 3 query blocks"):
        op(num, idx, bits, [2, 2], [6, 6])
    with pytest.raises(RuntimeError, match=r"expected kv_num_blocks in \[0, 2\]"):
        op(num.clone().fill_(3), idx, bits, [2, 2], [4, 6])
    with pytest.raises(RuntimeError, match="both or neither"):
        op(num, idx, bits, [2, 2], [4, 6], full_num)
    with pytest.raises(RuntimeError, match="bits of their own per index need lists of 1"):
        op(num.expand(2, 1, 2), idx.expand(2, 1, 2, 2), per_batch.repeat(1, 1, 2, 1, 1),
           [2, 2], [4, 6])
