"""The cases of fusedmha.MultiheadAttention, against torch.nn.MultiheadAttention with the same
state_dict: valid calls (and fully masked rows, against the float64 reference), training with
dropout, meta, wrong devices, and test_mha_errors.py's fuzz calls perturbed into wrong shapes,
wrong dtypes, empty and non-finite inputs."""

import copy
import warnings
from dataclasses import dataclass

import torch
from torch import nn

import mha_inputs
import test_mha_errors as mha_errors  # (its fuzz calls and outcome comparison)
from reference import MHA_TOL, compare_runs, compare_with_reference

from .case import ENTRY_POINTS, Case, Mismatch, describe, expect, kwargs_text
from .draw import INF, to_meta
from .judge import same_meta_outputs, same_values


MHA_DTYPES = [torch.float32, torch.float32, torch.float64, torch.bfloat16, torch.float16]
MHA_LENGTHS = [1, 1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 33]
# test_mha_errors.fuzz_build's perturbations, by the kind of case they make
MHA_PERTURBATIONS = {
    "wrong_shape": ["q_dim-", "q_dim+", "k_dim-", "v_dim+", "q_E", "k_E", "v_E", "k_S", "v_S", "q_N",
                    "k_N", "v_N", "kpm_S", "kpm_N", "kpm_dim-", "kpm_dim+", "am_L", "am_S",
                    "am_3d_N", "am_1d", "am_4d"],
    "wrong_dtype": ["q_f64", "k_f64", "q_int", "q_bf16", "kpm_int", "kpm_u8", "kpm_f64", "kpm_f16",
                    "am_int", "am_f64", "am_f16"],
    "empty": ["L0", "S0", "N0"],
    "nonfinite": ["nan", "inf", "huge"],
}
MHA_EXTRA_PERTURBATIONS = ["none", "none", "noncontig", "expanded", "causal", "am_expand", "L1S1"]


@dataclass
class MHACall:
    """A fused module and PyTorch's with the same state_dict, and one call to both."""
    ctor: dict
    ref: nn.Module
    mod: nn.Module
    inputs: tuple  # query, key, value (the same tensor object where the call shares them)
    f_kw: dict
    r_kw: dict  # PyTorch's masks: the causal mask given explicitly where fusedmha has is_causal
    masks: str
    dtype: torch.dtype

    def text(self):
        q, k, v = self.inputs
        same = "q=k=v " if q is k and k is v else "k=v " if k is v else ""
        return (f"MultiheadAttention({kwargs_text(self.ctor)}) {'train' if self.mod.training else 'eval'} "
                f"{same}query={describe(q)} key={describe(k)} value={describe(v)} masks={self.masks} "
                f"{kwargs_text(self.f_kw)}")


def draw_mha(rng, g, dtype, *, dropout=0.0, layouts=True, fully_masked=False):
    while True:
        H = rng.choice([1, 1, 2, 3, 4, 8])
        E = H * rng.choice([1, 2, 4, 8, 12, 16])
        N, L, S = rng.randint(1, 4), rng.choice(MHA_LENGTHS), rng.choice(MHA_LENGTHS)
        if N * H * L * S * E <= 60_000:
            break
    kd = vd = E
    ctor = dict(bias=rng.random() < 0.8, add_bias_kv=rng.random() < 0.2,
                add_zero_attn=rng.random() < 0.2, batch_first=rng.random() < 0.5, dropout=dropout)
    if rng.random() < 0.3:
        kd, vd = rng.choice([1, 3, E, E + 5]), rng.choice([2, E, E + 3])
        ctor.update(kdim=kd, vdim=vd)
    batched = rng.random() < 0.85
    ref, mod = mha_inputs.make_pair(E, H, dtype=dtype, **ctor)
    train = dropout > 0 or rng.random() < 0.3  # training with p = 0: PyTorch's slow path
    ref.train(train)
    mod.train(train)
    kind = rng.choice(mha_inputs.MASK_KINDS)
    f_kw, r_kw = mha_inputs.make_masks(kind, N, H, L, S, dtype, batched)
    if fully_masked:  # masks of our own, where some query rows see no key at all
        kind = "fully_masked"
        f_kw = {}
        if rng.random() < 0.6:
            kpm = torch.rand((N, S) if batched else (S,), generator=g) < 0.4
            kpm[..., 0] = rng.random() < 0.5
            f_kw["key_padding_mask"] = kpm
        am = torch.rand((L, S) if rng.random() < 0.5 else ((N if batched else 1) * H, L, S), generator=g) < 0.5
        am[..., rng.randrange(L), :] = True
        f_kw["attn_mask"] = am if rng.random() < 0.6 else torch.zeros(am.shape, dtype=dtype).masked_fill(am, -INF)
        r_kw = dict(f_kw)
    weights = rng.choice([dict(need_weights=False), dict(), dict(average_attn_weights=False)])
    f_kw.update(weights)
    r_kw.update(weights)
    x = mha_inputs.make_inputs(N, L, S, E, kd, vd, dtype, batched, ctor["batch_first"])
    pattern = rng.choice(["distinct"] * 3 + ["k=v", "q=k=v"])
    if layouts and rng.random() < 0.3:  # the same values through other strides
        x = tuple(t.transpose(0, -1).contiguous().transpose(0, -1) if rng.random() < 0.5 else t for t in x)
    if pattern == "q=k=v" and L == S and kd == vd == E:
        x = (x[0], x[0], x[0])
    elif pattern in ("k=v", "q=k=v") and kd == vd:
        x = (x[0], x[1], x[1])
    return MHACall(ctor, ref, mod, x, f_kw, r_kw, kind, dtype)


