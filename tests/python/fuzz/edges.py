"""The fuzzer's edge cases: what users pass that is easy to get wrong. Every dim may be 0 or 1
(batch, heads, L, S, E, Ev, the number of sequences, a cache's length), batch dims broadcast
(1 against N, 1 against 0), and masks of every kind come with them: bool and float, of every
broadcast shape, strided, transposed and expanded, all-true, all-false and bands.

Each entry point of the fuzzer gets a case kind "edge" drawn here, plus the two entry
points only this module draws: fusedmha.merge_attention and fusedmha.distributed's ring
attention (its local step, the ops with a band and a dropout stream, over a world of one).
A case's result must equal the float64 reference within the suite's tolerances, or the call
must raise a clean exception whose message names the entry point, and only where the
reference cannot compute the call either."""

import contextlib
import math

import torch
import torch.distributed as dist

import fusedmha
import fusedmha.distributed as fdist
import mha_inputs
from reference import MHA_TOL, assert_close_to_truth, compare_with_reference, reference_variants

from .case import ENTRY_POINTS, Case, describe, expect, kwargs_text, names_error, raise_ok
from .draw import Problem, outer_of, randn
from .judge import (
    FIXED_TOL, GRAD_FIXED_FACTOR, check_gradients, check_logsumexp, leaves64, reference_of,
    rounded_output_gradients)
from .kvcache import gen_kvcache
from .sdpa import check_problem_call, forward_op_call, grad_leaves, sdpa_call
from .varlen import gen_varlen


def edge(rng, others=(2, 3, 5, 17)):
    """A dim's size: 0 or 1 half the time, else one of `others`."""
    r = rng.random()
    return 0 if r < 0.25 else 1 if r < 0.5 else rng.choice(others)


def has_empty_dim(*tensors):
    return any(t is not None and 0 in t.shape for t in tensors)


# --------------------------------------------------------------------------------------
# masks
# --------------------------------------------------------------------------------------

def mask_values(shape, kind, dtype, rng, g, lowest=True):
    """A mask of `shape`: all visible, all hidden, random, or a (causal) band; bool (True = may
    attend) or float (0, -inf, or with `lowest` finfo.min, and random values to add).

    A row that finfo.min hides entirely is drawn with -inf instead: PyTorch averages its keys,
    and so does the fused forward, but the backward and the weights recompute its probabilities
    from a log-sum-exp that cannot hold that average (test_edge_properties.py's xfail)."""
    L, S = shape[-2], shape[-1]
    fill = rng.choice(["random", "random", "all", "none", "band"])
    if fill == "random":
        visible = torch.rand(shape, generator=g) > rng.choice([0.2, 0.5, 0.9])
    elif fill == "band":
        visible = torch.ones(L, S, dtype=torch.bool).tril(rng.choice([0, S - L, 1])).expand(shape).clone()
    else:
        visible = torch.full(shape, fill == "all", dtype=torch.bool)
    if kind == "bool":
        return visible
    lowest = lowest and dtype != torch.float16 and rng.random() < 0.5
    values = torch.zeros(shape) if rng.random() < 0.6 else torch.randn(shape, generator=g)
    values = values.to(dtype).masked_fill(~visible, -math.inf)
    if lowest:  # finfo.min where it hides keys beside a visible one
        sees = visible.any(-1, keepdim=True)
        values = values.masked_fill(~visible & sees, torch.finfo(dtype).min)
    return values


def draw_edge_mask(rng, g, full, dtype):
    """A mask that broadcasts to `full` (..., L, S): some leading dims dropped, others 1, in a
    random layout; or None."""
    kind = rng.choice(["none", "bool", "bool", "bool", "float", "float", "float", "float32"])
    if kind == "none":
        return None
    mask_dtype = torch.bool if kind == "bool" else dtype if kind == "float" else torch.float32
    if kind == "float32" and dtype == torch.float64:
        mask_dtype = torch.float64  # (a float mask of higher precision than the query is refused)
    keep = rng.randint(2, len(full))  # (the trailing dims kept: (L, S) at least)
    shape = [s if rng.random() < 0.6 else 1 for s in full[len(full) - keep:]]
    if rng.random() < 0.2:  # (L, S) in full now and then: the most common mask
        shape = list(full[-2:])
    layout = rng.choice(["contiguous", "contiguous", "strided", "transposed", "expanded"])
    if layout == "strided":
        wide = mask_values(shape[:-1] + [2 * shape[-1]], kind, mask_dtype, rng, g)
        return wide[..., ::2]
    if layout == "transposed" and len(shape) >= 2:
        return mask_values(shape[:-2] + [shape[-1], shape[-2]], kind, mask_dtype, rng, g).transpose(-1, -2)
    if layout == "expanded":
        small = [1 if rng.random() < 0.5 else s for s in shape]
        target = [f if s == 1 and rng.random() < 0.5 else s
                  for s, f in zip(shape, full[len(full) - len(shape):])]
        return mask_values(small, kind, mask_dtype, rng, g).expand(
            [t if sm == 1 else sm for sm, t in zip(small, target)])
    return mask_values(shape, kind, mask_dtype, rng, g)


