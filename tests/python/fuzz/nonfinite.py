"""The truth of a call with NaN/+-inf in q, k, v or a float mask (the "nonfinite" cases), and
the check of a result against it. Keys a row attends to give the float64 reference's exact
result: a NaN or +inf score makes the row NaN, a non-finite value of V reaches the columns it
is in. A key a row does not attend to (masked, outside the causal band or the window) may
still turn the row NaN, as in PyTorch, whose masks are additive (-inf + NaN = NaN,
0 * inf = NaN); what is never allowed is a finite value that differs from the truth, or a
finite value where the truth is NaN/inf. (A float mask's lowest value, read as hiding, has two
truths in a row whose visible keys all score -inf: its hidden keys averaged, as PyTorch's
additive mask does, or left out, as a band does.)"""

import copy
import math

import torch

from .case import expect
from .draw import INF, NAN
from .judge import fixed_floor, reference_of


def hides_as_neg_inf(pb):
    """Whether pb's float mask hides keys exactly as a bool one would: 0 and -inf, or 0 and its
    dtype's lowest value (not float16's) where every row sees a key and the call has no band
    of its own (docs/differences.md)."""
    mask = pb.mask
    hidden = (mask == 0) | (mask == -INF)
    own_band = pb.is_causal or pb.variants.get("window_left", -1) >= 0 or \
        pb.variants.get("window_right", -1) >= 0
    if (mask.dtype in (torch.float32, torch.bfloat16, torch.float64) and not own_band
            and bool((mask == 0).any(-1).all())):
        hidden |= mask == torch.finfo(mask.dtype).min
    return bool(hidden.all())


def check_nonfinite(pb, out, what="output"):
    """Where the inputs hold NaN/inf: every entry is the exact truth (keys a row does not attend
    to left out), or NaN where PyTorch's additive masking would give NaN too; never a finite
    value where the truth is not finite, nor a wrong finite value (see the module's docstring).
    A float mask's lowest value hides its keys to the bit only beside a visible key with a
    finite score: where an inf in q or k leaves a row none, PyTorch's additive mask averages
    the keys the lowest value hides, and the kernels do so too unless the host has read the
    mask as a band and key spans, which leave those keys out. Either is the truth there."""
    got = out.detach().double()
    truths = [nonfinite_truth(pb, lowest_hides=True)]
    if lowest_hides_keys(pb):
        truths.append(nonfinite_truth(pb, lowest_hides=False))
    for exact, _ in truths:
        expect(tuple(got.shape) == tuple(exact.shape),
               f"{what}: shape {tuple(got.shape)} != {tuple(exact.shape)}")
    failures = [nonfinite_mismatch(got, exact.expand(got.shape), leak.expand(got.shape),
                                   fixed_floor(pb, out.dtype)) for exact, leak in truths]
    # Rows that match no truth (one truth: any row that does not match it).
    rows_off = failures[0][0]
    for rows, _ in failures[1:]:
        rows_off = rows_off & rows
    expect(not rows_off.any(), f"{what}: {failures[0][1]}" if len(truths) == 1 else
           f"{what}: rows match neither truth (lowest value as hiding: {failures[0][1]}; "
           f"as a value: {failures[1][1]})")


def lowest_hides_keys(pb):
    """Whether pb's float mask holds its dtype's lowest value and hides_as_neg_inf reads it as
    hiding."""
    mask = pb.mask
    if mask is None or mask.dtype == torch.bool or not hides_as_neg_inf(pb):
        return False
    return mask.dtype != torch.float16 and bool((mask == torch.finfo(mask.dtype).min).any())


