"""Migrating hand-written tutorial attention to fusedmha (companion of docs/migrating.md).

Three attention classes that are copied from tutorials again and again, each with its classic
bug, and for each:

* ``Tutorial*``  the class as it is usually found (bug included), for loading old checkpoints
                 and for showing what the bug does;
* ``Reference*`` the same class with the bug fixed, in plain PyTorch (tests run it in float64);
* ``Fused*``     the fusedmha port: same constructor and forward signature as the tutorial
                 class (plus optional keyword arguments), so it replaces it in a model, and a
                 ``from_original(old_module)`` classmethod that copies the weights.

Shape 1, ``MultiHeadAttention(embed_size, heads)``, ``forward(values, keys, query, mask)``:
    heads split *before* a head_dim x head_dim projection shared by all heads; scores divided
    by sqrt(embed_size) instead of sqrt(head_dim); ``masked_fill(mask == 0, -1e20)``.
    Ports: ``FusedSharedProjectionAttention`` (keeps the shared projection, for checkpoints;
    fusedmha.scaled_dot_product_attention) and ``FusedMultiHeadAttention`` (the recommended
    full projection; fusedmha.MultiheadAttention, initialised to the same function).
Shape 2, BERT-style ``SelfAttention(num_attention_heads, input_size, hidden_size,
    hidden_dropout_prob)``: attention-probability dropout hard-coded to 0.8.
    Port: ``FusedSelfAttention`` (same state_dict keys; fusedmha.scaled_dot_product_attention).
Shape 3, ``MultiHeadedAttention(dmodel, num_heads)``, ``forward(x, context=None, mask=None)``:
    the softmax output is transposed before the product with V.
    Port: ``FusedMultiHeadedAttention`` (fusedmha.MultiheadAttention).

Mask meanings, the usual source of porting mistakes:
    tutorials                        mask == 0 (or False) means "masked"
    fusedmha.scaled_dot_product_attention   bool True means "may attend"   (as F.sdpa)
    fusedmha.MultiheadAttention      bool True means "masked"           (as nn.MultiheadAttention)

Run ``python examples/python/migrate_tutorial_attention.py`` (with fusedmha importable) for a
short comparison of every port with its reference.
"""

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fusedmha

__all__ = [
    "TutorialMultiHeadAttention", "ReferenceMultiHeadAttention",
    "FusedSharedProjectionAttention", "FusedMultiHeadAttention",
    "shared_projection_to_mha_state_dict", "tutorial_mask_to_sdpa", "tutorial_mask_to_mha",
    "make_src_mask", "make_trg_mask",
    "TutorialSelfAttention", "ReferenceSelfAttention", "FusedSelfAttention",
    "TutorialMultiHeadedAttention", "ReferenceMultiHeadedAttention",
    "FusedMultiHeadedAttention", "multiheaded_to_mha_state_dict",
    "masked_softmax",
]


def masked_softmax(scores: Tensor, attend: Optional[Tensor]) -> Tensor:
    """softmax over the last dim where ``attend`` (bool, broadcastable, True = may attend);
    a row with nothing to attend to gets all-zero probabilities (fusedmha's rule), not NaN
    (-inf everywhere) nor a uniform average (-1e20 everywhere)."""
    if attend is None:
        return scores.softmax(-1)
    empty = ~attend.any(-1, keepdim=True)
    scores = scores.masked_fill(~attend, float("-inf")).masked_fill(empty, 0.0)
    return scores.softmax(-1).masked_fill(empty, 0.0)


def _tril(L: int, S: int, device) -> Tensor:
    return torch.ones(L, S, dtype=torch.bool, device=device).tril()


# ---------------------------------------------------------------------------------------------
# Shape 1: split into heads, then one head_dim x head_dim projection shared by all heads
# ---------------------------------------------------------------------------------------------

