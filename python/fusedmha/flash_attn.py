"""FlashAttention 2's Python API on fusedmha's kernels: code written for ``flash_attn`` runs on
the CPU (and on fusedmha's CUDA kernels) by changing its import.

    from fusedmha import flash_attn_func   # instead of: from flash_attn import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True, window_size=(4096, 0))

Same names, positional order, defaults, layout ``(batch, seqlen, nheads, headdim)`` and return
values as flash_attn 2; ``sinks`` is the one addition, keyword-only, at the end. Causal masks
and windows are aligned bottom-right, as FlashAttention aligns them: query i's diagonal is key
``i + seqlen_k - seqlen_q``.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               return_attn_probs, sinks):
    """q (B, L, H, E), k/v (B, S, H_kv, E) -> flash_attn's return values."""
    window_left, window_right = (int(w) for w in window_size)
    # The op's (..., H, L, E) layout as views: nothing is copied.
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    variants = dict(window_left=window_left, window_right=window_right, bottom_right=True,
                    softcap=float(softcap), alibi_slopes=alibi_slopes, sinks=sinks)
    enable_gqa = qh.shape[1] != kh.shape[1]
    out, lse, rng_state = torch.ops.fusedmha.attention_forward(
        qh, kh, vh, None, dropout_p, causal, softmax_scale, enable_gqa, **variants
    )
    out = out.transpose(1, 2)  # (B, L, H, E), contiguous: the op follows q's layout
    if not return_attn_probs:
        return out
    with torch.no_grad():
        weights = torch.ops.fusedmha.attention_weights
        probs = weights(qh, kh, lse, rng_state, None, 0.0, causal, softmax_scale, enable_gqa,
                        False, **variants)
        if dropout_p > 0:
            # flash_attn encodes the dropout pattern in the sign: negative = dropped.
            kept = weights(qh, kh, lse, rng_state, None, dropout_p, causal, softmax_scale,
                           enable_gqa, False, **variants)
            probs = torch.where((kept != 0) | (probs == 0), probs, -probs)
    return out, lse, probs


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: Optional[Tensor] = None,
):
    """flash_attn.flash_attn_func: q ``(B, L, H, E)``, k and v ``(B, S, H_kv, E)`` with H a
    multiple of H_kv (multi- and grouped-query attention, K/V not copied).

    ``softmax_scale`` defaults to ``1/sqrt(E)``; ``causal`` is aligned bottom-right;
    ``window_size=(left, right)``: query i sees keys within ``[i + S - L - left, i + S - L +
    right]`` (-1 = unbounded); ``softcap`` > 0 caps scores to ``softcap * tanh(s / softcap)``;
    ``alibi_slopes`` ``(H)`` or ``(B, H)`` add ``-slope * |i + S - L - j|``; ``sinks`` ``(H)``
    joins each row's softmax denominator with no value. ``deterministic`` is accepted for
    compatibility: the CPU backward is deterministic for a given thread count.

    Returns the output ``(B, L, H, E)``; with ``return_attn_probs``, also the log-sum-exp of
    each row ``(B, H, L)`` (float32) and the probabilities ``(B, H, L, S)``, negative where
    dropout dropped them (flash_attn's testing aid). Differentiable with respect to q, k, v and
    sinks.
    """
    del deterministic
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, return_attn_probs, sinks)


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: Optional[Tensor] = None,
):
    """flash_attn.flash_attn_qkvpacked_func: ``qkv (B, L, 3, H, E)``, otherwise as
    :func:`flash_attn_func` (read through views: the packed tensor is not split by copies)."""
    del deterministic
    q, k, v = qkv.unbind(2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, return_attn_probs, sinks)


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: Optional[Tensor] = None,
):
    """flash_attn.flash_attn_kvpacked_func: q ``(B, L, H, E)``, ``kv (B, S, 2, H_kv, E)``,
    otherwise as :func:`flash_attn_func`."""
    del deterministic
    k, v = kv.unbind(2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, return_attn_probs, sinks)


def merge_attention(outputs, lses) -> Tuple[Tensor, Tensor]:
    """Partial attention results over disjoint sets of keys, combined by their log-sum-exp
    into the result over all the keys: ``outputs`` ``(B, L, H, E)`` and ``lses``
    ``(B, H, L)``, as :func:`flash_attn_func` returns them with ``return_attn_probs=True``.
    Returns ``(output, lse)``. A partial whose lse is +inf for a row (it had no key there)
    weighs nothing; a row no partial saw gets 0 and lse +inf. Differentiable."""
    return torch.ops.fusedmha.merge_attention(list(outputs), list(lses))
