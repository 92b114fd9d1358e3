"""The float64 truth the tests compare against, and the accuracy checks they share.

Every float64 reference of the test suite lives here: scaled dot-product attention and its
probabilities with fusedmha's semantics (a row with no key to attend to gives 0, with zero
gradient; an optional dropout keep-mask), MultiheadAttention computed from a module's
parameters, and the tolerances per dtype (and per device) the checks use.

The references run on the device of their inputs, in float64."""

import copy
import math

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")

# --------------------------------------------------------------------------------------
# tolerances
# --------------------------------------------------------------------------------------

# Error bound floors per dtype (absolute, on outputs of magnitude ~1): a
# fused kernel rounds differently from PyTorch, so it may be as far from the
# float64 truth as PyTorch is, times a small factor, or this floor.
ATOL_FLOOR = {
    torch.float64: 1e-12,
    torch.float32: 2e-6,
    torch.bfloat16: 1e-2,
    torch.float16: 2e-3,
}

# The CUDA kernels are held to 4x the floor, outputs and gradients alike (the bound they
# were written against: their tiles sum in another order than PyTorch's CUDA kernels, and
# the tensor-core backward sums dQ with atomics).
CUDA_FLOOR_FACTOR = 4

# Gradients of the CPU kernels: floors per dtype, and how many times PyTorch's own error.
GRAD_FLOOR_CPU = {torch.float64: 1e-11, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
GRAD_FACTOR = {"cpu": 2.0, "cuda": 3.0}

# Attention weights (probabilities, at most 1) on the CPU: absolute, no relative part.
WEIGHTS_ATOL_CPU = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}

# MultiheadAttention against PyTorch's module at the same dtype: (rtol, atol x scale).
# bfloat16 and float16 are compared through PyTorch's error against float64 instead. On CUDA,
# float32 gets atol 1e-4 (PyTorch's CUDA module and fusedmha's sum in other orders).
MHA_TOL = {
    "cpu": {torch.float64: (1e-9, 1e-10), torch.float32: (1e-4, 2e-5)},
    "cuda": {torch.float64: (1e-9, 1e-10), torch.float32: (1e-4, 1e-4)},
}


def device_type(device):
    return torch.device(device).type


def output_floor(dtype, device="cpu"):
    """The absolute floor of an attention output of magnitude ~1 (see ATOL_FLOOR)."""
    return ATOL_FLOOR[dtype] * (CUDA_FLOOR_FACTOR if device_type(device) == "cuda" else 1)


def grad_tolerance(dtype, device="cpu"):
    """(factor on PyTorch's own error, floor) for the gradients of attention."""
    kind = device_type(device)
    floor = GRAD_FLOOR_CPU[dtype] if kind == "cpu" else CUDA_FLOOR_FACTOR * ATOL_FLOOR[dtype]
    return GRAD_FACTOR[kind], floor


def weights_atol(dtype, device="cpu"):
    """Absolute tolerance of attention probabilities."""
    if device_type(device) == "cuda":
        return CUDA_FLOOR_FACTOR * ATOL_FLOOR[dtype]
    return WEIGHTS_ATOL_CPU[dtype]


# --------------------------------------------------------------------------------------
# small shared helpers
# --------------------------------------------------------------------------------------


def leaves(*tensors, dtype=None):
    """Fresh leaf copies that require grad (cast to dtype, when given), one per tensor."""
    return [(t.detach().clone() if dtype is None else t.detach().to(dtype, copy=True)).requires_grad_()
            for t in tensors]


def scale_of(t):
    return max(1.0, t.detach().abs().max().item()) if t.numel() else 1.0


def nonfinite(t):
    bad = ~torch.isfinite(t)
    return f"{bad.sum().item()} of {t.numel()} values are NaN/inf, first at {bad.nonzero()[:4].tolist()}"


# --------------------------------------------------------------------------------------
# scaled dot-product attention
# --------------------------------------------------------------------------------------


