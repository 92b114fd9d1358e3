"""Functional API: drop-in replacements for torch.nn.functional."""

from typing import Optional

import torch
from torch import Tensor


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Same signature and meaning as ``torch.nn.functional.scaled_dot_product_attention``.

    query ``(..., H, L, E)``, key ``(..., H_kv, S, E)``, value ``(..., H_kv, S, Ev)``.
    ``attn_mask``: bool (True = may attend) or float (added to the scores), any shape
    broadcastable to ``(..., H, L, S)``; it is read through its strides, never expanded.
    ``is_causal``: top-left aligned causal mask, no tensor built. ``scale`` defaults to
    ``1/sqrt(E)``. ``enable_gqa``: H may be a multiple of H_kv (K/V are not copied).

    ``dropout_p`` is applied inside the fused kernel (a Philox stream seeded from PyTorch's
    default generator, replayed by the backward). Differentiable with respect to query, key
    and value. A query row whose keys are all masked gets 0 (as in PyTorch 2.15), never NaN.
    Differences from PyTorch: ``scale`` must be finite and >= 0; a NaN or +inf score makes
    its row NaN; a float mask that requires grad is refused.
    """
    return torch.ops.fusedmha.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )
