"""fusedmha.MultiheadAttention against torch.nn.MultiheadAttention.

Every test builds the PyTorch module with the same arguments, copies its state_dict into
the fused one and compares forward outputs, attention weights and gradients (of inputs and
parameters). The deliberate differences are tested on their own: ``is_causal=True`` without
``attn_mask`` (PyTorch raises; here it means the causal mask, so PyTorch gets that mask
explicitly) and query rows whose keys are all masked (0 here, NaN in PyTorch).
"""

import copy
import io
import itertools
import math
import pickle
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedmha

BF16 = torch.bfloat16
NEG_INF = float("-inf")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The sizes here are tiny: one intra-op thread is several times faster than two on a
    shared 2-core machine (test_threaded_parity keeps the default count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def fused_mha(*args, **kwargs):
    return fusedmha.MultiheadAttention(*args, **kwargs)


def randomize_biases(mha):
    """nn.MultiheadAttention zero-initialises its biases; make them matter."""
    with torch.no_grad():
        for name, p in mha.named_parameters():
            if "bias" in name:
                p.copy_(torch.randn_like(p) * 0.5)


def make_pair(E, H, dtype=torch.float32, **kwargs):
    """(PyTorch module, fused module) with the same arguments and the same parameters."""
    ref = nn.MultiheadAttention(E, H, dtype=dtype, **kwargs)
    randomize_biases(ref)
    mod = fused_mha(E, H, dtype=dtype, **kwargs)
    mod.load_state_dict(ref.state_dict())  # strict: same names and shapes
    return ref, mod


def as64(ref):
    """The PyTorch module in float64 with the same (rounded) parameters: the truth for bf16."""
    return copy.deepcopy(ref).to(torch.float64)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def scale_of(t):
    return max(1.0, t.detach().abs().max().item()) if t.numel() else 1.0


TOL = {torch.float64: (1e-9, 1e-10), torch.float32: (1e-4, 2e-5)}  # rtol, atol (x scale)


def nonfinite(t):
    bad = ~torch.isfinite(t)
    return f"{bad.sum().item()} of {t.numel()} values are NaN/inf, first at {bad.nonzero()[:4].tolist()}"


def check(name, got, exp, exp64=None):
    """got (fused) against exp (PyTorch at the same dtype); for low precision, fused must be
    within 2x PyTorch's own error against exp64 (PyTorch in float64), plus a floor."""
    assert got is not None, f"{name}: got None"
    assert got.shape == exp.shape, f"{name}: shape {tuple(got.shape)} != {tuple(exp.shape)}"
    assert got.dtype == exp.dtype, f"{name}: dtype {got.dtype} != {exp.dtype}"
    if got.numel() == 0:
        return
    assert torch.isfinite(got).all(), f"{name}: {nonfinite(got)}"
    if exp.dtype in TOL:
        rtol, atol = TOL[exp.dtype]
        torch.testing.assert_close(got, exp, rtol=rtol, atol=atol * scale_of(exp), msg=lambda m: f"{name}: {m}")
    else:
        assert exp64 is not None
        err = (got.double() - exp64).abs().max().item()
        torch_err = (exp.double() - exp64).abs().max().item()
        bound = 2 * torch_err + 1e-2 * scale_of(exp64)
        assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g} (PyTorch's {torch_err:.3g})"


def grads_of(loss, inputs, module):
    names = [n for n, _ in module.named_parameters()]
    params = [p for _, p in module.named_parameters()]
    g = torch.autograd.grad(loss, list(inputs) + params, allow_unused=True)
    return list(g[: len(inputs)]), dict(zip(names, g[len(inputs):]))


def loss_of(out, w, go, gw):
    loss = (out * go).sum()
    if w is not None and gw is not None:
        loss = loss + (w * gw).sum()
    return loss


def compare_runs(mod, ref, f_in, r_in, f_kw, r_kw, dtype, grads=True, name=""):
    """Run both modules (and PyTorch in float64 for bf16), compare outputs, weights and grads."""
    out_f, w_f = mod(*f_in, **f_kw)
    out_r, w_r = ref(*r_in, **r_kw)
    out_64 = w_64 = ref64 = in64 = None
    if dtype not in TOL:
        ref64 = as64(ref)
        in64 = leaves(*(t.double() for t in r_in))
        kw64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                for k, v in r_kw.items()}
        out_64, w_64 = ref64(*in64, **kw64)
    check(f"{name} output", out_f, out_r, None if out_64 is None else out_64.detach())
    if w_r is None:
        assert w_f is None, f"{name}: weights should be None with need_weights=False"
    else:
        check(f"{name} weights", w_f, w_r, None if w_64 is None else w_64.detach())
    if not grads:
        return
    go = torch.randn(out_r.shape).to(dtype)
    gw = None if w_r is None else torch.randn(w_r.shape).to(dtype)
    gi_f, gp_f = grads_of(loss_of(out_f, w_f, go, gw), f_in, mod)
    gi_r, gp_r = grads_of(loss_of(out_r, w_r, go, gw), r_in, ref)
    gi_64, gp_64 = [None] * len(gi_r), dict.fromkeys(gp_r)
    if ref64 is not None:
        gi_64, gp_64 = grads_of(loss_of(out_64, w_64, go.double(), None if gw is None else gw.double()), in64, ref64)
    for i, (a, b, c) in enumerate(zip(gi_f, gi_r, gi_64)):
        check(f"{name} grad of input {i}", a, b, c)
    assert list(gp_f) == list(gp_r), f"{name}: parameter names {list(gp_f)} != {list(gp_r)}"
    for n in gp_r:
        check(f"{name} grad of {n}", gp_f[n], gp_r[n], gp_64[n])


# --------------------------------------------------------------------------------------
# masks and inputs
# --------------------------------------------------------------------------------------


def bool_mask(shape):
    m = torch.rand(shape) < 0.35
    m[..., 0] = False  # key 0 always visible: no row is fully masked
    return m


