"""Context parallelism: attention over a sequence sharded across the processes of a
``torch.distributed`` group (CPU with gloo, CUDA with NCCL), forward and backward.

    import fusedmha.distributed as cp
    q, k, v = (cp.shard(x, zigzag=True) for x in (q_full, k_full, v_full))  # (B, L/W, H, E)
    out = cp.ring_attention(q, k, v, causal=True)                           # this rank's rows
    out_full = cp.unshard(out, zigzag=True)

Ring attention: each rank keeps its queries; the K/V shards travel once around the ring
(``batch_isend_irecv``), each step's transfer overlapped with the compute on the shard that
arrived before. Each (query shard, key shard) pair is one call of the fused kernels, with the
causal band and the sliding window placed at the shards' global positions; the partial
results merge by their log-sum-exp. The backward recomputes each pair from the merged output
and log-sum-exp, keeps dQ, and sends dK/dV around the ring with the K/V until they reach
their owner. Each rank holds its shard plus one K/V shard (and, in the backward, one dK/dV
accumulator) in flight.

With ``causal``, contiguous shards give rank W-1 2W-1 times the work of rank 0; the zigzag
layout (rank r holds chunks r and 2W-1-r of 2W) gives every rank the same.
See docs/distributed.md for the cost model.
"""

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from fusedmha.modules import MultiheadAttention

__all__ = ["shard", "unshard", "ring_attention", "ContextParallelMultiheadAttention",
           "context_parallel"]

_RING = "fusedmha.distributed.ring_attention"


def _world(group) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fusedmha.distributed: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    return dist.get_world_size(group), dist.get_rank(group)


def _segments(rank: int, world: int, local_len: int, zigzag: bool) -> List[Tuple[int, int, int]]:
    """The rows a rank holds, as (global start, length, local start) runs."""
    if not zigzag:
        return [(rank * local_len, local_len, 0)]
    c = local_len // 2
    return [(rank * c, c, 0), ((2 * world - 1 - rank) * c, c, c)]


def shard(x: Tensor, seq_dim: int = 1, group=None, zigzag: bool = False) -> Tensor:
    """This rank's shard of a whole sequence: rows ``[r·L/W, (r+1)·L/W)`` of dim ``seq_dim``,
    or with ``zigzag`` chunks r and 2W-1-r of 2W (concatenated). A view when contiguous."""
    world, rank = _world(group)
    length = x.size(seq_dim)
    parts = 2 * world if zigzag else world
    if length % parts:
        raise ValueError(f"fusedmha.distributed.shard: sequence length {length} (dim {seq_dim}) "
                         f"is not a multiple of {parts} ({'2 x ' if zigzag else ''}world size "
                         f"{world})")
    segs = _segments(rank, world, length // world, zigzag)
    pieces = [x.narrow(seq_dim, start, n) for start, n, _ in segs]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, seq_dim)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seq_dim, group, zigzag):
        world, rank = _world(group)
        ctx.seq_dim, ctx.group, ctx.zigzag = seq_dim, group, zigzag
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        if not zigzag:
            return torch.cat(parts, seq_dim)
        c = x.size(seq_dim) // 2
        first = [p.narrow(seq_dim, 0, c) for p in parts]
        second = [p.narrow(seq_dim, c, c) for p in reversed(parts)]
        return torch.cat(first + second, seq_dim)

    @staticmethod
    def backward(ctx, grad):
        # Every rank got the whole sequence: the gradient of the sum of their losses.
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return shard(grad, ctx.seq_dim, ctx.group, ctx.zigzag), None, None, None


def unshard(x_local: Tensor, seq_dim: int = 1, group=None, zigzag: bool = False) -> Tensor:
    """The whole sequence on every rank, gathered from the shards :func:`shard` made.
    Differentiable: the gradient is that of the sum of every rank's loss."""
    return _Unshard.apply(x_local, seq_dim, group, zigzag)


# --------------------------------------------------------------------------------------------
# One (query run, key run) pair: the kernels' top-left band, placed at the runs' positions.