# --------------------------------------------------------------------------------------
# SDPA and the ops: (..., H, L, E)
# --------------------------------------------------------------------------------------

def draw_edge_problem(rng, g, dtype, *, front_door):
    """A Problem whose dims are each 0, 1 or small, batch dims broadcast among q, k and v, with
    a mask of any kind and shape."""
    batch = [edge(rng) for _ in range(rng.choice([0, 1, 1, 2]))]
    h_kv = edge(rng, (2, 3))
    gqa = h_kv > 0 and rng.random() < 0.3
    h = h_kv * rng.choice([1, 2, 3]) if gqa else h_kv
    L, S, E = edge(rng, (2, 3, 7, 40, 70)), edge(rng, (2, 3, 7, 40, 70)), edge(rng, (2, 3, 8, 64))
    Ev = E if rng.random() < 0.6 else edge(rng, (2, 3, 8))
    three_d = not batch and rng.random() < 0.2  # (H, L, E): no batch dim

    def shape(heads, rows, cols):
        b = [s if rng.random() < 0.75 else 1 for s in batch]  # broadcast: 1 against N (or 0)
        hd = heads if gqa or rng.random() < 0.8 else 1
        return ([] if three_d else b) + [hd, rows, cols]

    q = randn(shape(h, L, E), dtype, g)
    k = randn(shape(h_kv, S, E), dtype, g)
    v = randn(shape(h_kv, S, Ev), dtype, g)
    pb = Problem(q, k, v, gqa=gqa)
    try:
        outer = outer_of(pb)
    except RuntimeError:  # heads that do not broadcast: an error case
        outer = list(batch) + [h]
    pb.mask = draw_edge_mask(rng, g, outer + [L, S], dtype)
    pb.is_causal = rng.random() < 0.25 and (pb.mask is None or not front_door)
    if rng.random() < 0.15:
        pb.scale = rng.choice([0.0, 0.5, 2.0])
    if not front_door and rng.random() < 0.2:
        pb.variants = dict(window_left=rng.choice([-1, 0, 2]), window_right=rng.choice([-1, 0, 1]),
                           bottom_right=rng.random() < 0.5)
    return pb


def reference_raises(pb):
    """Whether the float64 reference cannot compute the problem (shapes that do not go
    together): only then may the call raise."""
    try:
        reference_of(pb)
    except (RuntimeError, ValueError, IndexError):
        return True
    return False


def clean_error_of(entry):
    names = names_error(ENTRY_POINTS[entry])
    return lambda pb: lambda exc: reference_raises(pb) and raise_ok(exc, names) is None


def gen_edge_sdpa_like(entry, rng, g, seed):
    front_door = entry == "sdpa"
    forward = sdpa_call if front_door else forward_op_call
    dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.bfloat16])
    pb = draw_edge_problem(rng, g, dtype, front_door=front_door)
    grads = grad_leaves(pb, rng)
    run, check = check_problem_call(pb, forward, not front_door, grads, seed)
    return Case(entry, "edge", pb.text() + (" +backward" if grads else ""), run, check,
                   may_raise=clean_error_of(entry)(pb), tags=edge_tags(pb.q, pb.k, pb.v, masks=[pb.mask]))


def edge_tags(*tensors, masks=()):
    """The case's tags: "edge", "empty" where a tensor has a dim of size 0, "mask" where a
    mask is passed, and "empty+mask" for both (the run's summary prints their shares)."""
    tags = {"edge"}
    if has_empty_dim(*tensors):
        tags.add("empty")
    if any(m is not None for m in masks):
        tags.add("mask")
    if {"empty", "mask"} <= tags:
        tags.add("empty+mask")
    return tags


