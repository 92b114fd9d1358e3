"""Which case is drawn: the weights of the entry points and of each one's kinds of case, the
generator of each (edges.py's for the kind "edge"), and draw_case, which draws everything of
case `index` of run `seed` from seed * CASE_STRIDE + index alone, so any case replays alone."""

import random

import torch

from . import edges
from .backward import gen_attention_backward
from .flash_attn import gen_flash_attn_func
from .flex import gen_flex
from .kvcache import gen_kvcache
from .mha import gen_mha
from .sdpa import gen_sdpa_like
from .varlen import gen_varlen


CASE_STRIDE = 1_000_003  # case `index` of run `seed` is seeded with seed * CASE_STRIDE + index
ENTRY_WEIGHTS = {"sdpa": 24, "attention_forward": 12, "attention_backward": 8,
                 "flash_attn_func": 13, "flash_attn_varlen_func": 14,
                 "flash_attn_with_kvcache": 13, "MultiheadAttention": 16,
                 "merge_attention": 2, "ring_attention": 2, "flex_attention": 8}
ERROR_KINDS = {"wrong_device": 4, "wrong_dtype": 4, "wrong_shape": 6}
KINDS = {  # kind -> weight, per entry point ("edge": edges.py)
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
    "flex_attention": dict(valid=40, broken=8, wrong_shape=8),
}


def gen_edge(entry):
    """The edge cases of an entry point (edges.py)."""
    def gen(rng, g, kind, seed):
        return edges.GENERATORS[entry](rng, g, seed)
    return gen


GENERATORS = {
    "sdpa": lambda rng, g, kind, seed: gen_sdpa_like("sdpa", rng, g, kind, seed),
    "attention_forward": lambda rng, g, kind, seed: gen_sdpa_like("attention_forward", rng, g, kind, seed),
    "attention_backward": gen_attention_backward,
    "flash_attn_func": gen_flash_attn_func,
    "flash_attn_varlen_func": gen_varlen,
    "flash_attn_with_kvcache": gen_kvcache,
    "MultiheadAttention": gen_mha,
    "flex_attention": gen_flex,
}


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