def float_mask(shape, dtype):
    m = torch.randn(shape).masked_fill(torch.rand(shape) < 0.25, NEG_INF)
    m[..., 0] = torch.randn(shape[:-1])
    return m.to(dtype)


def causal_bool(L, S):
    return ~torch.ones(L, S, dtype=torch.bool).tril()  # True = masked (top-left aligned)


def causal_float(L, S, dtype):
    return torch.zeros(L, S, dtype=dtype).masked_fill(causal_bool(L, S), NEG_INF)


CAUSAL_KINDS = ("causal", "causal_mask_bool", "causal_mask_float", "causal_kpm")
MASK_KINDS = ("none", "kpm_bool", "kpm_float", "am2_bool", "am2_float", "am3_bool", "am3_float",
              "both_bool", "both_float") + CAUSAL_KINDS


def make_masks(kind, N, H, L, S, dtype, batched):
    """(fused kwargs, PyTorch kwargs) for a mask kind. PyTorch gets causal masks explicitly."""
    kpm_shape = (N, S) if batched else (S,)
    am3_shape = (N * H, L, S) if batched else (H, L, S)
    f, r = {}, {}
    if kind == "kpm_bool":
        f["key_padding_mask"] = bool_mask(kpm_shape)
    elif kind == "kpm_float":
        f["key_padding_mask"] = float_mask(kpm_shape, dtype)
    elif kind == "am2_bool":
        f["attn_mask"] = bool_mask((L, S))
    elif kind == "am2_float":
        f["attn_mask"] = float_mask((L, S), dtype)
    elif kind == "am3_bool":
        f["attn_mask"] = bool_mask(am3_shape)
    elif kind == "am3_float":
        f["attn_mask"] = float_mask(am3_shape, dtype)
    elif kind == "both_bool":
        f["key_padding_mask"], f["attn_mask"] = bool_mask(kpm_shape), bool_mask(am3_shape)
    elif kind == "both_float":
        f["key_padding_mask"], f["attn_mask"] = float_mask(kpm_shape, dtype), float_mask((L, S), dtype)
    elif kind == "causal":
        f["is_causal"] = True
        r["attn_mask"] = causal_bool(L, S)
    elif kind == "causal_mask_bool":
        f["attn_mask"], f["is_causal"] = causal_bool(L, S), True
    elif kind == "causal_mask_float":
        f["attn_mask"], f["is_causal"] = causal_float(L, S, dtype), True
    elif kind == "causal_kpm":
        f["is_causal"], f["key_padding_mask"] = True, bool_mask(kpm_shape)
        r["attn_mask"] = causal_bool(L, S)
    else:
        assert kind == "none"
    if "key_padding_mask" in f:
        r["key_padding_mask"] = f["key_padding_mask"]
    if "attn_mask" in f:
        r["attn_mask"] = f["attn_mask"]  # with is_causal: PyTorch gets the mask, not the hint
    return f, r


def make_inputs(N, L, S, E, kd, vd, dtype, batched, batch_first):
    def shape(T, D):
        if not batched:
            return (T, D)
        return (N, T, D) if batch_first else (T, N, D)

    return (torch.randn(shape(L, E)).to(dtype), torch.randn(shape(S, kd)).to(dtype),
            torch.randn(shape(S, vd)).to(dtype))


# --------------------------------------------------------------------------------------
# the parity matrix: a greedy 3-wise covering array over the factors below
# --------------------------------------------------------------------------------------

SHAPES = [  # E, H, L, S, N
    (16, 2, 5, 7, 2),
    (32, 4, 12, 12, 3),
    (24, 3, 9, 4, 2),  # L > S
    (8, 1, 1, 6, 2),  # one head, one query
]

FACTORS = {
    "bias": [True, False],
    "add_bias_kv": [False, True],
    "add_zero_attn": [False, True],
    "kvdim": ["same", "diff"],
    "batch_first": [False, True],
    "batched": [True, False],
    "mask": list(MASK_KINDS),
    "weights": ["none", "avg", "per_head"],
    "dtype": [torch.float32, torch.float64, BF16],
    "mode": ["eval", "train"],
    "shape": list(range(len(SHAPES))),
}


def allowed(row):
    # is_causal with extra keys (bias_kv / zero_attn) is tested on its own below.
    return not (row.get("mask") in CAUSAL_KINDS and (row.get("add_bias_kv") or row.get("add_zero_attn")))


def covering_array(factors, strength, allowed, seed=0, tries=30):
    """Rows such that every `strength`-tuple of factor values (that `allowed` admits) occurs."""
    names = list(factors)
    n = len(names)
    rng = random.Random(seed)

    def as_row(idx):
        return {names[i]: factors[names[i]][j] for i, j in enumerate(idx) if j is not None}

    combos = list(itertools.combinations(range(n), strength))
    uncovered = set()
    for c in combos:
        for vals in itertools.product(*(range(len(factors[names[i]])) for i in c)):
            idx = [None] * n
            for i, j in zip(c, vals):
                idx[i] = j
            if allowed(as_row(idx)):
                uncovered.add((c, vals))
    rows = []
    while uncovered:
        pool = sorted(uncovered)
        best, best_gain = None, -1
        for _ in range(tries):
            c, vals = rng.choice(pool)
            for _attempt in range(20):
                idx = [rng.randrange(len(factors[name])) for name in names]
                for i, j in zip(c, vals):
                    idx[i] = j
                if allowed(as_row(idx)):
                    break
            else:
                continue
            gain = sum((cc, tuple(idx[i] for i in cc)) in uncovered for cc in combos)
            if gain > best_gain:
                best, best_gain = idx, gain
        rows.append(as_row(best))
        for cc in combos:
            uncovered.discard((cc, tuple(best[i] for i in cc)))
    return rows


