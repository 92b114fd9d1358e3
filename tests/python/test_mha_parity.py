"""fusedmha.MultiheadAttention against torch.nn.MultiheadAttention: the parity matrix (a 3-wise
covering array over the module's arguments, masks, dtypes and modes), PyTorch's own sample
inputs for the module, and inputs of every layout.

Every test builds the PyTorch module with the same arguments, copies its state_dict into
the fused one and compares forward outputs, attention weights and gradients (of inputs and
parameters). The deliberate differences are tested on their own (test_mha_masks.py):
``is_causal=True`` without ``attn_mask`` (PyTorch raises; here it means the causal mask, so
PyTorch gets that mask explicitly) and query rows whose keys are all masked (0 here, NaN in
PyTorch).
"""

import itertools
import random

import pytest
import torch
from torch import nn

from mha_inputs import (BF16, CAUSAL_KINDS, MASK_KINDS, bool_mask, fused_mha, make_inputs, make_masks, make_pair,
                        randomize_biases)
from reference import check, compare_runs, grads_of, leaves, reference_mha

pytestmark = pytest.mark.usefixtures("one_thread")


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
    # is_causal with extra keys (bias_kv / zero_attn) is tested on its own (test_mha_masks.py).
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


def run_matrix_case(row, device):
    E, H, L, S, N = SHAPES[row["shape"]]
    dtype = row["dtype"]
    kwargs = dict(bias=row["bias"], add_bias_kv=row["add_bias_kv"], add_zero_attn=row["add_zero_attn"],
                  batch_first=row["batch_first"], dropout=0.0)
    kd = vd = E
    if row["kvdim"] == "diff":
        kd, vd = E // 2 + 1, E + 8
        kwargs.update(kdim=kd, vdim=vd)
    ref, mod = make_pair(E, H, dtype=dtype, device=device, **kwargs)
    train = row["mode"] == "train"
    ref.train(train)
    mod.train(train)
    f_kw, r_kw = make_masks(row["mask"], N, H, L, S, dtype, row["batched"], device)
    weights = {"none": dict(need_weights=False), "avg": dict(need_weights=True, average_attn_weights=True),
               "per_head": dict(need_weights=True, average_attn_weights=False)}[row["weights"]]
    f_kw.update(weights)
    r_kw.update(weights)
    x = make_inputs(N, L, S, E, kd, vd, dtype, row["batched"], row["batch_first"], device)
    compare_runs(mod, ref, leaves(*x), leaves(*x), f_kw, r_kw, dtype, name=case_id(row))


@pytest.mark.parametrize("row", MATRIX, ids=[case_id(r) for r in MATRIX])
def test_parity_matrix(row, device):
    run_matrix_case(row, device)


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
def test_pytorch_module_sample_inputs(training, dtype, device):
    from torch.testing._internal.common_modules import module_inputs_torch_nn_MultiheadAttention

    samples = module_inputs_torch_nn_MultiheadAttention(
        None, device=device, dtype=dtype, requires_grad=True, training=training)
    assert len(samples) >= 32
    for i, sample in enumerate(samples):
        c_args, c_kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
        f_args, f_kwargs = sample.forward_input.args, sample.forward_input.kwargs
        torch.manual_seed(i)
        ref = nn.MultiheadAttention(*c_args, **c_kwargs, dtype=dtype, device=device)
        randomize_biases(ref)
        mod = fused_mha(*c_args, **c_kwargs, dtype=dtype, device=device)
        mod.load_state_dict(ref.state_dict())
        ref.train(training)
        mod.train(training)
        compare_runs(mod, ref, leaves(*f_args), leaves(*f_args), dict(f_kwargs), dict(f_kwargs), dtype,
                     name=f"sample {i} {c_kwargs} mask kinds {[k for k, v in f_kwargs.items() if v is not None]}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("need_weights", [False, True])
def test_padded_batch_matches_pytorch(dtype, need_weights, device):
    """A larger module (E=256, 8 heads) on a padded batch, float16 included, against PyTorch's
    module at the same dtype; every parameter gets a finite gradient."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(256, 8, batch_first=True, device=device, dtype=dtype)
    mine = fused_mha(256, 8, batch_first=True, device=device, dtype=dtype)
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(4, 100, 256, device=device, dtype=dtype)
    pad = torch.zeros(4, 100, dtype=torch.bool, device=device)
    pad[:, 90:] = True
    out, w = mine(x, x, x, key_padding_mask=pad, need_weights=need_weights)
    ref_out, ref_w = ref(x, x, x, key_padding_mask=pad, need_weights=need_weights)
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    if need_weights:
        torch.testing.assert_close(w, ref_w, rtol=tol, atol=tol)
    out.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mine.parameters())


# --------------------------------------------------------------------------------------
# inputs of every layout: self-attention, non-contiguous, unbatched; loss on the weights
# --------------------------------------------------------------------------------------


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


def test_unbatched_ignores_batch_first():
    ref, mod = make_pair(16, 4, batch_first=True)
    x = make_inputs(1, 5, 7, 16, 16, 16, torch.float32, False, True)
    for kw in (dict(), dict(average_attn_weights=False), dict(need_weights=False),
               dict(key_padding_mask=bool_mask((7,)), attn_mask=bool_mask((4, 5, 7)))):
        compare_runs(mod, ref, leaves(*x), leaves(*x), kw, dict(kw), torch.float32)


# --------------------------------------------------------------------------------------
# the float64 reference of reference.py (fully masked rows, dropout masks) is PyTorch's module
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("row", MATRIX[::9], ids=[case_id(r) for r in MATRIX[::9]])
def test_reference_mha_matches_pytorch(row):
    """Self-test of the float64 reference (reference.reference_mha) that test_mha_masks.py and
    test_mha_dropout.py use (needs no fused module)."""
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

