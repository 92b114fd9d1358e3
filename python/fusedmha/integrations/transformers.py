"""fusedmha as a Hugging Face transformers attention implementation.

    import fusedmha.integrations.transformers  # registers "fusedmha"
    model = AutoModel.from_pretrained(name, attn_implementation="fusedmha")
    # or: model.set_attn_implementation("fusedmha")

Registered through transformers' public AttentionInterface (the attention call) and
AttentionMaskInterface (masks as for "sdpa": bool, True = may attend, which is fusedmha's
meaning too). Covers what models pass: padding and causal masks, the causal flag, dropout,
scaling, grouped-query attention (num_key_value_groups: K/V are not repeated), transformers'
(batch, heads, seq, head_dim) layout, and the variants some models use: sliding windows
(Mistral, Qwen2, Gemma 2, gpt-oss), softcap (Gemma 2), attention sinks (gpt-oss's s_aux, or
``sinks``, one logit per head) and additive position biases (``position_bias``, T5-style).
Packed batches (padding-free training with DataCollatorWithFlattening: the ``cu_seq_lens_q/k``
kwargs, or ``position_ids`` that restart within a row) run fusedmha's varlen kernels, which
attend within each sequence and spend no work across them.
An argument that would change the result and that fusedmha cannot honour raises an error.
Generation can keep its cache quantized: ``cache=QuantizedKVCache(dtype=torch.int8)``
(fusedmha.integrations.transformers_cache), whose codes this attention reads in place.
A FlexAttention ``BlockMask`` passed as the model's ``attention_mask`` (transformers hands
4-D masks to the attention as given) is read as fusedmha.flex_attention reads it: the bool mask
it stands for, kept with the BlockMask, whose hidden tiles the CPU kernels skip.
"""

from typing import Optional, Tuple

import torch
from transformers import AttentionInterface
from torch.nn.attention.flex_attention import BlockMask
from transformers.masking_utils import AttentionMaskInterface, prepare_padding_mask, sdpa_mask

import fusedmha
from fusedmha.flex import _block_mask_for
from fusedmha.integrations.transformers_cache import QuantizedKVCache, QuantizedRows, attend_quantized

NAME = "fusedmha"

# Keyword arguments some models pass that change the attention's result and that this
# backend does not implement: an error, never silently different numbers.
_UNSUPPORTED = {
    "head_mask": "head masks",
    "layer_head_mask": "head masks",
    "block_table": "paged KV caches through the attention call (use fusedmha.flash_attn_with_kvcache)",
    "cache_seqlens": "per-sequence cache lengths through the attention call "
                     "(use fusedmha.flash_attn_with_kvcache)",
}


def fusedmha_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, local_size=None, allow_is_causal_skip=True, **kwargs):
    """transformers' "sdpa" mask, except for a sliding-window causal layer whose window bites
    (kv_length >= the window), with no padding and its queries the last q_length positions:
    then no mask (None), and the attention call applies the causal band in the kernel, which
    skips the key blocks outside it instead of reading a dense L×S mask."""
    if (
        local_size is not None
        and allow_is_causal_skip
        and kv_length >= local_size
        and isinstance(q_offset, int)
        and isinstance(kv_offset, int)
        and q_offset - kv_offset == kv_length - q_length
        and not torch.compiler.is_compiling()
    ):
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if padding is None or bool(padding.all()):
            return None
    call = dict(kwargs, local_size=local_size, allow_is_causal_skip=allow_is_causal_skip)
    if mask_function is not None:
        call["mask_function"] = mask_function
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                     attention_mask=attention_mask, **call)


def fusedmha_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """transformers' attention signature: query (B, H, L, D), key/value (B, H_kv, S, D);
    returns the output as (B, L, H, D) and no weights (as "sdpa")."""
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"fusedmha attention does not support {what} (`{name}`); "
                             "use attn_implementation='eager' or 'sdpa'")
    q_length, kv_length = query.shape[2], key.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    variants = dict(softcap=float(softcap or 0.0), sinks=_per_head_sinks(s_aux, kwargs, query))
    if isinstance(attention_mask, BlockMask):
        attention_mask = _block_mask_for(attention_mask, query, key, "fusedmha attention")
    if isinstance(key, QuantizedRows):
        if kwargs.get("position_bias") is not None:
            raise ValueError("fusedmha QuantizedKVCache does not take position_bias")
        return attend_quantized(query, key, attention_mask, dropout, scaling, bool(is_causal),
                                sliding_window, **variants), None
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        # An additive score bias (T5-style relative positions): it joins the mask as a float
        # mask, as "sdpa" does; the causal flag becomes part of it.
        attention_mask = _bias_mask(position_bias, attention_mask, bool(is_causal) and
                                    attention_mask is None and q_length > 1, query, key)
        is_causal = False
    packed, explicit = _packed_sequences(query, key, kwargs)
    if packed is not None and _mask_is_packing_only(attention_mask, packed, bool(is_causal),
                                                     explicit):
        return _varlen_forward(query, key, value, packed, dropout, scaling, bool(is_causal),
                               sliding_window, variants), None
    causal = bool(is_causal) and attention_mask is None
    if causal and sliding_window is not None and kv_length >= sliding_window:
        # fusedmha_mask left this sliding-window layer to the kernel: its queries are the
        # last q_length positions, so the band is causal, bottom-right aligned, and reaches
        # sliding_window - 1 keys back (transformers' window counts the diagonal).
        variants.update(bottom_right=True, window_left=sliding_window - 1)
    elif causal:
        # transformers passes the causal mask itself when it has one (padding, caches); the
        # flag only stands for it when there is no mask, with SDPA's (top-left) alignment.
        causal = q_length > 1
        if causal and kv_length > q_length:
            # Prefill into an empty static cache: the keys past the queries are unused
            # slots, and top-left causal masking would read them.
            key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = fusedmha.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal,
        scale=scaling, enable_gqa=query.shape[1] != key.shape[1], **variants,
    )
    return out.transpose(1, 2).contiguous(), None


