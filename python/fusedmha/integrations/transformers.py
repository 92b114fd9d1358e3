"""fusedmha as a Hugging Face transformers attention implementation.

    import fusedmha.integrations.transformers  # registers "fusedmha"
    model = AutoModel.from_pretrained(name, attn_implementation="fusedmha")
    # or: model.set_attn_implementation("fusedmha")

Registered through transformers' public AttentionInterface (the attention call) and
AttentionMaskInterface (masks built as for "sdpa": bool, True = may attend, which is
fusedmha's meaning too). Covers what models pass: padding and causal masks, the causal flag,
dropout, scaling, grouped-query attention (num_key_value_groups: K/V are not repeated) and
transformers' (batch, heads, seq, head_dim) layout.
"""

from typing import Optional, Tuple

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import fusedmha

NAME = "fusedmha"


def fusedmha_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """transformers' attention signature: query (B, H, L, D), key/value (B, H_kv, S, D);
    returns the output as (B, L, H, D) and no weights (as "sdpa")."""
    if kwargs.get("softcap") is not None:
        raise ValueError("fusedmha attention does not support `softcap`; use attn_implementation='eager'")
    if kwargs.get("position_bias") is not None:
        raise ValueError("fusedmha attention does not support `position_bias`; use attn_implementation='sdpa'")
    q_length, kv_length = query.shape[2], key.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # transformers passes the causal mask itself when it has one (padding, caches); the
    # flag only stands for it when there is no mask.
    is_causal = bool(is_causal) and q_length > 1 and attention_mask is None
    if is_causal and kv_length > q_length:
        # Prefill into an empty static cache: the keys past the queries are unused slots,
        # and top-left causal masking would read them.
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = fusedmha.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal,
        scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Registers "fusedmha" with transformers (done on import; idempotent)."""
    AttentionInterface.register(NAME, fusedmha_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
