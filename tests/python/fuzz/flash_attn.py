"""The cases of fusedmha.flash_attn_func: (B, L, H, E) inputs, bottom-right causal and
windows, the variants, dropout, return_attn_probs; valid calls with their gradients, huge,
nonfinite, empty, meta, and the broken calls that must raise."""

import torch

import fusedmha
from reference import assert_close_to_truth

from .case import ENTRY_POINTS, Case, describe, expect, kwargs_text, names_error, raise_ok
from .draw import (
    DTYPES, LAYOUTS, Problem, draw_sizes, leaves_with_sinks, make, nonfinite_into, randn, to_meta)
from .judge import (
    check_forward, check_gradients, check_logsumexp, fixed_floor, keep_mask, leaves64,
    reference_of, rounded_output_gradients, same_meta_outputs, torch_sdpa)
from .nonfinite import check_nonfinite
from .sdpa import forward_op_call


def draw_flash(rng, g, dtype, *, layouts=True, dropout=True):
    """(q, k, v in (B, L, H, E), flash_attn_func's kwargs, the same call as a Problem)."""
    batch, h, h_kv, L, S, E, Ev = draw_sizes(rng)
    B = batch[0] if batch else 1
    pick = (lambda: rng.choice(LAYOUTS)) if layouts else (lambda: "contiguous")
    q = make([B, L, h, E], dtype, pick(), rng, g)
    k = make([B, S, h_kv, E], dtype, pick(), rng, g)
    v = make([B, S, h_kv, Ev], dtype, pick(), rng, g)
    kw = {}
    if rng.random() < 0.4:
        kw["causal"] = True
    if rng.random() < 0.3:
        kw["window_size"] = (rng.choice([-1, 0, 2, 5, 17]), rng.choice([-1, 0, 1, 6]))
    if rng.random() < 0.2:
        kw["softcap"] = rng.choice([1.0, 4.0, 30.0])
    if rng.random() < 0.2:
        kw["alibi_slopes"] = torch.rand([B, h] if rng.random() < 0.5 else [h], generator=g) * 0.3
    if rng.random() < 0.2:
        kw["sinks"] = randn([h], dtype, g)
    if rng.random() < 0.3:
        kw["softmax_scale"] = rng.choice([0.0, 0.1, 0.5, 1.5])
    if dropout and rng.random() < 0.2:
        kw["dropout_p"] = rng.choice([0.1, 0.3, 0.6])
    if rng.random() < 0.3:
        kw["return_attn_probs"] = True
    return q, k, v, kw


def flash_problem(q, k, v, kw, sinks=None):
    window = kw.get("window_size", (-1, -1))
    variants = dict(window_left=window[0], window_right=window[1], bottom_right=True,
                    softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi_slopes"),
                    sinks=kw.get("sinks") if sinks is None else sinks)
    variants = {n: x for n, x in variants.items() if x is not None}
    return Problem(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                   dropout_p=kw.get("dropout_p", 0.0), is_causal=kw.get("causal", False),
                   scale=kw.get("softmax_scale"), gqa=q.shape[2] != k.shape[2], variants=variants)