def nonfinite_truth(pb, lowest_hides=True):
    """(exact, leak) of check_nonfinite: the exact output (NaN or +-inf where the non-finite
    inputs reach it), and where NaN is allowed (masked keys with non-finite scores or values).
    lowest_hides: a float mask's lowest value hides its keys (as -inf does), else it is a value
    that PyTorch's additive mask adds."""
    q, k, v = pb.q.double(), pb.k.double(), pb.v.double()
    given_mask = pb.mask
    if pb.mask is not None and pb.mask.dtype != torch.bool and hides_as_neg_inf(pb) and (
            lowest_hides or not lowest_hides_keys(pb)):
        # A float mask of 0 and -inf (or lowest) hides keys as a bool mask does (the CPU host
        # may read it as a band and key spans, whose hidden keys are never read): the truth
        # leaves them out, and a NaN or inf they carry may still reach the row (leak, below).
        pb = copy.copy(pb)
        pb.mask = pb.mask == 0
    if pb.mask is not None and pb.mask.dtype != torch.bool:
        # Keys outside the causal band or the window are not attended to, whatever a float
        # mask holds there (the kernels never read it): the truth leaves them out.
        L, S = q.size(-2), k.size(-2)
        i, j = torch.arange(L).unsqueeze(-1), torch.arange(S)
        d = i + (S - L if pb.variants.get("bottom_right") else 0)
        right = 0 if pb.is_causal else pb.variants.get("window_right", -1)
        left = pb.variants.get("window_left", -1)
        band = torch.ones(L, S, dtype=torch.bool)
        if right >= 0:
            band &= j <= d + right
        if left >= 0:
            band &= j >= d - left
        pb = copy.copy(pb)
        pb.mask = torch.where(band, pb.mask, torch.zeros((), dtype=pb.mask.dtype))
    _, _, probs = reference_of(pb)  # NaN rows are NaN, masked keys 0
    if pb.gqa and q.dim() >= 3:
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
    attended = probs != 0  # NaN rows: every key counts
    vbad = ~torch.isfinite(v)
    # The exact truth: finite part from finite values, then the non-finite values of V that
    # attended keys bring (NaN, or +-inf; +inf and -inf together make NaN).
    exact = torch.nan_to_num(probs, nan=0.0) @ torch.where(vbad, 0.0, v)
    a = attended.double()
    pos = (a @ (v == INF).double()) > 0
    neg = (a @ (v == -INF).double()) > 0
    nan = (a @ torch.isnan(v).double()) > 0
    exact = torch.where(pos, INF, exact)
    exact = torch.where(neg, -INF, exact)
    exact = torch.where(nan | (pos & neg) | torch.isnan(probs).any(-1, keepdim=True), NAN, exact)
    # NaN allowed where masked keys carry non-finite scores or values (0 * inf, -inf + NaN).
    scale = 1 / math.sqrt(q.size(-1)) if pb.scale is None else pb.scale
    raw = (q @ k.transpose(-1, -2)) * scale
    unattended = ~attended
    leak_rows = (unattended & ~torch.isfinite(raw)).any(-1, keepdim=True)
    leak = ((unattended.double() @ vbad.double()) > 0) | leak_rows
    if given_mask is not None and given_mask.dtype != torch.bool:
        # NaN or +inf in the mask itself at a key the row does not attend to (a -inf there
        # with a non-finite score is leak_rows' case).
        m = given_mask.double()
        leak = leak | ((torch.isnan(m) | (m == INF)) & unattended).any(-1, keepdim=True)
    return exact, leak


def nonfinite_mismatch(got, exact, leak, floor):
    """(rows, why): the rows (all dims but the last) where got is not exact as check_nonfinite
    requires, and why, for the first kind of mismatch found ("" where none)."""
    finite = torch.isfinite(exact)
    bad = ~finite & (got != exact) & ~(torch.isnan(got) & torch.isnan(exact))
    # +-inf in V reaching a row through the online softmax's rescaling may come out NaN.
    bad &= ~(torch.isinf(exact) & torch.isnan(got))
    unexplained = finite & ~torch.isfinite(got) & ~(leak & torch.isnan(got))
    ok = finite & torch.isfinite(got)
    off = torch.zeros_like(ok)
    err = 0.0
    if ok.any():
        bound = 2 * floor * max(1.0, exact[ok].abs().max().item())
        off = ok & ((got - exact).abs() > bound)
        err = (got[ok] - exact[ok]).abs().max().item()
    why = ""
    if bad.any():
        why = f"{int(bad.sum())} entries should be NaN/inf and are not, first at {bad.nonzero()[:3].tolist()}"
    elif unexplained.any():
        why = (f"{int(unexplained.sum())} entries are NaN/inf where the truth is finite, first at "
               f"{unexplained.nonzero()[:3].tolist()}")
    elif off.any():
        why = f"finite entries off by {err:.3g} > {bound:.3g}"
    return (bad | unexplained | off).any(-1), why
