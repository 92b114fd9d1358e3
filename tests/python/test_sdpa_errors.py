"""Bad input raises a RuntimeError that names the argument and what was expected."""

import re

import pytest
import torch

import fusedmha

sdpa = fusedmha.scaled_dot_product_attention


def qkv(B=2, H=4, L=5, S=7, E=8, Ev=6, dtype=torch.float32):
    return (torch.randn(B, H, L, E, dtype=dtype), torch.randn(B, H, S, E, dtype=dtype),
            torch.randn(B, H, S, Ev, dtype=dtype))


def raises(match, *args, **kwargs):
    with pytest.raises(RuntimeError, match=match):
        sdpa(*args, **kwargs)
    # The op itself (what C++ and torch.compile call) raises the same.
    with pytest.raises(RuntimeError, match=match):
        torch.ops.fusedmha.attention_forward(*args, **kwargs)


def test_rank_too_small():
    q, k, v = qkv()
    raises(r"at least 2 dims.*query.dim\(\)=1", q[0, 0, 0], k, v)
    raises(r"key.dim\(\)=1", q, k[0, 0, 0], v)


def test_embedding_dim_mismatch():
    q, k, v = qkv()
    raises(r"key's last dim \(E\) to equal query's", q, k[..., :5], v)


def test_sequence_length_mismatch():
    q, k, v = qkv()
    raises(r"value's sequence length.*to equal key's", q, k, v[:, :, :6])


def test_batch_mismatch():
    q, k, v = qkv()
    raises(r"batch dims of query, key and value must be broadcastable", q, torch.randn(3, 4, 7, 8), torch.randn(3, 4, 7, 6))


def test_head_mismatch_without_gqa():
    q, k, v = qkv(H=4)
    k2, v2 = torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 6)
    raises(r"same number of heads.*enable_gqa=True", q, k2, v2)


def test_gqa_heads_must_divide():
    q = torch.randn(2, 6, 5, 8)
    k, v = torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 6)
    raises(r"enable_gqa=True the number of heads in key \(4\).*must divide.*query \(6\)", q, k, v, enable_gqa=True)


def test_gqa_zero_kv_heads():
    q = torch.randn(1, 4, 5, 8)
    raises(r"key and value need at least one head", q, torch.randn(1, 0, 6, 8), torch.randn(1, 0, 6, 8), enable_gqa=True)


def test_dtype_mismatch():
    q, k, v = qkv()
    raises(r"same dtype.*key.dtype=Double", q, k.double(), v)
    raises(r"same dtype.*value.dtype=BFloat16", q, k, v.bfloat16())


def test_integer_inputs():
    q, k, v = qkv()
    raises(r"query of dtype float32, float64, bfloat16 or float16, got Long", q.long(), k.long(), v.long())


def test_device_mismatch():
    q, k, v = qkv()
    raises(r"same device.*key on meta", q, k.to("meta"), v)


def test_mask_integer_dtype():
    q, k, v = qkv()
    raises(r"attn_mask of dtype bool, float32 or the query's dtype.*got Long", q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.long))


def test_mask_other_float_dtype():
    q, k, v = qkv(dtype=torch.bfloat16)
    raises(r"attn_mask of dtype.*got Double", q, k, v, attn_mask=torch.zeros(5, 7, dtype=torch.double))


@pytest.mark.parametrize("shape", [(4, 7), (5, 6), (3, 5, 7), (1, 2, 4, 5, 7), (2, 4, 5, 7, 1)])
def test_mask_not_broadcastable(shape):
    q, k, v = qkv()
    raises(r"attn_mask of shape .* is not broadcastable to the attention shape", q, k, v,
           attn_mask=torch.ones(shape, dtype=torch.bool))


@pytest.mark.parametrize("shape", [(2, 4, 5, 7), (1, 1, 4, 5, 7), (1, 3, 5, 7), (1, 4, 5, 6)])
def test_mask_beyond_three_dim_inputs(shape):
    # PyTorch takes a (1, N, L, S) mask for (N, L, E) inputs, and refuses these. The error
    # shows the shape passed.
    q, k, v = (t[0] for t in qkv())
    shown = re.escape(str(list(shape)))
    with pytest.raises(RuntimeError, match=rf"attn_mask of shape {shown} is not broadcastable to the attention shape"):
        sdpa(q, k, v, attn_mask=torch.ones(shape, dtype=torch.bool))


def test_mask_device_mismatch():
    q, k, v = qkv()
    raises(r"attn_mask on the query's device", q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.bool, device="meta"))