def shared_leaves(inputs):
    """Leaves for the inputs, one per distinct tensor (shared as the call shares them)."""
    made = {}
    return tuple(made.setdefault(id(t), t.detach().clone().requires_grad_()) for t in inputs)


def mha_same_outcome(spec):
    """test_mha_errors.py's fuzz case `spec` (both modules, the outcome compared); the fused
    module's exception, if it raised."""
    ctor, args, kw = mha_errors.fuzz_build(spec)
    ref, mod = mha_errors.make_pair(mha_errors.E, mha_errors.H, **ctor)
    mod.train(spec["training"])
    ref.train(spec["training"])
    if mha_errors.known_difference(spec, kw):  # is_causal without a mask: the test's own rule
        mha_errors.test_fuzz_like_pytorch(spec)
        try:
            mod(*args, **kw)
        except Exception as e:  # noqa: BLE001
            return e
        return None
    _, exc = mha_errors.torch_outcome(lambda: ref(*args, **kw))
    masks = [kw.get(n) for n in ("attn_mask", "key_padding_mask")]
    if exc is None and any(m is not None and m.is_floating_point() and m.dtype != args[0].dtype
                           and torch.promote_types(m.dtype, args[0].dtype) == m.dtype for m in masks):
        # A float mask of higher precision than the query: an error (docs/differences.md), where PyTorch
        # takes it on some paths (and refuses it on others)
        try:
            mod(*args, **kw)
        except RuntimeError as e:
            expect("or lower precision" in str(e), f"not the mask precision error: {e}")
            return e
        raise Mismatch("a float mask of higher precision than the query was taken")
    # NaN/inf inputs: PyTorch's fused CPU kernel may return finite values where the exact
    # result is NaN (docs/differences.md); huge ones (q x 1e30) make scores whose rounding alone (1e23)
    # flips the softmax, so no two implementations agree. Only the outcome and shapes are
    # compared; the sdpa and op cases check non-finite values against the float64 reference.
    nonfinite = any(p in ("nan", "inf", "huge") for p in spec["perturb"])
    return mha_errors.assert_same_outcome(ref, mod, args, kw,
                                          compare_values=not (mha_errors.wrong_hint(kw) or nonfinite))


def names_the_module(exc, required):
    """The message of a fused module's error names the module (when `required`), and never
    another entry point."""
    if exc is None:
        return
    text = str(exc)
    named = [n for n in ("fusedmha.attention_forward", "fusedmha.scaled_dot_product_attention",
                         "fusedmha._multihead_attention_core", "fusedmha.attention_backward")
             if n + ":" in text]
    if named:
        raise Mismatch(f"the error names {named[0]}, not fusedmha.MultiheadAttention: {text}")
    if required:
        expect("fusedmha.MultiheadAttention:" in text,
               f"the error does not name fusedmha.MultiheadAttention: {type(exc).__name__}({text})")


