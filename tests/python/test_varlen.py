"""fusedmha.flash_attn_varlen_func (and the op under it, varlen_attention_forward/backward): a
packed batch of sequences of their own lengths equals each sequence run alone, forward and
gradients, with flash_attn 2's signature; bad lengths get clear errors."""

import pytest
import torch

import fusedmha
from reference import reference_variants
from signatures import signature_text

H, H_KV, E = 4, 2, 16
# Empty sequences, one query row, more queries than keys, and the longest last-but-one.
LENS_Q = [5, 0, 17, 64, 1, 9]
LENS_K = [7, 3, 17, 80, 9, 4]


def cumulative(lengths, device):
    return torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)


def packed_batch(device, dtype, lens_q=LENS_Q, lens_k=LENS_K):
    q = torch.randn(sum(lens_q), H, E, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(sum(lens_k), H_KV, E, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(sum(lens_k), H_KV, E, dtype=dtype, device=device, requires_grad=True)
    return q, k, v, cumulative(lens_q, device), cumulative(lens_k, device)


def sequences(t, cu):
    """Sequence b's rows of a packed tensor, as (H, L, E) views."""
    cu = cu.tolist()
    return [t[cu[b]:cu[b + 1]].transpose(0, 1) for b in range(len(cu) - 1)]


VARIANTS = [
    dict(),
    dict(causal=True),
    dict(causal=True, window_size=(6, 0)),
    dict(window_size=(5, 3), softcap=2.5),
    dict(causal=True, alibi="heads", sinks=True, softmax_scale=0.3),
    dict(alibi="sequences"),
]


def variant_args(kw, device, dtype):
    kw = dict(kw)
    alibi = kw.pop("alibi", None)
    if alibi == "heads":
        kw["alibi_slopes"] = torch.rand(H, device=device) * 0.2
    elif alibi == "sequences":
        kw["alibi_slopes"] = torch.rand(len(LENS_Q), H, device=device) * 0.2
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H, dtype=dtype, device=device, requires_grad=True)
    return kw


def alone(q, k, v, b, kw):
    """Sequence b through fusedmha.scaled_dot_product_attention on its own: (L, H, E)."""
    window = kw.get("window_size", (-1, -1))
    slopes = kw.get("alibi_slopes")
    if slopes is not None and slopes.dim() == 2:
        slopes = slopes[b]
    out = fusedmha.scaled_dot_product_attention(
        q, k, v, is_causal=kw.get("causal", False), scale=kw.get("softmax_scale"),
        enable_gqa=True, window_left=window[0], window_right=window[1], bottom_right=True,
        softcap=kw.get("softcap", 0.0), alibi_slopes=slopes, sinks=kw.get("sinks"))
    return out.transpose(0, 1)


def test_signature_is_flash_attn_2s():
    assert signature_text(fusedmha.flash_attn_varlen_func) == (
        "(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, "
        "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
        "alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None, *, "
        "sinks=None, seqused_k=None)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kw", VARIANTS)
def test_equals_each_sequence_alone(device, dtype, kw):
    q, k, v, cu_q, cu_k = packed_batch(device, dtype)
    kw = variant_args(kw, device, dtype)
    out, lse, _ = fusedmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                                  return_attn_probs=True, **kw)
    assert out.shape == q.shape and lse.shape == (H, q.shape[0]) and lse.dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32)
    parts = [alone(qb, kb, vb, b, kw)
             for b, (qb, kb, vb) in enumerate(zip(sequences(q, cu_q), sequences(k, cu_k),
                                                  sequences(v, cu_k)))]
    ref = torch.cat(parts)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out, ref, **tol)

    # The log-sum-exp against the float64 truth, sequence by sequence.
    window = kw.get("window_size", (-1, -1))
    for b, (qb, kb, vb) in enumerate(zip(sequences(q, cu_q), sequences(k, cu_k),
                                         sequences(v, cu_k))):
        slopes = kw.get("alibi_slopes")
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        _, want_lse, _ = reference_variants(
            qb, kb, vb, is_causal=kw.get("causal", False), scale=kw.get("softmax_scale"),
            enable_gqa=True, window_left=window[0], window_right=window[1], bottom_right=True,
            softcap=kw.get("softcap", 0.0), alibi_slopes=slopes, sinks=kw.get("sinks"))
        got_lse = lse[:, cu_q[b]:cu_q[b + 1]].double()
        finite = want_lse.isfinite()
        assert torch.equal(finite, got_lse.isfinite())
        torch.testing.assert_close(got_lse[finite], want_lse[finite], atol=1e-4, rtol=1e-5)

    # Gradients of q, k, v (and the sinks) equal those of the sequences alone.
    inputs = (q, k, v) + ((kw["sinks"],) if "sinks" in kw else ())
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(ref, inputs, grad)
    gtol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-11, rtol=1e-11)
    for n, (a, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, w, **gtol, msg=lambda m: f"gradient {n}: {m}")


