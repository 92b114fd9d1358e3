"""Masks that say no more than a band and key padding (a causal mask passed explicitly, with
left or right padding, a static cache's unused slots, a sliding window; bool, or float with -inf
or the dtype's lowest value for hidden keys) are read on the CPU as
the band and per-batch key spans, and the hidden key blocks are skipped: results, log-sum-exp,
weights and gradients must be those of the float64 reference with the mask as given, and masks
that only look like them (one element off, other float values, per-head rows) keep the
general path, with the same results."""

import pytest
import torch

import fusedmha
from reference import check_masked_call as check, reference_variants

B, H, E = 3, 4, 16


def band_mask(L, S, diagonal=0, window_left=None, begins=(0,), ends=None):
    """(len(begins), 1, L, S) bool: row i of batch b sees keys [max(begins[b], i + diagonal −
    window_left), min(ends[b], i + diagonal + 1))."""
    ends = ends or (S,) * len(begins)
    i = torch.arange(L)[:, None]
    j = torch.arange(S)[None, :]
    rows = []
    for begin, end in zip(begins, ends):
        keep = (j >= begin) & (j < end) & (j <= i + diagonal)
        if window_left is not None:
            keep &= j >= i + diagonal - window_left
        rows.append(keep)
    return torch.stack(rows)[:, None]


def as_float(mask, dtype=torch.float64):
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))


def as_lowest(mask, dtype=torch.float64):
    """The float mask that hides with torch.finfo(dtype).min, as transformers' float masks do."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


# transformers' masks (bool, (B, 1, L, S)): causal prefill with left and right padding (the
# left-padded rows of the first queries see nothing), a static cache's unused slots (S > L),
# chunked prefill after a cache (bottom-right), a sliding window with padding; and the
# (L, S) masks people pass themselves: torch.tril, nn.Transformer's float square mask.
CASES = {
    "causal_left_padding": lambda L, S: band_mask(L, S, begins=(0, 5, 29), ends=(S, S, S)),
    "causal_right_padding": lambda L, S: (band_mask(L, S, begins=(0, 0, 0))
                                          & (torch.arange(S) < torch.tensor([S, 20, 9])[:, None, None, None])),
    "static_cache": lambda L, S: band_mask(L, S, begins=(0, 4, 11), ends=(L, L, L)),
    "chunked_prefill": lambda L, S: band_mask(L, S, diagonal=S - L, begins=(0, 6, 2)),
    "sliding_window": lambda L, S: band_mask(L, S, diagonal=S - L, window_left=7, begins=(0, 3, 20)),
    "tril": lambda L, S: torch.ones(L, S, dtype=torch.bool).tril(),
    "square_subsequent": lambda L, S: torch.nn.Transformer.generate_square_subsequent_mask(
        L, dtype=torch.float64)[:, :S] if L == S else as_float(torch.ones(L, S, dtype=torch.bool).tril()),
    # (Every row sees a key: see test_lowest_in_rows_that_see_nothing_is_added.)
    "lowest_right_padding": lambda L, S: as_lowest(CASES["causal_right_padding"](L, S)),
}


@pytest.mark.parametrize("kw", [dict(), dict(softcap=2.0), dict(sinks=True), dict(dropout_p=0.3),
                                dict(alibi=True)])
@pytest.mark.parametrize("L, S", [(37, 37), (37, 50), (70, 130)])
@pytest.mark.parametrize("name", list(CASES))
def test_band_masks_match_float64(name, L, S, kw):
    q, k, v = (torch.randn(B, H, n, E, dtype=torch.float64, requires_grad=True) for n in (L, S, S))
    mask = CASES[name](L, S)
    kw = dict(kw)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H, dtype=torch.float64, requires_grad=True)
    if kw.pop("alibi", False):  # (ALiBi reads the diagonal: the mask's band is not taken)
        kw["alibi_slopes"] = torch.rand(H, dtype=torch.float64)
    check(q, k, v, mask, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["causal_left_padding", "square_subsequent", "lowest_right_padding"])
def test_band_masks_in_every_dtype(name, dtype):
    """Bool masks, and float masks of the inputs' dtype (0 and -inf in any float type; the
    dtype's lowest value, which float16's is not read as hiding)."""
    L = S = 70
    q, k, v = (torch.randn(B, H, n, E).to(dtype) for n in (L, S, S))
    mask = CASES[name](L, S)
    if name.startswith("lowest"):
        mask = as_lowest(mask == 0, dtype)
    elif mask.dtype != torch.bool:
        mask = mask.to(dtype)
    out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref, _, _ = reference_variants(q, k, v, mask)
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), ref, **tol)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("heads", [1, H, "copies"])
@pytest.mark.parametrize("Ev", [E, 24])
@pytest.mark.parametrize("name", ["causal_left_padding", "static_cache", "tril", "square_subsequent",
                                  "chunked_prefill", "sliding_window", "lowest_right_padding"])
def test_keys_no_row_sees_are_never_used(name, Ev, heads, threads):
    """The skip itself: keys that no query of a batch index sees (left padding, a static
    cache's slots past the last query, keys left of a window) may hold NaN in K and V, and the
    output, the log-sum-exp and the gradients stay finite and those of the reference (0 for
    those keys); also with the mask expanded over the batch and the heads (stride 0), or
    copied for every head (as repeat_interleave makes a (N·H, L, S) mask for
    nn.MultiheadAttention). (The general mask path adds -inf to a NaN score: NaN. So this
    fails wherever the mask's structure is not recognised.)"""
    L, S = 150, 300
    q = torch.randn(B, H, L, E, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, H, S, n, dtype=torch.float64) for n in (E, Ev))
    mask = CASES[name](L, S)
    mask = mask.expand(B, H, L, S).contiguous() if heads == "copies" else mask.expand(B, heads, L, S)
    seen = mask if mask.dtype == torch.bool else mask == 0
    unseen = ~seen[:, :1].any(dim=-2).unsqueeze(-1)  # (B, 1, S, 1)
    assert unseen.any()
    nan_k, nan_v = (t.masked_fill(unseen, float("nan")).requires_grad_() for t in (k, v))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse, _ = torch.ops.fusedmha.attention_forward(q, nan_k, nan_v, mask, 0.0, False)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, [q, nan_k, nan_v], grad)
    finally:
        torch.set_num_threads(before)
    k.requires_grad_(), v.requires_grad_()
    ref, ref_lse, _ = reference_variants(q, k, v, mask)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    for a, b in zip(got, torch.autograd.grad(ref, [q, k, v], grad)):
        torch.testing.assert_close(a, b)


