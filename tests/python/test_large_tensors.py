"""Inputs and masks of more than 2^31 elements: every offset into them is 64-bit. Each test
puts distinctive values past element 2^31 (where a 32-bit offset would wrap around to other
rows or out of the tensor), and checks the rows that read them against float64.

Sized for a 24 GiB machine; skipped, with the reason, when memory is short."""

import math

import pytest
import torch

import fusedmha

BEYOND_32_BITS = 2**31


def available_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def need_memory(gib):
    have = available_bytes()
    if have is not None and have < gib * 2**30:
        pytest.skip(f"needs {gib} GiB of free memory, {have / 2**30:.1f} GiB available")


def test_bool_mask_past_two_to_the_31_elements():
    """A (40000, 65537) bool mask: rows from 32768 on start past element 2^31."""
    L, S, E = 40_000, 65_537, 8
    assert L * S > BEYOND_32_BITS and 32_768 * S > BEYOND_32_BITS
    need_memory(6)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, L, E, generator=g, requires_grad=True)
    k = torch.randn(1, 1, S, E, generator=g, requires_grad=True)
    v = torch.randn(1, 1, S, E, generator=g, requires_grad=True)
    grad = torch.randn(1, 1, L, E, generator=g)
    mask = torch.zeros(L, S, dtype=torch.bool)
    mask[:, ::2] = True
    rows = [0, 1, 32_767, 32_768, 35_001, L - 1]
    for r in rows:  # each its own pattern: a wrong row offset reads another one
        mask[r] = torch.rand(S, generator=g) > 0.5
    out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.backward(grad)
    for r in rows:
        q64 = q.detach()[0, 0, r].double().requires_grad_()
        scores = (k.detach()[0, 0].double() @ q64) / math.sqrt(E)
        p = torch.softmax(scores.masked_fill(~mask[r], -math.inf), dim=0)
        want = p @ v.detach()[0, 0].double()
        want.backward(grad[0, 0, r].double())
        torch.testing.assert_close(out.detach()[0, 0, r].double(), want, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(q.grad[0, 0, r].double(), q64.grad, atol=1e-4, rtol=1e-4)


def test_keys_and_values_past_two_to_the_31_elements():
    """bfloat16 keys (one tensor as K and V, 4.3 GB) of 2^25 + 4097 rows of 64: the last 4096
    rows lie past element 2^31. Every other row is zero (score 0, value 0), so the float64
    truth needs only the non-zero rows and the count of the others."""
    S, E, n = 2**25 + 4097, 64, 4096
    assert (S - n) * E > BEYOND_32_BITS
    need_memory(9)
    g = torch.Generator().manual_seed(1)
    kv = torch.zeros(1, 1, S, E, dtype=torch.bfloat16)
    head = torch.randn(n, E, generator=g).bfloat16()
    tail = (torch.randn(n, E, generator=g) * 2).bfloat16()  # larger: the tail dominates
    kv[0, 0, :n] = head
    kv[0, 0, -n:] = tail
    q = (torch.randn(1, 2, 3, E, generator=g) * 3).bfloat16()  # 2 heads share a K/V head
    out = fusedmha.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)

    rows = torch.cat([head, tail]).double()
    scores = q[0].double() @ rows.T / math.sqrt(E)  # (2, 3, 2n)
    m = scores.amax(-1, keepdim=True).clamp_min(0.0)
    weights = (scores - m).exp()
    zeros = (S - 2 * n) * (-m).exp()
    want = (weights @ rows) / (weights.sum(-1, keepdim=True) + zeros)
    torch.testing.assert_close(out[0].double(), want, atol=2e-2, rtol=2e-2)
    # Without the tail's 4096 rows the answer is far away: the check can fail.
    assert (want - (weights[..., :n] @ rows[:n]) / (weights[..., :n].sum(-1, keepdim=True)
                                                    + zeros)).abs().max() > 0.1
