"""A function's signature rendered the way flash_attn's source writes it, for the tests that
hold fusedmha's FlashAttention API to flash_attn 2's names, order and defaults."""

import inspect


def signature_text(fn):
    """'(q, k, v, dropout_p=0.0, ..., *, sinks=None)': parameters with their defaults, and
    '*' before the keyword-only ones."""
    rendered, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            rendered.append("*")
            star = True
        rendered.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return "(" + ", ".join(rendered) + ")"