def reference_probs(q, k, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """The attention probabilities in float64 (rows with no key to attend to are 0)."""
    return reference_variants(q, k, k, attn_mask, is_causal, scale, enable_gqa)[2]


def reference_attention(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                        keep=None, dropout_p=0.0):
    """Attention in float64 with fusedmha's semantics (rows with no key to attend to give 0).
    keep: the dropout keep-mask (shaped like the scores), applied with scale 1 / (1 - dropout_p)."""
    v = v.double()
    if enable_gqa and q.dim() >= 3:
        v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
    probs = reference_probs(q, k, attn_mask, is_causal, scale, enable_gqa)
    if keep is not None:
        probs = probs * keep.to(probs.device) / (1 - dropout_p)
    return probs @ v


def reference_variants(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                       keep=None, dropout_p=0.0, window_left=-1, window_right=-1,
                       bottom_right=False, softcap=0.0, alibi_slopes=None, sinks=None):
    """Attention with FlashAttention's variants in float64, differentiable: (output,
    log-sum-exp, probabilities). The pipeline of fusedmha's kernels: s = scale·q·kᵀ →
    softcap·tanh(s / softcap) → −slope·|d − j| → the band d − window_left <= j <= d +
    window_right (window_right 0 when causal) and the mask → softmax with the sink in the
    denominator → dropout → ·v; d = i (+ S − L when bottom_right). A row with nothing to
    attend to (and no sink) gives 0 and lse +inf."""
    q, k, v = q.double(), k.double(), v.double()
    if enable_gqa and q.dim() >= 3 and k.size(-3) > 0:  # (no heads: nothing to repeat)
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
    if scale is None:  # (E = 0: every score is 0, whatever the scale)
        scale = 1.0 / math.sqrt(q.size(-1)) if q.size(-1) > 0 else 1.0
    scores = (q @ k.transpose(-2, -1)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    L, S = q.size(-2), k.size(-2)
    i = torch.arange(L, device=scores.device).unsqueeze(-1)
    j = torch.arange(S, device=scores.device)
    diagonal = i + (S - L if bottom_right else 0)
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().to(scores.device)[..., None, None]
        scores = scores - slopes * (diagonal - j).abs()
    right = 0 if is_causal else window_right
    allowed = torch.ones(L, S, dtype=torch.bool, device=scores.device)
    if right >= 0:
        allowed &= j <= diagonal + right
    if window_left >= 0:
        allowed &= j >= diagonal - window_left
    scores = scores.masked_fill(~allowed, NEG_INF)
    if attn_mask is not None:
        attn_mask = attn_mask.to(scores.device)
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, NEG_INF)
        else:
            scores = scores + attn_mask.double()
    if sinks is not None:
        sink = sinks.double().to(scores.device)[:, None, None].expand(*scores.shape[:-1], 1)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1, keepdim=True)
        probs = torch.exp(scores - lse)
    else:
        attends = (scores > NEG_INF).any(dim=-1, keepdim=True)
        safe = torch.where(attends, scores, torch.zeros_like(scores))
        lse = torch.where(attends, torch.logsumexp(safe, dim=-1, keepdim=True),
                          torch.full_like(attends, math.inf, dtype=scores.dtype))
        probs = torch.softmax(safe, dim=-1) * attends
    kept = probs if keep is None else probs * keep.to(probs.device) / (1 - dropout_p)
    out = kept @ v  # (v's batch dims may broadcast those of q and k: the lse follows the output)
    return out, lse.squeeze(-1).expand(out.shape[:-1]), probs


def assert_same_gradients(out, ref, inputs, **tol):
    """The gradients of out and of its reference ref with respect to inputs agree, for one
    random output gradient."""
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(ref, inputs, grad.to(ref.dtype))
    for n, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a.to(b.dtype), b, **tol, msg=lambda m: f"gradient {n}: {m}")


