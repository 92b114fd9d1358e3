"""Masks with whole tiles hidden or seen (document masking of packed sequences, prefix-LM,
block-sparse patterns, per head and per batch index) are read on the CPU tile by tile: the
kernels skip the tiles that hide every key and add no mask where a tile hides none. Results,
log-sum-exp, gradients (of a float mask too) and weights must be those of the float64
reference with the mask as given, at lengths that split the tiles and with blocks that do not
line up with them; and the skip itself must happen (NaN keys that only hidden tiles cover do
not reach the output)."""

import pytest
import torch

import fusedmha
from reference import check_masked_call, reference_variants

B, H, E = 2, 3, 16


def documents(L, S, lengths):
    """(len(lengths), 1, L, S) bool: causal within documents of the given lengths per batch
    index (bottom-right when S > L: the queries are the last L of the keys)."""
    masks = []
    for doc_lengths in lengths:
        ids = torch.repeat_interleave(torch.arange(len(doc_lengths)), torch.tensor(doc_lengths))
        ids = torch.cat([ids, ids.new_full((S - len(ids),), len(doc_lengths))])  # (pad: own doc)
        q_ids = ids[S - L:]
        i = torch.arange(S - L, S)[:, None]
        masks.append((q_ids[:, None] == ids[None, :]) & (torch.arange(S)[None, :] <= i))
    return torch.stack(masks)[:, None]


def blocks(shape, L, S, block_q, block_kv, seed):
    """A random block-sparse bool mask of shape (..., L, S): each block_q × block_kv block hides
    every key, hides none or is random, a third of each."""
    g = torch.Generator().manual_seed(seed)
    nq, nk = -(-L // block_q), -(-S // block_kv)
    kind = torch.randint(0, 3, (*shape, nq, nk), generator=g)
    kind = kind.repeat_interleave(block_q, -2)[..., :L, :].repeat_interleave(block_kv, -1)[..., :S]
    random = torch.rand(*shape, L, S, generator=g) < 0.5
    return (kind == 1) | ((kind == 2) & random)


CASES = {
    "documents": lambda L, S: documents(L, S, [[40, 90, L - 130], [L]]),
    "prefix_lm": lambda L, S: (torch.arange(S) < 70) | torch.ones(L, S, dtype=torch.bool).tril(S - L),
    "blocks_per_head": lambda L, S: blocks((B, H), L, S, 24, 40, 0),
    "blocks_per_batch": lambda L, S: blocks((B, 1), L, S, 32, 64, 1),
    "blocks_shared": lambda L, S: blocks((), L, S, 16, 64, 2),
    # (rows 0-39 see no key at all, and one block of keys no query sees)
    "empty_rows": lambda L, S: blocks((), L, S, 40, 50, 3) & (torch.arange(L) >= 40)[:, None]
    & ~((torch.arange(S) >= 64) & (torch.arange(S) < 128)),
}


# The call's variants beside the mask (made per test: sinks are a leaf of their own).
VARIANTS = {
    "plain": lambda: {},
    "dropout": lambda: dict(dropout_p=0.3),
    "softcap": lambda: dict(softcap=2.0),
    "sinks": lambda: dict(sinks=torch.randn(H, dtype=torch.float64, requires_grad=True)),
    "window": lambda: dict(window_left=90, window_right=0, bottom_right=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("L, S", [(200, 200), (150, 300)])
@pytest.mark.parametrize("name", list(CASES))
def test_tiled_masks_match_float64(name, L, S, variant):
    q, k, v = (torch.randn(B, H, n, E, dtype=torch.float64, requires_grad=True) for n in (L, S, S))
    check_masked_call(q, k, v, CASES[name](L, S), **VARIANTS[variant]())


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("name", ["documents", "blocks_per_head", "empty_rows"])
def test_tiled_masks_in_float32(name, threads):
    L = S = 256
    q, k, v = (torch.randn(B, H, n, E, requires_grad=True) for n in (L, S, S))
    mask = CASES[name](L, S)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, [q, k, v], grad)
    finally:
        torch.set_num_threads(before)
    ref, _, _ = reference_variants(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-6)
    for a, b in zip(got, torch.autograd.grad(ref, [q, k, v], grad.double())):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(1, H), (H,)])
def test_per_head_tiles_the_batch_shares(shape, threads):
    """A per-head mask the batch shares, at a size where the forward takes the batch indices of
    a head in one item (the outer dims reordered, the mask's tiles with them)."""
    L = S = 400
    q, k, v = (torch.randn(4, H, n, E, dtype=torch.float64) for n in (L, S, S))
    mask = blocks(shape, L, S, 48, 64, 5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, reference_variants(q, k, v, mask)[0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_float_mask_with_hidden_tiles_and_its_gradient(dtype):
    """A float mask of -inf tiles beside tiles of 0 and tiles of other values (a bias inside a
    block mask, as fusedmha.flex.bias makes): the -inf tiles are skipped and their gradient is
    0; the bias's gradient elsewhere is the reference's."""
    L, S = 150, 300
    q, k, v = (torch.randn(B, H, n, E, dtype=dtype, requires_grad=True) for n in (L, S, S))
    hidden = ~blocks((B, H), L, S, 32, 64, 4)
    values = torch.randn(B, H, L, S, dtype=dtype) * (torch.rand(B, H, L, S) < 0.5)
    bias = values.masked_fill(hidden, float("-inf")).requires_grad_()
    out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    ref, _, _ = reference_variants(q, k, v, bias)
    tol = {} if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.double(), ref, **tol)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [q, k, v, bias], grad)
    want = torch.autograd.grad(ref, [q, k, v, bias], grad.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.nan_to_num(), **tol)
    assert (got[3][hidden] == 0).all()


def test_mask_that_hides_nothing_is_the_unmasked_call():
    """A bool mask of all trues is dropped: the output is the unmasked call's, bit for bit."""
    q, k, v = (torch.randn(B, H, 130, E) for _ in range(3))
    mask = torch.ones(B, 1, 130, 130, dtype=torch.bool)
    got = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(got, fusedmha.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("heads", [1, H])
def test_keys_only_hidden_tiles_cover_are_never_used(heads):
    """The skip itself: in two documents split on a tile boundary, the second document's keys
    may hold NaN in K and V, and the first document's rows (output, log-sum-exp, dQ) stay
    those of the reference with finite keys. (The general mask path adds -inf to a NaN score:
    NaN.)"""
    L = S = 256
    mask = documents(L, S, [[128, 128]]).expand(B, heads, L, S)
    q = torch.randn(B, H, L, E, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, H, S, E, dtype=torch.float64) for _ in range(2))
    nan_k, nan_v = (t.clone().index_fill_(-2, torch.arange(128, S), float("nan")) for t in (k, v))
    out, lse, _ = torch.ops.fusedmha.attention_forward(q, nan_k, nan_v, mask, 0.0, False)
    first = slice(0, 128)
    ref, ref_lse, _ = reference_variants(q, k, v, mask)
    torch.testing.assert_close(out[..., first, :], ref[..., first, :])
    torch.testing.assert_close(lse[..., first], ref_lse[..., first])
    grad = torch.zeros_like(out)
    grad[..., first, :] = torch.randn_like(grad[..., first, :])
    (dq,) = torch.autograd.grad(out, [q], grad)
    (want,) = torch.autograd.grad(ref, [q], grad)
    torch.testing.assert_close(dq[..., first, :], want[..., first, :])
