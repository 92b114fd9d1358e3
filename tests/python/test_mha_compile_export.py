"""fusedmha.MultiheadAttention beyond eager calls: torch.compile, torch.export, torch.jit.script,
copies (deepcopy, pickle, torch.save), dtype moves, autocast, meta-device construction, and
every intra-op thread."""

import copy
import io
import pickle
import warnings

import pytest
import torch
from torch import nn

from mha_inputs import BF16, bool_mask, causal_bool, float_mask, fused_mha, make_inputs, make_pair, randomize_biases
from reference import check, compare_runs, leaves, loss_of, scale_of

pytestmark = pytest.mark.usefixtures("one_thread")


COMPILE_CASES = {
    "plain": (dict(), dict()),
    "masks_weights": (dict(add_bias_kv=True, kdim=8, vdim=12),
                      dict(average_attn_weights=False)),
    "causal_no_mask": (dict(batch_first=True), dict(is_causal=True, need_weights=False)),
    "causal_kpm_weights": (dict(bias=False), dict(is_causal=True)),
}


def compile_inputs(cfg, kw_base):
    N, L, S = 2, 5, 6
    x = make_inputs(N, L, S, 16, cfg.get("kdim", 16), cfg.get("vdim", 16), torch.float32, True,
                    cfg.get("batch_first", False))
    kw = dict(kw_base)
    if "is_causal" in kw:
        L = S = 5
        x = make_inputs(N, L, S, 16, 16, 16, torch.float32, True, cfg.get("batch_first", False))
        if kw.get("need_weights", True):
            kw["key_padding_mask"] = bool_mask((N, S))
    else:
        kw["key_padding_mask"] = bool_mask((N, S))
        kw["attn_mask"] = bool_mask((L, S))
    return x, kw


@pytest.mark.parametrize("backend,case", [("eager", "plain"), ("eager", "causal_no_mask"),
                                          ("aot_eager", "masks_weights"), ("aot_eager", "causal_kpm_weights")])