def check_masked_call(q, k, v, mask, **kw):
    """The op's forward (output, log-sum-exp), gradients and weights (averaged over the heads)
    with mask (and the variants kw; dropout_p draws a dropout mask) against the float64
    reference."""
    kw = dict(kw)
    p = kw.pop("dropout_p", 0.0)
    out, lse, rng = torch.ops.fusedmha.attention_forward(q, k, v, mask, p, False, **kw)
    keep = kernel_keep_mask(rng, q, k, p) if p > 0 else None
    ref, ref_lse, probs = reference_variants(q, k, v, mask, keep=keep, dropout_p=p, **kw)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    inputs = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    assert_same_gradients(out, ref, inputs)
    weights = torch.ops.fusedmha.attention_weights(q, k, lse, rng, mask, p, False, None, False,
                                                   True, **kw)
    want = probs if keep is None else probs * keep / (1 - p)
    torch.testing.assert_close(weights, want.mean(-3))


def reference_logsumexp(q, k, scale=None):
    """The log-sum-exp of each query's scaled scores in float64 (no mask): the kernels'
    logsumexp output."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    return torch.logsumexp((q.double() @ k.double().transpose(-1, -2)) * scale, dim=-1)


def kernel_keep_mask(rng, q, k, p):
    """The keep-mask fusedmha's kernels drew for a call (its rng_state), shaped (..., H, L, S)
    like the scores, on the query's device."""
    outer = q.shape[:-2]
    mask = torch.ops.fusedmha._dropout_keep_mask(rng.cpu(), math.prod(outer), q.size(-2), k.size(-2), p)
    return mask.view(*outer, q.size(-2), k.size(-2)).to(q.device)


def assert_close_to_truth(out, ref, torch_out=None, *, dtype=None, factor=2.0, floor=None, what="output"):
    """out within factor x PyTorch's own error against the float64 truth ref (when torch_out,
    PyTorch's answer at the same dtype, is given), or within the floor (default: the dtype's
    output floor on out's device) times max(1, |ref|). `what` names out in the message."""
    dtype = dtype or out.dtype
    floor = output_floor(dtype, out.device) if floor is None else floor
    ref = ref.detach().double().cpu()
    err = (out.detach().double().cpu() - ref).abs().max().item() if out.numel() else 0.0
    torch_err = 0.0
    if torch_out is not None and out.numel():
        # Older PyTorch versions give NaN where a row has no key to attend to; compare as 0.
        torch_err = (torch.nan_to_num(torch_out.detach().double().cpu(), nan=0.0) - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item() if ref.numel() else 1.0)
    bound = factor * torch_err + floor * scale
    assert not torch.isnan(out).any(), f"{what} has NaN"
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g} (PyTorch's error {torch_err:.3g})"


def assert_attention_close(out, q, k, v, **kwargs):
    """out must be as close to the float64 truth as PyTorch's own SDPA at the same dtype
    (within 2x), or within the dtype's floor."""
    ref = reference_attention(q, k, v, **kwargs)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == q.dtype
    torch_kwargs = dict(kwargs)
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.dim() < 2:  # PyTorch's CPU kernels want >= 2-D masks
        torch_kwargs["attn_mask"] = mask.expand(q.size(-2), k.size(-2))
    torch_out = F.scaled_dot_product_attention(q, k, v, **torch_kwargs)
    assert_close_to_truth(out, ref, torch_out)


# --------------------------------------------------------------------------------------
# MultiheadAttention
# --------------------------------------------------------------------------------------


def as64(module):
    """PyTorch's module in float64 with the same (rounded) parameters: the truth for bf16."""
    return copy.deepcopy(module).to(torch.float64)


def params64(m):
    return {n: p.detach().double().requires_grad_() for n, p in m.named_parameters()}


def reference_mha(m, query, key, value, key_padding_mask=None, attn_mask=None, is_causal=False,
                  need_weights=True, average_attn_weights=True, keep=None, params=None):
    """Multi-head attention in float64 from the parameters of module m (or `params`, a dict by
    name). Rows with no visible key give attention 0 (output = out_proj.bias) with gradient 0.
    `keep` (N, H, L, S'), when given, is the dropout keep-mask applied with scale 1/(1-p)."""
    P = params if params is not None else {n: p.double() for n, p in m.named_parameters()}
    E, H = m.embed_dim, m.num_heads
    hd = E // H
    batched = query.dim() == 3
    query, key, value = query.double(), key.double(), value.double()
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif m.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    L, N, _ = query.shape
    S = key.shape[0]
    if P.get("in_proj_weight") is not None:
        wq, wk, wv = P["in_proj_weight"].chunk(3)
    else:
        wq, wk, wv = P["q_proj_weight"], P["k_proj_weight"], P["v_proj_weight"]
    bq = bk = bv = None
    if P.get("in_proj_bias") is not None:
        bq, bk, bv = P["in_proj_bias"].chunk(3)
    q, k, v = F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)  # (T, N, E)
    add = torch.zeros(N, H, L, S, dtype=torch.float64, device=query.device)
    if is_causal:  # True = masked (top-left aligned)
        add = add.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=query.device).tril(), NEG_INF)
    if attn_mask is not None:
        am = attn_mask.view(N, H, L, S) if attn_mask.dim() == 3 else attn_mask
        add = add.masked_fill(am, NEG_INF) if am.dtype == torch.bool else add + am.double()
    if key_padding_mask is not None:
        kp = key_padding_mask.view(N, 1, 1, S)
        add = add.masked_fill(kp, NEG_INF) if kp.dtype == torch.bool else add + kp.double()
    if P.get("bias_k") is not None:
        k = torch.cat([k, P["bias_k"].expand(1, N, E)])
        v = torch.cat([v, P["bias_v"].expand(1, N, E)])
        add = F.pad(add, (0, 1))
    q = q.view(L, N, H, hd).permute(1, 2, 0, 3)
    k = k.view(k.shape[0], N, H, hd).permute(1, 2, 0, 3)
    v = v.view(v.shape[0], N, H, hd).permute(1, 2, 0, 3)
    if m.add_zero_attn:
        k = torch.cat([k, k.new_zeros(N, H, 1, hd)], dim=2)
        v = torch.cat([v, v.new_zeros(N, H, 1, hd)], dim=2)
        add = F.pad(add, (0, 1))
    scores = q @ k.transpose(-2, -1) / math.sqrt(hd) + add
    attends = (scores > NEG_INF).any(dim=-1, keepdim=True)
    probs = torch.softmax(torch.where(attends, scores, torch.zeros_like(scores)), dim=-1) * attends
    if keep is not None:
        probs = probs * keep / (1 - m.dropout)
    out = (probs @ v).permute(2, 0, 1, 3).reshape(L, N, E)
    out = F.linear(out, P["out_proj.weight"], P.get("out_proj.bias"))
    w = probs.mean(dim=1) if average_attn_weights else probs
    if not batched:
        out, w = out.squeeze(1), w.squeeze(0)
    elif m.batch_first:
        out = out.transpose(0, 1)
    return out, (w if need_weights else None)


