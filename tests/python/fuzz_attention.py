"""A seeded fuzzer over fusedmha's entry points, checked against the float64 reference.

    python tests/python/fuzz_attention.py --calls 20000 --seed 0       # a long run
    python tests/python/fuzz_attention.py --seed 3 --only-case 1234    # replay one case

Each case is one call as a user makes it, to one of: fusedmha.scaled_dot_product_attention
(forward, and backward when the inputs require grad), fusedmha.flash_attn_func,
fusedmha.flash_attn_varlen_func, fusedmha.flash_attn_with_kvcache, fusedmha.MultiheadAttention,
and the ops torch.ops.fusedmha.attention_forward / attention_backward. Case `index` of run
`seed` draws everything (entry point, kind, shapes, values, the dropout seed) from
random.Random(seed * CASE_STRIDE + index), so any case replays alone with --only-case.

Kinds of case and what each must give (anything else is a failure, with a reproducer):

- valid: random shapes (0-2 batch dims, heads, GQA, L, S, E, Ev from 1 to a few blocks),
  dtypes, layouts (transposed, sliced, strided, expand()ed, overlapping as_strided, flipped),
  masks (bool, float, broadcast, fully masked rows), causal, dropout (checked against the
  kernels' own keep-mask), the variants; the result (and the gradients) within the test
  suite's tolerances of the float64 reference (reference.py).
- nonfinite: NaN/+-inf in q, k, v or a float mask. Keys a row attends to give the float64
  reference's exact result: a NaN or +inf score makes the row NaN (README), a non-finite value
  of V reaches the columns it is in. A key a row does not attend to (masked, outside the
  causal band or the window) may still turn the row NaN, as in PyTorch, whose masks are
  additive (-inf + NaN = NaN, 0 * inf = NaN); what is never allowed is a finite value that
  differs from the truth, or a finite value where the truth is NaN/inf. (A float mask's lowest
  value, read as hiding, has two truths in a row whose visible keys all score -inf: its hidden
  keys averaged, as PyTorch's additive mask does, or left out, as a band does.)
- empty: a dim of size 0 (batch, heads, L, S, E, Ev): PyTorch's F.scaled_dot_product_attention
  on the same inputs gives the shapes (or both raise).
- huge: cheap but extreme sizes (E = 4096 with L = S = 2, S = 100000 with L = 1, ...), within
  the tolerances.
- overflow: logical sizes past 2^31 elements held in stride-0 views (a mask, keys) or skipped by
  a window, so the work stays small; checked on slices against the reference.
- meta: every tensor on the meta device: the same shapes, dtypes and strides as on the CPU.
- wrong_device / wrong_dtype / wrong_shape: a tensor on the meta device among CPU tensors, an
  integer or mismatched dtype, an impossible shape: a RuntimeError/ValueError/TypeError whose
  message names the entry point called (or the op it hands the call to, as the error tests
  expect); for MultiheadAttention, the exception type nn.MultiheadAttention raises for the
  same call.
- overlap: flash_attn_with_kvcache's caches are written in place: a cache whose elements
  overlap (an expand()ed view), or k_cache and v_cache being one tensor, must raise.

Every case runs under a watchdog (faulthandler): a hang dumps the stacks and exits non-zero.
KNOWN_FAILURES lists classes of input that fail today for reasons in the C++ code, each with a
minimal reproducer; their cases still run, and are counted apart unless --strict.
"""

import argparse
import collections
import copy
import faulthandler
import math
import os
import random
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # reference.py and the other helpers of the test suite
    sys.path.insert(0, HERE)

import fusedmha  # noqa: E402
import mha_inputs  # noqa: E402
import test_mha_errors as mha_errors  # noqa: E402  (its fuzz calls and outcome comparison)
from reference import (  # noqa: E402
    GRAD_FLOOR_CPU, MHA_TOL, assert_close_to_truth, compare_runs, compare_with_reference,
    grad_tolerance, kernel_keep_mask, output_floor, reference_variants)
from test_kvcache import rotate  # noqa: E402  (rotary embedding, written independently)

CASE_STRIDE = 1_000_003  # case `index` of run `seed` is seeded with seed * CASE_STRIDE + index
CASE_TIMEOUT_S = 60.0  # a case that runs longer is a hang

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
NAN, INF = float("nan"), float("inf")

# Outputs without a PyTorch counterpart to take the error from (the variants, dropout): fixed
# floors, times max(1, |truth|). float64/float32/bfloat16 are test_variants.py's TOL (softcap in
# float64 is held to float32's, as there); float16 sits between float32 and bfloat16 as its
# output floor does (reference.ATOL_FLOOR).
FIXED_TOL = {torch.float64: 1e-10, torch.float32: 3e-5, torch.bfloat16: 3e-2, torch.float16: 6e-3}
GRAD_FIXED_FACTOR = 5  # gradients: 5x the output's (test_dropout.py)

