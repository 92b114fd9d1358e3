"""fusedmha.MultiheadAttention: a drop-in for torch.nn.MultiheadAttention on the fused op."""

import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.init import constant_, xavier_normal_, xavier_uniform_
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear


class MultiheadAttention(nn.Module):
    """Same constructor, parameters, ``state_dict`` keys, forward signature, return values and
    errors as ``torch.nn.MultiheadAttention``; attention runs in fusedmha's fused kernels.

    Masks keep nn.MultiheadAttention's meaning: a bool mask is True where attending is *not*
    allowed, a float mask is added to the scores. ``key_padding_mask`` ``(N, S)`` and
    ``attn_mask`` ``(L, S)`` or ``(N*num_heads, L, S)`` are read through their strides, and
    merged into one ``(N, 1, L, S)`` mask only when both are given (``(N, H, L, S)`` for a 3-D
    ``attn_mask``).

    ``is_causal=True`` trusts ``attn_mask`` to be the causal mask, as PyTorch does, and then
    skips it: causal attention plus a key padding mask runs on the kernel's fast paths. Unlike
    PyTorch it also works without ``attn_mask`` (the causal mask, no tensor built).

    ``need_weights=True`` returns the attention weights (after dropout in training mode, as
    PyTorch) from one extra fused pass over the saved log-sum-exp; the output itself always
    comes from the fused forward. Differences from PyTorch: a query whose keys are all masked
    gets output 0 and weights 0 (PyTorch gives NaN); gradients with respect to a float mask
    are not supported.
    """

    __constants__ = ["batch_first"]
    bias_k: Optional[Tensor]
    bias_v: Optional[Tensor]

    def __init__(
        self,
        embed_dim,
        num_heads,
        dropout=0.0,
        bias=True,
        add_bias_kv=False,
        add_zero_attn=False,
        kdim=None,
        vdim=None,
        batch_first=False,
        device=None,
        dtype=None,
    ) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be greater than 0,"
                f" got embed_dim={embed_dim} and num_heads={num_heads} instead"
            )
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != self.embed_dim:
            raise AssertionError("embed_dim must be divisible by num_heads")

        # Registered in nn.MultiheadAttention's order, so state_dicts match key for key.
        if not self._qkv_same_embed_dim:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory_kwargs))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory_kwargs))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory_kwargs))
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = nn.Parameter(
                torch.empty((3 * embed_dim, embed_dim), **factory_kwargs)
            )
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory_kwargs))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(
            embed_dim, embed_dim, bias=bias, **factory_kwargs
        )
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
            self.bias_v = nn.Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            xavier_uniform_(self.in_proj_weight)
        else:
            xavier_uniform_(self.q_proj_weight)
            xavier_uniform_(self.k_proj_weight)
            xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            constant_(self.in_proj_bias, 0.0)
            constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            xavier_normal_(self.bias_v)

    def __setstate__(self, state):
        # Checkpoints of nn.MultiheadAttention from PyTorch 1.1 lack this flag.
        if "_qkv_same_embed_dim" not in state:
            state["_qkv_same_embed_dim"] = True
        super().__setstate__(state)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """query ``(L, N, E)`` (``(N, L, E)`` with batch_first, ``(L, E)`` unbatched), key
        ``(S, N, kdim)``, value ``(S, N, vdim)``. Returns ``(attn_output, attn_weights)``:
        the output shaped like query, and the weights ``(N, L, S)`` averaged over heads or
        ``(N, num_heads, L, S)`` (no N when unbatched), or None when ``need_weights=False``.
        """
        is_batched = F._mha_shape_check(
            query, key, value, key_padding_mask, attn_mask, self.num_heads
        )
        _check_mask_dtype(key_padding_mask, "key_padding_mask")
        _check_mask_dtype(attn_mask, "attn_mask")
        if (
            key_padding_mask is not None
            and attn_mask is not None
            and key_padding_mask.dtype != attn_mask.dtype
        ):
            warnings.warn(
                "Support for mismatched key_padding_mask and attn_mask is deprecated. "
                "Use same type for both instead."
            )

        # Batched inputs, kept in their own layout: (L, N, E), or (N, L, E) with batch_first.
        seq_first = not (self.batch_first and is_batched)
        if not is_batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        seq_dim = 0 if seq_first else 1
        tgt_len, bsz, embed_dim = query.shape[seq_dim], query.shape[1 - seq_dim], query.shape[2]
        src_len = key.shape[seq_dim]
        if embed_dim != self.embed_dim:
            raise AssertionError(
                f"was expecting embedding dimension of {self.embed_dim}, but got {embed_dim}"
            )
        if self._qkv_same_embed_dim:
            if key.shape != value.shape:
                raise AssertionError(
                    f"key shape {key.shape} does not match value shape {value.shape}"
                )
        else:
            if key.shape[:2] != value.shape[:2]:
                raise AssertionError(
                    f"key's sequence and batch dims {key.shape[:2]} do not match value's "
                    f"{value.shape[:2]}"
                )
            # F._in_projection's checks, with its messages.
            if key.shape[-1] != self.kdim:
                raise AssertionError(
                    f"expecting key weights shape of {(self.embed_dim, key.shape[-1])}, but got "
                    f"{(self.embed_dim, self.kdim)}"
                )
            if value.shape[-1] != self.vdim:
                raise AssertionError(
                    f"expecting value weights shape of {(self.embed_dim, value.shape[-1])}, but "
                    f"got {(self.embed_dim, self.vdim)}"
                )

        if key.shape[1 - seq_dim] != bsz or value.shape[1 - seq_dim] != bsz:
            # PyTorch fails here on a view of the projected key: the same type, clearer words.
            raise RuntimeError(
                f"expected key and value with the query's batch size {bsz}, got key "
                f"{key.shape} and value {value.shape}"
            )
        _check_mask_precision(key_padding_mask, "key_padding_mask", query.dtype)
        _check_mask_precision(attn_mask, "attn_mask", query.dtype)

        q, k, v = self._project(query, key, value, seq_first)
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                if attn_mask.shape != (tgt_len, src_len):
                    raise RuntimeError(
                        f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                        f"{(tgt_len, src_len)}."
                    )
                attn_mask = attn_mask.view(1, 1, tgt_len, src_len)
            else:
                if attn_mask.shape != (bsz * self.num_heads, tgt_len, src_len):
                    raise RuntimeError(
                        f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                        f"{(bsz * self.num_heads, tgt_len, src_len)}."
                    )
                attn_mask = attn_mask.view(bsz, self.num_heads, tgt_len, src_len)
        if key_padding_mask is not None:
            # PyTorch's checks and messages (F._check_key_padding_mask), without the
            # torch._check closures that torch.compile cannot trace.
            if key_padding_mask.shape[0] != bsz:
                raise AssertionError(
                    f"Expected key_padded_mask.shape[0] to be {bsz}, but got "
                    f"{key_padding_mask.shape[0]}"
                )
            if key_padding_mask.shape[1] != src_len:
                raise AssertionError(
                    f"Expected key_padded_mask.shape[1] to be {src_len}, but got "
                    f"{key_padding_mask.shape[1]}"
                )
            key_padding_mask = key_padding_mask.view(bsz, 1, 1, src_len)

        # Extra keys: the learnt bias_k/bias_v, then a zero key/value; every query sees them.
        extra_keys = int(self.bias_k is not None) + int(self.add_zero_attn)
        if is_causal and extra_keys > 0:
            # Top-left causal masking would hide the appended keys from the first queries.
            if attn_mask is None:
                attn_mask = torch.ones(
                    tgt_len, src_len, dtype=torch.bool, device=q.device
                ).triu(1).view(1, 1, tgt_len, src_len)
            is_causal = False
        elif is_causal:
            attn_mask = None  # the hint: attn_mask is the causal mask
        bias_k, bias_v = self.bias_k, self.bias_v
        if bias_k is not None and bias_v is not None:
            shape = [bsz, self.num_heads, 1, self.head_dim]
            k = torch.cat([k, bias_k.view(1, self.num_heads, 1, self.head_dim).expand(shape)], 2)
            v = torch.cat([v, bias_v.view(1, self.num_heads, 1, self.head_dim).expand(shape)], 2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(bsz, self.num_heads, 1, self.head_dim)], 2)
            v = torch.cat([v, v.new_zeros(bsz, self.num_heads, 1, self.head_dim)], 2)
        if extra_keys > 0:
            attn_mask = _pad_keys(attn_mask, extra_keys)
            key_padding_mask = _pad_keys(key_padding_mask, extra_keys)
        mask = _merge_masks(attn_mask, key_padding_mask, q.dtype)

        dropout_p = float(self.dropout) if self.training else 0.0
        # dropout 1 drops every probability, as F.dropout does (the kernels take p < 1).
        drop_all = dropout_p == 1.0
        if drop_all:
            dropout_p = 0.0
        out, lse, rng_state = torch.ops.fusedmha.attention_forward(
            q, k, v, mask, dropout_p, is_causal
        )
        weights: Optional[Tensor] = None
        if need_weights:
            weights = torch.ops.fusedmha.attention_weights(
                q, k, lse, rng_state, mask, dropout_p, is_causal, None, False, average_attn_weights
            )
            if not is_batched:
                weights = weights.squeeze(0)
            if drop_all:
                weights = weights * 0.0
        if drop_all:
            out = out * 0.0

        # out (N, H, L, D) follows q's layout: (N, L, H, D) or (L, N, H, D) memory.
        out = out.permute(2, 0, 1, 3) if seq_first else out.transpose(1, 2)
        out = F.linear(out.flatten(2), self.out_proj.weight, self.out_proj.bias)
        if not is_batched:
            out = out.squeeze(1)
        return out, weights

    def merge_masks(
        self, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], query: Tensor
    ) -> Tuple[Optional[Tensor], Optional[int]]:
        """nn.MultiheadAttention.merge_masks: the masks as nn.TransformerEncoderLayer's
        inference fast path wants them (it calls this, then runs PyTorch's own fused layer
        kernel with this module's weights). Type 0: attn_mask (L, L); 1: key_padding_mask
        (N, L); 2: both, as (N, H, L, L)."""
        mask_type: Optional[int] = None
        merged: Optional[Tensor] = None
        if key_padding_mask is not None:
            mask_type = 1
            merged = key_padding_mask
        if attn_mask is not None:
            batch_size, seq_len = query.shape[0], query.shape[1]
            mask_type = 2
            if attn_mask.dim() == 3:
                merged = attn_mask.view(batch_size, -1, seq_len, seq_len)
            else:
                merged = attn_mask.view(1, 1, seq_len, seq_len).expand(
                    batch_size, self.num_heads, -1, -1
                )
            if key_padding_mask is not None:
                merged = merged + key_padding_mask.view(batch_size, 1, 1, seq_len).expand(
                    -1, self.num_heads, -1, -1
                )
        return merged, mask_type

    def _project(self, query: Tensor, key: Tensor, value: Tensor, seq_first: bool):
        """The input projections as (N, H, L, D) views of the projected tensors (no
        transposing copies); one packed matmul for self-attention, two when key is value."""
        w, b = self.in_proj_weight, self.in_proj_bias
        E = self.embed_dim
        if self._qkv_same_embed_dim:
            assert w is not None
            if query is key and key is value:
                q, k, v = self._heads(F.linear(query, w, b), 3, seq_first).unbind(0)
                return q, k, v
            if key is value:
                b_q = b_kv = None
                if b is not None:
                    b_q, b_kv = b[:E], b[E:]
                q = self._heads(F.linear(query, w[:E], b_q), 1, seq_first)[0]
                k, v = self._heads(F.linear(key, w[E:], b_kv), 2, seq_first).unbind(0)
                return q, k, v
            w_q, w_k, w_v = w[:E], w[E : 2 * E], w[2 * E :]
        else:
            assert self.q_proj_weight is not None
            assert self.k_proj_weight is not None
            assert self.v_proj_weight is not None
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if b is not None:
            b_q, b_k, b_v = b[:E], b[E : 2 * E], b[2 * E :]
        q = self._heads(F.linear(query, w_q, b_q), 1, seq_first)[0]
        k = self._heads(F.linear(key, w_k, b_k), 1, seq_first)[0]
        v = self._heads(F.linear(value, w_v, b_v), 1, seq_first)[0]
        return q, k, v

    def _heads(self, x: Tensor, parts: int, seq_first: bool) -> Tensor:
        """A projection (L, N, parts*E), or (N, L, parts*E), viewed as (parts, N, H, L, D)."""
        if seq_first:
            return x.unflatten(-1, (parts, self.num_heads, self.head_dim)).permute(2, 1, 3, 0, 4)
        return x.unflatten(-1, (parts, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4)


def _check_mask_dtype(mask: Optional[Tensor], name: str) -> None:
    if mask is not None and mask.dtype != torch.bool and not torch.is_floating_point(mask):
        raise AssertionError(f"only bool and floating types of {name} are supported")


def _check_mask_precision(mask: Optional[Tensor], name: str, query_dtype: torch.dtype) -> None:
    # PyTorch adds a float mask to the query's scores: one of lower precision is widened,
    # one of higher precision (float64 for a float32 query) is an error.
    if mask is not None and mask.dtype != torch.bool:
        if torch.promote_types(mask.dtype, query_dtype) != query_dtype:
            raise RuntimeError(
                f"Expected a float {name} of the query's dtype ({query_dtype}) or lower "
                f"precision, got {mask.dtype}"
            )


def _pad_keys(mask: Optional[Tensor], extra: int) -> Optional[Tensor]:
    """mask with `extra` more keys that every query may attend to."""
    if mask is None:
        return None
    return F.pad(mask, [0, extra])  # zeros: False (bool) or 0.0 (float)


def _merge_masks(attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
                 dtype: torch.dtype) -> Optional[Tensor]:
    """nn.MultiheadAttention's masks (bool True = masked, float added), broadcastable to
    (N, H, L, S), as one mask for the op (bool True = may attend, float added). Built only
    when both are given: (N, 1, L, S), or (N, H, L, S) for a per-head attn_mask."""
    if attn_mask is None or key_padding_mask is None:
        mask = key_padding_mask if attn_mask is None else attn_mask
        if mask is None:
            return None
        return ~mask if mask.dtype == torch.bool else _additive(mask, dtype)
    if attn_mask.dtype == torch.bool and key_padding_mask.dtype == torch.bool:
        return ~(attn_mask | key_padding_mask)
    return _additive(attn_mask, dtype) + _additive(key_padding_mask, dtype)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A mask as a float term added to the scores, in dtype or float32 (the op takes both)."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            mask, float("-inf")
        )
    if mask.dtype != dtype and mask.dtype != torch.float32:
        return mask.to(dtype)
    return mask