def case_id(row):
    E, H, L, S, N = SHAPES[row["shape"]]
    return "-".join([
        "bias" if row["bias"] else "nobias",
        "bkv" if row["add_bias_kv"] else "",
        "zattn" if row["add_zero_attn"] else "",
        "kvdiff" if row["kvdim"] == "diff" else "",
        "bf" if row["batch_first"] else "sf",
        "batched" if row["batched"] else "unbatched",
        row["mask"],
        "w" + row["weights"],
        str(row["dtype"]).replace("torch.", ""),
        row["mode"],
        f"E{E}H{H}L{L}S{S}N{N}",
    ]).replace("--", "-").replace("--", "-")


MATRIX = covering_array(FACTORS, 3, allowed)


def run_matrix_case(row):
    E, H, L, S, N = SHAPES[row["shape"]]
    dtype = row["dtype"]
    kwargs = dict(bias=row["bias"], add_bias_kv=row["add_bias_kv"], add_zero_attn=row["add_zero_attn"],
                  batch_first=row["batch_first"], dropout=0.0)
    kd = vd = E
    if row["kvdim"] == "diff":
        kd, vd = E // 2 + 1, E + 8
        kwargs.update(kdim=kd, vdim=vd)
    ref, mod = make_pair(E, H, dtype=dtype, **kwargs)
    train = row["mode"] == "train"
    ref.train(train)
    mod.train(train)
    f_kw, r_kw = make_masks(row["mask"], N, H, L, S, dtype, row["batched"])
    weights = {"none": dict(need_weights=False), "avg": dict(need_weights=True, average_attn_weights=True),
               "per_head": dict(need_weights=True, average_attn_weights=False)}[row["weights"]]
    f_kw.update(weights)
    r_kw.update(weights)
    x = make_inputs(N, L, S, E, kd, vd, dtype, row["batched"], row["batch_first"])
    compare_runs(mod, ref, leaves(*x), leaves(*x), f_kw, r_kw, dtype, name=case_id(row))


@pytest.mark.parametrize("row", MATRIX, ids=[case_id(r) for r in MATRIX])
def test_parity_matrix(row):
    run_matrix_case(row)


def test_matrix_covers_every_factor_value():
    for name, values in FACTORS.items():
        seen = {repr(r[name]) for r in MATRIX}
        assert seen == {repr(v) for v in values}, name
    assert 100 <= len(MATRIX) <= 400, len(MATRIX)


# --------------------------------------------------------------------------------------
# PyTorch's own sample inputs for nn.MultiheadAttention
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_pytorch_module_sample_inputs(training, dtype):
    from torch.testing._internal.common_modules import module_inputs_torch_nn_MultiheadAttention

    samples = module_inputs_torch_nn_MultiheadAttention(
        None, device="cpu", dtype=dtype, requires_grad=True, training=training)
    assert len(samples) >= 32
    for i, sample in enumerate(samples):
        c_args, c_kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
        f_args, f_kwargs = sample.forward_input.args, sample.forward_input.kwargs
        torch.manual_seed(i)
        ref = nn.MultiheadAttention(*c_args, **c_kwargs, dtype=dtype)
        randomize_biases(ref)
        mod = fused_mha(*c_args, **c_kwargs, dtype=dtype)
        mod.load_state_dict(ref.state_dict())
        ref.train(training)
        mod.train(training)
        compare_runs(mod, ref, leaves(*f_args), leaves(*f_args), dict(f_kwargs), dict(f_kwargs), dtype,
                     name=f"sample {i} {c_kwargs} mask kinds {[k for k, v in f_kwargs.items() if v is not None]}")


# --------------------------------------------------------------------------------------
# constructor, attributes, parameters, state_dict
# --------------------------------------------------------------------------------------

CONFIGS = [
    dict(),
    dict(bias=False),
    dict(add_bias_kv=True),
    dict(add_zero_attn=True),
    dict(kdim=6, vdim=10),
    dict(kdim=16),
    dict(bias=False, add_bias_kv=True, add_zero_attn=True, kdim=5, vdim=7, batch_first=True, dropout=0.25),
]


def test_signatures_match_pytorch():
    import inspect

    for fn in ("__init__", "forward"):
        ours = inspect.signature(getattr(fusedmha.MultiheadAttention, fn))
        theirs = inspect.signature(getattr(nn.MultiheadAttention, fn))
        assert [(p.name, p.default, p.kind) for p in ours.parameters.values()] == \
               [(p.name, p.default, p.kind) for p in theirs.parameters.values()], fn


def test_is_a_module_and_positional_constructor():
    m = fused_mha(16, 4, 0.1, False, True, True, 8, 12, True)
    r = nn.MultiheadAttention(16, 4, 0.1, False, True, True, 8, 12, True)
    assert isinstance(m, nn.Module)
    for attr in ("embed_dim", "num_heads", "dropout", "kdim", "vdim", "batch_first", "add_zero_attn",
                 "_qkv_same_embed_dim", "head_dim"):
        assert getattr(m, attr) == getattr(r, attr), attr
    assert m.bias_k is not None and m.in_proj_bias is None


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_attributes(cfg):
    r = nn.MultiheadAttention(16, 4, **cfg)
    m = fused_mha(16, 4, **cfg)
    for attr in ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "dropout", "batch_first", "add_zero_attn",
                 "_qkv_same_embed_dim"):
        assert getattr(m, attr) == getattr(r, attr), attr
        assert type(getattr(m, attr)) is type(getattr(r, attr)), attr
    assert isinstance(m.dropout, float)
    for attr in ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight", "bias_k",
                 "bias_v"):
        a, b = getattr(m, attr), getattr(r, attr)
        assert (a is None) == (b is None), attr
        if b is not None:
            assert isinstance(a, nn.Parameter), attr
            assert a.shape == b.shape, attr
    assert isinstance(m.out_proj, nn.Linear)
    assert m.out_proj.in_features == m.out_proj.out_features == 16
    assert (m.out_proj.bias is None) == (r.out_proj.bias is None)


