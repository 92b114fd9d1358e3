"""FlexAttention's interface: ``flex_attention`` with a ``BlockMask`` from torch's
``create_block_mask``, and the ``score_mod``s fusedmha's kernels compute (``softcap``,
``alibi``, ``bias``, ``relative_position``), forward and backward on every device fusedmha
runs on.

A ``BlockMask`` is read as flex_attention reads it: a key block it lists as full is attended
to whole, a block it lists as partial where its ``mask_mod`` is true, a block it does not list
not at all. Its partial blocks' ``mask_mod`` is evaluated once per BlockMask, one vectorised
call over every partial block's index grid, and kept with the BlockMask (training steps reuse
it); the kernels then read the resulting ``(B or 1, H or 1, L, S)`` boolean mask tile by tile,
skipping the tiles it hides whole (docs/flex.md says what that costs).

A Python ``score_mod`` cannot run inside a C++ kernel: ``flex_attention`` takes only the ones
built here, each also a plain callable with ``score_mod``'s signature, so the same object runs
under torch's own ``flex_attention`` too.
"""

from typing import Optional

import torch
from torch import Tensor

__all__ = ["flex_attention", "softcap", "alibi", "bias", "relative_position"]


class _ScoreMod:
    """A score_mod fusedmha computes in its kernels: the variant arguments of the op it maps
    to, and the same function as a callable for torch's flex_attention."""

    def variants(self, query: Tensor, key: Tensor, mask: Optional[Tensor]):
        """(keyword arguments for attention_forward, the attn_mask to pass instead of mask)."""
        raise NotImplementedError


class softcap(_ScoreMod):
    """``score -> cap * tanh(score / cap)`` (Gemma 2's logit soft-capping), on the scaled
    scores."""

    def __init__(self, cap: float):
        if not cap > 0:
            raise ValueError(f"fusedmha.flex.softcap: cap must be > 0, got {cap}")
        self.cap = float(cap)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.cap * torch.tanh(score / self.cap)

    def variants(self, query, key, mask):
        return dict(softcap=self.cap), mask


class alibi(_ScoreMod):
    """``score -> score - slopes[h] * |q_idx - kv_idx|`` (ALiBi), with ``slopes`` a float
    tensor ``(H)`` of the query heads, on the device of the queries."""

    def __init__(self, slopes: Tensor):
        if not isinstance(slopes, Tensor) or slopes.dim() != 1:
            raise ValueError("fusedmha.flex.alibi: slopes must be a 1-D tensor (H), got "
                             f"{getattr(slopes, 'shape', type(slopes).__name__)}")
        self.slopes = slopes

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score - self.slopes[h] * (q_idx - kv_idx).abs()

    def variants(self, query, key, mask):
        if self.slopes.shape[0] != query.shape[1]:
            raise ValueError(f"fusedmha.flex.alibi: slopes has {self.slopes.shape[0]} entries, "
                             f"the queries {query.shape[1]} heads")
        return dict(alibi_slopes=self.slopes.to(torch.float32)), mask


class bias(_ScoreMod):
    """``score -> score + bias[b, h, q_idx, kv_idx]``: a float tensor broadcastable to
    ``(B, H, L, S)``, differentiable (a learnable bias gets its gradient)."""

    def __init__(self, tensor: Tensor):
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point() or tensor.dim() > 4:
            raise ValueError("fusedmha.flex.bias: expected a floating-point tensor of at most "
                             "4 dims, broadcastable to (B, H, L, S)")
        self.tensor = tensor
        # (Its shape with leading 1s up to (B, H, L, S)'s four dims.)
        self.shape4 = (1,) * (4 - tensor.dim()) + tuple(tensor.shape)

    def __call__(self, score, b, h, q_idx, kv_idx):
        t = self.tensor.reshape(self.shape4)
        idx = [i if n > 1 else torch.zeros_like(i) for i, n in zip((b, h, q_idx, kv_idx), t.shape)]
        return score + t[idx[0], idx[1], idx[2], idx[3]]

    def variants(self, query, key, mask):
        B, H, L, S = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
        if any(n not in (1, m) for n, m in zip(self.shape4, (B, H, L, S))):
            raise ValueError(f"fusedmha.flex.bias: tensor of shape {tuple(self.tensor.shape)} "
                             f"does not broadcast to (B, H, L, S) = {(B, H, L, S)}")
        t = self.tensor.to(query.dtype)
        if mask is None:
            return {}, t
        return {}, torch.where(mask, t, float("-inf"))


