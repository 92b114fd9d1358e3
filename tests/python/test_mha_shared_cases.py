"""The mask and argument cases of tests/data/mha_cases.txt, which the C++ module's tests
(tests/cpp/test_multihead_attention.cpp) run too: fusedmha.MultiheadAttention against
nn.MultiheadAttention with the same parameters, in float64 — output, weights, and the
gradients of the inputs and of every parameter."""

import pathlib

import pytest
import torch

from mha_inputs import bool_mask, causal_bool, float_mask, make_pair

CASES_FILE = pathlib.Path(__file__).resolve().parents[1] / "data" / "mha_cases.txt"
COLUMNS = ("name batch_first batched inputs attn_mask key_padding_mask need_weights average "
           "is_causal bias add_bias_kv add_zero_attn kdim vdim").split()
E, H, N, L, S = 16, 4, 3, 5, 7


def read_cases():
    cases = []
    for line in CASES_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            values = line.split()
            assert len(values) == len(COLUMNS), line
            case = dict(zip(COLUMNS, values))
            for key in COLUMNS[1:]:
                if key not in ("inputs", "attn_mask", "key_padding_mask"):
                    case[key] = int(case[key])
            cases.append(case)
    return cases


CASES = read_cases()


def make_mask(kind, shape, L_, S_):
    """(fused mask, PyTorch mask): the same values; PyTorch gets lower-precision masks
    widened and the causal hint's mask as it is."""
    if kind == "none":
        return None, None
    if kind in ("bool", "bool3d"):
        m = bool_mask(shape)
        return m, m
    if kind in ("float", "float3d"):
        m = float_mask(shape, torch.float64)
        return m, m
    if kind == "lowp":
        m = float_mask(shape, torch.float32)
        return m, m.double()
    if kind == "causal":
        m = causal_bool(L_, S_)
        return m, m
    raise ValueError(kind)


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_shared_case_matches_pytorch(case):
    kdim = case["kdim"] or E
    vdim = case["vdim"] or E
    ref, mod = make_pair(E, H, bias=bool(case["bias"]), add_bias_kv=bool(case["add_bias_kv"]),
                         add_zero_attn=bool(case["add_zero_attn"]), kdim=kdim, vdim=vdim,
                         batch_first=bool(case["batch_first"]), dtype=torch.float64)
    batched, batch_first = case["batched"], case["batch_first"]
    S_ = L if case["inputs"] == "self" else S

    def shaped(length, dim):
        if not batched:
            return (length, dim)
        return (N, length, dim) if batch_first else (length, N, dim)

    q = torch.randn(shaped(L, E), dtype=torch.float64)
    if case["inputs"] == "self":
        k = v = q
    elif case["inputs"] == "kv":
        k = v = torch.randn(shaped(S_, kdim), dtype=torch.float64)
    else:
        k, v = torch.randn(shaped(S_, kdim), dtype=torch.float64), torch.randn(shaped(S_, vdim), dtype=torch.float64)

    heads_first = (N * H,) if batched else (H,)
    am_shape = heads_first + (L, S_) if case["attn_mask"].endswith("3d") else (L, S_)
    am, ref_am = make_mask(case["attn_mask"], am_shape, L, S_)
    kpm, ref_kpm = make_mask(case["key_padding_mask"], (N, S_) if batched else (S_,), L, S_)
    is_causal = bool(case["is_causal"])
    if is_causal and ref_am is None:
        ref_am = causal_bool(L, S_)  # PyTorch wants the causal mask given; fusedmha does not

    def run(module, attn_mask, key_padding_mask, causal):
        leaves = {}
        for name, t in (("q", q), ("k", k), ("v", v)):
            same = next((leaves[n] for n, u in (("q", q), ("k", k)) if n in leaves and u is t), None)
            leaves[name] = same if same is not None else t.detach().clone().requires_grad_()
        module.zero_grad()
        out, weights = module(leaves["q"], leaves["k"], leaves["v"],
                              key_padding_mask=key_padding_mask, need_weights=bool(case["need_weights"]),
                              attn_mask=attn_mask, average_attn_weights=bool(case["average"]),
                              is_causal=causal)
        out.pow(2).sum().backward()
        grads = [leaves[n].grad for n in ("q", "k", "v")]
        return out, weights, grads, {n: p.grad for n, p in module.named_parameters()}

    out, w, grads, pgrads = run(mod, am, kpm, is_causal)
    # PyTorch takes the causal mask explicitly (its is_causal is only a hint).
    ref_out, ref_w, ref_grads, ref_pgrads = run(ref, ref_am, ref_kpm, False)
    tol = dict(rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(out, ref_out, **tol)
    if case["need_weights"]:
        torch.testing.assert_close(w, ref_w, **tol)
    else:
        assert w is None and ref_w is None
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, **tol)
    assert pgrads.keys() == ref_pgrads.keys()
    for name in pgrads:
        torch.testing.assert_close(pgrads[name], ref_pgrads[name], **tol, msg=lambda m: f"{name}: {m}")


def test_every_kind_of_the_table_is_used():
    """The table keeps covering each kind it documents."""
    used = {key: {c[key] for c in CASES} for key in ("inputs", "attn_mask", "key_padding_mask")}
    assert used["inputs"] == {"self", "kv", "cross"}
    assert used["attn_mask"] == {"none", "bool", "float", "bool3d", "float3d", "lowp", "causal"}
    assert used["key_padding_mask"] >= {"none", "bool", "float", "lowp"}
    for flag in ("batch_first", "batched", "need_weights", "average", "is_causal", "bias",
                 "add_bias_kv", "add_zero_attn"):
        assert {c[flag] for c in CASES} == {0, 1}, flag