# The entry points, and the names their errors may start with: their own, or the op they hand
# the call to (test_varlen.py and test_kvcache.py expect the op's name).
ENTRY_POINTS = {
    "sdpa": ("fusedmha.scaled_dot_product_attention",),
    "attention_forward": ("fusedmha.attention_forward",),
    "attention_backward": ("fusedmha.attention_backward",),
    "flash_attn_func": ("fusedmha.flash_attn_func", "fusedmha.attention_forward"),
    "flash_attn_varlen_func": ("fusedmha.flash_attn_varlen_func",
                               "fusedmha.varlen_attention_forward"),
    "flash_attn_with_kvcache": ("fusedmha.flash_attn_with_kvcache",
                                "fusedmha.attention_with_kvcache"),
    "MultiheadAttention": ("fusedmha.MultiheadAttention",),
    "merge_attention": ("fusedmha.merge_attention",),
    "ring_attention": ("fusedmha.distributed.ring_attention",),
}
ENTRY_WEIGHTS = {"sdpa": 24, "attention_forward": 12, "attention_backward": 8,
                 "flash_attn_func": 13, "flash_attn_varlen_func": 14,
                 "flash_attn_with_kvcache": 13, "MultiheadAttention": 16,
                 "merge_attention": 2, "ring_attention": 2}

# Inputs that fail today for reasons in the C++ code: tag -> minimal reproducer. A case tagged
# with one of these counts as "known" when it fails (a failure with --strict); once the code is
# fixed, the run reports the tag as passing: then remove it here.
KNOWN_FAILURES = {}


class Mismatch(AssertionError):
    """A result that is not what the case expects."""


def expect(cond, message):
    if not cond:
        raise Mismatch(message)


@dataclass
class Case:
    """One fuzzed call: `call` makes it as a user would; then `check` judges its result, or, when
    `error` is set, the call must raise (see raise_ok)."""
    entry: str
    kind: str
    what: str
    call: Callable[[], object]
    check: Optional[Callable[[object], None]] = None
    error: Optional[dict] = None  # names / types the exception must have; see raise_ok
    may_raise: Optional[Callable[[BaseException], bool]] = None  # an accepted error instead
    tags: set = field(default_factory=set)


# --------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------

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


def describe(t):
    if t is None:
        return "None"
    if not isinstance(t, torch.Tensor):
        return repr(t)
    text = f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}"
    if t.device.type != "cpu":
        text += f"@{t.device.type}"
    if not t.is_contiguous():
        text += f" strides {t.stride()}"
    return text


def kwargs_text(kw):
    return ", ".join(f"{k}={describe(v)}" for k, v in kw.items())


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


# --------------------------------------------------------------------------------------
# an attention problem in the (..., H, L, E) layout of SDPA and the ops
# --------------------------------------------------------------------------------------

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


def hides_as_neg_inf(pb):
    """Whether pb's float mask hides keys exactly as a bool one would: 0 and -inf, or 0 and its
    dtype's lowest value (not float16's) where every row sees a key and the call has no band
    of its own (README)."""
    mask = pb.mask
    hidden = (mask == 0) | (mask == -INF)
    own_band = pb.is_causal or pb.variants.get("window_left", -1) >= 0 or \
        pb.variants.get("window_right", -1) >= 0
    if (mask.dtype in (torch.float32, torch.bfloat16, torch.float64) and not own_band
            and bool((mask == 0).any(-1).all())):
        hidden |= mask == torch.finfo(mask.dtype).min
    return bool(hidden.all())


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


def keep_mask(rng_state, pb):
    """The keep-mask the kernels drew for this call (its rng_state), (*outer, L, S)."""
    q = pb.q.expand(outer_of(pb) + list(pb.q.shape[-2:]))
    return kernel_keep_mask(rng_state, q, pb.k, pb.dropout_p)


def leaves64(*tensors):
    return [None if t is None else t.detach().double().requires_grad_() for t in tensors]


def reference_of(pb, keep=None, grad_inputs=None):
    """The float64 truth (output, lse, probs) of a problem; grad_inputs: float64 leaves of
    q, k, v (and sinks) to differentiate, or None."""
    q, k, v = grad_inputs[:3] if grad_inputs else (pb.q.double(), pb.k.double(), pb.v.double())
    variants = dict(pb.variants)
    if grad_inputs and len(grad_inputs) > 3:
        variants["sinks"] = grad_inputs[3]
    return reference_variants(q, k, v, pb.mask, pb.is_causal, pb.scale, pb.gqa, keep,
                              pb.dropout_p, **variants)


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


# --------------------------------------------------------------------------------------
# expected errors
# --------------------------------------------------------------------------------------

ERROR_TYPES = (RuntimeError, ValueError, TypeError)


def names_error(names):
    return dict(names=names, types=ERROR_TYPES)


def raise_ok(exc, error):
    """None when exception exc is what `error` asks for, else why not."""
    if not isinstance(exc, error["types"]):
        return f"{type(exc).__name__} is not one of {[t.__name__ for t in error['types']]}"
    names = error.get("names")
    if names and not any(n + ":" in str(exc) for n in names):
        return f"the message does not name {' or '.join(names)}"
    return None


def meta_swap(tensors, rng):
    """One of the tensors moved to the meta device."""
    i = rng.randrange(len(tensors))
    tensors = list(tensors)
    tensors[i] = tensors[i].to("meta")
    return tensors, i


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


