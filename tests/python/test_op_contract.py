"""The op contract: schema/fake-tensor/autograd registration (opcheck), torch.compile with
dynamic shapes, torch.export, and the build information. opcheck and torch.compile run on
every device (the `device` fixture: CUDA cases skip, with the reason, without a GPU)."""

import pytest
import torch

import fusedmha

OP = torch.ops.fusedmha.attention_forward.default


def sample_inputs(device="cpu"):
    def r(*shape, **kwargs):
        return torch.randn(*shape, device=device, **kwargs)

    yield (r(2, 4, 19, 16), r(2, 4, 23, 16), r(2, 4, 23, 8)), {}
    yield (r(2, 4, 19, 16), r(2, 4, 23, 16), r(2, 4, 23, 16)), {"is_causal": True, "scale": 0.3}
    yield (r(2, 4, 19, 16), r(2, 4, 23, 16), r(2, 4, 23, 16)), {"attn_mask": (torch.rand(19, 23) > 0.3).to(device)}
    yield (r(2, 4, 19, 16), r(2, 4, 23, 16), r(2, 4, 23, 16)), {"attn_mask": r(4, 1, 23)}
    yield (r(2, 8, 19, 16), r(2, 2, 23, 16), r(2, 2, 23, 16)), {"enable_gqa": True}
    yield (r(2, 19, 4, 16).transpose(1, 2), r(2, 4, 23, 16), r(2, 4, 23, 16)), {}
    yield (r(19, 16, dtype=torch.bfloat16), r(23, 16, dtype=torch.bfloat16), r(23, 8, dtype=torch.bfloat16)), {}
    yield (r(3, 2, 4, 5, 8, dtype=torch.float64), r(3, 2, 4, 6, 8, dtype=torch.float64),
           r(3, 2, 4, 6, 8, dtype=torch.float64)), {}


@pytest.mark.parametrize("case", range(8))
def test_opcheck_forward(case, device):
    args, kwargs = list(sample_inputs(device))[case]
    torch.library.opcheck(OP, args, kwargs)


def test_opcheck_composite(device):
    args, kwargs = next(iter(sample_inputs(device)))
    torch.library.opcheck(torch.ops.fusedmha.scaled_dot_product_attention.default, args, kwargs)


def attention_block(q, k, v, mask):
    # A function of the kind users compile: projections around the fused op.
    return fusedmha.scaled_dot_product_attention(q * 2.0, k, v, attn_mask=mask).relu()


def test_torch_compile_fullgraph_dynamic(device, rand):
    torch._dynamo.reset()
    compiled = torch.compile(attention_block, fullgraph=True, dynamic=True)
    for B, L, S in [(2, 19, 23), (3, 7, 40), (1, 33, 5)]:
        q, k, v = rand(B, 4, L, 16), rand(B, 4, S, 16), rand(B, 4, S, 8)
        mask = (torch.rand(L, S) > 0.2).to(device)
        torch.testing.assert_close(compiled(q, k, v, mask), attention_block(q, k, v, mask))


def test_torch_compile_causal_gqa(rand):
    torch._dynamo.reset()

    def f(q, k, v):
        return fusedmha.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for L in [17, 64]:
        q, k, v = rand(2, 8, L, 16), rand(2, 2, L, 16), rand(2, 2, L, 16)
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v))


def test_torch_compile_fullgraph_half_with_backward(rand):
    """float16, two 64-row tiles, compiled with the default backend: the same output as eager,
    and a backward through the compiled graph."""
    torch._dynamo.reset()

    def f(q, k, v):
        return fusedmha.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (rand(2, 4, 128, 64, dtype=torch.float16).requires_grad_() for _ in range(3))
    compiled = torch.compile(f, fullgraph=True)
    out = compiled(q, k, v)
    torch.testing.assert_close(out, f(q, k, v))
    out.float().sum().backward()
    assert q.grad is not None


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, 4, 8).unbind(2)
        out = fusedmha.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2).reshape(B, L, 32)


def test_torch_export():
    model = Block().eval()
    x = torch.randn(2, 10, 32)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", min=2)
    exported = torch.export.export(model, (x,), dynamic_shapes={"x": {0: batch, 1: seq}})
    assert any("fusedmha" in str(n.target) for n in exported.graph.nodes)
    for shape in [(2, 10, 32), (3, 17, 32)]:
        x = torch.randn(shape)
        torch.testing.assert_close(exported.module()(x), model(x))


def test_meta_tensors_give_shapes():
    q = torch.empty(2, 4, 19, 16, device="meta")
    k = torch.empty(2, 4, 23, 16, device="meta")
    v = torch.empty(2, 4, 23, 8, device="meta")
    out, lse, rng = OP(q, k, v)
    assert out.shape == (2, 4, 19, 8) and out.device.type == "meta"
    assert lse.shape == (2, 4, 19) and lse.dtype == torch.float32
    assert rng.shape == (2,) and rng.dtype == torch.int64


def test_build_info():
    info = fusedmha.build_info()
    assert info["version"] == fusedmha.__version__
    assert info["torch_version"].split(".")[:2] == torch.__version__.split("+")[0].split(".")[:2]
    assert "default" in info["cpu_isas"]
    assert info["cpu_isa_in_use"] in info["cpu_isas"]
    assert info["cuda"] in (True, False)
