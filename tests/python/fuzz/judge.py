"""Judging a case: the float64 references (reference.py) and the tolerances a result must
meet (PyTorch's own error, or fixed floors grown with the scores' size), the checks of outputs,
log-sum-exps, gradients and meta-device results, and judge(), which makes a case's call and
says why it is wrong, or None."""

import math
import traceback
import warnings

import pytest
import torch
import torch.nn.functional as F

from reference import (
    GRAD_FLOOR_CPU, assert_close_to_truth, grad_tolerance, kernel_keep_mask, output_floor,
    reference_variants)

from .case import describe, expect, raise_ok
from .draw import INF, outer_of


# Outputs without a PyTorch counterpart to take the error from (the variants, dropout): fixed
# floors, times max(1, |truth|). float64/float32/bfloat16 are test_variants.py's TOL (softcap in
# float64 is held to float32's, as there); float16 sits between float32 and bfloat16 as its
# output floor does (reference.ATOL_FLOOR).
FIXED_TOL = {torch.float64: 1e-10, torch.float32: 3e-5, torch.bfloat16: 3e-2, torch.float16: 6e-3}
GRAD_FIXED_FACTOR = 5  # gradients: 5x the output's (test_dropout.py)


def keep_mask(rng_state, pb):
    """The keep-mask the kernels drew for this call (its rng_state), (*outer, L, S)."""
    q = pb.q.expand(outer_of(pb) + list(pb.q.shape[-2:]))
    return kernel_keep_mask(rng_state, q, pb.k, pb.dropout_p)


def leaves64(*tensors):
    return [None if t is None else t.detach().double().requires_grad_() for t in tensors]


def reference_of(pb, keep=None, grad_inputs=None, mask=None):
    """The float64 truth (output, lse, probs) of a problem; grad_inputs: float64 leaves of
    q, k, v (and sinks) to differentiate, or None; mask: a float64 leaf of the float mask to
    differentiate, or None."""
    q, k, v = grad_inputs[:3] if grad_inputs else (pb.q.double(), pb.k.double(), pb.v.double())
    variants = dict(pb.variants)
    if grad_inputs and len(grad_inputs) > 3:
        variants["sinks"] = grad_inputs[3]
    return reference_variants(q, k, v, pb.mask if mask is None else mask, pb.is_causal, pb.scale,
                              pb.gqa, keep, pb.dropout_p, **variants)


def check_mask_gradient(pb, got, want, rounded):
    """A float mask's gradient (the mask's shape and dtype) against the float64 truth: the
    query dtype's fixed gradient floor, grown with the square root of how many scores each
    element sums (their rounding errors add up, and the sum may cancel to near 0)."""
    mask = pb.mask
    expect(got.shape == mask.shape and got.dtype == mask.dtype,
           f"grad_attn_mask: {describe(got)} for the mask {describe(mask)}")
    # An expanded mask's elements share memory: each holds the sum over the expanded dims
    # divided by their count (the op's contract), where the float64 leaf has one per element.
    shared = [d for d in range(mask.dim()) if mask.stride(d) == 0 and mask.shape[d] > 1]

    def as_shared(w):
        if not shared:
            return w
        return (w.sum(shared, keepdim=True) / math.prod(mask.shape[d] for d in shared)).expand(mask.shape)

    want = as_shared(want)
    rounded = None if rounded is None else (as_shared(rounded[0]), rounded[1])
    summed = math.prod(outer_of(pb)) * pb.q.shape[-2] * pb.k.shape[-2] / max(1, mask.numel())
    floor = max(GRAD_FIXED_FACTOR * fixed_floor(pb, pb.q.dtype), GRAD_FLOOR_CPU[pb.q.dtype])
    assert_gradient_close(got, want, rounded, "attn_mask", dtype=pb.q.dtype,
                          floor=floor * math.sqrt(max(1.0, summed)))


def torch_mask(pb):
    """The problem's mask as PyTorch's SDPA takes it (>= 2-D; causal folded in when both)."""
    mask = pb.mask
    L, S = pb.q.shape[-2], pb.k.shape[-2]
    if mask is not None and mask.dim() < 2:
        mask = mask.expand(L, S)
    if mask is not None and pb.is_causal:
        tril = torch.ones(L, S, dtype=torch.bool).tril()
        mask = mask & tril if mask.dtype == torch.bool else mask.masked_fill(~tril, -INF)
    return mask


def pytorch_comparable(pb):
    return pb.dropout_p == 0 and not pb.variant_active()


def torch_sdpa(pb, inputs):
    q, k, v = inputs
    mask = torch_mask(pb)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          is_causal=pb.is_causal and mask is None,
                                          scale=pb.scale, enable_gqa=pb.gqa)


def fixed_floor(pb, dtype):
    if pb.variants.get("softcap", 0) > 0 and dtype == torch.float64:
        return FIXED_TOL[torch.float32]
    return FIXED_TOL[dtype]


