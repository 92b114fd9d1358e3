"""fusedmha.flash_attn_with_kvcache keeps flash_attn 2's signature; appending to the cache in
place then attending equals a full recompute over the sequences, with rotary embedding,
cache_batch_idx, cache_leftpad and the variants."""

import pytest
import torch

import fusedmha
from reference import reference_variants
from signatures import signature_text

H, H_KV, E = 8, 2, 16


def test_signature_is_flash_attn_2s():
    assert signature_text(fusedmha.flash_attn_with_kvcache) == (
        "(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, "
        "cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, "
        "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
        "rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, "
        "sinks=None, k_scale=None, v_scale=None)")


def rotate(x, cos, sin, positions, interleaved):
    """Rotary embedding written as complex multiplication (an independent formulation)."""
    half = cos.shape[1]
    head, rest = x[..., : 2 * half].double(), x[..., 2 * half:]
    if interleaved:
        pairs = head.unflatten(-1, (half, 2))
    else:
        pairs = torch.stack((head[..., :half], head[..., half:]), dim=-1)
    z = torch.view_as_complex(pairs.clone(memory_format=torch.contiguous_format))  # (offset 0)
    # cos + i·sin as the tables give them (rounded tables of a half dtype are not quite on
    # the unit circle; flash_attn multiplies by them as they are)
    turn = torch.complex(cos.double(), sin.double())
    z = z * turn[positions].unsqueeze(2)
    out = torch.view_as_real(z)
    out = out.flatten(-2) if interleaved else torch.cat((out[..., 0], out[..., 1]), dim=-1)
    return torch.cat((out.to(x.dtype), rest), dim=-1)


def full_recompute(q, keys, values, kw):
    """Sequence by sequence in float64: q (L, H, E) against keys/values (S, H_kv, E)."""
    window = kw.get("window_size", (-1, -1))
    out, lse, _ = reference_variants(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        is_causal=kw.get("causal", False), scale=kw.get("softmax_scale"), enable_gqa=True,
        window_left=window[0], window_right=window[1], bottom_right=True,
        softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi_slopes"),
        sinks=kw.get("sinks"))
    return out.transpose(0, 1), lse


@pytest.mark.parametrize("kw", [
    dict(causal=True),
    dict(),
    dict(causal=True, window_size=(5, 0), softcap=3.0),
    dict(causal=True, rotary=True, rotary_interleaved=True),
    dict(causal=True, rotary=True, rotary_interleaved=False, sinks=True),
    dict(rotary=True, rotary_interleaved=False),
    dict(causal=True, batch_idx=True, leftpad=True),
    dict(causal=True, batch_idx=True, rotary=True),
    dict(causal=True, equal_lengths=True),
])
@pytest.mark.parametrize("new", [1, 3])
def test_append_then_attend_equals_a_full_recompute(device, kw, new):
    B, B_cache, S_cache, L = 3, 4, 40, new
    dtype = torch.float64
    kw = dict(kw)
    cache_k = torch.randn(B_cache, S_cache, H_KV, E, dtype=dtype, device=device)
    cache_v = torch.randn(B_cache, S_cache, H_KV, E, dtype=dtype, device=device)
    before_k, before_v = cache_k.clone(), cache_v.clone()
    lengths = [20] * B if kw.pop("equal_lengths", False) else [11, 0, 30]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    leftpad = (torch.tensor([2, 0, 5], dtype=torch.int32, device=device)
               if kw.pop("leftpad", False) else None)
    batch_idx = (torch.tensor([3, 0, 2], dtype=torch.int32, device=device)
                 if kw.pop("batch_idx", False) else None)
    q = torch.randn(B, L, H, E, dtype=dtype, device=device)
    k = torch.randn(B, new, H_KV, E, dtype=dtype, device=device)
    v = torch.randn(B, new, H_KV, E, dtype=dtype, device=device)
    call = dict(cache_seqlens=seqlens, cache_batch_idx=batch_idx, cache_leftpad=leftpad,
                return_softmax_lse=True)
    rotary = kw.pop("rotary", False)
    if rotary:
        R = 12
        angles = torch.arange(64, dtype=dtype, device=device)[:, None] * torch.rand(
            R // 2, dtype=dtype, device=device)
        call.update(rotary_cos=angles.cos(), rotary_sin=angles.sin())
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H, dtype=dtype, device=device)
    call.update(kw)
    out, lse = fusedmha.flash_attn_with_kvcache(q, cache_k, cache_v, k, v, **call)
    assert out.shape == q.shape and lse.shape == (B, H, L)

    idx = batch_idx.tolist() if batch_idx is not None else list(range(B))
    pads = leftpad.tolist() if leftpad is not None else [0] * B
    for b in range(B):
        n, pad, c = lengths[b], pads[b], idx[b]
        qb, kb = q[b], k[b]
        if rotary:
            start = n - pad
            moving = kw.get("causal", False) or kw.get("window_size", (-1, -1)) != (-1, -1)
            q_pos = torch.arange(L, device=device) * int(moving) + start
            qb = rotate(qb[None], call["rotary_cos"], call["rotary_sin"], q_pos[None],
                        kw.get("rotary_interleaved", True))[0]
            kb = rotate(kb[None], call["rotary_cos"], call["rotary_sin"],
                        (torch.arange(new, device=device) + start)[None],
                        kw.get("rotary_interleaved", True))[0]
        # The cache now holds the new rows after the old ones, in place.
        torch.testing.assert_close(cache_k[c, n:n + new], kb)
        torch.testing.assert_close(cache_v[c, n:n + new], v[b])
        torch.testing.assert_close(cache_k[c, :n], before_k[c, :n])
        keys = torch.cat((before_k[c, pad:n], kb))
        values = torch.cat((before_v[c, pad:n], v[b]))
        want, want_lse = full_recompute(qb, keys, values, kw)
        torch.testing.assert_close(out[b], want, atol=1e-10, rtol=1e-10)
        finite = want_lse.isfinite()
        torch.testing.assert_close(lse[b][finite], want_lse[finite], atol=1e-10, rtol=1e-10)
    # Cache batches no sequence points to are untouched.
    for c in set(range(B_cache)) - set(idx):
        assert torch.equal(cache_k[c], before_k[c])