def test_mask_with_causal():
    """PyTorch's rule at the SDPA front door; the op itself applies both (MultiheadAttention's
    causal attention with a key padding mask relies on it)."""
    q, k, v = qkv()
    mask = torch.rand(5, 7) > 0.3
    mask[:, 0] = True
    with pytest.raises(RuntimeError, match=r"attn_mask should not be set when is_causal=True"):
        sdpa(q, k, v, attn_mask=mask, is_causal=True)
    both = torch.ops.fusedmha.attention_forward(q, k, v, mask, is_causal=True)[0]
    causal = torch.ones(5, 7, dtype=torch.bool).tril()
    torch.testing.assert_close(both, sdpa(q, k, v, attn_mask=mask & causal))


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_dropout_out_of_range(p):
    q, k, v = qkv()
    raises(r"dropout_p must be in \[0, 1\)", q, k, v, dropout_p=p)


def test_dropout_one_drops_everything():
    """As F.scaled_dot_product_attention: zeros, and zero gradients (the op itself takes p < 1)."""
    q, k, v = (t.requires_grad_() for t in qkv())
    out = sdpa(q, k, v, dropout_p=1.0)
    assert out.shape == (2, 4, 5, 6) and (out == 0).all()
    out.sum().backward()
    assert all((t.grad == 0).all() for t in (q, k, v))
    with pytest.raises(RuntimeError, match=r"dropout_p must be in \[0, 1\)"):
        torch.ops.fusedmha.attention_forward(q, k, v, dropout_p=1.0)


@pytest.mark.parametrize("scale", [-1.0, float("inf"), float("nan")])
def test_bad_scale(scale):
    q, k, v = qkv()
    raises(r"scale must be a finite number >= 0", q, k, v, scale=scale)


def test_double_backward_is_refused():
    q, k, v = (t.double().requires_grad_() for t in qkv())
    out = sdpa(q, k, v)
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"double backward .* is not supported"):
        gq.sum().backward()


def test_backward_op_checks_its_extra_inputs():
    q, k, v = qkv()
    out, lse, rng = torch.ops.fusedmha.attention_forward(q, k, v)
    bwd = torch.ops.fusedmha.attention_backward
    with pytest.raises(RuntimeError, match=r"expected grad_out of the forward output's shape"):
        bwd(out[:, :, :4], q, k, v, out, lse, rng, None, 0.0, False, None, False)
    with pytest.raises(RuntimeError, match=r"expected out of dtype Float"):
        bwd(out, q, k, v, out.double(), lse, rng, None, 0.0, False, None, False)
    with pytest.raises(RuntimeError, match=r"expected logsumexp as attention_forward returns it"):
        bwd(out, q, k, v, out, lse.double(), rng, None, 0.0, False, None, False)
    with pytest.raises(RuntimeError, match=r"expected rng_state as attention_forward returns it"):
        bwd(out, q, k, v, out, lse, rng[:1], None, 0.0, False, None, False)


def test_errors_name_the_entry_point_called():
    """Each entry point's errors start with its own name, not another door's."""
    q, k, v = qkv()
    bad_k = k[..., :5]
    with pytest.raises(RuntimeError, match=r"^fusedmha\.scaled_dot_product_attention: "):
        sdpa(q, bad_k, v)
    with pytest.raises(RuntimeError, match=r"^fusedmha\.attention_forward: "):
        torch.ops.fusedmha.attention_forward(q, bad_k, v)
    out, lse, rng = torch.ops.fusedmha.attention_forward(q, k, v)
    with pytest.raises(RuntimeError, match=r"^fusedmha\.attention_backward: .*grad_out"):
        torch.ops.fusedmha.attention_backward(out[..., :3], q, k, v, out, lse, rng, None, 0.0,
                                              False, None, False)
    with pytest.raises(RuntimeError, match=r"^fusedmha\.attention_backward: "):
        torch.ops.fusedmha.attention_backward(out, q, bad_k, v, out, lse, rng, None, 0.0,
                                              False, None, False)
    with pytest.raises(RuntimeError, match=r"^fusedmha\.attention_weights: .*logsumexp"):
        torch.ops.fusedmha.attention_weights(q, k, lse[..., :2], rng)


def test_backward_op_checks_grad_logsumexp():
    q, k, v = qkv()
    out, lse, rng = torch.ops.fusedmha.attention_forward(q, k, v)
    args = (torch.randn_like(out), q, k, v, out, lse, rng, None, 0.0, False, None, False)
    with pytest.raises(RuntimeError, match=r"^fusedmha\.attention_backward: expected grad_logsumexp"):
        torch.ops.fusedmha.attention_backward(*args, grad_logsumexp=lse[..., :2])
    # The right shape is taken, and shifts the gradients (it adds dlse·P to the scores').
    plain = torch.ops.fusedmha.attention_backward(*args)
    shifted = torch.ops.fusedmha.attention_backward(*args, grad_logsumexp=torch.ones_like(lse))
    assert not torch.equal(plain[0], shifted[0])