def test_dropout_attribute_is_float():
    assert isinstance(fused_mha(8, 2).dropout, float)
    assert fused_mha(8, 2, dropout=0.5).dropout == 0.5


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_parameters_and_state_dict_layout(cfg):
    r = nn.MultiheadAttention(16, 4, **cfg)
    m = fused_mha(16, 4, **cfg)
    assert [(n, p.shape) for n, p in m.named_parameters()] == [(n, p.shape) for n, p in r.named_parameters()]
    assert [(n, t.shape) for n, t in m.state_dict().items()] == [(n, t.shape) for n, t in r.state_dict().items()]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_fresh_initialisation_like_pytorch(cfg):
    m = fused_mha(16, 4, **cfg)
    if m.in_proj_bias is not None:
        assert torch.equal(m.in_proj_bias, torch.zeros_like(m.in_proj_bias))
        assert torch.equal(m.out_proj.bias, torch.zeros_like(m.out_proj.bias))
    for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
        w = getattr(m, name)
        if w is not None:
            bound = math.sqrt(6.0 / (w.size(0) + w.size(1)))  # xavier_uniform_
            assert w.abs().max() <= bound + 1e-6 and w.abs().max() > 0.3 * bound, name
    if m.bias_k is not None:
        assert m.bias_k.abs().sum() > 0 and m.bias_v.abs().sum() > 0


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_state_dict_round_trip_both_ways(cfg):
    E, H = 16, 4
    kw = {k: v for k, v in cfg.items() if k != "dropout"}
    ref, mod = make_pair(E, H, **kw)  # PyTorch -> fused
    x = make_inputs(2, 5, 6, E, cfg.get("kdim", E), cfg.get("vdim", E), torch.float32, True,
                    cfg.get("batch_first", False))
    kpm = bool_mask((2, 6))
    compare_runs(mod, ref, leaves(*x), leaves(*x), dict(key_padding_mask=kpm), dict(key_padding_mask=kpm),
                 torch.float32, name="pytorch->fused")

    mod2 = fused_mha(E, H, **kw)
    randomize_biases(mod2)
    with torch.no_grad():
        for p in mod2.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ref2 = nn.MultiheadAttention(E, H, **kw)
    ref2.load_state_dict(mod2.state_dict())  # fused -> PyTorch
    for (n, a), (_, b) in zip(mod2.state_dict().items(), ref2.state_dict().items()):
        assert torch.equal(a, b), n
    compare_runs(mod2, ref2, leaves(*x), leaves(*x), {}, {}, torch.float32, name="fused->pytorch")


# --------------------------------------------------------------------------------------
# is_causal, self-attention, layouts
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


@pytest.mark.parametrize("pattern", ["q=k=v", "k=v", "distinct"])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_self_and_cross_attention_identity_patterns(pattern, batch_first, need_weights):
    ref, mod = make_pair(16, 4, batch_first=batch_first)
    shape = (2, 6, 16) if batch_first else (6, 2, 16)
    a, b, c = torch.randn(shape), torch.randn(shape), torch.randn(shape)
    kpm = bool_mask((2, 6))
    kw = dict(key_padding_mask=kpm, need_weights=need_weights)
    if pattern == "q=k=v":
        (xf,), (xr,) = leaves(a), leaves(a)
        f_in, r_in = (xf, xf, xf), (xr, xr, xr)
        f_leaves, r_leaves = (xf,), (xr,)
    elif pattern == "k=v":
        (qf, kf), (qr, kr) = leaves(a, b), leaves(a, b)
        f_in, r_in = (qf, kf, kf), (qr, kr, kr)
        f_leaves, r_leaves = (qf, kf), (qr, kr)
    else:
        f_in, r_in = leaves(a, b, c), leaves(a, b, c)
        f_leaves, r_leaves = f_in, r_in
    out_f, w_f = mod(*f_in, **kw)
    out_r, w_r = ref(*r_in, **kw)
    check("output", out_f, out_r)
    if need_weights:
        check("weights", w_f, w_r)
    go = torch.randn_like(out_r)
    gf, gpf = grads_of((out_f * go).sum(), f_leaves, mod)
    gr, gpr = grads_of((out_r * go).sum(), r_leaves, ref)
    for i, (x, y) in enumerate(zip(gf, gr)):
        check(f"grad of input {i}", x, y)
    for n in gpr:
        check(f"grad of {n}", gpf[n], gpr[n])


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask", ["none", "kpm", "am"])
def test_eval_no_grad_self_attention(batch_first, need_weights, mask):
    """The setting where PyTorch takes its native fast path (batch_first, self-attention, no grad)."""
    ref, mod = make_pair(16, 4, batch_first=batch_first)
    ref.eval()
    mod.eval()
    x = torch.randn((2, 7, 16) if batch_first else (7, 2, 16))
    kw = dict(need_weights=need_weights)
    if mask == "kpm":
        kw["key_padding_mask"] = bool_mask((2, 7))
    elif mask == "am":
        kw["attn_mask"] = bool_mask((7, 7))
    with torch.no_grad():
        out_f, w_f = mod(x, x, x, **kw)
        out_r, w_r = ref(x, x, x, **kw)
    check("output", out_f, out_r)
    if need_weights:
        check("weights", w_f, w_r)
    else:
        assert w_f is None


def test_non_contiguous_inputs_and_masks():
    ref, mod = make_pair(16, 4, kdim=8, vdim=12)
    q = torch.randn(2, 5, 16).transpose(0, 1)  # (5, 2, 16) non-contiguous
    k = torch.randn(7, 2, 16)[..., ::2]  # (7, 2, 8) strided
    v = torch.randn(2, 7, 12).permute(1, 0, 2)
    am = bool_mask((5, 7)).t().contiguous().t()  # same values, column-major
    kpm = bool_mask((2, 7)).t().contiguous().t()
    assert not q.is_contiguous() and not k.is_contiguous() and not am.is_contiguous()
    kw = dict(attn_mask=am, key_padding_mask=kpm, average_attn_weights=False)
    compare_runs(mod, ref, leaves(q, k, v), leaves(q, k, v), kw, dict(kw), torch.float32)