def test_decode_steps_equal_attention_over_the_whole_sequence():
    """Greedy-decoding shape: one query per step against a growing cache, float32."""
    B, S_cache, steps = 1, 64, 6
    q_all = torch.randn(B, steps, H, E)
    k_all, v_all = torch.randn(B, steps, H_KV, E), torch.randn(B, steps, H_KV, E)
    cache_k, cache_v = torch.zeros(B, S_cache, H_KV, E), torch.zeros(B, S_cache, H_KV, E)
    outs = []
    for t in range(steps):
        outs.append(fusedmha.flash_attn_with_kvcache(
            q_all[:, t:t + 1], cache_k, cache_v, k_all[:, t:t + 1], v_all[:, t:t + 1],
            cache_seqlens=t, causal=True))
    want = fusedmha.flash_attn_func(q_all, k_all, v_all, causal=True)
    torch.testing.assert_close(torch.cat(outs, dim=1), want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("call, message", [
    (dict(block_table=torch.zeros(1, 1, dtype=torch.int32), cache_leftpad=torch.zeros(
        1, dtype=torch.int32)), "not supported with block_table"),
    (dict(cache_seqlens=39), "must fit"),
    (dict(cache_seqlens=-1), "must fit"),
    (dict(cache_seqlens=2**32 + 3), "must fit"),  # (not wrapped to 3 in int32)
    (dict(cache_seqlens=torch.tensor([2**32 + 3])), "must fit"),  # (an int64 tensor: the same)
    (dict(cache_seqlens=torch.tensor([2**63 - 1])), "must fit"),  # (no overflow in the check)
    (dict(cache_seqlens=torch.tensor([5]), cache_leftpad=torch.tensor([2**32 + 3])), "must fit"),
    (dict(k=None), "k and v together"),
    (dict(cache_seqlens=None), "cache_seqlens is needed"),
    (dict(cache_seqlens=torch.tensor([1, 2], dtype=torch.int32)), r"shape \(B\) = \(1\)"),
    (dict(rotary_cos=torch.ones(8, 4)), "rotary_cos and rotary_sin together"),
    (dict(k_cache=torch.zeros(1, 40, H_KV, E).half()), "k_cache and v_cache of q's dtype"),
    (dict(v_cache=torch.zeros(1, 40, H_KV, E, device="meta")), "on q's device"),
    (dict(k=torch.randn(1, 2, H_KV, E, device="meta")), "k and v on q's device"),
    # (one meta tensor among CPU ones sends the call to the shape kernel, which refuses it too)
    (dict(sinks=torch.zeros(H, device="meta")), "sinks on q's device"),
    (dict(alibi_slopes=torch.ones(H, device="meta")), "alibi_slopes on q's device"),
    (dict(block_table=torch.zeros(1, 1, dtype=torch.int32, device="meta"), k_cache=torch.zeros(
        1, 40, H_KV, E)), "block_table on q's device"),
    (dict(cache_seqlens=torch.tensor([3], dtype=torch.int32, device="meta")), "cache_seqlens on"),
    (dict(k_cache=torch.zeros(1, 1, H_KV, E).expand(1, 40, H_KV, E)), "elements that share memory"),
])
def test_bad_inputs_get_clear_errors(call, message):
    args = dict(q=torch.randn(1, 1, H, E), k_cache=torch.zeros(1, 40, H_KV, E),
                v_cache=torch.zeros(1, 40, H_KV, E), k=torch.randn(1, 2, H_KV, E),
                v=torch.randn(1, 2, H_KV, E), cache_seqlens=3)
    args.update(call)
    with pytest.raises(RuntimeError, match=message) as info:
        fusedmha.flash_attn_with_kvcache(**args)
    assert "fusedmha.attention_with_kvcache" in str(info.value)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(5, 0), softcap=3.0)])
