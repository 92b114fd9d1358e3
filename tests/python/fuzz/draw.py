"""The random inputs every entry point's generator shares: dtypes, tensors in every layout
(transposed, sliced, strided, expand()ed, overlapping, flipped), NaN/inf written into them, and
attention problems in the (..., H, L, E) layout of SDPA and the ops (sizes, masks of every kind,
bands, the variants), plus moving tensors to the meta device. Every draw comes from the case's
own random.Random and torch.Generator, in a fixed order: the same seed draws the same case."""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from .case import describe, kwargs_text


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
NAN, INF = float("nan"), float("inf")


LAYOUTS = ["contiguous"] * 4 + ["transposed", "sliced", "strided_last", "expanded",
                                "overlapping", "flipped"]


def randn(shape, dtype, g):
    return torch.randn(tuple(shape), generator=g).to(dtype)


def make(shape, dtype, layout, rng, g):
    """Standard normal values of `shape`, laid out as `layout` says (values drawn from g)."""
    shape = list(shape)
    n = len(shape)
    if 0 in shape or layout == "contiguous":
        return randn(shape, dtype, g)
    if layout == "transposed" and n >= 3:  # (..., L, H, E) memory seen as (..., H, L, E)
        perm = list(range(n))
        perm[-3], perm[-2] = perm[-2], perm[-3]
        return randn([shape[i] for i in perm], dtype, g).permute(perm)
    if layout == "sliced":  # an inner block of a bigger tensor
        pad = rng.randint(1, 3)
        base = randn(shape[:-2] + [shape[-2] + pad, shape[-1] + pad], dtype, g)
        return base[..., pad:, :shape[-1]]
    if layout == "strided_last":
        return randn(shape[:-1] + [2 * shape[-1]], dtype, g)[..., ::2]
    if layout == "expanded":  # stride 0 along one dim: all its entries are the same memory
        dims = [d for d in range(n) if shape[d] > 1] or [0]
        d = rng.choice(dims)
        small = list(shape)
        small[d] = 1
        return randn(small, dtype, g).expand(shape)
    if layout == "overlapping":  # rows that share elements: an as_strided view of a 1-D buffer
        strides = [0] * n
        strides[-1] = 1
        strides[-2] = rng.randint(1, max(1, shape[-1] - 1))
        for d in range(n - 3, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1] if rng.random() < 0.5 else 1 + (
                shape[d + 1] - 1) * strides[d + 1]
        size = 1 + sum((s - 1) * st for s, st in zip(shape, strides))
        return randn([size], dtype, g).as_strided(shape, strides)
    if layout == "flipped":  # PyTorch has no negative strides: flip() copies
        return randn(shape, dtype, g).flip(rng.randrange(n))
    return randn(shape, dtype, g)


def nonfinite_into(t, rng, g, what="any"):
    """A copy of t with a few NaN/+-inf written at random places (contiguous, so each element
    is its own), and the kind written."""
    t = t.contiguous().clone()
    if t.numel() == 0:
        return t
    value = rng.choice([NAN, INF, -INF]) if what == "any" else what
    for _ in range(rng.randint(1, 3)):
        t.view(-1)[rng.randrange(t.numel())] = value
    return t


@dataclass
class Problem:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: Optional[float] = None
    gqa: bool = False
    variants: dict = field(default_factory=dict)

    def variant_active(self):
        v = self.variants
        return (v.get("window_left", -1) != -1 or v.get("window_right", -1) != -1
                or v.get("softcap", 0.0) > 0 or v.get("alibi_slopes") is not None
                or v.get("sinks") is not None or (v.get("bottom_right") and self.is_causal))

    def text(self):
        kw = dict(attn_mask=self.mask, dropout_p=self.dropout_p, is_causal=self.is_causal,
                  scale=self.scale, enable_gqa=self.gqa, **self.variants)
        kw = {k: v for k, v in kw.items()
              if isinstance(v, torch.Tensor) or v not in (None, False, 0.0, -1)}
        return f"q={describe(self.q)} k={describe(self.k)} v={describe(self.v)} {kwargs_text(kw)}"


LENGTHS = [1, 1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 23, 31, 32, 33, 47, 63, 64, 65, 80, 97, 130]
HEAD_DIMS = [1, 2, 3, 4, 5, 7, 8, 12, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 80, 96, 100,
             128, 130, 256]