def check(name, got, exp, exp64=None):
    """got (fused) against exp (PyTorch at the same dtype); for low precision, fused must be
    within 2x PyTorch's own error against exp64 (PyTorch in float64), plus a floor."""
    assert got is not None, f"{name}: got None"
    assert got.shape == exp.shape, f"{name}: shape {tuple(got.shape)} != {tuple(exp.shape)}"
    assert got.dtype == exp.dtype, f"{name}: dtype {got.dtype} != {exp.dtype}"
    if got.numel() == 0:
        return
    assert torch.isfinite(got).all(), f"{name}: {nonfinite(got)}"
    tol = MHA_TOL[device_type(got.device)]
    if exp.dtype in tol:
        rtol, atol = tol[exp.dtype]
        torch.testing.assert_close(got, exp, rtol=rtol, atol=atol * scale_of(exp), msg=lambda m: f"{name}: {m}")
    else:
        assert exp64 is not None
        err = (got.double() - exp64).abs().max().item()
        torch_err = (exp.double() - exp64).abs().max().item()
        bound = 2 * torch_err + 1e-2 * scale_of(exp64)
        assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g} (PyTorch's {torch_err:.3g})"


def grads_of(loss, inputs, module):
    names = [n for n, _ in module.named_parameters()]
    params = [p for _, p in module.named_parameters()]
    g = torch.autograd.grad(loss, list(inputs) + params, allow_unused=True)
    return list(g[: len(inputs)]), dict(zip(names, g[len(inputs):]))


def loss_of(out, w, go, gw):
    loss = (out * go).sum()
    if w is not None and gw is not None:
        loss = loss + (w * gw).sum()
    return loss


def compare_runs(mod, ref, f_in, r_in, f_kw, r_kw, dtype, grads=True, name=""):
    """Run both modules (and PyTorch in float64 for bf16), compare outputs, weights and grads."""
    out_f, w_f = mod(*f_in, **f_kw)
    out_r, w_r = ref(*r_in, **r_kw)
    out_64 = w_64 = ref64 = in64 = None
    if dtype not in MHA_TOL[device_type(out_r.device)]:
        ref64 = as64(ref)
        in64 = leaves(*(t.double() for t in r_in))
        kw64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                for k, v in r_kw.items()}
        out_64, w_64 = ref64(*in64, **kw64)
    check(f"{name} output", out_f, out_r, None if out_64 is None else out_64.detach())
    if w_r is None:
        assert w_f is None, f"{name}: weights should be None with need_weights=False"
    else:
        check(f"{name} weights", w_f, w_r, None if w_64 is None else w_64.detach())
    if not grads:
        return
    go = torch.randn(out_r.shape).to(out_r.device, dtype)
    gw = None if w_r is None else torch.randn(w_r.shape).to(w_r.device, dtype)
    gi_f, gp_f = grads_of(loss_of(out_f, w_f, go, gw), f_in, mod)
    gi_r, gp_r = grads_of(loss_of(out_r, w_r, go, gw), r_in, ref)
    gi_64, gp_64 = [None] * len(gi_r), dict.fromkeys(gp_r)
    if ref64 is not None:
        gi_64, gp_64 = grads_of(loss_of(out_64, w_64, go.double(), None if gw is None else gw.double()), in64, ref64)
    for i, (a, b, c) in enumerate(zip(gi_f, gi_r, gi_64)):
        check(f"{name} grad of input {i}", a, b, c)
    assert list(gp_f) == list(gp_r), f"{name}: parameter names {list(gp_f)} != {list(gp_r)}"
    for n in gp_r:
        check(f"{name} grad of {n}", gp_f[n], gp_r[n], gp_64[n])


