"""Under torch.autocast the attention follows PyTorch's SDPA: float32 inputs (and float masks)
run in the autocast dtype, the output comes back in it, float64 stays float64, and training
steps produce float32 gradients for float32 leaves."""

import pytest
import torch
import torch.nn.functional as F

import fusedmha


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_sdpa_dtype_and_values_follow_pytorch_under_autocast(device, mask):
    q, k, v = (torch.randn(2, 4, 33, 16, device=device) for _ in range(3))
    attn_mask = {None: None,
                 "bool": torch.rand(33, 33, device=device) > 0.2,
                 "float": torch.randn(33, 33, device=device)}[mask]
    dtype = torch.bfloat16
    with torch.autocast(torch.device(device).type, dtype=dtype):
        ours = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        ops_out, lse, _ = torch.ops.fusedmha.attention_forward(q, k, v, attn_mask)
    assert ours.dtype == theirs.dtype == ops_out.dtype == dtype
    assert lse.dtype == torch.float32
    torch.testing.assert_close(ours.float(), theirs.float(), atol=2e-2, rtol=2e-2)


def test_float64_is_left_alone_under_autocast():
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fusedmha.scaled_dot_product_attention(q, q, q).dtype == torch.float64


def test_training_step_and_weights_under_autocast():
    torch.manual_seed(0)
    mha = fusedmha.MultiheadAttention(32, 4, batch_first=True)
    ref = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    ref.load_state_dict(mha.state_dict())
    x = torch.randn(2, 9, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, w = mha(x, x, x)
        ref_out, ref_w = ref(x, x, x)
        q = torch.randn(2, 4, 9, 8, requires_grad=True)
        o = fusedmha.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert out.dtype == ref_out.dtype and w.dtype == ref_w.dtype
    torch.testing.assert_close(out.float(), ref_out.float(), atol=3e-2, rtol=3e-2)
    (out.float().sum() + o.float().sum()).backward()
    assert x.grad.dtype == torch.float32 and q.grad.dtype == torch.float32
    assert torch.isfinite(x.grad).all() and torch.isfinite(q.grad).all()