def near_misses(L, S):
    base = CASES["causal_left_padding"](L, S)
    one_off_left = base.clone()
    one_off_left[1, 0, 40, 4] = True  # (row 40 of batch 1 begins one key early)
    one_off_right = base.clone()
    one_off_right[2, 0, 60, 61] = True  # (one key right of the diagonal)
    hole = base.clone()
    hole[0, 0, 50, 25] = False
    per_head = base.expand(B, H, L, S).clone()
    per_head[1, 2, 66, :] = False
    other_values = as_float(base)
    other_values[0, 0, 3, 2] = -1e9  # (a large negative, not -inf)
    wrong_diagonal = base.clone()
    wrong_diagonal[2, 0, 45, 45] = False  # (one row ends one key early)
    return dict(one_off_left=one_off_left, one_off_right=one_off_right, hole=hole,
                per_head=per_head, other_values=other_values, wrong_diagonal=wrong_diagonal)


@pytest.mark.parametrize("name", list(near_misses(70, 70)))
def test_masks_that_only_look_like_bands(name):
    L = S = 70
    q, k, v = (torch.randn(B, H, n, E, dtype=torch.float64, requires_grad=True) for n in (L, S, S))
    check(q, k, v, near_misses(L, S)[name])


@pytest.mark.parametrize("rows", ["left_padding", "a_batch_index"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_lowest_in_rows_that_see_nothing_is_added(dtype, rows):
    """A row whose keys are all hidden by the lowest value averages them (every score is that
    value), as the float64 reference does: such a mask is read as a mask, not as a band with
    empty rows (which would give zeros, as -inf does). (Forward only: the backward's
    probabilities exp(s - lse) are 1 there, not 1/S, since lse = max + log(S) rounds to the
    max at that size; PyTorch's fused CPU kernel does the same.)"""
    L = S = 40
    q, k, v = (torch.randn(B, H, n, E, dtype=dtype) for n in (L, S, S))
    if rows == "left_padding":
        mask = as_lowest(CASES["causal_left_padding"](L, S), dtype)
    else:  # (key padding in which batch index 1 sees no key)
        lengths = torch.tensor([S, 0, 17])[:, None, None, None]
        mask = as_lowest(torch.arange(S) < lengths, dtype)
    out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref, _, _ = reference_variants(q, k, v, mask)
    empty = (mask != 0).all(dim=-1, keepdim=True).expand_as(out)  # (the rows that see nothing)
    assert empty.any() and out[empty].abs().sum() > 0
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out, ref.to(dtype), **tol)


@pytest.mark.parametrize("band", [dict(is_causal=True), dict(window_left=3, window_right=0)])
def test_lowest_beside_a_band_of_the_calls_own_is_added(band):
    """Left padding hidden by the lowest value on a call with a band of its own: the first
    rows of a padded batch index see, within their band, only keys that value hides, and
    average them (the reference), so there the value is read as a value, not as a span that
    would leave those rows empty. (Forward only, as above.)"""
    L = S = 40
    q, k, v = (torch.randn(B, H, n, E, dtype=torch.float64) for n in (L, S, S))
    begins = torch.tensor([0, 5, 29])[:, None, None, None]
    mask = as_lowest(torch.arange(S) >= begins)  # (B, 1, 1, S)
    band = dict(band)
    is_causal = band.pop("is_causal", False)
    out, lse, _ = torch.ops.fusedmha.attention_forward(q, k, v, mask, 0.0, is_causal, **band)
    ref, ref_lse, _ = reference_variants(q, k, v, mask, is_causal=is_causal, **band)
    assert out[2, :, :29].abs().sum() > 0
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


def nan_in_unseen_keys(k, v, mask):
    """k and v with NaN at the keys that no row of their batch index sees in mask (B, 1, L, S)
    or (B, H, L, S), bool or float (0 = visible)."""
    seen = mask if mask.dtype == torch.bool else mask == 0
    unseen = ~seen[:, :1].any(dim=-2).unsqueeze(-1)  # (B, 1, S, 1)
    assert unseen.any()
    return k.masked_fill(unseen, float("nan")), v.masked_fill(unseen, float("nan"))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("kw", [dict(alibi_slopes=True), dict(window_left=200, window_right=200)])
def test_key_padding_rows_beside_alibi_or_a_window_are_key_spans(kw, threads):
    """Where the call reads the diagonal (ALiBi) or has a band of its own, a (B, 1, L, S) mask
    whose rows are all one run (key padding, as BLOOM's and MPT's callers pass it) still
    becomes key spans: its padded keys may hold NaN. (Each row is compared with its batch
    index's first after it is read: compared before, with the rows split among threads, every
    such mask was refused.)"""
    L, S = 40, 300
    kw = dict(kw)
    if kw.pop("alibi_slopes", False):
        kw["alibi_slopes"] = torch.rand(H, dtype=torch.float64)
    q = torch.randn(B, H, L, E, dtype=torch.float64)
    k, v = (torch.randn(B, H, S, E, dtype=torch.float64) for _ in range(2))
    lengths = torch.tensor([S, 170, 90])
    mask = (torch.arange(S) < lengths[:, None]).view(B, 1, 1, S).expand(B, 1, L, S).contiguous()
    nan_k, nan_v = nan_in_unseen_keys(k, v, mask)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse, _ = torch.ops.fusedmha.attention_forward(q, nan_k, nan_v, mask, 0.0, False, **kw)
    finally:
        torch.set_num_threads(before)
    ref, ref_lse, _ = reference_variants(q, k, v, mask, **kw)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("copies", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lowest_skips_unseen_keys_in_every_dtype(dtype, copies):
    """In float32 and bfloat16 as in float64, a mask that hides with the lowest value is read as
    spans and a band: NaN in the keys no row sees stays out. With copies, 3-d inputs (N, L, E)
    and the mask copied for every N (as for the heads of nn.MultiheadAttention's 3-d calls)."""
    L = S = 70
    mask = as_lowest(CASES["causal_right_padding"](L, S), dtype)  # (B, 1, L, S)
    q, k, v = (torch.randn(B, H, L, E, dtype=dtype) for _ in range(3))
    if copies:  # (one batch index's mask, B·H copies of it)
        mask = mask[1:2].expand(B, H, L, S)
        q, k, v = (t.reshape(B * H, L, E) for t in (q, k, v))
        nan_k, nan_v = nan_in_unseen_keys(k.view(B, H, L, E), v.view(B, H, L, E), mask)
        nan_k, nan_v = nan_k.view(B * H, L, E), nan_v.view(B * H, L, E)
        mask = mask.reshape(B * H, L, S).contiguous()
    else:
        nan_k, nan_v = nan_in_unseen_keys(k, v, mask)
    out = fusedmha.scaled_dot_product_attention(q, nan_k, nan_v, attn_mask=mask)
    ref, _, _ = reference_variants(q, k, v, mask)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out, ref.to(dtype), **tol)


def test_a_value_near_the_lowest_is_a_value():
    """Only the exact lowest hides: half of it, even where the band hides the key anyway,
    makes the mask one to add, so the NaN in the keys that no row sees reaches their rows
    (the general path adds the mask to a NaN score: NaN), where without it they stay out."""
    L = S = 40
    q, k, v = (torch.randn(B, H, n, E, dtype=torch.float64) for n in (L, S, S))
    mask = as_lowest(CASES["causal_right_padding"](L, S))
    nan_k, nan_v = nan_in_unseen_keys(k, v, mask)
    assert fusedmha.scaled_dot_product_attention(q, nan_k, nan_v, attn_mask=mask).isfinite().all()
    mask[0, 0, 33, 35] = torch.finfo(torch.float64).min / 2  # (right of row 33's diagonal)
    out = fusedmha.scaled_dot_product_attention(q, nan_k, nan_v, attn_mask=mask)
    assert out[1:].isnan().any() and out[0].isfinite().all()


@pytest.mark.parametrize("threads", [1, 3])
def test_large_masks_read_by_several_threads(threads):
    """A mask of several MB, whose rows the scan splits among the threads: read as a band and
    key spans (NaN in the keys no row sees stays out), and with a hole in its very last row
    (found by whichever thread reads it), read as a mask (the NaN reaches the rows)."""
    L = S = 1536
    mask = band_mask(L, S, begins=(0, 700))  # (2, 1, L, S) bool, 4.7 MB
    q, k, v = (torch.randn(2, 1, n, 8) for n in (L, S, S))
    nan_k, nan_v = nan_in_unseen_keys(k, v, mask)
    hole = mask.clone()
    hole[1, 0, L - 1, 1000] = False
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = fusedmha.scaled_dot_product_attention(q, nan_k, nan_v, attn_mask=mask)
        out_hole = fusedmha.scaled_dot_product_attention(q, nan_k, nan_v, attn_mask=hole)
    finally:
        torch.set_num_threads(before)
    ref, _, _ = reference_variants(q, k, v, mask)
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-5)
    assert out_hole[1].isnan().any()