def to_meta(x):
    if isinstance(x, torch.Tensor):  # with x's strides (x.to("meta") lays out expand()ed views anew)
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, dict):
        return {k: to_meta(v) for k, v in x.items()}
    return x


# --------------------------------------------------------------------------------------
# scaled_dot_product_attention, attention_forward, attention_backward
# --------------------------------------------------------------------------------------

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


def gen_attention_backward(rng, g, kind, seed):
    """torch.ops.fusedmha.attention_backward called directly on a forward's saved state."""
    entry = "attention_backward"
    dtype = rng.choice(DTYPES)
    pb = draw_problem(rng, g, dtype, front_door=False, variants=kind != "wrong_shape")
    torch.manual_seed(seed)
    out, lse, rng_state = forward_op_call(pb)
    grad_out = randn(out.shape, dtype, g)
    glse = randn(lse.shape, lse.dtype, g) if rng.random() < 0.2 else None

    def call(grad_out=grad_out, q=pb.q, k=pb.k, v=pb.v, out=out, lse=lse, rng_state=rng_state,
             mask=pb.mask, glse=glse, variants=pb.variants):
        return torch.ops.fusedmha.attention_backward(
            grad_out, q, k, v, out, lse, rng_state, mask, pb.dropout_p, pb.is_causal, pb.scale,
            pb.gqa, **variants, grad_logsumexp=glse)

    if kind == "valid":
        def check(grads):
            keep = keep_mask(rng_state, pb) if pb.dropout_p > 0 else None
            sinks = pb.variants.get("sinks")
            inputs64 = leaves64(pb.q, pb.k, pb.v, *([sinks] if sinks is not None else []))
            ref, ref_lse, _ = reference_of(pb, keep, inputs64)
            loss = (ref * grad_out.double()).sum()
            if glse is not None:  # the lse's gradient, where the lse is finite
                loss = loss + (torch.where(torch.isfinite(ref_lse), ref_lse, 0.0) * glse.double()).sum()
            want = torch.autograd.grad(loss, inputs64[:3], retain_graph=True)
            rounded = rounded_output_gradients(want, out, ref, ref_lse, grad_out, inputs64[:3])
            check_gradients(pb, grads, want, grad_out, [pb.q, pb.k, pb.v], rounded)
        return Case(entry, kind, pb.text() + (" +grad_logsumexp" if glse is not None else ""),
                    call, check)
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


# --------------------------------------------------------------------------------------
# flash_attn_func: (B, L, H, E), bottom-right causal and windows
# --------------------------------------------------------------------------------------

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


def leaves_with_sinks(tensors, kw):
    """Fresh leaves of q, k, v, and of kw's sinks when there are any, to differentiate."""
    leaves = [t.detach().requires_grad_() for t in tensors]
    if kw.get("sinks") is not None:
        leaves.append(kw["sinks"].detach().requires_grad_())
    return leaves


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


# --------------------------------------------------------------------------------------
# flash_attn_varlen_func: packed sequences
# --------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------
# flash_attn_with_kvcache: new keys and values appended to the caches in place, then attention
# over the cache (rotary embedding, a paged cache, cache_batch_idx, cache_leftpad, GQA, the
# variants)
# --------------------------------------------------------------------------------------

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


def same_values(a, b):
    """Equal, NaN where NaN."""
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


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


# --------------------------------------------------------------------------------------
# MultiheadAttention: against torch.nn.MultiheadAttention with the same state_dict
# --------------------------------------------------------------------------------------

MHA_DTYPES = [torch.float32, torch.float32, torch.float64, torch.bfloat16, torch.float16]
MHA_LENGTHS = [1, 1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 33]
# test_mha_errors.fuzz_build's perturbations, by the kind of case they make
MHA_PERTURBATIONS = {
    "wrong_shape": ["q_dim-", "q_dim+", "k_dim-", "v_dim+", "q_E", "k_E", "v_E", "k_S", "v_S", "q_N",
                    "k_N", "v_N", "kpm_S", "kpm_N", "kpm_dim-", "kpm_dim+", "am_L", "am_S",
                    "am_3d_N", "am_1d", "am_4d"],
    "wrong_dtype": ["q_f64", "k_f64", "q_int", "q_bf16", "kpm_int", "kpm_u8", "kpm_f64", "kpm_f16",
                    "am_int", "am_f64", "am_f16"],
    "empty": ["L0", "S0", "N0"],
    "nonfinite": ["nan", "inf", "huge"],
}
MHA_EXTRA_PERTURBATIONS = ["none", "none", "noncontig", "expanded", "causal", "am_expand", "L1S1"]


@dataclass
class MHACall:
    """A fused module and PyTorch's with the same state_dict, and one call to both."""
    ctor: dict
    ref: nn.Module
    mod: nn.Module
    inputs: tuple  # query, key, value (the same tensor object where the call shares them)
    f_kw: dict
    r_kw: dict  # PyTorch's masks: the causal mask given explicitly where fusedmha has is_causal
    masks: str
    dtype: torch.dtype

    def text(self):
        q, k, v = self.inputs
        same = "q=k=v " if q is k and k is v else "k=v " if k is v else ""
        return (f"MultiheadAttention({kwargs_text(self.ctor)}) {'train' if self.mod.training else 'eval'} "
                f"{same}query={describe(q)} key={describe(k)} value={describe(v)} masks={self.masks} "
                f"{kwargs_text(self.f_kw)}")


