"""A bool mask that only pads the keys per batch index (each row one run of trues: left
padding, a suffix, or both) is recognised on the CPU as key spans, and its padded keys are
skipped, never read: results, weights and gradients must be those of the float64 reference,
for such masks (empty and full rows too) and for masks that only look like them (holes, two
runs, per-head or per-row differences), which keep the general path."""

import pytest
import torch

import fusedmha
from reference import assert_same_gradients, kernel_keep_mask, reference_variants


def suffix_mask(lengths, S, shape):
    keep = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
    return keep.view(shape)


def span_mask(spans, S, shape):
    """Row b true at keys [begin, end) of spans[b] = (begin, end)."""
    keys = torch.arange(S)[None, :]
    begin, end = (torch.tensor(t)[:, None] for t in zip(*spans))
    return ((keys >= begin) & (keys < end)).view(shape)


# Suffixes (lengths 37, 20, 1, 0), left padding (from 5, 36, 32), both (3 to 20, 17 to 18),
# and rows of falses: spans that start and end inside a key block, on its edges, or at its ends.
@pytest.mark.parametrize("spans", [[(0, 37), (0, 20), (0, 1)], [(0, 0), (0, 37), (0, 12)],
                                   [(0, 37)] * 3, [(5, 37), (36, 37), (32, 37)],
                                   [(3, 20), (0, 0), (17, 18)]])
@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True, bottom_right=True), dict(softcap=2.0),
                                dict(sinks=True), dict(dropout=True)])
def test_key_spans_match_float64(spans, kw):
    B, H, L, S, E = 3, 4, 9, 37, 16
    q, k, v = (torch.randn(B, H, n, E, dtype=torch.float64, requires_grad=True) for n in (L, S, S))
    mask = span_mask(spans, S, (B, 1, 1, S))
    kw = dict(kw)
    is_causal = kw.pop("is_causal", False)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H, dtype=torch.float64, requires_grad=True)
    p = 0.3 if kw.pop("dropout", False) else 0.0
    out, lse, rng = torch.ops.fusedmha.attention_forward(q, k, v, mask, p, is_causal, **kw)
    keep = None
    if p > 0:
        keep = kernel_keep_mask(rng, q, k, p)
    ref, ref_lse, probs = reference_variants(q, k, v, mask, is_causal, keep=keep, dropout_p=p, **kw)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    assert_same_gradients(out, ref, [q, k, v] + ([kw["sinks"]] if "sinks" in kw else []))
    weights = torch.ops.fusedmha.attention_weights(q, k, lse, rng, mask, p, is_causal, None, False,
                                                   True, **kw)
    want = probs if keep is None else probs * keep / (1 - p)
    torch.testing.assert_close(weights, want.mean(-3))


def test_suffix_padding_read_through_strides():
    """A suffix mask that is a strided view (every second key of a buffer whose other keys
    repeat them): its rows are read through the key and batch strides, not as contiguous."""
    B, H, L, S, E = 3, 2, 4, 30, 8
    q, k, v = (torch.randn(B, H, n, E, dtype=torch.float64) for n in (L, S, S))
    buffer = suffix_mask([5, 30, 0], S, (B, 1, 1, S)).repeat_interleave(2, dim=-1)
    mask = buffer[..., ::2]
    assert mask.stride(-1) == 2
    out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref, _, _ = reference_variants(q, k, v, mask)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("Hkv", [2, 1])
@pytest.mark.parametrize("L", [1, 70])
def test_keys_outside_a_span_are_never_used(L, Hkv, threads):
    """Left padding, a suffix or both are skipped, not computed: K and V outside a row's span
    may hold NaN (a cache's unused slots) and the output stays that of the keys in the span,
    in prefill and in decoding (grouped heads packed as rows, keys split across threads; with
    one K/V head the batch indices are the last outer dim, and no work item holds two of
    them). (The general mask path adds -inf to a NaN score: NaN. So this fails wherever a span
    is not recognised.)"""
    B, H, S, E = 4, 8, 700, 16
    q = torch.randn(B, H, L, E)
    k, v = (torch.randn(B, Hkv, S, E) for _ in range(2))
    spans = [(100, 700), (0, 650), (33, 401), (0, 700)]
    mask = span_mask(spans, S, (B, 1, 1, S))
    nan_k, nan_v = (t.masked_fill(~mask.view(B, 1, S, 1), float("nan")) for t in (k, v))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = fusedmha.scaled_dot_product_attention(q, nan_k, nan_v, attn_mask=mask, enable_gqa=True)
    finally:
        torch.set_num_threads(before)
    ref, _, _ = reference_variants(q.double(), k.double(), v.double(), mask, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("mask_kind", ["hole", "hole_in_the_last_row", "two_runs", "per_head",
                                       "per_row"])
def test_masks_that_are_not_key_spans(mask_kind):
    B, H, L, S, E = 2, 3, 5, 20, 8
    q, k, v = (torch.randn(B, H, n, E, dtype=torch.float64) for n in (L, S, S))
    mask = suffix_mask([14, 20], S, (B, 1, 1, S))
    if mask_kind == "hole":
        mask = mask.clone()
        mask[0, ..., 3] = False
    elif mask_kind == "hole_in_the_last_row":
        mask = mask.clone()
        mask[1, ..., 12] = False
    elif mask_kind == "two_runs":
        mask = mask.flip(-1).clone()  # (left padding, then a hole)
        mask[0, ..., 15] = False
    elif mask_kind == "per_head":
        mask = mask.expand(B, H, 1, S).clone()
        mask[1, 2, 0, 7:] = False
    else:
        mask = mask.expand(B, 1, L, S).clone()
        mask[0, 0, 1, 2:] = False
    out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref, _, _ = reference_variants(q, k, v, mask)
    torch.testing.assert_close(out, ref)


def test_multihead_attention_with_right_padding_matches_pytorch():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(32, 4, batch_first=True, dtype=torch.float64)
    mod = fusedmha.MultiheadAttention(32, 4, batch_first=True, dtype=torch.float64)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(3, 11, 32, dtype=torch.float64)
    padding = torch.arange(11)[None, :] >= torch.tensor([11, 7, 2])[:, None]  # True = padded
    out, w = mod(x, x, x, key_padding_mask=padding)
    ref_out, ref_w = ref(x, x, x, key_padding_mask=padding)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(w, ref_w)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_an_empty_batch_with_a_padding_mask(dropout_p):
    """A key padding mask of an empty batch (0, 1, 1, S) is no key spans to read (it divided
    by the batch size: a crash), and the module's empty batch with its key_padding_mask gives
    empty outputs."""
    q = torch.randn(0, 2, 5, 4)
    mask = torch.zeros(0, 1, 1, 5, dtype=torch.bool)
    out = fusedmha.scaled_dot_product_attention(q, q, q, attn_mask=mask, dropout_p=dropout_p)
    assert out.shape == (0, 2, 5, 4)
    m = fusedmha.MultiheadAttention(8, 2, dropout=dropout_p)
    x = torch.randn(5, 0, 8)
    out, w = m(x, x, x, key_padding_mask=torch.zeros(0, 5, dtype=torch.bool))
    assert out.shape == (5, 0, 8) and w.shape == (0, 5, 5)
