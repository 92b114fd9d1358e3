"""Gradients with respect to a float attn_mask (trainable attention biases): dS = P ∘ (dP − D),
taken where the mask is added, summed inside the kernels into the mask's own shape. Checked
against the float64 reference of reference.py and PyTorch's own SDPA at the same dtype, for
every broadcast shape of the mask (expanded views too), with the variants, dropout, GQA and
packed decode heads; the op contract (gradcheck, opcheck), torch.compile, torch.export,
autocast and MultiheadAttention."""

import pytest
import torch
import torch.nn.functional as F

import fusedmha
from reference import (assert_close_to_truth, grad_tolerance, kernel_keep_mask, leaves,
                       reference_variants)

B, H, E = 2, 4, 16

# Mask shapes as the kernels see them (..., L, S): each broadcast pattern of (B, H, L, S).
SHAPES = {
    "LS": lambda L, S: (L, S),
    "HLS": lambda L, S: (H, L, S),
    "B1LS": lambda L, S: (B, 1, L, S),
    "BHLS": lambda L, S: (B, H, L, S),
    "1H1S": lambda L, S: (1, H, 1, S),
    "B11S": lambda L, S: (B, 1, 1, S),
    "S": lambda L, S: (S,),
    "L1": lambda L, S: (L, 1),
}


def qkv(L, S, dtype, device, heads_kv=H):
    return [torch.randn(B, h, n, E, dtype=dtype, device=device, requires_grad=True)
            for h, n in ((H, L), (heads_kv, S), (heads_kv, S))]


def mask_leaf(shape, dtype, device, expand=False):
    """A float mask that requires grad, and what the call is given (its expanded view)."""
    leaf = (torch.randn(shape, device=device) * 0.7).to(dtype).requires_grad_()
    return leaf, (leaf.expand(B, H, *leaf.shape[-2:]) if expand else leaf)


def check_against_truth(got, want, torch_got, dtype, what):
    factor, floor = grad_tolerance(dtype, got.device)
    assert got.shape == want.shape and got.dtype == dtype, (what, got.shape, got.dtype)
    assert_close_to_truth(got, want, torch_got, dtype=dtype, factor=factor, floor=floor, what=what)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("expand", [False, True], ids=["view", "expanded"])
@pytest.mark.parametrize("L,S", [(37, 53), (1, 70)])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_mask_gradient_matches_pytorch(device, shape, L, S, expand, dtype):
    """q, k, v and the mask's gradients through the SDPA drop-in, against float64 and PyTorch;
    an expanded mask's gradient sums over what it was expanded along, as PyTorch's does."""
    if expand and len(SHAPES[shape](L, S)) < 2:
        pytest.skip("a 1-D mask is not expanded to 4-D here")
    q, k, v = qkv(L, S, dtype, device)
    leaf, mask = mask_leaf(SHAPES[shape](L, S), dtype, device, expand)
    out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, leaf), grad)

    inputs64 = leaves(q, k, v, leaf, dtype=torch.float64)
    mask64 = inputs64[3].expand(B, H, L, S) if expand else inputs64[3]
    ref = reference_variants(*inputs64[:3], mask64)[0]
    want = torch.autograd.grad(ref, inputs64, grad.double())
    inputs_t = leaves(q, k, v, leaf)
    mask_t = inputs_t[3].expand(B, H, L, S) if expand or mask.dim() < 2 else inputs_t[3]
    theirs = F.scaled_dot_product_attention(*inputs_t[:3], attn_mask=mask_t)
    torch_got = torch.autograd.grad(theirs, inputs_t, grad)
    for name, g, w, t in zip("qkvm", got, want, torch_got):
        check_against_truth(g, w, t, dtype, f"grad {name}")