def gen_edge_attention_backward(rng, g, seed):
    entry = "attention_backward"
    dtype = rng.choice([torch.float32, torch.float64])
    pb = draw_edge_problem(rng, g, dtype, front_door=False)
    may_raise = clean_error_of(entry)(pb)

    def call():
        out, lse, rng_state = forward_op_call(pb)
        grad_out = randn(out.shape, dtype, g)
        grads = torch.ops.fusedmha.attention_backward(
            grad_out, pb.q, pb.k, pb.v, out, lse, rng_state, pb.mask, 0.0, pb.is_causal,
            pb.scale, pb.gqa, **pb.variants)
        return grad_out, out, grads

    def check(result):
        grad_out, out, grads = result
        inputs64 = leaves64(pb.q, pb.k, pb.v)
        ref, ref_lse, _ = reference_of(pb, None, inputs64)
        want = torch.autograd.grad(ref, inputs64, grad_out.double(), allow_unused=True,
                                   retain_graph=True)
        want = [torch.zeros_like(x) if w is None else w for w, x in zip(want, inputs64)]
        rounded = rounded_output_gradients(want, out, ref, ref_lse, grad_out, inputs64)
        check_gradients(pb, grads, want, grad_out, [pb.q, pb.k, pb.v], rounded)

    def may_raise_forward_too(exc):
        # (the forward op's own clean error counts: the backward is called on its result)
        return may_raise(exc) or (reference_raises(pb) and raise_ok(
            exc, names_error(ENTRY_POINTS["attention_forward"])) is None)

    return Case(entry, "edge", pb.text(), call, check, may_raise=may_raise_forward_too,
                   tags=edge_tags(pb.q, pb.k, pb.v, masks=[pb.mask]))


# --------------------------------------------------------------------------------------
# FlashAttention's API: (B, L, H, E)
# --------------------------------------------------------------------------------------

def gen_edge_flash(rng, g, seed):
    """flash_attn_func, or its packed forms (kv as (B, S, 2, H_kv, E), qkv as (B, L, 3, H, E)),
    with the log-sum-exp and probabilities returned now and then."""
    entry = "flash_attn_func"
    dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16])
    B, h_kv, L, S = edge(rng), edge(rng, (2, 3)), edge(rng, (2, 7, 40)), edge(rng, (2, 7, 40))
    h = h_kv * (rng.choice([1, 2]) if h_kv else 1)
    E = edge(rng, (2, 8, 64))
    packing = rng.choice(["none", "none", "kv"] + (["qkv"] if L == S and h == h_kv else []))
    q, k, v = (randn(s, dtype, g) for s in ([B, L, h, E], [B, S, h_kv, E], [B, S, h_kv, E]))
    kw = {}
    if rng.random() < 0.4:
        kw["causal"] = True
    if rng.random() < 0.2:
        kw["window_size"] = (rng.choice([-1, 0, 3]), rng.choice([-1, 0, 2]))
    if rng.random() < 0.3:
        kw["return_attn_probs"] = True
    grads = rng.random() < 0.4

    def call():
        if packing == "qkv":
            qkv = torch.stack([q, k, v], dim=2).requires_grad_(grads)
            result = fusedmha.flash_attn_qkvpacked_func(qkv, **kw)
            leaves = [qkv]
        elif packing == "kv":
            q_, kv = q.detach().requires_grad_(grads), torch.stack([k, v], dim=2).requires_grad_(grads)
            result = fusedmha.flash_attn_kvpacked_func(q_, kv, **kw)
            leaves = [q_, kv]
        else:
            leaves = [x.detach().requires_grad_(grads) for x in (q, k, v)]
            result = fusedmha.flash_attn_func(*leaves, **kw)
        out = result[0] if isinstance(result, tuple) else result
        gs = torch.autograd.grad(out, leaves, torch.ones_like(out)) if grads else None
        if gs is not None:  # (as q, k, v)
            gs = gs[0].unbind(2) if packing == "qkv" else (gs[0], *gs[1].unbind(2)) if packing == "kv" else gs
        return result, gs

    def check(result):
        result, gs = result
        out = result[0] if isinstance(result, tuple) else result
        xs = leaves64(q, k, v)
        window = kw.get("window_size", (-1, -1))
        ref, lse, probs = reference_variants(*(x.transpose(1, 2) for x in xs), is_causal=kw.get("causal", False),
                                             enable_gqa=h != h_kv, window_left=window[0],
                                             window_right=window[1], bottom_right=True)
        ref = ref.transpose(1, 2)
        assert_close_to_truth(out, ref, floor=FIXED_TOL[dtype])
        if isinstance(result, tuple):
            check_logsumexp(result[1], lse, dtype)
            assert_close_to_truth(result[2], probs, floor=FIXED_TOL[dtype], what="probabilities")
        if gs is not None:
            want = torch.autograd.grad(ref, xs, torch.ones_like(ref), allow_unused=True)
            for name, a, w, x in zip("qkv", gs, want, xs):
                w = torch.zeros_like(x) if w is None else w
                assert_close_to_truth(a, w, floor=GRAD_FIXED_FACTOR * FIXED_TOL[dtype],
                                         what=f"grad_{name}")

    return Case(entry, "edge", f"{packing}-packed q={describe(q)} k={describe(k)} "
                   f"v={describe(v)} {kwargs_text(kw)}{' +backward' if grads else ''}", call,
                   check, tags=edge_tags(q, k, v))


