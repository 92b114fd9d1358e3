"""The cases of fusedmha.scaled_dot_product_attention and of the op it hands the call to,
torch.ops.fusedmha.attention_forward (one generator, gen_sdpa_like): valid calls with their
gradients, nonfinite, empty, huge, overflow (logical sizes past 2^31 elements), meta, and the
broken calls that must raise."""

import math

import torch

import fusedmha
from reference import assert_close_to_truth

from .case import ENTRY_POINTS, Case, Mismatch, describe, expect, names_error, raise_ok
from .draw import DTYPES, INF, NAN, Problem, draw_problem, poison, randn, to_meta
from .judge import (
    check_forward, check_gradients, check_logsumexp, fixed_floor, keep_mask, leaves64,
    reference_of, rounded_output_gradients, same_meta_outputs, torch_sdpa)
from .nonfinite import check_nonfinite


def sdpa_call(pb, q=None, k=None, v=None, sinks=None):
    variants = dict(pb.variants)
    if sinks is not None:
        variants["sinks"] = sinks
    return fusedmha.scaled_dot_product_attention(
        pb.q if q is None else q, pb.k if k is None else k, pb.v if v is None else v,
        attn_mask=pb.mask, dropout_p=pb.dropout_p, is_causal=pb.is_causal, scale=pb.scale,
        enable_gqa=pb.gqa, **variants)


def forward_op_call(pb, q=None, k=None, v=None, sinks=None):
    variants = dict(pb.variants)
    if sinks is not None:
        variants["sinks"] = sinks
    return torch.ops.fusedmha.attention_forward(
        pb.q if q is None else q, pb.k if k is None else k, pb.v if v is None else v, pb.mask,
        pb.dropout_p, pb.is_causal, pb.scale, pb.gqa, **variants)


def grad_leaves(pb, rng):
    """Fresh leaves of q, k, v (and the sinks) to differentiate, or None (no backward)."""
    if rng.random() < 0.45:
        return None
    xs = [pb.q, pb.k, pb.v] + ([pb.variants["sinks"]] if pb.variants.get("sinks") is not None else [])
    # Views keep their layout: the leaf is the view itself, detached.
    return [x.detach().requires_grad_() for x in xs]


def check_problem_call(pb, forward, with_rng, grad_inputs, seed):
    """The result of forward(pb, *grad_inputs) (SDPA: output only; the op: output, lse,
    rng_state) against the float64 truth, gradients included."""
    def run():
        torch.manual_seed(seed)  # the dropout draw, replayed below
        return forward(pb, *(grad_inputs or []))

    def check(result):
        out, lse, rng_state = result if with_rng else (result, None, None)
        keep = None
        if pb.dropout_p > 0:
            if rng_state is None:  # replay the SDPA call's draw through the op
                torch.manual_seed(seed)
                rng_state = forward_op_call(pb)[2]
            keep = keep_mask(rng_state, pb)
        inputs64 = leaves64(*grad_inputs) if grad_inputs else None
        ref, ref_lse, _ = reference_of(pb, keep, inputs64)
        check_forward(pb, out, ref)
        if lse is not None:
            check_logsumexp(lse, ref_lse, pb.q.dtype)
        if grad_inputs:
            grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
            got = torch.autograd.grad(out, grad_inputs, grad_out)
            want = torch.autograd.grad(ref, inputs64, grad_out.double(), retain_graph=True)
            rounded = rounded_output_gradients(want, out, ref, ref_lse, grad_out, inputs64)
            check_gradients(pb, got, want, grad_out, grad_inputs, rounded)

    return run, check