@pytest.mark.parametrize("shape", ["HLS", "B1LS", "1H1S"])
@pytest.mark.parametrize("L", [1, 29])
def test_grouped_heads(device, shape, L):
    """GQA, and one query row per head (decoding: the kernels read a K/V head's query heads
    as rows of one tile, the mask's per-head rows with them)."""
    S, dtype = 45, torch.float64
    q, k, v = qkv(L, S, dtype, device, heads_kv=2)
    leaf, mask = mask_leaf(SHAPES[shape](L, S), dtype, device)
    out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ref = reference_variants(q, k, v, mask, enable_gqa=True)[0]
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, leaf), grad)
    want = torch.autograd.grad(ref, (q, k, v, leaf), grad)
    for name, g, w in zip("qkvm", got, want):
        check_against_truth(g, w, None, dtype, f"grad {name}")


VARIANTS = {
    "causal": dict(is_causal=True),
    "bottom_right_window": dict(window_left=6, window_right=3, bottom_right=True),
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi_slopes=True),
    "sinks": dict(sinks=True),
    "everything": dict(softcap=3.0, alibi_slopes=True, sinks=True, is_causal=True,
                       bottom_right=True, window_left=12),
}


def variant_kwargs(name, device):
    kw = dict(VARIANTS[name])
    if kw.pop("alibi_slopes", False):
        kw["alibi_slopes"] = torch.rand(H, device=device) * 0.3
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H, dtype=torch.float64, device=device, requires_grad=True)
    return kw, kw.pop("is_causal", False)


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("shape", ["HLS", "B11S", "L1"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_with_variants_and_dropout(device, name, shape, p):
    """The mask's gradient after softcap and ALiBi (where the mask is added), inside causal
    and window bands, with sinks, and with dropout (the kernels' own keep-mask replayed)."""
    L, S, dtype = 33, 47, torch.float64
    q, k, v = qkv(L, S, dtype, device)
    leaf, mask = mask_leaf(SHAPES[shape](L, S), dtype, device)
    kw, causal = variant_kwargs(name, device)
    out, lse, rng = torch.ops.fusedmha.attention_forward(q, k, v, mask, p, causal, None, False, **kw)
    keep = kernel_keep_mask(rng, q, k, p) if p > 0 else None
    ref = reference_variants(q, k, v, mask, causal, keep=keep, dropout_p=p, **kw)[0]
    inputs = [q, k, v, leaf] + ([kw["sinks"]] if "sinks" in kw else [])
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(ref, inputs, grad)
    for name_, g, w in zip(["q", "k", "v", "mask", "sinks"], got, want):
        check_against_truth(g, w, None, dtype, f"grad {name_}")


def test_key_padding_in_a_float_mask(device):
    """A float mask of 0 and -inf per key (read as key spans, blocks past a row's last key
    skipped) plus a learnt bias: no gradient where a key is hidden, PyTorch's elsewhere."""
    L, S, dtype = 40, 90, torch.float64
    q, k, v = qkv(L, S, dtype, device)
    padding = torch.zeros(B, 1, 1, S, dtype=dtype, device=device)
    padding[0, ..., 50:] = float("-inf")
    for leaf in (padding.clone().requires_grad_(), torch.zeros(H, L, S, dtype=dtype, device=device,
                                                            requires_grad=True)):
        mask = leaf + padding if leaf.dim() == 3 else leaf
        out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        ref = reference_variants(q, k, v, mask)[0]
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, leaf, grad)[0]
        want = torch.autograd.grad(ref, leaf, grad)[0]
        check_against_truth(got, want, None, dtype, "grad mask")
        hidden = got[0, ..., 50:] if leaf.dim() == 4 else got[..., 50:]
        assert hidden.abs().max() == 0 or leaf.dim() == 3


def test_backward_op_returns_the_mask_gradient_when_asked():
    L, S = 9, 13
    q, k, v = (t.detach() for t in qkv(L, S, torch.float32, "cpu"))
    mask = torch.randn(H, 1, S).expand(H, L, S)
    out, lse, rng = torch.ops.fusedmha.attention_forward(q, k, v, mask)
    args = (torch.randn_like(out), q, k, v, out, lse, rng, mask, 0.0, False, None, False)
    *_, none = torch.ops.fusedmha.attention_backward(*args)
    assert none.numel() == 0
    *_, dmask = torch.ops.fusedmha.attention_backward(*args, grad_attn_mask=True)
    assert dmask.shape == mask.shape and dmask.dtype == mask.dtype
    torch.library.opcheck(torch.ops.fusedmha.attention_backward.default, args,
                          dict(grad_attn_mask=True))
    bool_args = args[:7] + (mask > 0,) + args[8:]
    with pytest.raises(RuntimeError, match=r"^fusedmha\.attention_backward: grad_attn_mask=True "
                                           r"needs a float attn_mask, got a bool one"):
        torch.ops.fusedmha.attention_backward(*bool_args, grad_attn_mask=True)
    no_mask = args[:7] + (None,) + args[8:]
    with pytest.raises(RuntimeError, match=r"needs a float attn_mask, got none"):
        torch.ops.fusedmha.attention_backward(*no_mask, grad_attn_mask=True)


def test_gradcheck_output_and_weights():
    """The op contract: gradcheck of the output, log-sum-exp and weights with respect to a
    broadcast mask (besides q, k, v), with softcap and ALiBi."""
    L, S = 5, 7
    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64, requires_grad=True) for n in (L, S, S))
    kw = dict(softcap=1.5, alibi_slopes=torch.tensor([0.2, 0.1]))
    for shape in [(L, S), (2, 1, S), (1, 1, L, 1)]:
        mask = torch.randn(shape, dtype=torch.float64, requires_grad=True)

        def out_fn(q, k, v, mask):
            return torch.ops.fusedmha.attention_forward(q, k, v, mask, 0.0, False, None, False,
                                                        **kw)[:2]

        def weights_fn(q, k, mask):
            _, lse, rng = torch.ops.fusedmha.attention_forward(q, k, k, mask, 0.0, False, None,
                                                               False, **kw)
            return torch.ops.fusedmha.attention_weights(q, k, lse.detach(), rng, mask, 0.0, False,
                                                        None, False, False, **kw)

        assert torch.autograd.gradcheck(out_fn, (q, k, v, mask))
        assert torch.autograd.gradcheck(weights_fn, (q, k, mask))
    torch.library.opcheck(torch.ops.fusedmha.attention_forward.default,
                          (q, k, v, mask, 0.0, False, None, False), kw)