def test_expanded_masks():
    ref, mod = make_pair(16, 4)
    x = make_inputs(3, 5, 7, 16, 16, 16, torch.float32, True, False)
    am = bool_mask((1, 7)).expand(5, 7)
    am3 = float_mask((1, 5, 7), torch.float32).expand(12, 5, 7)
    for kw in (dict(attn_mask=am), dict(attn_mask=am3)):
        compare_runs(mod, ref, leaves(*x), leaves(*x), kw, dict(kw), torch.float32)


@pytest.mark.parametrize("which", ["out_only", "weights_only", "weights_only_per_head"])
def test_gradients_through_weights(which):
    """A loss on the returned weights alone, or on the output alone (weights returned, unused)."""
    ref, mod = make_pair(16, 4, kdim=12)
    x = make_inputs(2, 5, 6, 16, 12, 16, torch.float32, True, False)
    kw = dict(average_attn_weights=which != "weights_only_per_head", key_padding_mask=bool_mask((2, 6)))
    f_in, r_in = leaves(*x), leaves(*x)
    out_f, w_f = mod(*f_in, **kw)
    out_r, w_r = ref(*r_in, **kw)
    gw = torch.randn_like(w_r)
    go = torch.randn_like(out_r)

    def loss(out, w):
        return (out * go).sum() if which == "out_only" else (w * gw).sum()

    gf, gpf = grads_of(loss(out_f, w_f), f_in, mod)
    gr, gpr = grads_of(loss(out_r, w_r), r_in, ref)
    for i, (a, b) in enumerate(zip(gf, gr)):
        if b is None:
            assert a is None or not a.abs().any(), f"input {i}"
        else:
            check(f"grad of input {i}", a, b)
    for n in gpr:
        if gpr[n] is None:
            assert gpf[n] is None or not gpf[n].abs().any(), n
        else:
            check(f"grad of {n}", gpf[n], gpr[n])


# --------------------------------------------------------------------------------------
# float64 reference with fusedmha's semantics (fully masked rows give 0; optional dropout mask)
# --------------------------------------------------------------------------------------


def reference_mha(m, query, key, value, key_padding_mask=None, attn_mask=None, is_causal=False,
                  need_weights=True, average_attn_weights=True, keep=None, params=None):
    """Multi-head attention in float64 from the parameters of module m (or `params`, a dict by
    name). Rows with no visible key give attention 0 (output = out_proj.bias) with gradient 0.
    `keep` (N, H, L, S'), when given, is the dropout keep-mask applied with scale 1/(1-p)."""
    P = params if params is not None else {n: p.double() for n, p in m.named_parameters()}
    E, H = m.embed_dim, m.num_heads
    hd = E // H
    batched = query.dim() == 3
    query, key, value = query.double(), key.double(), value.double()
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif m.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    L, N, _ = query.shape
    S = key.shape[0]
    if P.get("in_proj_weight") is not None:
        wq, wk, wv = P["in_proj_weight"].chunk(3)
    else:
        wq, wk, wv = P["q_proj_weight"], P["k_proj_weight"], P["v_proj_weight"]
    bq = bk = bv = None
    if P.get("in_proj_bias") is not None:
        bq, bk, bv = P["in_proj_bias"].chunk(3)
    q, k, v = F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)  # (T, N, E)
    add = torch.zeros(N, H, L, S, dtype=torch.float64)
    if is_causal:
        add = add.masked_fill(causal_bool(L, S), NEG_INF)
    if attn_mask is not None:
        am = attn_mask.view(N, H, L, S) if attn_mask.dim() == 3 else attn_mask
        add = add.masked_fill(am, NEG_INF) if am.dtype == torch.bool else add + am.double()
    if key_padding_mask is not None:
        kp = key_padding_mask.view(N, 1, 1, S)
        add = add.masked_fill(kp, NEG_INF) if kp.dtype == torch.bool else add + kp.double()
    if P.get("bias_k") is not None:
        k = torch.cat([k, P["bias_k"].expand(1, N, E)])
        v = torch.cat([v, P["bias_v"].expand(1, N, E)])
        add = F.pad(add, (0, 1))
    q = q.view(L, N, H, hd).permute(1, 2, 0, 3)
    k = k.view(-1, N, H, hd).permute(1, 2, 0, 3)
    v = v.view(-1, N, H, hd).permute(1, 2, 0, 3)
    if m.add_zero_attn:
        k = torch.cat([k, k.new_zeros(N, H, 1, hd)], dim=2)
        v = torch.cat([v, v.new_zeros(N, H, 1, hd)], dim=2)
        add = F.pad(add, (0, 1))
    scores = q @ k.transpose(-2, -1) / math.sqrt(hd) + add
    attends = (scores > NEG_INF).any(dim=-1, keepdim=True)
    probs = torch.softmax(torch.where(attends, scores, torch.zeros_like(scores)), dim=-1) * attends
    if keep is not None:
        probs = probs * keep / (1 - m.dropout)
    out = (probs @ v).permute(2, 0, 1, 3).reshape(L, N, E)
    out = F.linear(out, P["out_proj.weight"], P.get("out_proj.bias"))
    w = probs.mean(dim=1) if average_attn_weights else probs
    if not batched:
        out, w = out.squeeze(1), w.squeeze(0)
    elif m.batch_first:
        out = out.transpose(0, 1)
    return out, (w if need_weights else None)