def draw_sizes(rng, max_work=400_000):
    """(batch dims, H, H_kv, L, S, E, Ev), with L*S*(E+Ev)*batch*H kept small."""
    while True:
        batch = [rng.choice([1, 1, 2, 3]) for _ in range(rng.choice([0, 1, 1, 2]))]
        h_kv = rng.choice([1, 1, 2, 3])
        h = h_kv * rng.choice([1, 1, 2, 3])
        L, S = rng.choice(LENGTHS), rng.choice(LENGTHS)
        E = rng.choice(HEAD_DIMS)
        Ev = E if rng.random() < 0.6 else rng.choice(HEAD_DIMS)
        if math.prod(batch) * h * L * S * (E + Ev) <= max_work:
            return batch, h, h_kv, L, S, E, Ev


def draw_band_mask(rng, outer, L, S, dtype):
    """A mask that is a causal band (or a sliding window) with per-batch key spans, bool or 0
    and -inf, or 0 and the dtype's lowest value where every row sees a key (the CPU host reads
    it as the band and spans), one element of it flipped now and then (then it is not, and
    the mask is read)."""
    batches = outer[0] if len(outer) >= 2 and rng.random() < 0.6 else 1
    diagonal = rng.randint(-3, max(S - L, 0) + 3)
    window_left = rng.choice([None, None, 0, 2, 9])
    causal = rng.random() < 0.8
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    rows = []
    for _ in range(batches):
        begin = rng.randint(0, S) if rng.random() < 0.5 else 0
        end = rng.randint(begin, S) if rng.random() < 0.5 else S
        keep = (j >= begin) & (j < end)
        if causal:
            keep = keep & (j <= i + diagonal)
        if window_left is not None:
            keep = keep & (j >= i + diagonal - window_left)
        rows.append(keep.expand(L, S))
    mask = torch.stack(rows)
    if rng.random() < 0.2:
        b, r, c = rng.randrange(batches), rng.randrange(L), rng.randrange(S)
        mask[b, r, c] = ~mask[b, r, c]
    if batches > 1:
        mask = mask.view([batches] + [1] * (len(outer) - 1) + [L, S])
    elif not outer or rng.random() < 0.5:  # ((L, S); (1, L, S) only beside an outer dim)
        mask = mask[0]
    if outer and rng.random() < 0.2:  # (copied for every head, as repeat_interleave makes it)
        mask = mask.expand(list(outer) + [L, S]).contiguous()
    if rng.random() < 0.4:
        mdtype = dtype if rng.random() < 0.5 else torch.float32
        hidden = -INF
        if mdtype != torch.float16 and bool(mask.any(-1).all()) and rng.random() < 0.5:
            hidden = torch.finfo(mdtype).min  # (transformers' older float masks)
        mask = torch.zeros(mask.shape, dtype=mdtype).masked_fill(~mask, hidden)
    return mask


def draw_mask(rng, g, outer, L, S, dtype):
    """A bool or float mask of a shape broadcastable to (*outer, L, S) (None sometimes), with
    some rows fully masked now and then; or a band with key spans (draw_band_mask)."""
    kind = rng.choice(["bool", "bool", "float", "float32", "band"])
    if kind == "band":
        return draw_band_mask(rng, outer, L, S, dtype)
    full = list(outer) + [L, S]
    shape = [n if rng.random() < 0.5 else 1 for n in full]
    shape[-1] = S if rng.random() < 0.8 else 1
    shape = shape[rng.randint(0, len(shape) - 1):]  # drop some leading dims
    if kind == "bool":
        mask = torch.rand(shape, generator=g) > rng.choice([0.0, 0.2, 0.5, 0.9])
        if rng.random() < 0.2 and len(shape) >= 2 and shape[-2] > 1:
            mask[..., rng.randrange(shape[-2]), :] = False  # a row with no key
    else:
        mdtype = dtype if kind == "float" else torch.float32
        mask = torch.randn(shape, generator=g)
        if rng.random() < 0.5:
            mask = mask.masked_fill(torch.rand(shape, generator=g) < 0.3, -INF)
        if rng.random() < 0.2 and len(shape) >= 2 and shape[-2] > 1:
            mask[..., rng.randrange(shape[-2]), :] = -INF
        mask = mask.to(mdtype)
    if rng.random() < 0.2 and mask.dim() >= 2:  # a view of a transposed buffer
        mask = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
    if rng.random() < 0.1 and mask.dim() >= 1:  # stride-0: a (1, S) row expanded
        mask = mask[..., :1, :].expand(mask.shape) if mask.dim() >= 2 else mask
    return mask