def draw_mha(rng, g, dtype, *, dropout=0.0, layouts=True, fully_masked=False):
    while True:
        H = rng.choice([1, 1, 2, 3, 4, 8])
        E = H * rng.choice([1, 2, 4, 8, 12, 16])
        N, L, S = rng.randint(1, 4), rng.choice(MHA_LENGTHS), rng.choice(MHA_LENGTHS)
        if N * H * L * S * E <= 60_000:
            break
    kd = vd = E
    ctor = dict(bias=rng.random() < 0.8, add_bias_kv=rng.random() < 0.2,
                add_zero_attn=rng.random() < 0.2, batch_first=rng.random() < 0.5, dropout=dropout)
    if rng.random() < 0.3:
        kd, vd = rng.choice([1, 3, E, E + 5]), rng.choice([2, E, E + 3])
        ctor.update(kdim=kd, vdim=vd)
    batched = rng.random() < 0.85
    ref, mod = mha_inputs.make_pair(E, H, dtype=dtype, **ctor)
    train = dropout > 0 or rng.random() < 0.3  # training with p = 0: PyTorch's slow path
    ref.train(train)
    mod.train(train)
    kind = rng.choice(mha_inputs.MASK_KINDS)
    f_kw, r_kw = mha_inputs.make_masks(kind, N, H, L, S, dtype, batched)
    if fully_masked:  # masks of our own, where some query rows see no key at all
        kind = "fully_masked"
        f_kw = {}
        if rng.random() < 0.6:
            kpm = torch.rand((N, S) if batched else (S,), generator=g) < 0.4
            kpm[..., 0] = rng.random() < 0.5
            f_kw["key_padding_mask"] = kpm
        am = torch.rand((L, S) if rng.random() < 0.5 else ((N if batched else 1) * H, L, S), generator=g) < 0.5
        am[..., rng.randrange(L), :] = True
        f_kw["attn_mask"] = am if rng.random() < 0.6 else torch.zeros(am.shape, dtype=dtype).masked_fill(am, -INF)
        r_kw = dict(f_kw)
    weights = rng.choice([dict(need_weights=False), dict(), dict(average_attn_weights=False)])
    f_kw.update(weights)
    r_kw.update(weights)
    x = mha_inputs.make_inputs(N, L, S, E, kd, vd, dtype, batched, ctor["batch_first"])
    pattern = rng.choice(["distinct"] * 3 + ["k=v", "q=k=v"])
    if layouts and rng.random() < 0.3:  # the same values through other strides
        x = tuple(t.transpose(0, -1).contiguous().transpose(0, -1) if rng.random() < 0.5 else t for t in x)
    if pattern == "q=k=v" and L == S and kd == vd == E:
        x = (x[0], x[0], x[0])
    elif pattern in ("k=v", "q=k=v") and kd == vd:
        x = (x[0], x[1], x[1])
    return MHACall(ctor, ref, mod, x, f_kw, r_kw, kind, dtype)


def shared_leaves(inputs):
    """Leaves for the inputs, one per distinct tensor (shared as the call shares them)."""
    made = {}
    return tuple(made.setdefault(id(t), t.detach().clone().requires_grad_()) for t in inputs)


def mha_same_outcome(spec):
    """test_mha_errors.py's fuzz case `spec` (both modules, the outcome compared); the fused
    module's exception, if it raised."""
    ctor, args, kw = mha_errors.fuzz_build(spec)
    ref, mod = mha_errors.make_pair(mha_errors.E, mha_errors.H, **ctor)
    mod.train(spec["training"])
    ref.train(spec["training"])
    if mha_errors.known_difference(spec, kw):  # is_causal without a mask: the test's own rule
        mha_errors.test_fuzz_like_pytorch(spec)
        try:
            mod(*args, **kw)
        except Exception as e:  # noqa: BLE001
            return e
        return None
    _, exc = mha_errors.torch_outcome(lambda: ref(*args, **kw))
    masks = [kw.get(n) for n in ("attn_mask", "key_padding_mask")]
    if exc is None and any(m is not None and m.is_floating_point() and m.dtype != args[0].dtype
                           and torch.promote_types(m.dtype, args[0].dtype) == m.dtype for m in masks):
        # A float mask of higher precision than the query: an error (README), where PyTorch
        # takes it on some paths (and refuses it on others)
        try:
            mod(*args, **kw)
        except RuntimeError as e:
            expect("or lower precision" in str(e), f"not the mask precision error: {e}")
            return e
        raise Mismatch("a float mask of higher precision than the query was taken")
    # NaN/inf inputs: PyTorch's fused CPU kernel may return finite values where the exact
    # result is NaN (README); huge ones (q x 1e30) make scores whose rounding alone (1e23)
    # flips the softmax, so no two implementations agree. Only the outcome and shapes are
    # compared; the sdpa and op cases check non-finite values against the float64 reference.
    nonfinite = any(p in ("nan", "inf", "huge") for p in spec["perturb"])
    return mha_errors.assert_same_outcome(ref, mod, args, kw,
                                          compare_values=not (mha_errors.wrong_hint(kw) or nonfinite))