def gen_sdpa_like(entry, rng, g, kind, seed):
    """Cases of fusedmha.scaled_dot_product_attention and torch.ops.fusedmha.attention_forward."""
    front_door = entry == "sdpa"
    forward = sdpa_call if front_door else forward_op_call
    with_rng = not front_door
    names = ENTRY_POINTS[entry]
    dtype = rng.choice(DTYPES)

    if kind == "valid":
        pb = draw_problem(rng, g, dtype, front_door=front_door)
        if front_door and rng.random() < 0.03:
            pb.dropout_p = 1.0  # PyTorch's meaning: zeros (the front door only)
            return Case(entry, kind, pb.text(), lambda: forward(pb),
                        check=lambda out: expect(bool((out == 0).all()), "dropout_p=1 must give zeros"))
        grads = grad_leaves(pb, rng)
        run, check = check_problem_call(pb, forward, with_rng, grads, seed)
        return Case(entry, kind, pb.text() + (" +backward" if grads else ""), run, check)

    if kind == "nonfinite":
        pb = draw_problem(rng, g, dtype, front_door=front_door, dropout=False)
        target = poison(pb, rng, g)
        grads = grad_leaves(pb, rng)

        def run():
            out = forward(pb, *(grads or []))
            out = out[0] if with_rng else out
            if grads:  # the backward must not crash; its values are not judged here
                torch.autograd.grad(out, grads, torch.ones_like(out), allow_unused=True)
            return out
        return Case(entry, kind, f"{target} poisoned: {pb.text()}", run,
                    check=lambda out: check_nonfinite(pb, out))

    if kind == "empty":
        pb = draw_problem(rng, g, dtype, front_door=front_door, variants=False, dropout=False,
                          layouts=False)
        dims = {"q": pb.q, "k": pb.k, "v": pb.v}
        which = rng.choice(["batch", "heads", "L", "S", "E", "Ev"])
        shapes = {n: list(t.shape) for n, t in dims.items()}
        nd = len(shapes["q"])
        if which == "batch" and nd >= 4:
            for s in shapes.values():
                s[0] = 0
        elif which == "heads" and nd >= 3:
            for s in shapes.values():
                s[-3] = 0
        elif which == "L":
            shapes["q"][-2] = 0
        elif which == "S":
            shapes["k"][-2] = shapes["v"][-2] = 0
        elif which == "E":
            shapes["q"][-1] = shapes["k"][-1] = 0
        else:
            shapes["v"][-1] = 0
        pb.q, pb.k, pb.v = (randn(shapes[n], dtype, g) for n in "qkv")
        if pb.mask is not None:  # a mask of the new shape, if it still broadcasts
            pb.mask = None if pb.mask.numel() else pb.mask
            pb.mask = None
        pb.gqa = pb.gqa and which != "heads"

        def check(out):
            out = out[0] if with_rng else out
            try:
                want = torch_sdpa(pb, (pb.q, pb.k, pb.v))
            except RuntimeError as e:
                raise Mismatch(f"PyTorch raises ({e}), fusedmha returns {describe(out)}") from None
            expect(out.shape == want.shape and out.dtype == want.dtype,
                   f"{describe(out)} != PyTorch's {describe(want)}")
            if out.numel():  # E = 0: every score 0, the mean of V; S = 0: zeros
                assert_close_to_truth(out, reference_of(pb)[0], want)

        def may_raise(exc):  # allowed only where PyTorch raises too
            try:
                torch_sdpa(pb, (pb.q, pb.k, pb.v))
            except RuntimeError:
                return raise_ok(exc, names_error(names)) is None
            return False
        return Case(entry, kind, f"{which}=0: {pb.text()}", lambda: forward(pb), check,
                    may_raise=may_raise)

    if kind == "huge":
        L, S, E, Ev = rng.choice([(2, 2, 4096, 4096), (1, 100_000, 4, 4), (1, 30_000, 64, 64),
                                  (3, 2, 2048, 8), (2000, 3, 4, 4), (1, 4099, 1, 300)])
        pb = Problem(randn([1, 1, L, E], dtype, g), randn([1, 1, S, E], dtype, g),
                     randn([1, 1, S, Ev], dtype, g))
        pb.is_causal = rng.random() < 0.3
        if rng.random() < 0.3 and not (front_door and pb.is_causal):
            pb.mask = torch.rand(1, S, generator=g) > 0.3
        run, check = check_problem_call(pb, forward, with_rng, None, seed)
        return Case(entry, kind, pb.text(), run, check)

    if kind == "overflow":
        return overflow_case(entry, rng, g, dtype, forward, with_rng, seed)

    if kind == "meta":
        pb = draw_problem(rng, g, dtype, front_door=front_door, dropout=False)
        metap = Problem(to_meta(pb.q), to_meta(pb.k), to_meta(pb.v), to_meta(pb.mask),
                        pb.dropout_p, pb.is_causal, pb.scale, pb.gqa, to_meta(pb.variants))
        return Case(entry, kind, pb.text(), lambda: (forward(pb), forward(metap)),
                    check=lambda r: same_meta_outputs(*r))

    pb = draw_problem(rng, g, dtype, front_door=front_door, variants=rng.random() < 0.3,
                      layouts=False)
    bad = broken_problem(pb, kind, rng, g)
    return Case(entry, kind, f"{bad}: {pb.text()}", lambda: forward(pb), error=names_error(names))


