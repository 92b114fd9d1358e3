"""examples/python/migrate_tutorial_attention.py (docs/migrating.md): every fusedmha port of a
tutorial attention class matches the corrected float64 reference with the same weights
(outputs, input and parameter gradients, masks, eval and training), and every bug the doc
describes is really there in the tutorial class."""

import math

import pytest
import torch

import migrate_tutorial_attention as mig  # examples/python: on sys.path through pytest's pythonpath
from reference import kernel_keep_mask, leaves, params64, reference_mha

N, E, H = 2, 16, 4  # batch, embedding, heads (head_dim 4)
L, S = 7, 9  # query length, context length
LENGTHS = torch.tensor([S, 5])  # batch entry 1 has padding
DTYPES = [torch.float32, torch.float64]


def tol(dtype):
    return {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float64: dict(rtol=1e-10, atol=1e-10)}[dtype]


def grad_tol(dtype):
    return {torch.float32: dict(rtol=2e-4, atol=2e-4), torch.float64: dict(rtol=1e-9, atol=1e-9)}[dtype]


@torch.no_grad()
def randomize_(module, std=0.5):
    """Every parameter random (biases and LayerNorm included), so every gradient matters."""
    for p in module.parameters():
        p.copy_(torch.randn_like(p) * std)
    return module


def run(module, inputs, kwargs, grad_out):
    """Output, then gradients of the float inputs and of every parameter (by name)."""
    out = module(*inputs, **kwargs)
    params = dict(module.named_parameters())
    wrt = [t for t in inputs if torch.is_tensor(t) and t.requires_grad] + list(params.values())
    grads = torch.autograd.grad(out, wrt, grad_out.to(out.dtype))
    n = len(wrt) - len(params)
    return out, grads[:n], dict(zip(params, grads[n:]))


def assert_all_close(actual, expected, tolerance):
    actual, expected = list(actual), list(expected)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.double(), e.double(), **tolerance)


def padding_attend():
    return (torch.arange(S) < LENGTHS[:, None])  # (N, S) True = token


# ---------------------------------------------------------------------------------------------
# Shape 1: MultiHeadAttention(embed_size, heads), shared per-head projection
# ---------------------------------------------------------------------------------------------

# case: (self-attention?, tutorial mask builder (0 = masked), is_causal)
SHAPE1_CASES = {
    "self": (True, None, False),
    "self_padding": (True, lambda: mig.make_src_mask(torch.tensor([L, 4]), L), False),
    "causal_mask_tensor": (True, lambda: mig.make_trg_mask(N, L), False),
    "causal_mask_2d": (True, lambda: torch.ones(L, L).tril(), False),
    "causal_flag": (True, None, True),
    "causal_flag_padding": (True, lambda: mig.make_src_mask(torch.tensor([L, 4]), L), True),
    "causal_and_padding_tensor": (
        True, lambda: mig.make_trg_mask(N, L) * mig.make_src_mask(torch.tensor([L, 4]), L), False),
    "cross_padding": (False, lambda: mig.make_src_mask(LENGTHS, S), False),
    "cross_bool_padding": (False, lambda: padding_attend()[:, None, None, :], False),
}


def shape1_data(case):
    """(values, keys, query, mask, is_causal) of a case; self-attention passes one tensor."""
    self_attention, make_mask, is_causal = SHAPE1_CASES[case]
    query = torch.randn(N, L, E)
    values, keys = (query, query) if self_attention else (torch.randn(N, S, E), torch.randn(N, S, E))
    mask = None if make_mask is None else make_mask()
    return values, keys, query, mask, is_causal


def shape1_run(module, dtype, data, grad_out):
    values, keys, query, mask, is_causal = data
    if values is query:
        (x,) = leaves(query, dtype=dtype)
        inputs = (x, x, x)
    else:
        inputs = tuple(leaves(values, keys, query, dtype=dtype))
    return run(module, (*inputs, mask), dict(is_causal=is_causal), grad_out)