def names_the_module(exc, required):
    """The message of a fused module's error names the module (when `required`), and never
    another entry point."""
    if exc is None:
        return
    text = str(exc)
    named = [n for n in ("fusedmha.attention_forward", "fusedmha.scaled_dot_product_attention",
                         "fusedmha._multihead_attention_core", "fusedmha.attention_backward")
             if n + ":" in text]
    if named:
        raise Mismatch(f"the error names {named[0]}, not fusedmha.MultiheadAttention: {text}")
    if required:
        expect("fusedmha.MultiheadAttention:" in text,
               f"the error does not name fusedmha.MultiheadAttention: {type(exc).__name__}({text})")


def gen_mha(rng, g, kind, seed):
    entry = "MultiheadAttention"
    dtype = rng.choice(MHA_DTYPES)

    if kind == "valid":
        fully_masked = dtype in MHA_TOL["cpu"] and rng.random() < 0.15
        c = draw_mha(rng, g, dtype, fully_masked=fully_masked)
        grads = rng.random() < 0.6

        def run():
            if fully_masked:  # PyTorch gives NaN there: the float64 reference instead
                return compare_with_reference(c.mod, c.inputs, c.f_kw, name=c.masks, tol=MHA_TOL["cpu"][dtype])
            f_in, r_in = shared_leaves(c.inputs), shared_leaves(c.inputs)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compare_runs(c.mod, c.ref, f_in, r_in, c.f_kw, c.r_kw, dtype, grads=grads)
        return Case(entry, kind, c.text() + (" +backward" if grads else ""), run)

    if kind == "train":  # dropout: shapes, finite, and the same result for the same seed
        c = draw_mha(rng, g, dtype, dropout=rng.choice([0.1, 0.5, 0.9]))

        def run():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                want = c.ref(*c.inputs, **c.r_kw)
                results = []
                for _ in range(2):
                    torch.manual_seed(seed)
                    f_in = shared_leaves(c.inputs)
                    out, w = c.mod(*f_in, **c.f_kw)
                    grads = torch.autograd.grad(out.float().sum() + (0 if w is None else w.float().sum()),
                                                list(dict.fromkeys(f_in)) + list(c.mod.parameters()),
                                                allow_unused=True)
                    results.append((out, w, grads))
            return want, results

        def check(r):
            (out_r, w_r), ((out, w, grads), (out2, w2, grads2)) = r
            expect(out.shape == out_r.shape and out.dtype == out_r.dtype,
                   f"output {describe(out)}, PyTorch's {describe(out_r)}")
            expect((w is None) == (w_r is None), "weights returned by one module only")
            if w is not None:
                expect(w.shape == w_r.shape and w.dtype == w_r.dtype, f"weights {describe(w)}, PyTorch's {describe(w_r)}")
                expect(same_values(w, w2), "weights differ for the same seed")
                expect(bool(torch.isfinite(w).all()), "weights not finite")
            expect(bool(torch.isfinite(out).all()), "output not finite")
            expect(same_values(out, out2), "output differs for the same seed")
            for a, b in zip(grads, grads2):
                expect((a is None) == (b is None) and (a is None or same_values(a, b)),
                       "gradients differ for the same seed")
                expect(a is None or bool(torch.isfinite(a).all()), "gradient not finite")
        return Case(entry, kind, c.text() + f" seed {seed}", run, check)

    if kind == "meta":  # the module and its inputs on the meta device
        c = draw_mha(rng, g, dtype, layouts=False)
        c.mod.eval()
        meta = copy.deepcopy(c.mod).to("meta")

        def run():
            with torch.no_grad():
                made = {}
                inputs = [made.setdefault(id(t), to_meta(t)) for t in c.inputs]
                return c.mod(*c.inputs, **c.f_kw), meta(*inputs, **to_meta(c.f_kw))
        return Case(entry, kind, c.text(), run, check=lambda r: same_meta_outputs(*r))

    if kind == "wrong_device":
        c = draw_mha(rng, g, dtype, layouts=False)
        options = ["query", "key", "value"] + [n for n in ("attn_mask", "key_padding_mask") if n in c.f_kw]
        what = rng.choice(options)
        inputs = list(c.inputs)
        f_kw, r_kw = dict(c.f_kw), dict(c.r_kw)
        if what in f_kw:
            f_kw[what] = f_kw[what].to("meta")  # PyTorch takes it; fusedmha must refuse, named
            error = dict(names=ENTRY_POINTS[entry], types=(RuntimeError,))
            return Case(entry, kind, f"{what} on meta: {c.text()}", lambda: c.mod(*inputs, **f_kw),
                        error=error, tags={"mha_error_names_attention_forward"})
        i = ["query", "key", "value"].index(what)
        inputs = [t.to("meta") if t is inputs[i] else t for t in inputs]

        def run():  # the exception PyTorch raises
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    c.ref(*inputs, **r_kw)
                except Exception as e:  # noqa: BLE001
                    want = e
                else:  # PyTorch accepts it: fusedmha may too, or refuse in its own name
                    try:
                        c.mod(*inputs, **f_kw)
                    except Exception as e:  # noqa: BLE001
                        names_the_module(e, True)
                    return None
                try:
                    c.mod(*inputs, **f_kw)
                except type(want) as e:
                    return e
                except Exception as e:  # noqa: BLE001
                    raise Mismatch(f"PyTorch raises {type(want).__name__}({want}); fused raises "
                                   f"{type(e).__name__}({e})") from e
                raise Mismatch(f"PyTorch raises {type(want).__name__}({want}); fused raises nothing")
        return Case(entry, kind, f"{what} on meta: {c.text()}", run,
                    check=lambda e: names_the_module(e, False))

    # wrong_shape, wrong_dtype, empty, nonfinite: test_mha_errors.py's fuzz call, perturbed
    perturb = {rng.choice(MHA_PERTURBATIONS[kind])}
    if rng.random() < 0.5:
        perturb.add(rng.choice(MHA_EXTRA_PERTURBATIONS))
    spec = dict(batched=rng.random() < 0.8, batch_first=rng.random() < 0.5, kvdiff=rng.random() < 0.3,
                add_bias_kv=rng.random() < 0.25, add_zero_attn=rng.random() < 0.25, bias=rng.random() < 0.8,
                need_weights=rng.random() < 0.6, average=rng.random() < 0.6, training=rng.random() < 0.5,
                kpm=rng.choice([None, None, "bool", "float"]),
                am=rng.choice([None, None, "2d_bool", "2d_float", "3d_bool", "3d_float"]),
                perturb=sorted(perturb), seed=seed % 2 ** 31)
    return Case(entry, kind, f"test_mha_errors.fuzz_build({spec})", lambda: mha_same_outcome(spec),
                check=lambda e: names_the_module(e, False))


