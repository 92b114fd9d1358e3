"""nn.TransformerEncoder/DecoderLayer with their attention swapped for fusedmha's: the same
outputs and gradients as PyTorch's layers, on the layers' fast path too."""

import copy

import pytest
import torch
from torch import nn

import fusedmha
from mha_inputs import NEG_INF, bool_mask, fused_mha, make_pair, randomize_biases
from reference import check, leaves

pytestmark = pytest.mark.usefixtures("one_thread")


def swap_attention(model):
    """Replace every nn.MultiheadAttention inside model by a fused one with the same weights."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.MultiheadAttention:
                new = fused_mha(child.embed_dim, child.num_heads, dropout=child.dropout,
                                bias=child.in_proj_bias is not None, add_bias_kv=child.bias_k is not None,
                                add_zero_attn=child.add_zero_attn, kdim=child.kdim, vdim=child.vdim,
                                batch_first=child.batch_first)
                new.load_state_dict(child.state_dict())
                new.train(child.training)
                setattr(parent, name, new)
    return model


def make_encoders(batch_first, nhead=4, layers=2):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, nhead, dim_feedforward=32, dropout=0.0, batch_first=batch_first)
    ref = nn.TransformerEncoder(layer, layers, enable_nested_tensor=batch_first)
    for m in ref.modules():
        if isinstance(m, nn.MultiheadAttention):
            randomize_biases(m)
    fused = swap_attention(copy.deepcopy(ref))
    assert sum(isinstance(m, fusedmha.MultiheadAttention) for m in fused.modules()) == layers
    return ref, fused


def encoder_inputs(batch_first, mask):
    N, L = 3, 7
    src = torch.randn((N, L, 16) if batch_first else (L, N, 16))
    kw = {}
    if mask == "kpm":
        kpm = torch.zeros(N, L, dtype=torch.bool)
        kpm[1, 5:] = True  # right padding (the nested-tensor fast path wants left-aligned)
        kpm[2, 3:] = True
        kw["src_key_padding_mask"] = kpm
    elif mask == "causal":
        kw.update(mask=nn.Transformer.generate_square_subsequent_mask(L), is_causal=True)
    elif mask == "am":
        kw["mask"] = bool_mask((L, L))
    return src, kw


def module_grads(loss, inputs, model):
    params = list(model.parameters())
    return torch.autograd.grad(loss, list(inputs) + params)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("mask", ["none", "kpm", "causal", "am"])
def test_transformer_encoder_with_fused_attention(batch_first, mode, mask):
    ref, fused = make_encoders(batch_first)
    assert list(fused.state_dict()) == list(ref.state_dict())
    ref.train(mode == "train")
    fused.train(mode == "train")
    src, kw = encoder_inputs(batch_first, mask)
    (sf,), (sr,) = leaves(src), leaves(src)
    out_f, out_r = fused(sf, **kw), ref(sr, **kw)
    check("encoder output", out_f, out_r)
    go = torch.randn_like(out_r)
    gf = module_grads((out_f * go).sum(), [sf], fused)
    gr = module_grads((out_r * go).sum(), [sr], ref)
    names = ["src"] + [n for n, _ in ref.named_parameters()]
    for n, a, b in zip(names, gf, gr):
        check(f"grad of {n}", a, b)


@pytest.mark.parametrize("masks", ["none", "kpm", "am2", "am3", "both"])
def test_merge_masks_like_pytorch(masks):
    """nn.MultiheadAttention.merge_masks is public and nn.TransformerEncoderLayer's fast path
    calls it on self_attn."""
    ref, mod = make_pair(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    am = kpm = None
    if masks in ("kpm", "both"):
        kpm = bool_mask((2, 5))
    if masks in ("am2", "both"):
        am = bool_mask((5, 5))
    if masks == "am3":
        am = bool_mask((8, 5, 5))
    if am is not None:  # nn.TransformerEncoderLayer hands over canonical (float) masks
        am = torch.zeros(am.shape).masked_fill(am, NEG_INF)
    if kpm is not None:
        kpm = torch.zeros(kpm.shape).masked_fill(kpm, NEG_INF)
    got = mod.merge_masks(am, kpm, x)
    exp = ref.merge_masks(am, kpm, x)
    assert got[1] == exp[1]
    assert (got[0] is None) == (exp[0] is None)
    if exp[0] is not None:
        torch.testing.assert_close(got[0], exp[0])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("mask", ["none", "kpm", "causal", "am"])
@pytest.mark.parametrize("fastpath", [True, False])
def test_transformer_encoder_eval_inference(mask, fastpath):
    """eval + no_grad + batch_first + even heads: nn.TransformerEncoderLayer's fast path reads
    self_attn's attributes (in_proj_weight, merge_masks, ...) and bypasses its forward; with
    the fast path off the fused forward runs. Both must give PyTorch's answer."""
    ref, fused = make_encoders(True)
    ref.eval()
    fused.eval()
    src, kw = encoder_inputs(True, mask)
    calls = []
    if not fastpath:  # a hook also keeps the layer off its fast path
        for m in fused.modules():
            if isinstance(m, fusedmha.MultiheadAttention):
                m.register_forward_hook(lambda *a: calls.append(1))
    old = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(fastpath)
    try:
        with torch.no_grad():
            out_f = fused(src, **kw)
            out_r = ref(src, **kw)
    finally:
        torch.backends.mha.set_fastpath_enabled(old)
    if not fastpath:
        assert len(calls) == 2
    if mask == "kpm":  # padded positions: the nested fast path gives 0 there, the slow path values
        keep = ~kw["src_key_padding_mask"]
        out_f, out_r = out_f[keep], out_r[keep]
    check("encoder output", out_f, out_r)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_transformer_decoder_layer_with_fused_attention(batch_first, mode):
    torch.manual_seed(0)
    ref = nn.TransformerDecoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=batch_first)
    for m in ref.modules():
        if isinstance(m, nn.MultiheadAttention):
            randomize_biases(m)
    fused = swap_attention(copy.deepcopy(ref))
    assert isinstance(fused.self_attn, fusedmha.MultiheadAttention)
    assert isinstance(fused.multihead_attn, fusedmha.MultiheadAttention)
    ref.train(mode == "train")
    fused.train(mode == "train")
    N, T, M = 2, 6, 9
    tgt = torch.randn((N, T, 16) if batch_first else (T, N, 16))
    mem = torch.randn((N, M, 16) if batch_first else (M, N, 16))
    mkpm = bool_mask((N, M))
    kw = dict(tgt_mask=nn.Transformer.generate_square_subsequent_mask(T), tgt_is_causal=True,
              memory_key_padding_mask=mkpm.float().masked_fill(mkpm, NEG_INF))
    tf, mf = leaves(tgt, mem)
    tr, mr = leaves(tgt, mem)
    out_f, out_r = fused(tf, mf, **kw), ref(tr, mr, **kw)
    check("decoder output", out_f, out_r)
    go = torch.randn_like(out_r)
    gf = module_grads((out_f * go).sum(), [tf, mf], fused)
    gr = module_grads((out_r * go).sum(), [tr, mr], ref)
    for n, a, b in zip(["tgt", "memory"] + [n for n, _ in ref.named_parameters()], gf, gr):
        check(f"grad of {n}", a, b)

