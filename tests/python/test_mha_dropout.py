"""fusedmha.MultiheadAttention's dropout: seeded and repeatable, at the configured rate and
scale, the returned weights are the ones applied (output and gradients against the float64
reference with that keep-mask), gradcheck with a fixed seed, and off in eval."""

import math

import pytest
import torch

from mha_inputs import bool_mask, causal_bool, fused_mha, make_inputs, make_pair, randomize_biases
from reference import compare_runs, leaves, loss_of, params64, reference_mha, scale_of

pytestmark = pytest.mark.usefixtures("one_thread")


WEIGHT_MODES = {"none": dict(need_weights=False), "avg": dict(need_weights=True),
                "per_head": dict(need_weights=True, average_attn_weights=False)}


@pytest.mark.parametrize("weights", list(WEIGHT_MODES))
def test_dropout_repeatable_with_seed(weights):
    mod = fused_mha(16, 4, dropout=0.3).train()
    x = make_inputs(2, 8, 8, 16, 16, 16, torch.float32, True, False)
    kw = WEIGHT_MODES[weights]
    torch.manual_seed(7)
    a = mod(*x, **kw)
    b = mod(*x, **kw)
    torch.manual_seed(7)
    c = mod(*x, **kw)
    assert torch.equal(a[0], c[0])
    assert not torch.equal(a[0], b[0])
    if a[1] is not None:
        assert torch.equal(a[1], c[1]) and not torch.equal(a[1], b[1])
    mod.eval()
    e1, e2 = mod(*x, **kw), mod(*x, **kw)
    assert torch.equal(e1[0], e2[0])
    assert not torch.equal(e1[0], a[0])


def test_dropout_average_is_mean_of_per_head_with_same_seed():
    """As in PyTorch, the seed fixes the dropout mask, whatever average_attn_weights is."""
    mod = fused_mha(16, 4, dropout=0.3).train()
    x = make_inputs(2, 6, 7, 16, 16, 16, torch.float32, True, False)
    torch.manual_seed(3)
    out_a, w_avg = mod(*x)
    torch.manual_seed(3)
    out_b, w_ph = mod(*x, average_attn_weights=False)
    torch.testing.assert_close(out_a, out_b)
    torch.testing.assert_close(w_avg, w_ph.mean(dim=1))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_fraction_and_scale(p):
    torch.manual_seed(3)
    mod = fused_mha(32, 4, dropout=p)
    x = make_inputs(2, 40, 48, 32, 32, 32, torch.float32, True, False)
    mod.eval()
    with torch.no_grad():
        _, w_eval = mod(*x, average_attn_weights=False)
    mod.train()
    with torch.no_grad():
        _, w = mod(*x, average_attn_weights=False)
    dropped = (w == 0).float().mean().item()
    n = w.numel()
    assert abs(dropped - p) < 6 * math.sqrt(p * (1 - p) / n), (p, dropped)
    kept = w != 0
    torch.testing.assert_close(w[kept], w_eval[kept] / (1 - p), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("cfg", [dict(), dict(add_bias_kv=True, add_zero_attn=True, kdim=8, vdim=12, batch_first=True)],
                         ids=["plain", "extras"])
@pytest.mark.parametrize("mask", ["none", "kpm", "causal"])
def test_dropout_weights_are_those_applied(cfg, mask):
    """The per-head weights returned in training are the dropped ones (as PyTorch); the output
    and all gradients are those of attention with exactly that keep-mask."""
    p = 0.3
    torch.manual_seed(5)
    mod = fused_mha(16, 4, dropout=p, **cfg).train()
    randomize_biases(mod)
    N, L, S = 2, 6, 7
    x = make_inputs(N, L, S, 16, cfg.get("kdim", 16), cfg.get("vdim", 16), torch.float32, True,
                    cfg.get("batch_first", False))
    kw = dict(average_attn_weights=False)
    if mask == "kpm":
        kw["key_padding_mask"] = bool_mask((N, S))
    elif mask == "causal" and not cfg:
        kw["is_causal"] = True
    elif mask == "causal":  # is_causal with extra keys is tested on its own
        kw["attn_mask"] = causal_bool(L, S)
    f_in = leaves(*x)
    out, w = mod(*f_in, **kw)
    keep = (w != 0).double()
    dropped = 1 - keep.mean().item()
    assert 0.05 < dropped < 0.7, dropped
    r_in = leaves(*(t.double() for t in x))
    P = params64(mod)
    out_r, w_r = reference_mha(mod, *r_in, keep=keep, params=P, **kw)
    torch.testing.assert_close(w.double(), w_r, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.double(), out_r, rtol=1e-4, atol=2e-5)
    go, gw = torch.randn(out.shape), torch.randn(w.shape)
    names = [n for n, _ in mod.named_parameters()]
    g_f = torch.autograd.grad(loss_of(out, w, go, gw), f_in + [p_ for _, p_ in mod.named_parameters()])
    g_r = torch.autograd.grad(loss_of(out_r, w_r, go.double(), gw.double()), r_in + [P[n] for n in names])
    for label, a, b in zip(["query", "key", "value"] + names, g_f, g_r):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4 * scale_of(b), msg=lambda m: f"{label}: {m}")


@pytest.mark.parametrize("need_weights", [False, True])
def test_dropout_gradcheck_with_fixed_seed(need_weights):
    """With the seed reset before each call the module is a deterministic function: its
    backward must be its derivative (the backward replays the forward's dropout mask)."""
    mod = fused_mha(8, 2, dropout=0.4, dtype=torch.float64).train()
    q, k, v = (torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        torch.manual_seed(11)
        out, w = mod(q, k, v, need_weights=need_weights, average_attn_weights=False)
        return (out, w) if need_weights else out

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("need_weights", [False, True])
def test_eval_ignores_dropout(need_weights):
    ref, mod = make_pair(16, 4, dropout=0.5)
    ref.eval()
    mod.eval()
    x = make_inputs(2, 6, 6, 16, 16, 16, torch.float32, True, False)
    kw = dict(need_weights=need_weights, key_padding_mask=bool_mask((2, 6)))
    compare_runs(mod, ref, leaves(*x), leaves(*x), kw, dict(kw), torch.float32)


@pytest.mark.parametrize("need_weights", [False, True])
def test_dropout_one_drops_everything(need_weights):
    ref, mod = make_pair(16, 4, dropout=1.0)
    x = make_inputs(2, 5, 6, 16, 16, 16, torch.float32, True, False)
    out_f, w_f = mod(*x, need_weights=need_weights)
    out_r, w_r = ref(*x, need_weights=need_weights)
    assert torch.isfinite(out_f).all()
    torch.testing.assert_close(out_f, out_r)
    if need_weights:
        torch.testing.assert_close(w_f, w_r)