class TutorialMultiHeadAttention(nn.Module):
    """As found in tutorials (named ``MultiHeadAttention`` there). Bugs kept on purpose:
    scale 1/sqrt(embed_size) instead of 1/sqrt(head_dim); masked with -1e20, so a query with
    every key masked averages all values (padding included), and float16 raises."""

    def __init__(self, embed_size, heads):
        super().__init__()
        self.embed_size = embed_size
        self.heads = heads
        self.head_dim = embed_size // heads
        assert self.head_dim * heads == embed_size, "embed_size must be divisible by heads"

        self.values = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.keys = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.queries = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.fc_out = nn.Linear(heads * self.head_dim, embed_size)

    def forward(self, values, keys, query, mask):
        N = query.shape[0]
        value_len, key_len, query_len = values.shape[1], keys.shape[1], query.shape[1]

        # split the embedding into self.heads pieces
        values = values.reshape(N, value_len, self.heads, self.head_dim)
        keys = keys.reshape(N, key_len, self.heads, self.head_dim)
        queries = query.reshape(N, query_len, self.heads, self.head_dim)

        values = self.values(values)
        keys = self.keys(keys)
        queries = self.queries(queries)

        # queries: (N, query_len, heads, head_dim), keys: (N, key_len, heads, head_dim)
        energy = torch.einsum("nqhd,nkhd->nhqk", [queries, keys])
        if mask is not None:
            energy = energy.masked_fill(mask == 0, float("-1e20"))

        attention = torch.softmax(energy / (self.embed_size ** (1 / 2)), dim=3)

        out = torch.einsum("nhqk,nkhd->nqhd", [attention, values])
        out = out.reshape(N, query_len, self.heads * self.head_dim)
        return self.fc_out(out)


def make_src_mask(lengths: Tensor, S: int) -> Tensor:
    """The tutorial's source mask: (N, 1, 1, S), 1 for tokens, 0 for padding."""
    return (torch.arange(S, device=lengths.device) < lengths[:, None])[:, None, None, :]


def make_trg_mask(N: int, L: int, device=None) -> Tensor:
    """The tutorial's target (causal) mask: (N, 1, L, L), lower triangle of ones."""
    return torch.tril(torch.ones(L, L, device=device)).expand(N, 1, L, L)


class ReferenceMultiHeadAttention(nn.Module):
    """Shape 1 corrected, plain PyTorch: the shared per-head projection is kept (an
    architecture some checkpoints depend on), the scale is 1/sqrt(head_dim) (or ``scale``),
    masked scores are -inf and a query with every key masked gets 0. ``dropout`` is on the
    attention probabilities, training mode only."""

    def __init__(self, embed_size, heads, dropout=0.0, scale=None):
        super().__init__()
        self.embed_size = embed_size
        self.heads = heads
        self.head_dim = embed_size // heads
        assert self.head_dim * heads == embed_size, "embed_size must be divisible by heads"
        self.values = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.keys = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.queries = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.fc_out = nn.Linear(heads * self.head_dim, embed_size)
        self.attn_dropout = nn.Dropout(dropout)
        self.scale = scale

    @classmethod
    def from_original(cls, old: TutorialMultiHeadAttention, **kwargs):
        new = cls(old.embed_size, old.heads, **kwargs).to(old.fc_out.weight)
        new.load_state_dict(old.state_dict())
        return new

    def forward(self, values, keys, query, mask=None, is_causal=False):
        N, L, S = query.shape[0], query.shape[1], keys.shape[1]
        values = self.values(values.reshape(N, S, self.heads, self.head_dim))
        keys = self.keys(keys.reshape(N, S, self.heads, self.head_dim))
        queries = self.queries(query.reshape(N, L, self.heads, self.head_dim))
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)
        energy = torch.einsum("nqhd,nkhd->nhqk", [queries, keys]) * scale
        attend = None if mask is None else (mask != 0)
        if is_causal:
            tril = _tril(L, S, query.device)
            attend = tril if attend is None else attend & tril
        attention = self.attn_dropout(masked_softmax(energy, attend))
        out = torch.einsum("nhqk,nkhd->nqhd", [attention, values])
        return self.fc_out(out.reshape(N, L, self.embed_size))


def tutorial_mask_to_sdpa(mask: Optional[Tensor]) -> Optional[Tensor]:
    """A tutorial mask (0 = masked) as fusedmha.scaled_dot_product_attention's bool mask
    (True = may attend). The shape is kept: (N, 1, 1, S) and (N, 1, L, S) broadcast over heads
    and are read through their strides, so an expanded mask costs no memory."""
    return None if mask is None else mask != 0