# The scaled scores' size up to which the output floors hold. A score s is rounded to about
# eps·|s| in any summation order, which moves the output by about that much times |v|: float32
# outputs of calls with scale=2.0 and E=100 (scores up to ~50-80) err by up to 1.1e-5 from the
# float64 truth, against 1.35e-5 for PyTorch's (300 random calls each), while the float32
# floor is 2e-6 per unit of output. So the floor grows with the scores beyond this size.
FLOOR_SCORE_SIZE = 16.0


def score_size(pb):
    """The largest |scale·q·k| over every pair of query and key rows (float64; rows of other
    heads too, so at least the call's own), capped by a softcap; 0 where not finite or too many
    pairs to compute cheaply."""
    q, k = pb.q, pb.k
    if q.dim() < 2 or k.dim() < 2 or q.size(-1) != k.size(-1) or q.numel() == 0 or k.numel() == 0:
        return 0.0
    if (q.numel() // q.size(-1)) * (k.numel() // k.size(-1)) > 4_000_000:
        return 0.0
    scale = pb.scale if pb.scale is not None else 1.0 / math.sqrt(q.size(-1))
    s = (q.reshape(-1, q.size(-1)).double() @ k.reshape(-1, k.size(-1)).double().T).abs().max().item()
    size = abs(scale) * s
    if pb.variants.get("softcap", 0) > 0:
        size = min(size, pb.variants["softcap"])
    return size if math.isfinite(size) else 0.0


def check_forward(pb, out, ref, what="output"):
    """out within the test suite's bounds of the float64 truth ref (the floor grown with the
    scores' size beyond FLOOR_SCORE_SIZE)."""
    expect(tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}")
    expect(out.dtype == pb.q.dtype, f"{what}: dtype {out.dtype} != {pb.q.dtype}")
    growth = max(1.0, score_size(pb) / FLOOR_SCORE_SIZE)
    if pytorch_comparable(pb):
        try:
            torch_out = torch_sdpa(pb, (pb.q, pb.k, pb.v))
        except RuntimeError:
            torch_out = None
        assert_close_to_truth(out, ref, torch_out, floor=growth * output_floor(out.dtype, out.device),
                              what=what)
    else:
        assert_close_to_truth(out, ref, floor=growth * fixed_floor(pb, out.dtype), what=what)


def rounded_output_gradients(want, out, ref, ref_lse, grad_out, inputs64):
    """want (the exact float64 gradients) as the backward the kernels define computes them from
    the output as returned, rounded to its dtype: D = rowsum(dO * O) of that output, dS = P *
    (dP - D). Against the exact D, that adds delta_i = dO_i . (O_i - round(O_i)) times row i's
    dlse/d(q, k). Where the exact gradient is a cancellation (one key: dS = 0; equal keys), that
    is all there is to see, and PyTorch's math (dS from P and dP) gets 0 there. FlashAttention
    computes D as the kernels do; this is the truth of that algorithm. Returns, per input, that
    gradient and the factor its floor is scaled by: the largest element of the D term alone
    (P * D), the size of what cancels (arithmetic errors scale with it, not with the result),
    or |lse| / 16 when larger."""
    finite = torch.isfinite(ref_lse.detach())
    lse = torch.where(finite, ref_lse, torch.zeros_like(ref_lse))

    def through_lse(row_weights):  # sum_i w_i dlse_i / d(inputs)
        w = torch.where(finite, row_weights, torch.zeros_like(row_weights))
        return torch.autograd.grad(lse, inputs64, w, allow_unused=True, retain_graph=True)

    dO = grad_out.double()
    extra = through_lse((dO * (ref.detach() - out.detach().double())).sum(-1))
    # The D term alone (P * D): the size of what cancels, which arithmetic errors scale with.
    terms = through_lse((dO * ref.detach()).sum(-1))
    # The saved log-sum-exp is a float: its rounding moves each probability the backward
    # recomputes by ulp(|lse|), relatively; the floors hold for |lse| up to about 16.
    big = ref_lse.detach()[finite]
    lse_factor = max(1.0, big.abs().max().item() / 16) if big.numel() else 1.0
    return [None if w is None else (w if e is None else w + e,
                                    max(lse_factor, 0.0 if t is None or not t.numel() else t.abs().max().item()))
            for w, e, t in zip(want, extra, terms)]


def assert_gradient_close(a, w, rounded, name, *, dtype, floor, torch_out=None, factor=2.0):
    """a within the bound of the exact float64 gradient w (2x PyTorch's error + the floor when
    torch_out is given, else the floor), or else, when rounded = (gradient, scale) of
    rounded_output_gradients is given, within the floor x scale of the gradient the kernels'
    algorithm defines."""
    try:
        assert_close_to_truth(a, w, torch_out, dtype=dtype, factor=factor, floor=floor,
                              what=f"grad_{name}")
    except AssertionError:
        if rounded is None:
            raise
        w_r, scale = rounded
        assert_close_to_truth(a, w_r, dtype=dtype, floor=floor * max(1.0, scale),
                              what=f"grad_{name} (from the rounded output, floor x {scale:.3g})")


def check_gradients(pb, got, want, grad_out, inputs, want_rounded=None):
    """Gradients got (fused) against want (float64 reference): within 2x PyTorch's own error or
    the floor (test_sdpa_backward.py) when PyTorch computes the same, else a fixed floor; or
    against want_rounded (rounded_output_gradients), when given."""
    names = ["q", "k", "v", "sinks"]
    torch_grads = [None] * len(got)
    if pytorch_comparable(pb):
        try:
            t = [x.detach().requires_grad_() for x in inputs[:3]]
            torch_grads = list(torch.autograd.grad(torch_sdpa(pb, t), t, grad_out))
        except RuntimeError:
            pass
    rounded = want_rounded if want_rounded is not None else [None] * len(got)
    for name, a, w, t, x, r in zip(names, got, want, torch_grads, inputs, rounded):
        expect(a.shape == x.shape and a.dtype == x.dtype,
               f"grad_{name}: {describe(a)} for input {describe(x)}")
        if t is not None and torch.isfinite(t).all():
            factor, floor = grad_tolerance(x.dtype)
            assert_gradient_close(a, w, r, name, dtype=x.dtype, floor=floor, torch_out=t,
                                  factor=factor)
        else:
            floor = max(GRAD_FIXED_FACTOR * fixed_floor(pb, x.dtype), GRAD_FLOOR_CPU[x.dtype])
            assert_gradient_close(a, w, r, name, dtype=x.dtype, floor=floor)


def check_logsumexp(lse, want, dtype, what="logsumexp"):
    """The kernels' log-sum-exp (float32 for half inputs) against the truth: the same +inf
    (rows with nothing to attend to), finite values within the float32 floor."""
    expect(tuple(lse.shape) == tuple(want.shape), f"{what}: shape {tuple(lse.shape)} != {tuple(want.shape)}")
    lse, want = lse.detach().double(), want.detach().double()
    finite = torch.isfinite(want)
    expect(torch.equal(torch.isfinite(lse), finite), f"{what}: non-finite entries differ")
    if finite.any():
        tol = FIXED_TOL[torch.float64 if dtype == torch.float64 else torch.float32]
        err = (lse[finite] - want[finite]).abs().max().item()
        bound = 10 * tol * max(1.0, want[finite].abs().max().item())
        expect(err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}")


def same_meta_outputs(cpu, meta):
    """CPU and meta results: the same shapes, dtypes and strides (what torch.compile traces)."""
    cpu = cpu if isinstance(cpu, (tuple, list)) else (cpu,)
    meta = meta if isinstance(meta, (tuple, list)) else (meta,)
    expect(len(cpu) == len(meta), f"{len(cpu)} outputs on the CPU, {len(meta)} on meta")
    for n, (a, b) in enumerate(zip(cpu, meta)):
        if a is None or b is None:
            expect(a is None and b is None, f"output {n}: {describe(a)} on the CPU, {describe(b)} on meta")
            continue
        expect(b.device.type == "meta", f"output {n} is on {b.device}")
        expect(a.shape == b.shape and a.dtype == b.dtype,
               f"output {n}: {describe(a)} on the CPU, {describe(b)} on meta")
        # (the stride of a dim of size 1 is never used to find an element)
        used = lambda t: [st for st, size in zip(t.stride(), t.shape) if size > 1]  # noqa: E731
        if a.numel() > 1:
            expect(used(a) == used(b), f"output {n}: strides {a.stride()} on the CPU, "
                                       f"{b.stride()} on meta")


def same_values(a, b):
    """Equal, NaN where NaN."""
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


# What a case may raise and still be judged (pytest.fail's Failed is no Exception).
CAUGHT = (Exception, pytest.fail.Exception)


def judge(case):
    """None when the case behaves as it must, else why not (with the traceback)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = case.call()
    except CAUGHT as exc:
        if case.error is not None:
            why = raise_ok(exc, case.error)
            if why is None:
                return None
            return f"raised {type(exc).__name__}: {exc}\nwhich is not the error expected: {why}\n" + \
                traceback.format_exc()
        if case.may_raise is not None and case.may_raise(exc):
            return None
        return f"raised {type(exc).__name__}: {exc}\n" + traceback.format_exc()
    if case.error is not None:
        names = case.error.get("names")
        return (f"returned {describe(result if not isinstance(result, (tuple, list)) else result[0])}; "
                f"it must raise {'/'.join(t.__name__ for t in case.error['types'])}"
                + (f" naming {' or '.join(names)}" if names else ""))
    if case.check is not None:
        try:
            case.check(result)
        except CAUGHT as exc:
            return f"{type(exc).__name__}: {exc}\n" + traceback.format_exc()
    return None