def gen_mha(rng, g, kind, seed):
    entry = "MultiheadAttention"
    dtype = rng.choice(MHA_DTYPES)

    if kind == "valid":
        fully_masked = dtype in MHA_TOL["cpu"] and rng.random() < 0.15
        c = draw_mha(rng, g, dtype, fully_masked=fully_masked)
        grads = rng.random() < 0.6

        def run():
            if fully_masked:  # PyTorch gives NaN there: the float64 reference instead
                return compare_with_reference(c.mod, c.inputs, c.f_kw, name=c.masks, tol=MHA_TOL["cpu"][dtype])
            f_in, r_in = shared_leaves(c.inputs), shared_leaves(c.inputs)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compare_runs(c.mod, c.ref, f_in, r_in, c.f_kw, c.r_kw, dtype, grads=grads)
        return Case(entry, kind, c.text() + (" +backward" if grads else ""), run)

    if kind == "train":  # dropout: shapes, finite, and the same result for the same seed
        c = draw_mha(rng, g, dtype, dropout=rng.choice([0.1, 0.5, 0.9]))

        def run():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                want = c.ref(*c.inputs, **c.r_kw)
                results = []
                for _ in range(2):
                    torch.manual_seed(seed)
                    f_in = shared_leaves(c.inputs)
                    out, w = c.mod(*f_in, **c.f_kw)
                    grads = torch.autograd.grad(out.float().sum() + (0 if w is None else w.float().sum()),
                                                list(dict.fromkeys(f_in)) + list(c.mod.parameters()),
                                                allow_unused=True)
                    results.append((out, w, grads))
            return want, results

        def check(r):
            (out_r, w_r), ((out, w, grads), (out2, w2, grads2)) = r
            expect(out.shape == out_r.shape and out.dtype == out_r.dtype,
                   f"output {describe(out)}, PyTorch's {describe(out_r)}")
            expect((w is None) == (w_r is None), "weights returned by one module only")
            if w is not None:
                expect(w.shape == w_r.shape and w.dtype == w_r.dtype, f"weights {describe(w)}, PyTorch's {describe(w_r)}")
                expect(same_values(w, w2), "weights differ for the same seed")
                expect(bool(torch.isfinite(w).all()), "weights not finite")
            expect(bool(torch.isfinite(out).all()), "output not finite")
            expect(same_values(out, out2), "output differs for the same seed")
            for a, b in zip(grads, grads2):
                expect((a is None) == (b is None) and (a is None or same_values(a, b)),
                       "gradients differ for the same seed")
                expect(a is None or bool(torch.isfinite(a).all()), "gradient not finite")
        return Case(entry, kind, c.text() + f" seed {seed}", run, check)

    if kind == "meta":  # the module and its inputs on the meta device
        c = draw_mha(rng, g, dtype, layouts=False)
        c.mod.eval()
        meta = copy.deepcopy(c.mod).to("meta")

        def run():
            with torch.no_grad():
                made = {}
                inputs = [made.setdefault(id(t), to_meta(t)) for t in c.inputs]
                return c.mod(*c.inputs, **c.f_kw), meta(*inputs, **to_meta(c.f_kw))
        return Case(entry, kind, c.text(), run, check=lambda r: same_meta_outputs(*r))

    if kind == "wrong_device":
        c = draw_mha(rng, g, dtype, layouts=False)
        options = ["query", "key", "value"] + [n for n in ("attn_mask", "key_padding_mask") if n in c.f_kw]
        what = rng.choice(options)
        inputs = list(c.inputs)
        f_kw, r_kw = dict(c.f_kw), dict(c.r_kw)
        if what in f_kw:
            f_kw[what] = f_kw[what].to("meta")  # PyTorch takes it; fusedmha must refuse, named
            error = dict(names=ENTRY_POINTS[entry], types=(RuntimeError,))
            return Case(entry, kind, f"{what} on meta: {c.text()}", lambda: c.mod(*inputs, **f_kw),
                        error=error, tags={"mha_error_names_attention_forward"})
        i = ["query", "key", "value"].index(what)
        inputs = [t.to("meta") if t is inputs[i] else t for t in inputs]

        def run():  # the exception PyTorch raises
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    c.ref(*inputs, **r_kw)
                except Exception as e:  # noqa: BLE001
                    want = e
                else:  # PyTorch accepts it: fusedmha may too, or refuse in its own name
                    try:
                        c.mod(*inputs, **f_kw)
                    except Exception as e:  # noqa: BLE001
                        names_the_module(e, True)
                    return None
                try:
                    c.mod(*inputs, **f_kw)
                except type(want) as e:
                    return e
                except Exception as e:  # noqa: BLE001
                    raise Mismatch(f"PyTorch raises {type(want).__name__}({want}); fused raises "
                                   f"{type(e).__name__}({e})") from e
                raise Mismatch(f"PyTorch raises {type(want).__name__}({want}); fused raises nothing")
        return Case(entry, kind, f"{what} on meta: {c.text()}", run,
                    check=lambda e: names_the_module(e, False))

    # wrong_shape, wrong_dtype, empty, nonfinite: test_mha_errors.py's fuzz call, perturbed
    perturb = {rng.choice(MHA_PERTURBATIONS[kind])}
    if rng.random() < 0.5:
        perturb.add(rng.choice(MHA_EXTRA_PERTURBATIONS))
    spec = dict(batched=rng.random() < 0.8, batch_first=rng.random() < 0.5, kvdiff=rng.random() < 0.3,
                add_bias_kv=rng.random() < 0.25, add_zero_attn=rng.random() < 0.25, bias=rng.random() < 0.8,
                need_weights=rng.random() < 0.6, average=rng.random() < 0.6, training=rng.random() < 0.5,
                kpm=rng.choice([None, None, "bool", "float"]),
                am=rng.choice([None, None, "2d_bool", "2d_float", "3d_bool", "3d_float"]),
                perturb=sorted(perturb), seed=seed % 2 ** 31)
    return Case(entry, kind, f"test_mha_errors.fuzz_build({spec})", lambda: mha_same_outcome(spec),
                check=lambda e: names_the_module(e, False))
