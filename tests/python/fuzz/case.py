"""What a fuzz case is: the Case record (a call as a user makes it, and how its result is
judged), the entry points with the names their errors may carry, the errors a case may expect,
KNOWN_FAILURES, and how a case's tensors and arguments are described in its reproducer."""

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


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
    "flex_attention": ("fusedmha.flex_attention", "fusedmha.block_mask_dense"),
}


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
