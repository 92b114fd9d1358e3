"""fusedmha.MultiheadAttention rejects what nn.MultiheadAttention rejects, with the same
exception type, and no input crashes the process.

Every case runs PyTorch's module first and takes the exception type it raises as the
expected one, so the tests follow PyTorch's behaviour rather than a copy of it.
"""

import os
import random
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import fusedmha
import mha_inputs

E, H, N, L, S = 8, 2, 3, 4, 5


pytestmark = pytest.mark.usefixtures("one_thread")


def make_pair(*args, **kwargs):
    """PyTorch's module and the fused one with the same parameters (biases drawn with std 1)."""
    return mha_inputs.make_pair(*args, bias_std=1.0, **kwargs)


def torch_outcome(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return fn(), None
        except Exception as e:  # noqa: BLE001 - we want PyTorch's exact type
            return None, e


def lower_precision_mask(query, kwargs):
    masks = [kwargs.get(n) for n in ("attn_mask", "key_padding_mask")]
    return any(m is not None and m.is_floating_point() and m.dtype != query.dtype
               and torch.promote_types(m.dtype, query.dtype) == query.dtype for m in masks)


def assert_same_outcome(ref, mod, args, kwargs, lenient_types=(), compare_values=True):
    """PyTorch raises T -> fused raises T (or a subclass); PyTorch succeeds -> fused does too,
    with the same output shapes (and values, where PyTorch's are finite)."""
    ref.train(mod.training)
    result, exc = torch_outcome(lambda: ref(*args, **kwargs))
    if exc is not None and "cannot reshape tensor of 0 elements" in str(exc):
        # PyTorch's module cannot reshape an empty batch or key sequence on some paths (extra
        # keys, separate projections); fusedmha's gives the output (shaped like the query;
        # its attention is 0 where no key is there to attend to), or refuses in its own name.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                out, _ = mod(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                assert str(e), "the error should say what is wrong"
                return e
        assert out.shape == args[0].shape, (out.shape, args[0].shape)
        return None
    if exc is not None and lower_precision_mask(args[0], kwargs):
        # A float mask of lower precision than the query (float16 for float32): PyTorch takes
        # it on some paths only (SDPA without extra keys); fusedmha widens it on every path.
        lenient, lenient_exc = torch_outcome(
            lambda: ref(*args, **{**kwargs, "need_weights": False}))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                out, _ = mod(*args, **kwargs)
            except type(exc):
                return None
        if lenient_exc is None:
            if compare_values:  # (not with a wrong is_causal hint: PyTorch's need_weights=False
                # path then drops the mask for a causal one, its need_weights path keeps it)
                torch.testing.assert_close(out, lenient[0], atol=1e-4, rtol=1e-4, equal_nan=True)
        else:  # PyTorch refuses on every path: only for the dtype, not for another error
            assert "dtype" in str(exc) or "dtype" in str(lenient_exc), (exc, lenient_exc)
        return None
    if exc is not None:
        expected = (type(exc),) + tuple(lenient_types)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                mod(*args, **kwargs)
            except expected as e:
                assert str(e), "the error should say what is wrong"
                return e
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"PyTorch raises {type(exc).__name__}({exc}); fused raises "
                                     f"{type(e).__name__}({e})") from e
        raise AssertionError(f"PyTorch raises {type(exc).__name__}({exc}); fused raises nothing")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            out, w = mod(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"PyTorch accepts this call; fused raises {type(e).__name__}({e})") from e
    out_r, w_r = result
    assert out.shape == out_r.shape and out.dtype == out_r.dtype, (out.shape, out_r.shape, out.dtype, out_r.dtype)
    assert (w is None) == (w_r is None)
    if w is not None:
        assert w.shape == w_r.shape and w.dtype == w_r.dtype, (w.shape, w_r.shape)
    for a, b in ((out, out_r), (w, w_r)):
        if (compare_values and b is not None and b.numel() and torch.isfinite(b).all()
                and b.dtype in (torch.float32, torch.float64)):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-4, atol=1e-4 * max(1.0, b.abs().max().item()))
    return None