@pytest.mark.parametrize("row", MATRIX[::9], ids=[case_id(r) for r in MATRIX[::9]])
def test_reference_mha_matches_pytorch(row):
    """Self-test of the float64 reference used below (needs no fused module)."""
    E, H, L, S, N = SHAPES[row["shape"]]
    kwargs = dict(bias=row["bias"], add_bias_kv=row["add_bias_kv"], add_zero_attn=row["add_zero_attn"],
                  batch_first=row["batch_first"])
    kd = vd = E
    if row["kvdim"] == "diff":
        kd, vd = E // 2 + 1, E + 8
        kwargs.update(kdim=kd, vdim=vd)
    ref = nn.MultiheadAttention(E, H, dtype=torch.float64, **kwargs)
    randomize_biases(ref)
    f_kw, r_kw = make_masks(row["mask"], N, H, L, S, torch.float64, row["batched"])
    x = make_inputs(N, L, S, E, kd, vd, torch.float64, row["batched"], row["batch_first"])
    out, w = ref(*x, average_attn_weights=row["weights"] != "per_head", **r_kw)
    out2, w2 = reference_mha(ref, *x, average_attn_weights=row["weights"] != "per_head", **f_kw)
    torch.testing.assert_close(out2, out)
    torch.testing.assert_close(w2, w)


def params64(m):
    return {n: p.detach().double().requires_grad_() for n, p in m.named_parameters()}


def compare_with_reference(mod, x, kw, name="", tol=(1e-4, 2e-5)):
    """Fused output/weights/grads against reference_mha (float64)."""
    f_in = leaves(*x)
    r_in = leaves(*(t.double() for t in x))
    P = params64(mod)
    out_f, w_f = mod(*f_in, **kw)
    out_r, w_r = reference_mha(mod, *r_in, params=P, **kw)
    assert torch.isfinite(out_f).all(), f"{name} output: {nonfinite(out_f)}"
    torch.testing.assert_close(out_f.double(), out_r, rtol=tol[0], atol=tol[1] * scale_of(out_r),
                               msg=lambda m: f"{name} output: {m}")
    if w_r is not None:
        assert torch.isfinite(w_f).all(), f"{name} weights: {nonfinite(w_f)}"
        torch.testing.assert_close(w_f.double(), w_r, rtol=tol[0], atol=tol[1], msg=lambda m: f"{name} weights: {m}")
    go = torch.randn(out_r.shape)
    gw = None if w_r is None else torch.randn(w_r.shape)
    names = [n for n, _ in mod.named_parameters()]
    g_f = torch.autograd.grad(loss_of(out_f, w_f, go, gw), f_in + [p for _, p in mod.named_parameters()])
    g_r = torch.autograd.grad(loss_of(out_r, w_r, go.double(), None if gw is None else gw.double()),
                              r_in + [P[n] for n in names])
    for label, a, b in zip([f"input {i}" for i in range(len(x))] + names, g_f, g_r):
        assert torch.isfinite(a).all(), f"{name} grad of {label}: {nonfinite(a)}"
        torch.testing.assert_close(a.double(), b, rtol=tol[0] * 5, atol=tol[1] * 5 * scale_of(b),
                                   msg=lambda m: f"{name} grad of {label}: {m}")
    return out_f, w_f


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


def test_unbatched_ignores_batch_first():
    ref, mod = make_pair(16, 4, batch_first=True)
    x = make_inputs(1, 5, 7, 16, 16, 16, torch.float32, False, True)
    for kw in (dict(), dict(average_attn_weights=False), dict(need_weights=False),
               dict(key_padding_mask=bool_mask((7,)), attn_mask=bool_mask((4, 5, 7)))):
        compare_runs(mod, ref, leaves(*x), leaves(*x), kw, dict(kw), torch.float32)