def test_gradcheck_float64(device):
    lens_q, lens_k = [3, 0, 5], [4, 2, 5]
    q, k, v, cu_q, cu_k = packed_batch(device, torch.float64, lens_q, lens_k)

    def f(q, k, v):
        return fusedmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True,
                                               softcap=3.0)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_seqused_k_bounds_each_sequences_keys(device):
    q, k, v, cu_q, cu_k = packed_batch(device, torch.float64)
    used = torch.tensor([3, 0, 17, 41, 9, 1], dtype=torch.int32, device=device)
    out = fusedmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                          causal=True, seqused_k=used)
    cu = cu_k.tolist()
    trimmed = [k[cu[b]:cu[b] + n] for b, n in enumerate(used.tolist())]
    k2 = torch.cat(trimmed)
    v2 = torch.cat([v[cu[b]:cu[b] + n] for b, n in enumerate(used.tolist())])
    ref = fusedmha.flash_attn_varlen_func(q, k2, v2, cu_q, cumulative(used.tolist(), device),
                                          max(LENS_Q), 41, causal=True)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


def test_dropout_draws_each_sequences_elements(device):
    q, k, v, cu_q, cu_k = packed_batch(device, torch.float64)
    p = 0.3
    out, lse, probs = fusedmha.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), dropout_p=p, causal=True,
        return_attn_probs=True)
    # probs is negative where dropped: the output is the kept probabilities times V / (1 - p).
    B = len(LENS_Q)
    kept = probs.clamp(min=0) / (1 - p)
    parts = []
    for b, vb in enumerate(sequences(v, cu_k)):
        Lq, Lk = LENS_Q[b], LENS_K[b]
        vb = vb.repeat_interleave(H // H_KV, dim=0)
        parts.append((kept[b, :, :Lq, :Lk] @ vb).transpose(0, 1))
    torch.testing.assert_close(out, torch.cat(parts), atol=1e-12, rtol=1e-12)
    dropped = (probs < 0).sum().item()
    visible = (probs != 0).sum().item()
    assert 0.2 < dropped / visible < 0.4
    # The backward replays the same elements: gradients against the reference built from probs.
    grad = torch.randn_like(out)
    gv = torch.autograd.grad(out, v, grad)[0]
    want = torch.zeros_like(v)
    cu = cu_k.tolist()
    for b in range(B):
        g = grad[cu_q[b]:cu_q[b + 1]].transpose(0, 1)  # (H, Lq, E)
        per_head = kept[b, :, :LENS_Q[b], :LENS_K[b]].transpose(-1, -2) @ g  # (H, Lk, E)
        want[cu[b]:cu[b + 1]] = per_head.unflatten(0, (H_KV, H // H_KV)).sum(1).transpose(0, 1)
    torch.testing.assert_close(gv, want, atol=1e-12, rtol=1e-12)


def test_varlen_ops_contract():
    q, k, v, cu_q, cu_k = packed_batch("cpu", torch.float32, [3, 0, 5], [4, 2, 5])
    torch.library.opcheck(torch.ops.fusedmha.varlen_attention_forward,
                          (q, k, v, cu_q, cu_k, 5, 5, 0.0, True, None),
                          dict(bottom_right=True, softcap=2.0))


def test_compiles_with_fullgraph():
    q, k, v, cu_q, cu_k = packed_batch("cpu", torch.float32, [3, 0, 5], [4, 2, 5])

    @torch.compile(fullgraph=True, backend="eager")
    def f(q, k, v):
        return fusedmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)

    torch.testing.assert_close(f(q, k, v), fusedmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k,
                                                                            5, 5, causal=True))


@pytest.mark.parametrize("cu_q, uncovered", [([0, 3, 5], [5, 6, 7]), ([2, 3, 5], [0, 1, 5, 6, 7])])
def test_rows_no_sequence_covers_are_zero(cu_q, uncovered):
    # (rows before cu_seqlens_q[0] too: the allocator's old bytes must not show there)
    torch.full((4096,), float("nan"))  # (leaves NaNs in the allocator's free memory)
    q, k, v, _, cu_k = packed_batch("cpu", torch.float32, [4, 4], [4, 4])
    cu_q = torch.tensor(cu_q, dtype=torch.int32)
    out, lse, _ = torch.ops.fusedmha.varlen_attention_forward(q, k, v, cu_q, cu_k, 3, 4)
    assert out[uncovered].eq(0).all() and lse[:, uncovered].eq(float("inf")).all()
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    assert gq[uncovered].eq(0).all()


@pytest.mark.parametrize("change, message", [
    (dict(cu_seqlens_q=torch.tensor([0, 5, 3, 7], dtype=torch.int32)), "non-decreasing"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 5, 99], dtype=torch.int32)), "within the"),
    (dict(cu_seqlens_k=torch.tensor([0, 4, 6], dtype=torch.int32)), r"cu_seqlens_k of dtype int32 and shape \(B \+ 1\)"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 5, 7])), "int32"),
    (dict(max_seqlen_q=2), "max_seqlen_q = 2 is smaller"),
    (dict(max_seqlen_k=3), "max_seqlen_k = 3 is smaller"),
    (dict(seqused_k=torch.tensor([1, 9, 1], dtype=torch.int32)), "seqused_k"),
    (dict(seqused_k=torch.tensor([1, -1, 1], dtype=torch.int32)), "seqused_k must be >= 0"),
    (dict(cu_seqlens_q=torch.tensor([-1, 3, 5, 7], dtype=torch.int32)), "within the"),
    (dict(k=torch.randn(11, 3, 16), v=torch.randn(11, 3, 16)), "multiple"),
    (dict(q=torch.randn(7, 4, 8)), "last dim"),
    (dict(alibi_slopes=torch.rand(2, 4)), "alibi_slopes"),
])
def test_bad_inputs_get_clear_errors(change, message):
    args = dict(q=torch.randn(7, 4, 16), k=torch.randn(11, 2, 16), v=torch.randn(11, 2, 16),
                cu_seqlens_q=torch.tensor([0, 3, 5, 7], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 4, 6, 11], dtype=torch.int32),
                max_seqlen_q=3, max_seqlen_k=5)
    args.update(change)
    with pytest.raises(RuntimeError, match=message) as info:
        fusedmha.flash_attn_varlen_func(**args)
    assert "fusedmha.varlen_attention_forward" in str(info.value)


