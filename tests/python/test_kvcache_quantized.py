"""Quantized KV caches: int8 and fp8 caches with a float32 scale per row and head, read by
fusedmha.flash_attn_with_kvcache (k_scale, v_scale) as code * scale. The rule that makes
codes (quantize_kv), the in-place quantizing append, and the attention over the codes against
float64 attention over the dequantized cache, on every path and ISA level."""

import math

import pytest
import torch
import torch.nn.functional as F

import fusedmha
from reference import reference_variants
from test_kvcache import rotate

H, H_KV, E = 8, 2, 40
CODES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def quantized(x, dtype):
    """A cache's codes and scales, by quantize_kv."""
    return fusedmha.quantize_kv(x, dtype)


@pytest.mark.parametrize("dtype", CODES)
def test_the_rule_scale_is_the_row_absmax_over_the_largest_code(dtype):
    x = torch.randn(3, 5, 2, 33) * torch.logspace(-3, 3, 33)
    x[1, 2, 0] = 0  # a row of zeros
    codes, scale = fusedmha.quantize_kv(x, dtype)
    assert codes.dtype == dtype and codes.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    torch.testing.assert_close(scale, x.abs().amax(-1) / QMAX[dtype], rtol=0, atol=0)
    assert scale[1, 2, 0] == 0 and (codes[1, 2, 0].float() == 0).all()
    # Each row's largest element is the largest code.
    assert torch.equal(codes.float().abs().amax(-1)[scale > 0],
                       torch.full_like(scale[scale > 0], QMAX[dtype]))
    s = scale.unsqueeze(-1)
    q = torch.where(s > 0, x / s, 0)
    want = q.round().to(dtype) if dtype == torch.int8 else q.to(dtype)
    assert torch.equal(codes.float(), want.float())
    # dequantize_kv undoes it within half a code step (int8) or the fp8 rounding.
    back = fusedmha.dequantize_kv(codes, scale, torch.float64)
    assert torch.equal(back, codes.double() * scale.double().unsqueeze(-1))
    step = s.double() * (0.5 if dtype == torch.int8 else
                         QMAX[dtype] * (2 ** -4 if dtype == torch.float8_e4m3fn else 2 ** -3))
    assert ((back - x.double()).abs() <= step + 1e-30).all()


def test_int8_rounds_halves_to_even():
    x = torch.tensor([[127.0, 2.5, -2.5, 3.5, 0.5]])
    codes, scale = fusedmha.quantize_kv(x, torch.int8)
    assert scale.item() == 1.0 and codes.tolist() == [[127, 2, -2, 4, 0]]


def test_quantize_kv_refuses_other_dtypes_clearly():
    with pytest.raises(RuntimeError, match="quantize_kv: expected dtype int8, float8_e4m3fn or float8_e5m2"):
        fusedmha.quantize_kv(torch.randn(2, 4), torch.float16)
    with pytest.raises(RuntimeError, match="quantize_kv: expected x of a floating dtype"):
        fusedmha.quantize_kv(torch.ones(2, 4, dtype=torch.int32), torch.int8)
    with pytest.raises(RuntimeError, match=r"dequantize_kv: expected scale of dtype float32 and shape \[2\]"):
        fusedmha.dequantize_kv(torch.zeros(2, 4, dtype=torch.int8), torch.ones(3))


def attention_over(q, keys, values, kw):
    """Float64 attention of q (L, H, E) over keys/values (S, H_kv, E), bottom-right."""
    window = kw.get("window_size", (-1, -1))
    out, lse, _ = reference_variants(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        is_causal=kw.get("causal", False), enable_gqa=True, window_left=window[0],
        window_right=window[1], bottom_right=True, softcap=kw.get("softcap", 0.0),
        alibi_slopes=kw.get("alibi_slopes"), sinks=kw.get("sinks"))
    return out.transpose(0, 1), lse