def broken_problem(pb, kind, rng, g):
    """Break a valid problem (in place) the way `kind` says; returns what was broken."""
    if kind == "wrong_device":
        options = ["q", "k", "v"] + (["mask"] if pb.mask is not None else [])
        options += [n for n in ("alibi_slopes", "sinks") if pb.variants.get(n) is not None]
        what = rng.choice(options)
        if what in ("alibi_slopes", "sinks"):
            pb.variants[what] = pb.variants[what].to("meta")
        elif what == "mask":
            pb.mask = pb.mask.to("meta")
        else:
            setattr(pb, what, getattr(pb, what).to("meta"))
        return f"{what} on meta"
    if kind == "wrong_dtype":
        choices = ["int_q", "bool_qkv", "k_other_float", "v_other_float", "long_all"]
        if pb.mask is not None:
            choices += ["int_mask", "mask_float64"] if pb.q.dtype != torch.float64 else ["int_mask"]
        if pb.variants.get("alibi_slopes") is not None:
            choices.append("int_alibi")
        what = rng.choice(choices)
        others = [d for d in DTYPES if d != pb.q.dtype]
        if what == "int_q":
            pb.q = pb.q.to(rng.choice([torch.int32, torch.int64, torch.uint8]))
        elif what == "bool_qkv":
            pb.q, pb.k, pb.v = pb.q > 0, pb.k > 0, pb.v > 0
        elif what == "k_other_float":
            pb.k = pb.k.to(rng.choice(others))
        elif what == "v_other_float":
            pb.v = pb.v.to(rng.choice(others))
        elif what == "long_all":
            pb.q, pb.k, pb.v = pb.q.long(), pb.k.long(), pb.v.long()
        elif what == "int_mask":
            pb.mask = pb.mask.to(rng.choice([torch.int32, torch.int64, torch.uint8, torch.int8]))
        elif what == "mask_float64":
            pb.mask = pb.mask.double()
        elif what == "int_alibi":
            pb.variants["alibi_slopes"] = pb.variants["alibi_slopes"].long()
        return what
    # wrong_shape
    choices = ["E_mismatch", "S_mismatch", "rank1", "heads_indivisible", "mask_not_broadcast",
               "batch_mismatch", "bad_scale", "bad_dropout", "bad_window", "bad_softcap",
               "alibi_shape", "sinks_shape"]
    what = rng.choice(choices)
    q, k, v = pb.q, pb.k, pb.v
    if what == "E_mismatch":
        pb.k = randn(list(k.shape[:-1]) + [k.shape[-1] + 1], k.dtype, g)
    elif what == "S_mismatch":
        pb.v = randn(list(v.shape[:-2]) + [v.shape[-2] + 1, v.shape[-1]], v.dtype, g)
    elif what == "rank1":
        setattr(pb, rng.choice("qkv"), randn([rng.randint(1, 5)], q.dtype, g))
    elif what == "heads_indivisible" and q.dim() >= 3:
        h = q.shape[-3]
        if h == 1:  # (1 query head would broadcast against any number)
            h = 2
            pb.q = randn(list(q.shape[:-3]) + [h] + list(q.shape[-2:]), q.dtype, g)
        pb.k = randn(list(k.shape[:-3]) + [h + 1] + list(k.shape[-2:]), k.dtype, g)
        pb.v = randn(list(v.shape[:-3]) + [h + 1] + list(v.shape[-2:]), v.dtype, g)
        pb.gqa = rng.random() < 0.5
        pb.variants = {}
    elif what == "mask_not_broadcast":
        pb.mask = torch.ones(q.shape[-2] + 1, k.shape[-2], dtype=torch.bool)
        pb.is_causal = pb.is_causal and False
    elif what == "batch_mismatch" and q.dim() >= 4:
        # (a batch of 1 against 2 would broadcast, as in PyTorch: neither is 1)
        b = q.shape[0] + 1 if q.shape[0] > 1 else 2
        if q.shape[0] == 1:
            pb.q = randn([3] + list(q.shape[1:]), q.dtype, g)
        pb.k = randn([b] + list(k.shape[1:]), k.dtype, g)
        pb.v = randn([b] + list(v.shape[1:]), v.dtype, g)
    elif what == "bad_scale":
        pb.scale = rng.choice([-1.0, INF, NAN])
    elif what == "bad_dropout":
        pb.dropout_p = rng.choice([-0.1, 1.5, NAN])
    elif what == "bad_window":
        pb.variants["window_left"] = rng.choice([-2, -100])
    elif what == "bad_softcap":
        pb.variants["softcap"] = rng.choice([-1.0, INF, NAN])
    elif what == "alibi_shape":
        h = q.shape[-3] if q.dim() >= 3 else 1
        pb.variants["alibi_slopes"] = torch.rand(h + 1)
    elif what == "sinks_shape":
        h = q.shape[-3] if q.dim() >= 3 else 1
        pb.variants["sinks"] = randn([2, h + 1], q.dtype, g)
    else:  # the shape does not allow this break: an E mismatch instead
        what = "E_mismatch"
        pb.k = randn(list(k.shape[:-1]) + [k.shape[-1] + 1], k.dtype, g)
    return what


