"""Resident memory stays flat over 10,000 forward + backward calls of the op and of the module:
a call that leaked even a few hundred bytes (a workspace, a saved tensor, a reference cycle
through autograd) would show here. The C++ tests run under LeakSanitizer too
(tests/sanitize.sh)."""

import gc

import pytest
import torch

import fusedmha

CALLS = 10_000
WARMUP = 1_000
# A leak of 200 bytes per call is 2 MB over the run; malloc's own growth after warm-up stays
# well below that.
TOLERANCE_BYTES = 2 * 2**20


def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def growth_over_calls(step):
    for _ in range(WARMUP):
        step()
    gc.collect()
    before = resident_bytes()
    for _ in range(CALLS):
        step()
    gc.collect()
    return resident_bytes() - before


@pytest.fixture(autouse=True)
def linux_only():
    try:
        resident_bytes()
    except OSError:
        pytest.skip("needs /proc/self/statm")


def test_op_forward_backward_does_not_leak(one_thread):
    q = torch.randn(2, 2, 16, 16, requires_grad=True)
    k = torch.randn(2, 2, 24, 16, requires_grad=True)
    v = torch.randn(2, 2, 24, 16, requires_grad=True)
    mask = torch.rand(16, 24) > 0.3

    def step():
        out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)
        out.sum().backward()
        q.grad = k.grad = v.grad = None

    growth = growth_over_calls(step)
    print(f"resident memory growth: {growth} bytes")
    assert growth < TOLERANCE_BYTES, f"resident memory grew by {growth / 2**20:.1f} MiB"


def test_module_forward_backward_does_not_leak(one_thread):
    mod = fusedmha.MultiheadAttention(16, 2, dropout=0.1, batch_first=True)
    x = torch.randn(2, 12, 16)
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[0, -3:] = True

    def step():
        out, weights = mod(x, x, x, key_padding_mask=padding)
        (out.sum() + weights.sum()).backward()
        mod.zero_grad(set_to_none=True)

    growth = growth_over_calls(step)
    print(f"resident memory growth: {growth} bytes")
    assert growth < TOLERANCE_BYTES, f"resident memory grew by {growth / 2**20:.1f} MiB"
