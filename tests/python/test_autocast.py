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


def test_training_step_with_grad_scaler_follows_pytorch(device):
    """A float16 mixed-precision step as users write it (autocast + GradScaler + optimizer) on
    fusedmha.MultiheadAttention gives the gradients and parameters of the same step on
    nn.MultiheadAttention with the same weights."""
    torch.manual_seed(0)
    mods = [fusedmha.MultiheadAttention(32, 4, batch_first=True).to(device)]
    mods.append(torch.nn.MultiheadAttention(32, 4, batch_first=True).to(device))
    mods[1].load_state_dict(mods[0].state_dict())
    x = torch.randn(3, 17, 32, device=device)
    target = torch.randn(3, 17, 32, device=device)
    mask = torch.rand(3, 17, device=device) < 0.2  # key padding
    mask[:, 0] = False
    grads, params = [], []
    for mod in mods:
        opt = torch.optim.SGD(mod.parameters(), lr=0.5)
        scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=2.0 ** 10)
        with torch.autocast(torch.device(device).type, dtype=torch.float16):
            out, _ = mod(x, x, x, key_padding_mask=mask, need_weights=False)
            assert out.dtype == torch.float16
            loss = torch.nn.functional.mse_loss(out.float(), target)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grads.append([p.grad.clone() for p in mod.parameters()])
        scaler.step(opt)
        scaler.update()
        params.append([p.detach().clone() for p in mod.parameters()])
    for name, g, g_ref in zip([n for n, _ in mods[0].named_parameters()], *grads):
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), name
        torch.testing.assert_close(g, g_ref, atol=2e-3 * max(1.0, g_ref.abs().max().item()),
                                   rtol=3e-2, msg=lambda m: f"grad of {name}: {m}")
    for p, p_ref in zip(*params):
        torch.testing.assert_close(p, p_ref, atol=2e-3, rtol=3e-2)