def compare_with_reference(mod, x, kw, name="", tol=(1e-4, 2e-5)):
    """Fused output/weights/grads against reference_mha (float64)."""
    f_in = leaves(*x)
    r_in = leaves(*(t.double() for t in x))
    P = params64(mod)
    out_f, w_f = mod(*f_in, **kw)
    out_r, w_r = reference_mha(mod, *r_in, params=P, **kw)
    assert torch.isfinite(out_f).all(), f"{name} output: {nonfinite(out_f)}"
    torch.testing.assert_close(out_f.double(), out_r, rtol=tol[0], atol=tol[1] * scale_of(out_r),
                               msg=lambda m: f"{name} output: {m}")
    if w_r is not None:
        assert torch.isfinite(w_f).all(), f"{name} weights: {nonfinite(w_f)}"
        torch.testing.assert_close(w_f.double(), w_r, rtol=tol[0], atol=tol[1], msg=lambda m: f"{name} weights: {m}")
    go = torch.randn(out_r.shape)
    gw = None if w_r is None else torch.randn(w_r.shape)
    names = [n for n, _ in mod.named_parameters()]
    g_f = torch.autograd.grad(loss_of(out_f, w_f, go, gw), f_in + [p for _, p in mod.named_parameters()])
    g_r = torch.autograd.grad(loss_of(out_r, w_r, go.double(), None if gw is None else gw.double()),
                              r_in + [P[n] for n in names])
    for label, a, b in zip([f"input {i}" for i in range(len(x))] + names, g_f, g_r):
        assert torch.isfinite(a).all(), f"{name} grad of {label}: {nonfinite(a)}"
        torch.testing.assert_close(a.double(), b, rtol=tol[0] * 5, atol=tol[1] * 5 * scale_of(b),
                                   msg=lambda m: f"{name} grad of {label}: {m}")
    return out_f, w_f
