"""What the MultiheadAttention tests feed both modules: a PyTorch module and a fused one with
the same arguments and parameters, their inputs, and masks of every kind.

Inputs and masks are drawn on the CPU (the same values whatever the device) and then moved
to `device`."""

import torch
from torch import nn

import fusedmha

BF16 = torch.bfloat16
NEG_INF = float("-inf")


def fused_mha(*args, **kwargs):
    return fusedmha.MultiheadAttention(*args, **kwargs)


def randomize_biases(mha, std=0.5):
    """nn.MultiheadAttention zero-initialises its biases; make them matter."""
    with torch.no_grad():
        for name, p in mha.named_parameters():
            if "bias" in name:
                p.copy_(torch.randn_like(p) * std)


def make_pair(*args, bias_std=0.5, **kwargs):
    """(PyTorch module, fused module) with the same arguments and the same parameters."""
    ref = nn.MultiheadAttention(*args, **kwargs)
    randomize_biases(ref, bias_std)
    mod = fused_mha(*args, **kwargs)
    mod.load_state_dict(ref.state_dict())  # strict: same names and shapes
    return ref, mod


def bool_mask(shape, device="cpu"):
    m = torch.rand(shape) < 0.35
    m[..., 0] = False  # key 0 always visible: no row is fully masked
    return m.to(device)


def float_mask(shape, dtype, device="cpu"):
    m = torch.randn(shape).masked_fill(torch.rand(shape) < 0.25, NEG_INF)
    m[..., 0] = torch.randn(shape[:-1])
    return m.to(device, dtype)


def causal_bool(L, S, device="cpu"):
    return ~torch.ones(L, S, dtype=torch.bool, device=device).tril()  # True = masked (top-left aligned)


def causal_float(L, S, dtype, device="cpu"):
    return torch.zeros(L, S, dtype=dtype, device=device).masked_fill(causal_bool(L, S, device), NEG_INF)


CAUSAL_KINDS = ("causal", "causal_mask_bool", "causal_mask_float", "causal_kpm")
MASK_KINDS = ("none", "kpm_bool", "kpm_float", "am2_bool", "am2_float", "am3_bool", "am3_float",
              "both_bool", "both_float") + CAUSAL_KINDS


def make_masks(kind, N, H, L, S, dtype, batched, device="cpu"):
    """(fused kwargs, PyTorch kwargs) for a mask kind. PyTorch gets causal masks explicitly."""
    kpm_shape = (N, S) if batched else (S,)
    am3_shape = (N * H, L, S) if batched else (H, L, S)
    f, r = {}, {}
    if kind == "kpm_bool":
        f["key_padding_mask"] = bool_mask(kpm_shape, device)
    elif kind == "kpm_float":
        f["key_padding_mask"] = float_mask(kpm_shape, dtype, device)
    elif kind == "am2_bool":
        f["attn_mask"] = bool_mask((L, S), device)
    elif kind == "am2_float":
        f["attn_mask"] = float_mask((L, S), dtype, device)
    elif kind == "am3_bool":
        f["attn_mask"] = bool_mask(am3_shape, device)
    elif kind == "am3_float":
        f["attn_mask"] = float_mask(am3_shape, dtype, device)
    elif kind == "both_bool":
        f["key_padding_mask"], f["attn_mask"] = bool_mask(kpm_shape, device), bool_mask(am3_shape, device)
    elif kind == "both_float":
        f["key_padding_mask"], f["attn_mask"] = float_mask(kpm_shape, dtype, device), float_mask((L, S), dtype, device)
    elif kind == "causal":
        f["is_causal"] = True
        r["attn_mask"] = causal_bool(L, S, device)
    elif kind == "causal_mask_bool":
        f["attn_mask"], f["is_causal"] = causal_bool(L, S, device), True
    elif kind == "causal_mask_float":
        f["attn_mask"], f["is_causal"] = causal_float(L, S, dtype, device), True
    elif kind == "causal_kpm":
        f["is_causal"], f["key_padding_mask"] = True, bool_mask(kpm_shape, device)
        r["attn_mask"] = causal_bool(L, S, device)
    else:
        assert kind == "none"
    if "key_padding_mask" in f:
        r["key_padding_mask"] = f["key_padding_mask"]
    if "attn_mask" in f:
        r["attn_mask"] = f["attn_mask"]  # with is_causal: PyTorch gets the mask, not the hint
    return f, r


def make_inputs(N, L, S, E, kd, vd, dtype, batched, batch_first, device="cpu"):
    def shape(T, D):
        if not batched:
            return (T, D)
        return (N, T, D) if batch_first else (T, N, D)

    return (torch.randn(shape(L, E)).to(device, dtype), torch.randn(shape(S, kd)).to(device, dtype),
            torch.randn(shape(S, vd)).to(device, dtype))