def _per_head_sinks(s_aux, kwargs, query):
    """The sink logits, one per head (gpt-oss passes them as s_aux, others as sinks); sinks of
    any other shape (per token) would change the result and are refused."""
    sinks = kwargs.get("sinks")
    if sinks is not None and s_aux is not None:
        raise ValueError("fusedmha attention: got both `s_aux` and `sinks`; pass one")
    sinks = s_aux if sinks is None else sinks
    if sinks is not None and sinks.numel() != query.shape[1]:
        raise ValueError(f"fusedmha attention supports one sink logit per head ({query.shape[1]}),"
                         f" not sinks of shape {tuple(sinks.shape)}; use attn_implementation="
                         "'eager'")
    return None if sinks is None else sinks.reshape(query.shape[1])


def _bias_mask(bias, mask, causal, query, key):
    """The float mask that adds `bias` (broadcastable to (B, H, L, S)) where a query may attend
    and excludes what `mask` (bool: True = may attend, or float: added) or `causal` excludes."""
    L, S = query.shape[2], key.shape[2]
    bias = bias.to(query.dtype)
    lowest = torch.finfo(query.dtype).min  # (as "sdpa": a finite floor, never -inf + bias)
    if causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        return torch.where(keep, bias, lowest)
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, lowest)
    return mask.to(query.dtype) + bias


def _packed_sequences(query, key, kwargs):
    """(cu, explicit): the cumulative sequence lengths of a packed batch (int32, over the B·L
    rows of the batch), from the cu_seq_lens_q/k kwargs (explicit) or from position_ids that
    restart within a row; None for an ordinary batch."""
    B, L = query.shape[0], query.shape[2]
    if key.shape[2] != L:
        return None, False  # (a cache: not a packed batch)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None or not torch.equal(cu_q, cu_k):
            raise ValueError("fusedmha attention supports packed self-attention batches only: "
                             "cu_seq_lens_q and cu_seq_lens_k must be given together and equal")
        if int(cu_q[-1]) != B * L:
            raise ValueError(f"fusedmha attention: cu_seq_lens_q ends at {int(cu_q[-1])}, but the "
                             f"batch has {B * L} rows")
        return cu_q.to(device=query.device, dtype=torch.int32), True
    position_ids = kwargs.get("position_ids")
    if position_ids is None or position_ids.shape[-1] != L or position_ids.dim() != 2:
        return None, False
    # A sequence starts at every row start and wherever the position does not step by one
    # (transformers' own rule for packed sequences).
    steps = position_ids.expand(B, L).diff(dim=-1) != 1
    if not bool(steps.any()):
        return None, False
    starts = torch.nn.functional.pad(steps, (1, 0), value=True).flatten().nonzero().flatten()
    ends = torch.tensor([B * L], device=starts.device)
    return torch.cat((starts, ends)).to(device=query.device, dtype=torch.int32), False


def _mask_is_packing_only(attention_mask, cu, causal, explicit):
    """Whether transformers' mask for this batch says nothing beyond the packing (each
    sequence attends within itself, causally when causal): then the varlen kernels honour it
    without reading it. Anything else (padding, custom masks) keeps the dense path. Without a
    mask, only explicit cu_seq_lens mean packing: from position_ids alone, transformers packs
    only when it builds the packing into the mask (no 2-D mask and no cache)."""
    if attention_mask is None:
        return explicit
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        return False
    B, L = attention_mask.shape[0], attention_mask.shape[-1]
    if attention_mask.shape[-2] != L or cu[-1] != B * L:
        return False
    lengths = cu.diff().long()
    ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    ids = ids.view(B, L)
    expected = ids[:, :, None] == ids[:, None, :]
    if causal:
        expected &= torch.ones(L, L, dtype=torch.bool, device=cu.device).tril()
    return bool((attention_mask == expected[:, None]).all())


def _varlen_forward(query, key, value, cu, dropout, scaling, causal, sliding_window, variants):
    """The packed batch through fusedmha.flash_attn_varlen_func: (B, L, H, D) back."""
    B, H, L, D = query.shape
    rows = lambda t: t.transpose(1, 2).reshape(B * L, t.shape[1], t.shape[3])  # noqa: E731
    window = (-1, -1)
    if causal and sliding_window is not None:
        window = (sliding_window - 1, 0)  # (transformers' window counts the diagonal)
    longest = int(cu.diff().max())
    out = fusedmha.flash_attn_varlen_func(
        rows(query), rows(key), rows(value), cu, cu, longest, longest, dropout_p=dropout,
        softmax_scale=scaling, causal=causal, window_size=window, softcap=variants["softcap"],
        sinks=variants["sinks"])
    return out.view(B, L, H, value.shape[3])


__all__ = ["QuantizedKVCache", "fusedmha_attention_forward", "fusedmha_mask", "register"]


def register() -> None:
    """Registers "fusedmha" with transformers (done on import; idempotent)."""
    AttentionInterface.register(NAME, fusedmha_attention_forward)
    AttentionMaskInterface.register(NAME, fusedmha_mask)


register()