# --------------------------------------------------------------------------------------
# constructor
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,kwargs", [
    ((0, 2), {}), ((8, 0), {}), ((-1, 2), {}), ((8, -2), {}), ((0, 0), {}),
    ((10, 3), {}), ((8, 16), {}), ((6, 4), {"kdim": 3}), ((8.0, 2), {}),
], ids=str)
def test_constructor_errors(args, kwargs):
    _, exc = torch_outcome(lambda: nn.MultiheadAttention(*args, **kwargs))
    assert exc is not None
    with pytest.raises(type(exc)):
        fusedmha.MultiheadAttention(*args, **kwargs)


def test_divisibility_error_message():
    with pytest.raises(AssertionError, match="divisible"):
        fusedmha.MultiheadAttention(10, 3)
    with pytest.raises(ValueError, match="greater than 0"):
        fusedmha.MultiheadAttention(0, 3)


# --------------------------------------------------------------------------------------
# forward: every shape/type check of nn.MultiheadAttention
# --------------------------------------------------------------------------------------


def qkv(batched=True, batch_first=False, kd=E, vd=E, n=N, l=L, s=S, dtype=torch.float32):
    def shape(t, d):
        if not batched:
            return (t, d)
        return (n, t, d) if batch_first else (t, n, d)
    return (torch.randn(shape(l, E), dtype=dtype), torch.randn(shape(s, kd), dtype=dtype),
            torch.randn(shape(s, vd), dtype=dtype))


B = torch.bool


