"""Every compiled ISA level, forced with FUSEDMHA_CPU_ISA, gives the same results; a level
the CPU lacks is refused with a clear error instead of crashing."""

import os

import pytest
import torch

import fusedmha
from reference import assert_attention_close

NEEDS = {"default": set(), "avx2": {"avx2", "fma", "f16c"},
         "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"}}


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.fixture
def force_isa():
    old = os.environ.get("FUSEDMHA_CPU_ISA")

    def force(level):
        os.environ["FUSEDMHA_CPU_ISA"] = level

    yield force
    if old is None:
        os.environ.pop("FUSEDMHA_CPU_ISA", None)
    else:
        os.environ["FUSEDMHA_CPU_ISA"] = old


def cases():
    r = torch.randn
    for dtype in [torch.float32, torch.float64, torch.bfloat16, torch.float16]:
        yield (r(2, 4, 37, 64, dtype=dtype), r(2, 4, 45, 64, dtype=dtype), r(2, 4, 45, 64, dtype=dtype)), {}
        yield (r(2, 4, 70, 13, dtype=dtype), r(2, 4, 90, 13, dtype=dtype), r(2, 4, 90, 21, dtype=dtype)), {"is_causal": True}
        yield (r(2, 4, 37, 128, dtype=dtype), r(2, 2, 45, 128, dtype=dtype), r(2, 2, 45, 128, dtype=dtype)), \
            {"attn_mask": torch.rand(37, 45) > 0.3, "enable_gqa": True}
        # Masks converted to additive terms a vector at a time, rows of 45 keys (whole vectors
        # and a tail): a bool mask per head, and one of the inputs' dtype per batch index.
        yield (r(2, 4, 37, 64, dtype=dtype), r(2, 4, 45, 64, dtype=dtype), r(2, 4, 45, 64, dtype=dtype)), \
            {"attn_mask": torch.rand(2, 4, 37, 45) > 0.3}
        yield (r(2, 4, 37, 64, dtype=dtype), r(2, 4, 45, 64, dtype=dtype), r(2, 4, 45, 64, dtype=dtype)), \
            {"attn_mask": r(2, 1, 37, 45, dtype=dtype)}
        # A bool mask per head read as bits (AVX-512): strips of 16 whole query rows and a tail
        # of 8, keys in chunks of 64 and a tail of 22, rows a stride apart (a slice of a wider
        # mask), and keys that no query of a strip sees.
        wide = torch.rand(2, 4, 40, 200) > 0.5
        wide[..., 60:75] = False
        wide[..., 1] = True
        yield (r(2, 4, 40, 32, dtype=dtype), r(2, 4, 150, 32, dtype=dtype), r(2, 4, 150, 32, dtype=dtype)), \
            {"attn_mask": wide[..., :150]}
        # A block of 256 query rows (scores from the transposed key blocks) and one of 44; a head
        # dim and a last key block that are not whole vectors.
        yield (r(2, 4, 300, 40, dtype=dtype), r(2, 4, 333, 40, dtype=dtype), r(2, 4, 333, 24, dtype=dtype)), {}


@pytest.mark.parametrize("level", ["default", "avx2", "avx512"])
def test_forced_level(level, force_isa):
    compiled = fusedmha.build_info()["cpu_isas"]
    force_isa(level)
    inputs = list(cases())
    if level not in compiled:
        with pytest.raises(RuntimeError, match="not compiled for that level"):
            fusedmha.scaled_dot_product_attention(*inputs[0][0])
        return
    if not NEEDS[level] <= cpu_flags():
        with pytest.raises(RuntimeError, match="this CPU does not support that level"):
            fusedmha.scaled_dot_product_attention(*inputs[0][0])
        return
    assert fusedmha.build_info()["cpu_isa_in_use"] == level
    for args, kwargs in inputs:
        out = fusedmha.scaled_dot_product_attention(*args, **kwargs)
        assert_attention_close(out, *args, **kwargs)


def test_levels_agree(force_isa):
    levels = [lvl for lvl in fusedmha.build_info()["cpu_isas"] if NEEDS[lvl] <= cpu_flags()]
    assert "default" in levels
    for args, kwargs in cases():
        outs = []
        for level in levels:
            force_isa(level)
            outs.append(fusedmha.scaled_dot_product_attention(*args, **kwargs))
        for out in outs[1:]:
            # Different vector widths round differently; agreement is at working precision.
            tol = {torch.float64: 1e-12, torch.float32: 2e-6}.get(args[0].dtype, 1e-2)
            torch.testing.assert_close(out, outs[0], rtol=tol, atol=tol)


def test_unknown_level(force_isa):
    force_isa("sse9")
    with pytest.raises(RuntimeError, match="expected one of default, avx2, avx512"):
        fusedmha.scaled_dot_product_attention(torch.randn(1, 2, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4))


@pytest.mark.parametrize("level", ["default", "avx2", "avx512"])
@pytest.mark.parametrize("L", [1, 2, 4, 24, 300])
@pytest.mark.parametrize("H,H_kv,S", [(3, 3, 37), (8, 2, 300), (16, 2, 300), (32, 1, 300), (22, 2, 300),
                                      (8, 2, 1100)],
                         ids=["mha", "gqa4", "gqa8", "mqa32", "gqa11", "gqa4_long"])
@pytest.mark.parametrize("E", [32, 168])
def test_probabilities_of_huge_scores_match_the_forward(level, L, H, H_kv, S, E, force_isa):
    """The weights pass recomputes each score and takes exp(s − lse) with the forward's lse:
    with scores of 1e30 one ulp between the two is a factor e^(±1e23), so the forward's scores
    must equal the GEMM's to the bit. That covers the few-row paths: short query blocks, and
    decoding (S >= 256), whose GQA groups read their 4 or 8 query heads as rows of one block
    (with L = 2 and 4 the rows of several heads share a tile of up to 16 in float on AVX2 and
    AVX-512, 8 otherwise; transposed keys, or the keys as rows, by the vector width; 32 heads
    over one K/V head as blocks of 16 or 8, 11 as heads of their own sharing each key block's
    transpose; 24 queries per head over 1100 keys in panels of 12 or 8 rows);
    E = 168 sums the head dim in chunks (five of 32, then 8), which every path must split alike.
    Then every row of probabilities sums to 1 and the output is probs @ v."""
    if level not in fusedmha.build_info()["cpu_isas"] or not NEEDS[level] <= cpu_flags():
        pytest.skip(f"{level} is not runnable here")
    force_isa(level)
    g = torch.Generator().manual_seed(L)
    q = torch.randn(2, L, H, E, generator=g) * 1e30
    k, v = torch.randn(2, S, H_kv, E, generator=g), torch.randn(2, S, H_kv, E, generator=g)
    out, lse, probs = fusedmha.flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, H, L), rtol=0, atol=1e-5)
    v_heads = v.repeat_interleave(H // H_kv, dim=2)
    torch.testing.assert_close(out, (probs @ v_heads.transpose(1, 2)).transpose(1, 2), rtol=1e-5, atol=1e-5)
