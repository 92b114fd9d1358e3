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


def _check_deterministic(deterministic, name, *tensors):
    """flash_attn's ``deterministic=True``: a CUDA backward without atomics. The flag cannot
    travel with the autograd graph to the backward, so fusedmha's switch is PyTorch's own: under
    ``torch.use_deterministic_algorithms(True)`` the CUDA backward takes the kernels that write
    each gradient row once. Asking for it without that switch is an error, not a silent no-op.
    (The CPU backward is always deterministic for a given thread count.)"""
    if (deterministic and any(t.is_cuda and t.requires_grad for t in tensors)
            and torch.is_grad_enabled() and not torch.are_deterministic_algorithms_enabled()):
        raise RuntimeError(
            f"fusedmha.{name}: deterministic=True on CUDA needs "
            "torch.use_deterministic_algorithms(True) (or warn_only=True) while the backward "
            "runs: the flag cannot reach the backward through autograd")


def _check_dims(name, **tensors):
    """flash_attn's layouts have a fixed number of dims: name=(tensor, dims) pairs."""
    for arg, (t, dims) in tensors.items():
        if not isinstance(t, Tensor) or t.dim() != dims:
            got = f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"fusedmha.{name}: expected {arg} with {dims} dims "
                             f"({_LAYOUTS[dims]}), got {got}")


# Looked up once (a decoding step finds flash_attn_with_kvcache cold: see there).
_WITH_KVCACHE = torch.ops.fusedmha.attention_with_kvcache.default