def draw_variants(rng, g, outer, h, dtype, allow=True):
    if not allow or rng.random() < 0.55:
        return {}
    v = {}
    if rng.random() < 0.35:
        v["window_left"] = rng.choice([-1, 0, 1, 3, 7, 20])
        v["window_right"] = rng.choice([-1, -1, 0, 2, 9])
    if rng.random() < 0.5:
        v["bottom_right"] = True
    if rng.random() < 0.3:
        v["softcap"] = rng.choice([0.5, 1.5, 5.0, 30.0])
    if rng.random() < 0.3:
        per_batch = len(outer) >= 2 and rng.random() < 0.5
        shape = [outer[-2], h] if per_batch else [h]
        v["alibi_slopes"] = torch.rand(shape, generator=g) * 0.3
    if rng.random() < 0.3:
        v["sinks"] = randn([h], dtype, g)
    return v


def draw_problem(rng, g, dtype, *, front_door, layouts=True, variants=True, dropout=True):
    """A random valid attention call (what the SDPA front door or the ops accept)."""
    batch, h, h_kv, L, S, E, Ev = draw_sizes(rng)
    gqa = h != h_kv and rng.random() < 0.9
    if not gqa:
        h_kv = h if rng.random() < 0.8 else 1  # heads broadcast
    no_heads = not batch and not gqa and rng.random() < 0.15  # plain (L, E) inputs
    kv_batch = [n if rng.random() < 0.8 else 1 for n in batch]  # batch dims broadcast
    pick = (lambda: rng.choice(LAYOUTS)) if layouts else (lambda: "contiguous")
    if no_heads:
        qs, ks, vs = [L, E], [S, E], [S, Ev]
    else:
        qs, ks, vs = batch + [h, L, E], kv_batch + [h_kv, S, E], kv_batch + [h_kv, S, Ev]
    q, k, v = make(qs, dtype, pick(), rng, g), make(ks, dtype, pick(), rng, g), make(vs, dtype, pick(), rng, g)
    outer = [] if no_heads else batch + [h]
    pb = Problem(q, k, v, gqa=gqa)
    r = rng.random()
    if r < 0.25:
        pb.is_causal = True
    if r > 0.45 and (not pb.is_causal or not front_door):
        pb.mask = draw_mask(rng, g, outer, L, S, dtype)
    if pb.is_causal and not front_door and rng.random() < 0.3:
        pb.mask = draw_mask(rng, g, outer, L, S, dtype)
    if rng.random() < 0.3:
        pb.scale = rng.choice([0.0, 0.05, 0.3, 1.0, 2.0])
    if dropout and rng.random() < 0.2:
        pb.dropout_p = rng.choice([0.1, 0.3, 0.5, 0.9])
    pb.variants = draw_variants(rng, g, outer, h if not no_heads else 1, dtype,
                                allow=variants and not no_heads)
    return pb


def outer_of(pb):
    """The (..., H) outer shape of a problem's output."""
    if pb.q.dim() == 2:
        return []
    h = pb.q.shape[-3]
    if not pb.gqa:
        h = torch.broadcast_shapes((pb.q.shape[-3],), (pb.k.shape[-3],), (pb.v.shape[-3],))[0]
    batch = torch.broadcast_shapes(pb.q.shape[:-3], pb.k.shape[:-3], pb.v.shape[:-3])
    return list(batch) + [h]


def poison(pb, rng, g):
    """Write NaN/inf into one of q, k, v or a float mask of the problem."""
    targets = ["q", "k", "v"] + (["mask"] if pb.mask is not None and pb.mask.dtype != torch.bool else [])
    target = rng.choice(targets)
    if target == "mask":
        pb.mask = nonfinite_into(pb.mask, rng, g)
    else:
        setattr(pb, target, nonfinite_into(getattr(pb, target), rng, g))
    pb.dropout_p = 0.0  # dropout's 0 * NaN is its own question; keep the truth exact
    return target


def meta_swap(tensors, rng):
    """One of the tensors moved to the meta device."""
    i = rng.randrange(len(tensors))
    tensors = list(tensors)
    tensors[i] = tensors[i].to("meta")
    return tensors, i


def to_meta(x):
    if isinstance(x, torch.Tensor):  # with x's strides (x.to("meta") lays out expand()ed views anew)
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, dict):
        return {k: to_meta(v) for k, v in x.items()}
    return x


def leaves_with_sinks(tensors, kw):
    """Fresh leaves of q, k, v, and of kw's sinks when there are any, to differentiate."""
    leaves = [t.detach().requires_grad_() for t in tensors]
    if kw.get("sinks") is not None:
        leaves.append(kw["sinks"].detach().requires_grad_())
    return leaves