def overflow_case(entry, rng, g, dtype, forward, with_rng, seed):
    """Sizes whose products pass 2^31 elements, in stride-0 views or skipped by a window."""
    front_door = entry == "sdpa"
    how = rng.choice(["long_keys", "band", "band_mask"])
    if how == "long_keys":
        # 2^31 + a few keys, all one stride-0 row: only the window's last keys are read.
        S = 2 ** 31 + rng.randint(1, 1000)
        L, E, Ev, w = rng.randint(1, 3), rng.randint(1, 8), rng.randint(1, 8), rng.randint(0, 9)
        k = randn([1, 1, 1, E], dtype, g).expand(1, 1, S, E)
        v = randn([1, 1, 1, Ev], dtype, g).expand(1, 1, S, Ev)
        pb = Problem(randn([1, 1, L, E], dtype, g), k, v, is_causal=True,
                     variants=dict(window_left=w, bottom_right=True))

        def check(result):
            out, lse = (result[0], result[1]) if with_rng else (result, None)
            # Every key is the same: the output is that value; the lse counts the keys seen.
            want = pb.v[..., :L, :].double().expand(out.shape)
            assert_close_to_truth(out, want, floor=fixed_floor(pb, dtype))
            if lse is not None:
                scale = 1 / math.sqrt(E)
                seen = torch.tensor([min(w + 1, S - (L - 1 - i) + w) for i in range(L)], dtype=torch.float64)
                score = (pb.q.double() @ pb.k[0, 0, 0].double()) * scale
                check_logsumexp(lse, (score[0, 0] + seen.log())[None, None], dtype)
        return Case(entry, "overflow", f"{how}: {pb.text()}", lambda: forward(pb), check)

    # L = S = 2^16 + a few (L*S > 2^32): a causal band of w keys, with a float mask expanded
    # from one row (stride 0, 2^32 logical elements); rows compared on slices.
    n = 2 ** 16 + rng.randint(1, 64)
    w = rng.randint(0, 12)
    E = rng.choice([1, 4, 8])
    q, k, v = (randn([1, 1, n, E], dtype, g) for _ in range(3))
    mask = None
    if how == "band_mask":
        mask = randn([1, n], torch.float32, g).expand(n, n)
    pb = Problem(q, k, v, mask=mask, variants=dict(window_left=w, window_right=0))

    def check(result):
        out = result[0] if with_rng else result
        expect(tuple(out.shape) == (1, 1, n, E), f"output shape {tuple(out.shape)}")
        for start in (0, rng.randrange(n - 40), n - 40):  # 40 rows at a time, their band of keys
            k0 = max(0, start - w)
            sub = Problem(q[..., start:start + 40, :], k[..., k0:start + 40, :], v[..., k0:start + 40, :],
                          mask=None if mask is None else mask[start:start + 40, k0:start + 40],
                          variants=dict(window_left=w, window_right=0, bottom_right=True))
            assert_close_to_truth(out[..., start:start + 40, :], reference_of(sub)[0],
                                  floor=fixed_floor(pb, dtype), what=f"rows {start}..{start + 39}")
    return Case(entry, "overflow", f"{how}: {pb.text()}", lambda: forward(pb), check)
