"""fusedmha.scaled_dot_product_attention against a float64 reference and PyTorch's SDPA."""

import itertools

import pytest
import torch

import fusedmha
from reference import assert_attention_close

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
sdpa = fusedmha.scaled_dot_product_attention


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E,Ev", [(1, 1), (7, 7), (16, 5), (64, 64), (80, 80), (128, 128), (256, 256), (33, 65)])
def test_head_dims(dtype, E, Ev):
    q, k, v = rand(2, 3, 37, E, dtype=dtype), rand(2, 3, 45, E, dtype=dtype), rand(2, 3, 45, Ev, dtype=dtype)
    assert_attention_close(sdpa(q, k, v), q, k, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L,S", [(1, 1), (1, 37), (37, 1), (64, 64), (100, 300), (300, 100), (257, 513)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_lengths(dtype, L, S, is_causal):
    q, k, v = rand(2, 2, L, 32, dtype=dtype), rand(2, 2, S, 32, dtype=dtype), rand(2, 2, S, 32, dtype=dtype)
    assert_attention_close(sdpa(q, k, v, is_causal=is_causal), q, k, v, is_causal=is_causal)


@pytest.mark.parametrize("batch", [(), (3,), (2, 3)], ids=str)
def test_batch_dims(batch):
    q, k, v = rand(*batch, 4, 19, 16), rand(*batch, 4, 23, 16), rand(*batch, 4, 23, 8)
    out = sdpa(q, k, v)
    assert out.shape == (*batch, 4, 19, 8)
    assert_attention_close(out, q, k, v)


def test_two_dim_inputs():
    q, k, v = rand(19, 16), rand(23, 16), rand(23, 8)
    assert_attention_close(sdpa(q, k, v), q, k, v)


def test_zero_size_batch():
    q, k, v = rand(0, 4, 19, 16), rand(0, 4, 23, 16), rand(0, 4, 23, 8)
    out = sdpa(q, k, v)
    assert out.shape == (0, 4, 19, 8)


def test_empty_keys_give_zero():
    q, k, v = rand(2, 4, 19, 16), rand(2, 4, 0, 16), rand(2, 4, 0, 8)
    out = sdpa(q, k, v)
    assert out.shape == (2, 4, 19, 8)
    assert torch.equal(out, torch.zeros_like(out))


MASK_SHAPES = [(19, 23), (1, 23), (19, 1), (4, 19, 23), (2, 1, 19, 23), (2, 4, 19, 23), (1, 1, 1, 23), (23,)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "float", "float32"])
def test_masks(dtype, mask_shape, kind):
    q, k, v = rand(2, 4, 19, 16, dtype=dtype), rand(2, 4, 23, 16, dtype=dtype), rand(2, 4, 23, 8, dtype=dtype)
    if kind == "bool":
        mask = torch.rand(mask_shape) > 0.3
    else:
        mask = torch.randn(mask_shape, dtype=dtype if kind == "float" else torch.float32)
        mask = mask.masked_fill(torch.rand(mask_shape) < 0.2, float("-inf"))
    assert_attention_close(sdpa(q, k, v, attn_mask=mask), q, k, v, attn_mask=mask)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_are_zero(kind):
    q, k, v = rand(2, 4, 19, 16), rand(2, 4, 23, 16), rand(2, 4, 23, 8)
    allowed = torch.rand(2, 4, 19, 23) > 0.3
    allowed[:, :, 5] = False  # row 5 attends to nothing
    allowed[1, 2, :] = False  # one whole head attends to nothing
    mask = allowed if kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    out = sdpa(q, k, v, attn_mask=mask)
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2]))
    assert_attention_close(out, q, k, v, attn_mask=mask)
    _, lse, _ = torch.ops.fusedmha.attention_forward(q, k, v, mask)
    assert torch.isinf(lse[:, :, 5]).all() and (lse[:, :, 5] > 0).all()


def test_mask_is_not_expanded_in_memory():
    # A (L, S) mask expanded to a huge batch is read through stride-0 dims.
    q, k, v = rand(64, 2, 19, 16), rand(64, 2, 23, 16), rand(64, 2, 23, 8)
    mask = (torch.rand(19, 23) > 0.5).expand(64, 2, 19, 23)
    assert mask.stride()[:2] == (0, 0)
    assert_attention_close(sdpa(q, k, v, attn_mask=mask), q, k, v, attn_mask=mask)