def _pair(q_start: int, lq: int, k_start: int, lk: int, left: int, right: int):
    """Query row i (global q_start + i) sees key j (global k_start + j) iff
    i + d - left <= j <= i + d + right, d = q_start - k_start (-1: that side unbounded).
    Drops the leading and trailing query rows and the trailing keys that see nothing, and
    places the band on the kernels' bottom-right diagonal (key j sees row i when
    j - (i + nk - nq) lies in [-a, b]), which then always fits the runs. The keys are never
    cut at the front: column j stays global column k_start + j, as the dropout stream needs.
    Returns (t, nq, nk, a, b): rows t..t+nq and keys 0..nk; None when no row sees any key."""
    d = q_start - k_start
    t = max(0, -right - d) if right >= 0 else 0
    end = min(lq, lk - d + left) if left >= 0 else lq
    nq = end - t
    nk = min(lk, end + d + right) if right >= 0 else lk
    if nq <= 0 or nk <= 0:
        return None
    diagonal = nk - nq  # of the kernels, in the kept rows' coordinates
    shift = d + t - diagonal  # where the band's diagonal lies against it
    a = -1 if left < 0 else left - shift
    b = -1 if right < 0 else right + shift
    assert a >= -1 and b >= -1, (q_start, lq, k_start, lk, left, right)
    if a >= nk - 1:  # every kept row's band starts at or before key 0
        a = -1
    if b >= nq - 1:  # ... and ends at or past the last key
        b = -1
    return t, nq, nk, a, b


def _pairs(rank, src, world, local_len, zigzag, left, right):
    """The pairs of this rank's query runs with the key runs of rank src, as
    (q rows, k rows, a, b, global row, global column) with rows = (local start, length)."""
    out = []
    for qs, lq, ql in _segments(rank, world, local_len, zigzag):
        for ks, lk, kl in _segments(src, world, local_len, zigzag):
            p = _pair(qs, lq, ks, lk, left, right)
            if p is not None:
                t, nq, nk, a, b = p
                out.append(((ql + t, nq), (kl, nk), a, b, qs + t, ks))
    return out


def _exchange(sends: Sequence[Tensor], group, world, rank, tag):
    """Starts sending tensors to the next rank and receiving their likes from the previous
    one; returns (requests, received)."""
    recvs = [torch.empty_like(t) for t in sends]
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=nxt, tag=tag) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=prev, tag=tag) for t in recvs]
    return dist.batch_isend_irecv(ops), recvs


def _wait(requests):
    for r in requests:
        r.wait()


def _merge_into(out_acc, lse_acc, rows, out, lse):
    """Folds a partial (out, lse) over rows (start, n) into the running result, by
    log-sum-exp. The kernels give lse +inf to a row with no key: it weighs nothing."""
    start, n = rows
    o, l = out_acc.narrow(2, start, n), lse_acc.narrow(2, start, n)
    lse = torch.where(lse == math.inf, -math.inf, lse.to(l.dtype))
    total = torch.logaddexp(l, lse)
    seen = total > -math.inf
    w_old = torch.where(seen, (l - total).exp(), 0.0).unsqueeze(-1)
    w_new = torch.where(seen, (lse - total).exp(), 0.0).unsqueeze(-1)
    o.copy_(o * w_old + out.to(o.dtype) * w_new)
    l.copy_(total)


def _draw_dropout_state(group, device) -> Tensor:
    """The dropout stream of one ring call, [seed, offset]: drawn from the default generator
    on the group's first rank, the same on every rank."""
    state = torch.empty(2, dtype=torch.int64).random_()
    if device.type == "cuda":
        state = state.to(device)
    dist.broadcast(state, group_src=0, group=group)
    return state.cpu()


def _pair_stream(state, dropout_p, row0, col0):
    """A pair's dropout_state: the call's stream, positioned at the pair's global first row
    and column, so that it drops what a call on the whole sequence drops."""
    if dropout_p == 0.0:
        return None
    return torch.tensor([int(state[0]), int(state[1]), row0, col0], dtype=torch.int64)


