"""The cases of fusedmha.flash_attn_with_kvcache: new keys and values appended to the caches
in place, then attention over the cache (rotary embedding, a paged cache, cache_batch_idx,
cache_leftpad, GQA, the variants); the output and the caches after the call judged against
the float64 truth. Valid calls, nonfinite, empty, meta, caches that overlap (which must be
refused), and the broken calls that must raise."""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

import fusedmha
from reference import assert_close_to_truth
from test_kvcache import rotate  # (rotary embedding, written independently)

from .case import ENTRY_POINTS, Case, Mismatch, describe, expect, kwargs_text, names_error, raise_ok
from .draw import DTYPES, HEAD_DIMS, INF, LAYOUTS, NAN, Problem, make, nonfinite_into, randn, to_meta
from .judge import (
    FIXED_TOL, check_logsumexp, fixed_floor, reference_of, same_meta_outputs, same_values)
from .nonfinite import check_nonfinite


@dataclass
class KVCall:
    """One flash_attn_with_kvcache call, and the lengths its tensors encode."""
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    kw: dict
    seqlens: list  # the cache lengths before the append, per sequence
    pads: list  # cache_leftpad, per sequence
    rows: int  # cache rows per sequence

    def __call__(self):
        return fusedmha.flash_attn_with_kvcache(self.q, self.k_cache, self.v_cache, self.k, self.v,
                                                **self.kw)

    def text(self):
        kw = {n: (x.tolist() if n in ("cache_seqlens", "cache_batch_idx", "cache_leftpad")
                  and isinstance(x, torch.Tensor) and x.numel() <= 8 and x.device.type == "cpu"
                  else x) for n, x in self.kw.items()}
        return (f"q={describe(self.q)} k_cache={describe(self.k_cache)} v_cache={describe(self.v_cache)} "
                f"k={describe(self.k)} v={describe(self.v)} {kwargs_text(kw)}")


def cache_pair(shape, dtype, layout, g):
    """k_cache and v_cache of `shape`, distinct memory, laid out as `layout` says."""
    if layout == "sliced":  # the first rows and dims of a bigger buffer
        big = [shape[0], shape[1] + 2, shape[2], shape[3] + 1]
        return tuple(randn(big, dtype, g)[:, :shape[1], :, :shape[3]] for _ in range(2))
    if layout == "heads_major":  # (B, H, S, E) memory seen as (B, S, H, E)
        return tuple(randn([shape[0], shape[2], shape[1], shape[3]], dtype, g).transpose(1, 2)
                     for _ in range(2))
    if layout == "halves":  # the two halves of one buffer
        kv = randn([2] + list(shape), dtype, g)
        return kv[0], kv[1]
    return randn(shape, dtype, g), randn(shape, dtype, g)