class relative_position(_ScoreMod):
    """``score -> score + table[h, clamp(kv_idx - q_idx, -R, R) + R]``: a learnable relative
    position bias, ``table`` a float tensor ``(H, 2R + 1)`` of the query heads (distances past R
    share the last entry, as T5's buckets do at the far end). Its gradient flows."""

    def __init__(self, table: Tensor):
        if (not isinstance(table, Tensor) or not table.is_floating_point() or table.dim() != 2
                or table.shape[1] % 2 != 1):
            raise ValueError("fusedmha.flex.relative_position: table must be a floating-point "
                             "tensor (H, 2R + 1), got "
                             f"{getattr(table, 'shape', type(table).__name__)}")
        self.table = table

    def __call__(self, score, b, h, q_idx, kv_idx):
        R = self.table.shape[1] // 2
        return score + self.table[h, (kv_idx - q_idx).clamp(-R, R) + R]

    def variants(self, query, key, mask):
        if self.table.shape[0] != query.shape[1]:
            raise ValueError(f"fusedmha.flex.relative_position: table has {self.table.shape[0]} "
                             f"rows, the queries {query.shape[1]} heads")
        R = self.table.shape[1] // 2
        on = dict(device=self.table.device)
        distance = torch.arange(key.shape[2], **on) - torch.arange(query.shape[2], **on)[:, None]
        # (H, L, S): the bias the kernels read as a float mask.
        return bias(self.table[:, distance.clamp(-R, R) + R]).variants(query, key, mask)


def _block_mask_for(block_mask, query: Tensor, key: Tensor, caller: str) -> Tensor:
    """The bool mask block_mask stands for over (B, H, L, S) query (B, H, L, E) and key
    (B, H_kv, S, E) (_block_mask_dense); a BlockMask that does not fit them is refused, the
    message naming `caller`."""
    L, S = query.shape[2], key.shape[2]
    if tuple(block_mask.seq_lengths) != (L, S):
        raise ValueError(f"{caller}: block_mask is for (L, S) = {tuple(block_mask.seq_lengths)}, "
                         f"the inputs have ({L}, {S})")
    Bm, Hm = block_mask.kv_num_blocks.shape[:2]
    B, H = query.shape[0], query.shape[1]
    if Bm not in (1, B) or Hm not in (1, H):
        raise ValueError(f"{caller}: block_mask is for (B, H) = ({Bm}, {Hm}), the query has "
                         f"({B}, {H}): expected 1 or the query's, each")
    return _block_mask_dense(block_mask, B, H, query.device)