class FusedSharedProjectionAttention(nn.Module):
    """Shape 1 ported faithfully: the same parameters (state_dict keys ``values.weight``,
    ``keys.weight``, ``queries.weight``, ``fc_out.*``), the per-head projection shared by all
    heads, attention in fusedmha.scaled_dot_product_attention.

    ``forward(values, keys, query, mask=None, is_causal=False)`` as the tutorial's (mask: 0 =
    masked, broadcastable to (N, heads, query_len, key_len)); ``is_causal=True`` adds the causal
    mask without building it when there is no other mask. ``scale`` defaults to the correct
    1/sqrt(head_dim); ``from_original(old, keep_trained_scale=True)`` sets the tutorial's
    1/sqrt(embed_size) so a trained checkpoint computes exactly what it computed before."""

    def __init__(self, embed_size, heads, dropout=0.0, scale=None):
        super().__init__()
        self.embed_size = embed_size
        self.heads = heads
        self.head_dim = embed_size // heads
        assert self.head_dim * heads == embed_size, "embed_size must be divisible by heads"
        self.values = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.keys = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.queries = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.fc_out = nn.Linear(heads * self.head_dim, embed_size)
        self.dropout = dropout
        self.scale = scale

    @classmethod
    def from_original(cls, old: TutorialMultiHeadAttention, keep_trained_scale=False, dropout=0.0):
        scale = 1.0 / math.sqrt(old.embed_size) if keep_trained_scale else None
        new = cls(old.embed_size, old.heads, dropout=dropout, scale=scale).to(old.fc_out.weight)
        new.load_state_dict(old.state_dict())  # same keys, same shapes
        return new

    def forward(self, values, keys, query, mask=None, is_causal=False):
        H, d = self.heads, self.head_dim
        # (N, L, E) -> (N, L, H, d) -> shared projection -> (N, H, L, d) as a strided view:
        # fusedmha reads the transposed layout in place, no copy.
        q = self.queries(query.unflatten(-1, (H, d))).transpose(1, 2)
        k = self.keys(keys.unflatten(-1, (H, d))).transpose(1, 2)
        v = self.values(values.unflatten(-1, (H, d))).transpose(1, 2)
        attn_mask = tutorial_mask_to_sdpa(mask)
        if is_causal and attn_mask is not None:
            # The functional API (as F.sdpa) takes is_causal or a mask, not both: fold it in.
            attn_mask = attn_mask & _tril(q.size(-2), k.size(-2), q.device)
            is_causal = False
        out = fusedmha.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal, scale=self.scale,
        )
        # out follows q's (N, L, H, d) memory layout: transpose + flatten is free.
        return self.fc_out(out.transpose(1, 2).flatten(2))


def shared_projection_to_mha_state_dict(
    sd: Dict[str, Tensor], heads: int, keep_trained_scale: bool = False
) -> Dict[str, Tensor]:
    """Shape 1 checkpoint -> fusedmha.MultiheadAttention / nn.MultiheadAttention state_dict.

    Splitting into heads and applying one d x d matrix W to every head is the same as applying
    the block-diagonal E x E matrix diag(W, ..., W): the full projection starts out computing
    exactly what the checkpoint computed, and training may then use the off-diagonal blocks.
    The tutorial's Linear layers have no bias: in_proj_bias is zero. keep_trained_scale folds
    the tutorial's extra 1/sqrt(heads) (1/sqrt(embed_size) = 1/sqrt(heads) * 1/sqrt(head_dim))
    into the query projection."""
    w_q, w_k, w_v = sd["queries.weight"], sd["keys.weight"], sd["values.weight"]
    if keep_trained_scale:
        w_q = w_q / math.sqrt(heads)
    blocks = [torch.block_diag(*([w] * heads)) for w in (w_q, w_k, w_v)]
    E = blocks[0].size(0)
    return {
        "in_proj_weight": torch.cat(blocks),
        "in_proj_bias": w_q.new_zeros(3 * E),
        "out_proj.weight": sd["fc_out.weight"],
        "out_proj.bias": sd["fc_out.bias"],
    }