def gen_flash_attn_func(rng, g, kind, seed):
    entry = "flash_attn_func"
    dtype = rng.choice(DTYPES)
    names = ENTRY_POINTS[entry]
    if kind in ("valid", "huge", "nonfinite"):
        q, k, v, kw = draw_flash(rng, g, dtype, dropout=kind == "valid")
        if kind == "huge":
            L, S, E = rng.choice([(2, 2, 4096), (1, 50_000, 8), (3000, 2, 4)])
            q, k, v = randn([1, L, 1, E], dtype, g), randn([1, S, 1, E], dtype, g), randn([1, S, 1, E], dtype, g)
            kw = {n: x for n, x in kw.items() if n in ("causal", "window_size", "softcap")}
        if kind == "nonfinite":
            target = rng.choice("qkv")
            q, k, v = (nonfinite_into(t, rng, g) if n == target else t for n, t in zip("qkv", (q, k, v)))
            kw.pop("return_attn_probs", None)
            pb = flash_problem(q, k, v, kw)
            return Case(entry, kind, f"{target} poisoned: q={describe(q)} k={describe(k)} v={describe(v)} {kwargs_text(kw)}",
                        lambda: fusedmha.flash_attn_func(q, k, v, **kw),
                        check=lambda out: check_nonfinite(pb, out.transpose(1, 2)))
        grads = leaves_with_sinks((q, k, v), kw) if kind == "valid" and rng.random() < 0.5 else None

        def run():
            torch.manual_seed(seed)
            if grads:
                call_kw = dict(kw, sinks=grads[3]) if len(grads) > 3 else kw
                return fusedmha.flash_attn_func(*grads[:3], **call_kw)
            return fusedmha.flash_attn_func(q, k, v, **kw)

        def check(result):
            out, lse, probs = result if kw.get("return_attn_probs") else (result, None, None)
            pb = flash_problem(q, k, v, kw)
            keep = None
            if pb.dropout_p > 0:  # the same draw, replayed through the op
                torch.manual_seed(seed)
                keep = keep_mask(forward_op_call(pb)[2], pb)
            inputs64 = leaves64(*grads) if grads else None
            pb64 = flash_problem(*inputs64[:3], kw, *inputs64[3:]) if grads else pb
            ref, ref_lse, ref_probs = reference_of(pb64, keep)
            # flash_attn allocates its output like q (empty_like): contiguous for a contiguous q
            expect(out.is_contiguous() or not q.is_contiguous(),
                   f"output strides {out.stride()}: flash_attn returns it contiguous for a contiguous q")
            check_forward(pb, out.transpose(1, 2), ref)
            if lse is not None:
                check_logsumexp(lse, ref_lse, dtype)
                expect(probs.shape == ref_probs.shape, f"probs {tuple(probs.shape)} != {tuple(ref_probs.shape)}")
                assert_close_to_truth(probs.abs(), ref_probs, floor=fixed_floor(pb, dtype), what="probs")
                if keep is not None:
                    dropped = ~keep.expand(probs.shape)
                    expect(not (probs[dropped] > 0).any() and not (probs[~dropped] < 0).any(),
                           "probs: the sign does not follow the dropout keep-mask")
            if grads:
                grad_out = randn(out.shape, dtype, g)
                got = torch.autograd.grad(out, grads, grad_out)
                want = torch.autograd.grad(ref, inputs64, grad_out.double().transpose(1, 2),
                                           retain_graph=True)
                rounded = rounded_output_gradients(want, out.transpose(1, 2), ref, ref_lse,
                                                   grad_out.transpose(1, 2), inputs64)
                t = lambda x: x.transpose(1, 2) if x.dim() == 4 else x  # noqa: E731
                check_gradients(pb, [t(x) for x in got], [t(x) for x in want], grad_out.transpose(1, 2),
                                [t(x) for x in grads], [(t(w), f) for w, f in rounded])
        what = f"q={describe(q)} k={describe(k)} v={describe(v)} {kwargs_text(kw)}"
        return Case(entry, kind, what + (" +backward" if grads else ""), run, check)

    if kind == "empty":
        q, k, v, kw = draw_flash(rng, g, dtype, layouts=False, dropout=False)
        kw = {n: x for n, x in kw.items() if n in ("causal", "softmax_scale")}
        which = rng.choice(["B", "L", "S", "H", "E"])
        dim = {"B": 0, "L": 1, "S": 1, "H": 2, "E": 3}[which]
        shapes = [list(t.shape) for t in (q, k, v)]
        for i, s in enumerate(shapes):
            if which in ("B", "H", "E") or (which == "L" and i == 0) or (which == "S" and i > 0):
                s[dim] = 0
        q, k, v = (randn(s, dtype, g) for s in shapes)
        pb = flash_problem(q, k, v, kw)
        pb.is_causal = pb.is_causal and which not in ("L", "S")  # PyTorch: top-left causal

        def check(out):
            want = torch_sdpa(pb, (pb.q, pb.k, pb.v)).transpose(1, 2)
            expect(out.shape == want.shape and out.dtype == want.dtype,
                   f"{describe(out)} != PyTorch's {describe(want)}")
        return Case(entry, kind, f"{which}=0: q={describe(q)} k={describe(k)} v={describe(v)} {kwargs_text(kw)}",
                    lambda: fusedmha.flash_attn_func(q, k, v, **kw), check,
                    may_raise=lambda e: raise_ok(e, names_error(names)) is None)

    q, k, v, kw = draw_flash(rng, g, dtype, layouts=False, dropout=False)
    if kind == "meta":
        mkw = to_meta(kw)
        return Case(entry, kind, f"q={describe(q)} k={describe(k)} v={describe(v)} {kwargs_text(kw)}",
                    lambda: (fusedmha.flash_attn_func(q, k, v, **kw),
                             fusedmha.flash_attn_func(to_meta(q), to_meta(k), to_meta(v), **mkw)),
                    check=lambda r: same_meta_outputs(*r))
    args = {"q": q, "k": k, "v": v}
    if kind == "wrong_device":
        options = ["q", "k", "v"] + [n for n in ("alibi_slopes", "sinks") if n in kw]
        what = rng.choice(options)
        if what in args:
            args[what] = args[what].to("meta")
        else:
            kw[what] = kw[what].to("meta")
        what += " on meta"
    elif kind == "wrong_dtype":
        what = rng.choice(["int_q", "k_other_float", "bool_all", "int_alibi"])
        if what == "int_q":
            args["q"] = q.to(torch.int32)
        elif what == "k_other_float":
            args["k"] = k.to(rng.choice([d for d in DTYPES if d != dtype]))
        elif what == "bool_all":
            args = {n: t > 0 for n, t in args.items()}
        else:
            kw["alibi_slopes"] = torch.ones(q.shape[2], dtype=torch.int64)
    else:  # wrong_shape: ranks and sizes flash_attn_func does not take
        what = rng.choice(["q_3d", "all_3d", "all_2d", "E_mismatch", "heads_indivisible", "window"])
        if what == "q_3d":
            args["q"] = q[0]
        elif what == "all_3d":
            args = {n: t[0] for n, t in args.items()}
        elif what == "all_2d":
            args = {n: t[0, :, 0] for n, t in args.items()}
        elif what == "E_mismatch":
            args["k"] = randn(list(k.shape[:-1]) + [k.shape[-1] + 1], dtype, g)
        elif what == "heads_indivisible":
            args["k"] = randn(list(k.shape[:2]) + [q.shape[2] + 1, k.shape[3]], dtype, g)
            args["v"] = randn(list(v.shape[:2]) + [q.shape[2] + 1, v.shape[3]], dtype, g)
        else:
            kw["window_size"] = (rng.choice([-2, -50]), 0)
    return Case(entry, kind, f"{what}: q={describe(args['q'])} k={describe(args['k'])} "
                             f"v={describe(args['v'])} {kwargs_text(kw)}",
                lambda: fusedmha.flash_attn_func(args["q"], args["k"], args["v"], **kw),
                error=names_error(names))
