"""FlashAttention's variants in the fused kernels — bottom-right causal, sliding windows,
softcap, ALiBi, sinks — alone and together, with masks, GQA and dropout: outputs, log-sum-exp,
weights and every gradient (the sinks' too) against the float64 reference of reference.py."""

import pytest
import torch

import fusedmha
from reference import kernel_keep_mask, reference_variants

# Tolerances (absolute, times max(1, |truth|)) of outputs and gradients per dtype: the
# variants have no PyTorch counterpart to compare errors with, so these are fixed floors.
TOL = {torch.float64: 1e-10, torch.float32: 3e-5, torch.bfloat16: 3e-2}

VARIANTS = {
    "bottom_right_causal": dict(is_causal=True, bottom_right=True),
    "top_left_causal": dict(is_causal=True),
    "window": dict(window_left=9, window_right=4, bottom_right=True),
    "window_causal": dict(window_left=13, is_causal=True, bottom_right=True),
    "window_top_left": dict(window_left=5, window_right=0),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi="heads"),
    "alibi_per_batch": dict(alibi="batch_heads", is_causal=True, bottom_right=True),
    "sinks": dict(sinks=True),
    "sinks_causal_window": dict(sinks=True, is_causal=True, bottom_right=True, window_left=7),
    "everything": dict(softcap=3.0, alibi="heads", sinks=True, is_causal=True,
                       bottom_right=True, window_left=20),
}


def make_variants(name, B, H, dtype, device):
    kw = dict(VARIANTS[name])
    alibi = kw.pop("alibi", None)
    if alibi == "heads":
        kw["alibi_slopes"] = torch.rand(H, device=device) * 0.3
    elif alibi == "batch_heads":
        kw["alibi_slopes"] = torch.rand(B, H, device=device) * 0.3
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H, dtype=dtype, device=device).requires_grad_()
    return kw


def split(kw):
    """(the op's keyword arguments, is_causal)."""
    kw = dict(kw)
    return kw, kw.pop("is_causal", False)


