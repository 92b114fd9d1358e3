"""fusedmha.MultiheadAttention's masks against nn.MultiheadAttention: is_causal (with and
without a mask, with extra keys), expanded, mixed and grad-requiring masks, sizes at the
edges, and the deliberate difference: query rows whose keys are all masked give 0, never
NaN (checked against the float64 reference, and against PyTorch everywhere else)."""

import warnings

import pytest
import torch
from torch import nn

from mha_inputs import NEG_INF, bool_mask, causal_bool, float_mask, make_inputs, make_pair
from reference import check, compare_runs, compare_with_reference, leaves

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------
# is_causal: the causal mask over the real keys, with or without the mask given
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("extra", ["bias_kv", "zero_attn", "both"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_is_causal_with_extra_keys(need_weights, extra, with_mask):
    """is_causal means the (L, S) causal mask over the real keys; the appended bias_k/zero key
    stays visible, as PyTorch does when it is given that mask explicitly (PyTorch's
    need_weights=False path would apply SDPA's is_causal to the padded keys instead, which
    differs from its own need_weights=True path; the explicit mask is the defined meaning)."""
    E, H, L, S, N = 16, 2, 6, 6, 2
    ref, mod = make_pair(E, H, add_bias_kv=extra != "zero_attn", add_zero_attn=extra != "bias_kv")
    x = make_inputs(N, L, S, E, E, E, torch.float32, True, False)
    f_kw = dict(is_causal=True, need_weights=need_weights)
    if with_mask:
        f_kw["attn_mask"] = causal_bool(L, S)
    r_kw = dict(attn_mask=causal_bool(L, S), need_weights=need_weights)
    compare_runs(mod, ref, leaves(*x), leaves(*x), f_kw, r_kw, torch.float32)


@pytest.mark.parametrize("L,S", [(6, 6), (4, 9), (9, 4), (1, 5)])
@pytest.mark.parametrize("need_weights", [False, True])
def test_is_causal_without_mask_is_top_left_causal(L, S, need_weights):
    ref, mod = make_pair(16, 4, batch_first=True)
    x = make_inputs(2, L, S, 16, 16, 16, torch.float32, True, True)
    compare_runs(mod, ref, leaves(*x), leaves(*x), dict(is_causal=True, need_weights=need_weights),
                 dict(attn_mask=causal_bool(L, S), need_weights=need_weights), torch.float32)


def test_is_causal_hint_matches_pytorch_hint():
    """With the causal mask given, PyTorch itself honours the hint (SDPA is_causal path)."""
    ref, mod = make_pair(16, 4)
    x = make_inputs(3, 7, 7, 16, 16, 16, torch.float32, True, False)
    for need_weights in (False, True):
        kw = dict(attn_mask=nn.Transformer.generate_square_subsequent_mask(7), is_causal=True,
                  need_weights=need_weights)
        compare_runs(mod, ref, leaves(*x), leaves(*x), kw, dict(kw), torch.float32)


# --------------------------------------------------------------------------------------
# masks of other layouts and types
# --------------------------------------------------------------------------------------


def test_expanded_masks():
    ref, mod = make_pair(16, 4)
    x = make_inputs(3, 5, 7, 16, 16, 16, torch.float32, True, False)
    am = bool_mask((1, 7)).expand(5, 7)
    am3 = float_mask((1, 5, 7), torch.float32).expand(12, 5, 7)
    for kw in (dict(attn_mask=am), dict(attn_mask=am3)):
        compare_runs(mod, ref, leaves(*x), leaves(*x), kw, dict(kw), torch.float32)




@pytest.mark.parametrize("name", ["attn_mask", "key_padding_mask"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_float_mask_requiring_grad(name, need_weights):
    """A float mask that requires grad gets PyTorch's gradient (a learnt bias), with the
    weights or without; under torch.no_grad the same mask is only read."""
    ref, mod = make_pair(16, 4)
    x = make_inputs(2, 5, 6, 16, 16, 16, torch.float32, True, False)
    mask = torch.randn((5, 6) if name == "attn_mask" else (2, 6), requires_grad=True)
    kw = {name: mask, "need_weights": need_weights}
    with torch.no_grad():
        out_f, w_f = mod(*x, **kw)
        out_r, w_r = ref(*x, **kw)
    check("no_grad output", out_f, out_r)
    if need_weights:
        check("no_grad weights", w_f, w_r)
    m_f = mask.detach().clone().requires_grad_()
    out_f, _ = mod(*x, **{name: m_f, "need_weights": need_weights})
    out_r, _ = ref(*x, **kw)
    go = torch.randn_like(out_r)
    (g_f,) = torch.autograd.grad((out_f * go).sum(), [m_f])
    (g_r,) = torch.autograd.grad((out_r * go).sum(), [mask])
    check("mask grad", g_f, g_r)


def test_mixed_mask_types_like_pytorch():
    """bool key_padding_mask with a float attn_mask: PyTorch warns (deprecated) but accepts."""
    ref, mod = make_pair(16, 4)
    x = make_inputs(2, 5, 6, 16, 16, 16, torch.float32, True, False)
    kw = dict(key_padding_mask=bool_mask((2, 6)), attn_mask=float_mask((5, 6), torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compare_runs(mod, ref, leaves(*x), leaves(*x), kw, dict(kw), torch.float32)


# --------------------------------------------------------------------------------------
# deliberate difference: fully masked query rows give 0, never NaN
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["kpm_bool", "kpm_float", "am2_bool", "am2_float", "am3_bool", "causal_kpm"])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_fully_masked_rows_give_zero(kind, need_weights, bias):
    E, H, L, S, N = 16, 4, 5, 6, 2
    torch.manual_seed(1)
    ref, mod = make_pair(E, H, bias=bias)
    kw = dict(need_weights=need_weights, average_attn_weights=False)
    dead_rows = torch.zeros(N, L, dtype=torch.bool)  # (batch, query) that attend to nothing
    if kind in ("kpm_bool", "kpm_float"):
        kpm = bool_mask((N, S))
        kpm[1] = True  # batch 1: every key padded
        kw["key_padding_mask"] = kpm if kind == "kpm_bool" else torch.zeros(N, S).masked_fill(kpm, NEG_INF)
        dead_rows[1] = True
    elif kind in ("am2_bool", "am2_float"):
        am = bool_mask((L, S))
        am[2] = True  # query 2 sees nothing
        kw["attn_mask"] = am if kind == "am2_bool" else torch.zeros(L, S).masked_fill(am, NEG_INF)
        dead_rows[:, 2] = True
    elif kind == "am3_bool":
        am = bool_mask((N * H, L, S))
        am[H + 1, 3] = True  # batch 1, head 1, query 3 only
        kw["attn_mask"] = am
    else:  # is_causal and key 0 padded: query 0 of batch 0 sees nothing
        kpm = bool_mask((N, S))
        kpm[0, 0] = True
        kw.update(is_causal=True, key_padding_mask=kpm)
        dead_rows[0, 0] = True
    x = make_inputs(N, L, S, E, E, E, torch.float32, True, False)
    out, w = compare_with_reference(mod, x, kw, name=kind)
    b = mod.out_proj.bias if bias else torch.zeros(E)
    dead = out.detach().transpose(0, 1)[dead_rows]  # (rows, E)
    torch.testing.assert_close(dead, b.detach().expand_as(dead))  # attention 0, then the projection
    if need_weights:
        assert not w[dead_rows.unsqueeze(1).expand(N, H, L)].any()
        if kind == "am3_bool":
            assert not w[1, 1, 3].any()
    # everywhere else it is PyTorch's answer (PyTorch gives NaN in the dead rows)
    r_kw = {k: v for k, v in kw.items() if k != "is_causal"}
    if kind == "causal_kpm":
        r_kw["attn_mask"] = causal_bool(L, S)
    with torch.no_grad():
        out_r, _ = ref(*x, **r_kw)
    if kind != "am3_bool":
        live = ~dead_rows.transpose(0, 1)
        torch.testing.assert_close(out.detach()[live], out_r[live], rtol=1e-4, atol=2e-5)


def test_all_real_keys_masked_with_extra_keys_matches_pytorch():
    """With add_bias_kv / add_zero_attn a row always has a visible key: PyTorch is finite there."""
    for extra in (dict(add_bias_kv=True), dict(add_zero_attn=True)):
        ref, mod = make_pair(16, 4, **extra)
        x = make_inputs(2, 4, 5, 16, 16, 16, torch.float32, True, False)
        kpm = torch.zeros(2, 5, dtype=torch.bool)
        kpm[1] = True
        for need_weights in (False, True):
            kw = dict(key_padding_mask=kpm, need_weights=need_weights)
            compare_runs(mod, ref, leaves(*x), leaves(*x), kw, dict(kw), torch.float32, name=str(extra))




# --------------------------------------------------------------------------------------
# sizes at the edges
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("N,L,S", [(0, 4, 5), (2, 0, 5), (2, 4, 1), (1, 1, 1), (2, 4, 0)])
def test_edge_sizes(N, L, S, need_weights):
    ref, mod = make_pair(16, 4)
    x = make_inputs(N, L, S, 16, 16, 16, torch.float32, True, False)
    kw = dict(need_weights=need_weights)
    if S == 0:  # no key at all: PyTorch's answer is its bias (sum over nothing), ours the same
        out_f, w_f = mod(*x, **kw)
        out_r, w_r = ref(*x, **kw)
        assert out_f.shape == out_r.shape
        assert torch.isfinite(out_f).all()
        torch.testing.assert_close(out_f, mod.out_proj.bias.detach().expand_as(out_f))
        if need_weights:
            assert w_f.shape == w_r.shape
        return
    compare_runs(mod, ref, leaves(*x), leaves(*x), kw, dict(kw), torch.float32)