def test_float16_lowest_is_added_as_a_value():
    """float16's lowest, -65504, is a value the scores can pass: a hidden key whose score is
    100000 above the visible one's still wins, as in PyTorch's SDPA. (Read as hiding the key,
    as -inf does, the row would be the visible key's value row.)"""
    q = torch.full((1, 1, 2, 16), 158.0, dtype=torch.float16)
    k = torch.zeros(1, 1, 2, 16, dtype=torch.float16)
    k[0, 0, 1] = 158.0  # (query · key 1 · scale ≈ 99856)
    v = torch.tensor([[1.0] * 16, [-1.0] * 16], dtype=torch.float16)[None, None]
    mask = as_lowest(torch.ones(2, 2, dtype=torch.bool).tril(), torch.float16)
    out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           attn_mask=mask.float())
    assert ref[0, 0, 0, 0] == -1.0  # (row 0 takes the hidden key's value)
    torch.testing.assert_close(out.float(), ref)


def test_band_mask_with_a_band_of_its_own():
    """A causal mask on a call that has a band already (a sliding window): the call's band
    stays, and the mask is read (its band would replace the call's)."""
    L = S = 70
    q, k, v = (torch.randn(B, H, n, E, dtype=torch.float64, requires_grad=True) for n in (L, S, S))
    mask = CASES["causal_left_padding"](L, S)
    check(q, k, v, mask, window_left=10, window_right=3)