def check(got, want, dtype, what):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{what}: non-finite entries differ"
    scale = max(1.0, want[finite].abs().max().item() if finite.any() else 1.0)
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} > {TOL[dtype] * scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("L,S", [(37, 53), (53, 37), (64, 64)])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_float64(device, name, L, S, dtype):
    B, H, Hkv, E = 2, 4, 2, 16
    q = torch.randn(B, H, L, E, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(B, Hkv, S, E, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(B, Hkv, S, E, dtype=dtype, device=device, requires_grad=True)
    kw, is_causal = split(make_variants(name, B, H, dtype, device))
    out, lse, rng = torch.ops.fusedmha.attention_forward(q, k, v, None, 0.0, is_causal, None, True, **kw)
    ref_out, ref_lse, ref_probs = reference_variants(q, k, v, is_causal=is_causal, enable_gqa=True, **kw)
    tol_dtype = torch.float32 if dtype == torch.float64 and name.startswith("softcap") else dtype
    check(out, ref_out, tol_dtype, "output")
    check(lse, ref_lse, torch.float32 if dtype == torch.bfloat16 else tol_dtype, "logsumexp")

    grad = torch.randn_like(out)
    inputs = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(ref_out, inputs, grad.double())
    for name_, g, w in zip(["q", "k", "v", "sinks"], got, want):
        check(g, w, tol_dtype, f"grad {name_}")

    weights = torch.ops.fusedmha.attention_weights(q, k, lse, rng, None, 0.0, is_causal, None, True,
                                                   False, **kw)
    check(weights, ref_probs, tol_dtype, "weights")


@pytest.mark.parametrize("name", ["window", "everything", "sinks"])
def test_variants_with_dropout_and_masks(device, name):
    """Dropout (the kernels' own keep-mask) and a bool/float mask on top of the variants."""
    B, H, L, S, E, p = 2, 4, 45, 61, 16, 0.25
    q, k, v = (torch.randn(B, H, n, E, dtype=torch.float64, device=device, requires_grad=True)
               for n in (L, S, S))
    kw, is_causal = split(make_variants(name, B, H, torch.float64, device))
    for mask in (torch.rand(B, 1, L, S, device=device) > 0.3, torch.randn(L, S, dtype=torch.float64, device=device)):
        out, lse, rng = torch.ops.fusedmha.attention_forward(q, k, v, mask, p, is_causal, None, False, **kw)
        keep = kernel_keep_mask(rng, q, k, p)
        ref_out, ref_lse, ref_probs = reference_variants(q, k, v, mask, is_causal, keep=keep,
                                                         dropout_p=p, **kw)
        check(out, ref_out, torch.float64, "output")
        inputs = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
        grad = torch.randn_like(out)
        for g, w in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref_out, inputs, grad)):
            check(g, w, torch.float64, "gradient")
        weights = torch.ops.fusedmha.attention_weights(q, k, lse, rng, mask, p, is_causal, None, False,
                                                       True, **kw)
        check(weights, (ref_probs * keep / (1 - p)).mean(-3), torch.float64, "averaged weights")


def test_gradcheck_every_variant():
    """The op contract: gradcheck of outputs (q, k, v, sinks) and of the weights (q, k, sinks)."""
    B, H, L, S, E = 1, 2, 6, 9, 4
    q, k, v = (torch.randn(B, H, n, E, dtype=torch.float64, requires_grad=True) for n in (L, S, S))
    sinks = torch.randn(H, dtype=torch.float64, requires_grad=True)
    kw = dict(window_left=4, window_right=1, bottom_right=True, softcap=1.2,
              alibi_slopes=torch.tensor([0.3, 0.1], dtype=torch.float64))

    def out_fn(q, k, v, sinks):
        return torch.ops.fusedmha.attention_forward(q, k, v, None, 0.0, False, None, False,
                                                    sinks=sinks, **kw)[0]

    def weights_fn(q, k, sinks):
        out, lse, rng = torch.ops.fusedmha.attention_forward(q, k, k, None, 0.0, False, None,
                                                             False, sinks=sinks, **kw)
        return torch.ops.fusedmha.attention_weights(q, k, lse.detach(), rng, None, 0.0, False,
                                                    None, False, True, sinks=sinks, **kw)

    assert torch.autograd.gradcheck(out_fn, (q, k, v, sinks))

    def lse_fn(q, k, v, sinks):  # the log-sum-exp is differentiable too
        return torch.ops.fusedmha.attention_forward(q, k, v, None, 0.0, False, None, False,
                                                    sinks=sinks, **kw)[:2]

    assert torch.autograd.gradcheck(lse_fn, (q, k, v, sinks))
    assert torch.autograd.gradcheck(weights_fn, (q, k, sinks))


def test_opcheck_with_variants():
    B, H, L, S, E = 2, 2, 7, 11, 8
    q, k, v = (torch.randn(B, H, n, E, requires_grad=True) for n in (L, S, S))
    kw = dict(window_left=3, window_right=0, bottom_right=True, softcap=2.0,
              alibi_slopes=torch.rand(H), sinks=torch.randn(H, requires_grad=True))
    torch.library.opcheck(torch.ops.fusedmha.attention_forward, (q, k, v, None, 0.0, False, None, False), kw)
    with torch.no_grad():
        out, lse, rng = torch.ops.fusedmha.attention_forward(q, k, v, **kw)
    # (The backward op has no backward of its own: its inputs do not require grad.)
    q, k, v = q.detach(), k.detach(), v.detach()
    kw["sinks"] = kw["sinks"].detach()
    torch.library.opcheck(torch.ops.fusedmha.attention_backward,
                          (torch.randn_like(out), q, k, v, out, lse, rng, None, 0.0, False, None, False), kw)
    torch.library.opcheck(torch.ops.fusedmha.attention_weights, (q, k, lse, rng), kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["plain", "causal", "window"])
@pytest.mark.parametrize("E", [32, 128])
def test_mask_per_head_over_spans_of_key_blocks(device, name, dtype, E):
    """A bool mask per head whose rows the CPU kernel reads several key blocks at a time
    (read_mask_bits, on AVX-512): query blocks of 128 rows (head dims up to 64) or 512 (E=128,
    where such a block fits the CPU's L2) and a tail of 76 (with up to 4 threads; its last
    panel a strip of 12), keys in spans of 4 blocks of 64 and a last one of 188 (a block of
    60), rows a stride apart (a slice of a wider mask), and bands whose first key is not a
    span's (a window starts inside one, with blocks of 32 queries)."""
    B, H, L, S = 1, 8, 1100, 700
    q = torch.randn(B, H, L, E, dtype=dtype, device=device)
    k, v = (torch.randn(B, H, S, E, dtype=dtype, device=device) for _ in range(2))
    mask = (torch.rand(B, H, L, S + 20, device=device) > 0.3)[..., :S]
    mask[:, 1, :, 250:270] = False  # keys across a span's edge that no query of a head sees
    kw = {"plain": {}, "causal": dict(is_causal=True, bottom_right=True),
          "window": dict(window_left=300, window_right=40)}[name]
    kw, is_causal = split(kw)
    out, lse, _ = torch.ops.fusedmha.attention_forward(q, k, v, mask, 0.0, is_causal, **kw)
    ref_out, ref_lse, _ = reference_variants(q, k, v, mask, is_causal, **kw)
    check(out, ref_out, dtype, "output")
    check(lse, ref_lse, torch.float32, "logsumexp")


def test_window_equals_its_dense_mask_and_skips_blocks():
    """A sliding window gives what the equivalent bool mask gives (here and in PyTorch)."""
    B, H, L, E, left = 1, 2, 300, 32, 40
    q, k, v = (torch.randn(B, H, L, E) for _ in range(3))
    i = torch.arange(L)[:, None]
    j = torch.arange(L)
    band = (j <= i) & (j >= i - left)
    windowed = fusedmha.scaled_dot_product_attention(q, k, v, is_causal=True, window_left=left)
    torch.testing.assert_close(windowed, fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=band),
                               rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(windowed, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band),
                               rtol=2e-5, atol=2e-6)


