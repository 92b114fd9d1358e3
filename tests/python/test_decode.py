"""Decoding with grouped-query attention: one query row per head against a K/V cache. The
kernels read the query heads that share a K/V head as rows of one item (K/V read once per
group); results, log-sum-exp and gradients must be those of the float64 reference in every
case that takes that path, and in the neighbouring ones that must not."""

import pytest
import torch

import fusedmha
from reference import assert_same_gradients, kernel_keep_mask, reference_variants

CASES = {
    "plain": dict(),
    "causal_bottom_right": dict(is_causal=True, bottom_right=True),
    "padding_mask": dict(mask="padding"),
    "span_mask": dict(mask="span"),  # (left padding and a suffix: a key span per batch index)
    "float_mask_row": dict(mask="float_row"),
    "softcap": dict(softcap=2.0),
    "per_head_mask": dict(mask="per_head"),  # (each head's mask row a row of the tile)
    # Not packed: each row's position or head matters.
    "causal_top_left": dict(is_causal=True),
    "window": dict(window_left=9, bottom_right=True, is_causal=True),
    "alibi": dict(alibi=True, bottom_right=True),
    "sinks": dict(sinks=True),
}


def forward_at_threads(threads, q, k, v, mask, is_causal, **variants):
    """The forward op's output and log-sum-exp (enable_gqa) with `threads` intra-op threads:
    how decoding splits its work depends on the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse, _ = torch.ops.fusedmha.attention_forward(q, k, v, mask, 0.0, is_causal, None, True, **variants)
    finally:
        torch.set_num_threads(before)
    return out, lse


def paged_copies(k_cache, v_cache, page):
    """(B, rows, H_kv, E) caches as pages of `page` rows in shuffled order: (k_pages, v_pages,
    block_table), sequence b's rows at the pages its table row names."""
    B, rows, Hkv, E = k_cache.shape
    pages = B * rows // page
    table = torch.randperm(pages).view(B, -1).to(torch.int32)
    k_pages = torch.empty(pages, page, Hkv, E, dtype=k_cache.dtype)
    v_pages = torch.empty(pages, page, Hkv, E, dtype=v_cache.dtype)
    k_pages[table.flatten().long()] = k_cache.reshape(-1, page, Hkv, E)
    v_pages[table.flatten().long()] = v_cache.reshape(-1, page, Hkv, E)
    return k_pages, v_pages, table


def with_kvcache(paged, page, q, k_cache, v_cache, *new_kv, **kw):
    """flash_attn_with_kvcache over the caches as they are, or (paged) over paged_copies of
    them through a block table."""
    if not paged:
        return fusedmha.flash_attn_with_kvcache(q, k_cache, v_cache, *new_kv, **kw)
    k_pages, v_pages, table = paged_copies(k_cache, v_cache, page)
    return fusedmha.flash_attn_with_kvcache(q, k_pages, v_pages, *new_kv, block_table=table, **kw)