def torch_error(q, keys, values, want, kw):
    """PyTorch SDPA's error against want, at q's dtype over the same (dequantized) keys:
    the parity bound (only where SDPA has the call's variants: causal or none)."""
    if set(kw) - {"causal"}:
        return 0.0
    L, S = q.shape[0], keys.shape[0]
    mask = torch.ones(L, S, dtype=torch.bool).tril(S - L) if kw.get("causal") else None
    qh, kh, vh = (t.transpose(0, 1).to(q.dtype) for t in (q, keys, values))
    theirs = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return (theirs.transpose(0, 1).double() - want).abs().max().item()


FLOOR = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("kw", [
    dict(causal=True),
    dict(),
    dict(causal=True, window_size=(9, 0), softcap=4.0),
    dict(causal=True, alibi=True, sinks=True),
    dict(causal=True, paged=True),
    dict(causal=True, batch_idx=True),
    dict(causal=True, batch_idx=True, leftpad=True),
    dict(causal=True, rotary=True),
])
@pytest.mark.parametrize("L", [1, 5])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_attention_over_the_codes_equals_attention_over_the_dequantized_cache(codes, kw, L, q_dtype):
    """The output against float64 attention over the dequantized cache (the new rows as they
    were quantized into it), within PyTorch's own error at q's dtype over that cache (or the
    dtype's floor): the kernels add no error of their own to the codes' values."""
    kw = dict(kw)
    B, B_cache, S_cache, page = 3, 4, 96, 16
    lengths = [37, 0, 80]
    paged, batch_idx, leftpad = kw.pop("paged", False), kw.pop("batch_idx", False), kw.pop("leftpad", False)
    rotary = kw.pop("rotary", False)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(H, dtype=torch.float64)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H)
    shape = (B * S_cache // page, page, H_KV, E) if paged else (B_cache, S_cache, H_KV, E)
    k_cache, k_scale = quantized(torch.randn(shape), codes)
    v_cache, v_scale = quantized(torch.randn(shape), codes)
    call = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32), return_softmax_lse=True,
                k_scale=k_scale, v_scale=v_scale, **kw)
    if paged:
        call["block_table"] = torch.randperm(B * S_cache // page).view(B, -1).to(torch.int32)
    if batch_idx:
        call["cache_batch_idx"] = torch.tensor([3, 0, 2], dtype=torch.int32)
    if leftpad:
        call["cache_leftpad"] = torch.tensor([5, 0, 11], dtype=torch.int32)
    if rotary:
        angles = torch.arange(128.0)[:, None] * torch.rand(8)
        call.update(rotary_cos=angles.cos(), rotary_sin=angles.sin())
    q = torch.randn(B, L, H, E, dtype=q_dtype)
    k, v = torch.randn(B, L, H_KV, E, dtype=q_dtype), torch.randn(B, L, H_KV, E, dtype=q_dtype)
    out, lse = fusedmha.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **call)
    assert out.dtype == q_dtype and out.shape == q.shape

    keys = fusedmha.dequantize_kv(k_cache, k_scale, torch.float64)
    values = fusedmha.dequantize_kv(v_cache, v_scale, torch.float64)
    for b in range(B):
        n = lengths[b] + L
        if paged:
            rows = torch.arange(n)
            where = (call["block_table"][b, rows // page].long(), rows % page)
            kb, vb = keys[where], values[where]
        else:
            c = call["cache_batch_idx"][b].item() if batch_idx else b
            pad = call["cache_leftpad"][b].item() if leftpad else 0
            kb, vb = keys[c, pad:n], values[c, pad:n]
        qb = q[b]
        if rotary:  # (q at its positions, counted from the left padding: n - L ..)
            start = n - L - (call["cache_leftpad"][b].item() if leftpad else 0)
            qb = rotate(qb[None], call["rotary_cos"], call["rotary_sin"],
                        (torch.arange(L) + start)[None], True)[0]
        want, want_lse = attention_over(qb, kb, vb, kw)
        err = (out[b].double() - want).abs().max().item()
        bound = max(2 * torch_error(qb, kb, vb, want, kw), FLOOR[q_dtype])
        assert err <= bound, (b, err, bound)
        if q_dtype == torch.float32:
            finite = want_lse.isfinite()
            torch.testing.assert_close(lse[b][finite].double(), want_lse[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("paged", [False, True])
def test_the_append_quantizes_the_new_rows_in_place(codes, paged):
    """Each appended row (after rotary, for keys) lands in the cache as quantize_kv's codes and
    its scale in k_scale/v_scale; nothing else changes."""
    B, S_cache, page, L = 2, 32, 8, 3
    shape = (B * S_cache // page, page, H_KV, E) if paged else (B, S_cache, H_KV, E)
    k_cache, k_scale = quantized(torch.randn(shape), codes)
    v_cache, v_scale = quantized(torch.randn(shape), codes)
    before = [t.clone() for t in (k_cache, k_scale, v_cache, v_scale)]
    table = torch.randperm(B * S_cache // page).view(B, -1).to(torch.int32) if paged else None
    lengths = torch.tensor([4, 20], dtype=torch.int32)
    q, k, v = torch.randn(B, 1, H, E), torch.randn(B, L, H_KV, E), torch.randn(B, L, H_KV, E)
    fusedmha.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                     block_table=table, k_scale=k_scale, v_scale=v_scale)
    want_k, want_ks = fusedmha.quantize_kv(k, codes)
    want_v, want_vs = fusedmha.quantize_kv(v, codes)
    written = torch.zeros(shape[:2], dtype=torch.bool)
    for b in range(B):
        for i in range(L):
            row = lengths[b].item() + i
            at = (table[b, row // page].item(), row % page) if paged else (b, row)
            written[at] = True
            assert torch.equal(k_cache[at].float(), want_k[b, i].float())
            assert torch.equal(v_cache[at].float(), want_v[b, i].float())
            assert torch.equal(k_scale[at], want_ks[b, i]) and torch.equal(v_scale[at], want_vs[b, i])
    for now, then in zip((k_cache, k_scale, v_cache, v_scale), before):
        assert torch.equal(now[~written].float(), then[~written].float())


def test_a_quantized_cache_decodes_as_its_dequantized_copy():
    """Decoding steps over an int8 cache give, step by step, what the same steps give over a
    float32 cache holding its dequantized values (appended as dequantized rows)."""
    B, S_cache, steps = 2, 64, 6
    k_cache, k_scale = quantized(torch.randn(B, S_cache, H_KV, E), torch.int8)
    v_cache, v_scale = quantized(torch.randn(B, S_cache, H_KV, E), torch.int8)
    k_float = fusedmha.dequantize_kv(k_cache, k_scale)
    v_float = fusedmha.dequantize_kv(v_cache, v_scale)
    for t in range(steps):
        q, k, v = torch.randn(B, 1, H, E), torch.randn(B, 1, H_KV, E), torch.randn(B, 1, H_KV, E)
        n = 30 + t
        got = fusedmha.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=n,
                                               causal=True, k_scale=k_scale, v_scale=v_scale)
        k_float[:, n:n + 1] = fusedmha.dequantize_kv(*fusedmha.quantize_kv(k, torch.int8))
        v_float[:, n:n + 1] = fusedmha.dequantize_kv(*fusedmha.quantize_kv(v, torch.int8))
        want = fusedmha.flash_attn_with_kvcache(q, k_float, v_float, cache_seqlens=n + 1,
                                                causal=True)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_long_caches_split_across_threads():
    """A decoding step whose keys are split into chunks across threads (merged by their
    log-sum-exp) over an e4m3 cache: as the float64 truth."""
    S = 5000
    k_cache, k_scale = quantized(torch.randn(1, S, H_KV, 128), torch.float8_e4m3fn)
    v_cache, v_scale = quantized(torch.randn(1, S, H_KV, 128), torch.float8_e4m3fn)
    q = torch.randn(1, 1, H, 128)
    out = fusedmha.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=S, k_scale=k_scale,
                                           v_scale=v_scale)
    keys = fusedmha.dequantize_kv(k_cache, k_scale, torch.float64)[0]
    values = fusedmha.dequantize_kv(v_cache, v_scale, torch.float64)[0]
    want, _ = attention_over(q[0], keys, values, {})
    assert (out[0].double() - want).abs().max().item() < 2e-6


@pytest.mark.parametrize("level", ["default", "avx2", "avx512"])
@pytest.mark.parametrize("codes", CODES)
def test_every_isa_level(level, codes, monkeypatch):
    """The codes' conversion at each compiled ISA level the CPU runs (vector loops and
    tails, every code of the dtype, NaN codes included): the float32 products code * scale
    exactly, seen through one-hot queries on a value cache."""
    from test_isa_levels import NEEDS, cpu_flags
    if level not in fusedmha.build_info()["cpu_isas"] or not NEEDS[level] <= cpu_flags():
        pytest.skip(f"{level} is not runnable here")
    monkeypatch.setenv("FUSEDMHA_CPU_ISA", level)
    every = torch.arange(256, dtype=torch.uint8).view(codes)
    # 256 codes as value rows of 37 (vectors and a tail): row j is codes[j..j + 37) mod 256.
    S, Ev = 256, 37
    v_codes = every[(torch.arange(S)[:, None] + torch.arange(Ev)) % 256].view(1, S, 1, Ev)
    v_scale = torch.rand(1, S, 1) + 0.5
    # Keys of zeros: each query's output is the mean of the values; as one value row each, by
    # a cache of one row at a time.
    k_codes = torch.zeros(1, S, 1, Ev, dtype=codes)
    k_scale = torch.ones(1, S, 1)
    want = fusedmha.dequantize_kv(v_codes, v_scale)  # (float32 products)
    for j in [0, 1, 100, 255]:
        out = fusedmha.flash_attn_with_kvcache(
            torch.zeros(1, 1, 1, Ev), k_codes[:, j:], v_codes[:, j:], cache_seqlens=1,
            k_scale=k_scale[:, j:].contiguous(), v_scale=v_scale[:, j:].contiguous())
        torch.testing.assert_close(out[0, 0, 0], want[0, j, 0], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("bad, message", [
    (dict(k_scale=None), "pass k_scale and v_scale together"),
    (dict(k_scale=torch.ones(2, 16, H_KV, dtype=torch.float64)), "expected k_scale of dtype float32 and shape"),
    (dict(v_scale=torch.ones(2, 15, H_KV)), "expected v_scale of dtype float32 and shape"),
    (dict(k_scale=None, v_scale=None), r"q's dtype \(Float\), got Char and Char \(a quantized cache needs k_scale and v_scale\)"),
    (dict(v_cache=torch.zeros(2, 16, H_KV, E, dtype=torch.float8_e5m2)), "one quantized dtype"),
])
def test_bad_quantized_caches_get_clear_errors_and_change_nothing(bad, message):
    k_cache, k_scale = quantized(torch.randn(2, 16, H_KV, E), torch.int8)
    v_cache, v_scale = quantized(torch.randn(2, 16, H_KV, E), torch.int8)
    call = dict(k_cache=k_cache, v_cache=v_cache, k_scale=k_scale, v_scale=v_scale)
    call.update(bad)
    before = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]
    with pytest.raises(RuntimeError, match="fusedmha.attention_with_kvcache: .*" + message):
        fusedmha.flash_attn_with_kvcache(torch.randn(2, 1, H, E), k=torch.randn(2, 1, H_KV, E),
                                         v=torch.randn(2, 1, H_KV, E), cache_seqlens=3, **call)
    for now, then in zip((k_cache, v_cache, k_scale, v_scale), before):
        assert torch.equal(now.float(), then.float())


@pytest.mark.parametrize("layout", ["rows", "strided"])
def test_a_refused_call_leaves_codes_and_scales_as_they_were(layout):
    """Refused by the attention after the append (queries of another head dim): the codes and
    scales it wrote are undone, whether the append copied rows or went through index_put_
    (caches and scales whose rows are not contiguous), and both land the same rows."""
    results = []
    for attempt in ("refused", "accepted"):
        k_cache, k_scale = quantized(torch.randn(2, 16, H_KV, E, generator=torch.Generator().manual_seed(1)), torch.int8)
        v_cache, v_scale = quantized(torch.randn(2, 16, H_KV, E, generator=torch.Generator().manual_seed(2)), torch.int8)
        if layout == "strided":
            k_cache, v_cache = (t.transpose(2, 3).contiguous().transpose(2, 3) for t in (k_cache, v_cache))
            k_scale, v_scale = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k_scale, v_scale))
        before = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]
        k = torch.randn(2, 1, H_KV, E, generator=torch.Generator().manual_seed(3))
        v = torch.randn(2, 1, H_KV, E, generator=torch.Generator().manual_seed(4))
        call = dict(cache_seqlens=torch.tensor([3, 9], dtype=torch.int32), k_scale=k_scale, v_scale=v_scale)
        if attempt == "refused":
            with pytest.raises(RuntimeError, match="fusedmha.attention_with_kvcache: .*last dim"):
                fusedmha.flash_attn_with_kvcache(torch.randn(2, 1, H, E + 1), k_cache, v_cache, k, v, **call)
            for now, then in zip((k_cache, v_cache, k_scale, v_scale), before):
                assert torch.equal(now.float(), then.float())
        else:
            fusedmha.flash_attn_with_kvcache(torch.randn(2, 1, H, E), k_cache, v_cache, k, v, **call)
            results = [t.float().contiguous() for t in (k_cache, v_cache, k_scale, v_scale)]
    codes, scale = fusedmha.quantize_kv(k, torch.int8)
    assert torch.equal(results[0][1, 9], codes[1, 0].float()) and torch.equal(results[2][1, 9], scale[1, 0])


@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn])
def test_row_copies_and_index_put_append_the_same(codes):
    """Caches whose rows are contiguous take row copies, others index_put_: the same codes and
    scales land in the same places."""
    got = {}
    for layout in ("rows", "strided"):
        k_cache, k_scale = quantized(torch.randn(3, 16, H_KV, E, generator=torch.Generator().manual_seed(1)), codes)
        v_cache, v_scale = quantized(torch.randn(3, 16, H_KV, E, generator=torch.Generator().manual_seed(2)), codes)
        if layout == "strided":
            k_cache, v_cache = (t.transpose(2, 3).contiguous().transpose(2, 3) for t in (k_cache, v_cache))
            k_scale, v_scale = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k_scale, v_scale))
        k = torch.randn(2, 2, H_KV, E, generator=torch.Generator().manual_seed(3))
        v = torch.randn(2, 2, H_KV, E, generator=torch.Generator().manual_seed(4))
        out = fusedmha.flash_attn_with_kvcache(
            torch.ones(2, 1, H, E), k_cache, v_cache, k, v, k_scale=k_scale, v_scale=v_scale,
            cache_seqlens=torch.tensor([3, 9], dtype=torch.int32),
            cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32))
        got[layout] = [t.float() for t in (k_cache, v_cache, k_scale, v_scale, out)]
    for a, b in zip(got["rows"], got["strided"]):
        assert torch.equal(a, b)