def _block_mask_dense(block_mask, B: int, H: int, device) -> Tensor:
    """The (B or 1, H or 1, L, S) bool mask a BlockMask stands for over B batches and H heads,
    evaluated once and kept on the BlockMask, keyed by what it was computed from (the mask_mod,
    the block tensors and their versions, B, H, the device): a BlockMask whose mask_mod or
    block lists change is evaluated again. (A mask_mod that reads tensors changed in place is
    not seen to change: build a new BlockMask then.) Under torch.compile, mask_mod is
    evaluated over the whole index grid in the graph instead (shapes that do not depend on the
    data, which the compiler fuses into one pass), and nothing is kept."""
    if torch.compiler.is_compiling():
        return _block_states_dense(block_mask, B, H, whole_grid=True).to(device)
    tensors = [t for t in (block_mask.kv_num_blocks, block_mask.kv_indices,
                           block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
               if t is not None]
    key = (B, H, device, block_mask.mask_mod, tuple(block_mask.seq_lengths),
           tuple(block_mask.BLOCK_SIZE), tuple((t.data_ptr(), t._version) for t in tensors))
    cached = block_mask.__dict__.get("_fusedmha_dense")
    if cached is None or cached[0] != key:
        cached = (key, _block_states_dense(block_mask, B, H, whole_grid=False).to(device))
        block_mask.__dict__["_fusedmha_dense"] = cached
    return cached[1]


def _block_states_dense(block_mask, B: int, H: int, whole_grid: bool) -> Tensor:
    """The BlockMask's dense mask over B batches and H heads: full blocks true, partial ones
    where mask_mod holds (evaluated over the partial blocks only, their bits then placed by the
    op block_mask_dense, which C++'s BlockMask shares; or with whole_grid over every index),
    the rest false. A BlockMask of batch or heads 1 lists its blocks for every batch
    index or head, and mask_mod is called with each one's own b and h, as flex_attention calls
    it; the result keeps a dim of 1 where every index gave the same mask (a mask_mod that does
    not read b or h), so that the kernels read one (L, S) mask then."""
    L, S = block_mask.seq_lengths
    QB, KB = block_mask.BLOCK_SIZE
    kv_num = block_mask.kv_num_blocks
    Bm, Hm, nq = kv_num.shape
    nk = -(-S // KB)
    on = dict(device=kv_num.device)
    if whole_grid:
        # Each block's state: 0 not listed, 1 partial, 2 full (column nk: where unlisted
        # entries of the index lists go).
        blocks = torch.zeros(Bm, Hm, nq, nk + 1, dtype=torch.uint8, **on)

        def mark(num, indices, value):
            listed = torch.arange(indices.shape[-1], **on) < num.unsqueeze(-1)
            target = torch.where(listed, indices.long().clamp(0, nk - 1), nk)
            blocks.scatter_(3, target, torch.full_like(target, value, dtype=torch.uint8))

        mark(kv_num, block_mask.kv_indices, 1)
        if block_mask.full_kv_num_blocks is not None:
            mark(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, 2)
        state = blocks[..., :nk].repeat_interleave(QB, 2).repeat_interleave(KB, 3)[:, :, :L, :S]
        allowed = block_mask.mask_mod(torch.arange(B, **on).view(-1, 1, 1, 1),
                                      torch.arange(H, **on).view(1, -1, 1, 1),
                                      torch.arange(L, **on).view(1, 1, -1, 1),
                                      torch.arange(S, **on).view(1, 1, 1, -1))
        return (state == 2) | ((state == 1) & allowed)
    # The listed partial blocks in list order, (count, 4): bm, hm, qb, position; and each one's
    # key block.
    K = block_mask.kv_indices.shape[-1]
    entries = (torch.arange(K, **on) < kv_num.unsqueeze(-1)).nonzero()
    kb = block_mask.kv_indices[entries.unbind(1)].long()
    # One mask_mod call over the index grids of all of them, (Bx, Hx, count, QB, KB):
    # Bx = B where the BlockMask's batch is 1 (each b of the query), else 1 (the listed b);
    # the same for heads. Indices past L or S (a last, shorter block) clamped for the call;
    # block_mask_dense drops them.
    bx = torch.arange(B, **on) if Bm == 1 and B > 1 else None
    hx = torch.arange(H, **on) if Hm == 1 and H > 1 else None
    b = (bx.view(-1, 1, 1, 1, 1) if bx is not None else entries[:, 0].view(1, 1, -1, 1, 1))
    h = (hx.view(1, -1, 1, 1, 1) if hx is not None else entries[:, 1].view(1, 1, -1, 1, 1))
    qi = entries[:, 2].view(1, 1, -1, 1, 1) * QB + torch.arange(QB, **on).view(1, 1, 1, -1, 1)
    # (A listed block outside the keys, refused by the op, is not passed to mask_mod.)
    ki = (kb.clamp(0, nk - 1).view(1, 1, -1, 1, 1) * KB
          + torch.arange(KB, **on).view(1, 1, 1, 1, -1))
    shape = (B if bx is not None else 1, H if hx is not None else 1, entries.shape[0], QB, KB)
    allowed = torch.as_tensor(block_mask.mask_mod(b.expand(shape), h.expand(shape),
                                                  qi.clamp(max=L - 1).expand(shape),
                                                  ki.clamp(max=S - 1).expand(shape)),
                              **on).bool().expand(shape)
    # (A dim of the query's batch or heads whose every index gave the same bits: kept as
    # its first, index 0.)
    for dim in (0, 1):
        if allowed.shape[dim] > 1 and bool((allowed == allowed.narrow(dim, 0, 1)).all()):
            allowed = allowed.narrow(dim, 0, 1)
    return torch.ops.fusedmha.block_mask_dense(
        kv_num, block_mask.kv_indices, allowed.contiguous(), [QB, KB], [L, S],
        block_mask.full_kv_num_blocks, block_mask.full_kv_indices)


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod=None, block_mask=None,
                   scale: Optional[float] = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options=None, *, return_aux=None):
    """torch.nn.attention.flex_attention.flex_attention for ``(B, H, L, E)`` queries and
    ``(B, H_kv, S, E)`` keys and values: ``block_mask`` a BlockMask of torch's
    ``create_block_mask`` (any BLOCK_SIZE; B and H of 1 broadcast), ``score_mod`` None or one of
    ``fusedmha.flex.softcap``, ``alibi``, ``bias``, ``relative_position``. Returns the output
    ``(B, H, L, Ev)`` and, with
    ``return_lse``, the log-sum-exp of each row ``(B, H, L)`` (float32; float64 for float64
    inputs). A row that sees no key gives 0 and an lse of -inf, as flex_attention's does.
    Differentiable with respect to query, key, value and a ``bias`` or ``relative_position``
    tensor.
    ``kernel_options`` tunes torch's compiled kernels and is not read here; ``return_aux`` must
    be None (use ``return_lse``)."""
    if return_aux is not None:
        raise ValueError("fusedmha.flex_attention: return_aux is not supported: pass "
                         "return_lse=True for the log-sum-exp")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"fusedmha.flex_attention: {name} must be a 4-D tensor "
                             f"(B, H, L or S, E), got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    if score_mod is not None and not isinstance(score_mod, _ScoreMod):
        raise TypeError(
            "fusedmha.flex_attention: score_mod must be None or one of fusedmha.flex.softcap(cap), "
            "fusedmha.flex.alibi(slopes), fusedmha.flex.bias(tensor), "
            "fusedmha.flex.relative_position(table) (a Python score_mod cannot "
            f"run inside the C++ kernels), got {score_mod!r}")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"fusedmha.flex_attention: query has {query.shape[1]} heads and key "
                         f"{key.shape[1]}: pass enable_gqa=True for grouped-query attention")
    mask = None
    if block_mask is not None:
        mask = _block_mask_for(block_mask, query, key, "fusedmha.flex_attention")
    variants = {}
    if score_mod is not None:
        variants, mask = score_mod.variants(query, key, mask)
    out, lse, _ = torch.ops.fusedmha.attention_forward(query, key, value, mask, 0.0, False, scale,
                                                       enable_gqa, **variants)
    if not return_lse:
        return out
    # (The kernels' lse of a row with no key is +inf, for their backward; flex's is -inf.)
    return out, torch.where(torch.isposinf(lse), float("-inf"), lse)