# 37 keys: one key block; 2500: long enough that decoding splits the keys into chunks
# across threads, merged by log-sum-exp, where each K/V row holds every head ("bshe": a
# cache's (B, S, H_kv, E) viewed as (B, H_kv, S, E), with 2 K/V heads); with each head's keys
# rows of their own ("bhse", or "bshe" with one K/V head) the threads take heads instead.
@pytest.mark.parametrize("S", [37, 2500])
@pytest.mark.parametrize("kv_layout", ["bhse", "bshe"])
@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("layout", ["bhle", "blhe"])
@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_float64(device, name, layout, kv_heads, kv_layout, S):
    B, H, E = 2, 8, 16
    kw = dict(CASES[name])
    opts = dict(dtype=torch.float64, device=device)
    if layout == "bhle":
        q = torch.randn(B, H, 1, E, **opts, requires_grad=True)
        qh = q
    else:  # the (B, L, H, E) projection viewed as (B, H, L, E)
        q = torch.randn(B, 1, H, E, **opts, requires_grad=True)
        qh = q.transpose(1, 2)
    if kv_layout == "bhse":
        k = torch.randn(B, kv_heads, S, E, **opts, requires_grad=True)
        v = torch.randn(B, kv_heads, S, E, **opts, requires_grad=True)
    else:
        k = torch.randn(B, S, kv_heads, E, **opts).transpose(1, 2).requires_grad_()
        v = torch.randn(B, S, kv_heads, E, **opts).transpose(1, 2).requires_grad_()
    mask = kw.pop("mask", None)
    if mask == "padding":
        mask = torch.arange(S, device=device)[None, None, None, :] < torch.tensor([S, S // 3], device=device)[:, None, None, None]
    elif mask == "span":
        keys = torch.arange(S, device=device)[None, None, None, :]
        begin, end = (torch.tensor(t, device=device)[:, None, None, None] for t in ([S // 4, 0], [S, S // 2]))
        mask = (keys >= begin) & (keys < end)
    elif mask == "float_row":
        mask = torch.randn(S, **opts)
    elif mask == "per_head":
        mask = torch.rand(B, H, 1, S, device=device) > 0.3
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(H, device=device)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H, **opts, requires_grad=True)
    is_causal = kw.pop("is_causal", False)
    out, lse, _ = torch.ops.fusedmha.attention_forward(qh, k, v, mask, 0.0, is_causal, None, True, **kw)
    ref, ref_lse, _ = reference_variants(qh, k, v, mask, is_causal, enable_gqa=True, **kw)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    assert_same_gradients(out, ref, [q, k, v] + ([kw["sinks"]] if "sinks" in kw else []))


def test_decode_with_dropout_keeps_the_stream_per_head():
    """Dropout is keyed by (head, row, key): decoding with it must draw the same elements as
    the reference keep-mask of the unpacked call."""
    B, H, Hkv, S, E, p = 1, 4, 2, 50, 8, 0.3
    q = torch.randn(B, H, 1, E, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, S, E, dtype=torch.float64) for _ in range(2))
    out, _, rng = torch.ops.fusedmha.attention_forward(q, k, v, None, p, False, None, True)
    keep = kernel_keep_mask(rng, q, k, p)
    ref, _, _ = reference_variants(q, k, v, enable_gqa=True, keep=keep, dropout_p=p)
    torch.testing.assert_close(out, ref)


def test_flash_attn_decode_and_weights():
    B, H, Hkv, S, E = 3, 8, 2, 64, 32
    q = torch.randn(B, 1, H, E)
    k, v = torch.randn(B, S, Hkv, E), torch.randn(B, S, Hkv, E)
    out, lse, probs = fusedmha.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref, ref_lse, ref_probs = reference_variants(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, bottom_right=True, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref.transpose(1, 2), rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(probs.double(), ref_probs, rtol=2e-5, atol=2e-6)


def test_split_decoding_keeps_a_nan_in_its_head():
    """A NaN in one head's query makes that head's output NaN, and no other's, when the keys
    are split across threads and merged (a cache's (B, S, H_kv, E) rows: one item holds every
    head, so the keys are split at any thread count)."""
    B, H, Hkv, S, E = 1, 8, 2, 4096, 16
    q = torch.randn(B, H, 1, E)
    q[0, 5, 0, 3] = float("nan")
    k, v = (torch.randn(B, S, Hkv, E).transpose(1, 2) for _ in range(2))
    out = fusedmha.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert out[0, 5].isnan().all()
    assert not out[0, [0, 1, 2, 3, 4, 6, 7]].isnan().any()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out[0, :5], ref[0, :5], atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("threads", [1, 3, 16])
@pytest.mark.parametrize("S", [300, 2500])
@pytest.mark.parametrize("kv_layout", ["bhse", "bshe"])
@pytest.mark.parametrize("name", ["plain", "sinks", "per_head_mask", "span_mask", "window"])
def test_decode_work_split_at_thread_counts(name, kv_layout, S, threads):
    """How decoding shares its work (heads per item, key chunks) depends on the thread count;
    every split must give the reference's result. Sinks and per-head masks keep the query
    heads apart, so an item must hold all the query heads of each K/V head it reads. A key
    span (left padding and a suffix) and a sliding window are chunked as the keys they see,
    not as all the keys."""
    B, H, Hkv, E = 1, 16, 4, 16
    q = torch.randn(B, H, 1, E, dtype=torch.float64)
    if kv_layout == "bhse":
        k, v = (torch.randn(B, Hkv, S, E, dtype=torch.float64) for _ in range(2))
    else:
        k, v = (torch.randn(B, S, Hkv, E, dtype=torch.float64).transpose(1, 2) for _ in range(2))
    kw, mask = {}, None
    if name == "sinks":
        kw["sinks"] = torch.randn(H, dtype=torch.float64)
    elif name == "per_head_mask":
        mask = torch.rand(B, H, 1, S) > 0.3
    elif name == "span_mask":
        keys = torch.arange(S)
        mask = ((keys >= S // 3 + 5) & (keys < S - 40)).view(1, 1, 1, S)
    elif name == "window":
        kw = dict(window_left=S // 4, bottom_right=True)
    is_causal = name == "window"
    out, lse = forward_at_threads(threads, q, k, v, mask, is_causal, **kw)
    ref, ref_lse, _ = reference_variants(q, k, v, mask, is_causal, enable_gqa=True, **kw)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("S", [256, 300, 511])
@pytest.mark.parametrize("paged", [False, True])
def test_short_cache_of_whole_rows_is_shared_by_heads(S, paged):
    """One sequence over a (B, S, H_kv, E) cache too short to split into two key chunks: the
    threads take K/V heads instead (each item reads its heads' slice of every row)."""
    B, H, Hkv, E, page = 1, 8, 4, 16, 64
    rows = -(-S // page) * page
    q = torch.randn(B, 1, H, E)
    k_cache, v_cache = torch.randn(B, rows, Hkv, E), torch.randn(B, rows, Hkv, E)
    out = with_kvcache(paged, page, q, k_cache, v_cache, cache_seqlens=S)
    ref, _, _ = reference_variants(q.transpose(1, 2).double(), k_cache[:, :S].transpose(1, 2).double(),
                                   v_cache[:, :S].transpose(1, 2).double(), enable_gqa=True)
    torch.testing.assert_close(out.double(), ref.transpose(1, 2), rtol=2e-5, atol=2e-6)


# More query heads per K/V head than one decoding item takes as rows (8): the forward packs
# the largest share of them that divides the group (32 → 8 per item, 12 → 6; 11, prime, →
# none: every head its own item row, all reading one K/V head), so the threads split the keys
# instead of one thread taking every query head. float32 and float64 take different vector
# paths (keys transposed, or scores in lanes).
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("S", [37, 2500])
@pytest.mark.parametrize("kv_layout", ["bhse", "bshe"])
@pytest.mark.parametrize("heads", [(32, 1), (12, 1), (22, 2), (24, 2)])
@pytest.mark.parametrize("name", ["plain", "padding_mask", "causal_bottom_right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decode_with_more_query_heads_per_kv_head_than_an_item_takes(dtype, name, heads, kv_layout, S, threads):
    (H, Hkv), B, E = heads, 2, 16
    q = torch.randn(B, H, 1, E, dtype=dtype)
    if kv_layout == "bhse":
        k, v = (torch.randn(B, Hkv, S, E, dtype=dtype) for _ in range(2))
    else:
        k, v = (torch.randn(B, S, Hkv, E, dtype=dtype).transpose(1, 2) for _ in range(2))
    mask, kw = None, {}
    if name == "padding_mask":  # (a key-length mask: the second sequence sees a third of the keys)
        mask = torch.arange(S)[None, None, None, :] < torch.tensor([S, S // 3])[:, None, None, None]
    elif name == "causal_bottom_right":
        kw["bottom_right"] = True
    is_causal = name == "causal_bottom_right"
    out, lse = forward_at_threads(threads, q, k, v, mask, is_causal, **kw)
    ref, ref_lse, _ = reference_variants(q, k, v, mask, is_causal, enable_gqa=True, **kw)
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else {}
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("H", [32, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kvcache_decode_with_multi_query_attention(dtype, H, causal, paged):
    """flash_attn_with_kvcache with one K/V head for 32 query heads (packed 8 at a time) or 11
    (a prime: not packed, the heads share each key block's transpose), through the packed-batch
    path, paged or not; bfloat16 keys are widened before they are transposed."""
    B, E, S, page = 2, 16, 700, 64
    rows = -(-S // page) * page
    q = torch.randn(B, 1, H, E).to(dtype)
    k_cache, v_cache = torch.randn(B, rows, 1, E).to(dtype), torch.randn(B, rows, 1, E).to(dtype)
    seqlens = torch.tensor([S, S // 3], dtype=torch.int32)
    out = with_kvcache(paged, page, q, k_cache, v_cache, cache_seqlens=seqlens, causal=causal)
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    for b in range(B):  # (one query row at the end of each cache: causal hides nothing)
        n = int(seqlens[b])
        ref, _, _ = reference_variants(q[b:b + 1].transpose(1, 2), k_cache[b:b + 1, :n].transpose(1, 2),
                                       v_cache[b:b + 1, :n].transpose(1, 2), enable_gqa=True)
        torch.testing.assert_close(out[b:b + 1].double(), ref.transpose(1, 2), **tol)


# A few queries per head (speculative decoding's draft tokens): the query heads of a K/V head
# are items' heads of their own, each block's keys transposed once for all of them.
@pytest.mark.parametrize("S", [300, 2500])
@pytest.mark.parametrize("L", [2, 3, 5])
@pytest.mark.parametrize("name", ["plain", "causal_bottom_right", "sinks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_few_queries_per_head_share_each_key_block(dtype, name, L, S):
    B, H, Hkv, E = 1, 16, 4, 16
    q = torch.randn(B, H, L, E, dtype=dtype)
    k, v = (torch.randn(B, Hkv, S, E, dtype=dtype) for _ in range(2))
    kw, is_causal = {}, False
    if name == "causal_bottom_right":
        kw["bottom_right"], is_causal = True, True
    elif name == "sinks":
        kw["sinks"] = torch.randn(H, dtype=dtype)
    out, lse, _ = torch.ops.fusedmha.attention_forward(q, k, v, None, 0.0, is_causal, None, True, **kw)
    ref, ref_lse, _ = reference_variants(q, k, v, None, is_causal, enable_gqa=True, **kw)
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else {}
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)


# A few queries per head with the rows of several query heads of a K/V head merged into one
# score tile (in float on AVX2 and AVX-512 up to 16 rows: 4 heads × 2 rows, 4 × 3, 6 × 2, 4 × 4;
# in float64 and at the default level up to 8: 4 × 2, 2 × 3, 3 × 2, 2 × 4): each row keeps its own
# position for the band, each head its own sink, and with split keys the merge writes every
# head's rows back. Forced to each runnable ISA level: the tiles' vector paths differ by width.
MERGED = {
    "plain": dict(),
    "causal_bottom_right": dict(is_causal=True, bottom_right=True),
    "causal_top_left": dict(is_causal=True),
    "window": dict(is_causal=True, bottom_right=True, window_left=5),
    "sinks": dict(sinks=True),
    "padding_mask": dict(mask="padding"),
    "span_mask": dict(mask="span"),  # (left padding and a suffix: a key span per batch index)
    "window_two_sided": dict(window_left=7, window_right=3, bottom_right=True),
    "window_top_left": dict(is_causal=True, window_left=5),
    "sinks_window": dict(sinks=True, is_causal=True, bottom_right=True, window_left=9),
}


def at_level(level, monkeypatch):
    """Runs the rest of the test with the kernels of ISA level `level` (skips it where this
    machine cannot run them)."""
    from test_isa_levels import NEEDS, cpu_flags
    if level not in fusedmha.build_info()["cpu_isas"] or not NEEDS[level] <= cpu_flags():
        pytest.skip(f"{level} is not runnable here")
    monkeypatch.setenv("FUSEDMHA_CPU_ISA", level)


def expect_merged_case(name, threads, B, H, Hkv, L, E, S, kv_layout, q=None):
    """MERGED[name] over float64 K/V in kv_layout ("bhse", or "bshe": a cache's (B, S, H_kv, E)
    viewed as (B, H_kv, S, E)) and q (random (B, H, L, E) if None): the forward at `threads`
    threads against the float64 reference, in float64 and in float32."""
    kw = dict(MERGED[name])
    if q is None:
        q = torch.randn(B, H, L, E, dtype=torch.float64)
    if kv_layout == "bhse":
        k, v = (torch.randn(B, Hkv, S, E, dtype=torch.float64) for _ in range(2))
    else:
        k, v = (torch.randn(B, S, Hkv, E, dtype=torch.float64).transpose(1, 2) for _ in range(2))
    mask, keys = None, torch.arange(S)[None, None, None, :]
    kind = kw.pop("mask", None)
    if kind == "padding":  # (key lengths: the second sequence sees a third of the keys)
        mask = keys < torch.tensor([S, S // 3])[:, None, None, None]
    elif kind == "span":  # (the first sequence left-padded, the second padded on both sides)
        begin, end = (torch.tensor(t)[:, None, None, None] for t in ([S // 4, 5], [S, S // 2]))
        mask = (keys >= begin) & (keys < end)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H, dtype=torch.float64)
    is_causal = kw.pop("is_causal", False)
    ref, ref_lse, _ = reference_variants(q, k, v, mask, is_causal, enable_gqa=True, **kw)
    for dtype, tol in ((torch.float64, {}), (torch.float32, dict(rtol=2e-5, atol=2e-6))):
        variants = {n: (t.to(dtype) if torch.is_tensor(t) else t) for n, t in kw.items()}
        out, lse = forward_at_threads(threads, q.to(dtype), k.to(dtype), v.to(dtype), mask, is_causal,
                                      **variants)
        torch.testing.assert_close(out.double(), ref, **tol)
        torch.testing.assert_close(lse.double(), ref_lse, **tol)


@pytest.mark.parametrize("level", ["default", "avx2", "avx512"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("kv_layout", ["bhse", "bshe"])
@pytest.mark.parametrize("heads", [(16, 4, 2), (16, 2, 3), (12, 2, 2), (8, 2, 4)], ids=["g4l2", "g8l3", "g6l2", "g4l4"])
@pytest.mark.parametrize("name", list(MERGED))
def test_few_queries_of_several_heads_share_a_tile(name, heads, kv_layout, threads, level, monkeypatch):
    at_level(level, monkeypatch)
    (H, Hkv, L), B, E = heads, 2, 24
    q = torch.randn(B, L, H, E, dtype=torch.float64).transpose(1, 2)  # (the projection's layout)
    expect_merged_case(name, threads, B, H, Hkv, L, E, 700, kv_layout, q)


# Tiles of 9 to 16 float query rows: one head's L queries, 16 query heads of a K/V head packed
# as rows, 8 heads × 2 queries merged. Decoding over 700 keys of a cache's (B, S, H_kv, E)
# layout, split across the threads and merged; over 37 keys, on AVX-512, the few-row path of
# short keys (elsewhere the GEMM path). Forced to each runnable ISA level: on AVX-512 the rows
# sit in one vector of lanes, on AVX2 the keys are transposed; float64, and the default level,
# keep tiles of 8 rows (the same shapes, other splits).
@pytest.mark.parametrize("level", ["default", "avx2", "avx512"])
@pytest.mark.parametrize("S", [37, 700])
@pytest.mark.parametrize("heads", [(4, 2, 9), (4, 2, 12), (4, 2, 16), (32, 2, 1), (8, 1, 2)],
                         ids=["l9", "l12", "l16", "g16l1", "g8l2"])
@pytest.mark.parametrize("name", ["plain", "causal_bottom_right", "window", "sinks", "padding_mask"])
def test_up_to_sixteen_query_rows_share_a_tile(name, heads, S, level, monkeypatch):
    at_level(level, monkeypatch)
    H, Hkv, L = heads
    expect_merged_case(name, 2, 2, H, Hkv, L, 24, S, "bshe")


# More query rows per head than a tile takes (chunked prefill, long drafts: up to 64 over 1024
# keys or more): each head's rows in panels of up to 16 (8 in float64 and at the default level),
# every panel of a K/V head reading each key block once; the keys of a cache's layout split
# across threads. 17 rows: panels of 9 and 8 (on AVX-512 one in a vector of lanes, one from
# transposed keys).
@pytest.mark.parametrize("level", ["default", "avx2", "avx512"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("kv_layout", ["bhse", "bshe"])
@pytest.mark.parametrize("L", [17, 33, 64])
@pytest.mark.parametrize("name", list(MERGED))
def test_many_queries_per_head_go_in_row_panels(name, L, kv_layout, threads, level, monkeypatch):
    at_level(level, monkeypatch)
    expect_merged_case(name, threads, 2, 4, 2, L, 24, 1100, kv_layout)


# A mask per query head, (B, H, 1, S), (1, H, 1, S) or (H, 1, S), bool or float, takes the
# packed path: the heads of a K/V head are still read as rows of one item (up to 16 of 32 over
# one K/V head), each head's mask row a row of the tile; one head sees no key at all (bool) or
# only -inf (float), and gets 0. "expanded": a key padding row expanded over the heads (head
# stride 0). Keys split across 3 threads or not, at each runnable ISA level, float64 and float32.
@pytest.mark.parametrize("level", ["default", "avx2", "avx512"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("shape", ["BH1S", "1H1S", "H1S", "expanded"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("heads", [(8, 2), (32, 1)], ids=["g4", "g32"])
def test_decoding_with_per_head_masks_matches_float64(heads, kind, shape, threads, level, monkeypatch):
    at_level(level, monkeypatch)
    (H, Hkv), B, E, S = heads, 2, 24, 700
    q = torch.randn(B, H, 1, E, dtype=torch.float64)
    k, v = (torch.randn(B, S, Hkv, E, dtype=torch.float64).transpose(1, 2) for _ in range(2))
    dims = {"BH1S": (B, H, 1, S), "1H1S": (1, H, 1, S), "H1S": (H, 1, S), "expanded": (B, 1, 1, S)}[shape]
    if kind == "bool":
        mask = torch.rand(dims) > 0.3
    else:
        mask = torch.randn(dims, dtype=torch.float64)
    if shape == "expanded":
        mask = mask.expand(B, H, 1, S)
    else:
        mask[..., 3, :, :] = False if kind == "bool" else float("-inf")
    ref, ref_lse, _ = reference_variants(q, k, v, mask, enable_gqa=True)
    for dtype, tol in ((torch.float64, {}), (torch.float32, dict(rtol=2e-5, atol=2e-6))):
        m = mask if kind == "bool" else mask.to(dtype)
        out, lse = forward_at_threads(threads, q.to(dtype), k.to(dtype), v.to(dtype), m, False)
        torch.testing.assert_close(out.double(), ref, **tol)
        torch.testing.assert_close(lse.double(), ref_lse, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decoding_with_half_precision_per_head_masks_and_left_padding(dtype):
    """One query per head over 700 keys in half precision: a per-head mask of the inputs'
    dtype (its rows widened a vector at a time), a left-padded bool mask (falses first: a key
    span), and the same with a hole (not a span: the general path), against float64 on the
    same rounded inputs."""
    B, H, Hkv, E, S = 2, 8, 2, 32, 700
    q = torch.randn(B, H, 1, E).to(dtype)
    k, v = (torch.randn(B, Hkv, S, E).to(dtype) for _ in range(2))
    left_padded = torch.arange(S)[None, None, None, :] >= torch.tensor([100, 0])[:, None, None, None]
    with_a_hole = left_padded.clone()
    with_a_hole[1, ..., 350] = False
    for mask in (torch.randn(B, H, 1, S).to(dtype), left_padded, with_a_hole):
        out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        ref, _, _ = reference_variants(q.double(), k.double(), v.double(),
                                       mask if mask.dtype == torch.bool else mask.double(),
                                       enable_gqa=True)
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


# 64 queries of 32 heads at E=128 hold 2 MiB of query state (4 in float64), more than a
# core's L2 on most CPUs: an item then takes fewer heads (a multiple of a K/V head's 4), in
# both layouts, the keys split across 3 threads or not. (Checks the results of that split.)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("kv_layout", ["bhse", "bshe"])
@pytest.mark.parametrize("name", ["plain", "causal_bottom_right", "sinks"])
def test_query_state_beyond_l2_matches_float64(name, kv_layout, threads):
    expect_merged_case(name, threads, 1, 32, 8, 64, 128, 1100, kv_layout)


@pytest.mark.parametrize("threads", [1, 3])
def test_varlen_chunks_of_different_lengths_go_in_row_panels(threads):
    """Packed sequences with 40, 17 and 5 queries over 1100, 1500 and 1024 keys (panels sized
    for the longest: a shorter sequence's last panels have fewer rows, or none), causal
    bottom-right per sequence: float32 (panels of up to 16) and float64 (of 8), with the keys
    split across 3 threads or not, and float64's gradients through the backward."""
    H, Hkv, E = 8, 2, 16
    cu_q = torch.tensor([0, 40, 57, 62], dtype=torch.int32)
    cu_k = torch.tensor([0, 1100, 2600, 3624], dtype=torch.int32)
    q = torch.randn(62, H, E, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(3624, Hkv, E, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ref = _varlen_reference(q, k, v, cu_q, cu_k)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out32 = fusedmha.flash_attn_varlen_func(q.float(), k.float(), v.float(), cu_q, cu_k, 40, 1500,
                                                causal=True)
        out = fusedmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 1500, causal=True)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), grad)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out32.double(), ref, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(out, ref)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


def test_varlen_query_state_beyond_l2_matches_float64():
    """Packed chunks of 64 and 30 queries of 32 heads (E=128: 2 MiB of query state in float32)
    over 1100 and 1030 keys, causal bottom-right: the items take fewer heads each."""
    H, Hkv, E = 32, 8, 128
    cu_q = torch.tensor([0, 64, 94], dtype=torch.int32)
    cu_k = torch.tensor([0, 1100, 2130], dtype=torch.int32)
    q = torch.randn(94, H, E, dtype=torch.float64)
    k, v = (torch.randn(2130, Hkv, E, dtype=torch.float64) for _ in range(2))
    ref = _varlen_reference(q, k, v, cu_q, cu_k)
    out32 = fusedmha.flash_attn_varlen_func(q.float(), k.float(), v.float(), cu_q, cu_k, 64, 1100,
                                            causal=True)
    out = fusedmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 1100, causal=True)
    torch.testing.assert_close(out32.double(), ref, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(out, ref)


def _varlen_reference(q, k, v, cu_q, cu_k):
    outs = []
    for b in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref, _, _ = reference_variants(q[qs].transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1),
                                       None, True, enable_gqa=True, bottom_right=True)
        outs.append(ref.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("paged", [False, True])
def test_varlen_drafts_of_different_lengths_share_tiles(paged):
    """Packed sequences with 2, 1 and 3 new queries over caches of their own lengths (the
    decode path sizes its tiles for the longest, 3 rows per head): causal, bottom-right per
    sequence; then flash_attn_with_kvcache with 2 draft tokens per sequence, paged or not."""
    H, Hkv, E, page = 16, 4, 16, 64
    lens_q, lens_k = [2, 1, 3], [300, 700, 520]
    cu_q = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 300, 1000, 1520], dtype=torch.int32)
    q = torch.randn(6, H, E)
    k, v = torch.randn(1520, Hkv, E), torch.randn(1520, Hkv, E)
    out = fusedmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 700, causal=True)
    for b in range(3):
        qs, ks = q[cu_q[b]:cu_q[b + 1]], slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref, _, _ = reference_variants(qs.transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1),
                                       None, True, enable_gqa=True, bottom_right=True)
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]].double(), ref.transpose(0, 1), rtol=2e-5, atol=2e-6)

    B, L, S = 2, 2, 700
    rows = -(-(S + L) // page) * page
    qd = torch.randn(B, L, H, E)
    k_cache, v_cache = torch.randn(B, rows, Hkv, E), torch.randn(B, rows, Hkv, E)
    k_new, v_new = torch.randn(B, L, Hkv, E), torch.randn(B, L, Hkv, E)
    seqlens = torch.tensor([S, S // 3], dtype=torch.int32)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for b in range(B):
        n = int(seqlens[b])
        expect_k[b, n:n + L], expect_v[b, n:n + L] = k_new[b], v_new[b]
    out = with_kvcache(paged, page, qd, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True)
    for b in range(B):
        n = int(seqlens[b]) + L
        ref, _, _ = reference_variants(qd[b:b + 1].transpose(1, 2), expect_k[b:b + 1, :n].transpose(1, 2),
                                       expect_v[b:b + 1, :n].transpose(1, 2), None, True, enable_gqa=True,
                                       bottom_right=True)
        torch.testing.assert_close(out[b:b + 1].double(), ref.transpose(1, 2), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("paged", [False, True])
def test_one_query_head_per_sequence_keeps_its_sequences_apart(paged):
    """A single query head (H = H_kv = 1): the last outer dim is then the batch, whose
    sequences read keys of their own (a kvcache's, found through their lengths or pages) and
    must not share score tiles; nor may batch indices that share one broadcast K/V but see
    keys of different lengths."""
    B, L, E, S, page = 4, 3, 16, 600, 64
    rows = -(-S // page) * page
    q = torch.randn(B, L, 1, E)
    k_cache, v_cache = torch.randn(B, rows, 1, E), torch.randn(B, rows, 1, E)
    seqlens = torch.tensor([S, 400, 300, 520], dtype=torch.int32)
    out = with_kvcache(paged, page, q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
    for b in range(B):
        n = int(seqlens[b])
        ref, _, _ = reference_variants(q[b:b + 1].transpose(1, 2), k_cache[b:b + 1, :n].transpose(1, 2),
                                       v_cache[b:b + 1, :n].transpose(1, 2), None, True, bottom_right=True)
        torch.testing.assert_close(out[b:b + 1].double(), ref.transpose(1, 2), rtol=2e-5, atol=2e-6)

    qd = torch.randn(B, 1, 2, E, dtype=torch.float64)
    k, v = (torch.randn(1, 1, S, E, dtype=torch.float64).expand(B, 1, S, E) for _ in range(2))
    mask = torch.arange(S)[None, None, None, :] < seqlens.long()[:, None, None, None]
    out, lse = forward_at_threads(2, qd, k, v, mask, False)
    ref, ref_lse, _ = reference_variants(qd, k, v, mask, False)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(16, 4, 2), (16, 2, 3), (8, 2, 4)], ids=["g4l2", "g8l3", "g4l4"])
def test_few_queries_of_several_heads_share_a_tile_in_half_precision(heads, dtype):
    """Each head's half-precision query rows are widened into their place in the shared tile."""
    (H, Hkv, L), B, E, S = heads, 2, 40, 900
    q = torch.randn(B, L, H, E).to(dtype).transpose(1, 2)
    k, v = (torch.randn(B, S, Hkv, E).to(dtype).transpose(1, 2) for _ in range(2))
    out, lse = forward_at_threads(3, q, k, v, None, True, bottom_right=True)
    ref, ref_lse, _ = reference_variants(q, k, v, None, True, enable_gqa=True, bottom_right=True)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("shapes", [((1, 4, 2), 1, 4), ((1, 8, 2), 2, 4), ((1, 8, 3), 4, 1), ((3, 1, 2), "k", None)],
                         ids=["k_one_head", "k2_v4", "k4_v1", "k_over_batch"])
def test_shared_tiles_need_both_k_and_v_shared(shapes, threads):
    """K and V may have different head counts (or one broadcast): only heads that read the same
    K rows and the same V rows may share a tile. Last: K broadcast over the batch (with a single
    head, the last outer dim), V per batch index."""
    (B, H, L), hk, hv = shapes
    E, S = 16, 700
    q = torch.randn(B, H, L, E, dtype=torch.float64)
    if hk == "k":
        k = torch.randn(1, 1, S, E, dtype=torch.float64).expand(B, 1, S, E)
        v = torch.randn(B, 1, S, E, dtype=torch.float64)
    else:
        k, v = torch.randn(B, hk, S, E, dtype=torch.float64), torch.randn(B, hv, S, E, dtype=torch.float64)
    out, lse = forward_at_threads(threads, q, k, v, None, True, bottom_right=True)
    ref, ref_lse, _ = reference_variants(q, k, v, None, True, enable_gqa=True, bottom_right=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_nan_query_stays_in_its_row_of_a_shared_tile(threads):
    """A NaN in one query row of one head makes that row NaN and no other row of its tile,
    with the keys split across threads and merged (a cache's (B, S, H_kv, E) rows)."""
    B, H, Hkv, L, E, S = 1, 16, 4, 2, 16, 2500
    q = torch.randn(B, H, L, E)
    q[0, 5, 1, 3] = float("nan")
    k, v = (torch.randn(B, S, Hkv, E).transpose(1, 2) for _ in range(2))
    out, lse = forward_at_threads(threads, q, k, v, None, True, bottom_right=True)
    ref, ref_lse, _ = reference_variants(q, k, v, None, True, enable_gqa=True, bottom_right=True)
    assert out[0, 5, 1].isnan().all() and lse[0, 5, 1].isnan()
    assert out.isnan().sum() == E and lse.isnan().sum() == 1
    others = torch.ones(B, H, L, dtype=torch.bool)
    others[0, 5, 1] = False
    torch.testing.assert_close(out[others].double(), ref[others], rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(lse[others].double(), ref_lse[others], rtol=2e-5, atol=2e-6)


def test_a_sequence_without_queries_among_shared_tiles():
    """Packed sequences with 2, 0 and 3 new queries: the empty one writes nothing, the others
    share tiles sized for the longest (2 heads × 3 rows)."""
    H, Hkv, E = 16, 4, 16
    cu_q = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 400, 1100, 1700], dtype=torch.int32)
    q = torch.randn(5, H, E)
    k, v = torch.randn(1700, Hkv, E), torch.randn(1700, Hkv, E)
    out = fusedmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 700, causal=True)
    for b in (0, 2):
        qs, ks = q[cu_q[b]:cu_q[b + 1]], slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref, _, _ = reference_variants(qs.transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1),
                                       None, True, enable_gqa=True, bottom_right=True)
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]].double(), ref.transpose(0, 1), rtol=2e-5, atol=2e-6)