@pytest.mark.parametrize("threads", [1, 2])
def test_bitwise_reproducible(threads):
    """Each element of the mask's gradient has one writer and one order of summation: the
    same call gives the same bits at a given thread count."""
    L, S = 300, 260
    q, k, v = qkv(L, S, torch.float32, "cpu")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = []
        for _ in range(2):
            torch.manual_seed(1)  # (the same dropout draws each time)
            for shape in ("HLS", "1H1S", "L1"):
                leaf, mask = mask_leaf(SHAPES[shape](L, S), torch.float32, "cpu")
                leaf.data = torch.linspace(-1, 1, leaf.numel()).view(leaf.shape)
                out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)
                runs.append(torch.autograd.grad(out.sum(), leaf)[0])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(runs[:3], runs[3:]):
        assert torch.equal(a, b)


def test_compile_fullgraph_and_export():
    """A learnt bias as a parameter: torch.compile(fullgraph=True) trains it as eager does;
    torch.export captures the module and its program gives the same output and gradient."""
    torch._dynamo.reset()

    class Biased(torch.nn.Module):
        def __init__(self, L, S):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.randn(H, L, S) * 0.2)

        def forward(self, q, k, v):
            return fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=self.bias,
                                                         is_causal=False, dropout_p=0.0)

    L, S = 21, 34
    model = Biased(L, S)
    q, k, v = (t.detach() for t in qkv(L, S, torch.float32, "cpu"))
    compiled = torch.compile(model, fullgraph=True)
    (want,) = torch.autograd.grad(model(q, k, v).square().sum(), model.bias)
    (got,) = torch.autograd.grad(compiled(q, k, v).square().sum(), model.bias)
    torch.testing.assert_close(got, want)
    program = torch.export.export(model, (q, k, v))
    exported = program.module()
    out = exported(q, k, v)
    torch.testing.assert_close(out, model(q, k, v))
    (got,) = torch.autograd.grad(out.square().sum(), exported.bias)
    torch.testing.assert_close(got, want)