def gen_edge_varlen(rng, g, seed):
    """flash_attn_varlen_func's empty cases (no sequence, empty sequences, no heads, E = 0)."""
    return as_edge(gen_varlen(rng, g, "empty", seed))


def gen_edge_kvcache(rng, g, seed):
    """flash_attn_with_kvcache's empty cases (no sequence, no query, nothing new, no heads, an
    empty cache, nothing at all)."""
    return as_edge(gen_kvcache(rng, g, "empty", seed))


def as_edge(case):
    case.kind = "edge"
    case.tags = set(case.tags) | {"edge", "empty"}  # (these kinds make one dim 0)
    return case


# --------------------------------------------------------------------------------------
# MultiheadAttention
# --------------------------------------------------------------------------------------

def gen_edge_mha(rng, g, seed):
    entry = "MultiheadAttention"
    dtype = rng.choice([torch.float32, torch.float64])
    H = rng.choice([1, 2])
    E = H * rng.choice([1, 2, 4])
    N, L, S = edge(rng, (2, 3)), edge(rng, (2, 5)), edge(rng, (2, 5))
    batched = rng.random() < 0.85
    ctor = dict(batch_first=rng.random() < 0.5, add_bias_kv=rng.random() < 0.15,
                add_zero_attn=rng.random() < 0.15)
    _, mod = mha_inputs.make_pair(E, H, dtype=dtype, **ctor)
    mod.eval()
    kw = {}
    kpm_shape = (N, S) if batched else (S,)
    am_shape = rng.choice([(L, S), ((N if batched else 1) * H, L, S)])
    for name, shp in (("key_padding_mask", kpm_shape), ("attn_mask", am_shape)):
        kind = rng.choice(["none", "bool", "float"])
        if kind != "none":
            # (-inf only: with the key padding mask, finfo.min could hide a row entirely)
            kw[name] = mask_values(list(shp) if len(shp) >= 2 else [1, shp[0]], kind, dtype, rng,
                                   g, lowest=False)
            if len(shp) < 2:
                kw[name] = kw[name][0]
            kw[name] = ~kw[name] if kind == "bool" else kw[name]  # (True = masked here)
    kw.update(rng.choice([dict(need_weights=False), dict(), dict(average_attn_weights=False)]))
    x = mha_inputs.make_inputs(N, L, S, E, E, E, dtype, batched, ctor["batch_first"])
    text = (f"MultiheadAttention({E}, {H}, {kwargs_text(ctor)}) query={describe(x[0])} "
            f"key={describe(x[1])} {kwargs_text(kw)}")
    return Case(entry, "edge", text,
                   lambda: compare_with_reference(mod, x, kw, name="edge", tol=MHA_TOL["cpu"][dtype]),
                   tags=edge_tags(*x, masks=list(kw.get(n) for n in ("attn_mask", "key_padding_mask"))))


# --------------------------------------------------------------------------------------
# merge_attention and the ring's local step
# --------------------------------------------------------------------------------------

