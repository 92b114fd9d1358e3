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
    comes from the fused forward. A float ``attn_mask`` or ``key_padding_mask`` that requires
    grad (a learnt bias) gets PyTorch's gradient. Differences from PyTorch: a query whose keys
    are all masked gets output 0 and weights 0 (PyTorch gives NaN).
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
        is_batched = self._check_inputs(query, key, value, key_padding_mask, attn_mask)
        # Batched inputs, kept in their own layout: (L, N, E), or (N, L, E) with batch_first.
        seq_first = not (self.batch_first and is_batched)
        if not is_batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        self._check_batched_shapes(query, key, value, seq_first)
        q, k, v = self._project(query, key, value, seq_first)
        # PyTorch's causal hint: with no key padding mask and no weights to return, attn_mask
        # is taken to be the causal mask, and its shape is not checked.
        causal_hint = is_causal and key_padding_mask is None and not need_weights
        attn_mask, key_padding_mask = self._mask_views(
            attn_mask, key_padding_mask, q.shape[0], q.shape[2], k.shape[2], causal_hint
        )
        dropout_p = float(self.dropout) if self.training else 0.0
        # Masks, extra keys, the causal hint and the fused attention: one C++ op shared with
        # the C++ module (csrc/modules/multihead_attention_core.cpp).
        out, weights = torch.ops.fusedmha._multihead_attention_core(
            q, k, v, attn_mask, key_padding_mask, self.bias_k, self.bias_v, self.add_zero_attn,
            dropout_p, need_weights, average_attn_weights, is_causal,
        )
        # out (N, H, L, D) follows q's layout: (N, L, H, D) or (L, N, H, D) memory.
        out = out.permute(2, 0, 1, 3) if seq_first else out.transpose(1, 2)
        out = F.linear(out.flatten(2), self.out_proj.weight, self.out_proj.bias)
        if not is_batched:
            out = out.squeeze(1)
            weights = weights.squeeze(0)
        return out, weights if need_weights else None

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor,
                      key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor]) -> bool:
        """nn.MultiheadAttention's checks, with its exception types; returns is_batched."""
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
        weight = self.in_proj_weight if self.in_proj_weight is not None else self.q_proj_weight
        devices = {n: t.device for n, t in (("query", query), ("key", key), ("value", value))}
        if any(d != weight.device for d in devices.values()):
            raise RuntimeError(
                "fusedmha.MultiheadAttention: expected query, key and value on the module's "
                f"device ({weight.device}), got " + ", ".join(f"{n} on {d}" for n, d in devices.items()))
        return is_batched

    def _check_batched_shapes(self, query: Tensor, key: Tensor, value: Tensor,
                              seq_first: bool) -> None:
        """Embedding dims and batch sizes of the batched inputs, with PyTorch's messages."""
        seq_dim = 0 if seq_first else 1
        bsz, embed_dim = query.shape[1 - seq_dim], query.shape[2]
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

    def _mask_views(self, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
                    bsz: int, tgt_len: int, src_len: int, causal_hint: bool = False
                    ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """attn_mask viewed as (1, 1, L, S) or (N, H, L, S) and the batched key_padding_mask
        as (N, 1, 1, S), their shapes checked with PyTorch's messages; never copied. With
        causal_hint, an attn_mask of another shape is dropped (it would not be read)."""
        mismatched = False
        if causal_hint and attn_mask is not None:
            if attn_mask.dim() == 2:
                mismatched = attn_mask.shape != (tgt_len, src_len)
            else:
                mismatched = attn_mask.shape != (bsz * self.num_heads, tgt_len, src_len)
        if mismatched:
            attn_mask = None
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
        return attn_mask, key_padding_mask

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
