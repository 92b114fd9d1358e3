"""Float64 reference attention and the accuracy check the tests share."""

import math

import torch
import torch.nn.functional as F

# Error bound floors per dtype (absolute, on outputs of magnitude ~1): a
# fused kernel rounds differently from PyTorch, so it may be as far from the
# float64 truth as PyTorch is, times a small factor, or this floor.
ATOL_FLOOR = {
    torch.float64: 1e-12,
    torch.float32: 2e-6,
    torch.bfloat16: 1e-2,
    torch.float16: 2e-3,
}


def reference_attention(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """Attention in float64 with fusedmha's semantics (rows with no key to attend to give 0)."""
    v = v.double()
    if enable_gqa and q.dim() >= 3:
        v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
    return reference_probs(q, k, attn_mask, is_causal, scale, enable_gqa) @ v


def reference_probs(q, k, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """The attention probabilities in float64 (rows with no key to attend to are 0)."""
    q, k = q.double(), k.double()
    if enable_gqa and q.dim() >= 3:
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    L, S = q.size(-2), k.size(-2)
    allowed = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        allowed = allowed.tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.double()
    # Rows with no key to attend to give 0, with zero gradient: take their
    # softmax over zeros instead of all -inf (which is NaN), then drop them.
    attends = (scores > float("-inf")).any(dim=-1, keepdim=True)
    return torch.softmax(torch.where(attends, scores, torch.zeros_like(scores)), dim=-1) * attends


def assert_attention_close(out, q, k, v, **kwargs):
    """out must be as close to the float64 truth as PyTorch's own SDPA at the same dtype
    (within 2x), or within the dtype's floor."""
    ref = reference_attention(q, k, v, **kwargs)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == q.dtype
    torch_kwargs = dict(kwargs)
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.dim() < 2:  # PyTorch's CPU kernels want >= 2-D masks
        torch_kwargs["attn_mask"] = mask.expand(q.size(-2), k.size(-2))
    torch_out = F.scaled_dot_product_attention(q, k, v, **torch_kwargs)
    # Older PyTorch versions give NaN where a row has no key to attend to; compare as 0.
    torch_out = torch.nan_to_num(torch_out.double(), nan=0.0)
    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    torch_err = (torch_out - ref).abs().max().item() if out.numel() else 0.0
    bound = 2 * torch_err + ATOL_FLOOR[q.dtype] * max(1.0, ref.abs().max().item() if ref.numel() else 1.0)
    assert not torch.isnan(out).any(), "output has NaN"
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g} (PyTorch's error {torch_err:.3g})"