def test_bottom_right_causal_matches_pytorch_causal_lower_right():
    from torch.nn.attention.bias import causal_lower_right

    for L, S in [(5, 12), (12, 12), (3, 40)]:
        q, k, v = torch.randn(2, 3, L, 16), torch.randn(2, 3, S, 16), torch.randn(2, 3, S, 16)
        ours = fusedmha.scaled_dot_product_attention(q, k, v, is_causal=True, bottom_right=True)
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(L, S))
        torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=2e-6)


def test_rows_that_see_no_key():
    """Bottom-right causal with L > S: the first L − S queries see no key: output 0, lse +inf
    (or, with a sink, lse = the sink)."""
    q, k, v = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    out, lse, _ = torch.ops.fusedmha.attention_forward(q, k, v, None, 0.0, True, bottom_right=True)
    assert torch.all(out[:, :, :5] == 0) and torch.all(torch.isinf(lse[:, :, :5]))
    sinks = torch.tensor([0.5, -1.0])
    out, lse, _ = torch.ops.fusedmha.attention_forward(q, k, v, None, 0.0, True, bottom_right=True,
                                                       sinks=sinks)
    assert torch.all(out[:, :, :5] == 0)
    torch.testing.assert_close(lse[0, :, :5], sinks[:, None].expand(2, 5))


@pytest.mark.parametrize("kw,match", [
    (dict(window_left=-2), "window sizes must be >= -1"),
    (dict(softcap=-1.0), "softcap must be a finite number >= 0"),
    (dict(softcap=float("inf")), "softcap must be a finite number >= 0"),
    (dict(alibi_slopes=torch.rand(3)), r"alibi_slopes of shape \(H\) or \(B, H\) with H = 4"),
    (dict(alibi_slopes=torch.rand(5, 4)), "alibi_slopes of shape"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.long)), "alibi_slopes of a floating dtype"),
    (dict(sinks=torch.rand(2, 4)), r"sinks of shape \(H\)"),
    (dict(sinks=torch.rand(2)), r"sinks of shape \(H\)"),
])
def test_bad_variants_name_the_argument(kw, match):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    with pytest.raises(RuntimeError, match=match):
        fusedmha.scaled_dot_product_attention(q, k, v, **kw)
    with pytest.raises(RuntimeError, match=match):
        fusedmha.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 **{("window_size" if n == "window_left" else n): ((val, -1) if n == "window_left" else val)
                                    for n, val in kw.items()})


def test_alibi_slopes_get_no_gradient():
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    slopes = torch.rand(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="alibi_slopes are not supported"):
        fusedmha.scaled_dot_product_attention(q, q, q, alibi_slopes=slopes)
    fusedmha.scaled_dot_product_attention(q, q, q, alibi_slopes=slopes.detach()).sum().backward()


def test_torch_compile_fullgraph_with_variants():
    q, k, v = (torch.randn(2, 33, 4, 16, requires_grad=True) for _ in range(3))
    sinks = torch.randn(4, requires_grad=True)
    kw = dict(causal=True, window_size=(8, 0), softcap=4.0, alibi_slopes=torch.rand(4), sinks=sinks)
    eager = fusedmha.flash_attn_func(q, k, v, **kw)
    compiled = torch.compile(fusedmha.flash_attn_func, fullgraph=True, backend="aot_eager")(q, k, v, **kw)
    torch.testing.assert_close(compiled, eager)
    g_eager = torch.autograd.grad(eager.sum(), (q, sinks))
    g_compiled = torch.autograd.grad(compiled.sum(), (q, sinks))
    for a, b in zip(g_compiled, g_eager):
        torch.testing.assert_close(a, b)