def test_multihead_attention_with_a_causal_mask_and_padding_matches_pytorch():
    """nn.MultiheadAttention's causal attn_mask with a key_padding_mask (bool, True = hidden):
    the module's merged mask is a band and key spans. And both float (0 and -inf), as
    generate_square_subsequent_mask makes them."""
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(32, 4, batch_first=True, dtype=torch.float64)
    mod = fusedmha.MultiheadAttention(32, 4, batch_first=True, dtype=torch.float64)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(3, 11, 32, dtype=torch.float64)
    causal = torch.ones(11, 11, dtype=torch.bool).triu(1)
    padding = torch.arange(11)[None, :] >= torch.tensor([11, 7, 9])[:, None]  # True = padded
    for attn_mask, key_padding_mask in ((causal, padding), (as_float(~causal), as_float(~padding))):
        out, w = mod(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask)
        ref_out, ref_w = ref(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(w, ref_w)
    # The two merged by hand, per batch index, and repeated for each head (N·H, L, S).
    merged = (causal[None] | padding[:, None, :]).repeat_interleave(4, dim=0)
    out, _ = mod(x, x, x, attn_mask=merged, need_weights=False)
    ref_out, _ = ref(x, x, x, attn_mask=merged, need_weights=False)
    torch.testing.assert_close(out, ref_out)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("Hkv", [2, 1])
@pytest.mark.parametrize("L", [1, 3, 20])
def test_band_masks_in_decoding(L, Hkv, threads):
    """A few new queries per head over a long grouped-query cache (decoding, speculative
    decoding's drafts; 20 queries take the GEMM path), with transformers' mask for a
    left-padded batch and a static cache (causal, bottom-right to the last query's position,
    slots past it unused): the band and spans are taken, the keys split across threads or
    not. The slots no query sees hold NaN: they are never read. (With one K/V head, read from
    a cache of two, the packed query heads leave the batch as the last outer dim, and no work
    item may hold two batch indices.)"""
    Bd, Hq, S, used = 4, 8, 700, 650
    q = torch.randn(Bd, Hq, L, E, dtype=torch.float64)
    k, v = (torch.randn(Bd, S, 2, E, dtype=torch.float64)[:, :, :Hkv].transpose(1, 2)
            for _ in range(2))
    mask = band_mask(L, S, diagonal=used - L, begins=(0, 100, 333, 0), ends=(used,) * Bd)
    unseen = ~mask.any(dim=-2).unsqueeze(-1)  # (Bd, 1, S, 1)
    nan_k, nan_v = (t.masked_fill(unseen, float("nan")) for t in (k, v))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse, _ = torch.ops.fusedmha.attention_forward(q, nan_k, nan_v, mask, 0.0, False, None, True)
    finally:
        torch.set_num_threads(before)
    ref, ref_lse, _ = reference_variants(q, k, v, mask, enable_gqa=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