@pytest.mark.parametrize("lens_k", [[7, 0, 40, 1, 25], [700, 0, 300, 1, 1200], [2100, 0]])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(window_size=(-1, 0), softcap=2.0),
                                dict(sinks=True, alibi="heads")])
def test_one_query_per_sequence_equals_each_alone(device, kw, lens_k):
    """Decoding a batch: one query row per sequence (the grouped query heads of a K/V head are
    then read as rows of one item; long caches split their keys across threads), forward and
    gradients."""
    kw = variant_args(kw, device, torch.float64)
    q, k, v, cu_q, cu_k = packed_batch(device, torch.float64, [1] * len(lens_k), lens_k)
    out = fusedmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, max(lens_k), **kw)
    ref = torch.cat([alone(qb, kb, vb, b, kw) for b, (qb, kb, vb) in enumerate(
        zip(sequences(q, cu_q), sequences(k, cu_k), sequences(v, cu_k)))])
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    grad = torch.randn_like(out)
    inputs = (q, k, v) + ((kw["sinks"],) if "sinks" in kw else ())
    for n, (a, w) in enumerate(zip(torch.autograd.grad(out, inputs, grad),
                                   torch.autograd.grad(ref, inputs, grad))):
        torch.testing.assert_close(a, w, atol=1e-11, rtol=1e-11, msg=lambda m: f"gradient {n}: {m}")


