"""fusedmha.flash_attn_func and its packed forms keep flash_attn 2's Python API: names,
positional order, defaults, the (batch, seqlen, nheads, headdim) layout and return values;
results against the float64 reference."""

import pytest
import torch

import fusedmha
from reference import kernel_keep_mask, reference_variants
from signatures import signature_text

# flash_attn 2.x's signatures (flash_attn/flash_attn_interface.py), with fusedmha's one
# addition, the keyword-only `sinks`.
COMMON = ("dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
          "alibi_slopes=None, deterministic=False, return_attn_probs=False, *, sinks=None")
SIGNATURES = {
    "flash_attn_func": "(q, k, v, " + COMMON + ")",
    "flash_attn_qkvpacked_func": "(qkv, " + COMMON + ")",
    "flash_attn_kvpacked_func": "(q, kv, " + COMMON + ")",
}


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_signature_is_flash_attn_2s(name):
    assert signature_text(getattr(fusedmha, name)) == SIGNATURES[name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kw", [
    dict(),
    dict(causal=True),
    dict(causal=True, window_size=(6, 0)),
    dict(window_size=(5, 3), softcap=2.5),
    dict(causal=True, alibi="heads", sinks=True, softmax_scale=0.3),
])
def test_flash_attn_func_matches_float64(device, dtype, kw):
    B, L, S, H, Hkv, E = 2, 29, 41, 4, 2, 16
    q = torch.randn(B, L, H, E, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(B, S, Hkv, E, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(B, S, Hkv, E, dtype=dtype, device=device, requires_grad=True)
    kw = dict(kw)
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = torch.rand(H, device=device) * 0.2
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H, dtype=dtype, device=device, requires_grad=True)
    out = fusedmha.flash_attn_func(q, k, v, **kw)
    assert out.shape == (B, L, H, E) and out.is_contiguous()
    window = kw.get("window_size", (-1, -1))
    ref, _, _ = reference_variants(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   is_causal=kw.get("causal", False), scale=kw.get("softmax_scale"),
                                   enable_gqa=True, window_left=window[0], window_right=window[1],
                                   bottom_right=True, softcap=kw.get("softcap", 0.0),
                                   alibi_slopes=kw.get("alibi_slopes"), sinks=kw.get("sinks"))
    ref = ref.transpose(1, 2)
    tol = 3e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    inputs = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad.double())):
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


def test_return_attn_probs(device):
    B, L, S, H, E, p = 2, 17, 23, 2, 8, 0.3
    q, k, v = (torch.randn(B, n, H, E, device=device, dtype=torch.float64) for n in (L, S, S))
    torch.manual_seed(5)
    out, lse, probs = fusedmha.flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    assert lse.shape == (B, H, L) and probs.shape == (B, H, L, S)
    assert lse.dtype == torch.float64 or lse.dtype == torch.float32
    _, ref_lse, ref_probs = reference_variants(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, bottom_right=True)
    torch.testing.assert_close(lse.double(), ref_lse)
    # flash_attn's testing aid: |probs| are the probabilities, negative where dropped.
    torch.testing.assert_close(probs.abs(), ref_probs)
    torch.manual_seed(5)
    _, _, rng = torch.ops.fusedmha.attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     None, p, True, bottom_right=True)
    keep = kernel_keep_mask(rng, q.transpose(1, 2), k.transpose(1, 2), p)
    dropped = (~keep) & (ref_probs > 0)
    assert dropped.any()
    assert torch.all(probs[dropped] < 0) and torch.all(probs[~dropped] >= 0)


def test_packed_forms_equal_the_unpacked(device):
    B, L, H, E = 2, 19, 4, 16
    qkv = torch.randn(B, L, 3, H, E, device=device, requires_grad=True)
    kw = dict(causal=True, window_size=(7, 0), softcap=3.0)
    packed = fusedmha.flash_attn_qkvpacked_func(qkv, **kw)
    q, k, v = qkv.unbind(2)
    torch.testing.assert_close(packed, fusedmha.flash_attn_func(q, k, v, **kw))
    kv = torch.randn(B, 31, 2, 2, E, device=device, requires_grad=True)
    kvp = fusedmha.flash_attn_kvpacked_func(q, kv, **kw)
    torch.testing.assert_close(kvp, fusedmha.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], **kw))
    packed.sum().backward()
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape


def test_deterministic_flag_is_accepted_and_backward_is_reproducible():
    q, k, v = (torch.randn(1, 64, 2, 32, requires_grad=True) for _ in range(3))
    grads = []
    for _ in range(2):
        out = fusedmha.flash_attn_func(q, k, v, causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out.sum(), (q, k, v)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("call, message", [
    (lambda: fusedmha.flash_attn_func(torch.randn(9, 16), torch.randn(1, 16), torch.randn(1, 16)),
     r"flash_attn_func: expected q with 4 dims \(batch, seqlen, nheads, headdim\), got shape \(9, 16\)"),
    (lambda: fusedmha.flash_attn_func(torch.randn(1, 9, 2, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)),
     "flash_attn_func: expected k with 4 dims"),
    (lambda: fusedmha.flash_attn_qkvpacked_func(torch.randn(1, 9, 3, 16)),
     "flash_attn_qkvpacked_func: expected qkv with 5 dims"),
    (lambda: fusedmha.flash_attn_kvpacked_func(torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16)),
     "flash_attn_kvpacked_func: expected kv with 5 dims"),
])
def test_tensors_of_the_wrong_rank_get_a_clear_error(call, message):
    with pytest.raises(ValueError, match="fusedmha." + message):
        call()