_LAYOUTS = {3: "total, nheads, headdim", 4: "batch, seqlen, nheads, headdim",
            5: "batch, seqlen, 2 or 3, nheads, headdim"}


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               return_attn_probs, sinks, name="flash_attn_func"):
    """q (B, L, H, E), k/v (B, S, H_kv, E) -> flash_attn's return values."""
    _check_dims(name, q=(q, 4), k=(k, 4), v=(v, 4))
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
    joins each row's softmax denominator with no value. ``deterministic=True`` on CUDA needs
    ``torch.use_deterministic_algorithms(True)``, under which the CUDA backward runs without
    atomics; the CPU backward is deterministic for a given thread count.

    Returns the output ``(B, L, H, E)``; with ``return_attn_probs``, also the log-sum-exp of
    each row ``(B, H, L)`` (float32) and the probabilities ``(B, H, L, S)``, negative where
    dropout dropped them (flash_attn's testing aid). Differentiable with respect to q, k, v and
    sinks.
    """
    _check_deterministic(deterministic, "flash_attn_func", q, k, v)
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
    _check_deterministic(deterministic, "flash_attn_qkvpacked_func", qkv)
    _check_dims("flash_attn_qkvpacked_func", qkv=(qkv, 5))
    q, k, v = qkv.unbind(2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, return_attn_probs, sinks, "flash_attn_qkvpacked_func")


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
    _check_deterministic(deterministic, "flash_attn_kvpacked_func", q, kv)
    _check_dims("flash_attn_kvpacked_func", q=(q, 4), kv=(kv, 5))
    k, v = kv.unbind(2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, return_attn_probs, sinks, "flash_attn_kvpacked_func")


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[Tensor] = None,
    *,
    sinks: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
):
    """flash_attn.flash_attn_varlen_func: a packed batch of sequences of their own lengths,
    with no work spent on padding. q ``(total_q, H, E)``, k and v ``(total_k, H_kv, E)``;
    sequence b is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v (int32 ``(B + 1)``); ``max_seqlen_q/k``
    are at least every sequence's length (on the CPU this is checked).

    Each sequence is attended to on its own, as :func:`flash_attn_func` would attend to it
    alone: ``causal``, ``window_size`` and ALiBi are aligned bottom-right within it.
    ``alibi_slopes`` is ``(H)`` or ``(B, H)``; ``sinks`` ``(H)`` and ``seqused_k`` (int32
    ``(B)``: sequence b uses only its first ``seqused_k[b]`` keys) are keyword-only additions.
    With ``block_table`` (int32 ``(B, pages per sequence)``), k and v are a paged cache
    ``(num_pages, page_size, H_kv, E)``: key j of sequence b is row ``j % page_size`` of page
    ``block_table[b, j // page_size]``, and ``cu_seqlens_k`` only gives the key counts (forward
    only, like FlashAttention's).

    Returns the output ``(total_q, H, E)``; with ``return_attn_probs``, also the log-sum-exp
    ``(H, total_q)`` (float32) and the probabilities ``(B, H, max_seqlen_q, max_seqlen_k)``,
    zero outside each sequence and negative where dropout dropped them. Differentiable with
    respect to q, k, v and sinks.
    """
    _check_deterministic(deterministic, "flash_attn_varlen_func", q, k, v)
    if block_table is not None and return_attn_probs:
        raise ValueError("fusedmha.flash_attn_varlen_func: return_attn_probs is not supported "
                         "with block_table (a paged KV cache)")
    window_left, window_right = (int(w) for w in window_size)
    variants = dict(window_left=window_left, window_right=window_right, bottom_right=True,
                    softcap=float(softcap), alibi_slopes=alibi_slopes, sinks=sinks)
    out, lse, rng_state = torch.ops.fusedmha.varlen_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), dropout_p,
        causal, softmax_scale, **variants, seqused_k=seqused_k, block_table=block_table
    )
    if not return_attn_probs:
        return out
    with torch.no_grad():
        probs = _varlen_probs(q, k, lse, rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, seqused_k, dropout_p, causal, softmax_scale, variants)
    return out, lse, probs


def _varlen_probs(q, k, lse, rng_state, cu_q, cu_k, max_q, max_k, seqused_k, dropout_p, causal,
                  softmax_scale, variants):
    """flash_attn's testing aid for a packed batch: each sequence's probabilities, padded
    into ``(B, H, max_q, max_k)``, negative where dropout dropped them."""
    batch = cu_q.numel() - 1
    h, h_kv = q.shape[1], k.shape[1]
    probs = q.new_zeros(batch, h, max_q, max_k)
    weights = torch.ops.fusedmha.attention_weights
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    used = seqused_k.tolist() if seqused_k is not None else None
    if dropout_p > 0:  # every sequence's elements (b·H + h, i, j), drawn once
        keep = torch.ops.fusedmha._dropout_keep_mask(rng_state, batch * h, max_q, max_k,
                                                     dropout_p).view(batch, h, max_q, max_k)
    for b in range(batch):
        # Sequence b alone, with its dropout elements (b·H + h, i, j).
        q0, q1, k0 = cu_q[b], cu_q[b + 1], cu_k[b]
        k1 = k0 + used[b] if used is not None else cu_k[b + 1]
        qb, kb = q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1)
        one = dict(variants)
        if one["alibi_slopes"] is not None and one["alibi_slopes"].dim() == 2:
            one["alibi_slopes"] = one["alibi_slopes"][b]
        lse_b = lse[:, q0:q1]
        p = weights(qb, kb, lse_b, rng_state, None, 0.0, causal, softmax_scale, h != h_kv, False,
                    **one)
        if dropout_p > 0:
            kept = keep[b, :, : q1 - q0, : k1 - k0].to(p.device)
            p = torch.where(kept | (p == 0), p, -p)
        probs[b, :, : q1 - q0, : k1 - k0] = p
    return probs


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    rotary_cos: Optional[Tensor] = None,
    rotary_sin: Optional[Tensor] = None,
    cache_seqlens=None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    sinks: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
):
    """flash_attn.flash_attn_with_kvcache, for inference: append the new keys and values to a
    KV cache in place, then attend over the cache (the op ``torch.ops.fusedmha.
    attention_with_kvcache``; C++: ``fusedmha::attention_with_kvcache``).

    q ``(B, L, H, E)``; ``k_cache``/``v_cache`` ``(B_cache, S_cache, H_kv, E)``; ``k``/``v``
    ``(B, L_new, H_kv, E)``, when given, are written into the cache in place at rows
    ``cache_seqlens[b] ..`` of cache batch ``cache_batch_idx[b]`` (default b). ``cache_seqlens``
    (an int or int32 ``(B)``; default: the whole cache) are the cache's lengths before the
    append. Sequence b attends to cache rows ``cache_leftpad[b]`` (default 0) up to its new
    length; ``causal`` and ``window_size`` are aligned bottom-right (the new queries are the
    last positions).

    With ``rotary_cos``/``rotary_sin`` ``(S_rotary, R / 2)``, rotary embedding is applied to
    the first R dims of q and of the new k before anything else, at their positions counted
    from ``cache_leftpad``: the new keys at ``cache_seqlens[b] + i``, and q at the same
    positions when causal or windowed, else all at ``cache_seqlens[b]``; pairs are adjacent
    dims (``rotary_interleaved=True``, GPT-J) or the two halves (GPT-NeoX).

    With ``block_table`` (int32 ``(B, pages per sequence)``), the cache is paged:
    ``k_cache``/``v_cache`` are ``(num_pages, page_size, H_kv, E)`` and row j of sequence b is
    row ``j % page_size`` of page ``block_table[b, j // page_size]`` (then ``cache_batch_idx``
    and ``cache_leftpad`` are not supported, as in FlashAttention). ``cache_batch_idx`` alone
    reads the selected caches in place (as pages of a whole cache each).

    With ``k_scale``/``v_scale`` (float32, the caches' shapes without their last dim), the
    caches are quantized: ``k_cache``/``v_cache`` hold int8, ``float8_e4m3fn`` or
    ``float8_e5m2`` codes and a cached value is ``code * scale`` (one scale per row and head).
    New rows are quantized as they are appended (:func:`fusedmha.quantize_kv`'s rule, into the
    caches and the scales in place), and the kernels read the codes directly.

    ``num_splits`` is accepted for compatibility (the CPU kernels split the keys themselves).
    Returns the output ``(B, L, H, E)``, and with ``return_softmax_lse`` also the log-sum-exp
    ``(B, H, L)``.
    """
    del num_splits
    # Only the keyword arguments that are not the op's defaults: each decoding step finds this
    # path cold, where parsing each costs microseconds.
    kwargs = {}
    if isinstance(cache_seqlens, (int, torch.SymInt)):  # (SymInt: torch.compile's dynamic int)
        # Passed on as an int: a tensor made here for it cost a decoding step from cold caches
        # 10-40 us on Zen 4 (5-9% of the step at S=256, 3-5% at 1024).
        cache_seqlens, kwargs["cache_seqlens_value"] = None, cache_seqlens
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, softmax_scale, causal, rotary_interleaved)
    window_left, window_right = int(window_size[0]), int(window_size[1])
    if (window_left != -1 or window_right != -1 or softcap != 0.0 or alibi_slopes is not None
            or sinks is not None):
        kwargs.update(window_left=window_left, window_right=window_right, softcap=float(softcap),
                      alibi_slopes=alibi_slopes, sinks=sinks)
    if k_scale is not None or v_scale is not None:
        kwargs.update(k_scale=k_scale, v_scale=v_scale)
    out, lse = _WITH_KVCACHE(*args, **kwargs)
    return (out, lse) if return_softmax_lse else out


def merge_attention(outputs, lses) -> Tuple[Tensor, Tensor]:
    """Partial attention results over disjoint sets of keys, combined by their log-sum-exp
    into the result over all the keys: ``outputs`` ``(B, L, H, E)`` and ``lses``
    ``(B, H, L)``, as :func:`flash_attn_func` returns them with ``return_attn_probs=True``.
    Returns ``(output, lse)``. A partial whose lse is +inf for a row (it had no key there)
    weighs nothing; a row no partial saw gets 0 and lse +inf. Differentiable."""
    return torch.ops.fusedmha.merge_attention(list(outputs), list(lses))