def test_a_paged_batch_equals_the_packed_one(device):
    """K/V in pages through block_table: the same results as the packed rows, forward only."""
    page, per_sequence = 16, 6
    q, k, v, cu_q, cu_k = packed_batch(device, torch.float64)
    B = len(LENS_Q)
    num_pages = B * per_sequence + 2
    table = torch.randperm(num_pages, device=device)[:B * per_sequence].view(B, per_sequence)
    paged_k = torch.zeros(num_pages, page, H_KV, E, dtype=torch.float64, device=device)
    paged_v = torch.zeros_like(paged_k)
    for b, (kb, vb) in enumerate(zip(sequences(k, cu_k), sequences(v, cu_k))):
        n = kb.shape[1]
        rows_k = torch.zeros(per_sequence * page, H_KV, E, dtype=torch.float64, device=device)
        rows_v = torch.zeros_like(rows_k)
        rows_k[:n], rows_v[:n] = kb.transpose(0, 1).detach(), vb.transpose(0, 1).detach()
        paged_k[table[b]] = rows_k.view(per_sequence, page, H_KV, E)
        paged_v[table[b]] = rows_v.view(per_sequence, page, H_KV, E)
    for kw in (dict(causal=True), dict(window_size=(7, 2), softcap=2.0)):
        got = fusedmha.flash_attn_varlen_func(q.detach(), paged_k, paged_v, cu_q, cu_k,
                                              max(LENS_Q), max(LENS_K),
                                              block_table=table.to(torch.int32), **kw)
        want = fusedmha.flash_attn_varlen_func(q.detach(), k.detach(), v.detach(), cu_q, cu_k,
                                               max(LENS_Q), max(LENS_K), **kw)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
        # max_seqlen_q/k only bound the lengths: the table's capacity as the bound gives the
        # same bits (the kernels are sized by the longest sequences, read on the CPU)
        loose = fusedmha.flash_attn_varlen_func(q.detach(), paged_k, paged_v, cu_q, cu_k,
                                                4 * max(LENS_Q), per_sequence * page,
                                                block_table=table.to(torch.int32), **kw)
        assert torch.equal(loose, got) or device != "cpu"
        torch.testing.assert_close(loose, want, atol=1e-12, rtol=1e-12)
    # Forward only: the backward says so.
    qg = q.detach().requires_grad_()
    out = fusedmha.flash_attn_varlen_func(qg, paged_k, paged_v, cu_q, cu_k, max(LENS_Q),
                                          max(LENS_K), block_table=table.to(torch.int32))
    with pytest.raises(RuntimeError, match="forward only"):
        out.sum().backward()


def test_a_block_table_out_of_range_is_refused():
    q, k, v, cu_q, cu_k = packed_batch("cpu", torch.float32, [3], [4])
    pages = torch.zeros(2, 16, H_KV, E)
    with pytest.raises(RuntimeError, match=r"page indices in \[0, 2\)"):
        fusedmha.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, 3, 4,
                                        block_table=torch.tensor([[2]], dtype=torch.int32))
    long_k = torch.tensor([0, 40], dtype=torch.int32)  # more keys than one page of 16 holds
    with pytest.raises(RuntimeError, match="a sequence of 40 keys does not fit the 16 rows"):
        fusedmha.flash_attn_varlen_func(q, pages, pages, cu_q, long_k, 3, 40,
                                        block_table=torch.tensor([[1]], dtype=torch.int32))


@pytest.mark.parametrize("causal", [False, True])
def test_nested_tensors_run_the_varlen_kernels(causal):
    """A jagged NestedTensor (B, j, H, E), transposed as PyTorch's SDPA takes it, through
    fusedmha.scaled_dot_product_attention: each sequence as PyTorch attends to it alone,
    forward and gradients."""
    F = torch.nn.functional
    lens_q, lens_k = [3, 9, 5], [3, 9, 5] if causal else [4, 2, 8]
    parts = [[torch.randn(n, H, E, dtype=torch.float64) for n in lens] for lens in
             (lens_q, lens_k, lens_k)]
    nested = [torch.nested.nested_tensor(p, layout=torch.jagged, requires_grad=True)
              for p in parts]
    out = fusedmha.scaled_dot_product_attention(*(t.transpose(1, 2) for t in nested),
                                                is_causal=causal)
    assert out.is_nested and out.shape[:2] == (3, H)
    leaves = [[t.detach().requires_grad_() for t in p] for p in parts]
    refs = [F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), is_causal=causal).transpose(0, 1)
            for q, k, v in zip(*leaves)]
    for got, want in zip(out.transpose(1, 2).unbind(), refs):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    grads = [torch.randn_like(r) for r in refs]
    torch.autograd.backward(refs, grads)
    out.transpose(1, 2).values().backward(torch.cat(grads))
    for t, parts_of in zip(nested, leaves):
        for got, leaf in zip(t.grad.unbind(), parts_of):
            torch.testing.assert_close(got, leaf.grad, atol=1e-11, rtol=1e-11)


def test_nested_tensors_refuse_a_mask():
    q = torch.nested.nested_tensor([torch.randn(3, H, E)], layout=torch.jagged).transpose(1, 2)
    with pytest.raises(ValueError, match="attn_mask is not supported with nested tensors"):
        fusedmha.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool))