def case_inputs(name):
    """(constructor kwargs, args, forward kwargs) of a call nn.MultiheadAttention rejects."""
    q, k, v = qkv()
    uq, uk, uv = qkv(batched=False)
    ctor = {}
    kw = {}
    if name == "query_1d":
        args = (q[0, 0], k[0, 0], v[0, 0])
    elif name == "query_4d":
        args = (q[None], k[None], v[None])
    elif name == "batched_query_2d_key":
        args = (q, k[:, 0], v)
    elif name == "batched_query_2d_value":
        args = (q, k, v[:, 0])
    elif name == "unbatched_query_3d_key":
        args = (uq, k, v)
    elif name == "query_wrong_embed_dim":
        args = (torch.randn(L, N, E + 2), k, v)
    elif name == "key_value_wrong_embed_dim":
        args = (q, torch.randn(S, N, E - 2), torch.randn(S, N, E - 2))
    elif name == "key_wrong_embed_dim_only":
        args = (q, torch.randn(S, N, E + 1), v)
    elif name == "key_value_seq_mismatch":
        args = (q, k, torch.randn(S + 1, N, E))
    elif name == "key_value_batch_mismatch":
        args = (q, k, torch.randn(S, N + 1, E))
    elif name == "query_key_batch_mismatch":
        args = (q, torch.randn(S, N + 1, E), torch.randn(S, N + 1, E))
    elif name == "query_key_batch_mismatch_batch_first":
        ctor = dict(batch_first=True)
        q, k, v = qkv(batch_first=True)
        args = (q, torch.randn(N + 1, S, E), torch.randn(N + 1, S, E))
    elif name == "kdim_wrong_key_dim":
        ctor = dict(kdim=6, vdim=4)
        args = (q, torch.randn(S, N, 5), torch.randn(S, N, 4))
    elif name == "vdim_wrong_value_dim":
        ctor = dict(kdim=6, vdim=4)
        args = (q, torch.randn(S, N, 6), torch.randn(S, N, 5))
    elif name == "kdim_key_value_seq_mismatch":
        ctor = dict(kdim=6, vdim=4)
        args = (q, torch.randn(S, N, 6), torch.randn(S + 2, N, 4))
    elif name == "kdim_key_value_batch_mismatch":
        ctor = dict(kdim=6, vdim=4)
        args = (q, torch.randn(S, N, 6), torch.randn(S, N + 1, 4))
    elif name == "kpm_1d_batched":
        args, kw = (q, k, v), dict(key_padding_mask=torch.zeros(S, dtype=B))
    elif name == "kpm_3d_batched":
        args, kw = (q, k, v), dict(key_padding_mask=torch.zeros(N, S, 1, dtype=B))
    elif name == "kpm_2d_unbatched":
        args, kw = (uq, uk, uv), dict(key_padding_mask=torch.zeros(1, S, dtype=B))
    elif name == "kpm_wrong_S":
        args, kw = (q, k, v), dict(key_padding_mask=torch.zeros(N, S + 1, dtype=B))
    elif name == "kpm_wrong_S_short":
        args, kw = (q, k, v), dict(key_padding_mask=torch.zeros(N, S - 1, dtype=B))
    elif name == "kpm_wrong_N":
        args, kw = (q, k, v), dict(key_padding_mask=torch.zeros(N + 1, S, dtype=B))
    elif name == "kpm_wrong_N_batch_first":
        ctor = dict(batch_first=True)
        args, kw = qkv(batch_first=True), dict(key_padding_mask=torch.zeros(N - 1, S, dtype=B))
    elif name == "kpm_float_wrong_S":
        args, kw = (q, k, v), dict(key_padding_mask=torch.zeros(N, S + 1))
    elif name == "kpm_unbatched_wrong_S":
        args, kw = (uq, uk, uv), dict(key_padding_mask=torch.zeros(S + 1, dtype=B))
    elif name == "kpm_int":
        args, kw = (q, k, v), dict(key_padding_mask=torch.zeros(N, S, dtype=torch.int64))
    elif name == "kpm_uint8":
        args, kw = (q, k, v), dict(key_padding_mask=torch.zeros(N, S, dtype=torch.uint8))
    elif name == "kpm_float64_with_float32_query":
        args, kw = (q, k, v), dict(key_padding_mask=torch.zeros(N, S, dtype=torch.float64))
    elif name == "am_1d":
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(S, dtype=B))
    elif name == "am_4d":
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(N, H, L, S, dtype=B))
    elif name == "am_1d_unbatched":
        args, kw = (uq, uk, uv), dict(attn_mask=torch.zeros(S, dtype=B))
    elif name == "am_2d_wrong_S":
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(L, S + 1, dtype=B))
    elif name == "am_2d_wrong_L":
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(L + 1, S, dtype=B))
    elif name == "am_2d_broadcastable":
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(1, S, dtype=B))
    elif name == "am_2d_transposed":
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(S, L))
    elif name == "am_2d_wrong_unbatched":
        args, kw = (uq, uk, uv), dict(attn_mask=torch.zeros(L, S - 1, dtype=B))
    elif name == "am_3d_wrong_first":
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(N, L, S, dtype=B))
    elif name == "am_3d_broadcastable":
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(1, L, S, dtype=B))
    elif name == "am_3d_wrong_S":
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(N * H, L, S + 1))
    elif name == "am_3d_unbatched_wrong_heads":
        args, kw = (uq, uk, uv), dict(attn_mask=torch.zeros(1, L, S, dtype=B))
    elif name == "am_3d_unbatched_wrong_S":
        args, kw = (uq, uk, uv), dict(attn_mask=torch.zeros(H, L, S + 1, dtype=B))
    elif name == "am_int":
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(L, S, dtype=torch.int32))
    elif name == "am_uint8":
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(L, S, dtype=torch.uint8))
    elif name == "am_int_3d":
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(N * H, L, S, dtype=torch.int64))
    elif name == "query_float64_module_float32":
        args = qkv(dtype=torch.float64)
    elif name == "key_float64":
        args = (q, k.double(), v.double())
    elif name == "query_int":
        args = tuple(t.long() for t in (q, k, v))
    elif name == "query_complex":
        args = tuple(t.to(torch.complex64) for t in (q, k, v))
    elif name == "bias_kv_am_2d_padded_shape":
        ctor = dict(add_bias_kv=True)
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(L, S + 1, dtype=B))
    elif name == "bias_kv_kpm_padded_shape":
        ctor = dict(add_bias_kv=True)
        args, kw = (q, k, v), dict(key_padding_mask=torch.zeros(N, S + 1, dtype=B))
    elif name == "zero_attn_am_3d_wrong":
        ctor = dict(add_zero_attn=True)
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(N * H, L, S + 1, dtype=B))
    elif name == "zero_attn_kpm_wrong":
        ctor = dict(add_zero_attn=True)
        args, kw = (q, k, v), dict(key_padding_mask=torch.zeros(N, S + 1, dtype=B))
    elif name == "causal_hint_wrong_mask_shape":
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(L, S + 1, dtype=B), is_causal=True)
    elif name == "causal_hint_int_mask":
        args, kw = (q, k, v), dict(attn_mask=torch.zeros(L, S, dtype=torch.int64), is_causal=True)
    elif name == "causal_kpm_wrong_shape":
        args, kw = (q, k, v), dict(key_padding_mask=torch.zeros(N, S + 1, dtype=B), is_causal=True,
                                   attn_mask=torch.zeros(L, S, dtype=B))
    else:
        raise KeyError(name)
    return ctor, args, kw


