"""fusedmha.MultiheadAttention is a drop-in nn.MultiheadAttention: the same constructor and
forward signatures, attributes, parameters, state_dict layout and initialisation, and
state_dicts that load both ways."""

import inspect
import math

import pytest
import torch
from torch import nn

import fusedmha
from mha_inputs import bool_mask, fused_mha, make_inputs, make_pair, randomize_biases
from reference import compare_runs, leaves

pytestmark = pytest.mark.usefixtures("one_thread")


CONFIGS = [
    dict(),
    dict(bias=False),
    dict(add_bias_kv=True),
    dict(add_zero_attn=True),
    dict(kdim=6, vdim=10),
    dict(kdim=16),
    dict(bias=False, add_bias_kv=True, add_zero_attn=True, kdim=5, vdim=7, batch_first=True, dropout=0.25),
]


def test_signatures_match_pytorch():
    import inspect

    for fn in ("__init__", "forward"):
        ours = inspect.signature(getattr(fusedmha.MultiheadAttention, fn))
        theirs = inspect.signature(getattr(nn.MultiheadAttention, fn))
        assert [(p.name, p.default, p.kind) for p in ours.parameters.values()] == \
               [(p.name, p.default, p.kind) for p in theirs.parameters.values()], fn


def test_is_a_module_and_positional_constructor():
    m = fused_mha(16, 4, 0.1, False, True, True, 8, 12, True)
    r = nn.MultiheadAttention(16, 4, 0.1, False, True, True, 8, 12, True)
    assert isinstance(m, nn.Module)
    for attr in ("embed_dim", "num_heads", "dropout", "kdim", "vdim", "batch_first", "add_zero_attn",
                 "_qkv_same_embed_dim", "head_dim"):
        assert getattr(m, attr) == getattr(r, attr), attr
    assert m.bias_k is not None and m.in_proj_bias is None


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_attributes(cfg):
    r = nn.MultiheadAttention(16, 4, **cfg)
    m = fused_mha(16, 4, **cfg)
    for attr in ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "dropout", "batch_first", "add_zero_attn",
                 "_qkv_same_embed_dim"):
        assert getattr(m, attr) == getattr(r, attr), attr
        assert type(getattr(m, attr)) is type(getattr(r, attr)), attr
    assert isinstance(m.dropout, float)
    for attr in ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight", "bias_k",
                 "bias_v"):
        a, b = getattr(m, attr), getattr(r, attr)
        assert (a is None) == (b is None), attr
        if b is not None:
            assert isinstance(a, nn.Parameter), attr
            assert a.shape == b.shape, attr
    assert isinstance(m.out_proj, nn.Linear)
    assert m.out_proj.in_features == m.out_proj.out_features == 16
    assert (m.out_proj.bias is None) == (r.out_proj.bias is None)


def test_dropout_attribute_is_float():
    assert isinstance(fused_mha(8, 2).dropout, float)
    assert fused_mha(8, 2, dropout=0.5).dropout == 0.5


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_parameters_and_state_dict_layout(cfg):
    r = nn.MultiheadAttention(16, 4, **cfg)
    m = fused_mha(16, 4, **cfg)
    assert [(n, p.shape) for n, p in m.named_parameters()] == [(n, p.shape) for n, p in r.named_parameters()]
    assert [(n, t.shape) for n, t in m.state_dict().items()] == [(n, t.shape) for n, t in r.state_dict().items()]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_fresh_initialisation_like_pytorch(cfg):
    m = fused_mha(16, 4, **cfg)
    if m.in_proj_bias is not None:
        assert torch.equal(m.in_proj_bias, torch.zeros_like(m.in_proj_bias))
        assert torch.equal(m.out_proj.bias, torch.zeros_like(m.out_proj.bias))
    for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
        w = getattr(m, name)
        if w is not None:
            bound = math.sqrt(6.0 / (w.size(0) + w.size(1)))  # xavier_uniform_
            assert w.abs().max() <= bound + 1e-6 and w.abs().max() > 0.3 * bound, name
    if m.bias_k is not None:
        assert m.bias_k.abs().sum() > 0 and m.bias_v.abs().sum() > 0


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_state_dict_round_trip_both_ways(cfg):
    E, H = 16, 4
    kw = {k: v for k, v in cfg.items() if k != "dropout"}
    ref, mod = make_pair(E, H, **kw)  # PyTorch -> fused
    x = make_inputs(2, 5, 6, E, cfg.get("kdim", E), cfg.get("vdim", E), torch.float32, True,
                    cfg.get("batch_first", False))
    kpm = bool_mask((2, 6))
    compare_runs(mod, ref, leaves(*x), leaves(*x), dict(key_padding_mask=kpm), dict(key_padding_mask=kpm),
                 torch.float32, name="pytorch->fused")

    mod2 = fused_mha(E, H, **kw)
    randomize_biases(mod2)
    with torch.no_grad():
        for p in mod2.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ref2 = nn.MultiheadAttention(E, H, **kw)
    ref2.load_state_dict(mod2.state_dict())  # fused -> PyTorch
    for (n, a), (_, b) in zip(mod2.state_dict().items(), ref2.state_dict().items()):
        assert torch.equal(a, b), n
    compare_runs(mod2, ref2, leaves(*x), leaves(*x), {}, {}, torch.float32, name="fused->pytorch")