# --------------------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------------------

ERROR_KINDS = {"wrong_device": 4, "wrong_dtype": 4, "wrong_shape": 6}
KINDS = {  # kind -> weight, per entry point ("edge": fuzz_edges.py)
    "sdpa": dict(valid=40, nonfinite=8, empty=5, edge=44, huge=2, overflow=1, meta=5, **ERROR_KINDS),
    "attention_forward": dict(valid=40, nonfinite=8, empty=5, edge=44, huge=2, overflow=1, meta=5,
                              **ERROR_KINDS),
    "attention_backward": dict(valid=40, edge=30, meta=5, **ERROR_KINDS),
    "flash_attn_func": dict(valid=40, nonfinite=8, empty=5, edge=10, huge=2, meta=5, **ERROR_KINDS),
    "flash_attn_varlen_func": dict(valid=40, nonfinite=8, empty=5, edge=8, meta=5, **ERROR_KINDS),
    "flash_attn_with_kvcache": dict(valid=40, nonfinite=8, empty=5, edge=8, meta=5, overlap=6,
                                    **ERROR_KINDS),
    "MultiheadAttention": dict(valid=40, train=8, nonfinite=6, empty=4, edge=30, meta=4,
                               wrong_device=3, wrong_dtype=5, wrong_shape=8),
    "merge_attention": dict(edge=1),
    "ring_attention": dict(edge=1),
}


def gen_edge(entry):
    """The edge cases of an entry point (fuzz_edges.py, imported when first drawn: it builds on
    this module)."""
    def gen(rng, g, kind, seed):
        import fuzz_edges
        return fuzz_edges.GENERATORS[entry](rng, g, seed)
    return gen


GENERATORS = {
    "sdpa": lambda rng, g, kind, seed: gen_sdpa_like("sdpa", rng, g, kind, seed),
    "attention_forward": lambda rng, g, kind, seed: gen_sdpa_like("attention_forward", rng, g, kind, seed),
    "attention_backward": gen_attention_backward,
    "flash_attn_func": gen_flash_attn_func,
    "flash_attn_varlen_func": gen_varlen,
    "flash_attn_with_kvcache": gen_kvcache,
    "MultiheadAttention": gen_mha,
}
OUTCOMES = ("pass", "known", "fail", "crash")


def weighted(rng, weights):
    names = sorted(weights)
    return rng.choices(names, [weights[n] for n in names])[0]


def draw_case(seed, index):
    """Case `index` of run `seed`: everything drawn from seed * CASE_STRIDE + index alone."""
    case_seed = seed * CASE_STRIDE + index
    rng = random.Random(case_seed)
    entry = weighted(rng, ENTRY_WEIGHTS)
    kind = weighted(rng, KINDS[entry])
    torch.manual_seed(case_seed)  # what draws from PyTorch's global generator (module init)
    g = torch.Generator().manual_seed(case_seed)
    generate = gen_edge(entry) if kind == "edge" else GENERATORS[entry]
    return entry, kind, lambda: generate(rng, g, kind, case_seed)


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