def test_scales_that_share_memory_are_refused():
    k_cache, k_scale = quantized(torch.randn(2, 16, H_KV, E), torch.int8)
    v_cache, _ = quantized(torch.randn(2, 16, H_KV, E), torch.int8)
    with pytest.raises(RuntimeError, match="k_scale and v_scale are written in place"):
        fusedmha.flash_attn_with_kvcache(torch.randn(2, 1, H, E), k_cache, v_cache,
                                         cache_seqlens=3, k_scale=k_scale, v_scale=k_scale)


def test_varlen_codes_are_forward_only():
    """The packed op reads codes too; with inputs that require grad it says it is forward only."""
    k, ks = quantized(torch.randn(10, H_KV, E), torch.int8)
    v, vs = quantized(torch.randn(10, H_KV, E), torch.int8)
    q = torch.randn(2, H, E, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="quantized key and value .* are forward only"):
        torch.ops.fusedmha.varlen_attention_forward(q, k, v, cu_q, cu_k, 1, 6, k_scale=ks, v_scale=vs)
    with torch.no_grad():
        out, _, _ = torch.ops.fusedmha.varlen_attention_forward(q, k, v, cu_q, cu_k, 1, 6,
                                                                k_scale=ks, v_scale=vs)
    keys, values = fusedmha.dequantize_kv(k, ks), fusedmha.dequantize_kv(v, vs)
    for b, (s0, s1) in enumerate([(0, 4), (4, 10)]):
        want, _ = attention_over(q[b:b + 1].detach(), keys[s0:s1], values[s0:s1], {})
        assert (out[b].double() - want[0]).abs().max() < 2e-6


