"""Random search over shapes, layouts and masks: fusedmha must match the float64 reference."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fusedmha  # noqa: E402
from reference import assert_attention_close  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def make(shape, dtype, layout, draw):
    """A tensor of `shape` with a layout drawn from: contiguous, a transposed (L, H) view, a
    slice of a bigger tensor, or a non-contiguous last dim."""
    if layout == "transposed" and len(shape) >= 3:
        perm = list(range(len(shape)))
        perm[-3], perm[-2] = perm[-2], perm[-3]
        base = torch.randn([shape[i] for i in perm], dtype=dtype)
        return base.permute(perm)
    if layout == "sliced":
        pad = draw(st.integers(1, 3))
        base = torch.randn(*shape[:-2], shape[-2] + pad, shape[-1] + pad, dtype=dtype)
        return base[..., pad:, :shape[-1]]
    if layout == "strided_last":
        return torch.randn(*shape[:-1], shape[-1] * 2, dtype=dtype)[..., ::2]
    return torch.randn(shape, dtype=dtype)


@st.composite
def attention_case(draw):
    dtype = draw(st.sampled_from(DTYPES))
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    hk = draw(st.integers(1, 3))
    gqa = draw(st.booleans())
    hq = hk * draw(st.integers(1, 3)) if gqa else hk
    L, S = draw(st.integers(1, 80)), draw(st.integers(1, 80))
    E, Ev = draw(st.integers(1, 70)), draw(st.integers(1, 70))
    layouts = st.sampled_from(["contiguous", "transposed", "sliced", "strided_last"])
    q = make((*batch, hq, L, E), dtype, draw(layouts), draw)
    k = make((*batch, hk, S, E), dtype, draw(layouts), draw)
    v = make((*batch, hk, S, Ev), dtype, draw(layouts), draw)
    kwargs = {"enable_gqa": gqa}
    kind = draw(st.sampled_from(["none", "causal", "bool", "float"]))
    if kind == "causal":
        kwargs["is_causal"] = True
    elif kind in ("bool", "float"):
        full = (*batch, hq, L, S)
        keep = draw(st.lists(st.booleans(), min_size=len(full), max_size=len(full)))
        shape = tuple(n if kept else 1 for n, kept in zip(full, keep))
        shape = shape[draw(st.integers(0, len(shape) - 1)):]  # drop some leading dims
        if kind == "bool":
            mask = torch.rand(shape) > draw(st.floats(0.0, 0.9))
        else:
            mask = torch.randn(shape, dtype=draw(st.sampled_from([dtype, torch.float32])))
        kwargs["attn_mask"] = mask
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.floats(0.0, 2.0))
    return q, k, v, kwargs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attention_case())
def test_random_cases_match_reference(case):
    q, k, v, kwargs = case
    out = fusedmha.scaled_dot_product_attention(q, k, v, **kwargs)
    assert_attention_close(out, q, k, v, **kwargs)