def gen_edge_merge(rng, g, seed):
    entry = "merge_attention"
    dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16])
    B, L, H, E = edge(rng), edge(rng, (2, 5)), edge(rng, (2, 3)), edge(rng, (2, 8))
    parts = rng.choice([1, 1, 2, 3])
    outs = [randn([B, L, H, E], dtype, g) for _ in range(parts)]
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    lses = []
    for _ in range(parts):
        lse = randn([B, H, L], lse_dtype, g)
        lses.append(lse.masked_fill(torch.rand(lse.shape, generator=g) < 0.3, math.inf))

    def check(result):
        out, lse = result
        stacked = torch.stack([x.double() for x in lses])  # (P, B, H, L); +inf: no key
        finite = torch.isfinite(stacked)
        safe = torch.where(finite, stacked, -math.inf)
        total = torch.logsumexp(safe, dim=0)
        seen = finite.any(0)
        weights = torch.where(finite, torch.exp(safe - torch.where(seen, total, 0.0)), 0.0)
        want = sum(w.transpose(1, 2).unsqueeze(-1) * o.double() for w, o in zip(weights, outs))
        assert_close_to_truth(out, want, floor=FIXED_TOL[dtype])
        want_lse = torch.where(seen, total, math.inf)
        expect(torch.equal(torch.isinf(lse), torch.isinf(want_lse)), "lse: +inf entries differ")
        check_logsumexp(lse, want_lse, dtype)

    return Case(entry, "edge", f"{parts} x out={describe(outs[0])} lse={describe(lses[0])}",
                   lambda: fusedmha.merge_attention(outs, lses), check,
                   tags=edge_tags(*outs))


@contextlib.contextmanager
def one_process_group():
    """A gloo group of this process alone, for the ring's local step; the default group while
    the call runs, and only then (other tests expect none)."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def gen_edge_ring(rng, g, seed):
    entry = "ring_attention"
    dtype = rng.choice([torch.float32, torch.float64])
    B, h_kv, L, E = edge(rng), edge(rng, (2, 3)), edge(rng, (2, 4, 8)), edge(rng, (2, 8))
    h = h_kv * rng.choice([1, 2])
    q, k, v = (randn(s, dtype, g) for s in ([B, L, h, E], [B, L, h_kv, E], [B, L, h_kv, E]))
    causal = rng.random() < 0.5
    window = (rng.choice([-1, 0, 2]), rng.choice([-1, 0, 1])) if rng.random() < 0.3 else (-1, -1)
    names = names_error(ENTRY_POINTS[entry])

    def call():
        xs = [x.detach().requires_grad_() for x in (q, k, v)]
        with one_process_group() as group:
            out = fdist.ring_attention(*xs, group=group, causal=causal, zigzag=False,
                                       window_size=window)
            return out, torch.autograd.grad(out, xs, torch.ones_like(out))

    def check(result):
        out, gs = result
        xs = leaves64(q, k, v)
        ref, _, _ = reference_variants(*(x.transpose(1, 2) for x in xs), is_causal=causal,
                                       enable_gqa=h != h_kv, window_left=window[0],
                                       window_right=window[1], bottom_right=True)
        ref = ref.transpose(1, 2)
        assert_close_to_truth(out, ref, floor=FIXED_TOL[dtype])
        want = torch.autograd.grad(ref, xs, torch.ones_like(ref), allow_unused=True)
        for name, a, w, x in zip("qkv", gs, want, xs):
            w = torch.zeros_like(x) if w is None else w
            assert_close_to_truth(a, w, floor=GRAD_FIXED_FACTOR * FIXED_TOL[dtype], what=f"grad_{name}")

    # No key/value heads: the ring refuses them (a ValueError naming it).
    return Case(entry, "edge", f"q={describe(q)} k={describe(k)} causal={causal} "
                   f"window_size={window}", call, check,
                   may_raise=lambda exc: h_kv == 0 and raise_ok(exc, names) is None,
                   tags=edge_tags(q, k, v))


GENERATORS = {
    "sdpa": lambda rng, g, seed: gen_edge_sdpa_like("sdpa", rng, g, seed),
    "attention_forward": lambda rng, g, seed: gen_edge_sdpa_like("attention_forward", rng, g, seed),
    "attention_backward": gen_edge_attention_backward,
    "flash_attn_func": gen_edge_flash,
    "flash_attn_varlen_func": gen_edge_varlen,
    "flash_attn_with_kvcache": gen_edge_kvcache,
    "MultiheadAttention": gen_edge_mha,
    "merge_attention": gen_edge_merge,
    "ring_attention": gen_edge_ring,
}