ERROR_CASES = [
    "query_1d", "query_4d", "batched_query_2d_key", "batched_query_2d_value", "unbatched_query_3d_key",
    "query_wrong_embed_dim", "key_value_wrong_embed_dim", "key_wrong_embed_dim_only", "key_value_seq_mismatch",
    "key_value_batch_mismatch", "query_key_batch_mismatch", "query_key_batch_mismatch_batch_first",
    "kdim_wrong_key_dim", "vdim_wrong_value_dim", "kdim_key_value_seq_mismatch", "kdim_key_value_batch_mismatch",
    "kpm_1d_batched", "kpm_3d_batched", "kpm_2d_unbatched", "kpm_wrong_S", "kpm_wrong_S_short", "kpm_wrong_N",
    "kpm_wrong_N_batch_first", "kpm_float_wrong_S", "kpm_unbatched_wrong_S", "kpm_int", "kpm_uint8",
    "kpm_float64_with_float32_query", "am_1d", "am_4d", "am_1d_unbatched", "am_2d_wrong_S", "am_2d_wrong_L",
    "am_2d_broadcastable", "am_2d_transposed", "am_2d_wrong_unbatched", "am_3d_wrong_first", "am_3d_broadcastable",
    "am_3d_wrong_S", "am_3d_unbatched_wrong_heads", "am_3d_unbatched_wrong_S", "am_int", "am_uint8", "am_int_3d",
    "query_float64_module_float32", "key_float64", "query_int", "query_complex", "bias_kv_am_2d_padded_shape",
    "bias_kv_kpm_padded_shape", "zero_attn_am_3d_wrong", "zero_attn_kpm_wrong", "causal_hint_wrong_mask_shape",
    "causal_hint_int_mask", "causal_kpm_wrong_shape",
]


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no_weights"])
@pytest.mark.parametrize("name", ERROR_CASES)
def test_same_error_as_pytorch(name, need_weights):
    ctor, args, kw = case_inputs(name)
    kw = dict(kw, need_weights=need_weights)
    ref, mod = make_pair(E, H, **ctor)
    # Where PyTorch skips the check on this path (it drops attn_mask for the is_causal hint
    # without weights), the fused module must take the call too.
    assert_same_outcome(ref, mod, args, kw, compare_values=not wrong_hint(kw))


def test_every_error_case_is_an_error_for_pytorch():
    """Guards the list above: each case makes PyTorch raise on the need_weights=True path."""
    for name in ERROR_CASES:
        ctor, args, kw = case_inputs(name)
        ref = nn.MultiheadAttention(E, H, **ctor)
        _, exc = torch_outcome(lambda: ref(*args, **kw))
        assert exc is not None, name


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no_weights"])
@pytest.mark.parametrize("p", [1.5, 2.0])
def test_bad_dropout_in_training(p, need_weights):
    """PyTorch raises ValueError (need_weights) or RuntimeError (its SDPA path); either is fine."""
    ref, mod = make_pair(E, H, dropout=p)
    q, k, v = qkv()
    with pytest.raises((ValueError, RuntimeError)):
        ref(q, k, v, need_weights=need_weights)
    with pytest.raises((ValueError, RuntimeError)):
        mod(q, k, v, need_weights=need_weights)
    mod.eval()
    ref.eval()  # eval ignores dropout, in PyTorch too
    assert_same_outcome(ref, mod, (q, k, v), dict(need_weights=need_weights))


