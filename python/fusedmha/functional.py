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
    *,
    window_left: int = -1,
    window_right: int = -1,
    bottom_right: bool = False,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Same signature and meaning as ``torch.nn.functional.scaled_dot_product_attention``,
    plus FlashAttention's variants as keyword arguments (their defaults keep SDPA's meaning).

    query ``(..., H, L, E)``, key ``(..., H_kv, S, E)``, value ``(..., H_kv, S, Ev)``.
    ``attn_mask``: bool (True = may attend) or float (added to the scores), any shape
    broadcastable to ``(..., H, L, S)``; it is read through its strides, never expanded.
    ``is_causal``: causal mask, no tensor built, aligned top-left (query i sees keys j <= i)
    unless ``bottom_right``. ``scale`` defaults to ``1/sqrt(E)``. ``enable_gqa``: H may be a
    multiple of H_kv (K/V are not copied).

    The variants, applied in this order to each score ``s = scale * q . k``:

    - ``softcap`` > 0: ``s -> softcap * tanh(s / softcap)`` (Gemma 2).
    - ``alibi_slopes`` ``(H)`` or ``(B, H)``: ``-slope * |d - j|`` is added, with d query i's
      diagonal key (BLOOM, MPT). No gradient.
    - ``window_left``/``window_right``: query i sees keys j with ``d - window_left <= j <=
      d + window_right`` (-1 = unbounded; FlashAttention's ``window_size``); key blocks outside
      the band are skipped, not computed. ``is_causal`` sets ``window_right`` to 0.
    - ``bottom_right``: the diagonal is ``d = i + S - L`` (FlashAttention's causal alignment)
      instead of ``d = i`` (SDPA's).
    - ``sinks`` ``(H)``: a logit per head that joins each row's softmax denominator with no
      value (gpt-oss); differentiable.

    ``dropout_p`` is applied inside the fused kernel (a Philox stream seeded from PyTorch's
    default generator, replayed by the backward). Differentiable with respect to query, key,
    value and sinks. A query row whose keys are all masked gets 0 (as in PyTorch 2.15), never
    NaN. Differences from PyTorch: ``scale`` must be finite and >= 0; a NaN or +inf score makes
    its row NaN; a float mask that requires grad is refused.
    """
    return torch.ops.fusedmha.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa,
        window_left=window_left, window_right=window_right, bottom_right=bottom_right,
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
    )