def test_an_int_cache_seqlens_equals_the_tensor(paged, kw):
    """flash_attn's int form goes to the op as cache_seqlens_value, with no tensor made for it:
    the same output, log-sum-exp and caches as the int32 tensor, bit for bit."""
    B, S_cache, new, page = 2, 64, 2, 16
    q = torch.randn(B, new, H, E)
    k, v = torch.randn(B, new, H_KV, E), torch.randn(B, new, H_KV, E)
    shape = (B * S_cache // page, page, H_KV, E) if paged else (B, S_cache, H_KV, E)
    caches = torch.randn(2, *shape)
    table = (torch.randperm(B * S_cache // page).view(B, -1).to(torch.int32) if paged else None)
    results = []
    for seqlens in (37, torch.full((B,), 37, dtype=torch.int32)):
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        out, lse = fusedmha.flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                                    cache_seqlens=seqlens, block_table=table,
                                                    return_softmax_lse=True, **kw)
        results.append((out, lse, k_cache, v_cache))
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_the_op_takes_cache_seqlens_one_way():
    q = torch.randn(1, 1, H, E)
    k_cache, v_cache = torch.zeros(1, 40, H_KV, E), torch.zeros(1, 40, H_KV, E)
    with pytest.raises(RuntimeError, match="not both"):
        torch.ops.fusedmha.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=torch.tensor([3], dtype=torch.int32),
            cache_seqlens_value=3)


@pytest.mark.parametrize("new", [1, 2])
@pytest.mark.parametrize("page", [16, 48, 256])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window_size=(21, 0)),
                                dict(rotary=True, causal=True)])
def test_a_paged_cache_equals_a_contiguous_one(device, page, kw, new):
    B = 3
    pages_per_sequence = 512 // page
    S_cache = page * pages_per_sequence  # (page 48: 480 rows, not a power of two)
    dtype = torch.float64
    kw = dict(kw)
    cache_k = torch.randn(B, S_cache, H_KV, E, dtype=dtype, device=device)
    cache_v = torch.randn(B, S_cache, H_KV, E, dtype=dtype, device=device)
    # The same rows scattered over shuffled pages (and a few pages no one uses).
    num_pages = B * pages_per_sequence + 3
    table = torch.randperm(num_pages, device=device)[:B * pages_per_sequence].view(
        B, pages_per_sequence).to(torch.int32)
    paged_k = torch.randn(num_pages, page, H_KV, E, dtype=dtype, device=device)
    paged_v = torch.randn(num_pages, page, H_KV, E, dtype=dtype, device=device)
    paged_k[table.long()] = cache_k.view(B, pages_per_sequence, page, H_KV, E)
    paged_v[table.long()] = cache_v.view(B, pages_per_sequence, page, H_KV, E)
    seqlens = torch.tensor([0, 300, S_cache - new - 1], dtype=torch.int32, device=device)
    q = torch.randn(B, new, H, E, dtype=dtype, device=device)
    k = torch.randn(B, new, H_KV, E, dtype=dtype, device=device)
    v = torch.randn(B, new, H_KV, E, dtype=dtype, device=device)
    if kw.pop("rotary", False):
        angles = torch.arange(S_cache, dtype=dtype, device=device)[:, None] * torch.rand(
            4, dtype=dtype, device=device)
        kw.update(rotary_cos=angles.cos(), rotary_sin=angles.sin())
    want, want_lse = fusedmha.flash_attn_with_kvcache(q, cache_k, cache_v, k, v,
                                                      cache_seqlens=seqlens,
                                                      return_softmax_lse=True, **kw)
    got, lse = fusedmha.flash_attn_with_kvcache(q, paged_k, paged_v, k, v, cache_seqlens=seqlens,
                                                block_table=table, return_softmax_lse=True, **kw)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)
    # The append went to the right rows of the right pages.
    torch.testing.assert_close(paged_k[table.long()].view(B, S_cache, H_KV, E), cache_k)
    torch.testing.assert_close(paged_v[table.long()].view(B, S_cache, H_KV, E), cache_v)


@pytest.mark.parametrize("page", [1, 2])
@pytest.mark.parametrize("dim", [31, 33])
def test_pages_of_rows_that_straddle_cache_lines(page, dim):
    """Decoding (3 query rows per K/V head) over pages of 1-2 rows whose rows of 31 or 33
    floats start anywhere in a cache line: the kernel's prefetch queue then fills with many
    small regions, and once overran itself (a crash within a few calls)."""
    torch.manual_seed(0)
    S_cache, new = 40, 2
    pages = S_cache // page
    for _ in range(20):
        cache_k = torch.randn(1, S_cache, H_KV, dim)
        cache_v = torch.randn(1, S_cache, H_KV, dim)
        table = torch.randperm(pages + 5)[:pages].view(1, pages).to(torch.int32)
        paged_k = torch.randn(pages + 5, page, H_KV, dim)
        paged_v = torch.randn(pages + 5, page, H_KV, dim)
        paged_k[table.long()] = cache_k.view(1, pages, page, H_KV, dim)
        paged_v[table.long()] = cache_v.view(1, pages, page, H_KV, dim)
        q = torch.randn(1, 3, H, dim)
        k, v = torch.randn(1, new, H_KV, dim), torch.randn(1, new, H_KV, dim)
        got = fusedmha.flash_attn_with_kvcache(q, paged_k, paged_v, k, v, cache_seqlens=18,
                                               block_table=table, causal=True)
        want = fusedmha.flash_attn_with_kvcache(q, cache_k, cache_v, k, v, cache_seqlens=18,
                                                causal=True)
        torch.testing.assert_close(got, want)


def test_caches_that_share_memory_are_refused_and_left_untouched():
    """The caches are written in place: one tensor as both, or new rows that are cache rows,
    would overwrite what is read; halves of one buffer are distinct and fine."""
    q, k, v = torch.randn(1, 1, H, E), torch.randn(1, 2, H_KV, E), torch.randn(1, 2, H_KV, E)
    cache = torch.randn(1, 40, H_KV, E)
    before = cache.clone()
    with pytest.raises(RuntimeError, match="fusedmha.attention_with_kvcache: .*must not share"):
        fusedmha.flash_attn_with_kvcache(q, cache, cache, k, v, cache_seqlens=3)
    with pytest.raises(RuntimeError, match="fusedmha.attention_with_kvcache: .*must not share"):
        fusedmha.flash_attn_with_kvcache(q, cache, torch.zeros_like(cache), cache[:, 5:7], v,
                                         cache_seqlens=3)
    assert torch.equal(cache, before)
    kv = torch.zeros(2, 1, 40, H_KV, E)
    out = fusedmha.flash_attn_with_kvcache(q, kv[0], kv[1], k, v, cache_seqlens=3)
    assert torch.equal(kv[0, :, 3:5], k) and torch.equal(kv[1, :, 3:5], v)
    assert out.isfinite().all()