def test_is_causal_without_mask_is_not_an_error():
    """Deliberate difference: PyTorch raises, fusedmha applies the causal mask."""
    ref, mod = make_pair(E, H)
    q, k, v = qkv()
    with pytest.raises(RuntimeError):
        ref(q, k, v, is_causal=True)
    for need_weights in (True, False):
        out, w = mod(q, k, v, is_causal=True, need_weights=need_weights)
        assert out.shape == (L, N, E) and torch.isfinite(out).all()


def test_errors_under_no_grad_and_eval():
    """The checks hold on every path (PyTorch's fast path is eval + no_grad + batch_first)."""
    ref, mod = make_pair(E, H, batch_first=True)
    ref.eval()
    mod.eval()
    x = torch.randn(N, L, E)
    with torch.no_grad():
        for kw in (dict(key_padding_mask=torch.zeros(N, L + 1, dtype=B)),
                   dict(attn_mask=torch.zeros(L, L + 1, dtype=B)),
                   dict(attn_mask=torch.zeros(L, L, dtype=torch.int64)),
                   dict(key_padding_mask=torch.zeros(N + 1, L, dtype=B))):
            # PyTorch's fast path and its slow path may raise different types: accept either.
            old = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
            try:
                _, slow_exc = torch_outcome(lambda: ref(x, x, x, **kw))
            finally:
                torch.backends.mha.set_fastpath_enabled(old)
            assert slow_exc is not None
            assert_same_outcome(ref, mod, (x, x, x), kw, lenient_types=(type(slow_exc),))


# --------------------------------------------------------------------------------------
# fuzz: perturbed calls behave like PyTorch's, and nothing crashes the process
# --------------------------------------------------------------------------------------

PERTURBATIONS = [
    "q_dim-", "q_dim+", "k_dim-", "v_dim+", "q_E", "k_E", "v_E", "k_S", "v_S", "q_N", "k_N", "v_N",
    "L0", "S0", "N0", "L1S1", "q_f64", "k_f64", "q_int", "q_bf16",
    "kpm_S", "kpm_N", "kpm_dim-", "kpm_dim+", "kpm_int", "kpm_u8", "kpm_f64", "kpm_f16",
    "am_L", "am_S", "am_3d_N", "am_1d", "am_4d", "am_int", "am_f64", "am_f16", "am_expand",
    "causal", "nan", "inf", "huge", "noncontig", "expanded", "none",
]


def fuzz_spec(i):
    rng = random.Random(1000 + i)
    spec = dict(
        batched=rng.random() < 0.8, batch_first=rng.random() < 0.5, kvdiff=rng.random() < 0.3,
        add_bias_kv=rng.random() < 0.25, add_zero_attn=rng.random() < 0.25, bias=rng.random() < 0.8,
        need_weights=rng.random() < 0.6, average=rng.random() < 0.6, training=rng.random() < 0.5,
        kpm=rng.choice([None, None, "bool", "float"]),
        am=rng.choice([None, None, "2d_bool", "2d_float", "3d_bool", "3d_float"]),
        perturb=sorted({rng.choice(PERTURBATIONS) for _ in range(rng.choice([1, 1, 2]))}),
        seed=i,
    )
    return spec


