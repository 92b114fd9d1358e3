"""Functional API: drop-in replacements for torch.nn.functional."""

from typing import Optional

import torch
from torch import Tensor


# The op, looked up once: a decoding step finds this path cold, and the lookup through
# torch.ops cost ~7 us of it each call.
_SDPA = torch.ops.fusedmha.scaled_dot_product_attention.default


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
    broadcastable to ``(..., H, L, S)`` (for ``(N, L, E)`` inputs also ``(1, N, L, S)``, as in
    PyTorch); it is read through its strides, never expanded.
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
    value, sinks and a float ``attn_mask`` (a learnt bias: its gradient is summed inside the
    kernels into the mask's own shape). A query row whose keys are all masked gets 0 (as in
    PyTorch 2.15), never NaN. Differences from PyTorch: ``scale`` must be finite and >= 0; a
    NaN or +inf score makes its row NaN.

    Jagged nested tensors (``torch.nested.nested_tensor(..., layout=torch.jagged)`` of shape
    ``(B, j, H, E)``, passed transposed as ``(B, H, j, E)``, as PyTorch's SDPA takes them) run
    the packed-sequence kernels: every sequence attended to on its own, no work on padding,
    forward and backward; ``attn_mask`` is not supported with them (as in PyTorch).
    """
    if query.is_nested or key.is_nested or value.is_nested:
        variants = dict(window_left=window_left, window_right=window_right,
                        bottom_right=bottom_right, softcap=softcap, alibi_slopes=alibi_slopes,
                        sinks=sinks)
        return _nested_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                 enable_gqa, variants)
    op = _SDPA
    if (window_left == -1 and window_right == -1 and not bottom_right and softcap == 0.0
            and alibi_slopes is None and sinks is None):
        # SDPA's own arguments, positionally: a decoding step finds this path cold, and
        # parsing six more keyword arguments cost ~10 us of it.
        return op(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return op(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
              window_left=window_left, window_right=window_right, bottom_right=bottom_right,
              softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)


def _nested_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      variants):
    """Jagged nested (B, H, j, E) query/key/value through the varlen op: their values are the
    packed (total, H, E) rows and their offsets the cumulative lengths."""
    name = "fusedmha.scaled_dot_product_attention"
    if not (query.is_nested and key.is_nested and value.is_nested):
        raise ValueError(f"{name}: query, key and value must all be nested tensors, or none")
    if any(t.layout != torch.jagged for t in (query, key, value)):
        raise ValueError(f"{name}: nested tensors must have the jagged layout "
                         "(torch.nested.nested_tensor(..., layout=torch.jagged))")
    if attn_mask is not None:
        raise ValueError(f"{name}: attn_mask is not supported with nested tensors")
    if query.dim() != 4 or query._ragged_idx != 2 or key._ragged_idx != 2:
        raise ValueError(f"{name}: expected nested query/key/value of shape (B, H, j, E): the "
                         "(B, j, H, E) jagged tensors transposed, as PyTorch's SDPA takes them")
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError(f"{name}: query has {query.shape[1]} heads and key {key.shape[1]}; "
                         "pass enable_gqa=True for grouped-query attention")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, j, H, E), ragged dim 1
    cu_q, cu_k = q.offsets().to(torch.int32), k.offsets().to(torch.int32)
    if not torch.equal(k.offsets(), v.offsets()):
        raise ValueError(f"{name}: key and value must have the same sequence lengths")
    max_q = int(cu_q.diff().max()) if cu_q.numel() > 1 else 0
    max_k = int(cu_k.diff().max()) if cu_k.numel() > 1 else 0
    out, _, _ = torch.ops.fusedmha.varlen_attention_forward(
        q.values(), k.values(), v.values(), cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
        scale, **variants)
    nested = torch.nested.nested_tensor_from_jagged(out, q.offsets())
    return nested.transpose(1, 2)