def test_opcheck_and_compile():
    """The op contract with quantized caches (mutated codes and scales, the shape kernel), and
    a decoding step compiled whole."""
    k_cache, k_scale = quantized(torch.randn(2, 16, H_KV, E), torch.int8)
    v_cache, v_scale = quantized(torch.randn(2, 16, H_KV, E), torch.int8)
    q, k, v = torch.randn(2, 1, H, E), torch.randn(2, 1, H_KV, E), torch.randn(2, 1, H_KV, E)
    torch.library.opcheck(torch.ops.fusedmha.attention_with_kvcache.default,
                          (q, k_cache, v_cache, k, v),
                          dict(cache_seqlens_value=3, k_scale=k_scale, v_scale=v_scale))
    torch.library.opcheck(torch.ops.fusedmha.quantize_kv.default, (torch.randn(3, 8), torch.int8))

    def step(q, kc, vc, k, v, ks, vs, n):
        return fusedmha.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=n, causal=True,
                                                k_scale=ks, v_scale=vs)

    torch._dynamo.reset()
    eager = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]
    compiled = torch.compile(step, fullgraph=True)
    for n in range(3, 6):
        want = step(q, eager[0], eager[1], k, v, eager[2], eager[3], n)
        got = compiled(q, k_cache, v_cache, k, v, k_scale, v_scale, n)
        assert torch.equal(got, want)
    for a, b in zip((k_cache, v_cache, k_scale, v_scale), eager):
        assert torch.equal(a.float(), b.float())


@pytest.mark.parametrize("codes", CODES)
def test_cuda_reads_quantized_caches_as_the_cpu(codes):
    """The CUDA simple kernel over the codes (the append quantized on the device too) gives
    the CPU kernels' output and caches."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    k_cache, k_scale = quantized(torch.randn(2, 64, H_KV, E), codes)
    v_cache, v_scale = quantized(torch.randn(2, 64, H_KV, E), codes)
    q, k, v = torch.randn(2, 1, H, E), torch.randn(2, 1, H_KV, E), torch.randn(2, 1, H_KV, E)
    on_gpu = [t.cuda() for t in (q, k_cache, v_cache, k, v, k_scale, v_scale)]
    want = fusedmha.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=40,
                                            causal=True, k_scale=k_scale, v_scale=v_scale)
    got = fusedmha.flash_attn_with_kvcache(*on_gpu[:5], cache_seqlens=40, causal=True,
                                           k_scale=on_gpu[5], v_scale=on_gpu[6])
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-5)
    for gpu, cpu in zip(on_gpu[1:3] + on_gpu[5:], (k_cache, v_cache, k_scale, v_scale)):
        assert torch.equal(gpu.cpu().float(), cpu.float())


@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("group", [1, 2, 3, 5, 8, 12])
@pytest.mark.parametrize("dim", [40, 72, 128])
def test_every_group_size_and_head_dim(codes, group, dim):
    """Decoding reads the codes in registers for a GQA group's rows (1, 2, or 4 at a time,
    padded; value rows 8, 4, 2 or 1 at a time) over head dims of whole vector pairs, a single
    vector and a tail: each group size and head dim as the float64 truth."""
    B, S, H_kv = 2, 150, 2
    k_cache, k_scale = quantized(torch.randn(B, S, H_kv, dim), codes)
    v_cache, v_scale = quantized(torch.randn(B, S, H_kv, dim), codes)
    q = torch.randn(B, 1, group * H_kv, dim)
    out = fusedmha.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=S - 3,
                                           k_scale=k_scale, v_scale=v_scale)
    keys = fusedmha.dequantize_kv(k_cache, k_scale, torch.float64)
    values = fusedmha.dequantize_kv(v_cache, v_scale, torch.float64)
    for b in range(B):
        want, _ = attention_over(q[b], keys[b, :S - 3], values[b, :S - 3], {})
        assert (out[b].double() - want).abs().max().item() < 3e-6, b
