"""The CUDA kernels against float64 truth, PyTorch and the CPU kernels: forward, backward,
dropout (the CPU's stream), the op contract, the module, torch.compile and CUDA graphs.

Skipped, with the reason shown, where fusedmha was built without CUDA kernels or no GPU is
visible (tests/run.sh prints skip reasons)."""

import math

import pytest
import torch
import torch.nn.functional as F

import fusedmha
from reference import reference_probs

pytestmark = [
    pytest.mark.skipif(not fusedmha.build_info()["cuda"], reason="fusedmha was built without CUDA kernels"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible (torch.cuda.is_available() is False)"),
]

ops = torch.ops.fusedmha
sdpa = fusedmha.scaled_dot_product_attention
DEV = "cuda"

# Absolute error floors on outputs of magnitude ~1, as in reference.py.
FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rand(*shape, dtype=torch.float16):
    return torch.randn(*shape, device=DEV, dtype=dtype)


def cpu64(t):
    return None if t is None else (t.detach().cpu().double() if t.is_floating_point() else t.detach().cpu())


def reference(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, keep=None, p=0.0):
    """Float64 attention on the CPU (keep: the dropout keep-mask, applied with 1/(1-p))."""
    q, k, v, m = cpu64(q), cpu64(k), cpu64(v), cpu64(attn_mask)
    probs = reference_probs(q, k, m, is_causal, scale, enable_gqa)
    if keep is not None:
        probs = probs * keep / (1 - p)
    if enable_gqa and v.dim() >= 3:
        v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
    return probs @ v


def assert_close_to_truth(out, ref, torch_out=None, dtype=None, factor=2.0):
    """out within factor x PyTorch's own error (when given) or the dtype's floor."""
    dtype = dtype or out.dtype
    err = (out.detach().cpu().double() - ref).abs().max().item() if out.numel() else 0.0
    torch_err = 0.0
    if torch_out is not None and out.numel():
        torch_err = (torch.nan_to_num(torch_out.detach().cpu().double()) - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item() if ref.numel() else 1.0)
    bound = factor * torch_err + 4 * FLOOR[dtype] * scale
    assert not torch.isnan(out).any(), "NaN in the output"
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g} (PyTorch's {torch_err:.3g})"


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E", [8, 33, 64, 80, 128, 200, 256, 320])
def test_forward_head_dims(dtype, E):
    q, k, v = rand(2, 3, 77, E, dtype=dtype), rand(2, 3, 91, E, dtype=dtype), rand(2, 3, 91, E, dtype=dtype)
    out = sdpa(q, k, v)
    torch_out = F.scaled_dot_product_attention(q, k, v)
    assert_close_to_truth(out, reference(q, k, v), torch_out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("L,S", [(1, 1), (1, 300), (300, 1), (64, 64), (65, 63), (128, 1000), (1000, 128),
                                 (2048, 2048), (8192, 8192)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_lengths(dtype, L, S, is_causal):
    B, H = (1, 2) if L * S > 1e7 else (2, 3)
    q, k, v = rand(B, H, L, 64, dtype=dtype), rand(B, H, S, 64, dtype=dtype), rand(B, H, S, 64, dtype=dtype)
    out = sdpa(q, k, v, is_causal=is_causal)
    torch_out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    assert_close_to_truth(out, reference(q, k, v, is_causal=is_causal), torch_out)


def masks(L, S, dtype):
    g = torch.Generator(device="cpu").manual_seed(1)
    keep = torch.rand(2, 3, L, S, generator=g) > 0.3
    keep[..., 0, :] = False  # a row with nothing to attend to
    return {
        "bool_full": keep.to(DEV),
        "bool_broadcast": keep[:1, :1].to(DEV),
        "bool_key_padding": keep[:, :1, :1].to(DEV),
        "float_full": torch.randn(2, 3, L, S, generator=g).to(DEV, dtype),
        "float_row": torch.randn(S, generator=g).to(DEV, dtype),
        "float32_for_half": torch.randn(1, 3, L, S, generator=g).to(DEV),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["bool_full", "bool_broadcast", "bool_key_padding", "float_full", "float_row",
                                  "float32_for_half"])
def test_masks(dtype, kind):
    L, S = 70, 130
    q, k, v = rand(2, 3, L, 64, dtype=dtype), rand(2, 3, S, 64, dtype=dtype), rand(2, 3, S, 64, dtype=dtype)
    mask = masks(L, S, dtype)[kind]
    if kind == "float32_for_half" and dtype in (torch.float32, torch.float64):
        pytest.skip("float32 masks with full-precision queries are the float_full case")
    out = sdpa(q, k, v, attn_mask=mask)
    assert_close_to_truth(out, reference(q, k, v, attn_mask=mask))
    if kind in ("bool_full", "bool_broadcast"):
        assert (out[..., 0, :] == 0).all()  # the row with nothing to attend to


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_gqa_and_strided_inputs(dtype):
    B, L, H, Hkv, E = 2, 100, 8, 2, 64
    # (B, L, H, E) projections viewed as (B, H, L, E): rows interleaved with heads.
    q = rand(B, L, H, E, dtype=dtype).transpose(1, 2)
    k = rand(B, L, Hkv, E, dtype=dtype).transpose(1, 2)
    v = rand(B, L, Hkv, E, dtype=dtype).transpose(1, 2)
    out = sdpa(q, k, v, enable_gqa=True, is_causal=True)
    assert_close_to_truth(out, reference(q, k, v, is_causal=True, enable_gqa=True))
    # Odd offsets (not 16-byte aligned) and non-contiguous last dims are copied, not misread.
    base = rand(B, H, L, E + 1, dtype=dtype)
    q2 = base[..., 1:]
    k2 = rand(B, H, E, L, dtype=dtype).transpose(-1, -2)
    out = sdpa(q2, k2, k2)
    assert_close_to_truth(out, reference(q2, k2, k2))


def test_output_layout_follows_query():
    q = rand(2, 50, 4, 64).transpose(1, 2)
    out = sdpa(q, q, q)
    assert out.stride() == F.scaled_dot_product_attention(q, q, q).stride()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E", [16, 64, 100, 128, 256])
@pytest.mark.parametrize("case", ["plain", "causal", "mask", "gqa"])
def test_backward_matches_float64(dtype, E, case):
    L, S = 75, 140
    H, Hkv = 4, (2 if case == "gqa" else 4)
    q = rand(2, H, L, E, dtype=dtype).requires_grad_()
    k = rand(2, Hkv, S, E, dtype=dtype).requires_grad_()
    v = rand(2, Hkv, S, E, dtype=dtype).requires_grad_()
    kwargs = {"is_causal": case == "causal", "enable_gqa": case == "gqa"}
    if case == "mask":
        kwargs["attn_mask"] = masks(L, S, dtype)["bool_full"][:, :1]
    out = sdpa(q, k, v, **kwargs)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    q64, k64, v64 = (cpu64(t).requires_grad_() for t in (q, k, v))
    ref = reference(q64, k64, v64, **kwargs)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), cpu64(grad_out))
    t = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    torch_kwargs = dict(kwargs)
    torch_out = F.scaled_dot_product_attention(*t, **torch_kwargs)
    torch_grads = torch.autograd.grad(torch_out, t, grad_out)
    for name, g, r, tg in zip("qkv", grads, ref_grads, torch_grads):
        assert g.shape == r.shape and g.dtype == dtype, name
        # PyTorch may give NaN for the fully masked row; then only the dtype's floor bounds us.
        assert_close_to_truth(g, r, tg if torch.isfinite(tg).all() else None, dtype=dtype, factor=3.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_dropout_matches_cpu_stream(dtype, is_causal):
    p = 0.25
    q, k, v = (rand(2, 3, 90, 64, dtype=dtype).requires_grad_() for _ in range(3))
    out, lse, rng = ops.attention_forward(q, k, v, dropout_p=p, is_causal=is_causal)
    assert rng.device.type == "cuda"
    keep = ops._dropout_keep_mask(rng.cpu(), 6, 90, 90, p).view(2, 3, 90, 90)
    q64, k64, v64 = (cpu64(t).requires_grad_() for t in (q, k, v))
    ref = reference(q64, k64, v64, is_causal=is_causal, keep=keep, p=p)
    assert_close_to_truth(out, ref, dtype=dtype)
    # Backward replays the same mask.
    grad_out = torch.randn_like(out)
    grads = ops.attention_backward(grad_out, q, k, v, out, lse, rng, None, p, is_causal, None, False)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), cpu64(grad_out))
    for g, r in zip(grads, ref_grads):
        assert_close_to_truth(g, r, dtype=dtype, factor=1.0)
    # The CPU kernels, handed the same (seed, offset), drop the same elements.
    w_cuda = ops.attention_weights(q, k, lse, rng, None, p, is_causal)
    w_cpu = ops.attention_weights(q.cpu().float(), k.cpu().float(), lse.cpu(), rng.cpu(), None, p, is_causal)
    assert torch.equal(w_cuda.cpu() == 0, w_cpu == 0)


def test_dropout_is_seeded_and_fresh():
    q = rand(2, 4, 128, 64)
    torch.manual_seed(3)
    a = sdpa(q, q, q, dropout_p=0.5)
    torch.manual_seed(3)
    b = sdpa(q, q, q, dropout_p=0.5)
    c = sdpa(q, q, q, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_attention_weights(dtype):
    q, k = rand(2, 4, 50, 32, dtype=dtype), rand(2, 4, 70, 32, dtype=dtype)
    out, lse, rng = ops.attention_forward(q, k, k)
    w = ops.attention_weights(q, k, lse, rng)
    ref = reference_probs(cpu64(q), cpu64(k))
    assert_close_to_truth(w, ref)
    avg = ops.attention_weights(q, k, lse, rng, average_heads=True)
    assert_close_to_truth(avg, ref.mean(1))


def test_fully_masked_rows_are_zero_with_zero_grad():
    q = rand(1, 2, 40, 64).requires_grad_()
    mask = torch.ones(40, 40, dtype=torch.bool, device=DEV)
    mask[5] = False
    out = sdpa(q, q, q, attn_mask=mask)
    assert (out[..., 5, :] == 0).all()
    (g,) = torch.autograd.grad(out.float().sum(), q)
    assert torch.isfinite(g).all()


def test_cpu_and_cuda_agree():
    q, k, v = (torch.randn(2, 4, 60, 64) for _ in range(3))
    mask = torch.rand(60, 60) > 0.2
    cpu = sdpa(q, k, v, attn_mask=mask)
    cuda = sdpa(q.to(DEV), k.to(DEV), v.to(DEV), attn_mask=mask.to(DEV))
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-5, atol=1e-5)


def test_bad_input_names_the_argument():
    q = rand(2, 3, 10, 64)
    with pytest.raises(RuntimeError, match="same device"):
        sdpa(q, q.cpu(), q)
    with pytest.raises(RuntimeError, match="attn_mask"):
        sdpa(q, q, q, attn_mask=torch.ones(10, 10, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_opcheck(dtype):
    q, k, v = (rand(2, 2, 20, 16, dtype=dtype).requires_grad_() for _ in range(3))
    mask = torch.rand(20, 20, device=DEV) > 0.2
    torch.library.opcheck(ops.attention_forward.default, (q, k, v, mask, 0.0, False, None, False))
    torch.library.opcheck(ops.attention_forward.default, (q, k, v, None, 0.0, True, 0.3, False))


def test_gradcheck_float64():
    q, k, v = (torch.randn(1, 2, 9, 8, device=DEV, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.rand(9, 9, device=DEV) > 0.3
    # nondet_tol=0: the float64 backward (the simple kernels) is deterministic.
    assert torch.autograd.gradcheck(lambda q, k, v: sdpa(q, k, v, is_causal=True), (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: sdpa(q, k, v, attn_mask=mask, dropout_p=0.0), (q, k, v))


def test_float32_backward_is_deterministic():
    q, k, v = (rand(2, 4, 100, 64, dtype=torch.float32).requires_grad_() for _ in range(3))
    g = torch.randn(2, 4, 100, 64, device=DEV)
    first = torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), g)
    second = torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), g)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_matches_pytorch(dtype, need_weights):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(256, 8, batch_first=True, device=DEV, dtype=dtype)
    mine = fusedmha.MultiheadAttention(256, 8, batch_first=True, device=DEV, dtype=dtype)
    mine.load_state_dict(ref.state_dict())
    x = rand(4, 100, 256, dtype=dtype)
    pad = torch.zeros(4, 100, dtype=torch.bool, device=DEV)
    pad[:, 90:] = True
    out, w = mine(x, x, x, key_padding_mask=pad, need_weights=need_weights)
    ref_out, ref_w = ref(x, x, x, key_padding_mask=pad, need_weights=need_weights)
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    if need_weights:
        torch.testing.assert_close(w, ref_w, rtol=tol, atol=tol)
    out.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mine.parameters())


def test_torch_compile_fullgraph():
    q, k, v = (rand(2, 4, 128, 64).requires_grad_() for _ in range(3))
    compiled = torch.compile(lambda q, k, v: sdpa(q, k, v, is_causal=True), fullgraph=True)
    out = compiled(q, k, v)
    torch.testing.assert_close(out, sdpa(q, k, v, is_causal=True))
    out.float().sum().backward()
    assert q.grad is not None


def test_cuda_graph_capture_with_dropout():
    q, k, v = (rand(2, 4, 128, 64).requires_grad_() for _ in range(3))
    static_grad = torch.randn(2, 4, 128, 64, device=DEV, dtype=torch.float16)

    def step():
        out, lse, rng = ops.attention_forward(q, k, v, dropout_p=0.2)
        grads = ops.attention_backward(static_grad, q, k, v, out, lse, rng, None, 0.2, False, None, False)
        return out, rng, grads

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, rng, grads = step()
    seen = set()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        keep = ops._dropout_keep_mask(rng.cpu(), 8, 128, 128, 0.2).view(2, 4, 128, 128)
        ref = reference(q, k, v, keep=keep, p=0.2)
        assert_close_to_truth(out, ref, dtype=torch.float16)
        seen.add(tuple(rng.cpu().tolist()))
    assert len(seen) == 3, "each replay should draw a fresh dropout stream"
    assert all(torch.isfinite(g).all() for g in grads)


def test_runs_on_the_current_stream_and_device_guard():
    q = rand(2, 4, 256, 64)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # q is made on the default stream
    with torch.cuda.stream(s):
        out = sdpa(q, q, q)
    s.synchronize()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q), rtol=2e-3, atol=2e-3)
    if torch.cuda.device_count() > 1:
        q1 = q.to("cuda:1")
        torch.testing.assert_close(sdpa(q1, q1, q1).cpu(), out.cpu(), rtol=2e-3, atol=2e-3)


def test_build_info_reports_cuda():
    assert fusedmha.build_info()["cuda"] is True
    assert math.isfinite(sdpa(rand(1, 1, 4, 8), rand(1, 1, 4, 8), rand(1, 1, 4, 8)).float().sum().item())