class Counts(collections.Counter):
    """(entry, kind, outcome) -> cases; with the failure reports (`reports`, known ones in
    `known_reports`), the KNOWN_FAILURES tags the run exercised and those that failed, the case
    descriptions by index, and the run's duration."""

    def __init__(self):
        super().__init__()
        self.reports, self.known_reports = [], []
        self.tags_seen, self.tags_failed = set(), set()
        self.described = {}
        self.tagged = collections.Counter()  # cases per tag: "edge", "empty", "mask"
        self.calls = 0
        self.seconds = 0.0

    def failures(self, strict=False):
        return sum(n for (_, _, o), n in self.items()
                   if o in ("fail", "crash") or strict and o == "known")

    def __reduce__(self):  # (Counter's pickles the counts alone: the workers send all of it)
        return _counts_from, (dict(self), self.__dict__)

    def crashes(self):
        return sum(n for (_, _, o), n in self.items() if o == "crash")

    def merge(self, other):
        self.update(other)
        self.reports += other.reports
        self.known_reports += other.known_reports
        self.tags_seen |= other.tags_seen
        self.tags_failed |= other.tags_failed
        self.described.update(other.described)
        self.tagged.update(other.tagged)
        self.calls += other.calls
        self.seconds += other.seconds


def _counts_from(items, attributes):
    counts = Counts()
    counts.update(items)
    counts.__dict__.update(attributes)
    return counts


def reproducer(seed, index, entry, kind, what, tags, why):
    lines = [f"=== FAIL seed {seed} case {index}: {entry} / {kind}" +
             (f" (known: {', '.join(sorted(tags))})" if tags else ""),
             f"case: {what}", why.rstrip(),
             f"replay: python tests/python/fuzz_attention.py --seed {seed} --only-case {index}"]
    return "\n".join(lines)


def run(calls, seed, only_case=None, strict=False, time_budget=None, quiet=False, out=sys.stdout):
    """Run cases 0 .. calls-1 of `seed` (or only case `only_case`), each under the watchdog;
    returns a Counts. Stops early after `time_budget` seconds. Prints each failure's reproducer
    (known ones too with strict), unless quiet."""
    counts = Counts()
    indices = [only_case] if only_case is not None else range(calls)
    start = time.perf_counter()
    for index in indices:
        if time_budget is not None and time.perf_counter() - start > time_budget:
            break
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
        try:
            entry, kind, make_case = draw_case(seed, index)
            what, tags = "(the case could not be drawn)", set()
            try:
                case = make_case()
                what, tags = case.what, set(case.tags)
                why = judge(case)
            except Exception as exc:  # noqa: BLE001  (drawing the case failed)
                why = f"drawing the case raised {type(exc).__name__}: {exc}\n" + traceback.format_exc()
        finally:
            faulthandler.cancel_dump_traceback_later()
        counts.calls += 1
        counts.described[index] = f"{entry} / {kind}: {what}"
        counts.tagged.update(tags & {"edge", "empty", "mask", "empty+mask"})
        known = tags & set(KNOWN_FAILURES)
        counts.tags_seen |= known
        if why is None:
            outcome = "pass"
        else:
            outcome = "known" if known else "fail"
            counts.tags_failed |= known
            text = reproducer(seed, index, entry, kind, what, known, why)
            (counts.known_reports if known else counts.reports).append(text)
            if not quiet and (outcome == "fail" or strict):
                print(text, file=out, flush=True)
        counts[entry, kind, outcome] += 1
        if only_case is not None and not quiet:
            print(f"case {index}: {counts.described[index]}\n-> {outcome}", file=out)
    counts.seconds = time.perf_counter() - start
    return counts


# --------------------------------------------------------------------------------------
# runs in worker processes: a case that kills its process does not end the run
# --------------------------------------------------------------------------------------

def crash_report(seed, index, returncode, stderr_tail):
    what = f"killed by signal {-returncode}" if returncode < 0 else f"exited with {returncode}"
    entry, kind, make_case = draw_case(seed, index)
    try:
        described = make_case().what
    except Exception as exc:  # noqa: BLE001
        described = f"(could not be drawn again: {exc})"
    return entry, kind, described, (f"=== CRASH seed {seed} case {index}: {entry} / {kind}\n"
                                    f"case: {described}\nthe process was {what}; its last words:\n"
                                    f"{stderr_tail.rstrip()}\n"
                                    f"replay: python tests/python/fuzz_attention.py --seed {seed} "
                                    f"--only-case {index}")


def run_isolated(calls, seed, strict=False, quiet=False, threads=None, out=sys.stdout):
    """run() over cases 0 .. calls-1 in a worker process; where a case kills the worker (a
    signal, an abort, the hang watchdog), it is counted as a crash with its reproducer, and a
    new worker goes on from the next case. Returns the Counts of all the cases."""
    import pickle
    import subprocess
    import tempfile
    counts = Counts()
    start = 0
    with tempfile.TemporaryDirectory() as tmp:
        progress, results, errors = (os.path.join(tmp, n) for n in ("progress", "results", "stderr"))
        while start < calls:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", progress, results,
                   "--seed", str(seed), "--first", str(start), "--calls", str(calls)]
            cmd += (["--strict"] if strict else []) + (["--quiet"] if quiet else [])
            cmd += ["--threads", str(threads)] if threads else []
            with open(errors, "w") as err:
                proc = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else None, stderr=err)
            with open(results, "rb") as f:  # each judged case's Counts (a torn last one: lost)
                while True:
                    try:
                        counts.merge(pickle.load(f))
                    except (EOFError, pickle.UnpicklingError):
                        break
            with open(progress) as f:
                started = [int(line) for line in f.read().split()]
            if proc.returncode == 0 and started and started[-1] == calls - 1:
                break
            index = started[-1] if started else start
            with open(errors) as f:
                tail = "\n".join(f.read().splitlines()[-25:])
            entry, kind, described, text = crash_report(seed, index, proc.returncode, tail)
            counts[entry, kind, "crash"] += 1
            counts.calls += 1
            counts.described[index] = f"{entry} / {kind}: {described}"
            counts.reports.append(text)
            if not quiet:
                print(text, file=out, flush=True)
            start = index + 1
    return counts


