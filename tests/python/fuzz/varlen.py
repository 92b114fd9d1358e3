"""The cases of fusedmha.flash_attn_varlen_func: packed sequences (empty ones too), paged
keys and values through a block table, seqused_k, the variants, dropout; judged sequence by
sequence against the float64 reference. Valid calls with their gradients, nonfinite, empty,
meta, and the broken calls that must raise."""

import torch

import fusedmha
from reference import assert_close_to_truth

from .case import ENTRY_POINTS, Case, describe, expect, kwargs_text, names_error, raise_ok
from .draw import (
    DTYPES, HEAD_DIMS, INF, LAYOUTS, Problem, leaves_with_sinks, make, nonfinite_into, randn,
    to_meta)
from .judge import (
    FIXED_TOL, GRAD_FIXED_FACTOR, assert_gradient_close, check_logsumexp, leaves64,
    reference_of, rounded_output_gradients, same_meta_outputs)
from .nonfinite import check_nonfinite


SEQ_LENGTHS = [0, 1, 1, 2, 3, 5, 8, 13, 17, 31, 33, 64, 70]


def cumulative(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)


def draw_varlen(rng, g, dtype, *, layouts=True, dropout=True):
    """(args, kwargs, description of the packed batch) for flash_attn_varlen_func."""
    B = rng.randint(1, 5)
    lens_q = [rng.choice(SEQ_LENGTHS) for _ in range(B)]
    lens_k = list(lens_q) if rng.random() < 0.3 else [rng.choice(SEQ_LENGTHS) for _ in range(B)]
    h_kv = rng.choice([1, 2, 3])
    h = h_kv * rng.choice([1, 1, 2, 3])
    E = rng.choice(HEAD_DIMS[:18])
    Ev = E if rng.random() < 0.7 else rng.choice(HEAD_DIMS[:18])
    extra_q, extra_k = rng.choice([0, 0, 0, 2]), rng.choice([0, 0, 0, 3])
    pick = (lambda: rng.choice(LAYOUTS)) if layouts else (lambda: "contiguous")
    q = make([sum(lens_q) + extra_q, h, E], dtype, pick(), rng, g)
    kw = {}
    paged = rng.random() < 0.12
    if paged:  # k/v as pages through a block table (forward only)
        page = rng.choice([1, 3, 16, 64])
        per_seq = max(1, -(-max(lens_k) // page))
        num_pages = B * per_seq + rng.randint(0, 3)
        table = torch.randperm(num_pages, generator=g)[:B * per_seq].view(B, per_seq).to(torch.int32)
        k = randn([num_pages, page, h_kv, E], dtype, g)
        v = randn([num_pages, page, h_kv, Ev], dtype, g)
        kw["block_table"] = table
    else:
        k = make([sum(lens_k) + extra_k, h_kv, E], dtype, pick(), rng, g)
        v = make([sum(lens_k) + extra_k, h_kv, Ev], dtype, pick(), rng, g)
    max_q = max(lens_q) + rng.choice([0, 0, 1, 7])
    max_k = max(lens_k) + rng.choice([0, 0, 2])
    if rng.random() < 0.4:
        kw["causal"] = True
    if rng.random() < 0.25:
        kw["window_size"] = (rng.choice([-1, 0, 3, 9]), rng.choice([-1, 0, 2]))
    if rng.random() < 0.2:
        kw["softcap"] = rng.choice([1.0, 5.0])
    if rng.random() < 0.2:
        kw["alibi_slopes"] = torch.rand([B, h] if rng.random() < 0.5 else [h], generator=g) * 0.3
    if rng.random() < 0.2:
        kw["sinks"] = randn([h], dtype, g)
    if rng.random() < 0.2:
        kw["softmax_scale"] = rng.choice([0.0, 0.2, 1.0])
    if rng.random() < 0.2:
        kw["seqused_k"] = torch.tensor([rng.randint(0, n) for n in lens_k], dtype=torch.int32)
    if dropout and rng.random() < 0.2 and not paged:
        kw["dropout_p"] = rng.choice([0.2, 0.5])
    if rng.random() < 0.25 and not paged:
        kw["return_attn_probs"] = True
    args = [q, k, v, cumulative(lens_q), cumulative(lens_k), max_q, max_k]
    return args, kw, (lens_q, lens_k)


def varlen_sequences(args, kw, lens, keep=None, grads64=None):
    """The float64 truth of a packed call, sequence by sequence: (output, lse, [probs])."""
    q, k, v, cu_q, cu_k, max_q, max_k = args
    if grads64:
        q, k, v = grads64[:3]
    lens_q, lens_k = lens
    used = kw.get("seqused_k")
    used = used.tolist() if used is not None else lens_k
    window = kw.get("window_size", (-1, -1))
    sinks = grads64[3] if grads64 and len(grads64) > 3 else kw.get("sinks")
    h = q.shape[1]
    outs, lses, probs = [], [], []
    for b, (n_q, n_k) in enumerate(zip(lens_q, used)):
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        if "block_table" in kw:
            page = k.shape[1]
            rows_k = k[kw["block_table"][b].long()].flatten(0, 1)
            rows_v = v[kw["block_table"][b].long()].flatten(0, 1)
            kb, vb = rows_k[:n_k], rows_v[:n_k]
            del page
        else:
            kb, vb = k[k0:k0 + n_k], v[k0:k0 + n_k]
        slopes = kw.get("alibi_slopes")
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        variants = dict(window_left=window[0], window_right=window[1], bottom_right=True,
                        softcap=kw.get("softcap", 0.0), alibi_slopes=slopes, sinks=sinks)
        pb = Problem(q[q0:q0 + n_q].transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1),
                     dropout_p=kw.get("dropout_p", 0.0), is_causal=kw.get("causal", False),
                     scale=kw.get("softmax_scale"), gqa=True,
                     variants={n: x for n, x in variants.items() if x is not None})
        kb_keep = None if keep is None else keep[b, :, :n_q, :n_k]
        out, lse, p = reference_of(pb, kb_keep)
        outs.append(out.transpose(0, 1))
        lses.append(lse)
        probs.append(p)
    rows = q.shape[0] - sum(lens_q)
    outs.append(torch.zeros(rows, h, v.shape[-1], dtype=torch.float64))
    lses.append(torch.full((h, rows), INF, dtype=torch.float64))
    return torch.cat(outs), torch.cat(lses, dim=1), probs


def varlen_text(args, kw):
    q, k, v, cu_q, cu_k, max_q, max_k = args
    def values(t):  # (a tensor on the meta device has none to show)
        return describe(t) if t.is_meta else t.tolist()

    return (f"q={describe(q)} k={describe(k)} v={describe(v)} cu_seqlens_q={values(cu_q)} "
            f"cu_seqlens_k={values(cu_k)} max_seqlen_q={max_q} max_seqlen_k={max_k} {kwargs_text(kw)}")


def gen_varlen(rng, g, kind, seed):
    entry = "flash_attn_varlen_func"
    names = ENTRY_POINTS[entry]
    dtype = rng.choice(DTYPES)
    args, kw, lens = draw_varlen(rng, g, dtype, layouts=kind == "valid", dropout=kind == "valid")
    floor = FIXED_TOL[dtype]

    if kind == "nonfinite":
        i = rng.randrange(3)
        args[i] = nonfinite_into(args[i], rng, g)
        kw.pop("return_attn_probs", None)

        def check(out):
            # Sequence by sequence, as SDPA-shaped problems (nothing leaks between sequences).
            q, k, v, cu_q, cu_k, _, _ = args
            for b, (n_q, n_k) in enumerate(zip(*lens)):
                if "block_table" in kw or "seqused_k" in kw:
                    return
                window = kw.get("window_size", (-1, -1))
                slopes = kw.get("alibi_slopes")
                if slopes is not None and slopes.dim() == 2:
                    slopes = slopes[b]
                variants = dict(window_left=window[0], window_right=window[1], bottom_right=True,
                                softcap=kw.get("softcap", 0.0), alibi_slopes=slopes, sinks=kw.get("sinks"))
                q0, k0 = int(cu_q[b]), int(cu_k[b])
                pb = Problem(q[q0:q0 + n_q].transpose(0, 1), k[k0:k0 + n_k].transpose(0, 1),
                             v[k0:k0 + n_k].transpose(0, 1), is_causal=kw.get("causal", False),
                             scale=kw.get("softmax_scale"), gqa=True,
                             variants={n: x for n, x in variants.items() if x is not None})
                check_nonfinite(pb, out[q0:q0 + n_q].transpose(0, 1), what=f"sequence {b}")
        return Case(entry, kind, f"{'qkv'[i]} poisoned: {varlen_text(args, kw)}",
                    lambda: fusedmha.flash_attn_varlen_func(*args, **kw), check)

    if kind == "valid":
        grads = leaves_with_sinks(args[:3], kw) if rng.random() < 0.5 and "block_table" not in kw else None

        def run():
            torch.manual_seed(seed)
            if grads:
                call_kw = dict(kw, sinks=grads[3]) if len(grads) > 3 else kw
                return fusedmha.flash_attn_varlen_func(*grads[:3], *args[3:], **call_kw)
            return fusedmha.flash_attn_varlen_func(*args, **kw)

        def check(result):
            out, lse, probs = result if kw.get("return_attn_probs") else (result, None, None)
            keep = None
            p = kw.get("dropout_p", 0.0)
            B, h = len(lens[0]), args[0].shape[1]
            if p > 0:  # replay the draw through the op: elements (b*H + h, i, j)
                torch.manual_seed(seed)
                variants = {n: kw[n] for n in ("softcap", "alibi_slopes", "sinks", "seqused_k") if n in kw}
                window = kw.get("window_size", (-1, -1))
                _, _, rng_state = torch.ops.fusedmha.varlen_attention_forward(
                    *args, p, kw.get("causal", False), kw.get("softmax_scale"),
                    window_left=window[0], window_right=window[1], bottom_right=True, **variants)
                keep = torch.ops.fusedmha._dropout_keep_mask(rng_state, B * h, args[5], args[6], p)
                keep = keep.view(B, h, args[5], args[6])
            grads64 = leaves64(*grads) if grads else None
            ref, ref_lse, ref_probs = varlen_sequences(args, kw, lens, keep, grads64)
            expect(out.shape == ref.shape and out.dtype == dtype, f"output {describe(out)}, expected {tuple(ref.shape)}")
            assert_close_to_truth(out, ref, floor=floor)
            if lse is not None:
                check_logsumexp(lse, ref_lse, dtype)
                expect(tuple(probs.shape) == (B, h, args[5], args[6]), f"probs of shape {tuple(probs.shape)}")
                for b, pb_probs in enumerate(ref_probs):
                    n_q, n_k = pb_probs.shape[-2:]
                    assert_close_to_truth(probs[b, :, :n_q, :n_k].abs(), pb_probs, floor=floor,
                                          what=f"probs of sequence {b}")
            if grads:
                grad_out = randn(out.shape, dtype, g)
                got = torch.autograd.grad(out, grads, grad_out)
                want = torch.autograd.grad(ref, grads64, grad_out.double(), allow_unused=True,
                                           retain_graph=True)
                want = [torch.zeros_like(a, dtype=torch.float64) if w is None else w
                        for a, w in zip(got, want)]
                rounded = rounded_output_gradients(want, out, ref, ref_lse.transpose(0, 1),
                                                   grad_out, grads64)
                for name, a, w, r in zip(["q", "k", "v", "sinks"], got, want, rounded):
                    assert_gradient_close(a, w, r, name, dtype=a.dtype, floor=GRAD_FIXED_FACTOR * floor)
        return Case(entry, kind, varlen_text(args, kw) + (" +backward" if grads else ""), run, check)

    if kind == "empty":
        which = rng.choice(["B0", "all_empty", "H0", "E0"])
        q, k, v, cu_q, cu_k, max_q, max_k = args
        kw = {n: x for n, x in kw.items() if n in ("causal", "softmax_scale")}
        if which == "B0":
            args = [q[:0], k[:0], v[:0], cu_q[:1], cu_k[:1], 0, 0]
        elif which == "all_empty":
            z = torch.zeros(len(lens[0]) + 1, dtype=torch.int32)
            args = [q[:0], k[:0], v[:0], z, z, 0, 0]
        elif which == "H0":
            args = [q[:, :0], k[:, :0], v[:, :0], cu_q, cu_k, max_q, max_k]
        else:
            args = [q[..., :0], k[..., :0], v, cu_q, cu_k, max_q, max_k]
        lens = (lens[0], lens[1]) if which in ("H0", "E0") else ([], []) if which == "B0" else (
            [0] * len(lens[0]), [0] * len(lens[0]))

        def check(out):
            want = (args[0].shape[0], args[0].shape[1], args[2].shape[-1])
            expect(tuple(out.shape) == want, f"output {describe(out)}, expected {want}")
            if out.numel():
                assert_close_to_truth(out, varlen_sequences(args, kw, lens)[0], floor=floor)
        return Case(entry, kind, f"{which}: {varlen_text(args, kw)}",
                    lambda: fusedmha.flash_attn_varlen_func(*args, **kw), check,
                    may_raise=lambda e: raise_ok(e, names_error(names)) is None)

    if kind == "meta":
        margs = [to_meta(a) for a in args]
        kw.pop("return_attn_probs", None)  # probabilities read the lengths (host values)
        return Case(entry, kind, varlen_text(args, kw),
                    lambda: (fusedmha.flash_attn_varlen_func(*args, **kw),
                             fusedmha.flash_attn_varlen_func(*margs, **to_meta(kw))),
                    check=lambda r: same_meta_outputs(*r))

    kw.pop("return_attn_probs", None)
    q, k, v, cu_q, cu_k, max_q, max_k = args
    if kind == "wrong_device":
        i = rng.randrange(5)
        args[i] = args[i].to("meta")
        what = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"][i] + " on meta"
    elif kind == "wrong_dtype":
        what = rng.choice(["cu_q_int64", "cu_k_float", "int_q", "v_other_float", "seqused_int64",
                           "block_table_int64"])
        if what == "cu_q_int64":
            args[3] = cu_q.long()
        elif what == "cu_k_float":
            args[4] = cu_k.float()
        elif what == "int_q":
            args[0] = q.to(torch.int32)
        elif what == "v_other_float":
            args[2] = v.to(rng.choice([d for d in DTYPES if d != dtype]))
        elif what == "seqused_int64":
            kw["seqused_k"] = torch.tensor(lens[1], dtype=torch.int64)
        else:
            if "block_table" not in kw:
                kw["block_table"] = torch.zeros(len(lens[0]), 1, dtype=torch.int32)
            kw["block_table"] = kw["block_table"].long()
    else:  # wrong_shape
        what = rng.choice(["decreasing", "past_total", "max_q_small", "max_k_small", "seqused_long",
                           "cu_2d", "q_2d", "heads_indivisible", "alibi_rows", "page_out_of_range",
                           "negative_max"])
        if what == "decreasing" and len(lens[0]) >= 2:
            c = cu_q.clone()
            c[1] = c[-1] + 1
            args[3] = c
        elif what == "past_total":
            c = cu_k.clone()
            c[-1] = c[-1] + 5 + (k.shape[0] * (k.shape[1] if "block_table" in kw else 1))
            args[4] = c
            kw.pop("seqused_k", None)  # (with pages, seqused_k would bound the keys instead)
        elif what == "max_q_small" and max(lens[0]) > 0:
            args[5] = max(lens[0]) - 1
        elif what == "max_k_small" and max(lens[1]) > 0 and "block_table" not in kw:
            args[6] = max(lens[1]) - 1
            kw.pop("seqused_k", None)  # (which may make max_seqlen_k right again)
        elif what == "seqused_long":  # (with pages: past what a table row holds)
            longest = [n + 1 for n in lens[1]]
            if "block_table" in kw:
                longest = [kw["block_table"].shape[1] * k.shape[1] + 1] * len(lens[1])
            kw["seqused_k"] = torch.tensor(longest, dtype=torch.int32)
        elif what == "cu_2d":
            args[3] = cu_q[None]
        elif what == "q_2d":
            args[0] = q[:, 0]
        elif what == "heads_indivisible":  # 2·H_kv + 1 query heads (H_kv >= 2: 1 divides all)
            h_kv = max(2, k.shape[-2])  # (k is (total_k, H_kv, E), or pages (n, page, H_kv, E))
            if h_kv != k.shape[-2]:
                args[1] = randn(list(k.shape[:-2]) + [h_kv, k.shape[-1]], dtype, g)
                args[2] = randn(list(v.shape[:-2]) + [h_kv, v.shape[-1]], dtype, g)
            args[0] = randn([q.shape[0], h_kv * 2 + 1, q.shape[2]], dtype, g)
            kw.pop("alibi_slopes", None)
            kw.pop("sinks", None)
        elif what == "alibi_rows":
            kw["alibi_slopes"] = torch.rand(len(lens[0]) + 1, q.shape[1])
        elif what == "page_out_of_range" and "block_table" in kw:
            t = kw["block_table"].clone()
            t[0, 0] = k.shape[0]
            kw["block_table"] = t
        else:
            what = "negative_max"
            args[5] = -1
    return Case(entry, kind, f"{what}: {varlen_text(args, kw)}",
                lambda: fusedmha.flash_attn_varlen_func(*args, **kw), error=names_error(names))