def test_torch_compile_fullgraph(backend, case):
    torch._dynamo.reset()
    cfg, kw_base = COMPILE_CASES[case]
    torch.manual_seed(0)
    mod = fused_mha(16, 4, **cfg)
    randomize_biases(mod)
    x, kw = compile_inputs(cfg, kw_base)
    compiled = torch.compile(mod, backend=backend, fullgraph=True)
    e_in, c_in = leaves(*x), leaves(*x)
    out_e, w_e = mod(*e_in, **kw)
    out_c, w_c = compiled(*c_in, **kw)
    check("compiled output", out_c, out_e)
    if w_e is not None:
        check("compiled weights", w_c, w_e)
    go = torch.randn_like(out_e)
    gw = None if w_e is None else torch.randn_like(w_e)
    g_e = torch.autograd.grad(loss_of(out_e, w_e, go, gw), e_in + list(mod.parameters()))
    g_c = torch.autograd.grad(loss_of(out_c, w_c, go, gw), c_in + list(mod.parameters()))
    for i, (a, b) in enumerate(zip(g_c, g_e)):
        check(f"compiled grad {i}", a, b)
    # and PyTorch's module agrees with both
    ref = nn.MultiheadAttention(16, 4, **cfg)
    ref.load_state_dict(mod.state_dict())
    r_kw = dict(kw)
    if r_kw.pop("is_causal", False):
        r_kw["attn_mask"] = causal_bool(5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out_r, _ = ref(*x, **r_kw)
    check("pytorch output", out_c.detach(), out_r.detach())


def test_torch_compile_inductor():
    torch._dynamo.reset()
    ref, mod = make_pair(16, 4, batch_first=True)
    mod.eval()
    x = make_inputs(2, 5, 6, 16, 16, 16, torch.float32, True, True)
    kw = dict(key_padding_mask=bool_mask((2, 6)))
    compiled = torch.compile(mod, backend="inductor", fullgraph=True)
    with torch.no_grad():
        out_c, w_c = compiled(*x, **kw)
        out_r, w_r = ref(*x, **kw)
    check("inductor output", out_c, out_r)
    check("inductor weights", w_c, w_r)


@pytest.mark.parametrize("kw", [dict(), dict(need_weights=False, is_causal=True),
                                dict(average_attn_weights=False, attn_mask="bool")], ids=["default", "causal", "mask"])
def test_torch_export(kw):
    kw = dict(kw)
    ref, mod = make_pair(16, 4, kdim=8)
    x = make_inputs(2, 5, 5, 16, 8, 16, torch.float32, True, False)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = bool_mask((5, 5))
    ep = torch.export.export(mod, x, kwargs=kw)
    assert "fusedmha" in str(ep.graph), "the exported graph should call the fused op"
    out_e, w_e = ep.module()(*x, **kw)
    out_m, w_m = mod(*x, **kw)
    check("exported output", out_e.detach(), out_m.detach())
    if w_m is not None:
        check("exported weights", w_e.detach(), w_m.detach())
    else:
        assert w_e is None


def test_deepcopy():
    ref, mod = make_pair(16, 4, add_bias_kv=True, kdim=8)
    clone = copy.deepcopy(mod)
    x = make_inputs(2, 5, 6, 16, 8, 16, torch.float32, True, False)
    compare_runs(clone, ref, leaves(*x), leaves(*x), {}, {}, torch.float32)
    with torch.no_grad():
        clone.k_proj_weight.add_(1.0)
    assert not torch.equal(clone.k_proj_weight, mod.k_proj_weight)
    compare_runs(mod, ref, leaves(*x), leaves(*x), {}, {}, torch.float32)


def test_pickle_and_torch_save_round_trip():
    ref, mod = make_pair(16, 4, add_zero_attn=True, batch_first=True, dropout=0.2)
    mod.eval()
    ref.eval()
    x = make_inputs(2, 5, 6, 16, 16, 16, torch.float32, True, True)
    back = pickle.loads(pickle.dumps(mod))
    assert type(back) is type(mod) and back.dropout == 0.2 and back.batch_first
    compare_runs(back, ref, leaves(*x), leaves(*x), {}, {}, torch.float32)
    buf = io.BytesIO()
    torch.save(mod, buf)
    buf.seek(0)
    back2 = torch.load(buf, weights_only=False)
    compare_runs(back2, ref, leaves(*x), leaves(*x), {}, {}, torch.float32)
    buf = io.BytesIO()
    torch.save(mod.state_dict(), buf)
    buf.seek(0)
    fresh = fused_mha(16, 4, add_zero_attn=True, batch_first=True).eval()
    fresh.load_state_dict(torch.load(buf))
    compare_runs(fresh, ref, leaves(*x), leaves(*x), {}, {}, torch.float32)


@pytest.mark.parametrize("how", ["to", "double"])
def test_to_float64(how):
    ref, mod = make_pair(16, 4, add_bias_kv=True, kdim=8, vdim=12)
    mod = mod.to(torch.float64) if how == "to" else mod.double()
    ref = ref.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in mod.parameters())
    x = make_inputs(2, 5, 6, 16, 8, 12, torch.float64, True, False)
    kw = dict(key_padding_mask=float_mask((2, 6), torch.float64), average_attn_weights=False)
    compare_runs(mod, ref, leaves(*x), leaves(*x), kw, dict(kw), torch.float64)


def test_to_bfloat16_and_half():
    ref, mod = make_pair(16, 4)
    x = make_inputs(2, 5, 6, 16, 16, 16, torch.float32, True, False)
    ref16, mod16 = copy.deepcopy(ref).half(), copy.deepcopy(mod).half()
    compare_runs(mod.to(BF16), ref.to(BF16), leaves(*(t.to(BF16) for t in x)), leaves(*(t.to(BF16) for t in x)),
                 {}, {}, BF16)
    with torch.no_grad():
        out_f, w_f = mod16(*(t.half() for t in x))
        out_r, w_r = ref16(*(t.half() for t in x))
    assert out_f.dtype == torch.float16 and w_f.dtype == w_r.dtype
    torch.testing.assert_close(out_f, out_r, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w_f, w_r, rtol=2e-2, atol=5e-3)