def worker(progress, results, calls, seed, first, strict, quiet):
    """The worker side of run_isolated: writes each case's index to `progress` before it runs
    it (the case that was running when the process died is the last one there), and appends
    each judged case's Counts, pickled, to `results`."""
    import pickle
    import signal
    faulthandler.enable()  # a fatal signal prints the Python stack to stderr: the report's tail
    # (test_fuzz.py checks that a crash is reported and the run goes on: this case dies.)
    kill = os.environ.get("FUSEDMHA_FUZZ_KILL_CASE")
    with open(progress, "w") as marks, open(results, "wb") as judged:
        for index in range(first, calls):
            marks.write(f"{index}\n")
            marks.flush()
            if kill is not None and index == int(kill):
                os.kill(os.getpid(), signal.SIGFPE)
            counts = run(calls, seed, only_case=index, strict=strict, quiet=True)
            if not quiet:
                for text in counts.reports + (counts.known_reports if strict else []):
                    print(text, flush=True)
            pickle.dump(counts, judged)
            judged.flush()


def shares(counts):
    """The share of the calls that are edge cases, that have an empty dim, and an empty dim
    beside a mask."""
    n = max(counts.calls, 1)
    return {tag: counts.tagged[tag] / n for tag in ("edge", "empty", "empty+mask")}


def summary(counts, out=sys.stdout):
    """The table per entry point x kind, calls/s, and the state of KNOWN_FAILURES."""
    rows = sorted({(e, k) for e, k, _ in counts})
    print(f"{'entry point':<26}{'kind':<14}" + "".join(f"{o:>7}" for o in OUTCOMES), file=out)
    for e, k in rows:
        print(f"{e:<26}{k:<14}" + "".join(f"{counts[e, k, o]:>7}" for o in OUTCOMES), file=out)
    totals = [sum(n for (_, _, o), n in counts.items() if o == oc) for oc in OUTCOMES]
    print(f"{'total':<40}" + "".join(f"{n:>7}" for n in totals), file=out)
    rate = counts.calls / counts.seconds if counts.seconds else 0.0
    print(f"{counts.calls} calls in {counts.seconds:.1f} s: {rate:.1f} calls/s", file=out)
    print("shares of the calls: " + ", ".join(f"{t} {100 * x:.1f}%" for t, x in shares(counts).items()),
          file=out)
    for tag in sorted(counts.tags_seen - counts.tags_failed):
        print(f"now passing: remove from KNOWN_FAILURES: {tag}", file=out)
    for tag in sorted(counts.tags_failed):
        print(f"still failing (known): {tag}", file=out)
    unseen = sorted(set(KNOWN_FAILURES) - counts.tags_seen)
    if unseen:
        print(f"not exercised in this run: {', '.join(unseen)}", file=out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="cases to run (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (default 0)")
    parser.add_argument("--only-case", type=int, default=None, help="replay this case index only")
    parser.add_argument("--strict", action="store_true", help="known failures fail the run too")
    parser.add_argument("--quiet", action="store_true", help="no reproducers, no table: a one-line result")
    parser.add_argument("--in-process", action="store_true",
                        help="run the cases in this process (a crash then ends the run)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument("--worker", nargs=2, metavar=("PROGRESS", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        worker(*args.worker, args.calls, args.seed, args.first, args.strict, args.quiet)
        return 0
    if args.only_case is not None or args.in_process:
        counts = run(args.calls, args.seed, only_case=args.only_case, strict=args.strict,
                     quiet=args.quiet)
    else:
        counts = run_isolated(args.calls, args.seed, strict=args.strict, quiet=args.quiet,
                              threads=args.threads)
    if args.quiet:
        totals = {o: sum(n for (_, _, oc), n in counts.items() if oc == o) for o in OUTCOMES}
        print(f"seed {args.seed}: {counts.calls} calls, " + ", ".join(f"{n} {o}" for o, n in totals.items())
              + "; " + ", ".join(f"{t} {100 * x:.1f}%" for t, x in shares(counts).items()))
        for text in counts.reports:  # (crashes and failures: each with its replay line)
            print(text)
    else:
        summary(counts)
    return 1 if counts.failures(args.strict) else 0


if __name__ == "__main__":
    # Run as the module fuzz_attention, not as __main__: fuzz_edges.py imports it by that name,
    # and the Counts a worker pickles name their class by it.
    import fuzz_attention
    sys.exit(fuzz_attention.main())