def draw_kvcache(rng, g, dtype, *, layouts=True, rotary=True, variants=True, empty=None):
    """A random valid flash_attn_with_kvcache call; `empty` makes one size 0 (B0, L0, new0, H0,
    S0: an empty cache, nothing: no key at all)."""
    while True:
        B = rng.choice([1, 1, 2, 3, 4])
        h_kv = rng.choice([1, 1, 2, 3])
        h = h_kv * rng.choice([1, 1, 2, 4])
        E = rng.choice(HEAD_DIMS[:21])
        L = rng.choice([1, 1, 1, 2, 3, 4, 7, 16])
        new = rng.choice([None, 0, 1, 1, 1, 2, 3, 8])
        paged = rng.random() < 0.25
        if empty == "B0":
            B = 0
        elif empty == "L0":
            L = 0
        elif empty == "new0":
            new = 0
        elif empty == "H0":
            h = h_kv = 0
        elif empty in ("S0", "nothing"):
            new, paged = None, False
        n_new = new or 0
        if paged:
            page = rng.choice([1, 2, 3, 16, 64])
            per_seq = max(-(-(n_new + 1) // page), rng.randint(1, max(1, 96 // page)))
            rows = page * per_seq
        else:
            rows = 0 if empty == "S0" else n_new + rng.choice([0, 1, 4, 17, 40, 100])
        if B * h * max(L, 1) * max(rows, 1) * E <= 300_000:
            break
    pick = (lambda: rng.choice(LAYOUTS)) if layouts else (lambda: "contiguous")
    kw = {}
    batch_idx = not paged and rng.random() < 0.25
    leftpad = not paged and rng.random() < 0.2
    if paged:
        num_pages = B * per_seq + rng.randint(0, 3)
        table = torch.randperm(num_pages, generator=g)[:B * per_seq].view(B, per_seq).to(torch.int32)
        k_cache, v_cache = cache_pair([num_pages, page, h_kv, E], dtype,
                                      rng.choice(["contiguous", "halves"]) if layouts else "contiguous", g)
        kw["block_table"] = table
    else:
        B_cache = B + (rng.randint(0, 2) if batch_idx else rng.choice([0, 0, 1]))
        layout = rng.choice(["contiguous", "contiguous", "sliced", "heads_major", "halves"])
        k_cache, v_cache = cache_pair([B_cache, rows, h_kv, E], dtype, layout if layouts else "contiguous", g)
        if batch_idx:
            kw["cache_batch_idx"] = torch.randperm(B_cache, generator=g)[:B].to(torch.int32)
    room = rows - n_new
    if empty == "nothing":
        seqlens = [0] * B
    elif rng.random() < 0.3:
        seqlens = [rng.randint(0, room)] * B
    else:
        seqlens = [rng.randint(0, room) for _ in range(B)]
    pads = [rng.randint(0, n) for n in seqlens] if leftpad else [0] * B
    if leftpad:
        kw["cache_leftpad"] = torch.tensor(pads, dtype=torch.int32)
    if new is None and not leftpad and rng.random() < 0.15 and empty != "nothing":
        seqlens = [rows] * B  # default: the whole cache
    elif len(set(seqlens)) == 1 and rng.random() < 0.5:
        kw["cache_seqlens"] = seqlens[0] if seqlens else 0
    else:
        kw["cache_seqlens"] = torch.tensor(seqlens, dtype=rng.choice([torch.int32, torch.int32, torch.int64]))
    q = make([B, L, h, E], dtype, pick(), rng, g)
    k = v = None
    if new is not None:
        k = make([B, n_new, h_kv, E], dtype, pick(), rng, g)
        v = make([B, n_new, h_kv, E], dtype, pick(), rng, g)
    if rotary and E >= 2 and rng.random() < 0.3:
        half = rng.randint(1, E // 2)
        positions = rows + max(L, 1) + rng.randint(0, 3)
        angles = torch.arange(positions, dtype=torch.float64)[:, None] * torch.rand(half, generator=g,
                                                                                 dtype=torch.float64)
        rdtype = dtype if rng.random() < 0.7 else torch.float32
        kw["rotary_cos"], kw["rotary_sin"] = angles.cos().to(rdtype), angles.sin().to(rdtype)
        kw["rotary_interleaved"] = rng.random() < 0.5
    if rng.random() < 0.5:
        kw["causal"] = True
    if variants:
        if rng.random() < 0.25:
            kw["window_size"] = (rng.choice([-1, 0, 2, 7, 30]), rng.choice([-1, 0, 3]))
        if rng.random() < 0.15:
            kw["softcap"] = rng.choice([1.0, 5.0, 30.0])
        if rng.random() < 0.2 and h:
            kw["alibi_slopes"] = torch.rand([B, h] if rng.random() < 0.5 else [h], generator=g) * 0.3
        if rng.random() < 0.15 and h:
            kw["sinks"] = randn([h], dtype, g)
    if rng.random() < 0.2:
        kw["softmax_scale"] = rng.choice([0.0, 0.1, 0.5, 1.5])
    if rng.random() < 0.5:
        kw["return_softmax_lse"] = True
    if rng.random() < 0.1:
        kw["num_splits"] = rng.choice([1, 4])
    return KVCall(q, k_cache, v_cache, k, v, kw, seqlens, pads, rows)


def kv_truth(c, before_k, before_v):
    """The float64 truth of a call: per sequence, the attention problem over its cache rows
    (the old ones from its left padding, then the new ones, rotary applied), and the caches as
    they must be after the call; plus which cache rows the append writes."""
    kw = c.kw
    B = c.q.shape[0]
    idx = kw["cache_batch_idx"].tolist() if "cache_batch_idx" in kw else list(range(B))
    table = kw.get("block_table")
    want_k, want_v = before_k.clone(), before_v.clone()
    written = torch.zeros(before_k.shape[:2], dtype=torch.bool)
    window = kw.get("window_size", (-1, -1))
    moving = kw.get("causal", False) or tuple(window) != (-1, -1)
    n_new = 0 if c.k is None else c.k.shape[1]
    problems = []
    for b in range(B):
        n, pad = c.seqlens[b], c.pads[b]
        qb, kb = c.q[b], None if c.k is None else c.k[b]
        if "rotary_cos" in kw:
            cos, sin, inter = kw["rotary_cos"], kw["rotary_sin"], kw.get("rotary_interleaved", True)
            start = n - pad
            q_pos = torch.arange(qb.shape[0]) * int(moving) + start
            qb = rotate(qb[None], cos, sin, q_pos[None], inter)[0]
            if kb is not None:
                kb = rotate(kb[None], cos, sin, (torch.arange(n_new) + start)[None], inter)[0]
        if table is not None:  # cache row j of sequence b: row j % page of page table[b, j // page]
            page = before_k.shape[1]
            where = [(int(table[b, j // page]), j % page) for j in range(c.rows)]
        else:
            where = [(idx[b], j) for j in range(c.rows)]
        rows_k = torch.stack([before_k[p, r] for p, r in where]) if where else before_k[:0].flatten(0, 1)
        rows_v = torch.stack([before_v[p, r] for p, r in where]) if where else before_v[:0].flatten(0, 1)
        keys, values = rows_k[pad:n], rows_v[pad:n]
        if kb is not None:
            kb, vb = kb.to(before_k.dtype), c.v[b].to(before_v.dtype)
            for j in range(n_new):
                p, r = where[n + j]
                want_k[p, r], want_v[p, r] = kb[j], vb[j]
                written[p, r] = True
            keys, values = torch.cat([keys, kb]), torch.cat([values, vb])
        slopes = kw.get("alibi_slopes")
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        variants = dict(window_left=window[0], window_right=window[1], bottom_right=True,
                        softcap=kw.get("softcap", 0.0), alibi_slopes=slopes, sinks=kw.get("sinks"))
        problems.append(Problem(qb.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                is_causal=kw.get("causal", False), scale=kw.get("softmax_scale"),
                                gqa=True, variants={n_: x for n_, x in variants.items() if x is not None}))
    return problems, want_k, want_v, written


def check_caches_after(c, want_k, want_v, written, dtype):
    """The caches after the call: the appended rows (rotary applied: within the floor), every
    other row untouched."""
    for name, got, want in (("k_cache", c.k_cache, want_k), ("v_cache", c.v_cache, want_v)):
        got = got.detach()
        expect(same_values(got[~written], want[~written]),
               f"{name}: rows the call must not write were changed")
        if written.any():
            if name == "k_cache" and "rotary_cos" in c.kw:
                assert_close_to_truth(got[written], want[written].double(), floor=FIXED_TOL[dtype],
                                      what=f"{name}: the appended (rotated) rows")
            else:
                expect(same_values(got[written], want[written]), f"{name}: the appended rows differ "
                                                                 f"from the new {name[0]}")


def kv_check(c, before_k, before_v, nonfinite=False):
    """The result of a call (made on c's caches) against the float64 truth."""
    dtype = c.q.dtype

    def check(result):
        out, lse = result if c.kw.get("return_softmax_lse") else (result, None)
        problems, want_k, want_v, written = kv_truth(c, before_k, before_v)
        B, L, h, E = c.q.shape
        expect(tuple(out.shape) == (B, L, h, E) and out.dtype == dtype,
               f"output {describe(out)}, expected {(B, L, h, E)}:{dtype}")
        if lse is not None:
            expect(tuple(lse.shape) == (B, h, L), f"lse of shape {tuple(lse.shape)}, expected {(B, h, L)}")
        for b, pb in enumerate(problems):
            got = out[b].transpose(0, 1)
            if nonfinite:
                check_nonfinite(pb, got, what=f"sequence {b}")
                continue
            ref, ref_lse, _ = reference_of(pb)
            assert_close_to_truth(got, ref, floor=fixed_floor(pb, dtype), what=f"output of sequence {b}")
            if lse is not None:
                check_logsumexp(lse[b], ref_lse, dtype, what=f"lse of sequence {b}")
        check_caches_after(c, want_k, want_v, written, dtype)
    return check


# Errors of flash_attn_with_kvcache that do not name it (or its op) today, by what is broken:
# the checks of the op it hands the call to answer, or ATen's (see KNOWN_FAILURES).
KV_ERROR_TAGS = {
    "block_table on meta": "kvcache_error_names_inner_op",
    "alibi_slopes on meta": "kvcache_error_names_inner_op",
    "sinks on meta": "kvcache_error_names_inner_op",
    "block_table_int64": "kvcache_error_names_inner_op",
    "int_alibi": "kvcache_error_names_inner_op",
    "q_E": "kvcache_error_names_inner_op",
    "heads_indivisible": "kvcache_error_names_inner_op",
    "bad_window": "kvcache_error_names_inner_op",
    "bad_softcap": "kvcache_error_names_inner_op",
    "bad_scale": "kvcache_error_names_inner_op",
    "alibi_shape": "kvcache_error_names_inner_op",
    "sinks_shape": "kvcache_error_names_inner_op",
    "cache_seqlens on meta": "kvcache_unchecked_inputs",
    "rotary_cos on meta": "kvcache_unchecked_inputs",
    "cache_batch_idx on meta": "kvcache_unchecked_inputs",
    "cache_leftpad on meta": "kvcache_unchecked_inputs",
    "float_batch_idx": "kvcache_unchecked_inputs",
    "k_E": "kvcache_unchecked_inputs",
    "k_heads": "kvcache_unchecked_inputs",
    "rotary_short": "kvcache_unchecked_inputs",
    "rotary_wide": "kvcache_unchecked_inputs",
    "batch_idx_out_of_range": "kvcache_unchecked_inputs",
    "page_out_of_range": "kvcache_unchecked_inputs",
    "cache_batch_small": "kvcache_unchecked_inputs",
}


def broken_kvcache(c, kind, rng, g):
    """Break a valid call (in place) the way `kind` says; returns what was broken."""
    kw = c.kw
    B, L, h, E = c.q.shape
    if kind == "wrong_device":
        options = ["q", "k_cache", "v_cache"] + (["k", "v"] if c.k is not None else [])
        options += [n for n in ("cache_batch_idx", "cache_leftpad", "block_table", "alibi_slopes",
                                "sinks", "rotary_cos") if n in kw]
        if isinstance(kw.get("cache_seqlens"), torch.Tensor):
            options.append("cache_seqlens")
        what = rng.choice(options)
        if what in kw:
            kw[what] = kw[what].to("meta")
        else:
            setattr(c, what, getattr(c, what).to("meta"))
        return f"{what} on meta"
    if kind == "wrong_dtype":
        choices = ["int_q", "k_cache_other_float", "v_cache_other_float", "seqlens_float"]
        choices += ["int_kv"] if c.k is not None else []
        choices += ["block_table_int64"] if "block_table" in kw else []
        choices += ["float_batch_idx"] if "cache_batch_idx" in kw else []
        choices += ["int_alibi"] if "alibi_slopes" in kw else []
        what = rng.choice(choices)
        others = [d for d in DTYPES if d != c.q.dtype]
        if what == "int_q":
            c.q = c.q.to(rng.choice([torch.int32, torch.int64]))
        elif what == "k_cache_other_float":
            c.k_cache = c.k_cache.to(rng.choice(others))
        elif what == "v_cache_other_float":
            c.v_cache = c.v_cache.to(rng.choice(others))
        elif what == "seqlens_float":
            kw["cache_seqlens"] = torch.tensor(c.seqlens, dtype=torch.float32)
        elif what == "int_kv":
            c.k, c.v = c.k.to(torch.int32), c.v.to(torch.int32)
        elif what == "block_table_int64":
            kw["block_table"] = kw["block_table"].long()
        elif what == "float_batch_idx":
            kw["cache_batch_idx"] = kw["cache_batch_idx"].float()
        else:
            kw["alibi_slopes"] = kw["alibi_slopes"].long()
        return what
    # wrong_shape
    choices = ["seqlens_past_end", "seqlens_shape", "q_E", "q_3d", "bad_window", "bad_softcap",
               "bad_scale", "cache_batch_small"]
    if c.k is not None:
        choices += ["k_E", "k_heads", "k_without_v", "v_E"]
    if h:
        choices += ["alibi_shape", "sinks_shape"]
    if c.k_cache.shape[2] >= 2:  # (one K/V head divides any number of query heads)
        choices.append("heads_indivisible")
    if "rotary_cos" in kw:
        choices += ["rotary_without_sin", "rotary_short", "rotary_wide"]
    if "cache_leftpad" in kw:
        choices.append("leftpad_past_seqlens")
    if "cache_batch_idx" in kw:
        choices.append("batch_idx_out_of_range")
    if "block_table" in kw:
        choices += ["page_out_of_range", "paged_with_leftpad"]
    what = rng.choice(choices)
    n_new = 0 if c.k is None else c.k.shape[1]
    if what == "seqlens_past_end":
        lens = list(c.seqlens)
        lens[rng.randrange(B)] = c.rows - n_new + rng.randint(1, 5)
        kw["cache_seqlens"] = torch.tensor(lens, dtype=torch.int32)
    elif what == "seqlens_shape":
        kw["cache_seqlens"] = torch.tensor(c.seqlens + [0], dtype=torch.int32)
    elif what == "q_E":
        c.q = randn([B, L, h, E + 1], c.q.dtype, g)
    elif what == "q_3d":
        c.q = c.q.flatten(0, 1)
    elif what == "bad_window":
        kw["window_size"] = (rng.choice([-2, -40]), 0)
    elif what == "bad_softcap":
        kw["softcap"] = rng.choice([-1.0, INF, NAN])
    elif what == "bad_scale":
        kw["softmax_scale"] = rng.choice([-1.0, INF, NAN])
    elif what == "cache_batch_small":  # fewer caches than sequences (no cache_batch_idx)
        for n in ("cache_batch_idx", "block_table", "cache_leftpad"):
            kw.pop(n, None)
        c.q = randn([c.k_cache.shape[0] + 1] + list(c.q.shape[1:]), c.q.dtype, g)
        c.k = c.v = None
        kw["cache_seqlens"] = 0
    elif what == "k_E":
        c.k = randn(list(c.k.shape[:3]) + [E + 1], c.k.dtype, g)
        c.v = randn(list(c.v.shape[:3]) + [E + 1], c.v.dtype, g)
    elif what == "k_heads":
        h_kv = c.k.shape[2]
        c.k = randn(list(c.k.shape[:2]) + [h_kv + 1, E], c.k.dtype, g)
        c.v = randn(list(c.v.shape[:2]) + [h_kv + 1, E], c.v.dtype, g)
    elif what == "k_without_v":
        c.v = None
    elif what == "v_E":
        c.v = randn(list(c.v.shape[:3]) + [E + 1], c.v.dtype, g)
    elif what == "heads_indivisible":
        c.q = randn([B, L, c.k_cache.shape[2] * 2 + 1, E], c.q.dtype, g)
        kw.pop("alibi_slopes", None)
        kw.pop("sinks", None)
    elif what == "alibi_shape":
        kw["alibi_slopes"] = torch.rand(h + 1)
    elif what == "sinks_shape":
        kw["sinks"] = randn([2, h], c.q.dtype, g)
    elif what == "rotary_without_sin":
        del kw["rotary_sin"]
    elif what == "rotary_short":  # fewer positions than the call reaches
        n_pos = max(s - p for s, p in zip(c.seqlens, c.pads)) + max(L, n_new)
        kw["rotary_cos"] = kw["rotary_cos"][:max(0, n_pos - 1 - rng.randint(0, 2))]
        kw["rotary_sin"] = kw["rotary_sin"][:kw["rotary_cos"].shape[0]]
    elif what == "rotary_wide":  # more rotated dims than E
        extra = E // 2 + 1 - kw["rotary_cos"].shape[1]
        kw["rotary_cos"] = F.pad(kw["rotary_cos"], (0, extra), value=1.0)
        kw["rotary_sin"] = F.pad(kw["rotary_sin"], (0, extra))
    elif what == "leftpad_past_seqlens":
        pads = list(c.pads)
        pads[rng.randrange(B)] = max(c.seqlens) + 1
        kw["cache_leftpad"] = torch.tensor(pads, dtype=torch.int32)
    elif what == "batch_idx_out_of_range":
        idx = kw["cache_batch_idx"].clone()
        idx[rng.randrange(B)] = rng.choice([c.k_cache.shape[0], c.k_cache.shape[0] + 5])
        kw["cache_batch_idx"] = idx
    elif what == "page_out_of_range":
        table = kw["block_table"].clone()
        table[rng.randrange(B), 0] = c.k_cache.shape[0] + rng.randint(0, 3)
        kw["block_table"] = table
    else:  # paged_with_leftpad
        kw["cache_leftpad"] = torch.zeros(B, dtype=torch.int32)
    return what


def overlapping_kvcache(c, rng, g):
    """Caches that share memory (in place, with a tag when it is a known failure); returns what
    and the tags."""
    shape = list(c.k_cache.shape)
    dtype = c.k_cache.dtype
    n_new = 0 if c.k is None else c.k.shape[1]
    choices = ["expanded", "shared"]
    if shape[0] * shape[1] > 1:
        choices.append("as_strided")
    if shape[1] > 1:
        choices.append("shifted")
    if c.k is not None and n_new and shape[1] >= n_new and "block_table" not in c.kw and shape[0] >= c.q.shape[0]:
        choices.append("new_k_in_cache")
    what = rng.choice(choices)
    if what == "expanded" and max(shape[:3]) == 1:
        what = "shared"  # (nothing to expand)
    if what == "as_strided":  # consecutive rows (or caches) sharing elements, no stride 0
        row = shape[2] * shape[3]
        strides = [max(1, shape[1] * row // 2), max(1, row // 2), shape[3], 1]
        size = 1 + sum((s - 1) * st for s, st in zip(shape, strides))
        if torch.arange(size).as_strided(shape, strides).unique().numel() < math.prod(shape):
            c.k_cache = randn([size], dtype, g).as_strided(shape, strides)
            return what, {"kvcache_overlap_undetected"}
        what = "shared"  # (tiny shapes may not overlap)
    if what == "expanded":  # stride 0 along the rows (or the batch)
        d = rng.choice([d for d in (0, 1, 2) if shape[d] > 1])
        small = list(shape)
        small[d] = 1
        cache = randn(small, dtype, g).expand(shape)
        if rng.random() < 0.5:
            c.k_cache = cache
        else:
            c.v_cache = cache
        return what, {"kvcache_overlapping_cache"}
    if what == "shared":
        c.v_cache = c.k_cache
        return what, {"kvcache_shared_cache"}
    if what == "shifted":  # k_cache and v_cache: one buffer, shifted by a row
        buf = randn([shape[0], shape[1] + 1] + shape[2:], dtype, g)
        c.k_cache, c.v_cache = buf[:, :-1], buf[:, 1:]
        return what, {"kvcache_overlap_undetected"}
    # the new k (or v) is rows of a cache
    start = rng.randint(0, shape[1] - n_new)
    cache = rng.choice(["k_cache", "v_cache"])
    view = getattr(c, cache)[:c.q.shape[0], start:start + n_new]
    if rng.random() < 0.5:
        c.k = view
    else:
        c.v = view
    return f"{what} ({cache} rows {start}..)", {"kvcache_overlap_undetected"}


def gen_kvcache(rng, g, kind, seed):
    entry = "flash_attn_with_kvcache"
    names = ENTRY_POINTS[entry]
    dtype = rng.choice(DTYPES)

    if kind in ("valid", "nonfinite"):
        nonfinite = kind == "nonfinite"
        c = draw_kvcache(rng, g, dtype, rotary=not nonfinite)
        what = ""
        if nonfinite:
            target = rng.choice(["q", "k_cache", "v_cache"] + (["k", "v"] if c.k is not None else []))
            setattr(c, target, nonfinite_into(getattr(c, target), rng, g))
            what = f"{target} poisoned: "
        before_k, before_v = c.k_cache.clone(), c.v_cache.clone()
        return Case(entry, kind, what + c.text(), c, kv_check(c, before_k, before_v, nonfinite))

    if kind == "empty":
        which = rng.choice(["B0", "L0", "new0", "H0", "S0", "nothing"])
        c = draw_kvcache(rng, g, dtype, layouts=False, variants=False, empty=which)
        before_k, before_v = c.k_cache.clone(), c.v_cache.clone()
        return Case(entry, kind, f"{which}: {c.text()}", c, kv_check(c, before_k, before_v),
                    may_raise=lambda e: raise_ok(e, names_error(names)) is None,
                    tags={"kvcache_empty_batch"} if which == "B0" else set())

    if kind == "meta":
        c = draw_kvcache(rng, g, dtype, layouts=False)
        c.kw["return_softmax_lse"] = rng.random() < 0.5
        m = KVCall(*(to_meta(x) for x in (c.q, c.k_cache, c.v_cache, c.k, c.v)), to_meta(c.kw),
                   c.seqlens, c.pads, c.rows)
        return Case(entry, kind, c.text(), lambda: (c(), m()), check=lambda r: same_meta_outputs(*r),
                    tags={"kvcache_meta_leftpad"} if "cache_leftpad" in c.kw else set())

    c = draw_kvcache(rng, g, dtype, layouts=kind == "overlap")
    while kind == "overlap" and c.k_cache.numel() == 0:  # (an empty cache shares nothing)
        c = draw_kvcache(rng, g, dtype, layouts=True)
    if kind == "overlap":
        what, tags = overlapping_kvcache(c, rng, g)
    else:
        what = broken_kvcache(c, kind, rng, g)
        tags = {KV_ERROR_TAGS[what]} if what in KV_ERROR_TAGS else set()
    k_cache, v_cache = c.k_cache, c.v_cache
    before = [t.clone() if t.device.type != "meta" else None for t in (k_cache, v_cache)]

    def call():
        try:
            return c()
        except Exception as e:  # refused: the caches must be as they were
            for t, b in zip((k_cache, v_cache), before):
                if b is not None and not same_values(t, b):
                    raise Mismatch(f"raised {type(e).__name__}({e}) after writing into the cache") from e
            raise
    return Case(entry, kind, f"{what}: {c.text()}", call, error=names_error(names), tags=tags)