def fuzz_build(spec):
    """The modules' constructor kwargs and a call (args, kwargs) from a spec."""
    g = torch.Generator().manual_seed(spec["seed"])
    P = set(spec["perturb"])
    kd, vd = (6, 4) if spec["kvdiff"] else (E, E)
    ctor = dict(bias=spec["bias"], add_bias_kv=spec["add_bias_kv"], add_zero_attn=spec["add_zero_attn"],
                batch_first=spec["batch_first"], kdim=kd, vdim=vd)
    n, l, s = N, L, S
    if "L0" in P:
        l = 0
    if "S0" in P:
        s = 0
    if "N0" in P:
        n = 0
    if "L1S1" in P:
        l = s = 1
    batched, bf = spec["batched"], spec["batch_first"]

    def t(T, D, nn_=None):
        nb = n if nn_ is None else nn_
        shape = ((nb, T, D) if bf else (T, nb, D)) if batched else (T, D)
        return torch.randn(shape, generator=g)

    q = t(l, E + (2 if "q_E" in P else 0), n + 1 if "q_N" in P else None)
    k = t(s + (1 if "k_S" in P else 0), kd + (1 if "k_E" in P else 0), n + 1 if "k_N" in P else None)
    v = t(s + (2 if "v_S" in P else 0), vd + (1 if "v_E" in P else 0), n + 2 if "v_N" in P else None)
    if "q_dim-" in P:
        q = q[0]
    if "q_dim+" in P:
        q = q[None]
    if "k_dim-" in P:
        k = k[0]
    if "v_dim+" in P:
        v = v[None]
    if "q_f64" in P:
        q = q.double()
    if "k_f64" in P:
        k, v = k.double(), v.double()
    if "q_int" in P:
        q = (q * 3).long()
    if "q_bf16" in P:
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    if "nan" in P and q.numel():
        q = q.clone()
        q.view(-1)[0] = float("nan")
    if "inf" in P and k.numel():
        k = k.clone()
        k.view(-1)[-1] = float("inf")
    if "huge" in P:
        q = q * 1e30
    if "noncontig" in P and q.dim() >= 2:
        q = q.transpose(0, -1).contiguous().transpose(0, -1)
    if "expanded" in P and k.dim() >= 2 and k.shape[0] > 0:
        k = k[:1].expand_as(k)
    kw = dict(need_weights=spec["need_weights"], average_attn_weights=spec["average"])
    fdt = q.dtype if q.is_floating_point() else torch.float32
    kpm_shape = [n, s] if batched else [s]
    if "kpm_S" in P:
        kpm_shape[-1] += 1
    if "kpm_N" in P and batched:
        kpm_shape[0] += 1
    kpm_kind = spec["kpm"] or (("bool" if "kpm" in "".join(P) else None))
    if kpm_kind:
        m = torch.rand(kpm_shape, generator=g) < 0.3
        kpm = m if kpm_kind == "bool" else torch.zeros(kpm_shape, dtype=fdt).masked_fill(m, float("-inf"))
        if "kpm_dim-" in P:
            kpm = kpm[0] if kpm.dim() else kpm
        if "kpm_dim+" in P:
            kpm = kpm[None]
        for tag, dt in (("kpm_int", torch.int64), ("kpm_u8", torch.uint8), ("kpm_f64", torch.float64),
                        ("kpm_f16", torch.float16)):
            if tag in P:
                kpm = kpm.to(dt)
        kw["key_padding_mask"] = kpm
    am_kind = spec["am"] or (("2d_bool" if "am_" in "".join(P) else None))
    if am_kind:
        lm, sm = l + (1 if "am_L" in P else 0), s + (1 if "am_S" in P else 0)
        heads = (n * H if batched else H) + (1 if "am_3d_N" in P else 0)
        shape = [lm, sm] if am_kind.startswith("2d") else [heads, lm, sm]
        m = torch.rand(shape, generator=g) < 0.3
        am = m if am_kind.endswith("bool") else torch.zeros(shape, dtype=fdt).masked_fill(m, float("-inf"))
        if "am_1d" in P:
            am = am.reshape(-1)
        if "am_4d" in P:
            am = am[None]
        if "am_expand" in P and am.dim() >= 2 and am.shape[0] > 0:
            am = am[:1].expand_as(am)
        for tag, dt in (("am_int", torch.int32), ("am_f64", torch.float64), ("am_f16", torch.float16)):
            if tag in P:
                am = am.to(dt)
        kw["attn_mask"] = am
    if "causal" in P:
        kw["is_causal"] = True
    return ctor, (q, k, v), kw