def tutorial_mask_to_mha(
    mask: Optional[Tensor], N: int, H: int, L: int, S: int
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """A tutorial mask (0 = masked, broadcastable to (N, H, L, S)) as nn.MultiheadAttention's
    ``(key_padding_mask, attn_mask)``, bool with True = masked.

    (N, 1, 1, S) -> key_padding_mask (N, S); (1, 1, L, S) or (L, S) -> attn_mask (L, S); a mask
    that varies with the batch entry *and* the query, e.g. causal & padding in one (N, 1, L, S)
    tensor, has no such form and becomes a (N*H, L, S) copy: pass the padding mask alone with
    is_causal=True instead (see FusedMultiHeadAttention.forward)."""
    if mask is None:
        return None, None
    masked = mask == 0
    while masked.dim() < 4:
        masked = masked.unsqueeze(0)
    if masked.size(1) == 1 and masked.size(2) == 1:
        return masked[:, 0, 0, :].expand(N, S), None
    if masked.size(0) == 1 and masked.size(1) == 1:
        return None, masked[0, 0].expand(L, S)
    return None, masked.expand(N, H, L, S).reshape(N * H, L, S)


class FusedMultiHeadAttention(nn.Module):
    """Shape 1, the recommended fix: a full E x E projection per Q/K/V
    (fusedmha.MultiheadAttention, batch_first). Same constructor and
    ``forward(values, keys, query, mask=None, is_causal=False)`` as the tutorial's class;
    mind that MultiheadAttention itself takes (query, key, value), the other way round.
    ``from_original`` loads the block-diagonal equivalent of the shared projection
    (shared_projection_to_mha_state_dict), so the ported model starts exactly where the
    checkpoint was. ``self.mha`` holds nn.MultiheadAttention's state_dict keys."""

    def __init__(self, embed_size, heads, dropout=0.0):
        super().__init__()
        self.embed_size = embed_size
        self.heads = heads
        self.mha = fusedmha.MultiheadAttention(embed_size, heads, dropout=dropout, batch_first=True)

    @classmethod
    def from_original(cls, old: TutorialMultiHeadAttention, keep_trained_scale=False, dropout=0.0):
        new = cls(old.embed_size, old.heads, dropout=dropout).to(old.fc_out.weight)
        new.mha.load_state_dict(
            shared_projection_to_mha_state_dict(old.state_dict(), old.heads, keep_trained_scale)
        )
        return new

    def forward(self, values, keys, query, mask=None, is_causal=False):
        N, L, S = query.shape[0], query.shape[1], keys.shape[1]
        key_padding_mask, attn_mask = tutorial_mask_to_mha(mask, N, self.heads, L, S)
        if is_causal and attn_mask is not None:
            attn_mask = attn_mask | ~_tril(L, S, query.device)  # True = masked
            is_causal = False
        # is_causal with key_padding_mask alone: the kernel's causal fast path plus padding.
        out, _ = self.mha(
            query, keys, values, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
            need_weights=False, is_causal=is_causal,
        )
        return out


# ---------------------------------------------------------------------------------------------
# Shape 2: BERT-style self-attention block (attention + dense + dropout + residual + LayerNorm)
# ---------------------------------------------------------------------------------------------

class TutorialSelfAttention(nn.Module):
    """As found in tutorials (named ``SelfAttention`` there). Bug kept on purpose: the dropout
    on the attention probabilities is hard-coded to 0.8, whatever hidden_dropout_prob says.
    ``attention_mask`` is (batch, seq) with 1 for tokens and 0 for padding, turned into BERT's
    additive -10000 mask. The residual only works when input_size == hidden_size (and
    broadcasts silently when input_size == 1)."""

    def __init__(self, num_attention_heads, input_size, hidden_size, hidden_dropout_prob):
        super().__init__()
        if hidden_size % num_attention_heads != 0:
            raise ValueError(
                "The hidden size (%d) is not a multiple of the number of attention "
                "heads (%d)" % (hidden_size, num_attention_heads))
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = int(hidden_size / num_attention_heads)
        self.all_head_size = hidden_size

        self.query = nn.Linear(input_size, self.all_head_size)
        self.key = nn.Linear(input_size, self.all_head_size)
        self.value = nn.Linear(input_size, self.all_head_size)

        self.attn_dropout = nn.Dropout(0.8)

        self.dense = nn.Linear(hidden_size, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=1e-12)
        self.out_dropout = nn.Dropout(hidden_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(*new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, input_tensor, attention_mask=None):
        mixed_query_layer = self.query(input_tensor)
        mixed_key_layer = self.key(input_tensor)
        mixed_value_layer = self.value(input_tensor)

        query_layer = self.transpose_for_scores(mixed_query_layer)
        key_layer = self.transpose_for_scores(mixed_key_layer)
        value_layer = self.transpose_for_scores(mixed_value_layer)

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            extended_mask = attention_mask[:, None, None, :].to(attention_scores.dtype)
            attention_scores = attention_scores + (1.0 - extended_mask) * -10000.0

        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        attention_probs = self.attn_dropout(attention_probs)

        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        context_layer = context_layer.view(*new_context_layer_shape)

        hidden_states = self.dense(context_layer)
        hidden_states = self.out_dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class _SelfAttentionParams(nn.Module):
    """The BERT-style block's parameters, under the tutorial's names (state_dicts load as is)."""

    def __init__(self, num_attention_heads, input_size, hidden_size, hidden_dropout_prob,
                 attention_probs_dropout_prob=None, norm_first=False, layer_norm_eps=1e-12):
        super().__init__()
        if hidden_size % num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({hidden_size}) is not a multiple of num_attention_heads "
                f"({num_attention_heads})")
        if input_size != hidden_size:
            raise ValueError(
                f"the residual connection adds the input to the output: input_size "
                f"({input_size}) must equal hidden_size ({hidden_size})")
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.all_head_size = hidden_size
        if attention_probs_dropout_prob is None:
            attention_probs_dropout_prob = hidden_dropout_prob  # BERT's configs: both 0.1
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.norm_first = norm_first
        self.query = nn.Linear(input_size, hidden_size)
        self.key = nn.Linear(input_size, hidden_size)
        self.value = nn.Linear(input_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.out_dropout = nn.Dropout(hidden_dropout_prob)

    @classmethod
    def from_original(cls, old: TutorialSelfAttention, attention_probs_dropout_prob=None):
        """Same keys: the old state_dict loads unchanged. The old module's hidden dropout is
        kept; the attention dropout becomes attention_probs_dropout_prob (default: the hidden
        dropout), not the hard-coded 0.8."""
        new = cls(old.num_attention_heads, old.query.in_features, old.all_head_size,
                  old.out_dropout.p, attention_probs_dropout_prob,
                  layer_norm_eps=old.LayerNorm.eps).to(old.dense.weight)
        new.load_state_dict(old.state_dict())
        return new

    def _residual(self, input_tensor, context):
        hidden_states = self.out_dropout(self.dense(context))
        if self.norm_first:
            return input_tensor + hidden_states
        return self.LayerNorm(hidden_states + input_tensor)


class ReferenceSelfAttention(_SelfAttentionParams):
    """Shape 2 corrected, plain PyTorch: attention dropout at ``attention_probs_dropout_prob``
    (default: hidden_dropout_prob); padding masked with -inf (a sequence with no token gets 0);
    ``norm_first=True`` gives the pre-LayerNorm variant x + dropout(dense(attn(LN(x))))."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.attn_dropout = nn.Dropout(self.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        return x.unflatten(-1, (self.num_attention_heads, self.attention_head_size)).transpose(1, 2)

    def forward(self, input_tensor, attention_mask=None):
        x = self.LayerNorm(input_tensor) if self.norm_first else input_tensor
        query_layer = self.transpose_for_scores(self.query(x))
        key_layer = self.transpose_for_scores(self.key(x))
        value_layer = self.transpose_for_scores(self.value(x))
        scores = query_layer @ key_layer.transpose(-1, -2) / math.sqrt(self.attention_head_size)
        attend = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        probs = self.attn_dropout(masked_softmax(scores, attend))
        context = (probs @ value_layer).transpose(1, 2).flatten(2)
        return self._residual(input_tensor, context)


class FusedSelfAttention(_SelfAttentionParams):
    """Shape 2 on fusedmha.scaled_dot_product_attention. Constructor and forward as the
    tutorial's (``attention_mask`` (batch, seq): 1 = token, 0 = padding), plus
    ``attention_probs_dropout_prob`` (default: hidden_dropout_prob), ``norm_first`` and
    ``layer_norm_eps``. Dropout on the probabilities runs inside the kernel."""

    def forward(self, input_tensor, attention_mask=None):
        x = self.LayerNorm(input_tensor) if self.norm_first else input_tensor
        H, d = self.num_attention_heads, self.attention_head_size
        q = self.query(x).unflatten(-1, (H, d)).transpose(1, 2)  # (N, H, L, d) views
        k = self.key(x).unflatten(-1, (H, d)).transpose(1, 2)
        v = self.value(x).unflatten(-1, (H, d)).transpose(1, 2)
        # 1 = token -> True = may attend, (N, 1, 1, S) broadcast over heads and queries.
        attn_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        context = fusedmha.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask,
            dropout_p=self.attention_probs_dropout_prob if self.training else 0.0,
        )
        return self._residual(input_tensor, context.transpose(1, 2).flatten(2))


# ---------------------------------------------------------------------------------------------
# Shape 3: self- or cross-attention with a key padding mask; softmax output transposed
# ---------------------------------------------------------------------------------------------

class TutorialMultiHeadedAttention(nn.Module):
    """As found in tutorials (named ``MultiHeadedAttention`` there). Bug kept on purpose: the
    attention matrix is transposed before the product with V, so query i receives
    sum_j P[j, i] v_j (weights that do not sum to 1, taken from the *other* queries' rows); it
    only runs when query and context have the same length. mask: (batch, context_len), 1 =
    token, 0 = padding; masked with -inf, so a context with no token gives NaN."""

    def __init__(self, dmodel, num_heads, dropout=0.1):
        super().__init__()
        assert dmodel % num_heads == 0
        self.dmodel = dmodel
        self.num_heads = num_heads
        self.d_k = dmodel // num_heads
        self.q_linear = nn.Linear(dmodel, dmodel)
        self.k_linear = nn.Linear(dmodel, dmodel)
        self.v_linear = nn.Linear(dmodel, dmodel)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(dmodel, dmodel)

    def forward(self, x, context=None, mask=None):
        if context is None:
            context = x  # self-attention
        bs = x.size(0)
        q = self.q_linear(x).view(bs, -1, self.num_heads, self.d_k).transpose(1, 2)
        k = self.k_linear(context).view(bs, -1, self.num_heads, self.d_k).transpose(1, 2)
        v = self.v_linear(context).view(bs, -1, self.num_heads, self.d_k).transpose(1, 2)

        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        if mask is not None:
            mask = mask.unsqueeze(1).unsqueeze(1)  # (bs, 1, 1, context_len)
            scores = scores.masked_fill(mask == 0, float("-inf"))
        attn = F.softmax(scores, dim=-1)
        attn = self.dropout(attn)

        out = torch.matmul(attn.transpose(-2, -1), v)
        out = out.transpose(1, 2).contiguous().view(bs, -1, self.num_heads * self.d_k)
        return self.out(out)


class ReferenceMultiHeadedAttention(nn.Module):
    """Shape 3 corrected, plain PyTorch: ``attn @ v``; a context with no token gives 0."""

    def __init__(self, dmodel, num_heads, dropout=0.1):
        super().__init__()
        assert dmodel % num_heads == 0
        self.dmodel = dmodel
        self.num_heads = num_heads
        self.d_k = dmodel // num_heads
        self.q_linear = nn.Linear(dmodel, dmodel)
        self.k_linear = nn.Linear(dmodel, dmodel)
        self.v_linear = nn.Linear(dmodel, dmodel)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(dmodel, dmodel)

    @classmethod
    def from_original(cls, old: TutorialMultiHeadedAttention):
        new = cls(old.dmodel, old.num_heads, old.dropout.p).to(old.out.weight)
        new.load_state_dict(old.state_dict())
        return new

    def forward(self, x, context=None, mask=None):
        if context is None:
            context = x
        heads = (self.num_heads, self.d_k)
        q = self.q_linear(x).unflatten(-1, heads).transpose(1, 2)
        k = self.k_linear(context).unflatten(-1, heads).transpose(1, 2)
        v = self.v_linear(context).unflatten(-1, heads).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        attend = None if mask is None else (mask != 0)[:, None, None, :]
        attn = self.dropout(masked_softmax(scores, attend))
        out = attn @ v
        return self.out(out.transpose(1, 2).flatten(2))


def multiheaded_to_mha_state_dict(sd: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """Shape 3 checkpoint -> fusedmha.MultiheadAttention / nn.MultiheadAttention state_dict:
    Q, K, V stacked into in_proj (in that order), ``out`` becomes out_proj."""
    return {
        "in_proj_weight": torch.cat([sd["q_linear.weight"], sd["k_linear.weight"], sd["v_linear.weight"]]),
        "in_proj_bias": torch.cat([sd["q_linear.bias"], sd["k_linear.bias"], sd["v_linear.bias"]]),
        "out_proj.weight": sd["out.weight"],
        "out_proj.bias": sd["out.bias"],
    }


class FusedMultiHeadedAttention(nn.Module):
    """Shape 3 on fusedmha.MultiheadAttention (batch_first). Same constructor and
    ``forward(x, context=None, mask=None)``: self-attention when context is None (one packed
    Q/K/V matmul), cross-attention otherwise (any context length); mask (batch, context_len),
    1/True = token, becomes key_padding_mask (True = padded)."""

    def __init__(self, dmodel, num_heads, dropout=0.1):
        super().__init__()
        self.dmodel = dmodel
        self.num_heads = num_heads
        self.mha = fusedmha.MultiheadAttention(dmodel, num_heads, dropout=dropout, batch_first=True)

    @classmethod
    def from_original(cls, old: TutorialMultiHeadedAttention):
        new = cls(old.dmodel, old.num_heads, old.dropout.p).to(old.out.weight)
        new.mha.load_state_dict(multiheaded_to_mha_state_dict(old.state_dict()))
        return new

    def forward(self, x, context=None, mask=None):
        if context is None:
            context = x
        key_padding_mask = None if mask is None else mask == 0
        out, _ = self.mha(x, context, context, key_padding_mask=key_padding_mask, need_weights=False)
        return out


# ---------------------------------------------------------------------------------------------

def _demo() -> None:
    torch.manual_seed(0)
    N, E, H = 2, 32, 4
    x, mem = torch.randn(N, 6, E), torch.randn(N, 9, E)
    src_mask = make_src_mask(torch.tensor([9, 5]), 9)

    def report(name, port, ref, *args, **kwargs):
        with torch.no_grad():
            diff = (port(*args, **kwargs).double() - ref(*(a.double() if torch.is_tensor(a) else a for a in args), **kwargs)).abs().max()
        print(f"{name:58s} max |port - float64 reference| = {diff:.2e}")

    old1 = TutorialMultiHeadAttention(E, H)
    ref1 = ReferenceMultiHeadAttention.from_original(old1).double()
    report("shape 1, shared projection (SDPA), cross + padding", FusedSharedProjectionAttention.from_original(old1), ref1, mem, mem, x, src_mask)
    report("shape 1, full projection (MultiheadAttention), causal", FusedMultiHeadAttention.from_original(old1), ref1, x, x, x, make_trg_mask(N, 6))

    old2 = TutorialSelfAttention(H, E, E, 0.1).eval()
    ref2 = ReferenceSelfAttention.from_original(old2).double().eval()
    report("shape 2, BERT-style block, padding", FusedSelfAttention.from_original(old2).eval(), ref2, mem, src_mask[:, 0, 0].long())

    old3 = TutorialMultiHeadedAttention(E, H).eval()
    ref3 = ReferenceMultiHeadedAttention.from_original(old3).double().eval()
    report("shape 3, cross-attention + padding", FusedMultiHeadedAttention.from_original(old3).eval(), ref3, x, mem, src_mask[:, 0, 0])


if __name__ == "__main__":
    _demo()