def test_views_of_one_buffer_share_memory_only_where_they_meet():
    """Non-contiguous views (get_overlap_status cannot decide them): caches that are one buffer
    shifted by a row, or one cache whose rows overlap, are refused; K and V interleaved in one
    (B, S, 2, H_kv, E) buffer are distinct and taken."""
    q, k, v = torch.randn(2, 1, H, E), torch.randn(2, 1, H_KV, E), torch.randn(2, 1, H_KV, E)
    buf = torch.randn(2, 41, H_KV, E)
    before = buf.clone()
    with pytest.raises(RuntimeError, match="fusedmha.attention_with_kvcache: .*must not share"):
        fusedmha.flash_attn_with_kvcache(q, buf[:, :-1], buf[:, 1:], k, v, cache_seqlens=3)
    rows = torch.randn(2 * 20 * H_KV * E + 40 * H_KV * E)
    overlapping = rows.as_strided((2, 40, H_KV, E), (20 * H_KV * E, H_KV * E // 2, E, 1))
    with pytest.raises(RuntimeError, match="fusedmha.attention_with_kvcache: .*elements that share"):
        fusedmha.flash_attn_with_kvcache(q, overlapping, torch.zeros(2, 40, H_KV, E), k, v,
                                         cache_seqlens=3)
    assert torch.equal(buf, before)
    kv = torch.zeros(2, 40, 2, H_KV, E)
    out = fusedmha.flash_attn_with_kvcache(q, kv[:, :, 0], kv[:, :, 1], k, v, cache_seqlens=3)
    assert torch.equal(kv[:, 3:4, 0], k) and torch.equal(kv[:, 3:4, 1], v)
    assert out.isfinite().all()


@pytest.mark.parametrize("bad, message", [
    (dict(alibi_slopes=torch.rand(3)), "alibi_slopes"),
    (dict(window_size=(-2, 0)), "window sizes"),
    (dict(softmax_scale=float("inf")), "scale"),
    (dict(k=torch.randn(2, 1, H_KV + 1, E)), "H_kv, E, Ev of the caches"),
    (dict(cache_batch_idx=torch.tensor([0, 5], dtype=torch.int32)), r"cache_batch_idx in \[0, 3\)"),
    (dict(rotary_cos=torch.ones(4, 4), rotary_sin=torch.zeros(4, 4)), "rotary_cos and rotary_sin have 4 positions"),
    (dict(cache_seqlens=torch.tensor([3, 40], dtype=torch.int32)), "must fit the cache's 40 rows"),
    (dict(cache_leftpad=torch.tensor([0, 10], dtype=torch.int32)), "cache_leftpad <= cache_seqlens"),
    (dict(cache_leftpad=torch.tensor([-1, 0], dtype=torch.int32)), "0 <= cache_leftpad"),
    (dict(block_table=torch.tensor([[0], [7]], dtype=torch.int32)), r"block_table's pages in \[0, 3\)"),
])
def test_a_refused_call_leaves_the_caches_as_they_were(bad, message):
    """Every check, the attention kernels' too, comes before the caches are written, or the
    append is undone: a refused call changes nothing, and its error names the entry point
    called."""
    q = torch.randn(2, 1, H, E)
    k_cache, v_cache = torch.randn(3, 40, H_KV, E), torch.randn(3, 40, H_KV, E)
    before = k_cache.clone(), v_cache.clone()
    kw = dict(k=torch.randn(2, 1, H_KV, E), v=torch.randn(2, 1, H_KV, E),
              cache_seqlens=torch.tensor([3, 9], dtype=torch.int32))
    kw.update(bad)
    with pytest.raises(RuntimeError, match="fusedmha.attention_with_kvcache: .*" + message):
        fusedmha.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize("paged", [False, True])
def test_the_append_is_the_same_whatever_the_cache_strides(paged):
    """Caches whose rows (H_kv, E) are contiguous take row copies, others index_put_: the
    same rows land in the same places, in the cache's dtype, and a refused call undoes
    either (rows written twice, by two sequences sharing a cache, included)."""
    q = torch.randn(2, 1, H, E, dtype=torch.float64)
    k, v = torch.randn(2, 2, H_KV, E), torch.randn(2, 2, H_KV, E)  # float32 into float64
    caches = {}
    for layout in ("rows", "strided"):
        k_cache, v_cache = (torch.randn(3, 16, H_KV, E, dtype=torch.float64,
                                        generator=torch.Generator().manual_seed(seed))
                            for seed in (1, 2))
        if layout == "strided":  # (each row's E elements H_kv apart)
            k_cache, v_cache = (t.transpose(2, 3).contiguous().transpose(2, 3) for t in (k_cache, v_cache))
        kw = dict(cache_seqlens=torch.tensor([3, 15 if paged else 9], dtype=torch.int32))
        if paged:
            kw["block_table"] = torch.tensor([[2, 0], [1, 0]], dtype=torch.int32)
        else:
            kw["cache_batch_idx"] = torch.tensor([2, 0], dtype=torch.int32)
        out = fusedmha.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
        caches[layout] = (k_cache, v_cache, out)
        # Refused by the attention, after the append (queries of another head dim), with
        # both sequences on cache 0's rows 3-4:
        before = k_cache.clone(), v_cache.clone()
        kw.pop("block_table", None)
        kw.update(cache_batch_idx=torch.tensor([0, 0], dtype=torch.int32),
                  cache_seqlens=torch.tensor([3, 3], dtype=torch.int32))
        with pytest.raises(RuntimeError, match="last dim"):
            fusedmha.flash_attn_with_kvcache(torch.randn(2, 1, H, E + 1, dtype=torch.float64),
                                             k_cache, v_cache, k, v, **kw)
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    for a, b in zip(caches["rows"], caches["strided"]):
        assert torch.equal(a, b)
    k_cache = caches["rows"][0]
    if not paged:
        assert torch.equal(k_cache[2, 3:5], k[0].double()) and torch.equal(k_cache[0, 9:11], k[1].double())


@pytest.mark.parametrize("h_kv, e", [(2, 0), (0, 16)])
def test_an_append_of_empty_rows(h_kv, e):
    """Rows of no elements (a head dim or K/V head count of 0): nothing to copy, no error."""
    q = torch.randn(1, 1, 2 * h_kv, e)
    k_cache, v_cache = torch.zeros(1, 8, h_kv, e), torch.zeros(1, 8, h_kv, e)
    k, v = torch.randn(1, 1, h_kv, e), torch.randn(1, 1, h_kv, e)
    out = fusedmha.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3)
    assert out.shape == (1, 1, 2 * h_kv, e)


def test_meta_outputs_are_laid_out_as_on_the_cpu():
    """The output (B, L, H, E) and the lse (B, H, L) are contiguous whichever kernel path runs,
    so the meta device (torch.compile's fake tensors) can give the CPU's strides."""
    for lens in ([5, 5], [5, 9]):
        args = (torch.randn(2, 3, H, E), torch.randn(2, 40, H_KV, E), torch.randn(2, 40, H_KV, E))
        seqlens = torch.tensor(lens, dtype=torch.int32)
        out, lse = fusedmha.flash_attn_with_kvcache(*args, cache_seqlens=seqlens, causal=True,
                                                    return_softmax_lse=True)
        meta = [torch.empty_like(t, device="meta") for t in args]
        m_out, m_lse = fusedmha.flash_attn_with_kvcache(*meta, cache_seqlens=seqlens.to("meta"),
                                                        causal=True, return_softmax_lse=True)
        assert out.is_contiguous() and lse.is_contiguous(), lens
        assert (m_out.shape, m_lse.shape) == (out.shape, lse.shape)
        assert m_out.is_contiguous() and m_lse.is_contiguous()


def decoding_step(q, k_cache, v_cache, k, v, seqlens, table):
    """A serving loop's step, as users compile it: the new token's q, k, v, then attention."""
    return fusedmha.flash_attn_with_kvcache(q * 0.5, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                            block_table=table, causal=True,
                                            return_softmax_lse=True)


@pytest.mark.parametrize("paged, as_tensor", [(False, False), (True, False), (False, True)])
def test_decoding_steps_compile_into_one_graph(paged, as_tensor):
    """torch.compile(fullgraph=True) traces the op whole (its shape kernel gives the outputs;
    the lengths are read on the host only in the real call), appends in place, and gives the
    eager steps' outputs and caches bit for bit: an int cache_seqlens that turns dynamic after
    the first steps (a SymInt in the op's schema), or a tensor."""
    torch._dynamo.reset()
    B, S_cache, page = 2, 48, 16
    shape = (B * S_cache // page, page, H_KV, E) if paged else (B, S_cache, H_KV, E)
    table = torch.randperm(B * S_cache // page).view(B, -1).to(torch.int32) if paged else None
    eager_caches = [torch.zeros(shape), torch.zeros(shape)]
    compiled_caches = [c.clone() for c in eager_caches]
    compiled = torch.compile(decoding_step, fullgraph=True)
    for t in range(5):
        q, k, v = torch.randn(B, 1, H, E), torch.randn(B, 1, H_KV, E), torch.randn(B, 1, H_KV, E)
        seqlens = torch.full((B,), t, dtype=torch.int32) if as_tensor else t
        want = decoding_step(q, *eager_caches, k, v, seqlens, table)
        got = compiled(q, *compiled_caches, k, v, seqlens, table)
        for a, b in zip(got + tuple(compiled_caches), want + tuple(eager_caches)):
            assert torch.equal(a, b), t


def test_the_outputs_record_no_graph_and_the_caches_count_a_write():
    """Inference only: q that requires grad gives outputs that do not (as under no_grad), and
    the caches' version counters move, as an in-place op's do."""
    q = torch.randn(1, 1, H, E, requires_grad=True)
    k_cache, v_cache = torch.zeros(1, 8, H_KV, E), torch.zeros(1, 8, H_KV, E)
    versions = (k_cache._version, v_cache._version)
    out = fusedmha.flash_attn_with_kvcache(q, k_cache, v_cache, torch.randn(1, 1, H_KV, E),
                                           torch.randn(1, 1, H_KV, E), cache_seqlens=2)
    assert not out.requires_grad and out.grad_fn is None
    assert k_cache._version > versions[0] and v_cache._version > versions[1]


@pytest.mark.parametrize("kw", [dict(cache_seqlens=5), dict(cache_seqlens=torch.tensor(
    [5, 9], dtype=torch.int32)), dict(cache_seqlens=5, block_table=torch.tensor(
        [[1, 0], [3, 2]], dtype=torch.int32))])
def test_autocast_leaves_the_call_in_the_caches_dtype(kw):
    """The call computes in the caches' dtype whichever path runs (autocast used to reach one
    of them, the one for equal lengths): the same output as without autocast."""
    shape = (4, 8, H_KV, E) if "block_table" in kw else (2, 16, H_KV, E)
    q, k_cache, v_cache = torch.randn(2, 1, H, E), torch.randn(shape), torch.randn(shape)
    want = fusedmha.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True, **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fusedmha.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True, **kw)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("kw", [dict(cache_seqlens_value=3), dict(
    cache_seqlens=torch.tensor([3, 7], dtype=torch.int32), is_causal=True), dict(
        cache_seqlens_value=5, block_table=torch.tensor([[1, 0], [3, 2]], dtype=torch.int32),
        window_left=4)])
def test_opcheck(device, kw):
    """The op contract (schema and its mutations, the shape kernel against the real one,
    autograd registration, AOT dispatch) on the paths a call takes."""
    kw = {name: value.to(device) if isinstance(value, torch.Tensor) else value
          for name, value in kw.items()}
    shape = (4, 8, H_KV, E) if "block_table" in kw else (2, 16, H_KV, E)
    q = torch.randn(2, 2, H, E, device=device)
    caches = torch.randn(shape, device=device), torch.randn(shape, device=device)
    k, v = torch.randn(2, 2, H_KV, E, device=device), torch.randn(2, 2, H_KV, E, device=device)
    torch.library.opcheck(torch.ops.fusedmha.attention_with_kvcache.default, (q, *caches, k, v),
                          kw)


def test_a_decoding_step_exports():
    """torch.export keeps the op whole, and the exported program appends in place too."""
    class Step(torch.nn.Module):
        def forward(self, q, k_cache, v_cache, k, v, seqlens):
            return decoding_step(q, k_cache, v_cache, k, v, seqlens, None)

    q, k, v = torch.randn(2, 1, H, E), torch.randn(2, 1, H_KV, E), torch.randn(2, 1, H_KV, E)
    seqlens = torch.tensor([3, 6], dtype=torch.int32)
    caches = [torch.randn(2, 16, H_KV, E) for _ in range(2)]
    caches += [c.clone() for c in caches]
    program = torch.export.export(Step(), (q, caches[0], caches[1], k, v, seqlens))
    got = program.module()(q, caches[0], caches[1], k, v, seqlens)
    want = Step()(q, caches[2], caches[3], k, v, seqlens)
    for a, b in zip(got + tuple(caches[:2]), want + tuple(caches[2:])):
        assert torch.equal(a, b)
    assert torch.equal(caches[0][1, 6], k[1, 0])