@pytest.mark.parametrize("need_weights", [False, True])
def test_autocast_bfloat16(need_weights):
    ref, mod = make_pair(16, 4, kdim=8)
    x = make_inputs(2, 5, 6, 16, 8, 16, torch.float32, True, False)
    kw = dict(need_weights=need_weights, key_padding_mask=bool_mask((2, 6)))
    f_in, r_in = leaves(*x), leaves(*x)
    with torch.autocast("cpu", dtype=BF16):
        out_f, w_f = mod(*f_in, **kw)
        out_r, w_r = ref(*r_in, **kw)
    out_32, w_32 = ref(*x, **kw)  # the float32 truth
    assert out_f.dtype == out_r.dtype, (out_f.dtype, out_r.dtype)
    check("autocast output", out_f, out_r, out_32.detach().double())
    if need_weights:
        assert w_f.dtype == w_r.dtype, (w_f.dtype, w_r.dtype)
        check("autocast weights", w_f, w_r, w_32.detach().double())
    go = torch.randn(out_r.shape)
    g_f = torch.autograd.grad((out_f.float() * go).sum(), f_in + list(mod.parameters()))
    g_r = torch.autograd.grad((out_r.float() * go).sum(), r_in + list(ref.parameters()))
    for i, (a, b) in enumerate(zip(g_f, g_r)):
        assert a.dtype == b.dtype
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0.1, atol=0.05 * scale_of(b), msg=lambda m: f"grad {i}: {m}")


@pytest.mark.parametrize("cfg", [dict(), dict(add_bias_kv=True, kdim=8, vdim=12, bias=False)], ids=["plain", "extras"])
def test_meta_device_construction(cfg):
    m = fused_mha(16, 4, device=torch.device("meta"), **cfg)
    assert all(p.is_meta for p in m.parameters())
    with torch.device("meta"):
        m2 = fused_mha(16, 4, **cfg)
    assert all(p.is_meta for p in m2.parameters())
    ref = nn.MultiheadAttention(16, 4, **cfg)
    randomize_biases(ref)
    # shapes on meta inputs, like PyTorch
    xm = make_inputs(2, 5, 6, 16, cfg.get("kdim", 16), cfg.get("vdim", 16), torch.float32, True, False)
    xm = [t.to("meta") for t in xm]
    ref_meta = nn.MultiheadAttention(16, 4, device="meta", **cfg)
    for kw in (dict(), dict(need_weights=False), dict(average_attn_weights=False)):
        o, w = m(*xm, **kw)
        o_r, w_r = ref_meta(*xm, **kw)
        assert o.is_meta and o.shape == o_r.shape
        assert (w is None) == (w_r is None) and (w is None or w.shape == w_r.shape)
    m.to_empty(device="cpu")
    m.load_state_dict(ref.state_dict())
    x = make_inputs(2, 5, 6, 16, cfg.get("kdim", 16), cfg.get("vdim", 16), torch.float32, True, False)
    compare_runs(m, ref, leaves(*x), leaves(*x), {}, {}, torch.float32)
    m2.load_state_dict(ref.state_dict(), assign=True)
    compare_runs(m2, ref, leaves(*x), leaves(*x), {}, {}, torch.float32)


def test_threaded_parity():
    """A larger case with every intra-op thread (the rest of this file runs on one)."""
    n = torch.get_num_threads()
    torch.set_num_threads(max(2, torch.get_num_interop_threads()))
    try:
        ref, mod = make_pair(64, 8, kdim=48, add_bias_kv=True)
        x = make_inputs(4, 70, 90, 64, 48, 64, torch.float32, True, False)
        kw = dict(key_padding_mask=bool_mask((4, 90)), attn_mask=bool_mask((70, 90)), average_attn_weights=False)
        compare_runs(mod, ref, leaves(*x), leaves(*x), kw, dict(kw), torch.float32)
        kw["need_weights"] = False
        compare_runs(mod, ref, leaves(*x), leaves(*x), kw, dict(kw), torch.float32)
    finally:
        torch.set_num_threads(n)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.parametrize("kwargs", [dict(batch_first=True), dict(add_bias_kv=True, add_zero_attn=True),
                                    dict(kdim=8, vdim=12)], ids=str)
def test_torch_jit_script(kwargs):
    """nn.MultiheadAttention is scriptable, so fusedmha's is too."""
    ref, mod = make_pair(16, 4, **kwargs)
    scripted = torch.jit.script(mod)
    q, k, v = make_inputs(2, 5, 6, 16, kwargs.get("kdim", 16), kwargs.get("vdim", 16), torch.float32,
                          True, kwargs.get("batch_first", False))
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[0, -2:] = True
    for need_weights in (True, False):
        out, w = scripted(q, k, v, key_padding_mask=kpm, need_weights=need_weights)
        out_r, w_r = ref(q, k, v, key_padding_mask=kpm, need_weights=need_weights)
        check("scripted output", out, out_r)
        if need_weights:
            check("scripted weights", w, w_r)