FUZZ = [fuzz_spec(i) for i in range(160)]


def fuzz_id(spec):
    return f"{spec['seed']}-" + "+".join(spec["perturb"])


def known_difference(spec, kw):
    """Calls where fusedmha deliberately differs: is_causal without attn_mask."""
    return kw.get("is_causal") and kw.get("attn_mask") is None


def wrong_hint(kw):
    """is_causal with a mask that is not causal: a wrong hint, whose result is undefined (in
    PyTorch too); only the outcome (error type or success) is compared."""
    return kw.get("is_causal") and kw.get("attn_mask") is not None


@pytest.mark.parametrize("spec", FUZZ, ids=[fuzz_id(s) for s in FUZZ])
def test_fuzz_like_pytorch(spec):
    ctor, args, kw = fuzz_build(spec)
    ref, mod = make_pair(E, H, **ctor)
    mod.train(spec["training"])
    ref.train(spec["training"])
    if known_difference(spec, kw):
        kw_ref = dict(kw)
        kw_ref.pop("is_causal")
        _, exc = torch_outcome(lambda: ref(*args, **kw_ref))
        if exc is not None:  # an error elsewhere in the call: the same outcome expected
            fused_error = assert_same_outcome(ref, mod, args, kw_ref)
            if fused_error is not None:  # (not where fusedmha takes what PyTorch cannot)
                with pytest.raises(Exception):
                    mod(*args, **kw)
        else:
            try:
                mod(*args, **kw)
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"is_causal without mask should work here; got {type(e).__name__}({e})") from e
        return
    assert_same_outcome(ref, mod, args, kw, compare_values=not wrong_hint(kw))


def fuzz_main():
    """Runs every fuzz call on the fused module only (in a child process: a crash is a failure)."""
    torch.set_num_threads(1)
    n_ok = n_err = 0
    for spec in FUZZ:
        ctor, args, kw = fuzz_build(spec)
        try:
            mod = fusedmha.MultiheadAttention(E, H, **ctor).train(spec["training"])
            out, w = mod(*args, **kw)
            if out.requires_grad and out.numel():
                (out.float().sum() + (0 if w is None else w.float().sum())).backward()
            n_ok += 1
        except Exception:  # noqa: BLE001
            n_err += 1
    print(f"FUZZ DONE ok={n_ok} errors={n_err}", flush=True)


def test_fuzz_never_crashes():
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([here] + sys.path)
    code = "import test_mha_errors as t; t.fuzz_main()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"child exited with {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "FUZZ DONE" in proc.stdout


@pytest.mark.parametrize("mask", ["attn_mask", "key_padding_mask"])
def test_mask_on_another_device_names_the_module(mask):
    """Errors name the entry point the user called, not the op the module hands the call to."""
    mod = fusedmha.MultiheadAttention(E, H)
    x = torch.randn(4, 3, E)
    shape = (4, 4) if mask == "attn_mask" else (3, 4)
    with pytest.raises(RuntimeError, match="fusedmha.MultiheadAttention: expected " + mask):
        mod(x, x, x, **{mask: torch.zeros(shape, device="meta")})


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_inputs_off_the_modules_device_are_refused_in_its_name(which):
    """An input on another device than the module's parameters is an error that names the
    module (not an op it hands the call to), before anything runs."""
    m = fusedmha.MultiheadAttention(8, 2)
    x = {n: torch.randn(4, 3, 8) for n in ("query", "key", "value")}
    x[which] = torch.empty(4, 3, 8, device="meta")
    with pytest.raises(RuntimeError, match=f"fusedmha.MultiheadAttention: expected query, key and "
                                           f"value on the module's device \\(cpu\\), got .*{which} on meta"):
        m(x["query"], x["key"], x["value"])
