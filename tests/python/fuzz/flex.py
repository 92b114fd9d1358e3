"""The cases of fusedmha.flex_attention: BlockMasks of torch's create_block_mask over random
patterns, block sizes, lengths, batch and heads of 1 or their own, GQA and score_mods, judged
against float64 attention with the dense mask rebuilt here from the block lists and mask_mod
(output, lse, and the gradients in float32/float64); BlockMasks that do not fit the inputs; and
block lists broken after the fact (indices outside the keys, counts past the lists), which must
raise naming the call or the op that reads them."""

import math

import torch
from torch.nn.attention.flex_attention import create_block_mask

import fusedmha
import fusedmha.flex as flex

from .case import ENTRY_POINTS, Case, expect, names_error
from .draw import DTYPES, randn
from .judge import FIXED_TOL, GRAD_FIXED_FACTOR, check_logsumexp
from reference import assert_close_to_truth

BLOCK_SIZES = [16, 32, 64, 128, (16, 32), (32, 16), (64, 16)]


def draw_mask_mod(rng, g, B, H, L, S):
    """A mask_mod of one of the common patterns, or over a random table of bits."""
    pattern = rng.choice(["causal", "window", "document", "prefix", "per_head", "per_batch",
                          "random", "all", "none_of_some_rows"])
    width, prefix = rng.randint(0, 40), rng.randint(0, 40)
    docs = torch.sort(torch.randint(0, rng.randint(1, 5), (max(L, S),), generator=g)).values
    table = torch.rand(B, H, L, S, generator=g) < rng.random()
    mods = {
        "causal": lambda b, h, q, kv: q >= kv,
        "window": lambda b, h, q, kv: (q - kv).abs() <= width,
        "document": lambda b, h, q, kv: (docs[q] == docs[kv]) & (q >= kv),
        "prefix": lambda b, h, q, kv: (kv < prefix) | (q >= kv),
        "per_head": lambda b, h, q, kv: (q >= kv) | (h % 2 == 1),
        "per_batch": lambda b, h, q, kv: kv <= q + 8 * b,
        "random": lambda b, h, q, kv: table[b, h, q, kv],
        "all": lambda b, h, q, kv: q >= 0,
        "none_of_some_rows": lambda b, h, q, kv: (q % 3 != 0) & (kv <= q + width),
    }
    return pattern, mods[pattern]


def draw_score_mod(rng, g, H, L, S, dtype):
    kind = rng.choice([None, None, "softcap", "alibi", "bias", "relative_position"])
    if kind == "softcap":
        return kind, flex.softcap(rng.choice([1.0, 5.0, 30.0]))
    if kind == "alibi":
        return kind, flex.alibi(torch.rand(H, generator=g))
    if kind == "bias":
        shape = rng.choice([(L, S), (H, L, S), (1, H, 1, S)])
        return kind, flex.bias(randn(shape, dtype, g))
    if kind == "relative_position":
        return kind, flex.relative_position(randn((H, 2 * rng.randint(0, 8) + 1), dtype, g))
    return None, None


def dense_of(block_mask, B, H):
    """The (B, H, L, S) mask a BlockMask stands for, from its definition: each listed full
    block whole, each listed partial block where mask_mod holds over the whole index grid."""
    L, S = block_mask.seq_lengths
    QB, KB = block_mask.BLOCK_SIZE
    Bm, Hm, nq = block_mask.kv_num_blocks.shape
    nk = -(-S // KB)
    state = torch.zeros(B, H, nq, nk, dtype=torch.uint8)
    lists = [(block_mask.kv_num_blocks, block_mask.kv_indices, 1)]
    if block_mask.full_kv_num_blocks is not None:
        lists.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices, 2))
    for num, indices, value in lists:
        for b in range(B):
            for h in range(H):
                for i in range(nq):
                    n = int(num[b % Bm, h % Hm, i])
                    for j in indices[b % Bm, h % Hm, i, :n].tolist():
                        state[b, h, i, j] = max(int(state[b, h, i, j]), value)
    state = state.repeat_interleave(QB, 2).repeat_interleave(KB, 3)[:, :, :L, :S]
    allowed = block_mask.mask_mod(torch.arange(B).view(-1, 1, 1, 1),
                                  torch.arange(H).view(1, -1, 1, 1),
                                  torch.arange(L).view(1, 1, -1, 1),
                                  torch.arange(S).view(1, 1, 1, -1))
    return (state == 2) | ((state == 1) & allowed)


def reference(q, k, v, mask, score_mod, scale):
    """float64 attention over the mask: (out, lse), rows that see no key 0 and -inf, softmax
    spelled out so that such rows give no NaN gradient."""
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ kk.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if score_mod is not None:
        B, H, L, S = s.shape
        grid = torch.meshgrid(torch.arange(B), torch.arange(H), torch.arange(L), torch.arange(S),
                              indexing="ij")
        s = score_mod(s, *grid)
    s = s.masked_fill(~mask, float("-inf"))
    top = s.amax(-1, keepdim=True).detach()
    top = torch.where(torch.isfinite(top), top, 0.0)
    e = (s - top).exp()
    total = e.sum(-1, keepdim=True)
    p = e / torch.where(total == 0, 1.0, total)
    return p @ vv, (total.log() + top).squeeze(-1)