@pytest.mark.parametrize("case", list(SHAPE1_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shape1_shared_projection_port_matches_reference(dtype, case):
    old = randomize_(mig.TutorialMultiHeadAttention(E, H))
    ref = mig.ReferenceMultiHeadAttention.from_original(old, dropout=0.3).double().eval()
    port = mig.FusedSharedProjectionAttention.from_original(old, dropout=0.3).to(dtype).eval()
    assert port.state_dict().keys() == old.state_dict().keys()
    grad_out = torch.randn(N, L, E, dtype=torch.float64)
    data = shape1_data(case)
    out, in_grads, p_grads = shape1_run(port, dtype, data, grad_out)
    ref_out, ref_in_grads, ref_p_grads = shape1_run(ref, torch.float64, data, grad_out)
    torch.testing.assert_close(out.double(), ref_out, **tol(dtype))
    assert_all_close(in_grads, ref_in_grads, grad_tol(dtype))
    assert p_grads.keys() == ref_p_grads.keys()
    assert_all_close(p_grads.values(), ref_p_grads.values(), grad_tol(dtype))


def full_projection_reference(mha, values, keys, query, attend, is_causal):
    """nn.MultiheadAttention's math in plain float64 (reference.reference_mha), on leaf copies
    of ``mha``'s parameters (fused port's recommended form): full E x E projections, then
    attention per head."""
    params = params64(mha)
    out, _ = reference_mha(mha, query, keys, values, attn_mask=None if attend is None else ~attend,
                           is_causal=is_causal, need_weights=False, params=params)
    return out, params


@pytest.mark.parametrize("case", ["self", "causal_mask_tensor", "causal_flag_padding",
                                  "causal_and_padding_tensor", "cross_padding"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shape1_full_projection_port_matches_reference(dtype, case):
    old = randomize_(mig.TutorialMultiHeadAttention(E, H))
    shared_ref = mig.ReferenceMultiHeadAttention.from_original(old).double()
    port = mig.FusedMultiHeadAttention.from_original(old, dropout=0.3).to(dtype).eval()
    grad_out = torch.randn(N, L, E, dtype=torch.float64)
    data = shape1_data(case)
    out, in_grads, p_grads = shape1_run(port, dtype, data, grad_out)

    # Ported, the block-diagonal full projection computes what the shared one did.
    ref_out, ref_in_grads, shared_grads = shape1_run(shared_ref, torch.float64, data, grad_out)
    torch.testing.assert_close(out.double(), ref_out, **tol(dtype))
    assert_all_close(in_grads, ref_in_grads, grad_tol(dtype))
    # Chain rule of the tying: the shared weight's gradient is the sum of its diagonal blocks.
    d = E // H
    for i, name in enumerate(["queries.weight", "keys.weight", "values.weight"]):
        g = p_grads["mha.in_proj_weight"][i * E:(i + 1) * E]
        diag_sum = sum(g[h * d:(h + 1) * d, h * d:(h + 1) * d] for h in range(H))
        torch.testing.assert_close(diag_sum.double(), shared_grads[name], **grad_tol(dtype))
    torch.testing.assert_close(p_grads["mha.out_proj.weight"].double(), shared_grads["fc_out.weight"], **grad_tol(dtype))

    # Every parameter's gradient, off-diagonal blocks and in_proj_bias included, against the
    # full-projection math in float64: training is free to leave the block-diagonal form.
    values, keys, query, mask, is_causal = data
    values, keys, query = values.double(), keys.double(), query.double()
    attend = mig.tutorial_mask_to_sdpa(mask)
    full_out, params = full_projection_reference(port.mha, values, keys, query, attend, is_causal)
    full_grads = torch.autograd.grad(full_out, list(params.values()), grad_out)
    for name, g in zip(params, full_grads):
        torch.testing.assert_close(p_grads["mha." + name].double(), g, **grad_tol(dtype))
    off_diag = p_grads["mha.in_proj_weight"][:E, d:2 * d]  # head 1's query rows, head 0's input
    assert off_diag.abs().max() > 1e-3


@pytest.mark.parametrize("port_cls", [mig.FusedSharedProjectionAttention, mig.FusedMultiHeadAttention])
def test_shape1_keep_trained_scale_reproduces_the_checkpoint(port_cls):
    # A trained checkpoint learnt its weights around the 1/sqrt(embed_size) scale: ported with
    # keep_trained_scale=True it computes what it computed before, masks included.
    old = randomize_(mig.TutorialMultiHeadAttention(E, H)).double()
    port = port_cls.from_original(old, keep_trained_scale=True).double()
    x, mem = torch.randn(N, L, E, dtype=torch.float64), torch.randn(N, S, E, dtype=torch.float64)
    cases = [(x, x, x, mig.make_trg_mask(N, L)), (mem, mem, x, mig.make_src_mask(LENGTHS, S)),
             (x, x, x, None)]
    for values, keys, query, mask in cases:
        torch.testing.assert_close(port(values, keys, query, mask), old(values, keys, query, mask), rtol=1e-10, atol=1e-10)


def test_mapped_state_dicts_load_into_torch_multihead_attention():
    # The doc's claim: the mapped checkpoints are nn.MultiheadAttention's too.
    x = torch.randn(N, L, E, dtype=torch.float64)
    old1 = randomize_(mig.TutorialMultiHeadAttention(E, H)).double()
    old3 = randomize_(mig.TutorialMultiHeadedAttention(E, H)).double().eval()
    for sd, old_out in [
        (mig.shared_projection_to_mha_state_dict(old1.state_dict(), H, keep_trained_scale=True), old1(x, x, x, None)),
        (mig.multiheaded_to_mha_state_dict(old3.state_dict()),
         mig.ReferenceMultiHeadedAttention.from_original(old3).eval()(x)),
    ]:
        torch_mha = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
        torch_mha.load_state_dict(sd)
        torch.testing.assert_close(torch_mha(x, x, x, need_weights=False)[0], old_out, rtol=1e-10, atol=1e-10)


# --- shape 1 bugs -----------------------------------------------------------------------------

def test_shape1_bug_scale_is_sqrt_embed_size():
    old = randomize_(mig.TutorialMultiHeadAttention(E, H)).double()
    fixed = mig.ReferenceMultiHeadAttention.from_original(old)
    same_scale = mig.ReferenceMultiHeadAttention.from_original(old, scale=1 / math.sqrt(E))
    x, mask = torch.randn(N, L, E, dtype=torch.float64), mig.make_trg_mask(N, L)
    # The only difference from the fixed class (no row fully masked here) is the scale ...
    torch.testing.assert_close(old(x, x, x, mask), same_scale(x, x, x, mask), rtol=1e-12, atol=1e-12)
    assert (old(x, x, x, mask) - fixed(x, x, x, mask)).abs().max() > 1e-2
    # ... which is too small by sqrt(heads): the softmax is flatter (higher entropy).
    q = old.queries(x.reshape(N, L, H, E // H))
    k = old.keys(x.reshape(N, L, H, E // H))
    energy = torch.einsum("nqhd,nkhd->nhqk", q, k)
    entropy = lambda p: -(p * p.log()).sum(-1).mean()  # noqa: E731
    assert entropy((energy / math.sqrt(E)).softmax(-1)) > entropy((energy / math.sqrt(E // H)).softmax(-1))


def test_shape1_bug_fully_masked_query_averages_padding():
    # -1e20 instead of -inf: a query whose keys are all masked gets the plain average of every
    # value, padding included; the fixed class and fusedmha give it 0 (fc_out's bias alone).
    old = randomize_(mig.TutorialMultiHeadAttention(E, H)).double()
    port = mig.FusedSharedProjectionAttention.from_original(old).double()
    mem, x = torch.randn(N, S, E, dtype=torch.float64), torch.randn(N, L, E, dtype=torch.float64)
    mask = mig.make_src_mask(torch.tensor([S, 0]), S)  # batch entry 1: nothing to attend to
    v = old.values(mem.reshape(N, S, H, E // H)).reshape(N, S, E)
    expected_old = old.fc_out(v[1].mean(0)).expand(L, E)
    torch.testing.assert_close(old(mem, mem, x, mask)[1], expected_old)
    torch.testing.assert_close(port(mem, mem, x, mask)[1], old.fc_out.bias.expand(L, E))
    ref = mig.ReferenceMultiHeadAttention.from_original(old)
    torch.testing.assert_close(ref(mem, mem, x, mask)[1], old.fc_out.bias.expand(L, E))


def test_shape1_bug_float16_mask_overflows():
    # -1e20 does not fit in float16: the tutorial class fails on half inputs with a mask.
    old = randomize_(mig.TutorialMultiHeadAttention(E, H)).half()
    x, mask = torch.randn(N, L, E).half(), mig.make_trg_mask(N, L)
    with pytest.raises(RuntimeError, match="overflow"):
        old(x, x, x, mask)
    ref = mig.ReferenceMultiHeadAttention.from_original(old).double()
    for port_cls in (mig.FusedSharedProjectionAttention, mig.FusedMultiHeadAttention):
        port = port_cls.from_original(old)
        assert port(x, x, x, mask).dtype == torch.float16
        torch.testing.assert_close(port(x, x, x, mask).double(), ref(*(t.double() for t in (x, x, x)), mask), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# Shape 2: BERT-style SelfAttention(num_attention_heads, input_size, hidden_size, dropout)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "padding"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shape2_port_matches_reference(dtype, masked, norm_first):
    old = randomize_(mig.TutorialSelfAttention(H, E, E, 0.2))
    kwargs = dict(attention_probs_dropout_prob=0.3, norm_first=norm_first)
    ref = mig.ReferenceSelfAttention(H, E, E, 0.2, **kwargs).double().eval()
    ref.load_state_dict(old.state_dict())
    port = mig.FusedSelfAttention(H, E, E, 0.2, **kwargs).to(dtype).eval()
    port.load_state_dict(old.state_dict())  # the tutorial's keys, unchanged
    mask = padding_attend().long() if masked else None  # 1 = token, 0 = padding
    x = torch.randn(N, S, E)
    grad_out = torch.randn(N, S, E, dtype=torch.float64)
    out, in_grads, p_grads = run(port, (*leaves(x, dtype=dtype), mask), {}, grad_out)
    ref_out, ref_in_grads, ref_p_grads = run(ref, (*leaves(x, dtype=torch.float64), mask), {}, grad_out)
    torch.testing.assert_close(out.double(), ref_out, **tol(dtype))
    assert_all_close(in_grads, ref_in_grads, grad_tol(dtype))
    assert p_grads.keys() == ref_p_grads.keys() == dict(old.named_parameters()).keys()
    assert_all_close(p_grads.values(), ref_p_grads.values(), grad_tol(dtype))


def test_shape2_from_original_keeps_hidden_dropout_and_fixes_attention_dropout():
    old = mig.TutorialSelfAttention(H, E, E, 0.15)
    port = mig.FusedSelfAttention.from_original(old)
    assert port.out_dropout.p == 0.15 and port.attention_probs_dropout_prob == 0.15
    assert mig.FusedSelfAttention.from_original(old, 0.05).attention_probs_dropout_prob == 0.05


# --- shape 2 bugs -----------------------------------------------------------------------------

def test_shape2_bug_eval_unaffected():
    # The hard-coded dropout only acts in training: in eval the tutorial class already computes
    # the corrected function (-10000 vs -inf makes no difference while a row has a token).
    old = randomize_(mig.TutorialSelfAttention(H, E, E, 0.1)).double().eval()
    ref = mig.ReferenceSelfAttention.from_original(old).eval()
    x = torch.randn(N, S, E, dtype=torch.float64)
    for mask in (None, padding_attend().long()):
        torch.testing.assert_close(old(x, mask), ref(x, mask), rtol=1e-12, atol=1e-12)


def test_shape2_bug_residual_needs_input_size_equal_hidden_size():
    old = mig.TutorialSelfAttention(H, 8, E, 0.1)
    with pytest.raises(RuntimeError):
        old(torch.randn(N, S, 8))
    with pytest.raises(ValueError, match="input_size"):
        mig.FusedSelfAttention(H, 8, E, 0.1)


# ---------------------------------------------------------------------------------------------
# Shape 3: MultiHeadedAttention(dmodel, num_heads), forward(x, context=None, mask=None)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["self", "cross", "cross_same_length"])
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "padding"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shape3_port_matches_reference(dtype, masked, attention):
    old = randomize_(mig.TutorialMultiHeadedAttention(E, H, dropout=0.3))
    ref = mig.ReferenceMultiHeadedAttention.from_original(old).double().eval()
    port = mig.FusedMultiHeadedAttention.from_original(old).to(dtype).eval()
    context_len = {"self": L, "cross": S, "cross_same_length": L}[attention]
    x, context = torch.randn(N, L, E), torch.randn(N, context_len, E)
    lengths = torch.tensor([context_len, 4])
    mask = (torch.arange(context_len) < lengths[:, None]).long() if masked else None
    grad_out = torch.randn(N, L, E, dtype=torch.float64)

    def inputs(dt):
        if attention == "self":
            return (*leaves(x, dtype=dt), None, mask)
        return (*leaves(x, context, dtype=dt), mask)

    out, in_grads, p_grads = run(port, inputs(dtype), {}, grad_out)
    ref_out, ref_in_grads, ref_p_grads = run(ref, inputs(torch.float64), {}, grad_out)
    torch.testing.assert_close(out.double(), ref_out, **tol(dtype))
    assert_all_close(in_grads, ref_in_grads, grad_tol(dtype))
    # The state_dict mapping is linear (concatenation): it maps gradients too.
    mapped = mig.multiheaded_to_mha_state_dict(ref_p_grads)
    assert {"mha." + n for n in mapped} == p_grads.keys()
    for name, g in mapped.items():
        torch.testing.assert_close(p_grads["mha." + name].double(), g, **grad_tol(dtype))


# --- shape 3 bugs -----------------------------------------------------------------------------

def test_shape3_bug_transposed_attention():
    old = randomize_(mig.TutorialMultiHeadedAttention(E, H)).double().eval()
    ref = mig.ReferenceMultiHeadedAttention.from_original(old).eval()
    x = torch.randn(N, L, E, dtype=torch.float64)
    assert (old(x) - ref(x)).abs().max() > 1e-2
    # Every value the same vector: attention must return it whatever the weights (each row of
    # probabilities sums to 1); the transposed product scales it by a column sum instead.
    with torch.no_grad():
        old.v_linear.weight.zero_()
        old.out.weight.copy_(torch.eye(E))
        old.out.bias.zero_()
    ref.load_state_dict(old.state_dict())
    expected = old.v_linear.bias.expand(N, L, E)
    torch.testing.assert_close(ref(x), expected)
    assert (old(x) - expected).abs().max() > 1e-2
    # With a context of another length it does not run at all.
    with pytest.raises(RuntimeError):
        old(x, torch.randn(N, S, E, dtype=torch.float64))


def test_shape3_bug_empty_context_gives_nan():
    old = randomize_(mig.TutorialMultiHeadedAttention(E, H)).double().eval()
    port = mig.FusedMultiHeadedAttention.from_original(old).eval()
    x, context = torch.randn(N, L, E, dtype=torch.float64), torch.randn(N, L, E, dtype=torch.float64)
    mask = torch.tensor([[1] * L, [0] * L])  # batch entry 1: no token
    assert old(x, context, mask)[1].isnan().all()
    torch.testing.assert_close(port(x, context, mask)[1], old.out.bias.expand(L, E))


# ---------------------------------------------------------------------------------------------
# Training mode: dropout on the attention probabilities at the configured rate
# ---------------------------------------------------------------------------------------------
#
# Weights chosen so the output shows the dropout mask: zero query/key projections (uniform
# probabilities 1/S), identity value and output projections, and one-hot keys (key s = e_s),
# so output coordinate s of a query is keep[head(s), query, s] / (S * (1 - p)): 0 where the
# probability was dropped, 1 / (S (1 - p)) where it was kept.

DE, DN = 64, 4  # embedding = number of keys; batch


@torch.no_grad()
def reveal_dropout_(module):
    eye = torch.eye(DE)
    if isinstance(module, (mig.FusedSharedProjectionAttention, mig.TutorialMultiHeadAttention)):
        module.queries.weight.zero_()
        module.keys.weight.zero_()
        module.values.weight.copy_(torch.eye(DE // H))
        module.fc_out.weight.copy_(eye)
        module.fc_out.bias.zero_()
    elif isinstance(module, (mig.FusedMultiHeadAttention, mig.FusedMultiHeadedAttention)):
        module.mha.in_proj_weight.copy_(torch.cat([torch.zeros(2 * DE, DE), eye]))
        module.mha.in_proj_bias.zero_()
        module.mha.out_proj.weight.copy_(eye)
        module.mha.out_proj.bias.zero_()
    else:  # BERT-style block: read the context at the input of `dense`
        for lin in (module.query, module.key, module.value):
            lin.weight.zero_()
            lin.bias.zero_()
        module.value.weight.copy_(eye)
    return module


def attention_output(module, keys_onehot):
    """The attention output of one training-mode call (N, L, DE)."""
    if isinstance(module, (mig.FusedSelfAttention, mig.TutorialSelfAttention)):
        seen = []
        handle = module.dense.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        module(keys_onehot)
        handle.remove()
        return seen[0]
    if isinstance(module, mig.FusedMultiHeadedAttention):
        return module(torch.randn(DN, 32, DE), keys_onehot)
    return module(keys_onehot, keys_onehot, torch.randn(DN, 32, DE))


def dropped_fraction(module):
    keys_onehot = torch.eye(DE).expand(DN, DE, DE)
    with torch.no_grad():
        out = attention_output(module.train(), keys_onehot)
    dropped = (out == 0).double().mean().item()
    kept = out[out != 0]
    return dropped, kept, out.numel()


PORTS = {
    "shape1_shared": lambda p: mig.FusedSharedProjectionAttention(DE, H, dropout=p),
    "shape1_mha": lambda p: mig.FusedMultiHeadAttention(DE, H, dropout=p),
    "shape2": lambda p: mig.FusedSelfAttention(H, DE, DE, hidden_dropout_prob=0.0, attention_probs_dropout_prob=p),
    "shape3": lambda p: mig.FusedMultiHeadedAttention(DE, H, dropout=p),
}


@pytest.mark.parametrize("p", [0.0, 0.2, 0.6])
@pytest.mark.parametrize("port", list(PORTS))
def test_training_dropout_at_configured_rate(port, p):
    module = reveal_dropout_(PORTS[port](p))
    dropped, kept, n = dropped_fraction(module)
    assert abs(dropped - p) < 5 * math.sqrt(max(p * (1 - p), 1e-4) / n) + 1e-3, (port, p, dropped)
    # kept probabilities are rescaled by 1 / (1 - p)
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (DE * (1 - p))))
    # eval mode: no dropout at all
    module.eval()
    with torch.no_grad():
        assert (attention_output(module, torch.eye(DE).expand(DN, DE, DE)) != 0).all()


def test_shape2_bug_tutorial_drops_80_percent_whatever_the_config():
    for hidden_dropout_prob in (0.0, 0.1):
        old = reveal_dropout_(mig.TutorialSelfAttention(H, DE, DE, hidden_dropout_prob))
        dropped, _, _ = dropped_fraction(old)
        assert abs(dropped - 0.8) < 0.02, dropped
        port = reveal_dropout_(mig.FusedSelfAttention.from_original(old))
        dropped, _, _ = dropped_fraction(port)
        assert abs(dropped - hidden_dropout_prob) < 0.02, dropped


class FixedDropout(torch.nn.Module):
    """Dropout with a given keep-mask (for the float64 reference)."""

    def __init__(self, keep, p):
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, probs):
        return probs * self.keep / (1 - self.p)


def keep_mask_drawn_after(seed, n, length, s_len, p):
    """The keep-mask fusedmha's kernel draws for one call with dropout p made right after
    torch.manual_seed(seed), on (n, H, length, head_dim) queries and s_len keys: it depends on
    the generator's state and the shapes only."""
    torch.manual_seed(seed)
    q, k = torch.zeros(n, H, length, E // H), torch.zeros(n, H, s_len, E // H)
    _, _, rng = torch.ops.fusedmha.attention_forward(q, k, k, None, p, False)
    return kernel_keep_mask(rng, q, k, p).double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("port", list(PORTS))
def test_training_mode_matches_reference_with_the_kernels_dropout_mask(port, dtype):
    # Training mode, dropout 0.25: with the mask the kernel drew, the port's output and
    # gradients are the reference's (dropout applied to the probabilities, scaled 1/(1-p)).
    p, seed = 0.25, 1234
    src_mask = mig.make_src_mask(LENGTHS, S)
    if port.startswith("shape1"):
        old = randomize_(mig.TutorialMultiHeadAttention(E, H))
        cls = mig.FusedSharedProjectionAttention if port == "shape1_shared" else mig.FusedMultiHeadAttention
        module = cls.from_original(old, dropout=p)
        ref = mig.ReferenceMultiHeadAttention.from_original(old, dropout=p)
        ref.attn_dropout = FixedDropout(keep_mask_drawn_after(seed, N, L, S, p), p)
        values, keys, query = torch.randn(N, S, E), torch.randn(N, S, E), torch.randn(N, L, E)
        inputs = lambda dt: (*leaves(values, keys, query, dtype=dt), src_mask)  # noqa: E731
        out_len = L
    elif port == "shape2":
        old = randomize_(mig.TutorialSelfAttention(H, E, E, 0.0))
        module = mig.FusedSelfAttention.from_original(old, attention_probs_dropout_prob=p)
        ref = mig.ReferenceSelfAttention.from_original(old, attention_probs_dropout_prob=p)
        ref.attn_dropout = FixedDropout(keep_mask_drawn_after(seed, N, S, S, p), p)
        x = torch.randn(N, S, E)
        inputs = lambda dt: (*leaves(x, dtype=dt), padding_attend().long())  # noqa: E731
        out_len = S
    else:
        old = randomize_(mig.TutorialMultiHeadedAttention(E, H, dropout=p))
        module = mig.FusedMultiHeadedAttention.from_original(old)
        ref = mig.ReferenceMultiHeadedAttention.from_original(old)
        ref.dropout = FixedDropout(keep_mask_drawn_after(seed, N, L, S, p), p)
        x, context = torch.randn(N, L, E), torch.randn(N, S, E)
        inputs = lambda dt: (*leaves(x, context, dtype=dt), padding_attend().long())  # noqa: E731
        out_len = L
    module, ref = module.to(dtype).train(), ref.double().train()
    grad_out = torch.randn(N, out_len, E, dtype=torch.float64)
    port_inputs = inputs(dtype)
    torch.manual_seed(seed)
    out, in_grads, p_grads = run(module, port_inputs, {}, grad_out)
    ref_out, ref_in_grads, ref_p_grads = run(ref, inputs(torch.float64), {}, grad_out)
    torch.testing.assert_close(out.double(), ref_out, **tol(dtype))
    assert_all_close(in_grads, ref_in_grads, grad_tol(dtype))
    if port in ("shape1_shared", "shape2"):  # same parameter names
        assert_all_close(p_grads.values(), [ref_p_grads[n] for n in p_grads], grad_tol(dtype))
    elif port == "shape3":
        for name, g in mig.multiheaded_to_mha_state_dict(ref_p_grads).items():
            torch.testing.assert_close(p_grads["mha." + name].double(), g, **grad_tol(dtype))
    # and it did drop something: without dropout the output is another
    with torch.no_grad():
        assert (module.eval()(*port_inputs).double() - ref_out).abs().max() > 1e-3