def test_mask_strided_columns():
    q, k, v = rand(2, 4, 19, 16), rand(2, 4, 23, 16), rand(2, 4, 23, 8)
    mask = torch.randn(2, 4, 23, 19).transpose(-1, -2)  # column stride 19
    assert_attention_close(sdpa(q, k, v, attn_mask=mask), q, k, v, attn_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hq,hk", [(8, 1), (8, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gqa(dtype, hq, hk, is_causal):
    q, k, v = rand(2, hq, 33, 16, dtype=dtype), rand(2, hk, 41, 16, dtype=dtype), rand(2, hk, 41, 16, dtype=dtype)
    out = sdpa(q, k, v, is_causal=is_causal, enable_gqa=True)
    assert_attention_close(out, q, k, v, is_causal=is_causal, enable_gqa=True)


def test_gqa_with_mask():
    q, k, v = rand(2, 8, 33, 16), rand(2, 2, 41, 16), rand(2, 2, 41, 16)
    mask = torch.rand(8, 33, 41) > 0.4
    out = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    assert_attention_close(out, q, k, v, attn_mask=mask, enable_gqa=True)


def test_broadcast_batch_and_heads():
    # PyTorch's SDPA broadcasts batch and head dims of size 1 (like matmul).
    q, k, v = rand(2, 3, 19, 16), rand(1, 1, 23, 16), rand(2, 1, 23, 8)
    assert_attention_close(sdpa(q, k, v), q, k, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_transposed_inputs_are_read_in_place(dtype, is_causal):
    # (B, L, H, E) projections viewed as (B, H, L, E): the usual MHA layout.
    B, H, L, S, E = 2, 4, 37, 29, 16
    q = rand(B, L, H, E, dtype=dtype).transpose(1, 2)
    k = rand(B, S, H, E, dtype=dtype).transpose(1, 2)
    v = rand(B, S, H, E, dtype=dtype).transpose(1, 2)
    assert not q.is_contiguous()
    out = sdpa(q, k, v, is_causal=is_causal)
    assert_attention_close(out, q, k, v, is_causal=is_causal)


def test_sliced_and_non_contiguous_last_dim():
    base = rand(2, 4, 40, 48)
    q = base[:, :, 3:22, 8:24]  # row stride 48, offset
    k = rand(2, 4, 16, 23).transpose(-1, -2)  # last dim not contiguous: copied once
    v = rand(2, 4, 23, 16)[..., ::2]  # last dim stride 2
    assert_attention_close(sdpa(q, k, v), q, k, v)


@pytest.mark.parametrize("Ev", [16, 8])
@pytest.mark.parametrize("q_layout", ["contiguous", "BLHE"])
def test_output_layout_matches_pytorch(Ev, q_layout):
    # Like PyTorch, the output follows the query's layout: a (B, L, H, E) query viewed as
    # (B, H, L, E) gives (B, L, H, Ev) memory, so merging heads afterwards is a view.
    q = rand(2, 4, 19, 16) if q_layout == "contiguous" else rand(2, 19, 4, 16).transpose(1, 2)
    k, v = rand(2, 4, 23, 16), rand(2, 4, 23, Ev)
    out = sdpa(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert out.shape == ref.shape
    if Ev == 16:  # PyTorch's fused kernel; its math fallback (Ev != E) is always contiguous
        assert out.stride() == ref.stride()
    assert out.is_contiguous() == (q_layout == "contiguous")


@pytest.mark.parametrize("scale", [0.0, 0.05, 1.0, 3.7])
def test_scale(scale):
    q, k, v = rand(2, 4, 19, 16), rand(2, 4, 23, 16), rand(2, 4, 23, 8)
    assert_attention_close(sdpa(q, k, v, scale=scale), q, k, v, scale=scale)


def test_long_keys():
    q, k, v = rand(1, 1, 4, 32), rand(1, 1, 20000, 32), rand(1, 1, 20000, 32)
    assert_attention_close(sdpa(q, k, v), q, k, v)


def test_large_scores_are_stable():
    # Scores of ~±1000 overflow a naive exp; the running max keeps them finite.
    q, k, v = rand(1, 2, 33, 16) * 30, rand(1, 2, 300, 16) * 30, rand(1, 2, 300, 16)
    out = sdpa(q, k, v)
    assert torch.isfinite(out).all()
    assert_attention_close(out, q, k, v)


def test_matches_pytorch_positional_and_keyword_calls():
    q, k, v = rand(2, 4, 19, 16), rand(2, 4, 23, 16), rand(2, 4, 23, 8)
    mask = torch.rand(19, 23) > 0.2
    a = sdpa(q, k, v, mask, 0.0, False, scale=0.3)
    b = sdpa(query=q, key=k, value=v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=0.3)
    assert torch.equal(a, b)


def test_cpp_op_and_functional_agree():
    q, k, v = rand(2, 4, 19, 16), rand(2, 4, 23, 16), rand(2, 4, 23, 8)
    out, lse, _ = torch.ops.fusedmha.attention_forward(q, k, v)
    assert torch.equal(out, sdpa(q, k, v))
    assert lse.shape == (2, 4, 19) and lse.dtype == torch.float32
    ref_lse = torch.logsumexp((q.double() @ k.double().transpose(-1, -2)) / 4.0, dim=-1)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_inference_mode_and_no_grad():
    q, k, v = rand(2, 4, 19, 16), rand(2, 4, 23, 16), rand(2, 4, 23, 8)
    with torch.inference_mode():
        a = sdpa(q, k, v)
    with torch.no_grad():
        b = sdpa(q, k, v)
    assert torch.equal(a, b)


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_count_does_not_change_result(threads):
    q, k, v = rand(1, 1, 300, 64), rand(1, 1, 300, 64), rand(1, 1, 300, 64)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = sdpa(q, k, v, is_causal=True)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(out, sdpa(q, k, v, is_causal=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_propagates_like_exact_softmax(dtype):
    q, k, v = rand(1, 2, 9, 16, dtype=dtype), rand(1, 2, 300, 16, dtype=dtype), rand(1, 2, 300, 16, dtype=dtype)
    q[0, 0, 3, 5] = float("nan")  # one query row
    k[0, 1, 200, 0] = float("nan")  # one key: every query of head 1 sees it
    v[0, 0, 7, 2] = float("nan")  # one value entry: column 2 of head 0
    out = sdpa(q, k, v)
    assert out[0, 0, 3].isnan().all()
    assert out[0, 1].isnan().all()
    assert out[0, 0, :, 2].isnan().all()
    rows = [i for i in range(9) if i != 3]
    assert not out[0, 0, rows][:, [0, 1, 3]].isnan().any()


def test_positive_infinite_mask_gives_nan_row():
    q, k, v = rand(1, 1, 4, 8), rand(1, 1, 6, 8), rand(1, 1, 6, 8)
    mask = torch.zeros(4, 6)
    mask[1, 2] = float("inf")
    out = sdpa(q, k, v, attn_mask=mask)
    assert out[0, 0, 1].isnan().all() and not out[0, 0, [0, 2, 3]].isnan().any()