def _band(a, b):
    return dict(window_left=a, window_right=b, bottom_right=True)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, zigzag, scale, left, right, dropout_p):
        # (B, L, H, E) -> the ops' (B, H, L, E), as views.
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        world, rank = _world(group)
        L, gqa = qh.size(2), qh.size(1) != kh.size(1)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out_acc = qh.new_zeros(qh.shape[:-1] + (vh.size(-1),), dtype=acc)
        lse_acc = qh.new_full(qh.shape[:-1], -math.inf, dtype=acc)
        cur = (kh.contiguous(), vh.contiguous())
        state = _draw_dropout_state(group, q.device) if dropout_p > 0 else torch.zeros(2, dtype=torch.int64)
        rng = None  # (without dropout: what the backward op takes as the stream)
        for step in range(world):
            if step < world - 1:
                requests, nxt = _exchange(cur, group, world, rank, tag=0)
            src = (rank - step) % world
            for (qr, kr, a, b, row0, col0) in _pairs(rank, src, world, L, zigzag, left, right):
                out, lse, rng = torch.ops.fusedmha.attention_forward(
                    qh.narrow(2, *qr), cur[0].narrow(2, *kr), cur[1].narrow(2, *kr), None,
                    dropout_p, False, scale, gqa, **_band(a, b),
                    dropout_state=_pair_stream(state, dropout_p, row0, col0))
                _merge_into(out_acc, lse_acc, qr, out, lse)
            if step < world - 1:
                _wait(requests)
                cur = tuple(nxt)
        out = out_acc.to(q.dtype)
        lse = torch.where(lse_acc == -math.inf, math.inf, lse_acc)
        ctx.save_for_backward(qh, kh, vh, out, lse, rng, state)
        ctx.config = (group, zigzag, scale, left, right, dropout_p)
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad):
        qh, kh, vh, out, lse, rng, state = ctx.saved_tensors
        group, zigzag, scale, left, right, dropout_p = ctx.config
        world, rank = _world(group)
        L, gqa = qh.size(2), qh.size(1) != kh.size(1)
        gh = grad.transpose(1, 2)
        acc = torch.float64 if qh.dtype == torch.float64 else torch.float32
        dq = torch.zeros(qh.shape, dtype=acc, device=qh.device)
        cur = (kh.contiguous(), vh.contiguous())
        pending = None  # the dK/dV accumulator of the shard held, on its way from the left
        for step in range(world):
            if step < world - 1:
                requests, nxt = _exchange(cur, group, world, rank, tag=0)
            src = (rank - step) % world
            dk = torch.zeros(cur[0].shape, dtype=acc, device=qh.device)
            dv = torch.zeros(cur[1].shape, dtype=acc, device=qh.device)
            for (qr, kr, a, b, row0, col0) in _pairs(rank, src, world, L, zigzag, left, right):
                rows = lambda t: t.narrow(2, *qr)  # noqa: E731
                g_q, g_k, g_v, _ = torch.ops.fusedmha.attention_backward(
                    rows(gh), rows(qh), cur[0].narrow(2, *kr), cur[1].narrow(2, *kr),
                    rows(out), lse.narrow(2, *qr),
                    rng if dropout_p == 0.0 else _pair_stream(state, dropout_p, row0, col0),
                    None, dropout_p, False, scale, gqa, **_band(a, b))
                rows(dq).add_(g_q)
                dk.narrow(2, *kr).add_(g_k)
                dv.narrow(2, *kr).add_(g_v)
            if pending is not None:
                _wait(pending[0])
                dk.add_(pending[1][0])
                dv.add_(pending[1][1])
            pending = _exchange((dk, dv), group, world, rank, tag=1) if world > 1 else None
            if step < world - 1:
                _wait(requests)
                cur = tuple(nxt)
        if pending is not None:  # this rank's own accumulator, back from its last holder
            _wait(pending[0])
            dk, dv = pending[1]
        grads = (dq.to(qh.dtype), dk.to(kh.dtype), dv.to(vh.dtype))
        return tuple(g.transpose(1, 2) for g in grads) + (None,) * 6


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group=None, causal: bool = False,
                   zigzag: Optional[bool] = None, dropout_p: float = 0.0,
                   softmax_scale: Optional[float] = None,
                   window_size: Tuple[int, int] = (-1, -1)) -> Tensor:
    """Attention of this rank's queries over the whole sharded sequence: q ``(B, L_local, H,
    E)``, k and v ``(B, L_local, H_kv, E)`` (``flash_attn_func``'s layout, H a multiple of H_kv)
    as :func:`shard` cut them, the same L_local on every rank. ``causal`` and ``window_size``
    are placed at the global positions (the whole sequence is square, so FlashAttention's
    bottom-right alignment is the top-left one); ``zigzag`` (default: ``causal``) says how the
    sequence was sharded. Returns this rank's rows of the output, ``(B, L_local, H, E)``;
    differentiable with respect to q, k and v.

    ``dropout_p`` drops exactly what the single-process op drops on the whole sequence with the
    same stream: the ring draws one (seed, offset) on its first rank, and each step's call
    counts rows and columns from its shards' global positions. Dense masks are not taken (a
    mask would cross shards)."""
    world, rank = _world(group)
    zigzag = causal if zigzag is None else bool(zigzag)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{_RING}: expected q, k, v of shape (B, L_local, H, E), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[:2] != k.shape[:2] or q.size(3) != k.size(3):
        raise ValueError(f"{_RING}: expected k and v (B, L_local, H_kv, E) with q's B, L_local "
                         f"and E; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.size(2) == 0 or q.size(2) % k.size(2):
        raise ValueError(f"{_RING}: the {q.size(2)} query heads are not a multiple of the "
                         f"{k.size(2)} key/value heads")
    if zigzag and q.size(1) % 2:
        raise ValueError(f"{_RING}: zigzag shards hold two chunks of one length; got L_local = "
                         f"{q.size(1)} (shard(..., zigzag=True) cuts them)")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{_RING}: dropout_p must be in [0, 1), got {dropout_p}")
    chunk = q.size(1) // 2 if zigzag else q.size(1)
    if dropout_p > 0.0 and chunk % 4:
        raise ValueError(f"{_RING}: with dropout, each shard's chunks must be a multiple of 4 "
                         f"long (the dropout stream draws 4 columns at a time); got {chunk}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"{_RING}: expected q, k, v of one floating dtype, got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    lengths = torch.tensor([q.size(1)], device=q.device if q.is_cuda else "cpu")
    every = [torch.empty_like(lengths) for _ in range(world)]
    dist.all_gather(every, lengths, group=group)
    if any(int(n) != q.size(1) for n in every):
        raise ValueError(f"{_RING}: every rank must hold a shard of the same length; got "
                         f"{[int(n) for n in every]}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"{_RING}: window_size entries must be >= -1, got {window_size}")
    if causal:
        right = 0
    if softmax_scale is not None:
        scale = float(softmax_scale)
    else:  # (E = 0: every score is 0, whatever the scale)
        scale = 1.0 / math.sqrt(q.size(-1)) if q.size(-1) > 0 else 0.0
    return _RingAttention.apply(q, k, v, group, zigzag, scale, left, right, float(dropout_p))


# --------------------------------------------------------------------------------------------
# The module path.

def _self_attention_only(module, args, kwargs):
    """Forward pre-hook: context parallelism is for self-attention over this rank's shard.
    (Being a hook also keeps nn.TransformerEncoderLayer off its fused inference fast path,
    which would attend within the local shard only.)"""
    query, key, value = (args[i] if i < len(args) else kwargs.get(name)
                         for i, name in enumerate(("query", "key", "value")))
    if not (query is key and key is value):
        raise ValueError("fusedmha.distributed.ContextParallelMultiheadAttention: expected "
                         "self-attention (query, key and value the same tensor: this rank's "
                         "shard of the sequence)")


class ContextParallelMultiheadAttention(MultiheadAttention):
    """:class:`fusedmha.MultiheadAttention` whose self-attention runs over a sequence sharded
    across the ranks of ``group``: each rank passes its shard (as :func:`shard` cuts it, on
    the sequence dim: 0, or 1 with ``batch_first``) and gets its shard of the output. The
    projections are per token; the attention is :func:`ring_attention`. Same parameters and
    ``state_dict`` as nn.MultiheadAttention; wrap a model with :func:`context_parallel`.

    Takes ``is_causal=True`` (the causal mask over the whole sequence; an ``attn_mask`` passed
    with it is trusted to be that mask, as PyTorch does) and no other mask: a dense mask or a
    key padding mask would cross shards. ``need_weights`` must be False (the weights of a row
    span every rank), and ``bias_k``/``add_zero_attn`` are not supported."""

    def __init__(self, *args, group=None, zigzag: Optional[bool] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group, self.zigzag = group, zigzag
        self.register_forward_pre_hook(_self_attention_only, with_kwargs=True)

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[Tensor, None]:
        name = "fusedmha.distributed.ContextParallelMultiheadAttention"
        if key_padding_mask is not None or (attn_mask is not None and not is_causal):
            raise ValueError(f"{name}: masks are not supported (a dense mask or a key padding "
                             "mask crosses shards); is_causal=True is")
        if need_weights:
            raise ValueError(f"{name}: need_weights=True is not supported (a row's weights span "
                             "every rank); pass need_weights=False")
        if self.bias_k is not None or self.add_zero_attn:
            raise ValueError(f"{name}: add_bias_kv and add_zero_attn are not supported")
        dropout_p = float(self.dropout) if self.training else 0.0
        batched = query.dim() == 3
        if not batched:
            query = key = value = query.unsqueeze(1)
        seq_first = not (self.batch_first and batched)
        q, k, v = self._project(query, query, query, seq_first)  # (N, H, L, D) views
        out = ring_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                             group=self.group, causal=is_causal, zigzag=self.zigzag,
                             dropout_p=dropout_p)  # (N, L, H, D)
        if seq_first:
            out = out.transpose(0, 1)
        out = F.linear(out.flatten(2), self.out_proj.weight, self.out_proj.bias)
        return (out if batched else out.squeeze(1)), None


def context_parallel(model: nn.Module, group=None, zigzag: Optional[bool] = None) -> nn.Module:
    """Makes every ``nn.MultiheadAttention`` and ``fusedmha.MultiheadAttention`` in ``model`` a
    :class:`ContextParallelMultiheadAttention` that shares its parameters (the same Parameter
    objects: call it before building the optimizer or wrapping in DDP). The model then takes
    this rank's shard of each sequence (:func:`shard`) and returns its shard of the outputs;
    per-token layers (projections, feed-forward, norms) need nothing else. Returns model."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (nn.MultiheadAttention, MultiheadAttention)) and not isinstance(
                    child, ContextParallelMultiheadAttention):
                setattr(parent, name, _converted(child, group, zigzag))
    if isinstance(model, (nn.MultiheadAttention, MultiheadAttention)) and not isinstance(
            model, ContextParallelMultiheadAttention):
        return _converted(model, group, zigzag)
    return model


def _converted(m, group, zigzag):
    cp = ContextParallelMultiheadAttention(
        m.embed_dim, m.num_heads, dropout=m.dropout, bias=m.in_proj_bias is not None,
        add_bias_kv=m.bias_k is not None, add_zero_attn=m.add_zero_attn, kdim=m.kdim,
        vdim=m.vdim, batch_first=m.batch_first, device="meta", group=group, zigzag=zigzag)
    for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                 "in_proj_bias", "bias_k", "bias_v"):
        setattr(cp, name, getattr(m, name))
    cp.out_proj = m.out_proj
    cp.train(m.training)
    return cp