@pytest.mark.parametrize("name", ["attn_mask", "key_padding_mask"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_float_mask_requiring_grad(name, need_weights):
    """Gradients with respect to a float mask are documented as unsupported: asking for one
    may raise a RuntimeError (or give PyTorch's gradient). When no gradient is needed (under
    torch.no_grad, e.g. inference with a learnt bias tensor as the mask) the call must work."""
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
    try:
        out_f, _ = mod(*x, **{name: m_f, "need_weights": need_weights})
    except RuntimeError as e:
        assert "mask" in str(e)
        return
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
# dropout
# --------------------------------------------------------------------------------------

WEIGHT_MODES = {"none": dict(need_weights=False), "avg": dict(need_weights=True),
                "per_head": dict(need_weights=True, average_attn_weights=False)}


@pytest.mark.parametrize("weights", list(WEIGHT_MODES))
def test_dropout_repeatable_with_seed(weights):
    mod = fused_mha(16, 4, dropout=0.3).train()
    x = make_inputs(2, 8, 8, 16, 16, 16, torch.float32, True, False)
    kw = WEIGHT_MODES[weights]
    torch.manual_seed(7)
    a = mod(*x, **kw)
    b = mod(*x, **kw)
    torch.manual_seed(7)
    c = mod(*x, **kw)
    assert torch.equal(a[0], c[0])
    assert not torch.equal(a[0], b[0])
    if a[1] is not None:
        assert torch.equal(a[1], c[1]) and not torch.equal(a[1], b[1])
    mod.eval()
    e1, e2 = mod(*x, **kw), mod(*x, **kw)
    assert torch.equal(e1[0], e2[0])
    assert not torch.equal(e1[0], a[0])


def test_dropout_average_is_mean_of_per_head_with_same_seed():
    """As in PyTorch, the seed fixes the dropout mask, whatever average_attn_weights is."""
    mod = fused_mha(16, 4, dropout=0.3).train()
    x = make_inputs(2, 6, 7, 16, 16, 16, torch.float32, True, False)
    torch.manual_seed(3)
    out_a, w_avg = mod(*x)
    torch.manual_seed(3)
    out_b, w_ph = mod(*x, average_attn_weights=False)
    torch.testing.assert_close(out_a, out_b)
    torch.testing.assert_close(w_avg, w_ph.mean(dim=1))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_fraction_and_scale(p):
    torch.manual_seed(3)
    mod = fused_mha(32, 4, dropout=p)
    x = make_inputs(2, 40, 48, 32, 32, 32, torch.float32, True, False)
    mod.eval()
    with torch.no_grad():
        _, w_eval = mod(*x, average_attn_weights=False)
    mod.train()
    with torch.no_grad():
        _, w = mod(*x, average_attn_weights=False)
    dropped = (w == 0).float().mean().item()
    n = w.numel()
    assert abs(dropped - p) < 6 * math.sqrt(p * (1 - p) / n), (p, dropped)
    kept = w != 0
    torch.testing.assert_close(w[kept], w_eval[kept] / (1 - p), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("cfg", [dict(), dict(add_bias_kv=True, add_zero_attn=True, kdim=8, vdim=12, batch_first=True)],
                         ids=["plain", "extras"])
@pytest.mark.parametrize("mask", ["none", "kpm", "causal"])
def test_dropout_weights_are_those_applied(cfg, mask):
    """The per-head weights returned in training are the dropped ones (as PyTorch); the output
    and all gradients are those of attention with exactly that keep-mask."""
    p = 0.3
    torch.manual_seed(5)
    mod = fused_mha(16, 4, dropout=p, **cfg).train()
    randomize_biases(mod)
    N, L, S = 2, 6, 7
    x = make_inputs(N, L, S, 16, cfg.get("kdim", 16), cfg.get("vdim", 16), torch.float32, True,
                    cfg.get("batch_first", False))
    kw = dict(average_attn_weights=False)
    if mask == "kpm":
        kw["key_padding_mask"] = bool_mask((N, S))
    elif mask == "causal" and not cfg:
        kw["is_causal"] = True
    elif mask == "causal":  # is_causal with extra keys is tested on its own
        kw["attn_mask"] = causal_bool(L, S)
    f_in = leaves(*x)
    out, w = mod(*f_in, **kw)
    keep = (w != 0).double()
    dropped = 1 - keep.mean().item()
    assert 0.05 < dropped < 0.7, dropped
    r_in = leaves(*(t.double() for t in x))
    P = params64(mod)
    out_r, w_r = reference_mha(mod, *r_in, keep=keep, params=P, **kw)
    torch.testing.assert_close(w.double(), w_r, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.double(), out_r, rtol=1e-4, atol=2e-5)
    go, gw = torch.randn(out.shape), torch.randn(w.shape)
    names = [n for n, _ in mod.named_parameters()]
    g_f = torch.autograd.grad(loss_of(out, w, go, gw), f_in + [p_ for _, p_ in mod.named_parameters()])
    g_r = torch.autograd.grad(loss_of(out_r, w_r, go.double(), gw.double()), r_in + [P[n] for n in names])
    for label, a, b in zip(["query", "key", "value"] + names, g_f, g_r):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4 * scale_of(b), msg=lambda m: f"{label}: {m}")


@pytest.mark.parametrize("need_weights", [False, True])
def test_dropout_gradcheck_with_fixed_seed(need_weights):
    """With the seed reset before each call the module is a deterministic function: its
    backward must be its derivative (the backward replays the forward's dropout mask)."""
    mod = fused_mha(8, 2, dropout=0.4, dtype=torch.float64).train()
    q, k, v = (torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        torch.manual_seed(11)
        out, w = mod(q, k, v, need_weights=need_weights, average_attn_weights=False)
        return (out, w) if need_weights else out

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("need_weights", [False, True])
def test_eval_ignores_dropout(need_weights):
    ref, mod = make_pair(16, 4, dropout=0.5)
    ref.eval()
    mod.eval()
    x = make_inputs(2, 6, 6, 16, 16, 16, torch.float32, True, False)
    kw = dict(need_weights=need_weights, key_padding_mask=bool_mask((2, 6)))
    compare_runs(mod, ref, leaves(*x), leaves(*x), kw, dict(kw), torch.float32)


@pytest.mark.parametrize("need_weights", [False, True])
def test_dropout_one_drops_everything(need_weights):
    ref, mod = make_pair(16, 4, dropout=1.0)
    x = make_inputs(2, 5, 6, 16, 16, 16, torch.float32, True, False)
    out_f, w_f = mod(*x, need_weights=need_weights)
    out_r, w_r = ref(*x, need_weights=need_weights)
    assert torch.isfinite(out_f).all()
    torch.testing.assert_close(out_f, out_r)
    if need_weights:
        torch.testing.assert_close(w_f, w_r)


# --------------------------------------------------------------------------------------
# nn.Transformer layers with fused attention
# --------------------------------------------------------------------------------------


def swap_attention(model):
    """Replace every nn.MultiheadAttention inside model by a fused one with the same weights."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.MultiheadAttention:
                new = fused_mha(child.embed_dim, child.num_heads, dropout=child.dropout,
                                bias=child.in_proj_bias is not None, add_bias_kv=child.bias_k is not None,
                                add_zero_attn=child.add_zero_attn, kdim=child.kdim, vdim=child.vdim,
                                batch_first=child.batch_first)
                new.load_state_dict(child.state_dict())
                new.train(child.training)
                setattr(parent, name, new)
    return model


def make_encoders(batch_first, nhead=4, layers=2):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, nhead, dim_feedforward=32, dropout=0.0, batch_first=batch_first)
    ref = nn.TransformerEncoder(layer, layers, enable_nested_tensor=batch_first)
    for m in ref.modules():
        if isinstance(m, nn.MultiheadAttention):
            randomize_biases(m)
    fused = swap_attention(copy.deepcopy(ref))
    assert sum(isinstance(m, fusedmha.MultiheadAttention) for m in fused.modules()) == layers
    return ref, fused


def encoder_inputs(batch_first, mask):
    N, L = 3, 7
    src = torch.randn((N, L, 16) if batch_first else (L, N, 16))
    kw = {}
    if mask == "kpm":
        kpm = torch.zeros(N, L, dtype=torch.bool)
        kpm[1, 5:] = True  # right padding (the nested-tensor fast path wants left-aligned)
        kpm[2, 3:] = True
        kw["src_key_padding_mask"] = kpm
    elif mask == "causal":
        kw.update(mask=nn.Transformer.generate_square_subsequent_mask(L), is_causal=True)
    elif mask == "am":
        kw["mask"] = bool_mask((L, L))
    return src, kw


def module_grads(loss, inputs, model):
    params = list(model.parameters())
    return torch.autograd.grad(loss, list(inputs) + params)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("mask", ["none", "kpm", "causal", "am"])
def test_transformer_encoder_with_fused_attention(batch_first, mode, mask):
    ref, fused = make_encoders(batch_first)
    assert list(fused.state_dict()) == list(ref.state_dict())
    ref.train(mode == "train")
    fused.train(mode == "train")
    src, kw = encoder_inputs(batch_first, mask)
    (sf,), (sr,) = leaves(src), leaves(src)
    out_f, out_r = fused(sf, **kw), ref(sr, **kw)
    check("encoder output", out_f, out_r)
    go = torch.randn_like(out_r)
    gf = module_grads((out_f * go).sum(), [sf], fused)
    gr = module_grads((out_r * go).sum(), [sr], ref)
    names = ["src"] + [n for n, _ in ref.named_parameters()]
    for n, a, b in zip(names, gf, gr):
        check(f"grad of {n}", a, b)


@pytest.mark.parametrize("masks", ["none", "kpm", "am2", "am3", "both"])
def test_merge_masks_like_pytorch(masks):
    """nn.MultiheadAttention.merge_masks is public and nn.TransformerEncoderLayer's fast path
    calls it on self_attn."""
    ref, mod = make_pair(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    am = kpm = None
    if masks in ("kpm", "both"):
        kpm = bool_mask((2, 5))
    if masks in ("am2", "both"):
        am = bool_mask((5, 5))
    if masks == "am3":
        am = bool_mask((8, 5, 5))
    if am is not None:  # nn.TransformerEncoderLayer hands over canonical (float) masks
        am = torch.zeros(am.shape).masked_fill(am, NEG_INF)
    if kpm is not None:
        kpm = torch.zeros(kpm.shape).masked_fill(kpm, NEG_INF)
    got = mod.merge_masks(am, kpm, x)
    exp = ref.merge_masks(am, kpm, x)
    assert got[1] == exp[1]
    assert (got[0] is None) == (exp[0] is None)
    if exp[0] is not None:
        torch.testing.assert_close(got[0], exp[0])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("mask", ["none", "kpm", "causal", "am"])
@pytest.mark.parametrize("fastpath", [True, False])
def test_transformer_encoder_eval_inference(mask, fastpath):
    """eval + no_grad + batch_first + even heads: nn.TransformerEncoderLayer's fast path reads
    self_attn's attributes (in_proj_weight, merge_masks, ...) and bypasses its forward; with
    the fast path off the fused forward runs. Both must give PyTorch's answer."""
    ref, fused = make_encoders(True)
    ref.eval()
    fused.eval()
    src, kw = encoder_inputs(True, mask)
    calls = []
    if not fastpath:  # a hook also keeps the layer off its fast path
        for m in fused.modules():
            if isinstance(m, fusedmha.MultiheadAttention):
                m.register_forward_hook(lambda *a: calls.append(1))
    old = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(fastpath)
    try:
        with torch.no_grad():
            out_f = fused(src, **kw)
            out_r = ref(src, **kw)
    finally:
        torch.backends.mha.set_fastpath_enabled(old)
    if not fastpath:
        assert len(calls) == 2
    if mask == "kpm":  # padded positions: the nested fast path gives 0 there, the slow path values
        keep = ~kw["src_key_padding_mask"]
        out_f, out_r = out_f[keep], out_r[keep]
    check("encoder output", out_f, out_r)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_transformer_decoder_layer_with_fused_attention(batch_first, mode):
    torch.manual_seed(0)
    ref = nn.TransformerDecoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=batch_first)
    for m in ref.modules():
        if isinstance(m, nn.MultiheadAttention):
            randomize_biases(m)
    fused = swap_attention(copy.deepcopy(ref))
    assert isinstance(fused.self_attn, fusedmha.MultiheadAttention)
    assert isinstance(fused.multihead_attn, fusedmha.MultiheadAttention)
    ref.train(mode == "train")
    fused.train(mode == "train")
    N, T, M = 2, 6, 9
    tgt = torch.randn((N, T, 16) if batch_first else (T, N, 16))
    mem = torch.randn((N, M, 16) if batch_first else (M, N, 16))
    mkpm = bool_mask((N, M))
    kw = dict(tgt_mask=nn.Transformer.generate_square_subsequent_mask(T), tgt_is_causal=True,
              memory_key_padding_mask=mkpm.float().masked_fill(mkpm, NEG_INF))
    tf, mf = leaves(tgt, mem)
    tr, mr = leaves(tgt, mem)
    out_f, out_r = fused(tf, mf, **kw), ref(tr, mr, **kw)
    check("decoder output", out_f, out_r)
    go = torch.randn_like(out_r)
    gf = module_grads((out_f * go).sum(), [tf, mf], fused)
    gr = module_grads((out_r * go).sum(), [tr, mr], ref)
    for n, a, b in zip(["tgt", "memory"] + [n for n, _ in ref.named_parameters()], gf, gr):
        check(f"grad of {n}", a, b)


# --------------------------------------------------------------------------------------
# torch.compile, torch.export, copies, dtype moves, autocast, meta
# --------------------------------------------------------------------------------------

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
