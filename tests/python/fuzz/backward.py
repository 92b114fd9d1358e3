"""The cases of torch.ops.fusedmha.attention_backward, called directly on a forward's saved
state (output, log-sum-exp, rng_state): valid gradients against the float64 reference, meta,
and the broken calls that must raise."""

import torch

from .case import ENTRY_POINTS, Case, names_error
from .draw import DTYPES, draw_problem, meta_swap, randn, to_meta
from .judge import (
    check_gradients, check_mask_gradient, keep_mask, leaves64, reference_of,
    rounded_output_gradients, same_meta_outputs)
from .sdpa import forward_op_call


def gen_attention_backward(rng, g, kind, seed):
    """torch.ops.fusedmha.attention_backward called directly on a forward's saved state."""
    entry = "attention_backward"
    dtype = rng.choice(DTYPES)
    pb = draw_problem(rng, g, dtype, front_door=False, variants=kind != "wrong_shape")
    torch.manual_seed(seed)
    out, lse, rng_state = forward_op_call(pb)
    grad_out = randn(out.shape, dtype, g)
    glse = randn(lse.shape, lse.dtype, g) if rng.random() < 0.2 else None
    # A float mask's gradient too, for half of the valid calls that have one.
    grad_mask = (kind == "valid" and pb.mask is not None and pb.mask.is_floating_point()
                 and rng.random() < 0.5)

    def call(grad_out=grad_out, q=pb.q, k=pb.k, v=pb.v, out=out, lse=lse, rng_state=rng_state,
             mask=pb.mask, glse=glse, variants=pb.variants):
        return torch.ops.fusedmha.attention_backward(
            grad_out, q, k, v, out, lse, rng_state, mask, pb.dropout_p, pb.is_causal, pb.scale,
            pb.gqa, **variants, grad_logsumexp=glse, grad_attn_mask=grad_mask)

    if kind == "valid":
        def check(grads):
            keep = keep_mask(rng_state, pb) if pb.dropout_p > 0 else None
            sinks = pb.variants.get("sinks")
            inputs64 = leaves64(pb.q, pb.k, pb.v, *([sinks] if sinks is not None else []))
            mask64 = leaves64(pb.mask)[0] if grad_mask else None
            ref, ref_lse, _ = reference_of(pb, keep, inputs64, mask64)
            loss = (ref * grad_out.double()).sum()
            if glse is not None:  # the lse's gradient, where the lse is finite
                loss = loss + (torch.where(torch.isfinite(ref_lse), ref_lse, 0.0) * glse.double()).sum()
            wrt = inputs64[:3] + ([mask64] if grad_mask else [])
            want = torch.autograd.grad(loss, wrt, retain_graph=True)
            rounded = rounded_output_gradients(want, out, ref, ref_lse, grad_out, wrt)
            check_gradients(pb, grads[:3], want[:3], grad_out, [pb.q, pb.k, pb.v], rounded[:3])
            if grad_mask:
                check_mask_gradient(pb, grads[3], want[3], rounded[3])
        text = pb.text() + (" +grad_logsumexp" if glse is not None else "")
        return Case(entry, kind, text + (" +grad_attn_mask" if grad_mask else ""), call, check)
    if kind == "meta":
        return Case(entry, kind, pb.text(),
                    lambda: (call(), call(*(to_meta(t) for t in (grad_out, pb.q, pb.k, pb.v, out, lse, rng_state, pb.mask, glse)),
                                          variants=to_meta(pb.variants))),
                    check=lambda r: same_meta_outputs(*r))
    error = names_error(ENTRY_POINTS[entry])
    if kind == "wrong_device":
        args = [grad_out, pb.q, pb.k, pb.v, out, lse]
        swapped, i = meta_swap(args, rng)
        return Case(entry, kind, f"argument {i} on meta: {pb.text()}", lambda: call(*swapped), error=error)
    if kind == "wrong_dtype":
        what = rng.choice(["grad_out", "out", "lse", "rng_state", "q"])
        own = lse.dtype if what == "lse" else dtype  # (the lse is float32 for half inputs)
        other = rng.choice([d for d in DTYPES if d != own] + [torch.int32])
        bad = dict(grad_out=grad_out, q=pb.q, out=out, lse=lse, rng_state=rng_state)
        bad[what] = bad[what].to(other if what != "rng_state" else torch.int32)
        return Case(entry, kind, f"{what} as {bad[what].dtype}: {pb.text()}", lambda: call(**bad), error=error)
    what = rng.choice(["grad_out", "out", "lse", "rng_state", "glse"])
    bad = dict(grad_out=grad_out, out=out, lse=lse, rng_state=rng_state, glse=lse)
    shrink = {"rng_state": rng_state[:1]}
    t = bad[what]
    bad[what] = shrink.get(what, torch.cat([t, t], dim=-1) if t.dim() else t[None])
    return Case(entry, kind, f"{what} of shape {tuple(bad[what].shape)}: {pb.text()}",
                lambda: call(**bad), error=error)