def as_float64(score_mod):
    """The same score_mod over float64 tensors (its own tensors, detached)."""
    if isinstance(score_mod, flex.bias):
        return flex.bias(score_mod.tensor.detach().double())
    if isinstance(score_mod, flex.relative_position):
        return flex.relative_position(score_mod.table.detach().double())
    if isinstance(score_mod, flex.alibi):
        return flex.alibi(score_mod.slopes.double())
    return score_mod


def gen_flex(rng, g, kind, seed):
    """fusedmha.flex_attention with a BlockMask of torch's create_block_mask."""
    entry = "flex_attention"
    dtype = rng.choice(DTYPES)
    B, H_kv, groups = rng.randint(1, 3), rng.choice([1, 2]), rng.choice([1, 1, 2])
    H, L, S, E = H_kv * groups, rng.randint(1, 150), rng.randint(1, 150), rng.choice([8, 16, 40])
    pattern, mask_mod = draw_mask_mod(rng, g, B, H, L, S)
    mB, mH = rng.choice([None, B]), rng.choice([None, H])
    block_size = rng.choice(BLOCK_SIZES)
    block_mask = create_block_mask(mask_mod, mB, mH, L, S, device="cpu", BLOCK_SIZE=block_size)
    mod_kind, score_mod = draw_score_mod(rng, g, H, L, S, dtype)
    scale = rng.choice([None, None, 0.3])
    q, k, v = randn((B, H, L, E), dtype, g), randn((B, H_kv, S, E), dtype, g), randn(
        (B, H_kv, S, E), dtype, g)
    what = (f"q {tuple(q.shape)}:{str(dtype).replace('torch.', '')} kv {tuple(k.shape)} "
            f"{pattern} BlockMask({mB}, {mH}, BLOCK_SIZE={block_size}) score_mod={mod_kind} "
            f"scale={scale}")
    error = names_error(ENTRY_POINTS[entry])
    if kind == "wrong_shape":
        # A BlockMask for other lengths, or for a batch or heads the query does not have.
        causal = lambda b, h, q, kv: q >= kv  # noqa: E731
        if rng.random() < 0.5:
            other = create_block_mask(causal, mB, mH, L + rng.randint(1, 9), S, device="cpu",
                                      BLOCK_SIZE=block_size)
        else:
            other = create_block_mask(causal, B + 1, H, L, S, device="cpu",
                                      BLOCK_SIZE=block_size)
        return Case(entry, kind, what + " (a BlockMask that does not fit)",
                    lambda: fusedmha.flex_attention(q, k, v, block_mask=other,
                                                    enable_gqa=groups > 1), error=error)
    if kind == "broken":
        # Lists changed after the fact: a listed key block past the keys, or a count past the
        # lists' length (or below 0).
        num, indices = block_mask.kv_num_blocks.clone(), block_mask.kv_indices.clone()
        listed = (torch.arange(indices.shape[-1]) < num.unsqueeze(-1)).nonzero()
        nk = -(-S // block_mask.BLOCK_SIZE[1])
        if listed.shape[0] > 0 and rng.random() < 0.6:
            at = tuple(listed[rng.randrange(listed.shape[0])].tolist())
            indices[at] = rng.choice([nk, nk + 5, -1])
        else:
            num.view(-1)[rng.randrange(num.numel())] = rng.choice([indices.shape[-1] + 1, -1])
        block_mask.kv_num_blocks, block_mask.kv_indices = num, indices
        return Case(entry, kind, what + " (block lists broken)",
                    lambda: fusedmha.flex_attention(q, k, v, block_mask=block_mask,
                                                    enable_gqa=groups > 1), error=error)
    grads = kind == "valid" and dtype in (torch.float32, torch.float64)
    leaves = [t.requires_grad_() for t in (q, k, v)] if grads else []

    def call():
        return fusedmha.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                       scale=scale, enable_gqa=groups > 1, return_lse=True)

    def check(result):
        out, lse = result
        mask = dense_of(block_mask, B, H)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref, ref_lse = reference(q64, k64, v64, mask, as_float64(score_mod), scale)
        expect(out.dtype == dtype and tuple(out.shape) == tuple(ref.shape),
               f"output {tuple(out.shape)}:{out.dtype}, expected {tuple(ref.shape)}:{dtype}")
        assert_close_to_truth(out, ref, floor=FIXED_TOL[dtype])
        expect(torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)),
               "lse: the rows that see no key differ (-inf)")
        check_logsumexp(torch.where(torch.isneginf(lse), float("inf"), lse),
                        torch.where(torch.isneginf(ref_lse), float("inf"), ref_lse), dtype)
        if not grads:
            return
        grad_out = randn(out.shape, dtype, g)
        got = torch.autograd.grad(out, leaves, grad_out)
        want = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())
        for name, a, w in zip("qkv", got, want):
            assert_close_to_truth(a, w, floor=GRAD_FIXED_FACTOR * FIXED_TOL[dtype],
                                  what=f"d{name}")

    return Case(entry, kind, what, call, check)