def test_autocast_bias_keeps_its_dtype():
    """Under CPU autocast to bfloat16 a float32 bias gets a float32 gradient, close to
    PyTorch's under the same autocast."""
    L, S = 24, 40
    q, k, v = (t.detach() for t in qkv(L, S, torch.float32, "cpu"))
    grads = []
    for f in (fusedmha.scaled_dot_product_attention, F.scaled_dot_product_attention):
        bias = torch.linspace(-1, 1, H * L * S).view(H, L, S).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = f(q, k, v, attn_mask=bias)
        grads.append(torch.autograd.grad(out.float().sum(), bias)[0])
    assert grads[0].dtype == torch.float32
    torch.testing.assert_close(grads[0], grads[1], atol=3e-2, rtol=0)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask_dims", [2, 3])
def test_multihead_attention_mask_and_padding(need_weights, mask_dims):
    """MultiheadAttention with a learnt float attn_mask (2-D, or 3-D per batch·head) and a float
    key_padding_mask, both requiring grad (merged into one mask): PyTorch's module's gradients
    for both masks and the parameters."""
    N, L, S, D, heads = 2, 6, 9, 16, 4
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(D, heads, batch_first=True, dtype=torch.float64)
    mod = fusedmha.MultiheadAttention(D, heads, batch_first=True, dtype=torch.float64)
    mod.load_state_dict(ref.state_dict())
    x, kv = torch.randn(N, L, D, dtype=torch.float64), torch.randn(N, S, D, dtype=torch.float64)
    am = torch.randn((L, S) if mask_dims == 2 else (N * heads, L, S), dtype=torch.float64)
    kpm = torch.zeros(N, S, dtype=torch.float64)
    kpm[1, 6:] = float("-inf")
    results = []
    for m in (mod, ref):
        a, p = am.clone().requires_grad_(), kpm.clone().requires_grad_()
        out, w = m(x, kv, kv, attn_mask=a, key_padding_mask=p, need_weights=need_weights)
        loss = out.square().sum() + (w.sum() if need_weights else 0)
        results.append(torch.autograd.grad(loss, [a, p, *m.parameters()]))
    for name, g, w in zip(["attn_mask", "key_padding_mask", "in_proj_weight"], *results):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=lambda s: f"{name}: {s}")


@pytest.mark.parametrize("level", ["default", "avx2", "avx512"])
def test_every_isa_level(level, monkeypatch):
    """The mask's gradient at each compiled ISA level the CPU runs (FUSEDMHA_CPU_ISA), in
    float64, float32 and bfloat16, against the float64 truth and PyTorch's error."""
    from test_isa_levels import NEEDS, cpu_flags
    if level not in fusedmha.build_info()["cpu_isas"] or not NEEDS[level] <= cpu_flags():
        pytest.skip(f"{level} is not runnable here")
    monkeypatch.setenv("FUSEDMHA_CPU_ISA", level)
    L, S = 45, 70
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for shape in ("HLS", "1H1S"):
            q, k, v = qkv(L, S, dtype, "cpu")
            leaf, _ = mask_leaf(SHAPES[shape](L, S), dtype, "cpu")
            grad = torch.randn(B, H, L, E, dtype=dtype)
            (got,) = torch.autograd.grad(
                fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=leaf), leaf, grad)
            m64 = leaf.detach().double().requires_grad_()
            (want,) = torch.autograd.grad(reference_variants(q, k, v, m64)[0], m64, grad.double())
            mt = leaf.detach().clone().requires_grad_()
            (theirs,) = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mt),
                                            mt, grad)
            check_against_truth(got, want, theirs, dtype, f"{level} {dtype} {shape}")
